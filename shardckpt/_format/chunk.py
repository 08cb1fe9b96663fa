"""The one chunk type of the read path: a saved chunk, where its bytes are and how they are checked (torch-free).

A *chunk* is one stored box of a global tensor (one safetensors entry). The
manifest records chunks as :class:`~shardckpt._format.manifest.ChunkMeta`
(the JSON row, mutable, as parsed). Everything that reads chunk bytes works on
:class:`Chunk` instead, one frozen value from resolution to the copy into a
tensor:

* ``_format.resolve.resolve_chunks`` produces them (v1 manifests, v2/v3 index
  files, manifests whose chunk lists are filled in: Hugging Face sources,
  renamed or keyed loads);
* ``_readers`` plans and verifies reads of them (:meth:`Chunk.unit_bounds`);
* ``_replicas`` keys shared byte ranges by them;
* ``_load`` copies their bytes into tensors; ``_verify`` re-reads every one;
  the converters read their sources' chunks through them.

Words: a *block* is only ever the checksum block — ``block_bytes`` of a chunk,
each with its own CRC-32C (format v2/v3; the last block of a chunk may be
short). A read of several blocks or chunks is a *range*; what the reader asks
storage for at once is a *read piece*; memory a range is read into is a
*buffer*.

Extending: a new field goes at the end with a default, and
:meth:`Chunk.from_meta` copies it from the manifest row — nothing else
constructs a chunk from a manifest row. A chunk whose bytes live in a sibling
checkpoint (format v4) needs no field: its ``file`` is the reference path
(``@<dir>/<path>``) that the storage of ``_format.refs.follow`` reads.

:class:`MetaCache` (the metadata one load reads while resolving chunks) lives
here too, below both ``_format.resolve`` and ``_format._v2``, which share it.
"""

from __future__ import annotations

import threading
from dataclasses import dataclass, field
from itertools import repeat
from typing import Any, Dict, Iterable, List, NamedTuple, Optional, Tuple

__all__ = ["Chunk", "MetaCache", "chunk_of", "chunks_of"]


