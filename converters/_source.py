"""What a conversion reads and writes, and how it is cut into blocks: pure, no I/O beyond opening a manifest.

A *source* is a set of tensors whose bytes lie in byte ranges of files:
native shardckpt chunks (format v1 or v2), safetensors entries, DCP items,
``torch.save`` records. Each importer describes its input as a
:class:`Source`; :func:`plan_blocks` cuts a range of a tensor's elements into
blocks of bounded bytes, each a list of byte runs of its chunks; an
:class:`OutEntry` is a range of a source tensor's elements that goes into
an output file. The reading and writing happen in ``_common``, through the
engine.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import Any, Callable, Dict, List, NamedTuple, Optional, Tuple

import torch

from shardckpt._format import ChunkMeta, Manifest, itemsize, open_manifest
from shardckpt._format.refs import follow
from shardckpt._format.versions import spec
from shardckpt._geometry import Box, split_box
from shardckpt._storage import Storage
from shardckpt.errors import CorruptCheckpointError

__all__ = [
    "BLOCK_BYTES", "SrcChunk", "SrcTensor", "Source", "Seg", "Block", "OutEntry",
    "source_from_manifest", "open_checkpoint", "plan_blocks", "whole_entry", "block_bytes_for",
]

#: Bytes per streamed block (and of the reader's buffers per output file):
#: with two blocks in flight per file this sets the memory a conversion needs.
BLOCK_BYTES = 16 << 20


@dataclass
class SrcChunk:
    """A box of a source tensor and where its bytes are.

    ``blocks`` (format v2): the CRC-32C of each ``block_bytes`` slice, so
    every piece is verified as it is read. Otherwise ``check`` is
    ``(algorithm, value)`` for the whole chunk (``"crc32c"`` for v1,
    ``"crc32"`` for zip records), checked once it is all read, or ``None``
    (no checksum). ``loader``, when set, materializes the chunk (a
    contiguous tensor of the box) for data that is not one byte range.
    """

    file: str
    byte_offset: int
    nbytes: int
    offsets: Tuple[int, ...]
    sizes: Tuple[int, ...]
    key: str
    check: Optional[Tuple[str, int]] = None
    loader: Optional[Callable[[], torch.Tensor]] = None
    block_bytes: int = 0
    blocks: Tuple[int, ...] = ()


@dataclass
class SrcTensor:
    name: str
    dtype: str  # safetensors dtype name
    shape: Tuple[int, ...]
    chunks: List[SrcChunk]
    layout: Optional[Dict[str, Any]] = None

    @property
    def numel(self) -> int:
        return math.prod(self.shape)

    @property
    def nbytes(self) -> int:
        return self.numel * itemsize(self.dtype)

    @property
    def row(self) -> int:
        """Elements per dim-0 row (1 for 0-d and 1-d tensors)."""
        return math.prod(self.shape[1:]) if self.shape else 1

    @property
    def flat(self) -> bool:
        """Chunks split dim 0 only: the tensor's bytes are its chunks' bytes in order."""
        return len(self.shape) <= 1 or all(tuple(c.sizes[1:]) == tuple(self.shape[1:]) for c in self.chunks if math.prod(c.sizes))


@dataclass
class Source:
    """Tensors to convert, their plain values (JSON tree with refs) and where they live."""

    url: str
    storage: Storage
    tensors: Dict[str, SrcTensor]
    values: Any = None
    world_size: int = 1
    kind: str = "native"
    extra: Dict[str, Any] = field(default_factory=dict)
    files: Optional[Dict[str, int]] = None  # file -> expected size, checked before reading

    @property
    def total_bytes(self) -> int:
        return sum(t.nbytes for t in self.tensors.values())


def _src_chunk(c: ChunkMeta, block_bytes: int) -> SrcChunk:
    blocks = tuple(c.blocks) if c.blocks is not None and block_bytes else ()
    return SrcChunk(
        file=c.file,
        byte_offset=c.byte_offset,
        nbytes=c.nbytes,
        offsets=tuple(c.offsets),
        sizes=tuple(c.sizes),
        key=c.key,
        check=None if c.crc32c is None or blocks else ("crc32c", c.crc32c),
        block_bytes=block_bytes if blocks else 0,
        blocks=blocks,
    )


def source_from_manifest(storage: Storage, m: Manifest) -> Source:
    """The tensors of an opened manifest (chunks filled in: v1, v2, or a safetensors directory)."""
    tensors = {}
    for name in sorted(m.tensors):
        t = m.tensors[name]
        bb = m.block_bytes if spec(m.version).block_checksums else 0
        tensors[name] = SrcTensor(name=name, dtype=t.dtype, shape=tuple(t.shape), chunks=[_src_chunk(c, bb) for c in t.chunks], layout=t.layout)
    kind = m.extra.get("source", "native") if isinstance(m.extra, dict) else "native"
    return Source(
        url=storage.url,
        storage=storage,
        tensors=tensors,
        values=m.values,
        world_size=m.world_size,
        kind=kind,
        extra=dict(m.extra or {}),
        files={rel: f.size for rel, f in m.data_files.items()},
    )


def open_checkpoint(url: str, storage_options: Optional[Dict[str, Any]] = None) -> Source:
    """A shardckpt checkpoint (v1 or v2), a safetensors directory, or one ``.safetensors`` file."""
    storage = follow(Storage(url, storage_options=storage_options))  # format v4 references
    return source_from_manifest(storage, open_manifest(storage))


# --------------------------------------------------------------------------
# block planning (pure)


class Seg(NamedTuple):
    chunk: int  # index into SrcTensor.chunks
    pos: int  # byte offset inside the chunk
    n: int  # bytes


class Block(NamedTuple):
    start: int  # first element (row-major over the whole tensor)
    count: int  # type: ignore[assignment]  # elements (shadows tuple.count, unused here)
    segs: Tuple[Seg, ...]
    rows: Optional[Tuple[int, int]]  # dim-0 slab [a, b) when chunks must be assembled


def plan_blocks(t: SrcTensor, start: int, stop: int, block_bytes: int = BLOCK_BYTES) -> List[Block]:
    """Blocks covering elements ``[start, stop)`` of ``t`` in order, each at most ``block_bytes``.

    When chunks split dim 0 only, blocks are byte runs of the chunks (a
    block may span chunks, a chunk may span blocks, a huge row is cut).
    Otherwise a block is a slab of whole rows (``[start, stop)`` must be
    row-aligned) assembled from every chunk it crosses; a single row larger
    than ``block_bytes`` is then one block.
    """
    isz = itemsize(t.dtype)
    if stop <= start:
        return []
    block_bytes = max(isz, block_bytes - block_bytes % isz)
    order = sorted(
        (i for i, c in enumerate(t.chunks) if math.prod(c.sizes) > 0),
        key=lambda i: tuple(t.chunks[i].offsets),
    )
    out: List[Block] = []
    row = t.row
    if t.flat:
        segs: List[Seg] = []
        size = 0
        first = start
        for i in order:
            c = t.chunks[i]
            cs = (c.offsets[0] if c.offsets else 0) * row
            ce = cs + (c.sizes[0] if c.sizes else 1) * row
            lo, hi = max(start, cs), min(stop, ce)
            p, end = (lo - cs) * isz, (hi - cs) * isz
            while p < end:
                take = min(block_bytes - size, end - p)
                segs.append(Seg(i, p, take))
                size += take
                p += take
                if size == block_bytes:
                    out.append(Block(first, size // isz, tuple(segs), None))
                    first += size // isz
                    segs, size = [], 0
        if segs:
            out.append(Block(first, size // isz, tuple(segs), None))
        if sum(b.count for b in out) != stop - start:
            raise CorruptCheckpointError(f"{t.name}: chunks do not cover elements [{start}, {stop})")
        return out
    if start % row or stop % row:
        raise ValueError(f"{t.name}: element range [{start}, {stop}) is not made of whole rows of {row}")
    a0, b0 = start // row, stop // row
    rows = Box((a0,) + (0,) * (len(t.shape) - 1), (b0 - a0,) + tuple(t.shape[1:]))
    for slab in split_box(rows, max(1, block_bytes // isz)):
        a, b = slab.offsets[0], slab.offsets[0] + slab.sizes[0]
        segs = []
        for i in order:
            c = t.chunks[i]
            lo, hi = max(a, c.offsets[0]), min(b, c.offsets[0] + c.sizes[0])
            if lo < hi:
                crow = math.prod(c.sizes[1:]) * isz
                segs.append(Seg(i, (lo - c.offsets[0]) * crow, (hi - lo) * crow))
        out.append(Block(a * row, (b - a) * row, tuple(segs), (a, b)))
    return out


def block_bytes_for(src: str, dst: str, block_bytes: int) -> int:
    """Block size on the source side so that a cast block also fits ``block_bytes``."""
    return max(itemsize(src), block_bytes * itemsize(src) // max(itemsize(src), itemsize(dst)))


# --------------------------------------------------------------------------
# output entries


@dataclass
class OutEntry:
    """One entry of an output safetensors file: elements ``[start, stop)`` of ``src``."""

    key: str
    src: SrcTensor
    start: int
    stop: int
    shape: Tuple[int, ...]
    dtype: str
    name: str = ""  # native outputs: the tensor this chunk belongs to
    offsets: Tuple[int, ...] = ()

    @property
    def nbytes(self) -> int:
        return (self.stop - self.start) * itemsize(self.dtype)


def whole_entry(t: SrcTensor, key: str, dtype: Optional[str] = None, *, native: bool = False) -> OutEntry:
    """An entry holding all of ``t`` under ``key``, cast to ``dtype`` (default: ``t``'s).

    ``native``: the entry is the single chunk of the output tensor ``key``
    (its ``name`` and zero ``offsets`` set, as native manifests need them).
    """
    return OutEntry(
        key=key,
        src=t,
        start=0,
        stop=t.numel,
        shape=t.shape,
        dtype=t.dtype if dtype is None else dtype,
        name=key if native else "",
        offsets=(0,) * len(t.shape) if native else (),
    )
