"""Cross-rank agreement for save, load, async_save and the manager: one mechanism, bounded in time.

The collective rule: with an initialised process group, ``save``, ``load``,
``async_save`` and the manager's ``save``/``restore`` are collective — every
rank of the group calls them, in the same order. ``no_dist=True`` runs one of
them in this process alone, as if no process group existed (world size 1:
rank-0 export or evaluation inside a distributed job); every tensor must then
be whole in this process (plain tensors, or DTensors on a mesh of one rank).

Every exchange between ranks goes through :func:`agree`: each rank runs a
local step, the outcomes meet on rank 0, and every rank returns — or raises
the same :class:`~shardckpt.errors.CheckpointError` subclass with the same
message — together. A rank that does not arrive within ``collective_timeout_s``
is named, on every rank that did.

How ranks meet: through the process group's key-value store (the c10d
``TCPStore`` every ``init_process_group`` creates), not through process-group
collectives. Measured and chosen because

* ``store.wait(keys, timeout)`` is bounded per call, and ``store.check`` then
  tells exactly which ranks never arrived — a gloo collective with a missing
  peer blocks until the *group's* timeout (30 min by default) and fails with
  ``Connection closed by peer``, naming nobody;
* it needs no extra process group: ``dist.new_group`` is itself a collective
  of the whole world, so a side group cannot be created lazily when a rank is
  missing (it hangs there instead), and NCCL-only default groups just work;
* the background thread of an async save uses it while the training thread
  keeps using the training group (the store client serialises its requests).

Every (group, channel) pair counts its exchanges; keys are
``shardckpt/<channel>/<group hash>/<n>/...``. One exchange, at N ranks:

* **every rank** posts ``r<i>`` (its outcome: its error or None, a value
  hash, and in ``to_root``/``all`` mode its value) and bumps the counter
  ``n`` (``add``); the rank that brings it to N sets ``all`` (one more). In
  ``distinct`` mode it first bumps ``h/<hash of its value>``; the first rank
  of each distinct value (the counter came back 1) also posts the value as
  ``p/<hash>/<k>`` (pieces of at most ``MAX_VALUE_BYTES``, one ``set``
  each), so identical values (every rank of a pipeline stage) travel once.
* **a peer** then checks for ``v`` (the verdict; one ``check``), waits for
  it if it is not there yet (one ``wait``, on the helper connection below),
  reads it, in ``distinct`` mode reads its group's piece ``g/<hash>``, and
  deletes its ``r<i>``: **6 round trips** (5 when the verdict is already
  there; 8 in ``distinct`` mode, plus one per piece for the first rank of a
  value; plus one for the rank that arrives last), independent of N.
* **rank 0** checks (or waits) for ``all``, reads the N outcomes with
  ``multi_get`` in batches of ``BATCH_KEYS`` (ceil(N/256) round trips),
  deletes ``n``, ``all``, its ``r0`` and the previous exchange's verdict
  (every rank has read it once every rank posted again), and posts the
  verdict (one ``set``): with its own two posts, **ceil(N/256) + 9 round
  trips** when it arrives last. In ``distinct`` mode, with D distinct values
  of one piece each, also one ``add`` of its hash, one ``multi_get`` of the
  D values, one ``multi_set`` of the D group pieces, and per value three
  deletes (``h``, its piece, last exchange's ``g``): **ceil(N/256) + 3D +
  12**. Counted by ``benchmarks/bench_control_plane.py`` (whose counting
  store does not see the helper connection's ``wait``): rank 0 10 and 16
  (D=1) at N=4, 12 and 18 at N=600; a peer 5 and 7 plus its wait
  (torch 2.13, 2026-11-26).
* **bytes**: N small outcomes (~60 B; a ``to_root`` value as large as the
  rank's own summary) to rank 0, D distinct values to rank 0, one verdict
  (O(1): a status, ``from_root``'s value, the failing ranks' messages, capped)
  to every rank, one piece (O(tensors of that group that need correcting),
  nothing in the SPMD case) to every rank of a group. No value holds every
  rank's payload: the largest is a distinct value (a stage's tensor records
  and value tree) or one rank's summary, whatever N. ``all`` mode is the
  exception (a list by rank, to every rank): small groups and values only.
  A distinct value travels in pieces of at most ``MAX_VALUE_BYTES`` (4 MiB);
  any other value over it (a verdict, one rank's summary) fails the exchange
  with our error on every rank, never a connection reset (the libuv store's
  limit is 8 MiB).

A save makes 4 exchanges (``prepare_save``: ``distinct``; the target check:
``from_root``; the write summaries: ``to_root``; the commit outcome), plus
the replica check's (``distinct``) unless ``replicas="off"``; a load 3 (the
plan check, the read outcome, the outcome of the stateful objects'
``load_state_dict``; ``benchmarks/bench_control_plane.py`` times the first two).

After a timeout the late rank, if it ever comes, reads the same verdict (the
missing-rank error) and raises too; a peer that gives up withdraws its
outcome (deletes ``r<i>``, takes back its count) so a late rank 0 does not
take it for this exchange.

An exchange that ends in an error on every rank (a rank's step failed, or
rank 0's ``decide`` refused) has one more step, its final agreement: each
peer bumps ``read`` once it has read the verdict (the last sets
``read_all``), and rank 0 returns only then, or after
``SHARDCKPT_LIVENESS_TIMEOUT_S``. Rank 0 hosts the store and a program
usually exits on the error: without it a peer slow to read the verdict
found the store gone (issue 29).

How ranks wait: the blocking ``store.wait`` runs in a helper thread on a
clone of the store's connection, with one long timeout, while the calling
thread checks liveness once a second (below): waiting in 1 s slices makes
torch log two "socket timed out" warnings per slice. The helper also opens
that connection (``Store.clone``), which retries connecting for the store's
own timeout (30 min) when the store's host has just exited: the calling
thread, which ticks, notices that in seconds. After
``WAIT_LOG_AFTER_S`` (30 s), then every ``WAIT_LOG_EVERY_S`` (300 s), a
waiting rank logs (``logging.getLogger("shardckpt")``, WARNING) how long it
has waited and for whom: rank 0 names the ranks that have not arrived (found
with ``check`` on halves, O(missing x log N) round trips), a peer names them
up to 64 ranks and counts them above.

Dead ranks are noticed in seconds, not after ``collective_timeout_s``: every
rank that takes part in a multi-rank call starts one daemon thread that bumps
a counter under ``shardckpt/alive/<rank>`` every second, for the life of the
process (one ``add``; the first one also appends the rank to
``shardckpt/alive_roster``). Once a second while it waits, rank 0 reads the
roster (one get, ~6 bytes a rank) and the counters of its peers
(ceil(N/256) ``multi_get``s), a peer reads rank 0's counter (2 round trips).
A counter that has not moved for ``SHARDCKPT_LIVENESS_TIMEOUT_S`` (10 s),
of a rank that has not posted, means the process is gone (SIGKILL, OOM kill,
a crashed host) and the exchange fails at once naming it. A rank that is
alive but late (still training, a slow write) keeps beating and is waited for
up to ``collective_timeout_s``. A rank that never took part in a multi-rank
call has no counter and is waited for up to the timeout. The counters are
compared with the waiter's own clock, so hosts' clocks need not agree. The
store's server lives in rank 0's process: when it dies, the store itself
fails and the peers raise naming rank 0; a frozen rank 0 (SIGSTOP) is seen
by its stopped counter only while its store still answers.

Measured (``benchmarks/bench_control_plane.py``, ``docs/scaling.md``).
"""

