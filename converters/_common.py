"""The streaming engine every converter runs on.

A *source* is a set of tensors whose bytes lie in byte ranges of files
(native shardckpt chunks, safetensors entries, DCP items, ``torch.save``
records). A conversion plans its *output files* up front — every entry's
name, dtype, shape and byte offset is known from metadata alone — then
streams: worker threads read *blocks* (at most ``BLOCK_BYTES``: byte runs of
dim-0 shards, or row slabs from ``_plan.split_box`` where chunks are other
boxes), cast them if asked, checksum them, and on local disk ``pwrite`` them
at their final offset (elsewhere one writer per output file appends them in
order). At most ``depth`` blocks per output file are in flight, in reused
buffers, so peak memory is a few blocks — plus one tensor only where a
source cannot be read by ranges (a non-contiguous ``torch.save`` record).

Source checksums are verified as the bytes stream through: each block's CRC
is computed on the thread that read it and joined in order with
:func:`shardckpt._format.checksum.combine`; a mismatch is raised at the end, before the output is
committed, so damaged input never yields committed output.
"""

from __future__ import annotations

import collections
import itertools
import math
import os
import sys
import threading
import time
import uuid
from concurrent.futures import ThreadPoolExecutor, wait
from dataclasses import dataclass, field
from typing import Any, Callable, Dict, Iterable, Iterator, List, NamedTuple, Optional, Sequence, Tuple

import torch

from shardckpt._format import (
    DATA_DIR,
    DTYPES,
    MANIFEST_NAME,
    ChunkMeta,
    FileMeta,
    Manifest,
    TensorMeta,
    checksum,
    combine,
    commit,
    data_file_name,
    itemsize,
    open_manifest,
    safetensors_header,
    tiling_problems,
    torch_dtype,
)
from shardckpt._io import DEFAULT_IO_THREADS, byte_view, check_files, split_files_by_header
from shardckpt._layout import box_view
from shardckpt._plan import Box, split_box
from shardckpt._storage import Storage
from shardckpt.errors import (
    CheckpointExistsError,
    ChecksumMismatchError,
    CorruptCheckpointError,
    StorageError,
    UnsupportedStateError,
    format_offenders,
)

__all__ = [
    "BLOCK_BYTES",
    "SrcChunk",
    "SrcTensor",
    "Source",
    "OutEntry",
    "ConvertResult",
    "open_checkpoint",
    "source_from_manifest",
    "Reader",
    "plan_blocks",
    "write_native",
    "write_whole",
    "write_safetensors_files",
    "whole_entry",
    "plan_whole_files",
    "parse_dtype",
    "parse_size",
]

#: Bytes per streamed block. With ``depth`` blocks in flight per output file
#: this sets the memory a conversion needs.
BLOCK_BYTES = 16 << 20


# --------------------------------------------------------------------------
# sources