class Chunk(NamedTuple):
    """One saved chunk to read: its bytes in ``file`` and their checksums (an immutable value).

    Attributes:
        file: the data file, relative to the checkpoint root.
        byte_offset, nbytes: where the chunk's bytes lie in ``file``.
        offsets, sizes: the chunk's box in the global tensor.
        crc32c: CRC-32C of the whole chunk (v1 records one per chunk; v2/v3
            index rows too). None: the source has none (Hugging Face files)
            or the reader is to check blocks only.
        block_bytes, block_crcs: format v2/v3: ``block_crcs[i]`` is the CRC-32C
            of chunk bytes ``[i * block_bytes, min((i + 1) * block_bytes, nbytes))``;
            ``block_bytes`` 0 and ``block_crcs`` empty: no block checksums.
        tensor, key: the tensor it belongs to and its safetensors key (for
            messages, :attr:`label`).
        content_hash: format v4: the hex digest of the chunk's bytes (in the
            manifest's ``content_hash`` algorithm); "" when none.

    A ``NamedTuple``: equal chunks hash alike, and a load of 50,000 tensors
    builds its chunks by C-level maps (:func:`chunks_of`, ~1 us a chunk;
    a frozen dataclass's instance dict cost ~3 us). Not to be iterated or
    compared with plain tuples by callers: use the attributes.

    How a reader verifies it (:meth:`unit_bounds`): by blocks when it has
    block checksums, else whole against ``crc32c``, else (no checksum at all)
    the bytes are read unchecked.

    Example:
        >>> c = Chunk("f", 0, 10, (0,), (10,), block_bytes=4, block_crcs=(1, 2, 3), tensor="w", key="w")
        >>> c.unit_bounds(5, 6), c.label
        ((4, 8), "w chunk 'w'")
    """

    file: str
    byte_offset: int
    nbytes: int
    offsets: Tuple[int, ...] = ()
    sizes: Tuple[int, ...] = ()
    crc32c: Optional[int] = None
    block_bytes: int = 0
    block_crcs: Tuple[int, ...] = ()
    tensor: str = ""
    key: str = ""
    content_hash: str = ""

    @property
    def blocked(self) -> bool:
        """Whether the chunk is checked block by block (else whole, or not at all)."""
        return self.block_bytes > 0 and bool(self.block_crcs)

    @property
    def checked(self) -> bool:
        """Whether a reader verifies this chunk's bytes at all."""
        return self.blocked or self.crc32c is not None

    @property
    def label(self) -> str:
        """How messages name it: ``"layer.w chunk 'layer.w/0'"``."""
        if self.key:
            return f"{self.tensor} chunk {self.key!r}"
        return self.tensor or f"{self.file}@{self.byte_offset}"

    def unit_bounds(self, start: int, stop: int) -> Tuple[int, int]:
        """Chunk bytes ``[start, stop)`` rounded out to what can be verified alone.

        Whole blocks when the chunk has block checksums, the whole chunk when
        it has one checksum, ``[start, stop)`` itself when it has none.
        """
        if self.blocked:
            b = self.block_bytes
            return (start // b) * b, min(self.nbytes, -(-stop // b) * b)
        if self.crc32c is not None:
            return 0, self.nbytes
        return start, stop

    @classmethod
    def from_meta(cls, tensor: str, meta: Any, block_bytes: int) -> "Chunk":
        """The chunk a manifest row (``ChunkMeta``) describes; ``block_bytes``: the manifest's (0 for v1).

        The one conversion from the manifest's record: its block CRCs (v2/v3
        rows read from an index file) are kept only with a block size.

            >>> from shardckpt._format import ChunkMeta
            >>> Chunk.from_meta("w", ChunkMeta("f", "w", [0], [4], 8, 16, 7), 0).unit_bounds(1, 2)
            (0, 16)
        """
        blocks = tuple(meta.blocks) if block_bytes > 0 and meta.blocks is not None else ()
        return cls(
            file=meta.file,
            byte_offset=meta.byte_offset,
            nbytes=meta.nbytes,
            offsets=tuple(meta.offsets),
            sizes=tuple(meta.sizes),
            crc32c=meta.crc32c,
            block_bytes=block_bytes if blocks else 0,
            block_crcs=blocks,
            tensor=tensor,
            key=meta.key,
            content_hash=meta.hash or "",
        )


_FIELDS = ("file", "byte_offset", "nbytes", "offsets", "sizes", "crc32c", "block_bytes", "block_crcs", "tensor", "key", "content_hash")
assert Chunk._fields == _FIELDS, "chunk_of must set every field of Chunk"
_new = tuple.__new__


def chunk_of(file: str, byte_offset: int, nbytes: int, offsets: Tuple[int, ...], sizes: Tuple[int, ...], crc32c: Optional[int],
             block_bytes: int, block_crcs: Tuple[int, ...], tensor: str, key: str, content_hash: str) -> Chunk:
    """``Chunk(...)`` of every field, positionally, without the keyword-matching ``__new__``.

    The same value (equal, same hash): a load of a 50,000-tensor state builds
    one per tensor. Arguments are not checked (the callers pass values
    already checked, as for ``Chunk``).

        >>> chunk_of("f", 0, 4, (0,), (1,), 7, 0, (), "w", "w", "") == Chunk("f", 0, 4, (0,), (1,), 7, tensor="w", key="w")
        True
    """
    return _new(Chunk, (file, byte_offset, nbytes, offsets, sizes, crc32c, block_bytes, block_crcs, tensor, key, content_hash))


def chunks_of(count: int, columns: Iterable[Tuple[Any, ...]]) -> List[Chunk]:
    """:func:`chunk_of` of each of ``count`` field tuples (``Chunk``'s fields in order), with no Python call per chunk.

    The tuples are made by one C-level ``map``: a load of 50,000 tensors
    builds its chunks in one pass. ``count`` is checked against what
    ``columns`` yields.

        >>> chunks_of(1, [("f", 0, 4, (0,), (1,), 7, 0, (), "w", "w", "")]) == [chunk_of("f", 0, 4, (0,), (1,), 7, 0, (), "w", "w", "")]
        True
    """
    out = list(map(_new, repeat(Chunk), columns))
    if len(out) != count:
        raise ValueError(f"chunks_of: {len(out)} chunks from the columns, {count} expected")
    if out and len(out[0]) != len(_FIELDS):
        raise ValueError(f"chunks_of: {len(out[0])} fields a chunk, {len(_FIELDS)} expected")
    return out


@dataclass
class MetaCache:
    """Metadata read during one load (parsed data file headers); thread-safe.

    ``bytes_read`` counts the metadata bytes fetched through it (headers), for
    ``load_meta_mb`` figures and tests.
    """

    headers: Dict[str, Any] = field(default_factory=dict)
    bytes_read: int = 0
    lock: threading.Lock = field(default_factory=threading.Lock, repr=False)
