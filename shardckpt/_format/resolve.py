"""Which saved bytes a loading rank reads: the one chunk resolver, v1 and v2 (torch-free).

The shared interface between the format layer and the load engine. Given an
opened manifest, the storage, a tensor name and the boxes a rank wants,
:func:`resolve_chunks` returns the saved chunks to read, each with where its
bytes are and how to verify any range of them:

* format v1: the manifest's chunk list; one CRC-32C per chunk
  (``block_bytes == 0``: a reader must read and check the whole chunk);
* format v2: chunks of regular layouts are derived from the tensor's layout
  record (``_plan.chunks_overlapping``) and located in the safetensors header
  of the files of the rank that wrote them; the header also carries the
  chunk's block checksums (``block_bytes`` each, chunk-relative, the last
  block short), so any block-aligned range verifies on its own. Each header
  read is checked against the CRC the (checksummed) manifest records for it.

Headers are read once per :class:`MetaCache`: keep one cache for one load.
"""

from __future__ import annotations

import threading
from dataclasses import dataclass, field
from typing import Any, Dict, List, Optional, Sequence, Tuple

from .checksum import crc32c_combine

__all__ = ["ResolvedChunk", "MetaCache", "resolve_chunks", "block_span", "chunk_blocks_crc"]


@dataclass(frozen=True)
class ResolvedChunk:
    """A saved chunk to read: its bytes in ``file`` and their checksums.

    ``block_bytes`` 0 means one checksum for the whole chunk (``crc32c``; v1):
    read it whole. Otherwise ``block_crcs[i]`` is the CRC-32C of chunk bytes
    ``[i * block_bytes, min((i + 1) * block_bytes, nbytes))``. ``crc32c`` is
    None only for foreign sources without checksums (Hugging Face files).
    """

    name: str
    key: str
    file: str
    byte_offset: int
    nbytes: int
    offsets: Tuple[int, ...]
    sizes: Tuple[int, ...]
    crc32c: Optional[int]
    block_bytes: int = 0
    block_crcs: Tuple[int, ...] = ()


@dataclass
class MetaCache:
    """Metadata read during one load (parsed data file headers); thread-safe.

    ``bytes_read`` counts the metadata bytes fetched through it (headers), for
    ``load_meta_mb`` figures and tests.
    """

    headers: Dict[str, Any] = field(default_factory=dict)
    bytes_read: int = 0
    lock: threading.Lock = field(default_factory=threading.Lock, repr=False)


def block_span(c: ResolvedChunk, lo: int, hi: int) -> Tuple[int, int, int]:
    """The chunk-relative byte range to read so that ``[lo, hi)`` can be verified, and its first block.

    Returns ``(start, stop, first_block)``: ``[lo, hi)`` widened to block
    boundaries (the whole chunk when ``block_bytes`` is 0).

    >>> c = ResolvedChunk("w", "w", "f", 0, 10, (0,), (10,), 0, 4, (1, 2, 3))
    >>> block_span(c, 5, 6)
    (4, 8, 1)
    """
    if not 0 <= lo <= hi <= c.nbytes:
        raise ValueError(f"range [{lo}, {hi}) outside chunk {c.key!r} of {c.nbytes} bytes")
    if c.block_bytes <= 0:
        return 0, c.nbytes, 0
    b = c.block_bytes
    first = lo // b
    stop = min(c.nbytes, -(-hi // b) * b) if hi > lo else first * b
    return first * b, stop, first


def chunk_blocks_crc(block_crcs: Sequence[int], nbytes: int, block_bytes: int) -> int:
    """The whole chunk's CRC-32C from its block CRCs (what v1 records per chunk)."""
    crc = 0
    for i, b in enumerate(block_crcs):
        crc = crc32c_combine(crc, b, min(block_bytes, nbytes - i * block_bytes))
    return crc


def resolve_chunks(
    manifest: Any,
    storage: Any,
    name: str,
    boxes: Sequence[Tuple[Sequence[int], Sequence[int]]],
    *,
    cache: Optional[MetaCache] = None,
) -> List[ResolvedChunk]:
    """The saved chunks of tensor ``name`` that overlap any of ``boxes``, each once, by offsets.

    Args:
        manifest: from ``open_manifest(..., chunks=False)`` (or any opened manifest).
        storage: the checkpoint's storage (v2 reads headers of the files involved).
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
    from . import _v2

    cache = cache if cache is not None else MetaCache()
    return _v2.resolve(manifest, storage, name, boxes, cache)
