"""Moving tensor bytes: parallel writes with checksums in the same pass, coalesced ranged reads.

Writes stream each chunk straight from tensor memory (a contiguous CPU tensor
is written without a copy; a GPU tensor goes through two pinned buffers, the
next block's device-to-host copy overlapping this block's write) in blocks,
updating the CRC32C as each block goes out. Local files are written behind:
see ``_storage.WRITEBACK_BYTES``.

Reads fetch whole saved chunks (checksums are per chunk), coalescing
neighbours in a file, into one staging buffer per range. The range is read in
blocks by several threads; each thread checksums the block it just read and
the per-block CRCs are combined into the chunk's CRC (``crc32c_combine``), so
verification needs no second pass over memory after the reads.

Measured and left out: ``O_DIRECT`` reads (no faster cold on the machines
measured, and a warm page cache no longer helps); 8 MiB blocks (no gain).
See docs/performance.md.
"""

from __future__ import annotations

import ctypes
import math
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from typing import Dict, List, Optional, Sequence, Tuple

import torch

from . import _knobs
from ._format import ChunkMeta, FileMeta, itemsize, safetensors_header
from ._format.checksum import crc32c, crc32c_combine
from ._format.files import check_files  # noqa: F401  (re-exported: load and the converters check files here)
from ._storage import Storage
from .errors import ChecksumMismatchError, CorruptCheckpointError, StorageError

__all__ = [
    "WriteItem",
    "crc32c_combine",
    "write_files",
    "partition",
    "read_chunks",
    "tensor_bytes",
    "as_dtype",
    "crc32c",
    "DEFAULT_IO_THREADS",
    "WRITE_BLOCK_BYTES",
]

# Tunables live in ``_knobs`` (overridable from SHARDCKPT_* environment
# variables); the names here are the ones the engine and converters import.
DEFAULT_IO_THREADS = _knobs.IO_THREADS
WRITE_BLOCK_BYTES = _knobs.WRITE_BLOCK_BYTES
READ_BLOCK_BYTES = _knobs.READ_BLOCK_BYTES
COALESCE_GAP_BYTES = _knobs.COALESCE_GAP_BYTES
MIN_BYTES_PER_FILE = _knobs.MIN_BYTES_PER_FILE


def as_dtype(raw: torch.Tensor, dtype: torch.dtype, shape) -> torch.Tensor:
    """View staged uint8 bytes as ``dtype``/``shape`` (copies only if misaligned)."""
    size = torch.empty((), dtype=dtype).element_size()
    if raw.storage_offset() % size:
        raw = raw.clone()
    return raw.view(dtype).reshape(tuple(shape))


def byte_view(t: torch.Tensor) -> memoryview:
    """Writable flat memoryview of a contiguous CPU tensor's bytes, without a copy.

    Uses NumPy when torch has it and falls back to ctypes otherwise: NumPy is
    not a dependency of torch's CPU wheel, nor of shardckpt.
    """
    n = t.numel() * t.element_size()
    if n == 0:
        return memoryview(bytearray(0))
    assert t.device.type == "cpu" and t.is_contiguous(), "byte_view needs a contiguous CPU tensor"
    try:
        return memoryview(t.reshape(-1).view(torch.uint8).numpy()).cast("B")
    except RuntimeError:  # "Numpy is not available"
        arr = (ctypes.c_char * n).from_address(t.data_ptr())
        arr._shardckpt_owner = t  # the view must keep the tensor's memory alive
        return memoryview(arr).cast("B")


def tensor_bytes(t: torch.Tensor) -> memoryview:
    """A CPU tensor's bytes as a flat memoryview (copies only if not contiguous)."""
    if t.device.type != "cpu":
        t = t.detach().cpu()
    t = t.detach()
    if not t.is_contiguous():
        t = t.contiguous()
    flat = t.reshape(-1)
    if flat.numel() == 0:
        return memoryview(b"")
    return byte_view(flat)


@dataclass
class WriteItem:
    """One chunk to write: ``tensor`` holds exactly the box ``offsets``/``sizes``."""

    name: str
    key: str
    dtype: str
    offsets: Tuple[int, ...]
    sizes: Tuple[int, ...]
    tensor: torch.Tensor

    @property
    def nbytes(self) -> int:
        return math.prod(self.sizes) * itemsize(self.dtype)


def partition(items: Sequence[WriteItem], parts: int) -> List[List[WriteItem]]:
    """Split items into at most ``parts`` groups of balanced bytes (order kept inside a group)."""
    total = sum(it.nbytes for it in items)
    parts = max(1, min(parts, math.ceil(total / MIN_BYTES_PER_FILE) if total else 1, len(items) or 1))
    groups: List[List[WriteItem]] = [[] for _ in range(parts)]
    load = [0] * parts
    for idx in sorted(range(len(items)), key=lambda i: (-items[i].nbytes, i)):
        g = min(range(parts), key=lambda j: (load[j], j))
        groups[g].append(items[idx])
        load[g] += items[idx].nbytes
    for g in groups:
        # Widest dtypes first (as safetensors does): with the header padded to
        # 8 bytes, every chunk then starts aligned to its element size, so a
        # reader can view the bytes as the dtype without a copy.
        g.sort(key=lambda it: (-itemsize(it.dtype), it.name, it.offsets))
    return [g for g in groups if g]


