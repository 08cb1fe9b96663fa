"""Moving tensor bytes: parallel writes with checksums in the same pass, coalesced ranged reads.

Writes stream each chunk straight from tensor memory (a contiguous CPU tensor
is written without a copy) in blocks, updating the CRC32C as the block goes
out. Reads fetch whole saved chunks (checksums are per chunk), coalescing
neighbours in a file, in parallel, into one staging buffer per range.
"""

from __future__ import annotations

import math
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from typing import Dict, List, Optional, Sequence, Tuple

import crc32c as _crc
import torch

from ._format import ChunkMeta, FileMeta, itemsize, safetensors_header
from ._storage import Storage
from .errors import ChecksumMismatchError, CorruptCheckpointError, StorageError

__all__ = [
    "WriteItem",
    "write_files",
    "partition",
    "read_chunks",
    "tensor_bytes",
    "as_dtype",
    "crc32c",
    "DEFAULT_IO_THREADS",
    "WRITE_BLOCK_BYTES",
]

#: I/O threads per rank for writes and reads. Writes and CRC32C release the GIL.
DEFAULT_IO_THREADS = 4
#: Bytes handed to one ``write`` call (and one CRC update).
WRITE_BLOCK_BYTES = 32 << 20
#: Reads of a coalesced range are split into pieces of this size, read in parallel.
READ_BLOCK_BYTES = 32 << 20
#: Neighbouring chunks closer than this in a file are fetched in one request.
COALESCE_GAP_BYTES = 1 << 20
#: A rank's data is split into several files (one per I/O thread) above this size.
MIN_BYTES_PER_FILE = 64 << 20
#: Benchmark-only switch (benchmarks/bench_save_load.py measures the checksum
#: cost with it): skip crc32c on write (records 0) and on read. Never set by the
#: library; a checkpoint written with it set fails verification, as it should.
_BENCH_NO_CHECKSUMS = False


def crc32c(data, value: int = 0) -> int:
    return _crc.crc32c(data, value)


def as_dtype(raw: torch.Tensor, dtype: torch.dtype, shape) -> torch.Tensor:
    """View staged uint8 bytes as ``dtype``/``shape`` (copies only if misaligned)."""
    size = torch.empty((), dtype=dtype).element_size()
    if raw.storage_offset() % size:
        raw = raw.clone()
    return raw.view(dtype).reshape(tuple(shape))


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
    u8 = flat.view(torch.uint8) if flat.dtype != torch.uint8 else flat
    return memoryview(u8.numpy()).cast("B")


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
        for it, start in zip(items, starts):
            mv = tensor_bytes(it.tensor)
            if len(mv) != it.nbytes:
                raise AssertionError(f"{it.key}: {len(mv)} bytes, expected {it.nbytes}")
            crc = 0
            for off in range(0, len(mv), WRITE_BLOCK_BYTES):
                block = mv[off : off + WRITE_BLOCK_BYTES]
                if not _BENCH_NO_CHECKSUMS:
                    crc = _crc.crc32c(block, crc)
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


def check_files(storage: Storage, expected: Dict[str, int]) -> None:
    """Every file exists with the recorded size; lists all offenders at once."""
    problems = []

    def stat(rel):
        try:
            return rel, storage.size(rel)
        except FileNotFoundError:
            return rel, None

    if len(expected) > 4 and not storage.is_local:
        with ThreadPoolExecutor(max_workers=16) as ex:
            sizes = list(ex.map(stat, sorted(expected)))
    else:
        sizes = [stat(rel) for rel in sorted(expected)]
    for rel, size in sizes:
        if size is None:
            problems.append(f"{rel} is missing")
        elif size != expected[rel]:
            what = "truncated" if size < expected[rel] else "has extra bytes"
            problems.append(f"{rel} {what}: {size} bytes, manifest says {expected[rel]}")
    if problems:
        raise CorruptCheckpointError(f"{storage.url}: " + "; ".join(problems))


def read_chunks(
    storage: Storage,
    chunks: Sequence[ChunkMeta],
    *,
    threads: int = DEFAULT_IO_THREADS,
    pin_memory: bool = False,
    verify: bool = True,
) -> List[torch.Tensor]:
    """Read and checksum-verify whole chunks; returns one uint8 tensor per chunk, same order."""
    out: List[Optional[torch.Tensor]] = [None] * len(chunks)
    by_file: Dict[str, List[int]] = {}
    for i, c in enumerate(chunks):
        by_file.setdefault(c.file, []).append(i)
    jobs: List[Tuple[str, int, memoryview]] = []  # (file, offset, dest)
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
            if end > start:
                mv = memoryview(buf.numpy()).cast("B")
                for off in range(0, end - start, READ_BLOCK_BYTES):
                    jobs.append((rel, start + off, mv[off : off + READ_BLOCK_BYTES]))

    def run(rel_jobs):
        rel, items = rel_jobs
        try:
            storage.read_into(rel, items)
        except FileNotFoundError:
            raise CorruptCheckpointError(f"{storage.url_of(rel)}: file is missing") from None
        except EOFError as e:
            raise CorruptCheckpointError(f"{e} (truncated)") from None
        except StorageError:
            raise
        except OSError as e:
            raise StorageError(f"reading {storage.url_of(rel)}: {e}") from e

    # Local disk: one pread per job, many threads. Remote: one batched
    # cat_ranges per file so fsspec runs the ranges concurrently.
    if storage.is_local:
        batches = [(rel, [(off, mv)]) for rel, off, mv in jobs]
    else:
        per: Dict[str, List[Tuple[int, memoryview]]] = {}
        for rel, off, mv in jobs:
            per.setdefault(rel, []).append((off, mv))
        batches = list(per.items())
    if threads > 1 and len(batches) > 1:
        with ThreadPoolExecutor(max_workers=min(threads, len(batches)), thread_name_prefix="shardckpt-r") as ex:
            list(ex.map(run, batches))
    else:
        for b in batches:
            run(b)

    if verify and not _BENCH_NO_CHECKSUMS:
        def check(i):
            c = chunks[i]
            if c.crc32c is None:
                return None  # safetensors sources carry no checksum (see _hf)
            got = _crc.crc32c(memoryview(out[i].numpy()).cast("B")) if c.nbytes else 0
            if got != c.crc32c:
                return (
                    f"{storage.url_of(c.file)}: chunk {c.key!r} (bytes {c.byte_offset}..{c.byte_offset + c.nbytes}) "
                    f"has crc32c {got:#010x}, manifest says {c.crc32c:#010x}"
                )
            return None

        if threads > 1 and len(chunks) > 1:
            with ThreadPoolExecutor(max_workers=threads) as ex:
                bad = [m for m in ex.map(check, range(len(chunks))) if m]
        else:
            bad = [m for m in map(check, range(len(chunks))) if m]
        if bad:
            raise ChecksumMismatchError("checksum mismatch, the checkpoint is damaged: " + "; ".join(sorted(bad)[:10]))
    return out  # type: ignore[return-value]