from __future__ import annotations

import atexit
import hashlib
import logging
import os
import pickle
import threading
import time
from dataclasses import dataclass, field, replace
from datetime import timedelta
from typing import TYPE_CHECKING, Any, Callable, Dict, List, Optional, Sequence, Tuple, Type, TypeVar

from . import _knobs
from .errors import CheckpointError, SaveFailedError, UsageError, format_offenders

if TYPE_CHECKING:  # torch is imported only inside the calls that need it
    from torch.distributed import ProcessGroup

log = logging.getLogger("shardckpt")

__all__ = [
    "Comm",
    "open_comm",
    "NoProcessGroupError",
    "agree",
    "broadcast",
    "all_gather",
    "dist_info",
    "EVERY_RANK_RULE",
    "start_heartbeat",
    "Group",
    "DISTINCT",
    "MAX_VALUE_BYTES",
    "Liveness",
    "stopped",
    "default_store",
]

T = TypeVar("T")

#: Default ``collective_timeout_s`` of save, load, async_save and the manager
#: (``SHARDCKPT_COLLECTIVE_TIMEOUT_S``). An exchange waits for the slowest
#: rank, so it must exceed the longest write (or read) of one rank's shard.

#: Said whenever a rank is missing or the process group is.
EVERY_RANK_RULE = "every rank of the process group must call {op} (or pass no_dist=True to {op} from this process alone)"

# The verdict can be posted only after the last rank arrived: peers wait this
# much longer than rank 0 so that rank 0's verdict (one message, the same on
# every rank) normally wins over each peer's own guess.
_PEER_GRACE_S = 2.0

#: How often each rank's heartbeat counter moves, and how often a waiting rank
#: looks at the counters of the ranks it waits for.
HEARTBEAT_INTERVAL_S = 1.0

# Exchange modes: who receives the ``share`` values.
NONE, ALL, TO_ROOT, FROM_ROOT, DISTINCT = "none", "all", "to_root", "from_root", "distinct"


def dist_info(group: Optional["ProcessGroup"] = None) -> Tuple[int, int]:
    """``(rank, world_size)`` of the process group, ``(0, 1)`` without one."""
    import torch.distributed as dist

    if dist.is_available() and dist.is_initialized():
        return dist.get_rank(group), dist.get_world_size(group)
    return 0, 1


@dataclass(frozen=True)
class Comm:
    """Who takes part in one call's exchanges, and how long to wait for them.

    ``world == 1`` means no exchange ever happens (no process group, a group
    of one, or ``no_dist``). ``op`` names the call in messages ("save");
    ``error`` is what a missing rank or a non-shardckpt failure raises.
    """

    rank: int = 0
    world: int = 1
    ranks: Tuple[int, ...] = (0,)
    timeout_s: float = field(default_factory=lambda: _knobs.COLLECTIVE_TIMEOUT_S)
    op: str = "save"
    error: Type[CheckpointError] = SaveFailedError
    channel: str = "main"
    no_dist: bool = False

    def on_channel(self, channel: str) -> "Comm":
        """The same ranks on another sequence of exchanges (the async save's background thread)."""
        return replace(self, channel=channel)


class NoProcessGroupError(UsageError):
    """A collective call in a torchrun job (``WORLD_SIZE`` > 1) before ``init_process_group``.

    Its own type so that callers with other advice to give (the manager,
    which has no ``no_dist``) can tell it from other misuse without reading
    the message.
    """


def _torchrun_world() -> int:
    try:
        return int(os.environ.get("WORLD_SIZE", "1"))
    except ValueError:
        return 1


