"""The converters' one path through the engine: no byte reading or writing code of their own.

* reading: :class:`Reader` turns a block of a source tensor (``_source.plan_blocks``)
  into wants for ``_readers.read_verified``, the reader ``load`` uses: v2
  sources are verified block by block before a byte is used; a chunk with one
  checksum (v1, a ``torch.save`` zip record) is checked from its pieces' CRCs
  joined (``checksum.combine``) in :meth:`Reader.finish`, before any commit.
* writing: each output entry is an ``_io.WriteItem`` whose bytes a
  :class:`Streamer` produces (block ``k + 1`` read while block ``k`` is
  written), written by ``_io.write_files`` through ``_save.write_rank`` (data
  files + v2 index with block CRCs, as a save's rank writes them) and committed
  by ``_format.commit``. Hugging Face files of tensors kept as saved are
  written by the reader threads themselves (:func:`_write_placed`: each
  verified piece ``pwrite``-n at its offset); casts and FP8 go through a
  :class:`Packer` and ``_io.write_packed``.

Peak memory: per output file written at once, two blocks (four when casting)
plus a block of read buffers; blocks shrink as more files are written at once.
A placed file: one mapped piece per reader thread (4 MiB) and, for small
tensors, one 4 MiB gathering buffer per thread.
"""

from __future__ import annotations

import math
import queue
import threading
import time
import uuid
from concurrent.futures import Future, ThreadPoolExecutor
from functools import partial
from typing import Any, Callable, Dict, Generator, Iterator, List, Optional, Sequence, Tuple, cast

import torch

from shardckpt import _knobs
from shardckpt._format import (
    MANIFEST_NAME,
    TensorMeta,
    checksum,
    combine,
    commit,
    data_file_name,
    index_file_name,
    itemsize,
    torch_dtype,
)
from shardckpt._format.build import RankOutput, build_manifest
from shardckpt._format.chunk import Chunk
from shardckpt._format.files import check_files
from shardckpt._io import (
    WriteItem,
    byte_view,
    host_empty,
    partition,
    split_files_by_header,
    tensor_bytes,
    write_packed,
    write_placed,
)
from shardckpt._layout import box_view
from shardckpt._readers import BufferPool, Want, read_verified
from shardckpt._save import write_rank
from shardckpt._storage import Storage
from shardckpt.errors import CheckpointExistsError, ChecksumMismatchError, format_offenders

from ._options import ConvertResult, Options, Progress
from ._source import BLOCK_BYTES, Block, OutEntry, Source, SrcTensor, block_bytes_for, plan_blocks, whole_entry

__all__ = ["WANT_BYTES", "Reader", "Streamer", "run_parallel", "write_native", "write_whole", "write_plain"]

#: Largest piece of a source chunk asked of the reader at once, cut at
#: chunk-relative multiples of it: a multiple of the v2 block size, so pieces
#: never share a checksum block (none is read twice) and up to
#: ``BLOCK_BYTES // WANT_BYTES`` are read in parallel.
WANT_BYTES = 4 << 20
#: A placed piece at least this big is written as it comes; smaller ones
#: (small tensors) are gathered per reader thread into one write.
PLACE_DIRECT_BYTES = 1 << 20


# --------------------------------------------------------------------------
# reading: wants for the one verified reader


