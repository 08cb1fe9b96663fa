"""The one verified ranged reader: only the bytes asked for, checked, through bounded buffers.

No torch here (``verify``, the converters and ``shardckpt inspect`` use it
where torch is absent); it works on plain memoryviews.

A caller names the bytes it wants (:class:`Want`: a byte range inside one
saved chunk, the :class:`~shardckpt._format.chunk.Chunk` that
``_format.resolve`` produces). The reader

1. plans (pure, :func:`plan_ranges`): rounds each want out to the chunk's
   checksum units — blocks of ``block_bytes`` when the chunk has block
   checksums (format v2), the whole chunk otherwise (v1) — and coalesces
   neighbouring units of a file into ranges of at most ``range_bytes``
   (a want is never split across ranges; a unit larger than that gets a range
   of its own, sized exactly). Units at most ``gap_bytes`` apart share a
   range too: the bytes between them are read and discarded, never checked
   nor delivered. :func:`coalesce_gap` picks the gap for a storage — the
   ``SHARDCKPT_COALESCE_GAP_BYTES`` knob where each request is a network
   round trip (object stores), 0 on local disk, where a second ``pread``
   costs less than reading bytes nobody needs;
2. reads each range into a buffer taken from a :class:`BufferPool` (bounded
   by bytes; buffers reused; a caller-supplied allocator makes them pinned
   for CUDA targets), several I/O threads at a time, each thread checksumming
   the bytes it just read;
3. in the caller's thread, in plan order, checks every unit's CRC-32C, then
   hands each want's bytes to ``deliver`` — never a byte that failed or was
   not checked — and returns the buffer to the pool once ``deliver``'s fence
   (if any: an asynchronous device copy) is done.

One pass (issue 43): a want with a ``sink`` (a CPU tensor's bytes, in the
load) is handed its bytes by the reader thread itself. Its range is cut into
pieces at checksum-unit ends, so the thread that reads a piece checks every
unit under it alone and copies the piece out while it is in cache; on a
storage that maps files (``Storage.can_map``: local files;
``SHARDCKPT_LOAD_MAP``) a range whose wants all have sinks takes no buffer:
each piece is checked and copied straight out of a mapping of the file, and
such ranges grow to :data:`MAPPED_RANGE_BYTES` (fewer for the caller's
thread to submit and finish). A piece of a file in memory (tmpfs:
``Storage.open_hot``; ``SHARDCKPT_LOAD_INTO``) is read with ``preadv``
instead, into the thread's scratch for live tensors (the same check-then-copy
in cache, no page-table fill and teardown per piece) or straight into
staging tensors (:func:`_into_job`). A piece with a damaged unit is not copied, and
once one is found no thread copies more; the caller's thread still raises as
above. Each job is handed only the units and sinks its piece overlaps, and
reports how many units it held whole with a matching CRC: when a range's
units all came back so (the usual case), the caller's thread joins no
parts.

Lanes (wave 12): on a storage whose files go through a kernel readahead
(``Storage.lane_bytes``: local files on a block device), the pieces of a
mapped range, or (``SHARDCKPT_LOAD_LANES=all``) of a run of neighbouring
buffered ranges (at most the pool's share of one thread), are one job that one thread runs in file order
through one kept file (``Storage.open_lane``); each piece still reports to
its own future, so ranges are finished in plan order as before.

Peak memory: the pool's capacity, or one oversized unit (a v1 chunk larger
than the pool) plus nothing else in flight; mapped pieces hold no buffer
(at most ``2 * threads`` ranges of them in flight, each mapping closed once
copied).
"""

from __future__ import annotations

import mmap
import threading
from bisect import bisect_right
from collections import deque
from concurrent.futures import FIRST_EXCEPTION, Future, ThreadPoolExecutor, wait
from dataclasses import dataclass, field
from typing import Any, Callable, Deque, Dict, List, NamedTuple, Optional, Sequence, Tuple, Type, cast

from . import _knobs
from ._format.checksum import CHECK_COPIES, COPY_FUSED, check_copy, copy_crc32c, crc32c, crc32c_combine
from ._format.chunk import Chunk
from ._storage import Storage
from .errors import ChecksumMismatchError, CorruptCheckpointError, StorageError

__all__ = [
    "Want",
    "Unit",
    "ReadRange",
    "Buffer",
    "BufferPool",
    "ReadStats",
    "plan_ranges",
    "coalesce_gap",
    "read_verified",
    "damaged_units",
]

#: Mismatches listed in one error before "... (N more)".
_MAX_LISTED = 10
#: Largest range of a mapped read (wants that all have sinks, on a storage that
#: maps files) when the caller names no range size, and at most the pool's
#: capacity: no buffer holds it, each of its pieces is mapped, checked and
#: copied on its own.
MAPPED_RANGE_BYTES = 32 << 20
#: A piece in memory (tmpfs) read straight into its destinations (``Want.into``) is read
#: and checked this many bytes at a time at most (a checksum block of 1 MiB is
#: one read): the CRC runs over bytes still in the reader's cache.
INTO_STEP_BYTES = 1 << 20
#: Largest piece of a file in memory read into the reader thread's scratch
#: (a piece that cannot go straight into its destinations: a live tensor,
#: which must not see a byte of a piece until all of it verified, or bytes
#: read only to be checked); larger ones (v1 whole-chunk CRCs) are mapped.
SCRATCH_MAX_BYTES = 16 << 20
#: Read piece of a range whose wants go to sinks (``Want.sink``: bytes that land
#: in CPU tensors as they are) where its pieces are read into the reader's
#: scratch (tmpfs with ``SHARDCKPT_LOAD_INTO``, few cores; a disk file's lanes,
#: one piece a thread): the reader reads it, checks its CRCs and copies it out
#: while it is still in its cache, so a few MiB, cut at checksum-block ends.
SCRATCH_PIECE_BYTES = 4 << 20
#: The same where pieces are mapped (``LOAD_INTO`` off: the default above 4
#: CPUs). Each piece costs a mapping, its teardown (a TLB shootdown across the
#: process's threads) and a job's Python under the GIL: on a 16-core H100
#: host, 1 GiB from tmpfs loaded at 18.5 GB/s in 8 MiB pieces, 14.8 in 4 MiB
#: and 20.7 in 16 MiB (the HF directory 25.1, 28.4), but each reader holds a
#: piece's pages mapped: 8 MiB kept a load's peak extra RSS at 107 MiB where
#: 16 MiB took 217 MiB (docs/performance.md, wave 15).
MAPPED_PIECE_BYTES = 8 << 20
#: A mapped piece with sinks is checked and delivered this many bytes at a
#: time (whole checksum units, at least one): a step's CRCs, then its copies
#: out, while the step is still in the reader core's L2, so the mapping is
#: read from memory once, not twice (CRC pass, then copy pass). Every
#: delivered byte is still verified, but a damaged block then leaves only its
#: step and the rest of the piece undelivered, where 0 (the default: the
#: whole piece checked, then copied) leaves the whole piece unchanged. In
#: Python, 1 MiB steps cost a quarter on a 16-core H100 host (10.6 against
#: 14.1 GB/s: a step's calls under the GIL, 16 readers); by the C kernel
#: (:func:`check_copy`) 1.03-1.07x on the 2-core VM, not yet measured on 16 cores
#: (docs/performance.md, wave 16): an experiment until it is.
MAPPED_STEP_BYTES = 0
#: The same for a piece read into the reader's scratch (``SHARDCKPT_LOAD_INTO``):
#: read, checked and copied out a step at a time. 0: read whole, then checked
#: whole, then copied (on the 2-core box steps changed nothing, wave 15).
SCRATCH_STEP_BYTES = 0
#: 1: pieces whose sinks all have destination memory (``Want.into``) are
#: checked and copied by the C kernel (``checksum.check_copy``), the GIL
#: taken once a piece, where it is built; 0: in Python (an experiment).
CHECK_IN_KERNEL = 1
#: Huge-page size the scratch is aligned to (x86-64 and aarch64 with 4 KiB pages).
_HUGE_BYTES = 2 << 20
_tls = threading.local()


