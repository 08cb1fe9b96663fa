"""The one load, collective: plan and check, agree, stream (or stage), agree, finish.

:func:`load_into` is what :func:`shardckpt.load`, :func:`shardckpt.read` and
the memory tier's restore call, from an open storage and comm:

  1. plan and check (:func:`~shardckpt._load.plan.plan_load`, then the data
     files present at their recorded sizes: ``check_files`` on
     :attr:`LoadPlan.files`);
  2. agree: every rank's plan succeeded (``_collective.agree``, bounded by
     ``collective_timeout_s``) — the point of no return;
  3. stream (``stream.stream_into``; into staging tensors first with
     ``atomic=True``, ``stage.py``);
  4. agree: every rank streamed without error; then, for ``atomic=True``,
     the staged tensors are copied in; then created tensors and plain values
     are put back and stateful objects get ``load_state_dict``
     (:func:`_finish`, agreed too).
"""

from __future__ import annotations

import dataclasses
import functools
from typing import TYPE_CHECKING, Any, Callable, Dict, List, Optional, Sequence, Tuple

from .._collective import Comm, agree
from .._format import Manifest
from .._io import check_files
from .._storage import Storage
from ..errors import CheckpointError, LoadFailedError, StateMismatchError, format_offenders
from .plan import DEFAULT_CAST, KeyMap, LoadPlan, LoadResult, plan_load
from .stage import copy_staged, stage_targets
from .stream import StreamHook, stream_into

if TYPE_CHECKING:  # pragma: no cover
    from torch.distributed import ProcessGroup

__all__ = ["load_into"]


def _run_alone(plan: LoadPlan, run: Callable[..., Any]) -> Any:
    """The default stream hook: run the stream once, as it is."""
    return run()


def load_into(
    state: Dict[str, Any],
    storage: Storage,
    *,
    comm: Comm,
    process_group: Optional["ProcessGroup"],
    strict: bool = True,
    io_threads: Optional[int] = None,
    keys: Optional[Sequence[str]] = None,
    key_map: Optional[KeyMap] = None,
    atomic: bool = False,
    buffer_bytes: Optional[int] = None,
    cast: bool = DEFAULT_CAST,
    held: Optional[Callable[[str], bool]] = None,
    stream: Optional[StreamHook] = None,
    opened: Optional[Manifest] = None,
) -> LoadResult:
    """:func:`load` from an open storage and comm (collective): plan and check, agree, stream, agree, finish.

    The one load; :func:`load` and the memory tier's restore call it. The
    memory tier passes ``held`` (which data files this rank's storage holds:
    only those are checked present; the others come from other ranks) and
    ``stream``, which runs the stream itself — ``stream(plan, run)``, ``run``
    being :func:`stream_into` bound to this load's plan and destinations,
    taking its ``sources=``/``read=`` options, and possibly run again after
    a damaged copy (the plan is made once; its ``cache`` holds the metadata
    it read). ``opened``: the storage's
    manifest, already opened and checked by the caller (not parsed again).

    Raises:
        As :func:`load`.
    """

    def plan_and_check() -> LoadPlan:
        plan = plan_load(
            state, storage, rank=comm.rank, world=comm.world, strict=strict, keys=keys, key_map=key_map, cast=cast,
            local_only=comm.no_dist, union=union, opened=opened,
        )
        needed = plan.files
        check_files(storage, needed if held is None else {f: n for f, n in needed.items() if held(f)})
        return plan

    # Agree across ranks before touching any tensor: one rank's missing file
    # must not leave the others loaded and this one not. Strict with several
    # ranks: what a rank leaves unclaimed is unexpected only if every rank
    # leaves it (ranks of one pipeline stage send the same list, so each
    # distinct list travels once).
    union = strict and comm.world > 1
    if union:
        plan, _ = agree(
            comm, plan_and_check, what=f"nothing was loaded from {storage.url}", mode="distinct",
            share=lambda p: p.result.unexpected_keys, decide=_nobody_holds,
        )
        # Every entry this rank left is another rank's: a strict load reports none.
        plan = dataclasses.replace(plan, result=LoadResult(plan.result.missing_keys, []))
    else:
        plan, _ = agree(comm, plan_and_check, what=f"nothing was loaded from {storage.url}")
    hook: StreamHook = stream if stream is not None else _run_alone
    staged = stage_targets(plan) if atomic else None
    run = functools.partial(
        stream_into, storage, plan, staged, threads=io_threads, buffer_bytes=buffer_bytes, comm=comm, process_group=process_group
    )
    agree(
        comm,
        lambda: hook(plan, run),
        what=f"nothing was loaded from {storage.url}" if atomic else
        f"the load from {storage.url} stopped part-way (ranks not named here loaded all their tensors)",
    )
    if staged is not None:
        copy_staged(plan, staged)
    _finish(comm, storage.url, plan)
    return plan.result


def _finish(comm: Comm, url: str, plan: LoadPlan) -> None:
    """Put created tensors and run the finalizers (``load_state_dict`` of stateful objects...), agreed by every rank.

    They run once every rank's tensors are in. One that raises (a user
    object refusing its saved state: its own version check) cannot be
    checked before: the object decides. The load then raises our error on
    every rank, naming the tensors this rank had already loaded and keeping
    the object's exception as ``__cause__`` (the streaming contract, as for a
    block that fails its checksum part-way).
    """
    original: List[BaseException] = []

    def run() -> None:
        for name, put in plan.creates.items():
            put(plan.created[name])
        for fn in plan.finalizers:
            try:
                fn()
            except Exception as e:
                cause = e.__cause__ if isinstance(e, CheckpointError) and e.__cause__ is not None else e
                original.append(cause)
                loaded = [t.name for t in plan.targets] + sorted(plan.created)
                cls = type(e) if isinstance(e, CheckpointError) else StateMismatchError
                text = str(e) if isinstance(e, CheckpointError) else f"{type(e).__name__}: {e}"
                msg = (f"{text}. The tensors were loaded before it (the live state now holds the checkpoint's "
                       f"values there; load again once this is fixed): {format_offenders(loaded) if loaded else 'none'}")
                try:
                    err = cls(msg)
                except Exception:  # a subclass with another signature
                    err = StateMismatchError(msg)
                raise err from cause

    try:
        agree(comm, run, what=f"the load from {url} stopped after the tensors were loaded", error=LoadFailedError)
    except CheckpointError as e:
        if original and e.__cause__ is not original[0]:
            e.__cause__ = original[0]  # the object's own exception, not our wrapper of it
        raise


def _nobody_holds(groups) -> Tuple[None, List[None]]:
    """Rank 0 of a strict multi-rank load: refuse the checkpoint entries that no rank's state holds.

    ``groups``: ``_collective.Group``s whose values are the ranks' unclaimed
    names (sorted lists). Raises ``StateMismatchError`` (on every rank).
    """
    nobody = set(groups[0].value)
    for g in groups[1:]:
        nobody &= set(g.value)
    if nobody:
        raise StateMismatchError(
            "cannot load, state and checkpoint disagree: in the checkpoint but not in the state of any rank: "
            f"{format_offenders(sorted(nobody))}. Pass strict=False to load the common entries."
        )
    return None, [None] * len(groups)