def open_comm(
    process_group: Optional["ProcessGroup"] = None,
    *,
    no_dist: bool = False,
    collective_timeout_s: Optional[float] = None,
    op: str = "save",
    error: Type[CheckpointError] = SaveFailedError,
) -> Comm:
    """The :class:`Comm` of one call: its ranks, timeout and error type.

    Args:
        process_group: the group the call runs over (default: the world).
        no_dist: this process alone, whatever the environment.
        collective_timeout_s: bound of every exchange (default
            ``SHARDCKPT_COLLECTIVE_TIMEOUT_S``, read now).
        op: the call's name for messages, e.g. ``"shardckpt.save"``.
        error: raised for a missing rank or a failure that is not a
            ``CheckpointError``.

    Raises:
        NoProcessGroupError: ``WORLD_SIZE`` > 1 in the environment (torchrun)
            but no process group is initialised (a ``UsageError``).
        UsageError: a non-positive timeout.
    """
    timeout = _knobs.COLLECTIVE_TIMEOUT_S if collective_timeout_s is None else collective_timeout_s
    if isinstance(timeout, bool) or not isinstance(timeout, (int, float)) or not timeout > 0:
        raise UsageError(f"{op}: collective_timeout_s must be a positive number of seconds, got {collective_timeout_s!r}")
    base = Comm(timeout_s=float(timeout), op=op, error=error, no_dist=bool(no_dist))
    if no_dist:
        return base
    import torch.distributed as dist

    if not (dist.is_available() and dist.is_initialized()):
        if _torchrun_world() > 1:
            raise NoProcessGroupError(
                f"{op}: WORLD_SIZE={os.environ.get('WORLD_SIZE')} (a torchrun job) but no process group is "
                "initialised, so the ranks would race on one checkpoint. Call "
                "torch.distributed.init_process_group() first, or pass no_dist=True for a deliberate "
                "single-process call"
            )
        return base
    world = dist.get_world_size(process_group)
    ranks = tuple(dist.get_process_group_ranks(process_group if process_group is not None else dist.group.WORLD))
    if world <= 1:
        # A group of one: no exchange, but meshes are recorded in its numbering.
        return replace(base, ranks=ranks)
    start_heartbeat()
    return replace(base, rank=dist.get_rank(process_group), world=world, ranks=ranks)


# --------------------------------------------------------------------------
# bounds and batched store access

#: Largest value shardckpt ever posts to the store. The libuv TCPStore (the
#: default since torch 2.4) resets the connection for values over 8 MiB; a
#: value over this bound fails the exchange with our own error instead.
MAX_VALUE_BYTES = 4 << 20

#: Keys per ``multi_get`` (rank 0 reads N outcomes in ceil(N / this) round
#: trips). Measured (torch 2.13, loopback): a multi_get's cost grows faster
#: than its key count (16,384 keys: 0.06 s in batches of 64-256, 0.9 s in
#: batches of 2,048, 4 s in batches of 8,192), so batches stay small.
BATCH_KEYS = 256

#: A waiting rank logs who it still waits for after this many seconds, then
#: every ``WAIT_LOG_EVERY_S``.
WAIT_LOG_AFTER_S = 30.0
WAIT_LOG_EVERY_S = 300.0

#: Below this group size a waiting peer names the ranks it waits for (it
#: costs it O(world) store round trips); above it, it counts them.
PEER_NAMES_PENDING_UP_TO = 64


class _TooBig(Exception):
    pass


def _set(store, key: str, value: bytes, what: str) -> None:
    if len(value) > MAX_VALUE_BYTES:
        raise _TooBig(
            f"{what} is {len(value) / 2**20:.1f} MiB, over the {MAX_VALUE_BYTES / 2**20:g} MiB that shardckpt "
            "posts to the process group's store as one value (the libuv TCPStore refuses values over 8 MiB)"
        )
    store.set(key, value)


def _multi_get(store, keys: Sequence[str]) -> List[bytes]:
    """Values of ``keys`` (all set), ``BATCH_KEYS`` per round trip where the store batches."""
    if not keys:
        return []
    if not hasattr(store, "multi_get"):  # pragma: no cover - torch without multi_get
        return [store.get(k) for k in keys]
    out: List[bytes] = []
    for i in range(0, len(keys), BATCH_KEYS):
        out.extend(store.multi_get(list(keys[i : i + BATCH_KEYS])))
    return out


def _absent(store, keys: Sequence[str]) -> List[int]:
    """Positions of the keys not set: ``check`` on halves, O(missing x log) round trips (failure paths only)."""
    out: List[int] = []

    def visit(lo: int, hi: int) -> None:
        if lo >= hi or store.check(list(keys[lo:hi])):
            return
        if hi - lo == 1:
            out.append(lo)
            return
        mid = (lo + hi) // 2
        visit(lo, mid)
        visit(mid, hi)

    for lo in range(0, len(keys), 256):
        visit(lo, min(lo + 256, len(keys)))
    return out


def _delete(store, key: str) -> None:
    try:
        store.delete_key(key)
    except Exception:  # cleanup only
        pass


# --------------------------------------------------------------------------
# liveness


_HEARTBEAT_LOCK = threading.Lock()
_HEARTBEAT: Dict[str, Any] = {"thread": None}

#: Every process that beats appends ``"<global rank>,"`` here once per store:
#: a waiter reads which counters exist in one get, then the counters in batches.
_ROSTER_KEY = "shardckpt/alive_roster"


def _alive_key(global_rank: int) -> str:
    return f"shardckpt/alive/{global_rank}"


def _beat() -> None:
    """Move this process's counter once (on the current default store, if any)."""
    import torch.distributed as dist

    if not (dist.is_available() and dist.is_initialized()):
        return
    store = default_store()
    me = dist.get_rank()
    # A counter just created (1) is this process's first beat on this store:
    # list it once, so that waiters find every counter in one read.
    if store.add(_alive_key(me), 1) == 1:
        store.append(_ROSTER_KEY, f"{me},".encode())


#: Set at interpreter exit: the heartbeat thread finishes its beat in flight and ends.
_HEARTBEAT_STOP = threading.Event()

#: Bound of the wait, at interpreter exit, for a beat in flight (a store call to a store that went away).
HEARTBEAT_EXIT_WAIT_S = 5.0