def _write_one(storage: Storage, rel: str, items: Sequence[WriteItem]) -> Tuple[List[ChunkMeta], FileMeta]:
    chunks_md = {it.key: {"tensor": it.name, "offsets": list(it.offsets)} for it in items}
    header, starts = safetensors_header(
        [(it.key, it.dtype, it.sizes, it.nbytes) for it in items], chunks=chunks_md
    )
    out: List[ChunkMeta] = []
    w = storage.open_write(rel)
    try:
        w.write(header)
        size = len(header)
        bounce: List[torch.Tensor] = []  # pinned buffers for GPU chunks, reused across them
        for it, start in zip(items, starts):
            if it.tensor.device.type == "cuda" and it.nbytes > 0:
                crc = _write_cuda(w, it, bounce)
            else:
                mv = tensor_bytes(it.tensor)
                if len(mv) != it.nbytes:
                    raise AssertionError(f"{it.key}: {len(mv)} bytes, expected {it.nbytes}")
                crc = 0
                for off in range(0, len(mv), WRITE_BLOCK_BYTES):
                    block = mv[off : off + WRITE_BLOCK_BYTES]
                    if _knobs.CHECKSUMS:
                        crc = crc32c(block, crc)
                    w.write(block)
                del mv
            size += it.nbytes
            out.append(
                ChunkMeta(
                    file=rel,
                    key=it.key,
                    offsets=list(it.offsets),
                    sizes=list(it.sizes),
                    byte_offset=start,
                    nbytes=it.nbytes,
                    crc32c=crc,
                )
            )
        w.close()
    except BaseException:
        w.abort()
        raise
    return out, FileMeta(size)


def _write_cuda(w, it: WriteItem, bounce: List[torch.Tensor]) -> int:
    """Stream a GPU chunk through two pinned buffers: block k+1 copies while block k is written."""
    src = it.tensor.detach()
    if not src.is_contiguous():
        src = src.contiguous()
    flat = src.reshape(-1).view(torch.uint8)
    if len(flat) != it.nbytes:
        raise AssertionError(f"{it.key}: {len(flat)} bytes, expected {it.nbytes}")
    block = WRITE_BLOCK_BYTES
    if not bounce or len(bounce[0]) < min(block, it.nbytes):
        bounce[:] = [torch.empty(min(block, max(it.nbytes, 1)), dtype=torch.uint8, pin_memory=True) for _ in range(2)]
    size = len(bounce[0])
    stream = torch.cuda.Stream(device=src.device)
    # The chunk may still be being produced on the current stream.
    stream.wait_stream(torch.cuda.current_stream(src.device))
    done = [torch.cuda.Event(), torch.cuda.Event()]
    offs = list(range(0, it.nbytes, size))

    def issue(k: int) -> None:
        off = offs[k]
        n = min(size, it.nbytes - off)
        with torch.cuda.stream(stream):
            bounce[k % 2][:n].copy_(flat[off : off + n], non_blocking=True)
            done[k % 2].record(stream)

    crc = 0
    issue(0)
    for k, off in enumerate(offs):
        if k + 1 < len(offs):
            # Buffer (k+1) % 2 last held block k-1, already written out.
            issue(k + 1)
        done[k % 2].synchronize()
        n = min(size, it.nbytes - off)
        mv = byte_view(bounce[k % 2][:n])
        if _knobs.CHECKSUMS:
            crc = crc32c(mv, crc)
        w.write(mv)
    return crc


def write_files(
    storage: Storage, files: Dict[str, Sequence[WriteItem]], *, threads: int = DEFAULT_IO_THREADS
) -> Tuple[List[ChunkMeta], Dict[str, FileMeta]]:
    """Write each file in parallel; return chunk metadata and file sizes."""
    chunks: List[ChunkMeta] = []
    metas: Dict[str, FileMeta] = {}
    if not files:
        return chunks, metas
    if len(files) == 1 or threads <= 1:
        results = [(rel, _write_one(storage, rel, items)) for rel, items in files.items()]
    else:
        with ThreadPoolExecutor(max_workers=min(threads, len(files)), thread_name_prefix="shardckpt-w") as ex:
            futs = {rel: ex.submit(_write_one, storage, rel, items) for rel, items in files.items()}
            results = [(rel, f.result()) for rel, f in futs.items()]
    for rel, (c, fm) in results:
        chunks.extend(c)
        metas[rel] = fm
    storage.fsync_dirs({rel.rsplit("/", 1)[0] if "/" in rel else "" for rel in files})
    return chunks, metas


# --------------------------------------------------------------------------
# reads


# One unit of read work: fill these (offset, buffer) ranges of a file, then
# checksum the chunk segments (chunk index, position in the chunk, bytes) that
# the ranges hold.
_ReadJob = Tuple[str, List[Tuple[int, memoryview]], List[Tuple[int, int, memoryview]]]


