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
``shardckpt/<channel>/<group hash>/<n>/...``. Rank 0 reads every rank's
outcome and posts one verdict; keys are deleted once every rank is past them,
so the store does not grow. After a timeout the late rank, if it ever comes,
reads the same verdict (the missing-rank error) and raises too.

Dead ranks are noticed in seconds, not after ``collective_timeout_s``: every
rank that takes part in a multi-rank call starts one daemon thread that bumps
a counter under ``shardckpt/alive/<rank>`` every second, for the life of the
process. A waiting rank polls the store each second and reads the counters
of the ranks it still waits for; a counter that has not moved for
``SHARDCKPT_LIVENESS_TIMEOUT_S`` (10 s) means the process is gone (SIGKILL,
OOM kill, a crashed host) and the exchange fails at once naming it. A rank
that is alive but late (still training, a slow write) keeps beating and is
waited for up to ``collective_timeout_s``, as before. A rank that never took
part in a multi-rank call has no counter and is waited for up to the timeout.
The counters are compared with the waiter's own clock, so hosts' clocks need
not agree. The store's server lives in rank 0's process: when it dies, the
store itself fails and the peers raise naming rank 0.

Cost: 2 store round trips per rank per exchange, plus rank 0 reading one key
per rank: three exchanges per save, one per load; one store write per rank
per second for the heartbeat, and one poll per second while waiting.
"""

from __future__ import annotations

import hashlib
import os
import pickle
import threading
import time
from dataclasses import dataclass, replace
from datetime import timedelta
from typing import Any, Callable, Dict, List, Optional, Sequence, Tuple, Type, TypeVar

from . import _knobs
from .errors import CheckpointError, SaveFailedError, UsageError, format_offenders

__all__ = [
    "Comm",
    "open_comm",
    "agree",
    "broadcast",
    "all_gather",
    "dist_info",
    "DEFAULT_COLLECTIVE_TIMEOUT_S",
    "EVERY_RANK_RULE",
    "start_heartbeat",
]

T = TypeVar("T")

#: Default ``collective_timeout_s`` of save, load, async_save and the manager
#: (``SHARDCKPT_COLLECTIVE_TIMEOUT_S``). An exchange waits for the slowest
#: rank, so it must exceed the longest write (or read) of one rank's shard.
DEFAULT_COLLECTIVE_TIMEOUT_S = _knobs.COLLECTIVE_TIMEOUT_S

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
NONE, ALL, TO_ROOT, FROM_ROOT = "none", "all", "to_root", "from_root"


def dist_info(group: Optional["ProcessGroup"] = None) -> Tuple[int, int]:  # noqa: F821
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
    timeout_s: float = DEFAULT_COLLECTIVE_TIMEOUT_S
    op: str = "save"
    error: Type[CheckpointError] = SaveFailedError
    channel: str = "main"
    no_dist: bool = False

    def on_channel(self, channel: str) -> "Comm":
        """The same ranks on another sequence of exchanges (the async save's background thread)."""
        return replace(self, channel=channel)


def _torchrun_world() -> int:
    try:
        return int(os.environ.get("WORLD_SIZE", "1"))
    except ValueError:
        return 1


def open_comm(
    process_group: Optional["ProcessGroup"] = None,  # noqa: F821
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
            ``DEFAULT_COLLECTIVE_TIMEOUT_S``).
        op: the call's name for messages, e.g. ``"shardckpt.save"``.
        error: raised for a missing rank or a failure that is not a
            ``CheckpointError``.

    Raises:
        UsageError: ``WORLD_SIZE`` > 1 in the environment (torchrun) but no
            process group is initialised; or a non-positive timeout.
    """
    timeout = DEFAULT_COLLECTIVE_TIMEOUT_S if collective_timeout_s is None else collective_timeout_s
    if isinstance(timeout, bool) or not isinstance(timeout, (int, float)) or not timeout > 0:
        raise UsageError(f"{op}: collective_timeout_s must be a positive number of seconds, got {collective_timeout_s!r}")
    base = Comm(timeout_s=float(timeout), op=op, error=error, no_dist=bool(no_dist))
    if no_dist:
        return base
    import torch.distributed as dist

    if not (dist.is_available() and dist.is_initialized()):
        if _torchrun_world() > 1:
            raise UsageError(
                f"{op}: WORLD_SIZE={os.environ.get('WORLD_SIZE')} (a torchrun job) but no process group is "
                "initialised, so the ranks would race on one checkpoint. Call "
                "torch.distributed.init_process_group() first, or pass no_dist=True for a deliberate "
                "single-process call"
            )
        return base
    world = dist.get_world_size(process_group)
    if world <= 1:
        return base
    ranks = tuple(dist.get_process_group_ranks(process_group if process_group is not None else dist.group.WORLD))
    start_heartbeat()
    return replace(base, rank=dist.get_rank(process_group), world=world, ranks=ranks)


# --------------------------------------------------------------------------
# liveness


_HEARTBEAT_LOCK = threading.Lock()
_HEARTBEAT: Dict[str, Any] = {"thread": None, "n": 0}


def _alive_key(global_rank: int) -> str:
    return f"shardckpt/alive/{global_rank}"


def _beat() -> None:
    """Move this process's counter once (on the current default store, if any)."""
    import torch.distributed as dist

    if not (dist.is_available() and dist.is_initialized()):
        return
    _HEARTBEAT["n"] += 1
    _store().set(_alive_key(dist.get_rank()), str(_HEARTBEAT["n"]))


def _heartbeat_loop() -> None:
    while True:
        time.sleep(HEARTBEAT_INTERVAL_S)
        try:
            _beat()
        except Exception:  # no group right now, or the store is gone: peers judge by the counter
            pass


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


class _Watch:
    """A waiter's view of its peers' heartbeats: which ones have stopped moving."""

    def __init__(self, store, ranks: Sequence[int]):
        self.store = store
        self.ranks = list(ranks)
        self.seen: Dict[int, Tuple[bytes, float]] = {}

    def dead(self, pending: Sequence[int]) -> List[int]:
        now = time.monotonic()
        out = []
        for r in pending:
            if r not in self.ranks:
                continue
            key = _alive_key(r)
            if not self.store.check([key]):
                continue  # never beat: not started yet, cannot tell; the timeout decides
            v = self.store.get(key)
            old = self.seen.get(r)
            if old is None or old[0] != v:
                self.seen[r] = (v, now)
            elif now - old[1] >= _knobs.LIVENESS_TIMEOUT_S:
                out.append(r)
        return out


class _StoreGone(Exception):
    pass


def _wait_keys(store, keys: Dict[int, str], timeout_s: float, watch: _Watch) -> Optional[Tuple[str, List[int]]]:
    """Wait until every key of ``keys`` (rank -> key) is set.

    Returns None once they are; ``("timeout", ranks still missing)`` after
    ``timeout_s``; ``("dead", ranks)`` as soon as a rank still missing has a
    stopped heartbeat. Raises ``_StoreGone`` when the store cannot be reached.
    """
    deadline = time.monotonic() + timeout_s
    while True:
        left = deadline - time.monotonic()
        try:
            store.wait(list(keys.values()), timedelta(seconds=max(min(HEARTBEAT_INTERVAL_S, left), 0.001)))
            return None
        except Exception:
            pass
        try:
            pending = [r for r, k in keys.items() if not store.check([k])]
            if not pending:
                continue  # arrived between the wait and the check
            if time.monotonic() >= deadline:
                return "timeout", pending
            dead = watch.dead(pending)
        except Exception as e:
            raise _StoreGone(f"{type(e).__name__}: {e}") from None
        if dead:
            return "dead", dead


# --------------------------------------------------------------------------
# the store and the sequence numbers


_SEQ: Dict[Tuple[Any, ...], int] = {}
_SEQ_LOCK = threading.Lock()


def _store():
    from torch.distributed import distributed_c10d as c10d

    return c10d._get_default_store()


def _base_key(comm: Comm, store) -> str:
    # Per store (a re-initialised world starts over), group and channel.
    group = hashlib.sha1(",".join(map(str, comm.ranks)).encode()).hexdigest()[:12]
    k = (id(store), group, comm.channel)
    with _SEQ_LOCK:
        n = _SEQ[k] = _SEQ.get(k, 0) + 1
    return f"shardckpt/{comm.channel}/{group}/{n}"


def _prev_key(key: str) -> str:
    head, n = key.rsplit("/", 1)
    return f"{head}/{int(n) - 1}"


def _missing(store, comm: Comm, base: str) -> List[int]:
    out = []
    for i, r in enumerate(comm.ranks):
        try:
            if not store.check([f"{base}/r{i}"]):
                out.append(r)
        except Exception:  # the store's server (rank 0) is gone
            out.append(r)
    return out


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
        "(a checkpoint being written was not committed, the previous ones are intact)"
    )