def _heartbeat_loop() -> None:
    while not _HEARTBEAT_STOP.wait(HEARTBEAT_INTERVAL_S):
        try:
            _beat()
        except Exception:  # no group right now, or the store is gone: peers judge by the counter
            pass


@atexit.register
def _stop_heartbeat() -> None:
    """At interpreter exit, end the heartbeat thread before the interpreter finalizes.

    A daemon thread that returns from a C++ store call (which released the
    GIL) once finalization began is ended by ``pthread_exit``; that unwinding
    through pybind11's noexcept GIL guard calls ``std::terminate``: the
    process aborts (exit -6, "terminate called without an active exception")
    after the script itself finished. Reproduced: 13 of 20 two-rank runs
    that beat continuously and exited without ``destroy_process_group``.
    """
    _HEARTBEAT_STOP.set()
    t = _HEARTBEAT["thread"]
    if t is not None:
        t.join(HEARTBEAT_EXIT_WAIT_S)


def start_heartbeat() -> None:
    """Start this process's heartbeat thread once (it runs until the process exits).

    The first beat is written before returning, so a rank killed during its
    first call is already visible to its peers as having lived.
    """
    with _HEARTBEAT_LOCK:
        if _HEARTBEAT["thread"] is not None and _HEARTBEAT["thread"].is_alive():
            return
        try:
            _beat()
        except Exception:
            pass
        t = threading.Thread(target=_heartbeat_loop, name="shardckpt-heartbeat", daemon=True)
        t.start()
        _HEARTBEAT["thread"] = t


class Liveness:
    """One waiter's memory of its peers' heartbeats (:func:`stopped` reads and updates it); one per wait."""

    def __init__(self) -> None:
        self.seen: Dict[int, Tuple[bytes, float]] = {}

    def _stale(self, values: Dict[int, bytes]) -> List[int]:
        now = time.monotonic()
        out = []
        for r, v in values.items():
            old = self.seen.get(r)
            if old is None or old[0] != v:
                self.seen[r] = (v, now)
            elif now - old[1] >= _knobs.LIVENESS_TIMEOUT_S:
                out.append(r)
        return out


def _counters_of(store, ranks: Sequence[int]) -> Dict[int, bytes]:
    """Heartbeat counters of those of ``ranks`` that ever beat: 1 + ceil(len / BATCH_KEYS) round trips."""
    if not store.check([_ROSTER_KEY]):
        return {}
    roster = {int(x) for x in store.get(_ROSTER_KEY).decode().split(",") if x}
    have = [r for r in ranks if r in roster]
    return dict(zip(have, _multi_get(store, [_alive_key(r) for r in have])))


def stopped(peers: Sequence[int], watch: Liveness, *, store: Any = None) -> List[int]:
    """Those of ``peers`` (global ranks) whose heartbeat has not moved for ``LIVENESS_TIMEOUT_S``, as ``watch`` saw it.

    Peer liveness, the one implementation every waiter asks (the exchanges
    of :func:`agree`, the wire's waits in ``_p2p.wait_ops``): each process
    that opened a ``Comm`` moves a counter in the default store every
    ``HEARTBEAT_INTERVAL_S`` (a daemon thread, :func:`start_heartbeat`); a
    waiter calls this about once a second with the same ``watch``. A rank
    that never beat is not judged (it may not have started yet: the
    exchange's timeout covers it).

    Args:
        peers: the global ranks waited for.
        watch: this wait's :class:`Liveness` (when each counter last moved).
        store: the key-value store (default: the default group's). One
            peer costs 2 round trips; many, 2 + ceil(len / BATCH_KEYS).

    Raises:
        whatever the store raises (it went away with rank 0): the caller decides.

    Example:
        >>> watch = Liveness()                               # doctest: +SKIP
        >>> while not done(): dead = stopped([0], watch)     # doctest: +SKIP
    """
    store = default_store() if store is None else store
    if len(peers) == 1:
        key = _alive_key(peers[0])
        return watch._stale({peers[0]: store.get(key)}) if store.check([key]) else []
    return watch._stale(_counters_of(store, peers))


class _StoreGone(Exception):
    pass


# The connection each process waits on: a clone of the default store's, so
# that a blocking wait never holds the connection the heartbeat and the
# liveness checks use. A wait that was given up keeps its connection busy
# until its own timeout; the next wait then clones a fresh one.
_WAITER: Dict[str, Any] = {"store": None, "conn": None}
_WAITER_LOCK = threading.Lock()


def _waiter_conn(store):
    """The waiting connection: the one kept from the last wait, else a new clone (may block: helper thread only)."""
    with _WAITER_LOCK:
        if _WAITER["store"] is store and _WAITER["conn"] is not None:
            conn, _WAITER["conn"] = _WAITER["conn"], None
            return conn
    return store.clone()


def _release_conn(store, conn) -> None:
    with _WAITER_LOCK:
        _WAITER["store"], _WAITER["conn"] = store, conn


