"""What a conversion reads and writes, and how it is cut into blocks: pure, no I/O beyond opening a manifest.

A *source* is a set of tensors whose bytes lie in byte ranges of files:
native shardckpt chunks (format v1 or v2), safetensors entries, DCP items,
``torch.save`` records. Each importer describes its input as a
:class:`Source` whose tensors' chunks are the engine's one chunk type,
:class:`~shardckpt._format.chunk.Chunk` (a manifest's rows become chunks
through ``Chunk.from_meta``, as for a load); :func:`plan_blocks` cuts a range of a tensor's elements into
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

from shardckpt._format import Manifest, itemsize, open_manifest
from shardckpt._format.chunk import Chunk
from shardckpt._format.refs import follow
from shardckpt._format.versions import spec
from shardckpt._geometry import Box, split_box
from shardckpt._storage import Storage
from shardckpt.errors import CorruptCheckpointError

__all__ = [
    "BLOCK_BYTES", "Loader", "SrcTensor", "Source", "Seg", "Block", "OutEntry",
    "source_from_manifest", "open_checkpoint", "plan_blocks", "whole_entry", "block_bytes_for",
]

#: Bytes per streamed block (and of the reader's buffers per output file):
#: with two blocks in flight per file this sets the memory a conversion needs.
BLOCK_BYTES = 16 << 20


#: Makes a chunk's box as a contiguous tensor, for bytes that are not one range of a file.
Loader = Callable[[], torch.Tensor]


@dataclass
class SrcTensor:
    """A tensor to convert: its chunks (the engine's :class:`~shardckpt._format.chunk.Chunk`) and what the reader needs besides.

    A chunk with block checksums (format v2+) is verified by the reader as
    each piece is read. A chunk with one checksum of all its bytes
    (:meth:`whole_check`: ``crc32c`` of a v1 chunk, the CRC-32 of a zip
    record in ``zip_crcs``) is checked once all of it is read
    (``Reader.finish``). ``loaders``: chunks whose bytes are not one byte
    range (a strided view, a tensor held in memory), by chunk index.
    """

    name: str
    dtype: str  # safetensors dtype name
    shape: Tuple[int, ...]
    chunks: List[Chunk]
    layout: Optional[Dict[str, Any]] = None
    zip_crcs: Dict[int, int] = field(default_factory=dict)
    loaders: Dict[int, Loader] = field(default_factory=dict)

    def add(self, chunk: Chunk, *, zip_crc: Optional[int] = None, loader: Optional[Loader] = None) -> None:
        """Append ``chunk``, with the CRC-32 of the zip record it is or the loader of its bytes."""
        if zip_crc is not None:
            self.zip_crcs[len(self.chunks)] = zip_crc
        if loader is not None:
            self.loaders[len(self.chunks)] = loader
        self.chunks.append(chunk)

    def whole_check(self, i: int) -> Optional[Tuple[str, int]]:
        """``(algorithm, value)`` of the one checksum of all of chunk ``i``'s bytes; None: block checksums, or none."""
        c = self.chunks[i]
        if i in self.zip_crcs:
            return "crc32", self.zip_crcs[i]
        if c.crc32c is not None and not c.blocked:
            return "crc32c", c.crc32c
        return None

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


def source_from_manifest(storage: Storage, m: Manifest) -> Source:
    """The tensors of an opened manifest (chunks filled in: v1, v2, or a safetensors directory)."""
    tensors = {}
    for name in sorted(m.tensors):
        t = m.tensors[name]
        bb = m.block_bytes if spec(m.version).block_checksums else 0
        chunks = [Chunk.from_meta(name, c, bb) for c in t.chunks]
        tensors[name] = SrcTensor(name=name, dtype=t.dtype, shape=tuple(t.shape), chunks=chunks, layout=t.layout)
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
    #: ``quantize="fp8-block"``: the weight's encoder (``_quantize.Fp8Weight``);
    #: its blocks are written as FP8 codes instead of cast.
    quant: Any = None

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
