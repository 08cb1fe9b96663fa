"""Read once, then send: bytes that several ranks load are read by one of them and sent to the others.

With HSDP replicas, DDP, replicated tensor-parallel parameters or replicated
buffers, every holder of a box used to read the same bytes from storage: R
replicas made R times the state in storage traffic. Here each such byte
range is read (and verified, block by block, through the one verified reader
``_readers.read_verified``) by exactly one of its holders, and sent from
there to the other holders over the load's process group (NCCL on CUDA,
gloo on CPU). Storage bytes across all ranks are then about 1.0x the state
(plus block rounding), whatever the number of replicas.

Mechanism (one load, every rank of the group):

1. *gather*: each rank posts the keys of the byte ranges it wants
   (``(file, chunk offset, start, stop)``; one store exchange through
   ``_collective.agree``);
2. *plan* (pure, :func:`plan_shared`, identical on every rank): a key wanted
   by several ranks is *shared*; each holder set's shared ranges are split
   into contiguous spans balanced by bytes, one reader per span; the readers'
   queues are cut into rounds of at most ``round_bytes`` per rank;
3. *stream*: one background thread per rank reads, in one continuous
   ``read_verified`` (no drain between rounds), this rank's shared ranges of
   every round, each into that round's buffer on the transfer device (three
   used in turn, so reads run ahead while earlier rounds are sent), and then
   the ranges nobody else wants (straight into their tensors: the other
   ranks do not wait for those). The calling
   thread, per round, waits for that round's reads and agrees with the other
   ranks (bounded by ``collective_timeout_s``) that every read of the round
   succeeded before any byte of it is sent. A damaged block on the
   reading rank therefore fails the load on every rank with the same error,
   and nobody waits in a send or receive that will never come. Transfers are
   point-to-point ``isend``/``irecv`` in the load's group (the wire,
   ``_p2p``), one message per (reader, holder set, receiver), waited for
   with a deadline and the peers' liveness (a killed peer fails the others in seconds, a hung one within
   ``collective_timeout_s``);
4. each holder (the reader too) copies its pieces out of the round buffer
   into its tensors.

Falls back to direct reads (every rank reads what it needs) with one process
(``no_dist``, no group, world size 1), when nothing is shared, when the
group's backend can send neither CPU nor CUDA tensors, or when
``SHARDCKPT_LOAD_READ_ONCE=0``.

Memory: the read pool (``buffer_bytes``) plus three round buffers of about
``buffer_bytes / 2`` each on the transfer device (a round holds every byte a
rank reads for others or receives; one range larger than a reader's slice of
a round gets a round of its own).

Limits: only ranges of replicated live tensors are offered (a purely
sharded load exchanges two counts and nothing else); their lists travel to
every rank, so when more than ``MAX_SHARED_KEYS`` ranges are offered in all
(HSDP at thousands of ranks) every rank reads its own, as without read-once;
only ranges wanted *identically* are
shared (two shard groups overlapping in part of a block each read that block);
on one host with a local disk the replicas' duplicate reads were served by
the page cache anyway, so there read-once saves storage traffic, not time
(docs/performance.md, "Several GPUs").

Example (what the plan decides; the load uses it by itself):

    >>> p = plan_shared([[("f", 0, 0, 64)], [("f", 0, 0, 64)]], round_bytes=1 << 20)
    >>> [(s.reader, s.holders) for r in p.rounds for s in r]
    [(1, (0, 1))]
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Callable, Dict, List, Mapping, Optional, Sequence, Tuple

from . import _knobs
from ._collective import agree
from ._p2p import p2p_op, start_ops, transfer_device, wait_ops, warm_nccl
from ._readers import Want, damaged_units
from .errors import ChecksumMismatchError, LoadFailedError

__all__ = [
    "Key",
    "Shared",
    "SharedPlan",
    "Sources",
    "plan_shared",
    "interior",
    "read_once",
    "enabled",
]

#: A wanted byte range: (file, chunk's byte offset in the file, start, stop within the chunk).
Key = Tuple[str, int, int, int]

#: Most wanted ranges (summed over ranks) the read-once exchange gathers; past
#: it every rank reads its own (the lists would travel to every rank).
MAX_SHARED_KEYS = 32768

# Round-buffer offsets are aligned so that every piece can be viewed as its dtype in place.
_ALIGN = 64
#: Bytes of one CRC job when checking what arrived (threads share a range's whole units in pieces of this).
CHECK_PIECE_BYTES = 8 << 20
#: Damaged units named in one error.
_MAX_SHOWN = 10


def _nbytes(k: Key) -> int:
    return k[3] - k[2]


def _align(n: int) -> int:
    return -(-n // _ALIGN) * _ALIGN


@dataclass(frozen=True)
class Shared:
    """One shared byte range: its key, the group index of its reader, and every holder (sorted).

    The reader is one of the holders, except with ``readers`` (the memory
    tier), where it may be a rank that only sends.
    """

    key: Key
    reader: int
    holders: Tuple[int, ...]


@dataclass
class SharedPlan:
    """Who reads what, in which round (group indices, not global ranks).

    ``rounds[k]``: the shared ranges of round k, in reading order.
    ``read_bytes[i]``: shared bytes rank ``i`` reads for itself and others.
    """

    rounds: List[List[Shared]] = field(default_factory=list)
    read_bytes: List[int] = field(default_factory=list)

    @property
    def shared_keys(self) -> List[Key]:
        return [s.key for r in self.rounds for s in r]


def plan_shared(
    keys_by_rank: Sequence[Sequence[Key]], *, round_bytes: int, readers: Optional[Mapping[str, Sequence[int]]] = None
) -> SharedPlan:
    """Assign every range wanted by several ranks to one reader, and cut the reads into rounds (pure).

    Args:
        keys_by_rank: each rank's wanted ranges (group index -> keys).
        round_bytes: bytes of shared ranges one rank reads or receives per
            round, at most (a single larger range gets a round of its own
            slice).
        readers: None (storage: every rank reads every file), or
            ``file -> group indices that can read it`` (the memory tier: the
            ranks whose node holds a copy). Then a range is also planned when
            its one holder cannot read its file, and its reader is a wanting
            rank that can read it, else the least loaded rank that can (a
            *sender* outside the holders).

    Returns:
        :class:`SharedPlan`, identical for identical inputs on every rank.

    The ranges of one holder set, in file order, are split into ``len(holders)``
    contiguous spans of about equal bytes (contiguous: a reader's ranges
    coalesce into large reads); the first span of the j-th holder set goes to
    its ``j % len(holders)``-th holder, so that many small holder sets do not
    all load the same rank.

    Example:
        >>> p = plan_shared([[("f", 0, 0, 8), ("f", 0, 8, 16)], [("f", 0, 0, 8), ("f", 0, 8, 16)]], round_bytes=64)
        >>> [(s.key[2], s.reader) for r in p.rounds for s in r], p.read_bytes
        ([(0, 0), (8, 1)], [8, 8])
    """
    world = len(keys_by_rank)
    holders: Dict[Key, List[int]] = {}
    for i, keys in enumerate(keys_by_rank):
        for k in set(keys):
            holders.setdefault(k, []).append(i)
    by_set: Dict[Tuple[int, ...], List[Key]] = {}
    for k, holding in holders.items():
        if _nbytes(k) <= 0:
            continue
        if len(holding) > 1 or (readers is not None and holding[0] not in readers.get(k[0], ())):
            by_set.setdefault(tuple(sorted(holding)), []).append(k)
    queues: List[List[Shared]] = [[] for _ in range(world)]
    read_bytes = [0] * world
    for j, hs in enumerate(sorted(by_set)):
        keys = sorted(by_set[hs])
        total = sum(_nbytes(k) for k in keys)
        n, pos = len(hs), 0
        for k in keys:
            if readers is None:
                # The span this range's middle falls in: contiguous and byte-balanced.
                span = min(n - 1, ((2 * pos + _nbytes(k)) * n) // (2 * total))
                reader = hs[(span + j) % n]
            else:
                can = sorted(set(readers.get(k[0], ())))
                if not can:
                    raise ValueError(f"no rank can read {k[0]!r} (wanted by group ranks {list(hs)})")
                # A holder that can read it reads it (nothing crosses the link
                # for it); else the least loaded rank that can, so a lost
                # node's bytes are read by all the ranks of the node holding them.
                cands = [h for h in hs if h in can] or can
                reader = min(cands, key=lambda r: (read_bytes[r], r))
            queues[reader].append(Shared(k, reader, hs))
            read_bytes[reader] += _nbytes(k)
            pos += _nbytes(k)
    for q in queues:
        # File order, as the reader reads: one continuous read over all rounds
        # delivers round after round.
        q.sort(key=lambda sh: sh.key)
    widest = max((len(hs) + (readers is not None) for hs in by_set), default=1)
    # A rank's round buffer holds what it reads plus what it receives: with
    # holder sets of up to ``widest`` ranks, each reader's slice of a round is
    # ``round_bytes / widest``.
    slice_bytes = max(1, round_bytes // widest)
    rounds: List[List[Shared]] = []
    heads = [0] * world
    while any(heads[i] < len(queues[i]) for i in range(world)):
        rnd: List[Shared] = []
        for i in range(world):
            taken = 0
            q = queues[i]
            while heads[i] < len(q) and (taken == 0 or taken + _nbytes(q[heads[i]].key) <= slice_bytes):
                taken += _nbytes(q[heads[i]].key)
                rnd.append(q[heads[i]])
                heads[i] += 1
        rounds.append(rnd)
    return SharedPlan(rounds, read_bytes)


@dataclass(frozen=True)
class Sources:
    """Where the bytes of a load are when not every rank can read every file (the memory tier).

    ``readers``: file -> group indices whose storage (their node's memory)
    holds a good copy; ``chunk_of(file, byte_offset)``: the saved chunk at
    that offset (with its block CRCs), for a rank that reads a range it does
    not load itself, only to send it.

    A rank that reads a range only to send it (none of the ranks that load
    it can read its file: a lost node's shard) reads it unchecked, whole
    checksum units; each receiver checks it on arrival, once, before placing
    it. ``on_damage(file, sender)``: called on the receiver, before the
    load fails with ``ChecksumMismatchError``, when bytes of ``file`` from
    group index ``sender`` fail their CRC-32C (the caller then excludes
    that sender's copy and runs the stream again).
    """

    readers: Mapping[str, Sequence[int]]
    chunk_of: Callable[[str, int], Any]
    on_damage: Optional[Callable[[str, int], None]] = None


@dataclass(frozen=True)
class _Group:
    """The ranges of one round that one reader sends to one holder set, contiguous in every holder's buffer."""

    reader: int
    holders: Tuple[int, ...]
    tag: int
    start: int  # byte offset in this rank's round buffer
    stop: int
    items: Tuple[Tuple[Shared, int], ...]  # (range, its offset in this rank's round buffer)


def round_layout(rnd: Sequence[Shared], me: int) -> Tuple[List[_Group], int]:
    """The groups of round ``rnd`` that rank ``me`` holds, laid out in its round buffer (pure).

    Every holder of a (reader, holder set) group lays that group out the
    same way (same order, same relative offsets, aligned start), so one
    message carries it. Returns ``(groups, buffer bytes)``.

        >>> s = [Shared(("f", 0, 0, 10), 0, (0, 1)), Shared(("f", 0, 10, 20), 1, (0, 1))]
        >>> [(g.reader, g.start, g.stop) for g in round_layout(s, 1)[0]]
        [(0, 0, 64), (1, 64, 128)]
    """
    groups: Dict[Tuple[int, Tuple[int, ...]], List[Shared]] = {}
    for s in rnd:
        groups.setdefault((s.reader, s.holders), []).append(s)
    out: List[_Group] = []
    at = 0
    for tag, gk in enumerate(sorted(groups)):
        reader, hs = gk
        if me not in hs and me != reader:
            continue
        items = []
        start = at
        for s in groups[gk]:
            items.append((s, at))
            at += _align(_nbytes(s.key))
        out.append(_Group(reader, hs, tag, start, at, tuple(items)))
    return out, at


def enabled() -> bool:
    """Whether loads read shared bytes once (``SHARDCKPT_LOAD_READ_ONCE``, read at call time)."""
    return bool(_knobs.LOAD_READ_ONCE)


def key_of(w: Any) -> Key:
    """The :data:`Key` of a ``_readers.Want``."""
    return (w.chunk.file, w.chunk.byte_offset, w.start, w.stop)


def read_once(
    storage: Any,
    wants: Sequence[Any],
    *,
    comm: Any,
    group: Any,
    read: Callable[..., Any],
    deliver: Callable[..., Any],
    place: Callable[[Any, Any], Any],
    pool: Any,
    threads: int,
    stats: Any,
    round_bytes: int,
    shareable: Optional[Callable[[Any], bool]] = None,
    sources: Optional[Sources] = None,
) -> Any:
    """Read ``wants`` (``_readers.Want``) with shared ranges read once and sent to their other holders.

    Args:
        storage: the checkpoint's storage.
        wants: every range this rank needs.
        comm: the load's ``_collective.Comm`` (``world > 1``).
        group: its process group (None: the world).
        read: ``_readers.read_verified``.
        deliver: ``read``'s consumer for ranges only this rank needs.
        place: ``place(want, uint8 tensor of its bytes) -> fence or None``:
            copies a shared want's bytes from the round buffer into its
            destination.
        pool: the read buffer pool.
        threads: reads in flight.
        stats: a ``ReadStats`` to fill (``sent_bytes``/``received_bytes`` too).
        round_bytes: bytes of one round buffer (three are held).
        shareable: which wants other ranks may hold too (None: every want);
            only those are offered to the exchange.
        sources: None: every rank reads every file from ``storage``. Given
            (the memory tier): each rank's ``storage`` holds only some files;
            a want whose file this rank cannot read is offered too, and is
            read (verified) by a rank that can and sent here; the exchange
            always runs (no ``MAX_SHARED_KEYS`` fallback: there is no direct
            read to fall back to), and a failure anywhere is raised on every
            rank (same type), so the caller may run the stream again.

    Returns:
        ``stats``.

    Raises:
        Whatever a read raises, on every rank (same type, one message naming
        the reading rank), and ``LoadFailedError`` naming a peer that died or
        did not send within ``collective_timeout_s``.

    Steps: :func:`_offered` (which wants go to the exchange),
    :func:`_agree_plan` (gather the offered keys, :func:`plan_shared`), and
    :class:`_Rounds` — one background thread reads everything this rank
    reads (its shared ranges of every round, in one continuous
    ``read_verified``, no drain between rounds, into three round buffers used
    in turn, then its own ranges); the calling thread agrees on each round,
    posts its transfers and, one round later, waits for them and places the
    bytes; the last exchange waits for the own ranges too.
    """
    what = f"the load from {storage.url} stopped part-way (ranks not named here loaded all their tensors)"
    keys = [key_of(w) for w in wants]
    offered = _offered(wants, keys, comm.rank, shareable, sources)

    def direct() -> Any:
        return read(storage, wants, deliver, threads=threads, pool=pool, stats=stats)

    plan = _agree_plan(comm, keys, offered, round_bytes=round_bytes, sources=sources, what=what)
    if plan is None:
        return direct()
    if not plan.rounds:
        if sources is None:
            return direct()
        # With sources every failure is agreed (as in the rounds below), so a
        # caller that runs the stream again after a damaged copy finds every
        # rank failed or every rank done, never some of each.
        agree(comm, direct, what=what)
        return stats
    rounds = _Rounds(
        storage, wants, keys, offered, plan, comm=comm, group=group, read=read, deliver=deliver, place=place, pool=pool,
        threads=threads, stats=stats, sources=sources, what=what,
    )
    return rounds.run()


def interior(chunk: Any, start: int, stop: int) -> Tuple[int, int]:
    """The whole checksum units inside chunk bytes ``[start, stop)``: what a receiver can check alone (pure).

    A range read only to send it is checked once: these units by the
    receiver on arrival, the partial units at its two ends (whose other
    bytes do not travel) by the sender as it reads them. An empty result
    (``(start, start)``) leaves it all to the sender; a chunk without
    checksums has nothing to check anywhere.

        >>> from shardckpt._format.chunk import Chunk
        >>> interior(Chunk("f", 0, 10, block_bytes=4, block_crcs=(1, 2, 3)), 1, 10)
        (4, 10)
    """
    if chunk.blocked:
        b = chunk.block_bytes
        lo = -(-start // b) * b
        hi = stop if stop == chunk.nbytes else (stop // b) * b
        return (lo, hi) if lo < hi else (start, start)
    if chunk.crc32c is not None:
        return (start, stop) if (start, stop) == (0, chunk.nbytes) else (start, start)
    return start, stop


def _offered(wants: Sequence[Any], keys: Sequence[Key], me: int, shareable: Optional[Callable[[Any], bool]],
             sources: Optional[Sources]) -> List[bool]:
    """Which wants this rank offers to the exchange: the shareable ones, and (memory tier) those of files it cannot read."""
    if sources is None:
        return [shareable is None or shareable(w) for w in wants]
    return [(shareable is not None and shareable(w)) or me not in sources.readers.get(k[0], ()) for w, k in zip(wants, keys)]


def _agree_plan(comm: Any, keys: Sequence[Key], offered: Sequence[bool], *, round_bytes: int,
                sources: Optional[Sources], what: str) -> Optional[SharedPlan]:
    """Gather every rank's offered keys and plan who reads what (:func:`plan_shared`); None: every rank reads its own.

    The key lists travel to every rank, so they are gathered only when they
    are few in all: first their count (to rank 0), then rank 0's go (to
    every rank): O(1) bytes per rank. A purely sharded load (FSDP, TP)
    offers none and stops here; a count over ``MAX_SHARED_KEYS`` (HSDP at
    thousands of ranks) falls back to direct reads on every rank alike.
    With ``sources`` the exchange always runs (there is no direct read to
    fall back to).
    """
    mine = sorted({key for key, o in zip(keys, offered) if o})
    if sources is None:
        _, counts = agree(comm, lambda: len(mine), what=what, share=lambda v: v, mode="to_root")
        _, go = agree(comm, lambda: None, what=what, mode="from_root",
                      share=lambda _: counts is not None and 0 < sum(counts) <= MAX_SHARED_KEYS)
        if not go:
            return None
    _, keys_by_rank = agree(comm, lambda: mine, what=what, share=lambda v: v)
    return plan_shared(keys_by_rank, round_bytes=round_bytes, readers=None if sources is None else sources.readers)


class _Rounds:
    """One rank's agreed rounds of a :func:`read_once`: the reader thread, the round buffers, the transfers.

    Built from the agreed :class:`SharedPlan` (with rounds). :meth:`run`
    starts the reader thread (:meth:`_reader`) and, per round, agrees with
    the other ranks that the round's reads succeeded (:meth:`_step`) before
    posting its transfers (:meth:`_post`); one round later the transfers are
    waited for and the bytes placed (:meth:`_finish`).
    """

    def __init__(self, storage: Any, wants: Sequence[Any], keys: Sequence[Key], offered: Sequence[bool],
                 plan: SharedPlan, *, comm: Any, group: Any, read: Callable[..., Any], deliver: Callable[..., Any],
                 place: Callable[[Any, Any], Any], pool: Any, threads: int, stats: Any, sources: Optional[Sources],
                 what: str):
        import threading

        import torch

        self.storage, self.comm, self.group, self.what = storage, comm, group, what
        self.read_fn, self.deliver, self.place = read, deliver, place
        self.pool, self.threads, self.stats, self.sources = pool, threads, stats, sources
        me = self.me = comm.rank
        # The keys this rank receives or reads for itself (a key it wants but did
        # not offer, because it reads it itself, stays its own read).
        shared = {s.key for r in plan.rounds for s in r if me in s.holders}
        self.by_key: Dict[Key, List[Any]] = {}
        self.own: List[Any] = []
        for w, key, o in zip(wants, keys, offered):
            if o and key in shared:
                self.by_key.setdefault(key, []).append(w)
            else:
                self.own.append(w)
        self.cuda = transfer_device(group) == "cuda"
        self.device = torch.device("cuda", torch.cuda.current_device()) if self.cuda else torch.device("cpu")
        if self.cuda:
            warm_nccl(group)  # every rank is here (the plan has rounds on every rank alike)
        self.layouts = [round_layout(r, me) for r in plan.rounds]
        n = self.n = len(self.layouts)
        self.nbuf = min(3, n)
        size = max(b for _, b in self.layouts)
        self.bufs = [torch.empty(size, dtype=torch.uint8, device=self.device) for _ in range(self.nbuf)]
        # What this rank reads for each round (tag: (round, offset in its buffer)), in file order, and
        # whether it checks it: of a range only sent (this rank is not among its holders) the whole
        # checksum units are checked by its receivers on arrival (``_check``) and read unchecked here, the
        # partial ones at its ends checked here -- every byte verified once (``interior``).
        self.reads: List[Tuple[Any, bool]] = []
        for k, (groups, _) in enumerate(self.layouts):
            mine: List[Tuple[Any, bool]] = []
            for g in groups:
                if g.reader != me:
                    continue
                for s, off in g.items:
                    c, lo, hi = self._chunk(s.key), s.key[2], s.key[3]
                    a, e = (lo, lo) if me in g.holders else interior(c, lo, hi)
                    for x, y, check in ((lo, a, True), (a, e, False), (e, hi, True)) if a < e else ((lo, hi, True),):
                        if x < y:
                            mine.append((Want(c, x, y, (k, off + x - lo)), check))
            # Checked reads of a round first, then its unchecked ones: at most two runs a round (one
            # ``read`` call each, below); a lost node's shard, all whole units, is one run over every round.
            self.reads += sorted(mine, key=lambda wc: not wc[1])
        self.host: Any = None  # pinned host copy of a received group to check (CUDA wire), made on first use
        self.crc_pool: Any = None  # threads checking what arrived (``_check``), made on first use
        self.left = [0] * n
        for w, _ in self.reads:
            self.left[w.tag[0]] += 1
        self.read_done = [threading.Event() for _ in range(n)]
        self.read_fence: List[Any] = [None] * n
        self.freed = [threading.Event() for _ in range(n)]  # round k's buffer may be reused
        self.freed_fence: List[Any] = [None] * n  # ... once the device copies out of it are done
        for k in range(n):
            if not self.left[k]:
                self.read_done[k].set()
        self.error: Optional[BaseException] = None
        self.cancel = False
        self.own_done = threading.Event()
        self.posted: List[Tuple[int, List[Any]]] = []  # the round whose transfers are in flight
        self.failed: List[BaseException] = []  # a failure between two exchanges, raised at the next one

    def _chunk(self, key: Key) -> Any:
        """The saved chunk of ``key``: from a want of this rank, else (a range read only to send) from ``sources``."""
        if key in self.by_key:
            return self.by_key[key][0].chunk
        assert self.sources is not None  # without sources every reader holds what it reads
        return self.sources.chunk_of(key[0], key[1])

    def _into(self, w, data, owner, off):
        """The reader's consumer for shared ranges: copy into round ``k``'s buffer once it is free; a fence or None."""
        import torch

        k, pos = w.tag
        nbuf = self.nbuf
        if self.cancel:
            raise _Cancelled()
        if k >= nbuf:
            while not self.freed[k - nbuf].wait(0.05):
                if self.cancel:
                    raise _Cancelled()
            if self.cancel:
                raise _Cancelled()
        src = owner[0][off : off + len(data)]
        dst = self.bufs[k % nbuf][pos : pos + len(data)]
        fence = None
        if dst.is_cuda:
            if k >= nbuf and self.freed_fence[k - nbuf] is not None:
                torch.cuda.current_stream().wait_event(self.freed_fence[k - nbuf])
            dst.copy_(src, non_blocking=True)
            fence = torch.cuda.Event()
            fence.record()
        else:
            dst.copy_(src)
        self.left[k] -= 1
        if not self.left[k]:
            self.read_fence[k] = fence
            self.read_done[k].set()
        return fence

    def _own_into(self, w, data, owner, off):
        """The reader's consumer for this rank's own ranges (straight into their tensors)."""
        if self.cancel:
            raise _Cancelled()  # another rank failed: stop reading
        return self.deliver(w, data, owner, off)

    def _reader(self) -> None:
        """The background thread: every shared range this rank reads, round after round, then its own ranges."""
        import torch

        try:
            if self.cuda:
                torch.cuda.set_device(self.device)  # a new thread starts on device 0: events and copies belong here
            with torch.no_grad():
                # Ranges others wait for first (their rounds go out while this
                # rank reads its own), then this rank's own.
                kw: Dict[str, Any] = dict(threads=self.threads, pool=self.pool, stats=self.stats)
                # Runs of reads checked alike, in order (one continuous read
                # each; a lost node's shard is one unchecked run).
                at = 0
                while at < len(self.reads):
                    check = self.reads[at][1]
                    end = at
                    while end < len(self.reads) and self.reads[end][1] == check:
                        end += 1
                    run = [w for w, _ in self.reads[at:end]]
                    self.read_fn(self.storage, run, self._into, **(kw if check else dict(kw, verify=False)))
                    at = end
                if self.own:
                    self.read_fn(self.storage, self.own, self._own_into, **kw)
        except BaseException as e:  # noqa: BLE001 - raised in the calling thread at its next step
            self.error = e
        finally:
            self.own_done.set()
            for ev in self.read_done:
                ev.set()

    def _wait_read(self, k: int) -> None:
        """Wait for round ``k``'s reads (``k == n``: for this rank's own ranges, read last)."""
        import torch

        comm, n = self.comm, self.n
        ev = self.read_done[k] if k < n else self.own_done
        if not ev.wait(comm.timeout_s):
            raise LoadFailedError(
                f"{comm.op}: this rank's reads of {'round %d' % k if k < n else 'its own ranges'} did not finish "
                f"within collective_timeout_s={comm.timeout_s:g}: the storage is stalled"
            )
        if self.error is not None and not isinstance(self.error, _Cancelled):
            raise self.error
        if k < n and self.read_fence[k] is not None:
            torch.cuda.current_stream().wait_event(self.read_fence[k])

    def _post(self, k: int) -> None:
        """Post round ``k``'s transfers: this rank's reads to their other holders, what it receives from the readers."""
        comm, me, stats = self.comm, self.me, self.stats
        buf = self.bufs[k % self.nbuf]
        ops = []
        for g in self.layouts[k][0]:
            part = buf[g.start : g.stop]
            if g.reader == me:
                for q in g.holders:
                    if q != me:
                        ops.append(p2p_op("send", part, comm.ranks[q], self.group, 2 * g.tag + k % 2))
                        stats.sent_bytes += g.stop - g.start
            else:
                # Two rounds may be on the wire at once: their messages between one pair differ by tag.
                ops.append(p2p_op("recv", part, comm.ranks[g.reader], self.group, 2 * g.tag + k % 2))
                stats.received_bytes += g.stop - g.start
        self.posted.append((k, start_ops(ops)))

    def _finish(self) -> None:
        """Wait for the oldest posted round's transfers, place its bytes into the tensors, free its buffer."""
        import torch

        comm, me = self.comm, self.me
        k, works = self.posted.pop(0)
        groups = self.layouts[k][0]
        peers = {comm.ranks[g.reader] for g in groups if g.reader != me}
        peers |= {comm.ranks[q] for g in groups if g.reader == me for q in g.holders if q != me}
        wait_ops(works, comm, sorted(peers), self.cuda, doing="sending replicated bytes")
        buf = self.bufs[k % self.nbuf]
        for g in groups:
            if g.reader != me and g.reader not in g.holders:
                self._check(g, buf)  # read unchecked by its sender (it does not load it)
            for s, off in g.items:
                for w in self.by_key.get(s.key, ()):
                    self.place(w, buf[off : off + _nbytes(s.key)])
        if self.cuda:
            # The reader's next copies into this buffer wait for these (on its own stream).
            self.freed_fence[k] = torch.cuda.Event()
            self.freed_fence[k].record()
        self.freed[k].set()

    def _check(self, g: _Group, buf: Any) -> None:
        """Check what a rank read unchecked and sent here (group ``g`` of ``buf``) before it is placed.

        The whole checksum units (``interior``) of every range, in pieces of
        about ``CHECK_PIECE_BYTES`` on ``threads`` threads (CRC-32C releases
        the GIL); on a CUDA wire through a ring of small pinned pieces. Raises
        ChecksumMismatchError naming the sender (``sources.on_damage`` told
        first): the agreement of the next exchange fails every rank.
        """
        import torch

        jobs = []  # (file, chunk, units' start, stop, their offset in the group)
        for s, off in g.items:
            chunk = self.by_key[s.key][0].chunk
            a, e = interior(chunk, s.key[2], s.key[3])
            if a == e or not (chunk.blocked or chunk.crc32c is not None):
                continue  # all checked by the sender (partial units), or nothing to check
            piece = max(1, CHECK_PIECE_BYTES // chunk.block_bytes) * chunk.block_bytes if chunk.blocked else e - a
            jobs += [(s.key[0], chunk, x, min(e, x + piece), off - g.start + x - s.key[2]) for x in range(a, e, piece)]
        if not jobs:
            return
        part = buf[g.start : g.stop]

        def one(job: Tuple[str, Any, int, int, Any]) -> Tuple[str, List[Any]]:
            rel, chunk, x, y, data = job
            return rel, damaged_units(chunk, x, y, data)

        if self.threads > 1 and len(jobs) > 1 and self.crc_pool is None:
            from concurrent.futures import ThreadPoolExecutor

            self.crc_pool = ThreadPoolExecutor(max_workers=self.threads, thread_name_prefix="shardckpt-crc")
        pool = self.crc_pool
        results: List[Tuple[str, List[Any]]] = []
        if not part.is_cuda:
            data = _host_bytes(part)
            views = [(rel, chunk, x, y, data[at : at + (y - x)]) for rel, chunk, x, y, at in jobs]
            results = list(pool.map(one, views)) if pool is not None else [one(v) for v in views]
        else:
            # Through a ring of small pinned pieces: each copied to the host (after the receive: this stream waits
            # for NCCL's) while the threads check the pieces before it; nothing the size of a round is pinned.
            piece = max(CHECK_PIECE_BYTES, max(y - x for _, _, x, y, _ in jobs))
            ring = 2 * max(1, self.threads)
            if self.host is None or int(self.host.numel()) < piece * ring:
                self.host = torch.empty(piece * ring, dtype=torch.uint8, pin_memory=True)
            busy: List[Any] = [None] * ring
            for i, (rel, chunk, x, y, at) in enumerate(jobs):
                k = i % ring
                if busy[k] is not None:
                    results.append(busy[k].result())
                dst = self.host[k * piece : k * piece + (y - x)]
                dst.copy_(part[at : at + (y - x)])
                work = (rel, chunk, x, y, _host_bytes(dst))
                busy[k] = pool.submit(one, work) if pool is not None else _Now(one(work))
            results += [b.result() for b in busy if b is not None]
        self.stats.verified_bytes += sum(y - x for _, _, x, y, _ in jobs)
        bad = [(rel, u) for rel, units in results for u in units]
        if not bad:
            return
        if self.sources is not None and self.sources.on_damage is not None:
            for rel in sorted({rel for rel, _ in bad}):
                self.sources.on_damage(rel, g.reader)
        shown = "; ".join(f"{rel}: {u.label} (bytes {u.start}..{u.stop})" for rel, u in bad[:_MAX_SHOWN])
        more = f" ... ({len(bad) - _MAX_SHOWN} more)" if len(bad) > _MAX_SHOWN else ""
        raise ChecksumMismatchError(
            f"checksum mismatch in bytes received from rank {self.comm.ranks[g.reader]} (read there unchecked, "
            f"checked here on arrival): its copy is damaged: {shown}{more}"
        )

    def _step(self, k: int) -> None:
        """This rank's part of exchange ``k``: a failure since the last one (round ``k-2``'s transfers), round ``k``'s reads."""
        if self.failed:
            raise self.failed.pop()
        if k <= self.n:
            self._wait_read(k)  # the reader is ahead, on the next rounds (then its own ranges), meanwhile

    def run(self) -> Any:
        """Every round, agreed by every rank; returns ``stats``. Transfers in flight finish before the buffers go."""
        import threading

        th = threading.Thread(target=self._reader, name="shardckpt-read-once", daemon=True)
        th.start()
        try:
            for k in range(self.n + 2):
                # Every rank runs every step and then meets the others, so a
                # failure anywhere (a damaged block on the reader) stops all ranks
                # at the same exchange, before any byte of that round is sent; a
                # damaged block found on arrival, at the exchange after the next.
                agree(self.comm, lambda k=k: self._step(k), what=self.what)  # type: ignore[misc]
                if k < self.n:
                    try:
                        self._post(k)
                    except Exception as e:  # noqa: BLE001 - reported to every rank at the next exchange
                        self.failed.append(e)
                # The previous round's transfers are waited for, checked and
                # placed while this round's are on the wire.
                while len(self.posted) > (1 if k < self.n else 0) and not self.failed:
                    try:
                        self._finish()
                    except Exception as e:  # noqa: BLE001 - reported to every rank at the next exchange
                        self.failed.append(e)
        finally:
            self.cancel = True
            for ev in self.freed:
                ev.set()
            th.join()
            if self.crc_pool is not None:
                self.crc_pool.shutdown(wait=True)
            # Transfers posted by every rank of them before an agreed failure:
            # finished before their buffers go (the caller may run the stream
            # again: the memory tier after a damaged copy). A dead peer fails
            # these within the timeout; the failure already raised wins.
            for _, works in self.posted:
                try:
                    wait_ops(works, self.comm, [], self.cuda, doing="finishing the transfers of a failed load")
                except Exception:  # noqa: BLE001 - the first error is the one raised
                    pass
        return self.stats


def _host_bytes(t: Any) -> Any:
    """A CPU uint8 tensor's bytes for the CRC: a view without a copy (NumPy), else a copy."""
    try:
        return memoryview(t.numpy())
    except RuntimeError:  # torch without NumPy
        return bytes(t.tolist())


class _Now:
    """A result computed already, with a future's ``result()``."""

    def __init__(self, value: Any):
        self.value = value

    def result(self) -> Any:
        return self.value


class _Cancelled(Exception):
    """The calling thread gave up (another rank failed): the reader stops."""