def _wait(
    store, keys: List[str], timeout_s: float, tick: Callable[[], Optional[Tuple[str, List[int]]]], wake: bool = False
):
    """Wait until every key of ``keys`` is set, calling ``tick`` about once a second meanwhile.

    Returns None once they are set, ``("timeout", [])`` after ``timeout_s``,
    or whatever non-None ``tick`` returned (it gives up the wait). Raises
    ``_StoreGone`` when the store cannot be reached. ``wake``: the keys are
    this rank's own to set, so a wait given up sets them to end the helper's
    wait (a thread left blocked in the store client aborts the interpreter
    at exit).

    The blocking ``store.wait`` runs in a helper thread on its own connection
    with one long timeout: waiting in 1 s slices would make torch log two
    "socket timed out" warnings per slice (seconds of them per rank, for as
    long as a peer is late).
    """
    try:
        if store.check(keys):
            return None
    except Exception as e:
        raise _StoreGone(f"{type(e).__name__}: {e}") from None
    deadline = time.monotonic() + timeout_s
    if not hasattr(store, "clone"):  # pragma: no cover - torch without Store.clone: 1 s slices
        return _wait_sliced(store, keys, deadline, tick)
    done = threading.Event()
    box: Dict[str, Any] = {}

    def run() -> None:
        try:
            # Opening the connection is the helper's too: Store.clone retries
            # connecting for the store's own timeout (30 min) when the host of
            # the store (rank 0) has just exited, and only the caller, which
            # ticks, notices that in seconds (issue 29: a peer hung there).
            conn = box["conn"] = _waiter_conn(store)
            # Outlives the caller's deadline: the caller decides the timeout.
            conn.wait(keys, timedelta(seconds=timeout_s))
            box["ok"] = True
        except Exception as e:  # noqa: BLE001 - told to the caller
            box["error"] = e
        done.set()

    threading.Thread(target=run, name="shardckpt-wait", daemon=True).start()
    def give_up(why):
        if wake:
            try:
                for k in keys:
                    store.set(k, b"given-up")
            except Exception:
                pass
        done.wait(2 * HEARTBEAT_INTERVAL_S)  # the helper's own timeout ends with ours
        return why

    while True:
        left = deadline - time.monotonic()
        if done.wait(max(min(HEARTBEAT_INTERVAL_S, left), 0.0)):
            break
        if left <= 0:
            return give_up(("timeout", []))
        try:
            got = tick()
        except Exception as e:
            raise _StoreGone(f"{type(e).__name__}: {e}") from None
        if got is not None:
            return give_up(got)
    if box.get("ok"):
        _release_conn(store, box["conn"])
        return None
    try:  # the helper's wait failed: a timeout of its own, or the store is gone
        if store.check(keys):
            return None
    except Exception as e:
        raise _StoreGone(f"{type(e).__name__}: {e}") from None
    return "timeout", []


def _wait_sliced(store, keys, deadline, tick):  # pragma: no cover - old torch only
    while True:
        left = deadline - time.monotonic()
        try:
            store.wait(keys, timedelta(seconds=max(min(HEARTBEAT_INTERVAL_S, left), 0.001)))
            return None
        except Exception:
            pass
        try:
            if store.check(keys):
                return None
            if time.monotonic() >= deadline:
                return "timeout", []
            got = tick()
        except Exception as e:
            raise _StoreGone(f"{type(e).__name__}: {e}") from None
        if got is not None:
            return got


# --------------------------------------------------------------------------
# the store and the sequence numbers


_SEQ: Dict[Tuple[Any, ...], int] = {}
_SEQ_LOCK = threading.Lock()
# Per (store, group, channel): the previous exchange's keys, deleted by rank 0
# once every rank has posted the next one (so every rank has read them).
_STALE: Dict[Tuple[Any, ...], List[str]] = {}


def default_store():
    """The default process group's key-value store (what the exchanges and heartbeats use)."""
    from torch.distributed import distributed_c10d as c10d

    return c10d._get_default_store()


def _seq_key(comm: Comm, store) -> Tuple[Any, ...]:
    group = hashlib.sha1(",".join(map(str, comm.ranks)).encode()).hexdigest()[:12]
    return (id(store), group, comm.channel)


def _base_key(comm: Comm, store) -> str:
    # Per store (a re-initialised world starts over), group and channel.
    k = _seq_key(comm, store)
    with _SEQ_LOCK:
        n = _SEQ[k] = _SEQ.get(k, 0) + 1
    return f"shardckpt/{comm.channel}/{k[1]}/{n}"


def _missing(store, comm: Comm, base: str) -> List[int]:
    """Ranks (global) whose outcome of exchange ``base`` is not posted; the root if the store is gone."""
    try:
        return [comm.ranks[i] for i in _absent(store, [f"{base}/r{i}" for i in range(comm.world)])]
    except Exception:  # the store's server (rank 0) is gone
        return [comm.ranks[0]]


def _missing_message(comm: Comm, what: str, missing: Sequence[int]) -> str:
    who = f"rank {missing[0]}" if len(missing) == 1 else f"ranks {format_offenders(missing)}"
    return (
        f"{what}: {who} of {comm.world} did not reach {comm.op} within collective_timeout_s={comm.timeout_s:g}; "
        + EVERY_RANK_RULE.format(op=comm.op)
    )


def _dead_message(comm: Comm, what: str, dead: Sequence[int]) -> str:
    who = f"rank {dead[0]}" if len(dead) == 1 else f"ranks {format_offenders(dead)}"
    return (
        f"{what}: {who} of {comm.world} stopped during {comm.op} (no heartbeat for "
        f"{_knobs.LIVENESS_TIMEOUT_S:g} s, or the store it hosts is unreachable): the process died, was killed "
        "or is frozen. The other ranks gave up without waiting for collective_timeout_s; restart the job "
        "(committed checkpoints are intact; the opening of this message says whether this one was committed)"
    )