def _exchange(comm: Comm, outcome: Any) -> Tuple[str, Any, Optional[List[Any]]]:
    """Post this rank's outcome; return ``(exchange key, verdict, outcomes seen by rank 0)``.

    A verdict is ``("ok", shared)``, ``("missing", ranks)`` (not arrived
    within the timeout) or ``("dead", ranks)`` (heartbeat stopped); the
    per-rank outcomes are returned on rank 0 only.
    """
    store = _store()
    base = _base_key(comm, store)
    mine = f"{base}/r{comm.rank}"
    verdict_key = f"{base}/v"
    root = comm.ranks[0]
    try:
        store.set(mine, pickle.dumps(outcome))
    except Exception:
        if comm.rank == 0:
            raise
        # Rank 0 hosts the store: it may die before this rank posts at all
        # (not only while this rank waits). Same verdict as a failed wait.
        return base, ("dead", [root]), None
    if comm.rank == 0:
        keys = {r: f"{base}/r{i}" for i, r in enumerate(comm.ranks)}
        outcomes: Optional[List[Any]] = None
        try:
            late = _wait_keys(store, keys, comm.timeout_s, _Watch(store, comm.ranks[1:]))
        except _StoreGone:
            late = ("missing", _missing(store, comm, base) or ["unknown"])
        if late is None:
            outcomes = [pickle.loads(store.get(k)) for k in keys.values()]
            verdict: Any = ("ok", None)
        else:
            verdict = ("dead", late[1]) if late[0] == "dead" else ("missing", late[1])
        # Everyone posted this exchange, so everyone read the previous verdict.
        if outcomes is not None:
            _delete(store, _prev_key(base) + "/v")
        return base, verdict, outcomes
    try:
        # Rank 0 names dead peers; this rank watches rank 0 only (whose death
        # usually takes the store down with it, which ends the wait at once).
        late = _wait_keys(store, {root: verdict_key}, comm.timeout_s + _PEER_GRACE_S, _Watch(store, [root]))
    except _StoreGone:
        return base, ("dead", [root]), None
    if late is not None:
        if late[0] == "dead":
            verdict = ("dead", [root])
        else:
            verdict = ("missing", _missing(store, comm, base) or [root])
        # Withdraw: if rank 0 comes late, it must not take this stale outcome
        # for its own exchange.
        _delete(store, mine)
        return base, verdict, None
    try:
        return base, pickle.loads(store.get(verdict_key)), None
    except Exception:  # the verdict was posted, then its host died before this rank read it
        return base, ("dead", [root]), None


