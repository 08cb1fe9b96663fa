"""What a loading rank reads of a saved chunk: :class:`ResolvedChunk`, the per-load :class:`MetaCache`, block arithmetic (torch-free).

The shared interface between the format layer and the load engine.
``_format.resolve_chunks`` (in ``_v2``, which reads the index files) turns an
opened manifest, the storage, a tensor name and the boxes a rank wants into
``ResolvedChunk`` records, each with where its bytes are and how to verify
any range of them:

* format v1: the manifest's chunk list; one CRC-32C per chunk
  (``block_bytes == 0``: a reader must read and check the whole chunk);
* format v2/v3: chunks of regular layouts are derived from the tensor's layout
  record (``_plan.chunks_overlapping``) and located in the index file of the
  rank that wrote them; the index also carries each chunk's block checksums
  (``block_bytes`` each, chunk-relative, the last block short), so any
  block-aligned range verifies on its own. Each index read is checked against
  the size and CRC the (checksummed) manifest records for it.

Index files are read once per :class:`MetaCache`: keep one cache for one load.
This module imports nothing of the format's own, so ``_v2`` can build on it.
"""

from __future__ import annotations

import threading
from dataclasses import dataclass, field
from typing import Any, Dict, Optional, Sequence, Tuple

from .checksum import crc32c_combine

__all__ = ["ResolvedChunk", "MetaCache", "block_span", "chunk_blocks_crc"]


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
    """Metadata read during one load (parsed index files); thread-safe.

    ``bytes_read`` counts the metadata bytes fetched through it (index files), for
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