class _Ticker:
    """What a waiting rank does once a second: liveness of whom it waits for, and a rare log line."""

    def __init__(self, store, comm: Comm, base: str, root_waits: bool):
        self.store, self.comm, self.base, self.root_waits = store, comm, base, root_waits
        self.watch = Liveness()
        self.start = time.monotonic()
        self.next_log = self.start + WAIT_LOG_AFTER_S

    def __call__(self) -> Optional[Tuple[str, List[int]]]:
        store, comm = self.store, self.comm
        if self.root_waits:
            # Rank 0: the counters of every peer in batches, then, for the few
            # stopped ones, whether they posted (a rank that posted and died
            # is the next exchange's business).
            stale = stopped(comm.ranks[1:], self.watch, store=store)
            index = {r: i for i, r in enumerate(comm.ranks)} if stale else {}
            dead = [r for r in stale if not store.check([f"{self.base}/r{index[r]}"])]
            if dead:
                return "dead", dead
        else:
            root = comm.ranks[0]
            if stopped([root], self.watch, store=store):
                return "dead", [root]
        if time.monotonic() >= self.next_log:
            self.next_log = time.monotonic() + WAIT_LOG_EVERY_S
            self._log()
        return None

    def _log(self) -> None:
        comm, store = self.comm, self.store
        waited = time.monotonic() - self.start
        arrived = int(store.add(f"{self.base}/n", 0))
        if self.root_waits or comm.world <= PEER_NAMES_PENDING_UP_TO:
            pending = _missing(store, comm, self.base)
            who = f"ranks {format_offenders(pending)}" if len(pending) != 1 else f"rank {pending[0]}"
        else:
            who = f"{comm.world - arrived} ranks"
        log.warning(
            "shardckpt: %s has waited %.0f s for %s of %d (%d arrived; collective_timeout_s=%g); %s",
            comm.op, waited, who, comm.world, max(arrived, 0), comm.timeout_s, EVERY_RANK_RULE.format(op=comm.op),
        )


def _pieces(digest: str) -> int:
    """How many store values a distinct value of this digest (``<hash>.<count>``) was posted in."""
    return int(digest.rsplit(".", 1)[1])


def _hash(blob: bytes) -> str:
    return hashlib.blake2b(blob, digest_size=12).hexdigest()


def _exchange(comm: Comm, outcome: Any, blob: Optional[bytes]) -> Tuple[str, Any, Optional[List[Any]], Dict[str, Any]]:
    """Post this rank's outcome; return ``(exchange key, verdict, outcomes on rank 0, distinct blobs on rank 0)``.

    ``outcome`` is ``(failure or None, value hash or None, value or None)``;
    ``blob`` (``DISTINCT`` mode) is posted once per distinct hash, by the
    first rank to claim it. A verdict is ``("ok", ...)``, ``("missing",
    ranks)`` (not arrived within the timeout) or ``("dead", ranks)``
    (heartbeat stopped); the per-rank outcomes are returned on rank 0 only.
    """
    store = default_store()
    base = _base_key(comm, store)
    mine = f"{base}/r{comm.rank}"
    root = comm.ranks[0]
    try:
        if blob is not None and outcome[1] is not None and store.add(f"{base}/h/{outcome[1]}", 1) == 1:
            # A large distinct value (a stage of 100,000 tensors) goes in
            # pieces of at most MAX_VALUE_BYTES; its hash names their count.
            parts = _pieces(outcome[1])
            for k in range(parts):
                _set(store, f"{base}/p/{outcome[1]}/{k}", blob[k * MAX_VALUE_BYTES : (k + 1) * MAX_VALUE_BYTES], "a piece")
        _set(store, mine, pickle.dumps(outcome), "this rank's outcome")
        if store.add(f"{base}/n", 1) == comm.world:
            store.set(f"{base}/all", b"1")
    except _TooBig:
        raise
    except Exception:
        if comm.rank == 0:
            raise
        # Rank 0 hosts the store: it may die before this rank posts at all
        # (not only while this rank waits). Same verdict as a failed wait.
        return base, ("dead", [root]), None, {}
    if comm.rank == 0:
        try:
            late = _wait(store, [f"{base}/all"], comm.timeout_s, _Ticker(store, comm, base, True), wake=True)
        except _StoreGone:
            late = ("timeout", [])
        if late is not None:
            if late[0] == "dead":
                return base, ("dead", late[1]), None, {}
            return base, ("missing", _missing(store, comm, base) or ["unknown"]), None, {}  # type: ignore[list-item]  # "unknown": no rank could be named
        outcomes = [pickle.loads(v) for v in _multi_get(store, [f"{base}/r{i}" for i in range(comm.world)])]
        hashes = sorted({o[1] for o in outcomes if o[1] is not None}) if blob is not None else []
        keys = [(h, f"{base}/p/{h}/{k}") for h in hashes for k in range(_pieces(h))]
        blobs: Dict[str, bytes] = {}
        for (h, _), v in zip(keys, _multi_get(store, [k for _, k in keys])):
            blobs[h] = blobs.get(h, b"") + v
        # Every rank posted this exchange, so every rank read the previous verdict.
        seq = _seq_key(comm, store)
        for key in _STALE.pop(seq, []) + [f"{base}/n", f"{base}/all"]:
            _delete(store, key)
        for h in hashes:
            _delete(store, f"{base}/h/{h}")
            for k in range(_pieces(h)):
                _delete(store, f"{base}/p/{h}/{k}")
        _delete(store, mine)
        return base, ("ok", None), outcomes, blobs
    try:
        # Rank 0 names dead peers; this rank watches rank 0 only (whose death
        # usually takes the store down with it, which ends the wait at once).
        late = _wait(store, [f"{base}/v"], comm.timeout_s + _PEER_GRACE_S, _Ticker(store, comm, base, False))
    except _StoreGone:
        return base, ("dead", [root]), None, {}
    if late is not None:
        if late[0] == "dead":
            verdict: Any = ("dead", [root])
        else:
            verdict = ("missing", _missing(store, comm, base) or [root])
        # Withdraw: if rank 0 comes late, it must not take this stale outcome
        # for its own exchange.
        try:
            store.delete_key(mine)
            store.add(f"{base}/n", -1)
        except Exception:
            pass
        return base, verdict, None, {}
    try:
        verdict = pickle.loads(store.get(f"{base}/v"))
        if verdict[0] == "ok" and verdict[2] and outcome[1] is not None:
            verdict = ("ok", verdict[1], pickle.loads(store.get(f"{base}/g/{outcome[1]}")))
        _delete(store, mine)
    except Exception:  # the verdict was posted, then its host died before this rank read it
        return base, ("dead", [root]), None, {}
    if verdict[0] in _ENDING:
        _mark_read(store, comm, base)
    return base, verdict, None, {}


