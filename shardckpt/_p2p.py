"""The wire between ranks: point-to-point sends and receives of tensors, with their deadlines.

The one way bytes move from rank to rank, used by read-once loads
(``_replicas``: a range read by one holder and sent to the others), the
memory tier's copies (``_memory.transfer``: whole files to a peer node, byte
ranges of a restore) and the memory tier's snapshot (``warm_nccl``):

- :func:`transfer_device`: where a group's sends can go (CUDA tensors under
  NCCL, CPU tensors under gloo), decided by the backend alone so every rank
  decides the same;
- :func:`warm_nccl`: one collective on a group before its first batched
  point-to-point call (NCCL needs it; collective);
- :func:`p2p_op` / :func:`start_ops`: operations posted together
  (``batch_isend_irecv``);
- :func:`wait_ops`: their wait, bounded by ``collective_timeout_s`` and, for
  NCCL works (polled), by the peers' liveness
  (:func:`shardckpt._collective.stopped`): a killed peer is named in seconds,
  a hung one within the timeout, never a hang.

Every call needs an initialized process group; torch is imported inside the
calls (``import shardckpt`` stays cheap).

Example (two ranks, rank 0 sends 4 floats to rank 1; every rank runs it)::

    ops = [p2p_op("send", t, 1, group, 0)] if rank == 0 else [p2p_op("recv", t, 0, group, 0)]
    wait_ops(start_ops(ops), comm, [1 - rank], cuda=transfer_device(group) == "cuda")

Limits: one tag per message pair (``tag``); NCCL ignores tags, so the
callers post their operations in the same order on both ends.
"""

from __future__ import annotations

import time
from typing import Any, Dict, List, Optional, Sequence

from . import _knobs
from ._collective import Liveness, stopped
from .errors import LoadFailedError

__all__ = ["transfer_device", "warm_nccl", "p2p_op", "start_ops", "wait_ops", "GLOO_TIMER_SLACK_S"]

#: A gloo wait given the time left may end this early by its own timer
#: (milliseconds); a failure past ``deadline - this`` counts as the timeout.
GLOO_TIMER_SLACK_S = 0.05
#: How often a wait for NCCL works asks whether its peers are alive.
_LOOK_EVERY_S = 1.0

#: Groups whose NCCL communicator has run a collective in this process (see :func:`warm_nccl`).
_WARM: Dict[int, bool] = {}


def transfer_device(group: Any) -> Optional[str]:
    """``"cuda"`` or ``"cpu"``: where a group's point-to-point sends can go; None if neither.

    NCCL (alone or in a ``cpu:gloo,cuda:nccl`` group) sends CUDA tensors:
    preferred, GPU links are faster. Decided by the backend alone, so every
    rank decides the same.
    """
    import torch
    import torch.distributed as dist

    backend = str(dist.get_backend(group)).lower()
    if "nccl" in backend and torch.cuda.is_available():
        return "cuda"
    if "gloo" in backend or "mpi" in backend:
        return "cpu"
    return None


def warm_nccl(group: Any) -> None:
    """Run one collective on ``group`` the first time (collective: every rank of it calls).

    NCCL's batched point-to-point calls may involve a subset of the group's
    ranks only once the group has run a collective; the first one must
    involve every rank (``torch.distributed.batch_isend_irecv``). A restarted
    job's first NCCL call may be a restore's transfer, where some ranks send
    nothing: a barrier first, once per group and process.
    """
    import torch
    import torch.distributed as dist

    key = id(group) if group is not None else 0
    if _WARM.get(key):
        return
    dist.barrier(group=group, device_ids=[torch.cuda.current_device()])
    _WARM[key] = True


def p2p_op(kind: str, tensor: Any, peer: int, group: Any, tag: int):
    """A point-to-point operation: ``kind`` ``"send"`` or ``"recv"`` of ``tensor`` with global rank ``peer``."""
    import torch.distributed as dist

    return dist.P2POp(dist.isend if kind == "send" else dist.irecv, tensor, peer, group, tag)


def start_ops(ops: List[Any]) -> List[Any]:
    """Post ``ops`` (:func:`p2p_op`) together (``batch_isend_irecv``); their works, to :func:`wait_ops`."""
    import torch.distributed as dist

    if not ops:
        return []
    return list(dist.batch_isend_irecv(ops))


def wait_ops(works: List[Any], comm: Any, peers: Sequence[int], cuda: bool, *, doing: str = "sending bytes") -> None:
    """Wait for ``works``, failing within ``comm.timeout_s`` (and, on CUDA, as soon as a peer stops).

    gloo works complete only inside ``wait``, which takes the deadline (a
    killed peer's closed connection fails them at once); NCCL works are polled
    (``is_completed``) so that a dead peer is named once its liveness stops
    (:func:`shardckpt._collective.stopped`) rather than after the timeout.

    Args:
        works: what :func:`start_ops` returned.
        comm: the exchange's ``Comm`` (``op`` and ``timeout_s`` for messages and the deadline).
        peers: global ranks this rank exchanges with (named when late; watched on CUDA).
        cuda: the works are NCCL's (polled).
        doing: what the transfer is, for messages.

    Raises:
        LoadFailedError: the deadline passed, a peer stopped, or a peer's
            connection failed (naming the peers and what was being done).
    """
    from datetime import timedelta

    deadline = time.monotonic() + comm.timeout_s

    def late() -> LoadFailedError:
        return LoadFailedError(
            f"{comm.op}: no data from ranks {list(peers)} within collective_timeout_s={comm.timeout_s:g} "
            f"while {doing}; a rank is hung or gone: restart the job"
        )

    if cuda:
        watch = Liveness()
        nap, next_look = 0.0002, time.monotonic() + _LOOK_EVERY_S
        while not all(w.is_completed() for w in works):
            now = time.monotonic()
            if now >= deadline:
                raise late()
            if now >= next_look:
                next_look = now + _LOOK_EVERY_S
                try:
                    dead = stopped(list(peers), watch)
                except Exception:  # the store is gone with rank 0: the works fail or time out
                    dead = []
                if dead:
                    raise LoadFailedError(
                        f"{comm.op}: rank(s) {dead} stopped (no heartbeat for {_knobs.LIVENESS_TIMEOUT_S:g} s) while "
                        f"{doing}: the process died or is frozen; restart the job"
                    )
            time.sleep(nap)
            nap = min(nap * 2, 0.005)
    for w in works:
        left = deadline - time.monotonic()
        try:
            if cuda:
                w.wait()
            elif left <= 0 or not w.wait(timedelta(seconds=left)):
                raise late()
        except LoadFailedError:
            raise
        except Exception as e:  # gloo: the peer closed its connection (killed), or the deadline passed
            # Both come as the same type (DistBackendError): our own clock
            # tells them apart (gloo's timer may fire a few ms early).
            if time.monotonic() >= deadline - GLOO_TIMER_SLACK_S:
                raise late() from None
            raise LoadFailedError(
                f"{comm.op}: {doing} between ranks {list(peers)} failed ({type(e).__name__}: {e}); "
                "a peer died: restart the job"
            ) from None