class Reader:
    """Reads blocks of a source's tensors through ``_readers.read_verified`` (thread-safe).

    Args:
        source: what to read.
        threads: reads in flight per block.

    Raises (from the reads): ChecksumMismatchError (a v2 block), CorruptCheckpointError
    (missing or short file), StorageError; :meth:`finish` raises ChecksumMismatchError
    for whole-chunk checksums.

    Example:
        >>> r = Reader(open_checkpoint("ck")); t = r.source.tensors["w"]     # doctest: +SKIP
        >>> data = torch.cat([r.read(t, b) for b in plan_blocks(t, 0, t.numel)]); r.finish()
    """

    def __init__(self, source: Source, *, threads: Optional[int] = None):
        self.source = source
        self.storage = source.storage
        self.threads = max(1, _knobs.IO_THREADS if threads is None else threads)
        # Pieces read of chunks with one checksum for all their bytes (v1,
        # zip records): (id of tensor, chunk index) -> (tensor, [(position, length, crc)]).
        self._pieces: Dict[Tuple[int, int], Tuple[SrcTensor, List[Tuple[int, int, int]]]] = {}
        self._lock = threading.Lock()
        # The chunk last materialized by its loader: (tensor, chunk index) -> bytes.
        self._cache: Tuple[Any, Optional[torch.Tensor]] = (None, None)
        # (id of tensor, chunk index) -> (the source's chunk, the chunk read_verified is given).
        self._wanted: Dict[Tuple[int, int], Tuple[Chunk, Chunk]] = {}

    def check_source_files(self, names: Sequence[str]) -> None:
        """Every file the named tensors need exists with its recorded size."""
        if self.source.files is None:
            return
        need = {c.file for n in names for i, c in enumerate(self.source.tensors[n].chunks)
                if i not in self.source.tensors[n].loaders and c.nbytes}
        check_files(self.storage, {rel: self.source.files[rel] for rel in need if rel in self.source.files})

    def finish(self) -> None:
        """Raise if a chunk with one checksum for all its bytes (v1, zip record) does not match it.

        The reader checks block checksums (v2) before it delivers a byte; a
        whole-chunk checksum can only be checked once every piece is read
        (the pieces' CRCs joined with ``combine``): a conversion calls this
        before it commits or publishes anything.
        """
        bad = []
        for (_, idx), (t, pieces) in self._pieces.items():
            c = t.chunks[idx]
            algo, want = t.whole_check(idx)  # type: ignore[misc]  # only such chunks' pieces are kept
            crc, pos = 0, 0
            for p, n, v in sorted(pieces):
                if p != pos:
                    break  # overlapping or partial reads: not a whole-chunk check
                crc, pos = combine(algo, crc, v, n), pos + n
            if pos == c.nbytes and crc != want:
                bad.append(f"{self.storage.url_of(c.file)}: chunk {c.key!r} of tensor {t.name!r} (bytes {c.byte_offset}.."
                           f"{c.byte_offset + c.nbytes}) has {algo} {crc:#010x}, the checkpoint says {want:#010x}")
        if bad:
            more = f" ... ({len(bad) - 10} more)" if len(bad) > 10 else ""
            bad.sort()
            raise ChecksumMismatchError(
                f"checksum mismatch, the source {self.source.url} is damaged ({len(bad)} chunks): " + "; ".join(bad[:10]) + more
            )

    def _wanted_chunk(self, t: SrcTensor, idx: int) -> Chunk:
        """Chunk ``idx`` of ``t`` as ``read_verified`` is given it: named by ``t``, without a whole-chunk checksum.

        Block checksums go to the reader; a whole-chunk one is joined from
        the pieces in :meth:`finish` (``read_verified`` would read the chunk
        whole to check it), so the reader is given none.
        """
        c = t.chunks[idx]
        with self._lock:
            got = self._wanted.get((id(t), idx))
            if got is None or got[0] is not c:
                w = c if c.tensor == t.name and c.crc32c is None else c._replace(tensor=t.name, crc32c=None)
                got = self._wanted[(id(t), idx)] = (c, w)
        return got[1]

    def _loaded(self, t: SrcTensor, idx: int) -> memoryview:
        with self._lock:
            key, data = self._cache
            if key != (id(t), idx):
                data = t.loaders[idx]().contiguous()
                self._cache = ((id(t), idx), data)
        return tensor_bytes(cast(torch.Tensor, data))

    def read_into(self, t: SrcTensor, blk: Block, out: torch.Tensor, *, pool: Optional[BufferPool] = None) -> None:
        """Fill ``out`` (flat uint8, ``blk.count`` elements of ``t``) with the block's bytes, row-major."""
        wants = self.wants_into(t, blk, out)
        if wants:
            self.read_wants(wants, pool=pool)

    def wants_into(self, t: SrcTensor, blk: Block, out: torch.Tensor) -> List[Want]:
        """The reads that fill ``out`` with the block's bytes (bytes of loaded chunks are copied now).

        Several blocks' wants handed to one :meth:`read_wants` are read in
        parallel (many small tensors: one batch of reads, not one per tensor).
        """
        isz = itemsize(t.dtype)
        wants: List[Want] = []
        if blk.rows is None:
            dst = byte_view(out) if out.numel() else memoryview(bytearray(0))
            at = 0
            for s in blk.segs:
                if s.chunk in t.loaders:
                    dst[at : at + s.n] = self._loaded(t, s.chunk)[s.pos : s.pos + s.n]
                else:
                    lo, end = s.pos, s.pos + s.n
                    while lo < end:
                        hi = min(end, (lo // WANT_BYTES + 1) * WANT_BYTES)
                        wants.append(Want(self._wanted_chunk(t, s.chunk), lo, hi, (t, s.chunk, dst[at + lo - s.pos : at + hi - s.pos])))
                        lo = hi
                at += s.n
        else:
            a, b = blk.rows
            shape = t.shape
            slab = out.view((b - a,) + tuple(shape[1:-1]) + (shape[-1] * isz,))
            for s in blk.segs:
                c = t.chunks[s.chunk]
                crow = math.prod(c.sizes[1:]) * isz
                step = max(1, WANT_BYTES // crow)
                for r in range(s.pos // crow, (s.pos + s.n) // crow, step):
                    k = min(step, (s.pos + s.n) // crow - r)
                    inner = tuple(c.sizes[1:-1]) + (c.sizes[-1] * isz,)
                    dst = box_view(slab, (c.offsets[0] + r - a,) + tuple(c.offsets[1:-1]) + (c.offsets[-1] * isz,), (k,) + inner)  # type: ignore[assignment]
                    if s.chunk in t.loaders:
                        src = torch.frombuffer(self._loaded(t, s.chunk), dtype=torch.uint8)[r * crow : (r + k) * crow]
                        cast(Any, dst).copy_(src.view((k,) + inner))
                    else:
                        wants.append(Want(self._wanted_chunk(t, s.chunk), r * crow, (r + k) * crow, (t, s.chunk, dst)))
        return wants

    def wants_placed(self, t: SrcTensor, blk: Block, at: int, put: Callable[[int, memoryview], None]) -> List[Want]:
        """The reads that hand the block's bytes to ``put(pos, data)`` from the reader threads, byte ``k`` of the block at ``pos = at + k``.

        For a flat tensor's block (``blk.rows`` None) read as it is saved (no
        loaders): each piece is passed on by the thread that read and checked
        it, while in its cache (``Want.sink``), no buffer between; pieces of
        a chunk with one checksum for all its bytes are CRC-ed on the way for
        :meth:`finish`.
        """
        if blk.rows is not None or t.loaders:
            raise AssertionError(f"internal error: {t.name!r}: placed reads need a flat tensor's byte runs read from files")
        wants: List[Want] = []
        for s in blk.segs:
            lo, end = s.pos, s.pos + s.n
            while lo < end:
                hi = min(end, (lo // WANT_BYTES + 1) * WANT_BYTES)
                sink = partial(self._place, t, s.chunk, lo, at + lo - s.pos, put)
                wants.append(Want(self._wanted_chunk(t, s.chunk), lo, hi, (t, s.chunk, None), sink=sink))
                lo = hi
            at += s.n
        return wants

    def _place(self, t: SrcTensor, idx: int, start: int, pos: int, put: Callable[[int, memoryview], None],
               off: int, data: memoryview) -> None:
        check = t.whole_check(idx)
        if check is not None:
            crc = checksum(check[0], data)
            with self._lock:
                self._pieces.setdefault((id(t), idx), (t, []))[1].append((start + off, len(data), crc))
        put(pos + off, data)

    def read_wants(self, wants: List[Want], *, pool: Optional[BufferPool] = None, threads: Optional[int] = None) -> None:
        """Read ``wants`` (from :meth:`wants_into`) verified into their targets, up to ``threads`` (default ``self.threads``) at once."""
        def deliver(w: Want, data: memoryview, owner: Any, off: int) -> None:
            t, idx, dst = w.tag
            check = t.whole_check(idx)
            if check is not None:
                crc = checksum(check[0], data)
                with self._lock:
                    self._pieces.setdefault((id(t), idx), (t, []))[1].append((w.start, len(data), crc))
            if isinstance(dst, memoryview):
                dst[:] = data
            else:
                dst.copy_(torch.frombuffer(data, dtype=torch.uint8).view(dst.shape))

        read_verified(self.storage, wants, deliver, threads=threads or self.threads, pool=pool, piece_bytes=WANT_BYTES)

    def read(self, t: SrcTensor, blk: Block) -> torch.Tensor:
        """The block's elements as a new flat uint8 tensor, row-major."""
        out = host_empty(blk.count * itemsize(t.dtype))
        self.read_into(t, blk, out)
        return out


class _Stopped(Exception):
    """Another output file failed; this one gave up."""


class Streamer:
    """Streams entries' bytes, in their output dtype, for one output file at a time.

    :meth:`slabs` yields an entry's blocks in order, block ``k + 1`` read
    (verified, cast) on a helper thread while block ``k`` is written; the two
    block buffers (four when casting) and the read buffers are reused across
    entries (large buffers freed per block fragment malloc's arenas: RSS creeps).
    ``stop``: set by a failing sibling; the next block read raises. Call :meth:`close`.

    Example:
        >>> s = Streamer(reader); [f.write(piece) for piece in s.slabs(entry)]; s.close()   # doctest: +SKIP
    """

    def __init__(self, reader: Reader, *, block_bytes: int = BLOCK_BYTES, progress: Optional["Progress"] = None,
                 stop: Optional[threading.Event] = None):
        self.reader = reader
        self.block_bytes = block_bytes
        self.progress = progress
        self.stop = stop
        self.pool = BufferPool(block_bytes, slot_bytes=min(WANT_BYTES, block_bytes))
        self._ex = ThreadPoolExecutor(max_workers=1, thread_name_prefix="shardckpt-cr")
        self._bufs: Dict[Tuple[str, int], torch.Tensor] = {}

    def close(self) -> None:
        self._ex.shutdown(wait=True)
        self.pool.close()
        self._bufs.clear()

    def _buf(self, role: str, k: int, n: int) -> torch.Tensor:
        if n > self.block_bytes:
            return host_empty(n)  # one row wider than a block
        key = (role, k % 2)
        got = self._bufs.get(key)
        if got is None:
            got = self._bufs[key] = host_empty(self.block_bytes)
        return got[:n]

    def _read(self, e: OutEntry, blk: Block, k: int) -> memoryview:
        if self.stop is not None and self.stop.is_set():
            raise _Stopped()
        raw = self._buf("raw", k, blk.count * itemsize(e.src.dtype))
        self.reader.read_into(e.src, blk, raw, pool=self.pool)
        if e.quant is not None:  # block FP8: codes of this block, by the scales the first pass found
            out = self._buf("cast", k, blk.count * itemsize(e.dtype))
            e.quant.encode(raw, blk.start, blk.count, out)
            raw = out
        elif e.dtype != e.src.dtype:
            out = self._buf("cast", k, blk.count * itemsize(e.dtype))
            if blk.count:
                out.view(torch_dtype(e.dtype)).copy_(raw.view(torch_dtype(e.src.dtype)))
            raw = out
        return byte_view(raw) if raw.numel() else memoryview(b"")

    def slabs(self, e: OutEntry) -> Iterator[memoryview]:
        """``e``'s bytes in blocks, in order; each valid until the next is asked for."""
        blocks = plan_blocks(e.src, e.start, e.stop, block_bytes_for(e.src.dtype, e.dtype, self.block_bytes))
        fut: Optional[Future] = self._ex.submit(self._read, e, blocks[0], 0) if blocks else None
        try:
            for k in range(len(blocks)):
                data = fut.result()  # type: ignore[union-attr]
                # Buffer (k + 1) % 2 held block k - 1, already written.
                fut = self._ex.submit(self._read, e, blocks[k + 1], k + 1) if k + 1 < len(blocks) else None
                yield data
                if self.progress is not None:
                    self.progress.update(len(data))
        finally:
            if fut is not None:  # the writer stopped early: no read may fill a buffer after this
                fut.cancel()
                try:
                    fut.result()
                except BaseException:  # noqa: BLE001 - the writer's error is the one raised
                    pass

    def item(self, e: OutEntry) -> WriteItem:
        """``e`` as a chunk for ``_io.write_files``, its bytes streamed from the source."""
        return WriteItem(name=e.name or e.key, key=e.key, dtype=e.dtype, offsets=tuple(e.offsets), sizes=tuple(e.shape),
                         tensor=None, stream=partial(self.slabs, e))


#: Buffers of a :class:`Packer`: one being written while the next is read.
PACK_DEPTH = 2


class Packer:
    """One output file's bytes (its entries concatenated in file order) in pieces of ``piece_bytes``.

    A producer thread reads (verified, cast) the entries into a ring of
    ``PACK_DEPTH`` buffers, many small tensors packed into one buffer and
    read as one parallel batch, and crosses entry boundaries freely: the next
    tensors are read while the writer writes the current buffer, and every
    ``write`` call (but a file's last) gets about ``piece_bytes``. The bytes
    are read straight into the buffer that is written (a cast or a block
    FP8 encode goes through one scratch block). Memory: ``PACK_DEPTH`` (+1 when casting) buffers plus
    a block of read buffers; a single row wider than a buffer gets one of its own.
    ``stop``: set by a failing sibling; the producer stops at its next block.

    Example:
        >>> p = Packer(reader); write_packed(storage, rel, shells, p.pieces(entries)); p.close()   # doctest: +SKIP
    """

    def __init__(self, reader: Reader, *, piece_bytes: int = BLOCK_BYTES, progress: Optional["Progress"] = None,
                 stop: Optional[threading.Event] = None):
        self.reader = reader
        self.piece_bytes = piece_bytes
        self.progress = progress
        self.stop = stop
        self.pool = BufferPool(piece_bytes, slot_bytes=min(WANT_BYTES, piece_bytes))
        self._scratch: Optional[torch.Tensor] = None

    def close(self) -> None:
        self.pool.close()
        self._scratch = None

    def _produce(self, entries: Sequence[OutEntry], free: "queue.Queue[Optional[torch.Tensor]]",
                 full: "queue.Queue[Any]", quit: threading.Event) -> None:
        try:
            buf: Optional[torch.Tensor] = None
            at = 0
            wants: List[Want] = []

            def ship() -> None:
                nonlocal buf, at
                if wants:
                    self.reader.read_wants(wants, pool=self.pool)
                    wants.clear()
                if buf is not None and at:
                    full.put((buf, at, buf))
                    buf = None
                at = 0

            def room(n: int) -> torch.Tensor:
                nonlocal buf, at
                if buf is not None and at + n > self.piece_bytes:
                    ship()
                if buf is None:
                    buf = free.get()
                    if buf is None or quit.is_set():
                        raise _Stopped()
                view = buf[at : at + n]
                at += n
                return view

            for e in entries:
                bb = block_bytes_for(e.src.dtype, e.dtype, self.piece_bytes)
                for blk in plan_blocks(e.src, e.start, e.stop, bb):
                    if quit.is_set() or (self.stop is not None and self.stop.is_set()):
                        raise _Stopped()
                    n_src, n_out = blk.count * itemsize(e.src.dtype), blk.count * itemsize(e.dtype)
                    if n_out > self.piece_bytes or n_src > self.piece_bytes:
                        ship()
                        # A ring buffer is held while the big one is in flight: memory stays bounded.
                        token = free.get()
                        if token is None or quit.is_set():
                            raise _Stopped()
                        big = host_empty(n_out)
                        self._read_block(e, blk, big, n_src)
                        full.put((big, n_out, token))
                        continue
                    dst = room(n_out)
                    if e.dtype == e.src.dtype and e.quant is None:
                        wants.extend(self.reader.wants_into(e.src, blk, dst))
                    else:
                        self._read_block(e, blk, dst, n_src)
            ship()
            full.put(None)
        except BaseException as exc:  # noqa: BLE001 - handed to the consumer, raised there
            full.put(exc)

    def _read_block(self, e: OutEntry, blk: Block, dst: torch.Tensor, n_src: int) -> None:
        """``dst`` gets the block in the output dtype: read into it, or read into scratch then cast/encode (block FP8)."""
        if e.dtype == e.src.dtype and e.quant is None:
            self.reader.read_into(e.src, blk, dst, pool=self.pool)
            return
        if n_src > self.piece_bytes:
            raw = host_empty(n_src)
        else:
            if self._scratch is None:
                self._scratch = host_empty(self.piece_bytes)
            raw = self._scratch[:n_src]
        self.reader.read_into(e.src, blk, raw, pool=self.pool)
        if e.quant is not None:  # block FP8: codes of this block, by the scales the first pass found
            e.quant.encode(raw, blk.start, blk.count, dst)
        elif blk.count:
            dst.view(torch_dtype(e.dtype)).copy_(raw.view(torch_dtype(e.src.dtype)))

    def pieces(self, entries: Sequence[OutEntry]) -> Generator[memoryview, None, None]:
        """The entries' bytes in order, in pieces; each valid until the next is asked for."""
        free: "queue.Queue[Optional[torch.Tensor]]" = queue.Queue()
        full: "queue.Queue[Any]" = queue.Queue()
        for _ in range(PACK_DEPTH):
            free.put(host_empty(self.piece_bytes))
        quit = threading.Event()
        producer = threading.Thread(target=self._produce, args=(entries, free, full, quit), name="shardckpt-pack", daemon=True)
        producer.start()
        try:
            while True:
                got = full.get()
                if got is None:
                    return
                if isinstance(got, BaseException):
                    raise got
                buf, n, ring = got
                yield byte_view(buf[:n])
                del buf
                if self.progress is not None:
                    self.progress.update(n)
                free.put(ring)  # written: the producer may fill it again
        finally:
            # The writer stopped early (or finished): no read may fill a buffer after this.
            quit.set()
            free.put(None)
            producer.join()


class _Placer:
    """``put(pos, data)`` for :func:`_io.write_placed`, called by reader threads: a large piece is written at once,
    small adjacent ones (many small tensors) are gathered per thread into one write of up to ``stage_bytes``.

    Call :meth:`flush` once the reads are done. ``stop``: set by a failing
    sibling file; the next piece raises.
    """

    def __init__(self, put: Callable[[int, memoryview], None], *, progress: Optional["Progress"], stop: Optional[threading.Event],
                 stage_bytes: int = WANT_BYTES, direct_bytes: int = PLACE_DIRECT_BYTES):
        self._put = put
        self._progress = progress
        self._stop = stop
        self._stage_bytes = stage_bytes
        self._direct = direct_bytes
        self._local = threading.local()
        self._lock = threading.Lock()
        self._stages: List[List[Any]] = []  # per thread: [buffer, data position, bytes held]

    def _stage(self) -> List[Any]:
        st = getattr(self._local, "st", None)
        if st is None:
            st = self._local.st = [None, 0, 0]
            with self._lock:
                self._stages.append(st)
        return st

    def _flush(self, st: List[Any]) -> None:
        if st[2]:
            self._put(st[1], memoryview(st[0])[: st[2]])
            st[2] = 0

    def __call__(self, pos: int, data: memoryview) -> None:
        if self._stop is not None and self._stop.is_set():
            raise _Stopped()
        n = len(data)
        st = self._stage()
        if st[2] and (pos != st[1] + st[2] or st[2] + n > self._stage_bytes):
            self._flush(st)
        if n >= self._direct:
            self._put(pos, data)
        else:
            if st[0] is None:
                st[0] = bytearray(self._stage_bytes)
            if not st[2]:
                st[1] = pos
            st[0][st[2] : st[2] + n] = data
            st[2] += n
        if self._progress is not None:
            with self._lock:
                self._progress.update(n)

    def flush(self) -> None:
        """Write what every thread gathered (the reads have ended: no thread adds more)."""
        for st in self._stages:
            self._flush(st)
            st[0] = None


def _placeable(e: OutEntry) -> bool:
    """Whether ``e``'s bytes go to its file as they are saved: same dtype, no encoding, byte runs of files (placed reads)."""
    return e.dtype == e.src.dtype and e.quant is None and e.src.flat and not e.src.loaders


def placed_threads(threads: int, cpus: int) -> int:
    """Reader threads of one placed file given ``threads`` of reads in flight: each thread reads then writes its
    piece, so twice as many keep ``threads`` of each in flight, where the cores allow (no more threads than cores
    beyond ``threads``: on a small machine the work is CPU-bound and extra threads only fight).

    Example:
        >>> placed_threads(4, 16), placed_threads(4, 2), placed_threads(1, 1)
        (8, 4, 1)
    """
    return max(1, min(2 * threads, max(threads, cpus)))


def _write_placed(storage: Storage, rel: str, ents: Sequence[OutEntry], reader: Reader, *, piece_bytes: int,
                  progress: Optional["Progress"], stop: Optional[threading.Event], threads: int) -> None:
    """One plain safetensors file of placeable entries: the reader threads write what they read and verified (``_io.write_placed``).

    One batch of reads for the whole file (neighbouring small tensors
    coalesced into one read), each thread's pieces written at their offsets
    by ``pwrite`` as soon as checked: reads and writes of different pieces
    overlap across the threads, every write is one piece (or a gathered run
    of small tensors), and no buffer holds bytes between read and write.
    """
    shells = [WriteItem(e.name or e.key, e.key, e.dtype, tuple(e.offsets), tuple(e.shape), None) for e in ents]

    def fill(put: Callable[[int, Any], None]) -> None:
        placer = _Placer(put, progress=progress, stop=stop)
        wants: List[Want] = []
        at = 0
        for e in ents:
            for blk in plan_blocks(e.src, e.start, e.stop, BLOCK_BYTES):
                wants.extend(reader.wants_placed(e.src, blk, at, placer))
                at += blk.count * itemsize(e.dtype)
        pool = BufferPool(piece_bytes, slot_bytes=min(WANT_BYTES, piece_bytes))
        try:
            reader.read_wants(wants, pool=pool, threads=threads)
        finally:
            pool.close()
        placer.flush()

    write_placed(storage, rel, shells, fill)


# --------------------------------------------------------------------------
# writing


def _write_streamed(
    groups: Dict[Any, Dict[str, List[OutEntry]]],
    reader: Reader,
    write: Callable[[Any, Dict[str, List[WriteItem]], int], Any],
    *,
    threads: int,
    progress: "Progress",
) -> Dict[Any, Any]:
    """``write(group, {file: items}, threads)`` for every group (a rank, or plain files), items streamed from ``reader``.

    Groups run in parallel and ``write`` over a group's files; reads and block
    memory are shared out so that about ``threads`` reads are in flight.
    """
    nfiles = sum(len(files) for files in groups.values())
    busy = max(1, min(threads, nfiles))
    reader.threads = max(1, threads // busy)
    stop = threading.Event()  # one file failed: the others stop at their next block
    streamers: List[Streamer] = []

    def one(key: Any) -> Any:
        files = {}
        for rel, ents in groups[key].items():
            # Files written at once share the memory budget: blocks shrink as their number grows.
            s = Streamer(reader, block_bytes=max(WANT_BYTES, BLOCK_BYTES // busy), progress=progress, stop=stop)
            streamers.append(s)
            files[rel] = [s.item(e) for e in ents]
        return write(key, files, max(1, busy // len(groups)) if len(groups) > 1 else busy)

    try:
        keys = list(groups)
        return dict(zip(keys, run_parallel(one, keys, workers=min(busy, len(keys)), stop=stop)))
    finally:
        for s in streamers:
            s.close()


def _write_packed(storage: Storage, files: Dict[str, List[OutEntry]], reader: Reader, *, threads: int,
                  progress: "Progress") -> None:
    """Write plain safetensors files, each by its :class:`Packer` (reads overlap writes, large writes), ``threads`` of reads in flight.

    Files are written in parallel (up to ``threads``), sharing the memory
    budget: pieces shrink (to ``WANT_BYTES``) as more files are written at once.
    """
    busy = max(1, min(threads, len(files)))
    reader.threads = max(1, threads // busy)
    stop = threading.Event()  # one file failed: the others stop at their next block
    piece = max(WANT_BYTES, BLOCK_BYTES // busy)

    def one(rel: str) -> None:
        ents = files[rel]
        if _knobs.EXPORT_PLACED and storage.caps.positional_write and all(_placeable(e) for e in ents):
            _write_placed(storage, rel, ents, reader, piece_bytes=piece, progress=progress, stop=stop,
                          threads=placed_threads(reader.threads, _knobs.usable_cpus() // busy))
            return
        p = Packer(reader, piece_bytes=piece, progress=progress, stop=stop)
        shells = [WriteItem(e.name or e.key, e.key, e.dtype, tuple(e.offsets), tuple(e.shape), None) for e in ents]
        pieces = p.pieces(ents)
        try:
            write_packed(storage, rel, shells, pieces)
        finally:
            # A failed write ends the producer now (not when its traceback is freed), before its pool closes.
            pieces.close()
            p.close()

    rels = list(files)
    run_parallel(one, rels, workers=busy, stop=stop)
    storage.fsync_dirs({rel.rsplit("/", 1)[0] if "/" in rel else "" for rel in rels})


def run_parallel(fn: Callable[[Any], Any], args: Sequence[Any], *, workers: int, stop: threading.Event) -> List[Any]:
    """``[fn(a) for a in args]`` on up to ``workers`` threads; a failure sets ``stop`` and is raised once all have ended.

    Siblings that gave up on ``stop`` raise ``_Stopped``; the error raised
    is the first real one.
    """

    def run(a: Any) -> Any:
        try:
            return fn(a)
        except BaseException:
            stop.set()
            raise

    if workers <= 1 or len(args) <= 1:
        return [run(a) for a in args]
    with ThreadPoolExecutor(max_workers=workers, thread_name_prefix="shardckpt-cw") as ex:
        futs = [ex.submit(run, a) for a in args]
        errors = [f.exception() for f in futs if f.exception() is not None]
    if errors:
        raise next((e for e in errors if not isinstance(e, _Stopped)), errors[0])  # type: ignore[misc]  # only failed futures are listed
    return [f.result() for f in futs]


def _sorted(entries: List[OutEntry]) -> List[OutEntry]:
    # Widest dtypes first (as safetensors does): with the header padded to 8
    # bytes every entry then starts aligned to its element size.
    return sorted(entries, key=lambda e: (-itemsize(e.dtype), e.key))


def write_native(
    dst_url: str,
    ranks: Dict[int, Dict[str, List[OutEntry]]],
    reader: Reader,
    opts: Options,
    *,
    tensors: Dict[str, Tuple[str, Tuple[int, ...], Optional[Dict[str, Any]], Optional[Dict[str, Any]]]],
    values: Any,
    world_size: int,
    extra: Optional[Dict[str, Any]] = None,
    desc: str = "convert",
) -> ConvertResult:
    """Write a native checkpoint in the newest format (what ``save`` writes), as a save's ranks would: ``_save.write_rank`` per rank, then ``commit``.

    Args:
        ranks: writing rank -> {file tag (``data/<save id>-<tag>.safetensors``):
            entries with ``name`` and ``offsets``}; each rank gets its index file.
        reader: the source; its whole-chunk checksums are checked before the commit.
        opts: the converter's options (``dst_storage_options``, ``overwrite``,
            ``io_threads``, ``progress`` are used here).
        tensors: output tensor -> ``(dtype, shape, layout, regular)``; ``regular``
            is the v2 layout record (``mesh_shape``, ``placements``, ``mesh`` 0:
            all ranks, ``rotation``) of tensors whose chunks are that layout's,
            None for chunks listed by their writers' index files only.
        values / world_size / extra: manifest fields; ``desc``: the progress bar's.

    Raises:
        CheckpointExistsError: committed checkpoint at ``dst_url`` and not ``overwrite``.
        ChecksumMismatchError / CorruptCheckpointError / StorageError: nothing
            committed, the files written removed.

    Example:
        >>> write_native("out", {0: {"00": [whole_entry(t, "w", native=True)]}}, Reader(src), Options(),   # doctest: +SKIP
        ...              tensors={"w": (t.dtype, t.shape, None, None)}, values=None, world_size=1)
    """
    overwrite = opts.overwrite
    t0 = time.perf_counter()
    dst = Storage(dst_url, storage_options=opts.dst_storage_options)
    if dst.exists(MANIFEST_NAME) and not overwrite:
        raise CheckpointExistsError(f"{dst.url_of(MANIFEST_NAME)} already exists; pass overwrite=True to replace it")
    if not overwrite:
        try:
            there = dst.listdir("")
        except (FileNotFoundError, NotADirectoryError):
            there = []
        if there:
            # Someone's directory (another run, a DCP checkpoint, a typo): a
            # conversion does not mix its files into it unasked.
            raise CheckpointExistsError(
                f"{dst.url} is not empty (it holds {format_offenders(there, limit=5)}); write the output to a new "
                "directory, or pass overwrite=True to write into this one"
            )
    save_id = uuid.uuid4().hex
    block_bytes = _knobs.BLOCK_BYTES
    # Headers stay under the limit, as save's files do.
    named = {
        r: {data_file_name(save_id, tag): ents for tag, ents in split_files_by_header({t: _sorted(e) for t, e in files.items() if e}).items()}
        for r, files in ranks.items()
    }
    named = {r: files for r, files in named.items() if files}
    data = sorted(rel for files in named.values() for rel in files)
    total = sum(e.nbytes for files in named.values() for ents in files.values() for e in ents)
    bar = Progress(total, opts.progress, desc)
    try:
        def write(rank, files, n):
            return write_rank(dst, files, save_id, rank, threads=n, block_bytes=block_bytes)

        results = _write_streamed(named, reader, write, threads=opts.io_threads, progress=bar)
        reader.finish()
        metas = {name: TensorMeta(dtype=dt, shape=list(shape), layout=layout, regular=reg)
                 for name, (dt, shape, layout, reg) in tensors.items()}
        outputs = [RankOutput(rank, chunks, {rel: f.size for rel, f in fmetas.items()}, index)
                   for rank, (chunks, fmetas, index) in sorted(results.items())]
        m = build_manifest(metas, outputs, world_size=world_size, values=values, save_id=save_id, block_bytes=block_bytes,
                           meshes=["iota"] if any(t.regular for t in metas.values()) else [], extra=extra, check_regular=True)
        commit(dst, m, replace=overwrite)
    except BaseException:
        for rel in data + [index_file_name(save_id, r) for r in named]:
            try:
                dst.remove(rel)
            except Exception:
                pass
        raise
    finally:
        bar.close()
    return ConvertResult(dst.url, data, len(metas), total, time.perf_counter() - t0)


def write_whole(source: Source, dst_url: str, names: Dict[str, str], opts: Options, *, check_sizes: bool = True,
                **native: Any) -> ConvertResult:
    """Write ``source``'s tensors ``{source name: output name}`` whole, as a world-size-1 native checkpoint.

    The imports' common tail: one chunk per tensor, in a few files of balanced
    size (``_io.partition``, as a save spreads a rank's chunks), layouts kept.
    ``check_sizes``: check the source files' sizes first (skip it where they
    were just listed); ``native``: :func:`write_native`'s manifest fields (values, extra, desc).
    """
    threads = opts.io_threads
    entries = {new: whole_entry(source.tensors[old], new, native=True) for old, new in names.items()}
    reader = Reader(source, threads=threads)
    if check_sizes:
        reader.check_source_files(list(names))
    # Plan the files on placeholder items: partition balances bytes and keeps the safetensors order.
    shells = [WriteItem(e.name, e.key, e.dtype, e.offsets, e.shape, None) for e in entries.values()]
    files = {f"{i:02d}": [entries[it.name] for it in g] for i, g in enumerate(partition(shells, threads))}
    tensors: Dict[str, Tuple[str, Tuple[int, ...], Optional[Dict[str, Any]], Optional[Dict[str, Any]]]] = {
        new: (source.tensors[old].dtype, source.tensors[old].shape, source.tensors[old].layout, None) for old, new in names.items()
    }
    return write_native(dst_url, {0: files}, reader, opts, tensors=tensors, world_size=1, **native)


# --------------------------------------------------------------------------
# plain safetensors outputs (HF directories, single files)


def write_plain(
    storage: Storage,
    files: Dict[str, List[OutEntry]],
    reader: Reader,
    opts: Options,
    *,
    index: Optional[bytes] = None,
    index_name: str = "",
    desc: str = "export",
) -> ConvertResult:
    """Write plain safetensors files (no shardckpt metadata) into ``storage``, then ``index`` (the HF index) last.

    The native outputs' writer (``_io.write_files``); its block CRCs are not
    kept: a Hugging Face file has no place for them. The source is fully
    verified before the index is written; publication is the caller's.

    Raises:
        ChecksumMismatchError / CorruptCheckpointError / StorageError: the files written are removed.

    Example:
        >>> write_plain(Storage("hf"), {"model.safetensors": entries}, reader, Options())   # doctest: +SKIP
    """
    t0 = time.perf_counter()
    total = sum(e.nbytes for ents in files.values() for e in ents)
    bar = Progress(total, opts.progress, desc)

    try:
        _write_packed(storage, {rel: _sorted(ents) for rel, ents in files.items()}, reader, threads=opts.io_threads, progress=bar)
        reader.finish()
        if index is not None:
            storage.write_atomic(index_name, index)
    except BaseException:
        for rel in files:
            try:
                storage.remove(rel)
            except Exception:
                pass
        raise
    finally:
        bar.close()
    out = sorted(files) + ([index_name] if index is not None else [])
    return ConvertResult(storage.url, out, sum(len(v) for v in files.values()), total, time.perf_counter() - t0)