@dataclass(frozen=True)
class Want:
    """Bytes ``[start, stop)`` of ``chunk`` that a caller needs, labelled ``tag`` for delivery.

    ``sink``: where the bytes go when the caller can take them in any
    thread, in parts: ``sink(pos, data)`` gets bytes ``[start + pos, start +
    pos + len(data))`` from the reader thread that read and verified them,
    while they are still in its cache (see :func:`read_verified`); ``deliver``
    is then not called for this want. ``into``/``restore``: see below.
    """

    chunk: Chunk
    start: int
    stop: int
    tag: Any = None
    sink: Optional[Callable[[int, Optional[memoryview]], None]] = field(default=None, compare=False, repr=False)
    #: With ``sink``: the destination's own writable bytes (exactly ``stop -
    #: start``), which a reader may read straight into; ``sink(pos, None)``
    #: then says bytes from ``pos`` landed there, verified.
    into: Optional[memoryview] = field(default=None, compare=False, repr=False)
    #: With ``into``: whether its previous bytes must survive a damaged read
    #: (the live state: never read into while checksums are checked, its
    #: piece is verified in scratch first); False for staging memory.
    restore: bool = field(default=True, compare=False, repr=False)


class Unit(NamedTuple):
    """One checksum unit a range verifies: file bytes ``[start, stop)`` and their expected CRC-32C.

    ``block``: the chunk's block number, or -1 when the unit is the whole chunk (v1).
    """

    start: int
    stop: int
    crc: int
    chunk: Chunk
    block: int

    @property
    def label(self) -> str:
        """How messages name it: ``"w chunk 'w/0' block 3"`` (the chunk's label alone for a whole chunk)."""
        return self.chunk.label if self.block < 0 else f"{self.chunk.label} block {self.block}"


@dataclass
class ReadRange:
    """One read: bytes ``[start, stop)`` of ``file``, the wants it serves and the units it verifies."""

    file: str
    start: int
    stop: int
    wants: List[Want] = field(default_factory=list)
    units: List[Unit] = field(default_factory=list)

    @property
    def nbytes(self) -> int:
        return self.stop - self.start


@dataclass
class ReadStats:
    """What a read did: bytes asked for, bytes read (the difference is block rounding and gaps).

    ``gap_bytes``: bytes read only to join two ranges into one request
    (counted in ``read_bytes``); ``requests``: storage reads issued;
    ``sent_bytes``/``received_bytes``: bytes of replicated ranges this rank
    sent to / received from the other holders instead of reading them
    (``shardckpt/_replicas.py``); ``verified_bytes``: bytes whose CRC-32C
    this rank checked (its reads, and what it checked on arrival).
    """

    wanted_bytes: int = 0
    read_bytes: int = 0
    ranges: int = 0
    peak_buffer_bytes: int = 0
    gap_bytes: int = 0
    requests: int = 0
    sent_bytes: int = 0
    received_bytes: int = 0
    verified_bytes: int = 0
    #: Bytes of the ranges this rank's load needs (set by ``_load.stream_into``; reads for others not counted).
    needed_bytes: int = 0