@dataclass
class SrcChunk:
    """A box of a source tensor and where its bytes are.

    ``check`` is ``(algorithm, value)`` for the chunk's bytes (``"crc32c"``
    for shardckpt, ``"crc32"`` for zip records) or ``None`` when the source
    has no checksum. ``loader``, when set, materializes the chunk (a
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


def source_from_manifest(storage: Storage, m: Manifest) -> Source:
    tensors = {}
    for name in sorted(m.tensors):
        t = m.tensors[name]
        tensors[name] = SrcTensor(
            name=name,
            dtype=t.dtype,
            shape=tuple(t.shape),
            chunks=[
                SrcChunk(
                    file=c.file,
                    byte_offset=c.byte_offset,
                    nbytes=c.nbytes,
                    offsets=tuple(c.offsets),
                    sizes=tuple(c.sizes),
                    key=c.key,
                    check=None if c.crc32c is None else ("crc32c", c.crc32c),
                )
                for c in t.chunks
            ],
            layout=t.layout,
        )
    kind = m.extra.get("source", "native") if isinstance(m.extra, dict) else "native"
    return Source(
        url=storage.url,
        storage=storage,
        tensors=tensors,
        values=m.values,
        world_size=m.world_size,
        kind=kind,
        extra=dict(m.extra or {}),
        files={rel: f.size for rel, f in m.files.items()},
    )


def open_checkpoint(url: str, storage_options: Optional[Dict[str, Any]] = None) -> Source:
    """A shardckpt checkpoint, a safetensors directory, or one ``.safetensors`` file."""
    storage = Storage(url, storage_options=storage_options)
    return source_from_manifest(storage, open_manifest(storage))


# --------------------------------------------------------------------------
# block planning (pure)


class Seg(NamedTuple):
    chunk: int  # index into SrcTensor.chunks
    pos: int  # byte offset inside the chunk
    n: int  # bytes


class Block(NamedTuple):
    start: int  # first element (row-major over the whole tensor)
    count: int  # elements
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


# --------------------------------------------------------------------------
# reading


class _Verifier:
    """Collects per-block CRCs of source chunks; checks whole chunks at the end."""

    def __init__(self):
        self.lock = threading.Lock()
        self.pieces: Dict[Tuple[int, int], List[Tuple[int, int, int]]] = collections.defaultdict(list)
        self.tensors: Dict[int, SrcTensor] = {}

    def add(self, t: SrcTensor, idx: int, pos: int, n: int, crc: int) -> None:
        with self.lock:
            self.tensors[id(t)] = t
            self.pieces[(id(t), idx)].append((pos, n, crc))

    def problems(self, source: Source) -> List[str]:
        bad = []
        for (tid, idx), pieces in self.pieces.items():
            t = self.tensors[tid]
            c = t.chunks[idx]
            if c.check is None:
                continue
            algo, want = c.check
            pieces.sort()
            crc, pos = 0, 0
            for p, n, v in pieces:
                if p != pos:
                    break  # overlapping or partial reads: not a whole-chunk check
                crc = combine(algo, crc, v, n)
                pos += n
            if pos != c.nbytes:
                continue
            if crc != want:
                bad.append(
                    f"{source.storage.url_of(c.file)}: chunk {c.key!r} of tensor {t.name!r} "
                    f"(bytes {c.byte_offset}..{c.byte_offset + c.nbytes}) has {algo} {crc:#010x}, "
                    f"the checkpoint says {want:#010x}"
                )
        return sorted(bad)


class BufferPool:
    """Reusable byte buffers of one size, shared by threads; never blocks.

    Streaming allocates and frees a 16 MiB buffer per block from several
    threads; through malloc that fragments per-thread arenas and the
    process's resident memory creeps up by hundreds of MB. Reusing a few
    buffers keeps it flat. ``take`` allocates when none is free (the number
    in use is bounded by the prefetch depth, not here); requests larger than
    the buffer size get a one-off allocation.
    """

    def __init__(self, size: int, keep: int):
        self.size, self.keep = size, keep
        self.free: List[torch.Tensor] = []
        self.lock = threading.Lock()

    def take(self, nbytes: int) -> torch.Tensor:
        if nbytes > self.size:
            return torch.empty(nbytes, dtype=torch.uint8)
        with self.lock:
            base = self.free.pop() if self.free else None
        if base is None:
            base = torch.empty(self.size, dtype=torch.uint8)
        return base[:nbytes]

    def give(self, t: Optional[torch.Tensor]) -> None:
        if t is None:
            return
        base = t._base if t._base is not None else t
        if base.numel() == self.size and base.dim() == 1:
            with self.lock:
                if len(self.free) < self.keep:
                    self.free.append(base)


class Reader:
    """Reads blocks of source tensors (thread-safe), verifying source checksums."""

    def __init__(self, source: Source):
        self.source = source
        self.storage = source.storage
        self.verifier = _Verifier()
        self._cache_lock = threading.Lock()
        self._cache: Tuple[Any, Optional[torch.Tensor]] = (None, None)

    def check_source_files(self, names: Iterable[str]) -> None:
        """Every file the named tensors need exists with its recorded size."""
        if self.source.files is None:
            return
        need = {c.file for n in names for c in self.source.tensors[n].chunks if c.loader is None and c.nbytes}
        check_files(self.storage, {rel: self.source.files[rel] for rel in need if rel in self.source.files})

    def finish(self) -> None:
        """Raise if any fully read source chunk failed its checksum."""
        bad = self.verifier.problems(self.source)
        if bad:
            raise ChecksumMismatchError(
                f"checksum mismatch, the source {self.source.url} is damaged ({len(bad)} chunks): " + "; ".join(bad[:10])
            )

    def _read_into(self, rel: str, ranges: List[Tuple[int, memoryview]]) -> None:
        try:
            self.storage.read_into(rel, ranges)
        except (FileNotFoundError, NotADirectoryError):
            raise CorruptCheckpointError(f"{self.storage.url_of(rel)}: file is missing") from None
        except EOFError as e:
            raise CorruptCheckpointError(f"{e} (truncated)") from None
        except StorageError:
            raise
        except OSError as e:
            raise StorageError(f"reading {self.storage.url_of(rel)}: {e}") from e

    def _loaded(self, c: SrcChunk) -> memoryview:
        with self._cache_lock:
            key, t = self._cache
            if key is not c:
                t = c.loader().contiguous()  # type: ignore[misc]
                self._cache = (c, t)
        from shardckpt._io import tensor_bytes

        return tensor_bytes(t)

    def _fill(self, t: SrcTensor, segs: Sequence[Seg], dests: Sequence[memoryview]) -> None:
        by_file: Dict[str, List[Tuple[int, memoryview]]] = {}
        for s, d in zip(segs, dests):
            c = t.chunks[s.chunk]
            if c.loader is not None:
                d[:] = self._loaded(c)[s.pos : s.pos + s.n]
            else:
                by_file.setdefault(c.file, []).append((c.byte_offset + s.pos, d))
        for rel, ranges in by_file.items():
            self._read_into(rel, ranges)
        for s, d in zip(segs, dests):
            c = t.chunks[s.chunk]
            if c.check is not None:
                self.verifier.add(t, s.chunk, s.pos, s.n, checksum(c.check[0], d))

    def read(self, t: SrcTensor, blk: Block, pool: Optional[BufferPool] = None) -> torch.Tensor:
        """The block's elements as a flat uint8 tensor, row-major (from ``pool`` when given)."""
        isz = itemsize(t.dtype)
        total = blk.count * isz
        take = pool.take if pool is not None else (lambda n: torch.empty(n, dtype=torch.uint8))
        if blk.rows is None:
            buf = take(total)
            if total:
                mv = byte_view(buf)
                dests, pos = [], 0
                for s in blk.segs:
                    dests.append(mv[pos : pos + s.n])
                    pos += s.n
                self._fill(t, blk.segs, dests)
            return buf
        a, b = blk.rows
        shape = t.shape
        slab = take(total).view((b - a,) + tuple(shape[1:-1]) + (shape[-1] * isz,))
        staging = take(sum(s.n for s in blk.segs))
        tmps, pos = [], 0
        for s in blk.segs:
            tmps.append(staging[pos : pos + s.n])
            pos += s.n
        self._fill(t, blk.segs, [byte_view(x) for x in tmps])
        for s, tmp in zip(blk.segs, tmps):
            c = t.chunks[s.chunk]
            crow = math.prod(c.sizes[1:]) * isz
            r0 = c.offsets[0] + s.pos // crow
            src = tmp.view((s.n // crow,) + tuple(c.sizes[1:-1]) + (c.sizes[-1] * isz,))
            dst = box_view(slab, (r0 - a,) + tuple(c.offsets[1:-1]) + (c.offsets[-1] * isz,), tuple(src.shape))
            dst.copy_(src)
        del tmps
        if pool is not None:
            pool.give(staging)
        return slab.view(-1)

    def read_tensor(self, t: SrcTensor, block_bytes: int = BLOCK_BYTES) -> torch.Tensor:
        """The whole tensor (for ``.pt`` output and ``diff``)."""
        out = torch.empty(t.nbytes, dtype=torch.uint8)
        for blk in plan_blocks(t, 0, t.numel, block_bytes):
            isz = itemsize(t.dtype)
            out[blk.start * isz : (blk.start + blk.count) * isz] = self.read(t, blk)
        return out.view(torch_dtype(t.dtype)).reshape(t.shape)


def cast_bytes(data: torch.Tensor, src: str, dst: str, pool: Optional[BufferPool] = None) -> torch.Tensor:
    """Cast a flat uint8 buffer of ``src`` elements to ``dst`` (same values as ``tensor.to``)."""
    if src == dst:
        return data
    n = data.numel() // itemsize(src)
    out = pool.take(n * itemsize(dst)) if pool is not None else torch.empty(n * itemsize(dst), dtype=torch.uint8)
    if n:
        out.view(torch_dtype(dst)).copy_(data.view(torch_dtype(src)))
    return out


def block_bytes_for(src: str, dst: str, block_bytes: int) -> int:
    """Block size on the source side so that a cast block also fits ``block_bytes``."""
    return max(itemsize(src), block_bytes * itemsize(src) // max(itemsize(src), itemsize(dst)))


def prefetch(pool: ThreadPoolExecutor, jobs: Iterable[Callable[[], Any]], depth: int) -> Iterator[Any]:
    """Run ``jobs`` on ``pool`` with at most ``depth`` pending; yield results in order."""
    pending: collections.deque = collections.deque()
    it = iter(jobs)
    try:
        for job in itertools.islice(it, max(1, depth)):
            pending.append(pool.submit(job))
        while pending:
            res = pending.popleft().result()
            for job in itertools.islice(it, 1):
                pending.append(pool.submit(job))
            yield res
    finally:
        for f in pending:
            f.cancel()
        wait(list(pending))


# --------------------------------------------------------------------------
# writing


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


def sort_entries(entries: List[OutEntry]) -> List[OutEntry]:
    # Widest dtypes first (as safetensors does): with the header padded to 8
    # bytes every entry then starts aligned to its element size.
    return sorted(entries, key=lambda e: (-itemsize(e.dtype), e.key))


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


def plan_whole_files(entries: List[OutEntry], threads: int, min_bytes: int = 64 << 20) -> Dict[str, List[OutEntry]]:
    """Spread whole-tensor entries over a few files of balanced size (one writer each)."""
    total = sum(e.nbytes for e in entries)
    parts = max(1, min(threads, math.ceil(total / min_bytes) if total else 1, len(entries) or 1))
    groups: List[List[OutEntry]] = [[] for _ in range(parts)]
    load = [0] * parts
    for e in sorted(entries, key=lambda e: (-e.nbytes, e.key)):
        g = min(range(parts), key=lambda j: (load[j], j))
        groups[g].append(e)
        load[g] += e.nbytes
    return {f"{i:02d}": g for i, g in enumerate(groups) if g}


def entry_blocks(entries: Sequence[OutEntry], block_bytes: int) -> Iterator[Tuple[int, OutEntry, Block]]:
    """``(entry index, entry, block)`` for every block of every entry, in file order.

    Blocks are sized on the source side so a cast block still fits ``block_bytes``.
    """
    for i, e in enumerate(entries):
        for blk in plan_blocks(e.src, e.start, e.stop, block_bytes_for(e.src.dtype, e.dtype, block_bytes)):
            yield i, e, blk


def read_entry_block(reader: Reader, e: OutEntry, blk: Block, buffers: BufferPool) -> Tuple[torch.Tensor, memoryview]:
    """One block of ``e`` in its output dtype: the flat uint8 tensor (give it back to ``buffers``) and its bytes."""
    data = reader.read(e.src, blk, buffers)
    if e.dtype != e.src.dtype:
        raw, data = data, cast_bytes(data, e.src.dtype, e.dtype, buffers)
        buffers.give(raw)
    return data, byte_view(data)


class Progress:
    """A tqdm bar when asked and available; otherwise nothing."""

    _warned = False

    def __init__(self, total: int, enabled: bool, desc: str):
        self.bar = None
        if not enabled:
            return
        try:
            from tqdm import tqdm
        except ImportError:
            if not Progress._warned:
                Progress._warned = True
                print("shardckpt: progress bars need tqdm (pip install tqdm)", file=sys.stderr)
            return
        self.bar = tqdm(total=total, unit="B", unit_scale=True, unit_divisor=1024, desc=desc, leave=False, dynamic_ncols=True)

    def update(self, n: int) -> None:
        if self.bar is not None:
            self.bar.update(n)

    def close(self) -> None:
        if self.bar is not None:
            self.bar.close()


def _write_file(
    storage: Storage,
    rel: str,
    entries: List[OutEntry],
    reader: Reader,
    pool: ThreadPoolExecutor,
    *,
    chunks_md: Optional[Dict[str, Any]],
    want_crc: bool,
    depth: int,
    progress: Progress,
    block_bytes: int,
    stop: Optional[threading.Event] = None,
) -> Tuple[List[int], List[int], int]:
    """Stream ``entries`` into one safetensors file; returns (crcs, data starts, size)."""
    header, starts = safetensors_header([(e.key, e.dtype, e.shape, e.nbytes) for e in entries], chunks=chunks_md)
    crcs = [0] * len(entries)
    done = [0] * len(entries)

    buffers = BufferPool(block_bytes, 2 * depth + 4)
    # Where the storage can, workers write their block at its final offset
    # (the layout is known up front), so writes run in parallel like reads.
    positional = storage.caps.positional_write

    def jobs():
        for i, e, blk in entry_blocks(entries, block_bytes):
            yield _job(i, e, blk)

    def _job(i, e, blk):
        def run():
            if stop is not None and stop.is_set():
                raise _Stopped()
            data, mv = read_entry_block(reader, e, blk, buffers)
            crc = checksum("crc32c", mv) if want_crc else 0
            if not positional:
                return i, data, mv, crc
            n = w.write_at(mv, starts[i] + (blk.start - e.start) * itemsize(e.dtype))
            del mv
            buffers.give(data)
            return i, None, n, crc

        return run

    w = storage.open_write(rel)
    stream = prefetch(pool, jobs(), depth)
    try:
        if positional:
            w.write_at(header, 0)
        else:
            w.write(header)
        for i, data, mv, crc in stream:
            n = mv if isinstance(mv, int) else len(mv)
            if not positional:
                w.write(mv)
            crcs[i] = combine("crc32c", crcs[i], crc, n)
            done[i] += n
            progress.update(n)
            del mv
            buffers.give(data)
            del data
        for e, n in zip(entries, done):
            if n != e.nbytes:
                raise AssertionError(f"internal error: {e.key}: wrote {n} bytes, expected {e.nbytes}")
        w.close()
    except BaseException:
        stream.close()  # waits for blocks in flight: none may write after the file is gone
        w.abort()
        raise
    return crcs, starts, len(header) + sum(e.nbytes for e in entries)


def _write_files(
    storage: Storage,
    files: Dict[str, List[OutEntry]],
    reader: Reader,
    *,
    native: bool,
    threads: int,
    progress: Progress,
    block_bytes: int,
) -> Dict[str, Tuple[List[int], List[int], int]]:
    """Write every file; several files at once, each fed by the shared read pool."""
    nfiles = max(1, min(threads, len(files)))
    depth = max(2, threads // nfiles + 1)
    results: Dict[str, Tuple[List[int], List[int], int]] = {}
    stop = threading.Event()  # one file failed: the others stop at their next block
    with ThreadPoolExecutor(max_workers=max(1, threads), thread_name_prefix="shardckpt-cr") as pool:
        def one(rel):
            ents = files[rel]
            md = {e.key: {"tensor": e.name, "offsets": list(e.offsets)} for e in ents} if native else None
            try:
                return rel, _write_file(
                    storage, rel, ents, reader, pool, chunks_md=md, want_crc=native, depth=depth, progress=progress,
                    block_bytes=block_bytes, stop=stop,
                )
            except BaseException:
                stop.set()
                raise

        if nfiles == 1:
            for rel in files:
                results[rel] = one(rel)[1]
        else:
            with ThreadPoolExecutor(max_workers=nfiles, thread_name_prefix="shardckpt-cw") as fpool:
                futs = [fpool.submit(one, rel) for rel in files]
                wait(futs)
                errors = [f.exception() for f in futs if f.exception() is not None]
                first = next((e for e in errors if not isinstance(e, _Stopped)), errors[0] if errors else None)
                if first is not None:
                    raise first
                for f in futs:
                    rel, res = f.result()
                    results[rel] = res
    return results


class _Stopped(Exception):
    """Another output file failed; this one gave up."""


class ConvertResult(NamedTuple):
    """What a conversion wrote."""

    url: str
    files: List[str]  # paths relative to ``url`` (or the file name for a single file)
    tensors: int
    nbytes: int  # tensor bytes written
    seconds: float

    @property
    def gb_per_s(self) -> float:
        return self.nbytes / 1e9 / self.seconds if self.seconds > 0 else float("inf")


def write_native(
    dst_url: str,
    files: Dict[str, List[OutEntry]],
    reader: Reader,
    *,
    tensors: Dict[str, Tuple[str, Tuple[int, ...], Optional[Dict[str, Any]]]],
    values: Any,
    world_size: int,
    extra: Optional[Dict[str, Any]] = None,
    storage_options: Optional[Dict[str, Any]] = None,
    overwrite: bool = False,
    threads: int = DEFAULT_IO_THREADS,
    progress: bool = False,
    desc: str = "convert",
    block_bytes: int = BLOCK_BYTES,
) -> ConvertResult:
    """Write a native checkpoint from planned files; ``manifest.json`` last (the commit).

    ``files`` maps a name (made unique with a fresh id under ``data/``) to
    entries with ``name``/``offsets`` set; ``tensors`` gives each output
    tensor's ``(dtype, shape, layout)``. Nothing is committed unless every
    file was written and every source chunk read passed its checksum.
    """
    t0 = time.perf_counter()
    dst = Storage(dst_url, storage_options=storage_options)
    if dst.exists(MANIFEST_NAME) and not overwrite:
        raise CheckpointExistsError(f"{dst.url_of(MANIFEST_NAME)} already exists; pass overwrite=True to replace it")
    save_id = uuid.uuid4().hex
    # Headers stay under the limit, as save's files do.
    named = {data_file_name(save_id, k): v for k, v in split_files_by_header({k: sort_entries(v) for k, v in files.items() if v}).items()}
    total = sum(e.nbytes for ents in named.values() for e in ents)
    bar = Progress(total, progress, desc)
    try:
        results = _write_files(dst, named, reader, native=True, threads=threads, progress=bar, block_bytes=block_bytes)
        dst.fsync_dirs([DATA_DIR])
        reader.finish()
        metas = {name: TensorMeta(dtype=dt, shape=list(shape), layout=layout) for name, (dt, shape, layout) in tensors.items()}
        for rel, ents in named.items():
            crcs, starts, _ = results[rel]
            for e, crc, start in zip(ents, crcs, starts):
                metas[e.name].chunks.append(
                    ChunkMeta(
                        file=rel,
                        key=e.key,
                        offsets=list(e.offsets),
                        sizes=list(e.shape),
                        byte_offset=start,
                        nbytes=e.nbytes,
                        crc32c=crc,
                    )
                )
        bad = tiling_problems(metas)
        if bad:
            raise AssertionError("internal error, converted chunks do not tile: " + "; ".join(bad[:10]))
        from shardckpt import __version__

        m = Manifest(
            world_size=world_size,
            tensors=metas,
            files={rel: FileMeta(res[2]) for rel, res in results.items()},
            values=values,
            save_id=save_id,
            library_version=__version__,
            extra=dict(extra or {}),
        )
        commit(dst, m, replace=overwrite)
    except BaseException:
        for rel in named:
            try:
                dst.remove(rel)
            except Exception:
                pass
        raise
    finally:
        bar.close()
    return ConvertResult(dst.url, sorted(named), len(metas), total, time.perf_counter() - t0)


def write_whole(
    source: Source,
    dst_url: str,
    names: Dict[str, str],
    *,
    values: Any,
    extra: Dict[str, Any],
    check_sizes: bool = True,
    storage_options: Optional[Dict[str, Any]] = None,
    overwrite: bool = False,
    threads: int = DEFAULT_IO_THREADS,
    progress: bool = False,
    desc: str = "convert",
) -> ConvertResult:
    """Write ``source``'s tensors ``{source name: output name}`` whole, as a world-size-1 native checkpoint.

    The imports' common tail: one chunk per tensor, spread over a few
    balanced files, layouts carried over. ``check_sizes``: check the
    source files' sizes first (skip it where they were just listed).
    """
    entries = [whole_entry(source.tensors[old], new, native=True) for old, new in names.items()]
    reader = Reader(source)
    if check_sizes:
        reader.check_source_files(names)
    return write_native(
        dst_url,
        plan_whole_files(entries, threads),
        reader,
        tensors={new: (source.tensors[old].dtype, source.tensors[old].shape, source.tensors[old].layout) for old, new in names.items()},
        values=values,
        world_size=1,
        extra=extra,
        storage_options=storage_options,
        overwrite=overwrite,
        threads=threads,
        progress=progress,
        desc=desc,
    )


# --------------------------------------------------------------------------
# plain safetensors outputs (HF directories, single files)


def split_url(url: str) -> Tuple[str, str]:
    """``(parent URL, base name)`` of a file URL or path."""
    if "://" in url and not url.startswith("file://"):
        head, _, base = url.rstrip("/").rpartition("/")
        if not base or head.endswith(":/"):
            raise StorageError(f"{url!r} does not name a file")
        return head, base
    path = url[len("file://") :] if url.startswith("file://") else url
    path = os.path.abspath(path)
    return os.path.dirname(path), os.path.basename(path)


def write_safetensors_files(
    dst_url: str,
    files: Dict[str, List[OutEntry]],
    reader: Reader,
    *,
    index: Optional[bytes] = None,
    index_name: str = "",
    storage_options: Optional[Dict[str, Any]] = None,
    overwrite: bool = False,
    single_file: bool = False,
    threads: int = DEFAULT_IO_THREADS,
    progress: bool = False,
    desc: str = "export",
    block_bytes: int = BLOCK_BYTES,
) -> ConvertResult:
    """Write plain safetensors files (no shardckpt metadata), published all at once where possible.

    Local disk: everything goes into a hidden sibling directory (or file)
    that is renamed into place at the end, so ``dst`` appears complete or
    not at all. Object stores: each file appears whole when its upload
    completes, and the index (when there is one) is written last.
    ``single_file``: ``dst_url`` is the file itself and ``files`` has one
    entry (its name is ignored).
    """
    t0 = time.perf_counter()
    total = sum(e.nbytes for ents in files.values() for e in ents)
    files = {rel: sort_entries(ents) for rel, ents in files.items()}
    bar = Progress(total, progress, desc)
    try:
        if single_file:
            parent, base = split_url(dst_url)
            root = Storage(parent, storage_options=storage_options)
            if root.exists(base) and not overwrite:
                raise CheckpointExistsError(f"{dst_url} already exists; pass overwrite=True to replace it")
            (ents,) = files.values()
            if root.caps.atomic_rename:
                tmp = f".{base}.{uuid.uuid4().hex[:12]}.tmp"
                try:
                    _write_files(root, {tmp: ents}, reader, native=False, threads=threads, progress=bar, block_bytes=block_bytes)
                    reader.finish()
                    root.rename(tmp, base)
                finally:
                    root.remove(tmp)
            else:
                # Verify the source before the upload completes where we can:
                # the remote object appears when its writer closes.
                _write_files(root, {base: ents}, reader, native=False, threads=threads, progress=bar, block_bytes=block_bytes)
                try:
                    reader.finish()
                except BaseException:
                    root.remove(base)
                    raise
            return ConvertResult(dst_url, [base], sum(len(v) for v in files.values()), total, time.perf_counter() - t0)

        dst = Storage(dst_url, storage_options=storage_options)
        existing = [n for n in dst.listdir("") if not n.startswith(".")]
        if existing and not overwrite:
            raise CheckpointExistsError(
                f"{dst.url} is not empty ({format_offenders(existing, limit=5)}); pass overwrite=True to replace it"
            )
        if dst.caps.atomic_rename:
            _, base = split_url(dst.url)
            tmp = dst.sibling(f".{base}.{uuid.uuid4().hex[:12]}.tmp")
            try:
                tmp.makedirs("")
                _write_files(tmp, files, reader, native=False, threads=threads, progress=bar, block_bytes=block_bytes)
                reader.finish()
                if index is not None:
                    tmp.write_atomic(index_name, index)
                dst.replace_with(tmp)
            except BaseException:
                tmp.remove_tree("")
                raise
        else:
            try:
                _write_files(dst, files, reader, native=False, threads=threads, progress=bar, block_bytes=block_bytes)
                reader.finish()
            except BaseException:
                for rel in files:
                    dst.remove(rel)
                raise
            if index is not None:
                dst.write_atomic(index_name, index)
            # Only stale weights and a stale index go; config/tokenizer files stay.
            for n in existing:
                # Stale weights and a stale index only: never the user's config/tokenizer files.
                if (n.endswith(".safetensors") and n not in files) or (n == index_name and index is None):
                    dst.remove(n)
        out = sorted(files) + ([index_name] if index is not None else [])
        return ConvertResult(dst.url, out, sum(len(v) for v in files.values()), total, time.perf_counter() - t0)
    finally:
        bar.close()


# --------------------------------------------------------------------------
# option parsing


_SIZE_UNITS = {
    "": 1,
    "B": 1,
    "KB": 10**3,
    "MB": 10**6,
    "GB": 10**9,
    "TB": 10**12,
    "KIB": 2**10,
    "MIB": 2**20,
    "GIB": 2**30,
    "TIB": 2**40,
}


def parse_size(size: Any) -> int:
    """Bytes from ``5_000_000``, ``"5GB"`` (10**9, as huggingface_hub reads it), ``"1GiB"`` (2**30)."""
    if isinstance(size, bool):
        raise ValueError(f"size must be an int or a string like '5GB', got {size!r}")
    if isinstance(size, int):
        n = size
    elif isinstance(size, str):
        s = size.strip().upper().replace(" ", "")
        num = s.rstrip("KMGTIB")
        unit = s[len(num) :]
        if unit not in _SIZE_UNITS or not num:
            raise ValueError(f"cannot read size {size!r}; use an int or e.g. '500MB', '5GB', '1GiB'")
        try:
            val = float(num)
        except ValueError:
            raise ValueError(f"cannot read size {size!r}; use an int or e.g. '500MB', '5GB', '1GiB'") from None
        n = int(val * _SIZE_UNITS[unit])
    else:
        raise ValueError(f"size must be an int or a string like '5GB', got {type(size).__name__}")
    if n <= 0:
        raise ValueError(f"size must be positive, got {size!r}")
    return n


_DTYPE_ALIASES = {"fp32": "F32", "fp16": "F16", "half": "F16", "bf16": "BF16", "fp64": "F64", "double": "F64", "float": "F32",
                  "fp8": "F8_E4M3", "fp8_e4m3": "F8_E4M3", "fp8_e5m2": "F8_E5M2"}
FLOAT_DTYPES = {"F16", "BF16", "F32", "F64", "F8_E4M3", "F8_E5M2", "F8_E4M3FNUZ", "F8_E5M2FNUZ"}


def parse_dtype(dtype: Any) -> Optional[str]:
    """safetensors dtype name of a floating-point ``torch.dtype`` or name (``"bf16"``, ``"bfloat16"``, ``"BF16"``)."""
    if dtype is None:
        return None
    if isinstance(dtype, torch.dtype):
        name = str(dtype).replace("torch.", "")
    elif isinstance(dtype, str):
        name = dtype.strip()
    else:
        raise TypeError(f"dtype must be a torch.dtype or a name like 'bfloat16', got {dtype!r}")
    st = _DTYPE_ALIASES.get(name.lower())
    if st is None:
        st = name.upper() if name.upper() in DTYPES else next((k for k, (attr, _) in DTYPES.items() if attr == name.lower()), None)
    if st is None or st not in FLOAT_DTYPES:
        raise UnsupportedStateError(
            f"dtype {dtype!r} is not a floating-point type shardckpt can write; use one of "
            f"{', '.join(sorted(DTYPES[k][0] for k in FLOAT_DTYPES))}"
        )
    return st


def out_dtype(src: str, cast: Optional[str]) -> str:
    """``cast`` for floating-point sources; integer and bool tensors keep their dtype."""
    return cast if cast is not None and src in FLOAT_DTYPES else src
