"""Which saved bytes a loading rank reads: the one chunk resolver, v1 and v2 (torch-free).

The shared interface between the format layer and the load engine. Given an
opened manifest, the storage, a tensor name and the boxes a rank wants,
:func:`resolve_chunks` returns the saved chunks to read, each with where its
bytes are and how to verify any range of them:

* format v1: the manifest's chunk list; one CRC-32C per chunk (no block
  checksums: a reader must read and check the whole chunk);
* format v2/v3: chunks of regular layouts are derived from the tensor's layout
  record (``_geometry.chunks_overlapping``) and located in the index file of the
  rank that wrote them; the index row also carries the chunk's block
  checksums (``block_bytes`` each, chunk-relative, the last block short), so
  any block-aligned range verifies on its own. Each index read is checked
  against the CRC the (checksummed) manifest records for it;
* a manifest whose chunk lists are already filled in (v1, Hugging Face
  sources, ``materialize``-d v2): those lists, and no storage is needed.

Every chunk comes back as the one :class:`~shardckpt._format.chunk.Chunk`
the reader, the read-once exchange and the copy into tensors take.

Index files are read once per :class:`MetaCache` (defined in ``chunk``, which
``_v2`` takes it from; re-exported here): keep one cache for one load.
"""

from __future__ import annotations

from typing import Any, List, Optional, Sequence, Tuple

from . import _v2
from ._v2 import Reads
from .chunk import Chunk, MetaCache

__all__ = ["Chunk", "MetaCache", "Reads", "resolve_chunks", "resolve_many", "resolve_reads"]


def resolve_chunks(
    manifest: Any,
    storage: Optional[Any],
    name: str,
    boxes: Sequence[Tuple[Sequence[int], Sequence[int]]],
    *,
    cache: Optional[MetaCache] = None,
) -> List[Chunk]:
    """The saved chunks of tensor ``name`` that overlap any of ``boxes``, each once, by offsets.

    Args:
        manifest: from ``open_manifest(..., chunks=False)`` (or any opened manifest).
        storage: the checkpoint's storage (v2/v3 read the index files involved); may
            be None when the manifest's chunk lists are filled in.
        name: a tensor of ``manifest.tensors``.
        boxes: ``(offsets, sizes)`` in global coordinates, as the rank wants them.
        cache: metadata read so far in this load (a new one when None).

    Raises:
        KeyError: ``name`` is not in the manifest.
        CorruptCheckpointError / UnsafeMetadataError: a header read for v2 is
            damaged (its CRC differs from the manifest's), lacks the chunk, or
            disagrees with the manifest.

    Example:
        >>> cs = resolve_chunks(m, storage, "w", [((0, 0), (4, 8))])   # doctest: +SKIP
        >>> [(c.file, c.byte_offset, c.nbytes, c.block_bytes) for c in cs]   # doctest: +SKIP
    """
    cache = cache if cache is not None else MetaCache()
    return _v2.resolve(manifest, storage, name, boxes, cache)


def resolve_many(
    manifest: Any,
    storage: Optional[Any],
    wants: Sequence[Tuple[str, Sequence[Tuple[Sequence[int], Sequence[int]]]]],
    *,
    cache: Optional[MetaCache] = None,
) -> List[List[Chunk]]:
    """:func:`resolve_chunks` for many ``(name, boxes)`` at once, in order: the same chunks and checks.

    What a load of a large state calls: the geometry (which saved boxes meet
    the wanted ones, which rank wrote them) is computed once per distinct
    layout and boxes, not once per tensor.

    Raises:
        KeyError / CorruptCheckpointError / UnsafeMetadataError: as :func:`resolve_chunks`.

    Example:
        >>> [cs] = resolve_many(m, storage, [("w", [((0, 0), (4, 8))])])   # doctest: +SKIP
    """
    cache = cache if cache is not None else MetaCache()
    return _v2.resolve_many(manifest, storage, wants, cache)


def resolve_reads(
    manifest: Any,
    storage: Optional[Any],
    wants: Sequence[Tuple[str, Sequence[Tuple[Sequence[int], Sequence[int]]]]],
    *,
    cache: Optional[MetaCache] = None,
) -> List[Reads]:
    """:func:`resolve_many` with the read pieces: per ``(name, boxes)``, its chunks and the pieces filling each box.

    What a load plan takes (``_load.plan``): ``Reads(chunks, pieces)``, with
    ``pieces[j]`` = ``_geometry.plan_box_reads(<the chunks' boxes>, boxes[j])``
    (pieces index ``chunks``). The tensors of one layout, rotation and wanted
    boxes share one planned tuple of pieces, so a 50,000-tensor state plans
    its pieces a few dozen times, not once per tensor.

    Raises:
        KeyError / CorruptCheckpointError / UnsafeMetadataError: as
            :func:`resolve_chunks`; CorruptCheckpointError also when the
            chunks do not cover a wanted box.

    Example:
        >>> [r] = resolve_reads(m, storage, [("w", [((0, 0), (4, 8))])])   # doctest: +SKIP
        >>> r.chunks, r.pieces[0]   # doctest: +SKIP
    """
    cache = cache if cache is not None else MetaCache()
    return _v2.resolve_reads(manifest, storage, wants, cache)