def _post_verdict(comm: Comm, base: str, verdict: Any, pieces: Optional[Dict[str, Any]] = None) -> None:
    """Rank 0: publish the verdict of exchange ``base`` (and each distinct group's piece) for the peers."""
    store = default_store()
    keys = [f"{base}/v"]
    if pieces:
        names = [f"{base}/g/{h}" for h in pieces]
        values = [pickle.dumps(p) for p in pieces.values()]
        for v in values:
            if len(v) > MAX_VALUE_BYTES:
                raise _TooBig(f"one group's verdict is {len(v) / 2**20:.1f} MiB")
        if hasattr(store, "multi_set"):
            store.multi_set(names, values)
        else:  # pragma: no cover
            for n, v in zip(names, values):
                store.set(n, v)
        keys += names
    body = pickle.dumps(verdict)
    if len(body) > MAX_VALUE_BYTES:
        raise _TooBig(f"the verdict is {len(body) / 2**20:.1f} MiB")
    store.set(f"{base}/v", body)
    _STALE[_seq_key(comm, store)] = keys


# Verdicts that end the call with an error on every rank: rank 0 waits until
# its peers have read them (:func:`_await_reads`).
_ENDING = ("failed", "refused")


def _mark_read(store, comm: Comm, base: str) -> None:
    """A peer has read an ending verdict: count it; the last peer tells rank 0 (best effort)."""
    try:
        if store.add(f"{base}/read", 1) == comm.world - 1:
            store.set(f"{base}/read_all", b"1")
    except Exception:  # rank 0 stops waiting after its bound
        pass


def _await_reads(comm: Comm, base: str) -> None:
    """Rank 0, after posting an ending verdict: return once every peer read it, or after ``LIVENESS_TIMEOUT_S``.

    The store lives in rank 0's process, and a program usually exits on the
    error: without this final agreement a peer that was slow to read the
    verdict found the store gone and raised "rank 0 stopped" instead of the
    refusal (issue 29). Every peer posted this exchange, so each is alive and
    about to read; one that has not within the liveness bound is treated as
    dead (it raises naming rank 0, as if rank 0 had died). Successful
    exchanges need no such wait: the next exchange is their agreement.
    """
    store = default_store()
    keys = [f"{base}/read_all"]
    _STALE.setdefault(_seq_key(comm, store), []).extend([f"{base}/read"] + keys)
    try:
        _wait(store, keys, _knobs.LIVENESS_TIMEOUT_S, lambda: None, wake=True)
    except _StoreGone:  # pragma: no cover - rank 0 hosts the store
        pass


# --------------------------------------------------------------------------
# agree


def _failure(rank: int, e: BaseException) -> Tuple[Any, str]:
    """What a rank tells its peers about its error: our class itself, or only its text (bounded)."""
    text = str(e) if isinstance(e, CheckpointError) else f"{type(e).__name__}: {e}"
    if len(text) > 16384:
        text = text[:16384] + " ... (truncated)"
    return (type(e) if isinstance(e, CheckpointError) else None), text


def _raise_for(
    comm: Comm, what: str, error: Type[CheckpointError], failures: List[Tuple[int, Any, str]], local: Optional[BaseException]
) -> None:
    """Raise one error, the same type and text on every rank, for ``failures`` [(rank, class, text)]."""
    cls = failures[0][1] or error
    if comm.world == 1:  # a foreign error of this process (ours are raised as they are)
        msg = f"{what}: {failures[0][2]}"
    else:
        msg = f"{what}: " + format_offenders([f"rank {r}: {m}" for r, _, m in failures], sep="; ")
    try:
        exc = cls(msg)
    except Exception:  # a subclass with another signature: keep the text
        exc = error(msg)
    if local is not None:
        raise exc from local
    raise exc


@dataclass(frozen=True)
class Group:
    """In ``DISTINCT`` mode, on rank 0: one distinct shared value and the ranks (group positions) that sent it."""

    ranks: Tuple[int, ...]
    value: Any