def _post_verdict(comm: Comm, base: str, verdict: Any) -> None:
    """Rank 0: publish the verdict of exchange ``base`` and drop the outcomes it read."""
    store = _store()
    store.set(f"{base}/v", pickle.dumps(verdict))
    for i in range(comm.world):
        _delete(store, f"{base}/r{i}")


def _delete(store, key: str) -> None:
    try:
        store.delete_key(key)
    except Exception:  # cleanup only
        pass


# --------------------------------------------------------------------------
# agree


def _failure(rank: int, e: BaseException) -> Tuple[Any, str]:
    """What a rank tells its peers about its error: our class itself, or only its text."""
    if isinstance(e, CheckpointError):
        return type(e), str(e)
    return None, f"{type(e).__name__}: {e}"


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


def agree(
    comm: Comm,
    fn: Callable[[], T],
    *,
    what: str,
    share: Optional[Callable[[T], Any]] = None,
    mode: str = ALL,
    error: Optional[Type[CheckpointError]] = None,
) -> Tuple[T, Any]:
    """Run ``fn`` on every rank; return together, or raise the same error everywhere.

    Args:
        comm: the call's ranks and timeout (:func:`open_comm`).
        fn: this rank's local step. Its ``CheckpointError`` crosses to every
            rank as the same class; any other exception becomes ``error``.
        what: the message's opening, e.g. ``"nothing was committed at s3://b/x"``.
        share: maps ``fn``'s result to what the peers receive (picklable).
        mode: who receives the shared values: ``"all"`` (a list by rank, on
            every rank), ``"to_root"`` (the list on rank 0, None elsewhere),
            ``"from_root"`` (rank 0's value, on every rank), ``"none"``.
        error: class for missing ranks and foreign exceptions (default
            ``comm.error``).

    Returns:
        ``(fn's result on this rank, the shared values as ``mode`` says)``.

    Raises:
        The first failing rank's ``CheckpointError`` subclass, on every rank,
        with one message listing every failing rank (capped); ``error`` naming
        the ranks that did not arrive within ``comm.timeout_s``. A
        ``KeyboardInterrupt``/``SystemExit`` is re-raised as is on its rank
        after the peers were told.

    Example:
        >>> comm = open_comm(None, op="save")
        >>> agree(comm, lambda: 3, what="demo", share=lambda v: v * 2)
        (3, [6])

    Limits: after a timeout the group's exchanges of this channel may be out
    of step (a rank that never came); restart the job, as after any
    collective timeout.
    """
    error = error or comm.error
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
        return result, ([piece] if mode in (ALL, TO_ROOT) else piece)

    piece = None
    if local is None and share is not None and mode != NONE:
        try:
            piece = share(result)
        except Exception as e:  # noqa: BLE001
            local = e
    outcome = (None if local is None else _failure(comm.rank, local), piece)
    base, verdict, outcomes = _exchange(comm, outcome)
    if comm.rank == 0 and verdict[0] == "ok":
        assert outcomes is not None
        failures = [(comm.ranks[i], o[0][0], o[0][1]) for i, o in enumerate(outcomes) if o[0] is not None]
        if failures:
            verdict = ("failed", failures)
        elif mode == ALL:
            verdict = ("ok", [o[1] for o in outcomes])
        elif mode == FROM_ROOT:
            verdict = ("ok", outcomes[0][1])
        else:
            verdict = ("ok", None)
        _post_verdict(comm, base, verdict)
    elif comm.rank == 0:
        _post_verdict(comm, base, verdict)
    kind, value = verdict
    if kind in ("missing", "dead"):
        if local is not None and not isinstance(local, Exception):
            raise local
        text = _missing_message(comm, what, value) if kind == "missing" else _dead_message(comm, what, value)
        raise error(text) from local
    if kind == "failed":
        if local is not None and not isinstance(local, Exception):
            raise local
        _raise_for(comm, what, error, value, local)
    shared = value
    if mode == TO_ROOT:
        shared = [o[1] for o in outcomes] if comm.rank == 0 and outcomes is not None else None
    return result, shared


def broadcast(comm: Comm, obj: Any, *, what: str = "broadcast") -> Any:
    """Rank 0's ``obj`` on every rank (bounded by ``comm.timeout_s``)."""
    return agree(comm, lambda: obj, what=what, share=lambda v: v, mode=FROM_ROOT)[1]


def all_gather(comm: Comm, obj: Any, *, what: str = "all_gather") -> List[Any]:
    """Every rank's ``obj``, by rank, on every rank (bounded by ``comm.timeout_s``)."""
    return agree(comm, lambda: obj, what=what, share=lambda v: v, mode=ALL)[1]