def _units_of(w: Want) -> List[Unit]:
    c = w.chunk
    if c.blocked:
        b = c.block_bytes
        lo, hi = c.unit_bounds(w.start, w.stop)
        return [
            Unit(c.byte_offset + s, c.byte_offset + min(s + b, c.nbytes), c.block_crcs[s // b], c, s // b)
            for s in range(lo, hi, b)
        ]
    if c.crc32c is not None:
        return [Unit(c.byte_offset, c.byte_offset + c.nbytes, c.crc32c, c, -1)]
    return []


def coalesce_gap(storage: Any) -> int:
    """Bytes between two needed ranges of a file worth reading to save a request on ``storage``.

    ``SHARDCKPT_COALESCE_GAP_BYTES`` (read at call time) where every request
    is a network round trip (``storage.caps.high_latency``: object stores),
    else 0: a local read of unneeded bytes costs more than another ``pread``.

    >>> coalesce_gap(None)
    0
    """
    caps = getattr(storage, "caps", None)
    return _knobs.COALESCE_GAP_BYTES if caps is not None and caps.high_latency else 0


def plan_ranges(
    wants: Sequence[Want], *, range_bytes: Optional[int] = None, gap_bytes: int = 0
) -> List[ReadRange]:
    """Group wants into coalesced, verifiable reads (pure: no I/O).

    Args:
        wants: byte ranges of saved chunks; empty ones are skipped.
        range_bytes: a range grows to at most this many bytes, unless one
            want's checksum units alone are larger (default
            ``SHARDCKPT_LOAD_RANGE_BYTES``, read now).
        gap_bytes: neighbours at most this far apart in a file share a read
            (default 0: only touching or overlapping ones — bytes between
            wants are bytes not needed, and a local read costs little); the
            range still stays within ``range_bytes``. The gap's bytes are
            read, never checked or delivered.

    Raises:
        CorruptCheckpointError: a want outside its chunk, or a chunk whose
            block checksums do not cover it.

    Example:
        >>> c = Chunk("a", 0, 10, block_bytes=4, block_crcs=(1, 2, 3))
        >>> [(r.start, r.stop) for r in plan_ranges([Want(c, 5, 6)])]
        [(4, 8)]
    """
    gap = gap_bytes
    range_bytes = _knobs.LOAD_RANGE_BYTES if range_bytes is None else range_bytes
    by_file: Dict[str, List[Tuple[int, int, Want]]] = {}
    for w in wants:
        c = w.chunk
        if not 0 <= w.start <= w.stop <= c.nbytes:
            raise CorruptCheckpointError(f"{c.file}: bytes {w.start}..{w.stop} requested outside {c.label} of {c.nbytes} bytes")
        if c.blocked and len(c.block_crcs) != -(-c.nbytes // c.block_bytes):
            raise CorruptCheckpointError(
                f"{c.file}: {c.label} has {len(c.block_crcs)} block checksums, "
                f"{-(-c.nbytes // c.block_bytes)} needed for {c.nbytes} bytes in blocks of {c.block_bytes}"
            )
        if w.stop == w.start:
            continue
        lo, hi = c.unit_bounds(w.start, w.stop)
        by_file.setdefault(c.file, []).append((c.byte_offset + lo, c.byte_offset + hi, w))
    out: List[ReadRange] = []
    for rel in sorted(by_file):
        cur: Optional[ReadRange] = None
        seen: set = set()
        for lo, hi, w in sorted(by_file[rel], key=lambda x: (x[0], x[1])):
            joins = (
                cur is not None
                and lo - cur.stop <= gap
                and max(hi, cur.stop) - cur.start <= range_bytes
            )
            if not joins or cur is None:  # (``joins`` implies a range: for type checkers)
                cur = ReadRange(rel, lo, hi)
                out.append(cur)
                seen = set()
            cur.stop = max(cur.stop, hi)
            cur.wants.append(w)
            for u in _units_of(w):
                # A block shared by two wants of one range is checked once.
                if u[:2] not in seen:
                    seen.add(u[:2])
                    cur.units.append(u)
    return out


class Buffer:
    """A pooled buffer: ``view`` (all of it), ``owner`` (what keeps it alive), ``size``."""

    __slots__ = ("view", "owner", "size")

    def __init__(self, view: memoryview, owner: Any):
        self.view, self.owner, self.size = view, owner, len(view)


class BufferPool:
    """Byte buffers for reads, bounded by total bytes, reused across ranges.

    Buffers of ``slot_bytes`` are kept and reused; a request larger than that
    gets an exact-size buffer that is dropped after use (never rounded up).
    ``take`` never waits: the reader asks ``fits`` first and finishes earlier
    work while it does not.

    Args:
        capacity: bytes of buffers out at once (an oversized request may
            exceed it when nothing else is out).
        slot_bytes: size of a reusable buffer.
        alloc: ``nbytes -> (memoryview, owner)``; ``owner`` keeps the memory
            alive and is what ``deliver`` sees (a torch tensor, for instance).
            Default: ``bytearray``.
        free: called with ``owner`` when a buffer is dropped (unregister pinned memory).

    Example:
        >>> pool = BufferPool(1 << 20, slot_bytes=1 << 16)
        >>> b = pool.take(100); pool.give(b); pool.close(); pool.held_bytes
        0
    """

    def __init__(
        self,
        capacity: Optional[int] = None,
        *,
        slot_bytes: Optional[int] = None,
        alloc: Optional[Callable[[int], Tuple[memoryview, Any]]] = None,
        free: Optional[Callable[[Any], None]] = None,
    ):
        # Defaults read now: SHARDCKPT_LOAD_BUFFER_BYTES, SHARDCKPT_LOAD_RANGE_BYTES.
        self.capacity = max(1, _knobs.LOAD_BUFFER_BYTES if capacity is None else capacity)
        self.slot_bytes = max(1, min(_knobs.LOAD_RANGE_BYTES if slot_bytes is None else slot_bytes, self.capacity))
        self._alloc = alloc or _bytearray_alloc
        self._free = free
        self._idle: List[Tuple[Buffer, Any]] = []  # (buffer, fence to wait for before reuse)
        self.out_bytes = 0
        self.held_bytes = 0  # allocated: out or idle
        self.peak_bytes = 0
        self._lock = threading.Lock()

    def _size(self, n: int) -> int:
        return self.slot_bytes if n <= self.slot_bytes else n

    def fits(self, n: int) -> bool:
        """Whether ``take(n)`` stays within capacity (always true when nothing is out)."""
        return self.out_bytes == 0 or self.out_bytes + self._size(n) <= self.capacity

    def can_reuse(self, n: int) -> bool:
        """Whether ``take(n)`` would reuse an idle buffer (not allocate one)."""
        return self._size(n) == self.slot_bytes and bool(self._idle)

    def take(self, n: int) -> Buffer:
        """A buffer of at least ``n`` bytes (exactly ``n`` when larger than a slot)."""
        size = self._size(n)
        fence = None
        with self._lock:
            if size == self.slot_bytes and self._idle:
                buf, fence = self._idle.pop()
            else:
                buf = None
                self.held_bytes += size
            self.out_bytes += size
            self.peak_bytes = max(self.peak_bytes, self.out_bytes)
        if buf is None:
            buf = Buffer(*self._alloc(size))
        if fence is not None:
            fence.synchronize()  # an asynchronous copy out of this buffer may still run
        return buf

    def give(self, buf: Buffer, fence: Any = None) -> None:
        """Return a buffer; ``fence.synchronize()`` runs before it is reused or freed."""
        with self._lock:
            self.out_bytes -= buf.size
            if buf.size == self.slot_bytes:
                self._idle.append((buf, fence))
                return
            self.held_bytes -= buf.size
        self._drop(buf, fence)

    def _drop(self, buf: Buffer, fence: Any) -> None:
        if fence is not None:
            fence.synchronize()
        if self._free is not None:
            self._free(buf.owner)
        buf.view = buf.owner = None  # type: ignore[assignment]

    def close(self) -> None:
        """Wait for pending fences and drop every idle buffer (pinned memory is released here)."""
        with self._lock:
            idle, self._idle = self._idle, []
            self.held_bytes -= sum(b.size for b, _ in idle)
        for buf, fence in idle:
            self._drop(buf, fence)


def _bytearray_alloc(n: int) -> Tuple[memoryview, Any]:
    b = bytearray(n)
    return memoryview(b), b


def _read_job(storage: Storage, rel: str, lo: int, view: memoryview, units: Sequence[Tuple[int, Unit]], sinks: Sequence[Want] = (),
              stop: Optional[threading.Event] = None):
    """Read ``view`` from ``rel`` at ``lo``, CRC the parts of ``units`` (``(index in the range, unit)``) it holds.

    Returns ``(parts, good)``: ``(index, position in the unit, bytes, crc)``
    per unit part, and how many units this piece held whole with a matching
    CRC (the caller's fast path: a range whose units all came back good
    needs no joining of parts). With ``stop`` (a range with sinks: pieces
    cut at unit ends), a piece whose units all matched is handed to
    ``sinks`` (those it overlaps) here, while in cache, and damage sets
    ``stop``.
    """
    try:
        storage.read_into(rel, [(lo, view)])
    except FileNotFoundError:
        raise CorruptCheckpointError(f"{storage.url_of(rel)}: file is missing") from None
    except EOFError as e:
        raise CorruptCheckpointError(f"{e} (truncated)") from None
    except StorageError:
        raise
    except OSError as e:
        raise StorageError(f"reading {storage.url_of(rel)}: {e}") from e
    # Checksum what this thread just read, while it is in cache: the threads
    # share the work and no second pass over memory follows.
    out, good, bad = _check(lo, view, units)
    if stop is not None:  # a range with sinks (its pieces cut at unit ends)
        if bad:
            stop.set()  # the read raises: no thread delivers more
        elif sinks:
            _fill(sinks, lo, view, stop)
    return out, good


def _check(lo: int, view: memoryview, units: Sequence[Tuple[int, Unit]]) -> Tuple[List[Tuple[int, int, int, int]], int, bool]:
    """CRC-32C of each unit's part in ``view`` (file bytes from ``lo``): ``(parts, units whole and good, any not)``.

    A unit only partly in ``view`` counts as not good (never, pieces of a
    fused read being cut at unit ends; a buffered read joins its parts later).
    """
    hi = lo + len(view)
    out = []
    good = 0
    bad = False
    for k, u in units:
        a, b = max(u.start, lo), min(u.stop, hi)
        if a < b:
            crc = crc32c(view[a - lo : b - lo])
            out.append((k, a - u.start, b - a, crc))
            if crc == u.crc and a == u.start and b == u.stop:
                good += 1
            else:
                bad = True
    return out, good, bad


def _opening(storage: Storage, rel: str, verb: str, other: Tuple[Type[BaseException], ...], open_: Callable[[], Any]) -> Any:
    """``open_()`` (a piece's mapping or file), its failures as our errors: missing or short is damage, ``other`` storage trouble."""
    try:
        return open_()
    except FileNotFoundError:
        raise CorruptCheckpointError(f"{storage.url_of(rel)}: file is missing") from None
    except EOFError as e:
        raise CorruptCheckpointError(f"{e} (truncated)") from None
    except StorageError:
        raise
    except other as e:
        raise StorageError(f"{verb} {storage.url_of(rel)}: {e}") from e


def _map_job(storage: Storage, rel: str, lo: int, hi: int, units: Sequence[Tuple[int, Unit]], sinks: Sequence[Want],
             stop: threading.Event):
    """:func:`_read_job` through a memory mapping of the piece: checked and copied out of the page cache, no read copy.

    The whole piece checked, then copied out (:func:`_check_fill`; in
    steps with :data:`MAPPED_STEP_BYTES`), or in one pass with the old
    bytes kept aside (:func:`_fused`, ``LOAD_FUSED=1``): either way a
    damaged unit leaves the whole piece undelivered.
    """
    if stop.is_set():
        return None  # damage found already: nothing more is delivered (the read raises)
    got = _opening(storage, rel, "mapping", (OSError, ValueError), lambda: storage.map_range(rel, lo, hi))
    mm, at = cast(Tuple[Any, int], got)
    try:
        with memoryview(mm) as whole:
            view = whole[at : at + hi - lo]
            if _fused_ok(lo, hi, units, sinks):
                done = _fused(view, lo, units, sinks, stop)
                view.release()
                return done
            out, good = _check_fill(lo, view, units, sinks, stop, MAPPED_STEP_BYTES)
            view.release()
    finally:
        try:
            mm.close()
        except BufferError:  # a view a sink kept: the mapping goes with it
            pass
    return out, good


def _check_fill(lo: int, view: memoryview, units: Sequence[Tuple[int, Unit]], sinks: Sequence[Want], stop: threading.Event,
                step: int, fetch: Optional[Callable[[int, int], None]] = None) -> Tuple[List[Tuple[int, int, int, int]], int]:
    """Check piece ``view`` (file bytes from ``lo``) against ``units`` and hand its bytes to ``sinks``: ``(parts, good)`` as :func:`_check`.

    In steps of whole units (``step`` bytes at most, one unit at least; the
    steps partition the piece, so a byte outside every unit goes with the
    step it lies in): each step is checked, then delivered while in cache.
    ``step`` 0 (or no units): the whole piece checked, then delivered.
    ``fetch(a, b)``: reads file bytes ``[a, b)`` into ``view`` before they
    are checked (None: ``view`` holds them already). Damage sets ``stop``
    and nothing more of the piece is delivered; the rest is still checked,
    so the error names exactly the damaged units.
    """
    hi = lo + len(view)
    if fetch is None and CHECK_IN_KERNEL and CHECK_COPIES and sinks and all(w.into is not None for w in sinks):
        return _check_fill_kernel(lo, view, units, sinks, stop, step)
    if step <= 0 or len(units) < 2:
        if fetch is not None:
            fetch(lo, hi)
        out, good, bad = _check(lo, view, units)
        if bad:
            stop.set()  # the read raises: no thread delivers more
        else:
            _fill(sinks, lo, view, stop)
        return out, good
    order = sorted(units, key=lambda x: x[1].start)
    out = []
    good = 0
    damaged = False
    at, i = lo, 0
    while i < len(order):
        j, first = i + 1, order[i][1].start
        while j < len(order) and order[j][1].stop - first <= step:
            j += 1
        cut = hi if j == len(order) else max(at, min(hi, order[j - 1][1].stop))
        if fetch is not None:
            fetch(at, cut)
        parts, ok, bad = _check(lo, view, order[i:j])
        out.extend(parts)
        good += ok
        if bad:
            stop.set()  # the read raises: no thread delivers more
            damaged = True
        elif not damaged:
            _fill(sinks, at, view[at - lo : cut - lo], stop)
        at, i = cut, j
    return out, good


def _check_fill_kernel(lo: int, view: memoryview, units: Sequence[Tuple[int, Unit]], sinks: Sequence[Want], stop: threading.Event,
                       step: int) -> Tuple[List[Tuple[int, int, int, int]], int]:
    """:func:`_check_fill` by the C kernel (:func:`check_copy`) for sinks that all have ``into``: the GIL taken once for the piece.

    Each sink is then told (``sink(pos, None)``) of the bytes that landed.
    """
    hi = lo + len(view)
    order = sorted(units, key=lambda x: x[1].start)
    outs = []
    placed = []
    for w in sinks:
        base = w.chunk.byte_offset + w.start
        a, b = max(lo, base), min(hi, base + w.stop - w.start)
        if a < b:
            outs.append((a, w.into[a - base : b - base]))  # type: ignore[index]
            placed.append((w, a - base, a))
    crcs, delivered = check_copy(view, lo, [(u.start, u.stop, u.crc) for _, u in order], outs, step=max(0, step),
                                 streaming=_knobs.LOAD_STREAM_COPY)
    for w, pos, a in placed:
        if a < delivered:
            w.sink(pos, None)  # type: ignore[misc]
    out = []
    good = 0
    for (k, u), crc in zip(order, crcs):
        a, b = max(u.start, lo), min(u.stop, hi)
        out.append((k, a - u.start, b - a, crc))
        good += crc == u.crc and a == u.start and b == u.stop
    if good < len(order):
        stop.set()  # the read raises: no thread delivers more
    return out, good


def _fill(sinks: Sequence[Want], lo: int, view: memoryview, stop: threading.Event) -> None:
    """Hand each sink want its bytes inside this piece (all verified: the piece's units matched), still in cache."""
    hi = lo + len(view)
    for w in sinks:
        base = w.chunk.byte_offset + w.start
        a, b = max(lo, base), min(hi, base + w.stop - w.start)
        if a < b and not stop.is_set():
            w.sink(a - base, view[a - lo : b - lo])  # type: ignore[misc]


def _into_ok(lo: int, hi: int, units: Sequence[Tuple[int, Unit]], sinks: Sequence[Want]) -> bool:
    """Whether piece ``[lo, hi)`` can be read straight into its destinations.

    Every byte of it must be a byte of exactly one want with ``into`` (no
    bytes read only to be checked, no want copied twice, no cast), and no
    destination may be one that must survive damage (``restore``: a live
    tensor) while checksums are checked: such a piece is read into the
    thread's scratch and checked whole before a byte of it is copied out.
    """
    if units and any(w.restore for w in sinks):
        return False
    return _tiled(lo, hi, sinks)


def _tiled(lo: int, hi: int, sinks: Sequence[Want]) -> bool:
    """Whether the wants (all with ``into``) tile piece ``[lo, hi)``: each byte goes to exactly one destination, as it is."""
    # The wants overlapping the piece, in file order, must tile it: the first
    # starts at or before it, each next one where the last ended, the last
    # ends at or after it.
    at = None
    for w in sorted(sinks, key=lambda w: w.chunk.byte_offset + w.start):
        a = w.chunk.byte_offset + w.start
        if w.into is None or (a > lo if at is None else a != at):
            return False
        at = a + (w.stop - w.start)
    return at is not None and at >= hi


def _by_offset(sinks: Sequence[Want]) -> Tuple[List[Want], List[int]]:
    """``sinks`` in file order, and where each starts in the file (for :func:`_views`)."""
    # Among wants starting at one byte the longest comes last: the one a bisection lands on.
    order = sorted(sinks, key=lambda w: (w.chunk.byte_offset + w.start, w.stop - w.start))
    return order, [w.chunk.byte_offset + w.start for w in order]


def _views(index: Tuple[List[Want], List[int]], a: int, b: int) -> List[Tuple[Want, int, memoryview]]:
    """``(want, position in it, its destination bytes)`` covering file bytes ``[a, b)``, in file order.

    ``index``: :func:`_by_offset` of wants that tile the piece (``_into_ok``),
    so a unit's wants are found by bisection, not by a pass over every want
    of the piece per unit (quadratic for a piece of thousands of small tensors).
    """
    order, starts = index
    out = []
    i = max(0, bisect_right(starts, a) - 1)
    while i < len(order) and starts[i] < b:
        w, base = order[i], starts[i]
        x, y = max(a, base), min(b, base + w.stop - w.start)
        if x < y:
            out.append((w, x - base, w.into[x - base : y - base]))  # type: ignore[index]
        i += 1
    return out


def _fused_ok(lo: int, hi: int, units: Sequence[Tuple[int, Unit]], sinks: Sequence[Want]) -> bool:
    """Whether mapped piece ``[lo, hi)`` goes into its destinations through :func:`_fused`.

    Only mapped pieces do: a piece read into the scratch is already in
    cache, where the CRC pass then the copy cost the same as one pass with
    the piece's old bytes kept aside (2-core VM, docs/performance.md wave 14),
    while a mapping is read from memory once instead of twice.

    The one-pass kernel must be here (``COPY_FUSED``, ``SHARDCKPT_LOAD_FUSED``),
    the piece's units must tile it (no byte unchecked, none outside it), the
    piece be at most :data:`SCRATCH_MAX_BYTES` (the bytes kept aside), and
    its wants must tile it with destination memory (:func:`_tiled`).
    """
    if not (COPY_FUSED and _knobs.LOAD_FUSED and units) or hi - lo > SCRATCH_MAX_BYTES:
        return False
    at = lo
    for _, u in sorted(units, key=lambda x: x[1].start):
        if u.start != at:
            return False
        at = u.stop
    return at == hi and _tiled(lo, hi, sinks)


def _fused(view: memoryview, lo: int, units: Sequence[Tuple[int, Unit]], sinks: Sequence[Want], stop: threading.Event):
    """A mapped piece (``view``: file bytes from ``lo``), unit by unit, copied into its destinations and checked in the same pass.

    The kernel (:func:`copy_crc32c`) reads a unit's bytes once, computing the
    CRC as it copies them, where the two-pass path read them twice (CRC, then
    copy). Live destinations' previous bytes are kept aside in the same pass
    (the piece's, in this thread's keep buffer) and all put back if any unit
    of the piece fails, or if another thread found damage first, before this
    returns: as with the two-pass path, a piece is delivered whole or not at
    all, and no byte of it stays in a live tensor when the load raises (a
    staging destination, ``atomic=True``, is discarded instead). After a
    damaged unit the rest are only checked, so the error names exactly the
    damaged units.
    """
    index = _by_offset(sinks)
    keep = _keep(len(view)) if any(w.restore for w in sinks) else None
    out: List[Tuple[int, int, int, int]] = []
    written: List[Tuple[Want, int, memoryview]] = []
    good = 0
    damaged = False
    try:
        for k, u in sorted(units, key=lambda x: x[1].start):
            src = view[u.start - lo : u.stop - lo]
            if damaged:
                out.append((k, 0, u.stop - u.start, crc32c(src)))
                continue
            if stop.is_set():  # damage found in another piece: nothing of this one is delivered
                _put_back(written, keep, lo)
                return None
            views = _views(index, u.start, u.stop)
            crc, at = 0, 0
            for _, _, v in views:
                m = len(v)
                crc = copy_crc32c(v, src[at : at + m], None if keep is None else keep[u.start - lo + at : u.start - lo + at + m], crc)
                at += m
            written.extend(views)
            out.append((k, 0, at, crc))
            if crc != u.crc:
                _put_back(written, keep, lo)
                stop.set()  # the read raises: no thread delivers more
                damaged = True
                continue
            good += 1
    except BaseException:  # anything raised mid-piece (an interrupt): the piece's tensors as they were
        if not damaged:
            _put_back(written, keep, lo)
        raise
    if not damaged:
        for w, pos, _ in written:
            w.sink(pos, None)  # type: ignore[misc]
    return out, good


def _put_back(written: Sequence[Tuple[Want, int, memoryview]], keep: Optional[memoryview], lo: int) -> None:
    """Live destinations' bytes as they were before :func:`_fused` wrote ``written`` (``keep``: the piece's old bytes from ``lo``)."""
    if keep is None:
        return  # staging: discarded by the failing load
    for w, pos, v in written:
        at = w.chunk.byte_offset + w.start + pos - lo
        v[:] = keep[at : at + len(v)]


def _keep(n: int) -> memoryview:
    """This thread's buffer for the bytes a fused copy overwrites (:func:`_fused`), as :func:`_scratch`."""
    return _thread_buffer("keep", n)


def _scratch(n: int) -> memoryview:
    """This thread's scratch of at least ``n`` bytes (kept for its next piece), in huge pages where the kernel has them.

    Huge pages because the kernel's copy into 4 KiB pages ran at a third of
    its speed into 2 MiB ones on the 2-core VM (3.5 vs 11 GB/s of ``preadv``
    from tmpfs): the scratch is written by every piece of the load.
    """
    return _thread_buffer("buf", n)


def _thread_buffer(name: str, n: int) -> memoryview:
    """``n`` bytes of this thread's buffer ``name`` (grown to fit, kept for the thread's next piece: :func:`_drop_scratch`)."""
    buf = getattr(_tls, name, None)
    if buf is None or len(buf) < n:
        setattr(_tls, name, None)  # the old mapping goes before the new one is made
        buf = _huge_buffer(max(n, 2 * INTO_STEP_BYTES))
        setattr(_tls, name, buf)
    return buf[:n]


def _huge_buffer(n: int) -> memoryview:
    """``n`` bytes of anonymous memory in whole huge pages, huge pages asked for (``MADV_HUGEPAGE``).

    The mapping is a whole number of huge pages: Linux (6.7+) places such an
    anonymous mapping at a huge-page boundary, so all of it can be huge;
    elsewhere its aligned interior is.
    """
    mm = mmap.mmap(-1, -(-n // _HUGE_BYTES) * _HUGE_BYTES, flags=mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS)
    advice = getattr(mmap, "MADV_HUGEPAGE", None)
    if advice is not None:
        try:
            mm.madvise(advice)
        except OSError:  # a kernel without THP: 4 KiB pages
            pass
    return memoryview(mm)[:n]


def _drop_scratch() -> None:
    """Release this thread's scratch and keep buffer (a load run in the calling thread keeps none after it)."""
    _tls.buf = None
    _tls.keep = None


def _into_job(storage: Storage, rel: str, lo: int, hi: int, units: Sequence[Tuple[int, Unit]], sinks: Sequence[Want],
              stop: threading.Event, hot: Optional["_HotFiles"] = None):
    """:func:`_map_job` for a piece in memory (``Storage.open_hot``: tmpfs, or a lane's file), read with ``preadv``.

    A piece whose bytes all go as they are into destinations that need not
    survive damage (``_into_ok``: staging, or checksums off) is read straight
    into them, one checksum unit at a time (at most :data:`INTO_STEP_BYTES` a
    call), each unit's CRC-32C computed there while in cache; ``sink(pos,
    None)`` tells the caller once a unit is verified in place. After a
    damaged unit, the rest of the piece is read into scratch only to check
    it (the error names exactly the damaged units). Any other piece (a live
    tensor's: nothing of it may change unless all of it verified) is read
    into this thread's scratch, checked whole and copied out while in cache,
    as a mapped piece is. A piece ``open_hot`` refuses (a file on a disk), or
    larger than :data:`SCRATCH_MAX_BYTES` that cannot go straight in, is
    mapped (:func:`_map_job`).
    """
    if stop.is_set():
        return None
    direct = _into_ok(lo, hi, units, sinks)
    if not direct and hi - lo > SCRATCH_MAX_BYTES:
        return _map_job(storage, rel, lo, hi, units, sinks, stop)
    f = hot.open(storage, rel, lo, hi) if hot is not None else \
        _opening(storage, rel, "reading", (OSError,), lambda: storage.open_hot(rel, lo, hi))
    if f is None:
        return _map_job(storage, rel, lo, hi, units, sinks, stop)
    try:
        if not direct:
            view = _scratch(hi - lo)
            if SCRATCH_STEP_BYTES <= 0:
                f.readv(lo, [view])
            return _check_fill(lo, view, units, sinks, stop, SCRATCH_STEP_BYTES,
                               fetch=None if SCRATCH_STEP_BYTES <= 0 else lambda a, b: f.readv(a, [view[a - lo : b - lo]]))
        # (index of the unit in its range or -1: unchecked, file bytes, expected CRC)
        steps = [(k, u.start, u.stop, u.crc) for k, u in sorted(units, key=lambda x: x[1].start)] if units else \
            [(-1, a, min(a + INTO_STEP_BYTES, hi), 0) for a in range(lo, hi, INTO_STEP_BYTES)]
        out = []
        good = 0
        damaged = False
        index = _by_offset(sinks)
        for k, a, b, want in steps:
            if damaged:  # checked in scratch, never in a destination
                crc = 0
                for x in range(a, b, INTO_STEP_BYTES):
                    y = min(x + INTO_STEP_BYTES, b)
                    buf = _scratch(y - x)
                    f.readv(x, [buf])
                    crc = crc32c(buf, crc)
                out.append((k, 0, b - a, crc))
                continue
            if stop.is_set():
                return None  # damage found in another piece: nothing more is delivered
            views = _views(index, a, b)
            if k < 0:  # unchecked (checksums off or none saved): the bytes are delivered as they land
                for w, pos, _ in views:
                    w.sink(pos, None)  # type: ignore[misc]
            crc = 0
            for x in range(a, b, INTO_STEP_BYTES):
                y = min(x + INTO_STEP_BYTES, b)
                part = [v for _, _, v in _clip(views, a, x, y)]
                f.readv(x, part)
                if k >= 0:
                    for v in part:
                        crc = crc32c(v, crc)
            if k < 0:
                continue
            out.append((k, 0, b - a, crc))
            if crc != want:
                stop.set()  # the read raises: no thread delivers more
                damaged = True
                continue
            good += 1
            for w, pos, _ in views:
                w.sink(pos, None)  # type: ignore[misc]
        return out, good
    except EOFError as e:  # the file was truncated under the load (the size was checked when it was opened)
        raise CorruptCheckpointError(f"{e} (truncated)") from None
    except (StorageError, CorruptCheckpointError):
        raise
    except OSError as e:
        raise StorageError(f"reading {storage.url_of(rel)}: {e}") from e
    finally:
        if hot is None or not getattr(f, "shareable", False):
            f.close()


class _HotFiles:
    """The files of one read that :meth:`Storage.open_hot` opened shareable: each opened once, not once per piece; closed at the end.

    An open (path checks, ``open``, two ``fstat``) cost 28 us, 17 ms of CPU
    in a 1 GiB load of 258 pieces on the 2-core VM. A file is shared only
    for pieces within the size it had when opened (a larger piece opens it
    again, and the size check there refuses a short file).
    """

    def __init__(self) -> None:
        self._files: Dict[str, Any] = {}
        self._retired: List[Any] = []  # replaced by a larger open: readers may still use them
        self._lock = threading.Lock()

    def open(self, storage: Any, rel: str, lo: int, hi: int) -> Any:
        got = self._files.get(rel)
        if got is not None and hi <= got.size:
            return got
        f = _opening(storage, rel, "reading", (OSError,), lambda: storage.open_hot(rel, lo, hi))
        if f is None or not getattr(f, "shareable", False):
            return f
        with self._lock:
            old = self._files.get(rel)
            if old is not None and hi <= old.size:
                f.close()  # another thread opened it meanwhile
                return old
            self._files[rel] = f
            if old is not None:
                self._retired.append(old)
        return f

    def close(self) -> None:
        for f in list(self._files.values()) + self._retired:
            f.close()
        self._files.clear()
        self._retired.clear()


def _clip(views: Sequence[Tuple[Want, int, memoryview]], a: int, x: int, y: int) -> List[Tuple[Want, int, memoryview]]:
    """The parts of ``views`` (covering file bytes from ``a``, in order) holding file bytes ``[x, y)``."""
    out, at = [], a
    for w, pos, v in views:
        p, q = max(x, at), min(y, at + len(v))
        if p < q:
            out.append((w, pos + p - at, v[p - at : q - at]))
        at += len(v)
    return out


def _cuts(rng: ReadRange, piece_bytes: int, units: Sequence[Unit]) -> List[Tuple[int, int]]:
    """A range's read pieces of about ``piece_bytes``, cut only at the ends of its checksum units.

    No unit straddles two pieces, so the thread that reads a piece verifies
    every unit under it alone, and may deliver its bytes at once.
    """
    if not units:
        return [(a, min(a + piece_bytes, rng.stop)) for a in range(rng.start, rng.stop, piece_bytes)]
    out, a = [], rng.start
    for end in sorted(u.stop for u in units):
        if end - a >= piece_bytes and end < rng.stop:
            out.append((a, end))
            a = end
    out.append((a, rng.stop))
    return out


def _by_piece(spans: Sequence[Tuple[int, int]], pieces: Sequence[Tuple[int, int]]) -> List[List[int]]:
    """For each piece (sorted, disjoint ``[lo, hi)``), the indices of the ``spans`` that overlap it.

    A job is handed only its own units and sinks: O(units + sinks) per range,
    not (units + sinks) x pieces.

        >>> _by_piece([(30, 40), (0, 10), (10, 20), (20, 30)], [(0, 20), (20, 25), (25, 40)])
        [[1, 2], [3], [3, 0]]
    """
    order = sorted(range(len(spans)), key=lambda k: spans[k])
    out: List[List[int]] = []
    first = 0
    for lo, hi in pieces:
        while first < len(order) and spans[order[first]][1] <= lo and spans[order[first]][0] < lo:
            first += 1
        mine = []
        for k in order[first:]:
            a, b = spans[k]
            if a >= hi:
                break
            if b > lo:
                mine.append(k)
        out.append(mine)
    return out


def read_verified(
    storage: Storage,
    wants: Sequence[Want],
    deliver: Callable[[Want, memoryview, Any, int], Any],
    *,
    threads: Optional[int] = None,
    pool: Optional[BufferPool] = None,
    range_bytes: Optional[int] = None,
    piece_bytes: Optional[int] = None,
    gap_bytes: Optional[int] = None,
    verify: bool = True,
    stats: Optional[ReadStats] = None,
    on_mismatch: Optional[Callable[[Unit, Optional[int]], None]] = None,
) -> ReadStats:
    """Read ``wants``, verify every checksum unit they touch, hand each one's bytes to ``deliver``.

    ``deliver(want, data, owner, offset)`` runs in the calling thread, in
    plan order, only after every unit under ``want`` matched its CRC-32C;
    ``data`` is exactly bytes ``[want.start, want.stop)`` of the chunk and is
    valid only during the call (it lies at ``offset`` in the buffer ``owner``
    from the pool's allocator). It may return a fence (``.synchronize()``) that
    must complete before the buffer is reused: an asynchronous device copy.

    Args:
        storage: the checkpoint's storage.
        wants: what to read (see :func:`plan_ranges`).
        deliver: the consumer.
        threads: reads in flight at once (default ``SHARDCKPT_IO_THREADS``, read now).
        pool: buffers to read into (default: a fresh one of
            ``SHARDCKPT_LOAD_BUFFER_BYTES``, closed on return); a caller's
            pool is left open for reuse.
        range_bytes: largest coalesced read (default the pool's slot size).
        piece_bytes: a range is read in *read pieces* of at most this size,
            in parallel (a read piece is not a checksum block: its CRCs are
            joined per unit). Default ``SHARDCKPT_READ_BLOCK_BYTES``; for
            wants with sinks :data:`SCRATCH_PIECE_BYTES` or
            :data:`MAPPED_PIECE_BYTES` by how the pieces are read (at most
            ``READ_BLOCK_BYTES``).
        gap_bytes: see :func:`plan_ranges` (default :func:`coalesce_gap`
            of ``storage``: the knob on object storage, 0 on local disk).
        verify: False skips the CRC checks (``SHARDCKPT_CHECKSUMS=0`` does too).
        stats: filled in (bytes wanted and read) and returned.
        on_mismatch: None (default): the first range with a damaged unit
            raises. Given: ``on_mismatch(unit, crc)`` is called for every
            damaged unit (``crc`` None when its bytes were not all read), the
            wants that touch one are not delivered, and the read goes on —
            how ``verify`` lists every damaged chunk.

    Raises:
        ChecksumMismatchError: a unit's bytes differ from its checksum (file,
            chunk, block and byte range named); nothing of that range was
            delivered (unless ``on_mismatch`` is given).
        CorruptCheckpointError: a file is missing or ends early.
        StorageError: the storage failed.
        Whatever ``deliver`` raises; reads in flight are drained first.

    Example:
        >>> got = []
        >>> read_verified(st, [Want(c, 0, 8)], lambda w, b, o, off: got.append(bytes(b)))  # doctest: +SKIP

    Limits: a v1 chunk is verified whole, so it is read whole even when a
    few bytes of it are wanted, and a chunk larger than the pool occupies a
    buffer of its own size.
    """
    threads = _knobs.IO_THREADS if threads is None else threads
    own_pool = pool is None
    pool = pool or BufferPool()
    stats = stats or ReadStats()
    checking = verify and _knobs.CHECKSUMS
    gap = coalesce_gap(storage) if gap_bytes is None else gap_bytes
    # Wants with a sink get their bytes in the reader thread, right after the
    # read and the CRC of their piece (one pass while the bytes are in cache);
    # with on_mismatch (a read that goes on past damage) they are handed over
    # whole, in this thread, as the others are.
    fused = on_mismatch is None and any(w.sink is not None for w in wants)
    # Their pieces are sized by how they are read (unless the caller names a size).
    sink_bytes = piece_bytes or min(SCRATCH_PIECE_BYTES if _knobs.LOAD_INTO else MAPPED_PIECE_BYTES, _knobs.READ_BLOCK_BYTES)
    plain_bytes = piece_bytes or _knobs.READ_BLOCK_BYTES
    # Ranges whose wants all have sinks are read through a mapping of the
    # file where the storage has one (local files): the bytes are checked and
    # copied out of the page cache once, no read into a buffer first.
    mappable = fused and _knobs.LOAD_MAP and getattr(storage, "can_map", False)
    # Pieces whose bytes all go as they are into destinations' memory
    # (``Want.into``) are read straight there where the storage offers them
    # (``Storage.open_hot``: tmpfs with ``SHARDCKPT_LOAD_INTO``, a lane's file
    # with ``SHARDCKPT_LOAD_LANES`` ``read`` or ``all``); the others are mapped.
    into = mappable and (_knobs.LOAD_INTO or _knobs.LOAD_LANES in ("read", "all"))
    # Lanes (``Storage.lane_bytes``: files on a block device): the pieces of
    # a mapped range, or of a run of neighbouring buffered ranges, are read
    # in order by one thread through one kept file (``Storage.open_lane``),
    # so the kernel's readahead sees sequential streams, not many threads
    # racing through neighbouring pieces. 0 for a file: every piece a job.
    lanes: Dict[str, int] = {}

    def lane_of(rel: str) -> int:
        got = lanes.get(rel)
        if got is None:
            got = lanes[rel] = storage.lane_bytes(rel) if threads > 1 and hasattr(storage, "lane_bytes") else 0
        return got

    if mappable and range_bytes is None:
        # A mapped range holds no buffer: larger ones (its pieces still
        # map and copy a few MiB each) mean fewer ranges for this thread to
        # submit and finish while the readers wait on it. Never larger than
        # the pool, though: a small pool asks for small steps. A mapped
        # range read in a lane is one lane: as long as the storage's lanes.
        sunk = [w for w in wants if w.sink is not None]
        lane = max([lane_of(f) for f in {w.chunk.file for w in sunk}], default=0)
        grown = max(pool.slot_bytes, min(max(MAPPED_RANGE_BYTES, lane), pool.capacity))
        ranges = plan_ranges(sunk, range_bytes=grown, gap_bytes=gap) + plan_ranges(
            [w for w in wants if w.sink is None], range_bytes=pool.slot_bytes, gap_bytes=gap)
    else:
        ranges = plan_ranges(wants, range_bytes=range_bytes or pool.slot_bytes, gap_bytes=gap)
    stats.wanted_bytes += sum(w.stop - w.start for w in wants)
    stats.ranges += len(ranges)
    if gap:
        stats.gap_bytes += sum(_gap_of(r) for r in ranges)
    pending: Deque[Tuple[ReadRange, Optional[Buffer], List[Any]]] = deque()
    ex = ThreadPoolExecutor(max_workers=max(1, threads), thread_name_prefix="shardckpt-r") if threads > 1 else None
    stop = threading.Event()  # set on the first damage or error: reader threads deliver nothing more
    hot = _HotFiles() if into else None  # the files its pieces read with ``preadv``, each opened once
    # A lane of buffered ranges being gathered: (file, end, bytes, [(calls, the ranges' job lists)]).
    # Its buffers are only as many as the pool's share of one thread.
    share = pool.capacity // max(1, threads)
    gathering: List[Any] = []

    def flush() -> None:
        """Submit the gathered lane of buffered ranges as one job (before any ``finish``: it may wait on them)."""
        if not gathering:
            return
        rel, _, _, members = gathering
        gathering.clear()
        calls = [c for cs, _ in members for c in cs]
        futs: List[Future] = []
        for cs, jobs in members:
            mine: List[Future] = [Future() for _ in cs]
            jobs.extend(mine)
            futs.extend(mine)
        cast(ThreadPoolExecutor, ex).submit(_lane_job, storage, rel, calls, futs)

    def submit(rng: ReadRange, mv: Optional[memoryview]) -> List[Any]:
        calls = calls_of(rng, mv)
        stats.requests += len(calls)
        lane = lane_of(rng.file)
        if mv is not None and _knobs.LOAD_LANES != "all":
            lane = 0  # buffered ranges in lanes only when asked (``SHARDCKPT_LOAD_LANES=all``)
        if not lane:
            flush()  # (a lane gathered for another file starts now, not when its range is due)
            return [ex.submit(fn, storage, *args) if ex is not None else _Done(fn, (storage, *args)) for fn, args in calls]
        if mv is None:  # a mapped range: one lane
            flush()
            futs: List[Future] = [Future() for _ in calls]
            cast(ThreadPoolExecutor, ex).submit(_lane_job, storage, rng.file, calls, futs)
            return futs
        # Buffered: neighbouring ranges of one file join one lane while the
        # lane stays within the storage's lane and this thread's share of the pool.
        if gathering and (gathering[0] != rng.file or rng.start != gathering[1]
                          or gathering[2] + rng.nbytes > min(lane, share)):
            flush()
        jobs: List[Any] = []
        if not gathering:
            gathering.extend([rng.file, rng.stop, 0, []])
        gathering[1], gathering[2] = rng.stop, gathering[2] + rng.nbytes
        gathering[3].append((calls, jobs))
        return jobs

    def calls_of(rng: ReadRange, mv: Optional[memoryview]) -> List[Tuple[Callable[..., Any], Tuple[Any, ...]]]:
        """The jobs reading ``rng`` (into ``mv``, or mapped when None): ``(function, its arguments after the storage)``."""
        calls: List[Tuple[Callable[..., Any], Tuple[Any, ...]]] = []
        units = rng.units if checking else []
        sinks = [w for w in rng.wants if w.sink is not None] if fused else []
        size = min(sink_bytes, SCRATCH_PIECE_BYTES) if mv is None and lane_of(rng.file) else sink_bytes
        pieces = _cuts(rng, max(1, size), units) if sinks else [
            (lo, min(lo + plain_bytes, rng.stop)) for lo in range(rng.start, rng.stop, max(1, plain_bytes))]
        per_unit = _by_piece([(u.start, u.stop) for u in units], pieces)
        per_sink = _by_piece([(w.chunk.byte_offset + w.start, w.chunk.byte_offset + w.stop) for w in sinks], pieces) if sinks \
            else [[] for _ in pieces]
        for (lo, hi), ks, ss in zip(pieces, per_unit, per_sink):
            mine = [(k, units[k]) for k in ks]
            theirs = [sinks[i] for i in ss]
            if mv is None:  # mapped: every want of the range has a sink
                fn: Callable[..., Any] = _into_job if into else _map_job
                args: Tuple[Any, ...] = (rng.file, lo, hi, mine, theirs, stop) + ((hot,) if into else ())
            else:
                fn, args = _read_job, (rng.file, lo, mv[lo - rng.start : hi - rng.start], mine, theirs, stop if sinks else None)
            calls.append((fn, args))
        return calls

    def finish() -> None:
        if not pending[0][2]:
            flush()  # the oldest range is in the lane being gathered: submit it now (else it keeps gathering)
        rng, buf, jobs = pending.popleft()
        fence = None
        try:
            parts: Dict[int, List[Tuple[int, int, int]]] = {}
            results = [j.result() for j in jobs]
            # A mapped piece is skipped (None) once damage was found: in this
            # range (raised below, naming only the units checked) or in another
            # (which raises when it is finished). Its units are not reported.
            skipped = any(r is None for r in results)
            stats.read_bytes += rng.nbytes
            damaged: List[Unit] = []
            if checking:
                stats.verified_bytes += sum(u.stop - u.start for u in rng.units)
            # Every unit came back whole and good from the thread that read it
            # (the usual case: pieces cut at unit ends): nothing to join.
            all_good = not skipped and sum(r[1] for r in results) == len(rng.units)
            if checking and not all_good:
                for r in results:
                    for k, pos, n, crc in r[0] if r is not None else ():
                        parts.setdefault(k, []).append((pos, n, crc))
                bad = []
                for k, u in enumerate(rng.units):
                    got, covered = 0, 0
                    for pos, n, crc in sorted(parts.get(k, [])):
                        if pos != covered:
                            break  # a gap: reported as a mismatch below, never passed as checked
                        got = crc32c_combine(got, crc, n)
                        covered += n
                    if skipped and covered != u.stop - u.start:
                        continue
                    if covered != u.stop - u.start or got != u.crc:
                        damaged.append(u)
                        if on_mismatch is not None:
                            on_mismatch(u, got if covered == u.stop - u.start else None)
                        bad.append(f"{u.label} (bytes {u.start}..{u.stop}): crc32c {got:#010x}, expected {u.crc:#010x}")
                if bad and on_mismatch is None:
                    more = f" ... ({len(bad) - _MAX_LISTED} more)" if len(bad) > _MAX_LISTED else ""
                    raise ChecksumMismatchError(
                        f"checksum mismatch in {storage.url_of(rng.file)}, the checkpoint is damaged: "
                        + "; ".join(bad[:_MAX_LISTED]) + more
                    )
            if skipped:
                return
            mv = buf.view if buf is not None else memoryview(b"")
            for w in rng.wants:
                if damaged and _touches(w, damaged) or fused and w.sink is not None:
                    continue
                off = w.chunk.byte_offset + w.start - rng.start
                if w.sink is not None:
                    w.sink(0, mv[off : off + (w.stop - w.start)])
                    continue
                f = deliver(w, mv[off : off + (w.stop - w.start)], buf.owner if buf is not None else None, off)
                fence = f if f is not None else fence
        finally:
            if buf is not None:
                pool.give(buf, fence)

    try:
        for rng in ranges:
            if mappable and all(w.sink is not None for w in rng.wants):
                # A mapped range holds no buffer: all of them are submitted at
                # once and finished together below, so this thread sleeps once
                # instead of waking for every piece (on two cores those
                # wake-ups took CPU from the readers).
                pending.append((rng, None, submit(rng, None)))
                continue
            # Reuse before growing: while the oldest range is read already,
            # finish it and take its buffer rather than a new one. Where reads
            # keep up (pages in memory) the pool stays a few buffers, so a warm
            # load into CUDA no longer page-locks its whole pool (2.6x on a 1 GiB
            # load of an H100 host); where they lag (a cold disk), the oldest is
            # still in flight and the pool grows to its capacity: a deep queue.
            while pending and (not pool.fits(rng.nbytes) or (not pool.can_reuse(rng.nbytes) and _read(pending[0][2]))):
                finish()
            taken = pool.take(rng.nbytes)
            stats.peak_buffer_bytes = max(stats.peak_buffer_bytes, pool.out_bytes)
            try:
                pending.append((rng, taken, submit(rng, taken.view[: rng.nbytes])))
            except BaseException:
                pool.give(taken)
                raise
        flush()
        wait([j for _, _, jobs in pending for j in jobs if isinstance(j, Future)], return_when=FIRST_EXCEPTION)
        while pending:
            finish()
    except BaseException:
        stop.set()
        # Let reads in flight end before their buffers go back (or away);
        # a gathered lane was never submitted: its buffers just go back.
        gathering.clear()
        while pending:
            rng, buf, jobs = pending.popleft()
            for j in jobs:
                try:
                    j.result()
                except BaseException:  # noqa: BLE001 - the first error is the one raised
                    pass
            if buf is not None:
                pool.give(buf)
        raise
    finally:
        if ex is not None:
            ex.shutdown(wait=True)  # (its threads' scratch goes with them)
        else:
            _drop_scratch()
        if hot is not None:
            hot.close()
        if own_pool:
            pool.close()
    return stats


def damaged_units(chunk: Chunk, start: int, stop: int, data: Any) -> List[Unit]:
    """The checksum units of ``chunk`` under its bytes ``[start, stop)`` that ``data`` (exactly those bytes) fails.

    For bytes checked where they arrive instead of where they were read
    (``_replicas``: a rank reading a range only to send it reads it
    unchecked, the receiver checks it, once). ``[start, stop)`` must be whole
    units (:meth:`Chunk.unit_bounds` of itself). Nothing is checked with
    ``SHARDCKPT_CHECKSUMS=0``, nor in a chunk without checksums.

    Example:
        >>> c = Chunk("a", 0, 4, block_bytes=2, block_crcs=(crc32c(b"ab"), crc32c(b"cd")))
        >>> [u.block for u in damaged_units(c, 0, 4, b"abcX")]
        [1]
    """
    if not _knobs.CHECKSUMS:
        return []
    out = []
    for u in _units_of(Want(chunk, start, stop)):
        a = u.start - chunk.byte_offset - start
        if crc32c(data[a : a + (u.stop - u.start)]) != u.crc:
            out.append(u)
    return out


def _touches(w: Want, units: Sequence[Unit]) -> bool:
    """Whether the checksum units under ``w`` include one of ``units`` (damaged ones: not delivered)."""
    c = w.chunk
    lo, hi = c.unit_bounds(w.start, w.stop)
    lo, hi = c.byte_offset + lo, c.byte_offset + hi
    return any(u.start < hi and lo < u.stop for u in units)  # one file: byte spans decide


def _gap_of(rng: ReadRange) -> int:
    """Bytes of ``rng`` no want's checksum units cover (read only to save a request)."""
    spans = sorted((c.byte_offset + lo, c.byte_offset + hi) for c, lo, hi in ((w.chunk, *w.chunk.unit_bounds(w.start, w.stop)) for w in rng.wants))
    covered, end = 0, rng.start
    for a, b in spans:
        a = max(a, end)
        if b > a:
            covered += b - a
            end = b
    return rng.nbytes - covered


def _lane_job(storage: Storage, rel: str, calls: Sequence[Tuple[Callable[..., Any], Tuple[Any, ...]]], futs: Sequence[Future]) -> None:
    """Run the jobs of one lane in order, in this thread, on one kept file of ``rel`` (``Storage.open_lane``).

    Each job's result or failure goes to its own future in ``futs`` as soon
    as it is done (the calling thread finishes a lane's first range while
    the lane reads on): a job's failure is raised for its own range, as when
    it ran alone. After a failure the lane's later jobs are not run (they
    report the same failure; the read raises at the first).
    """
    err: Optional[BaseException] = None
    lane = None
    try:
        lane = storage.open_lane(rel)
        for (fn, args), fut in zip(calls, futs):
            if err is None:
                try:
                    fut.set_result(fn(lane, *args))
                    continue
                except BaseException as e:  # noqa: BLE001 - re-raised by its future's result()
                    err = e
            fut.set_exception(err)
    except BaseException as e:  # noqa: BLE001 - no future is left without an outcome
        for fut in futs:
            if not fut.done():
                fut.set_exception(e)
    finally:
        if lane is not None:
            lane.close()


def _read(jobs: Sequence[Any]) -> bool:
    """Whether a pending range's jobs are all done (none: a lane still being gathered)."""
    return bool(jobs) and all(j.done() for j in jobs)


class _Done:
    """A job run at once in this thread, with a future's ``result()``."""

    def __init__(self, fn, args):
        try:
            self._v, self._e = fn(*args), None
        except BaseException as e:  # noqa: BLE001 - re-raised by result()
            self._v, self._e = None, e

    def done(self) -> bool:
        return True

    def result(self):
        if self._e is not None:
            raise self._e
        return self._v