def agree(
    comm: Comm,
    fn: Callable[[], T],
    *,
    what: str,
    share: Optional[Callable[[T], Any]] = None,
    mode: str = ALL,
    error: Optional[Type[CheckpointError]] = None,
    decide: Optional[Callable[[List[Group]], Tuple[Any, List[Any]]]] = None,
) -> Tuple[T, Any]:
    """Run ``fn`` on every rank; return together, or raise the same error everywhere.

    Args:
        comm: the call's ranks and timeout (:func:`open_comm`).
        fn: this rank's local step. Its ``CheckpointError`` crosses to every
            rank as the same class; any other exception becomes ``error``.
        what: the message's opening, e.g. ``"nothing was committed at s3://b/x"``.
        share: maps ``fn``'s result to what is exchanged (picklable).
        mode: who receives the shared values: ``"all"`` (a list by rank, on
            every rank: small values and small groups only, the list travels
            to every rank), ``"to_root"`` (the list on rank 0, None
            elsewhere), ``"from_root"`` (rank 0's value, on every rank),
            ``"none"``, or ``"distinct"``: each distinct value travels once
            to rank 0, where ``decide`` maps the list of :class:`Group` to
            ``(common, [piece per group])``; every rank receives
            ``(common, its group's piece)``.
        error: class for missing ranks and foreign exceptions (default
            ``comm.error``).
        decide: ``"distinct"`` mode's step on rank 0 (pure; a
            ``CheckpointError`` it raises is raised on every rank, as is).

    Returns:
        ``(fn's result on this rank, the shared values as ``mode`` says)``.

    Raises:
        The first failing rank's ``CheckpointError`` subclass, on every rank,
        with one message listing every failing rank (capped); ``error`` naming
        the ranks that did not arrive within ``comm.timeout_s``, or a value
        over ``MAX_VALUE_BYTES``. A ``KeyboardInterrupt``/``SystemExit`` is
        re-raised as is on its rank after the peers were told.

    Example:
        >>> comm = open_comm(None, op="save")
        >>> agree(comm, lambda: 3, what="demo", share=lambda v: v * 2)
        (3, [6])

    Limits: after a timeout the group's exchanges of this channel may be out
    of step (a rank that never came); restart the job, as after any
    collective timeout.
    """
    error = error or comm.error
    if share is None:
        mode = NONE
    local: Optional[BaseException] = None
    result: Any = None
    try:
        result = fn()
    except BaseException as e:  # noqa: BLE001 - told to the peers first, raised below
        local = e
    if comm.world == 1:
        if local is not None:
            if isinstance(local, CheckpointError) or not isinstance(local, Exception):
                raise local
            _raise_for(comm, what, error, [(0, None, _failure(0, local)[1])], local)
        piece = share(result) if share is not None and mode != NONE else None
        if mode == DISTINCT:
            common, pieces = decide([Group((0,), piece)])  # type: ignore[misc]
            return result, (common, pieces[0])
        return result, ([piece] if mode in (ALL, TO_ROOT) else piece)

    piece, blob, digest = None, None, None
    if local is None and mode != NONE and (mode != FROM_ROOT or comm.rank == 0):
        try:
            piece = share(result)  # type: ignore[misc]
            if mode == DISTINCT:
                blob = pickle.dumps(piece)
                digest = f"{_hash(blob)}.{-(-len(blob) // MAX_VALUE_BYTES) or 1}"
        except Exception as e:  # noqa: BLE001
            local, blob, digest = e, None, None
    if isinstance(local, _TooBig):
        local = error(f"{local}; this is a limit of shardckpt's exchange, please report it")
    outcome = (None if local is None else _failure(comm.rank, local), digest, None if mode == DISTINCT else piece)
    if mode == DISTINCT and blob is None:
        blob = b""  # a failing rank claims no hash (its digest is None)
    try:
        base, verdict, outcomes, blobs = _exchange(comm, outcome, blob if mode == DISTINCT else None)
    except _TooBig as e:
        # Only a TO_ROOT/ALL value (a rank's own summary) can be too big here.
        raise error(f"{what}: {e}") from None
    if comm.rank == 0 and verdict[0] == "ok":
        assert outcomes is not None
        failures = [(comm.ranks[i], o[0][0], o[0][1]) for i, o in enumerate(outcomes) if o[0] is not None]
        pieces_by_hash: Optional[Dict[str, Any]] = None
        if failures:
            verdict = ("failed", failures)
        elif mode == ALL:
            verdict = ("ok", [o[2] for o in outcomes], False)
        elif mode == FROM_ROOT:
            verdict = ("ok", outcomes[0][2], False)
        elif mode == DISTINCT:
            members: Dict[str, List[int]] = {}
            for i, o in enumerate(outcomes):
                members.setdefault(o[1], []).append(i)
            order = sorted(members, key=lambda h: members[h][0])
            groups = [Group(tuple(members[h]), pickle.loads(blobs[h])) for h in order]
            try:
                common, pieces = decide(groups)  # type: ignore[misc]
                verdict = ("ok", common, True)
                pieces_by_hash = dict(zip(order, pieces))
            except CheckpointError as e:
                verdict = ("refused", type(e), str(e))
            except Exception as e:  # noqa: BLE001
                verdict = ("refused", None, f"{what}: internal error on rank 0: {type(e).__name__}: {e}")
        else:
            verdict = ("ok", None, False)
        try:
            _post_verdict(comm, base, verdict, pieces_by_hash)
        except _TooBig as e:
            verdict = ("refused", None, f"{what}: {e}; this is a limit of shardckpt's exchange, please report it")
            _post_verdict(comm, base, verdict)
        if verdict[0] == "ok" and mode == DISTINCT:
            verdict = ("ok", verdict[1], pieces_by_hash[outcomes[0][1]])  # type: ignore[index]
    elif comm.rank == 0:
        _post_verdict(comm, base, verdict)
    if comm.rank == 0 and verdict[0] in _ENDING:
        _await_reads(comm, base)
    kind, value = verdict[0], verdict[1]
    if kind in ("missing", "dead"):
        if local is not None and not isinstance(local, Exception):
            raise local
        text = _missing_message(comm, what, value) if kind == "missing" else _dead_message(comm, what, value)
        raise error(text) from local
    if kind == "failed":
        if local is not None and not isinstance(local, Exception):
            raise local
        _raise_for(comm, what, error, value, local)
    if kind == "refused":
        cls = value or error
        try:
            exc = cls(verdict[2])
        except Exception:
            exc = error(verdict[2])
        raise exc
    if mode == DISTINCT:
        return result, (value, verdict[2])
    if mode == TO_ROOT:
        return result, ([o[2] for o in outcomes] if comm.rank == 0 and outcomes is not None else None)
    return result, value


def broadcast(comm: Comm, obj: Any, *, what: str = "broadcast") -> Any:
    """Rank 0's ``obj`` on every rank (bounded by ``comm.timeout_s``)."""
    return agree(comm, lambda: obj, what=what, share=lambda v: v, mode=FROM_ROOT)[1]


def all_gather(comm: Comm, obj: Any, *, what: str = "all_gather") -> List[Any]:
    """Every rank's ``obj``, by rank, on every rank (small values and groups only: the list travels to every rank)."""
    return agree(comm, lambda: obj, what=what, share=lambda v: v, mode=ALL)[1]