def read_chunks(
    storage: Storage,
    chunks: Sequence[ChunkMeta],
    *,
    threads: int = DEFAULT_IO_THREADS,
    pin_memory: bool = False,
    verify: bool = True,
) -> List[torch.Tensor]:
    """Read and checksum-verify whole chunks; returns one uint8 tensor per chunk, same order.

    Every returned tensor is a view into a staging buffer shared by the chunks
    coalesced with it. Nothing is returned unless every checksum matched.
    """
    out: List[Optional[torch.Tensor]] = [None] * len(chunks)
    checking = verify and _knobs.CHECKSUMS
    by_file: Dict[str, List[int]] = {}
    for i, c in enumerate(chunks):
        by_file.setdefault(c.file, []).append(i)
    jobs: List[_ReadJob] = []
    for rel, idxs in by_file.items():
        idxs.sort(key=lambda i: chunks[i].byte_offset)
        groups: List[List[int]] = []
        for i in idxs:
            if groups:
                last = chunks[groups[-1][-1]]
                if chunks[i].byte_offset - (last.byte_offset + last.nbytes) <= COALESCE_GAP_BYTES and chunks[i].byte_offset >= last.byte_offset + last.nbytes:
                    groups[-1].append(i)
                    continue
            groups.append([i])
        for g in groups:
            start = chunks[g[0]].byte_offset
            end = max(chunks[i].byte_offset + chunks[i].nbytes for i in g)
            buf = torch.empty(end - start, dtype=torch.uint8, pin_memory=pin_memory)
            for i in g:
                s = chunks[i].byte_offset - start
                out[i] = buf[s : s + chunks[i].nbytes]
            if end == start:
                continue
            mv = byte_view(buf)
            first = 0  # g is sorted by offset: chunks before g[first] end before this block
            for lo in range(start, end, READ_BLOCK_BYTES):
                hi = min(lo + READ_BLOCK_BYTES, end)
                segs = []
                while first < len(g) and chunks[g[first]].byte_offset + chunks[g[first]].nbytes <= lo:
                    first += 1
                k = first
                while checking and k < len(g) and chunks[g[k]].byte_offset < hi:
                    c = chunks[g[k]]
                    a, b = max(lo, c.byte_offset), min(hi, c.byte_offset + c.nbytes)
                    if a < b and c.crc32c is not None:  # safetensors sources carry no checksum
                        segs.append((g[k], a - c.byte_offset, mv[a - start : b - start]))
                    k += 1
                jobs.append((rel, [(lo, mv[lo - start : hi - start])], segs))

    def run(job: _ReadJob) -> List[Tuple[int, int, int, int]]:
        rel, ranges, segs = job
        try:
            storage.read_into(rel, ranges)
        except FileNotFoundError:
            raise CorruptCheckpointError(f"{storage.url_of(rel)}: file is missing") from None
        except EOFError as e:
            raise CorruptCheckpointError(f"{e} (truncated)") from None
        except StorageError:
            raise
        except OSError as e:
            raise StorageError(f"reading {storage.url_of(rel)}: {e}") from e
        # Checksum what this thread just read: the threads share the work,
        # and no pass over the whole staging memory follows the reads.
        return [(i, pos, len(seg), crc32c(seg)) for i, pos, seg in segs]

    # Local disk: one pread per block, many threads. Backends that run a
    # call's ranges concurrently (fsspec's cat_ranges): one call per file.
    if storage.caps.batched_reads:
        per: Dict[str, _ReadJob] = {}
        for rel, ranges, segs in jobs:
            job = per.setdefault(rel, (rel, [], []))
            job[1].extend(ranges)
            job[2].extend(segs)
        jobs = list(per.values())
    if threads > 1 and len(jobs) > 1:
        with ThreadPoolExecutor(max_workers=min(threads, len(jobs)), thread_name_prefix="shardckpt-r") as ex:
            done = list(ex.map(run, jobs))
    else:
        done = [run(j) for j in jobs]

    if checking:
        parts: Dict[int, List[Tuple[int, int, int]]] = {}
        for results in done:
            for i, pos, n, crc in results:
                parts.setdefault(i, []).append((pos, n, crc))
        bad = []
        for i, c in enumerate(chunks):
            if c.crc32c is None:
                continue
            got, covered = 0, 0
            for pos, n, crc in sorted(parts.get(i, [])):
                assert pos == covered, f"{c.key}: checksummed segments do not tile the chunk"
                got = crc32c_combine(got, crc, n)
                covered += n
            assert covered == c.nbytes, f"{c.key}: checksummed {covered} of {c.nbytes} bytes"
            if got != c.crc32c:
                bad.append(
                    f"{storage.url_of(c.file)}: chunk {c.key!r} (bytes {c.byte_offset}..{c.byte_offset + c.nbytes}) "
                    f"has crc32c {got:#010x}, manifest says {c.crc32c:#010x}"
                )
        if bad:
            raise ChecksumMismatchError("checksum mismatch, the checkpoint is damaged: " + "; ".join(sorted(bad)[:10]))
    return out  # type: ignore[return-value]
