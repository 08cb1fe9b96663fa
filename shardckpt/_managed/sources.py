"""Where a manager's restore may find a step of its run: its sources, fastest first, and what a restore hands the flusher.

``CheckpointManager.restore`` asks :func:`sources` for the places
(``_managed.restore.Source``: memory, then with ``local=`` the per-node or
shared local directory and the remote, else the root) and runs the one
restore rule over them (``_managed.restore.restore_from``); with ``local=``,
:func:`resume_flush` is told the newest step of each place once probed (the
run, what is durable, the local step to flush).
"""

from __future__ import annotations

import logging
from dataclasses import dataclass
from typing import Any, Callable, Dict, List, Optional, Tuple

from .._collective import FROM_ROOT, Comm, agree
from .._flush import PerNodeSource, Tiers
from .._format.committed import nearby_names
from .._load import load
from .._storage import Storage
from . import restore as order
from . import retention
from .runs import RunSteps

__all__ = ["Places", "sources", "resume_flush"]

log = logging.getLogger("shardckpt")


@dataclass(frozen=True)
class Places:
    """What a manager's restore reads from: its root, tiers and options (built by ``CheckpointManager.restore``).

    Attributes:
        root: the manager's root (with ``local=``, the local directory).
        storage_options: the root's fsspec options.
        process_group: the manager's group.
        memory: the memory tier (``_memory.tier``), or None.
        tiers: with ``local=``, the remote and its flusher (``_flush.Tiers``), else None.
        runs: with ``local=``, which local steps are this run's.
        layout: ``(shared, lead, leads)`` of the root (``_flush.detect_nodes``).
        check_files: check each step's files before loading it.
        initial_load_path: where a fresh run starts (named when nothing is there).
        load_only: a load-only manager (nothing is flushed).
    """

    root: Storage
    storage_options: Dict[str, Any]
    process_group: Any
    memory: Any
    tiers: Optional[Tiers]
    runs: Optional[RunSteps]
    layout: Tuple[bool, bool, List[int]]
    check_files: bool
    initial_load_path: Optional[str]
    load_only: bool

    def validate(self, step: int) -> None:
        """Check the root's step ``step`` before loading it (per-node: its files are checked as they load)."""
        if not self.layout[0]:
            order.validate_step(self.root, step, files=False, chunks=False)
            return
        order.validate_step(self.root, step, files=self.check_files)


def sources(p: Places, state: Dict[str, Any], comm: Comm, load_kw: Dict[str, Any]) -> List[Any]:
    """The places restore may load a step of this run from, fastest first (``_managed.restore.Source``; collective to build).

    Memory (``memory=``), then with ``local=`` the per-node or shared
    local directory and the remote, else the root.
    """
    out: List[Any] = []
    remote_run: List[Callable[[], Optional[str]]] = []  # with local=: the remote's newest step's run (probed first)
    if p.memory is not None:
        out.append(p.memory.source(comm, process_group=p.process_group, load_kw=load_kw,
                                   run=lambda: remote_run[0]() if remote_run else None))

    def loader(storage_options: Optional[Dict[str, Any]]) -> Callable[[str], Any]:
        return lambda url: load(state, url, storage_options=storage_options or None, process_group=p.process_group, **load_kw)

    def steps() -> List[int]:
        return retention.scan(p.root)[0]

    if p.tiers is None or p.runs is None:
        out.append(order.RootSource("storage", p.root, comm, steps=steps, validate=p.validate,
                                    load=loader(p.storage_options), initial_load_path=p.initial_load_path,
                                    choose_first=True, say_empty=lambda: order.say_why_empty(p.root, nearby=nearby_names)))
        return out
    tiers, runs = p.tiers, p.runs
    remote = tiers.remote
    remote_src = order.RootSource(
        "remote", remote.root, comm, steps=remote.steps, load=loader(remote.storage_options), tolerate=True,
        validate=lambda st: order.validate_step(remote.root, st, files=remote.check_files),
        # Probed after the local directory: nothing in either, the notice names both.
        say_empty=lambda: order.say_why_empty(p.root, nearby=nearby_names, remote=remote.root))

    remote_run.append(lambda: remote_src.run)

    def own_steps() -> List[int]:  # this run's: the root, and the run of the remote's newest step (probed first)
        return runs.own(steps(), remote_src.run)

    if not p.layout[0]:  # per-node: each node's own disk
        stats: Dict[str, Any] = {}
        tiers.last_restore = stats

        def check(st: int) -> None:  # this node's copy: a valid manifest of this run's step
            order.validate_step(p.root, st, files=False, chunks=False)
            runs.check_own(st, remote_src.run)

        out.append(PerNodeSource(p.root, comm, leads=p.layout[2], steps=own_steps, check=check,
                                 process_group=p.process_group, load_kw=load_kw, stats=stats))
    else:
        out.append(order.RootSource("local", p.root, comm, steps=own_steps, validate=p.validate,
                                    load=loader(None), every_rank=True))
    out.append(remote_src)
    return out


def resume_flush(p: Places, comm: Comm, found_in: List[Any]) -> Optional[Callable[[List[Optional[int]]], None]]:
    """With ``local=``, once restore knows the newest step of each source: the run, what is durable, and the local step to flush.

    The run is the remote's newest step's (``_managed.identity``); durable
    is the newest remote step that is loadable
    (:func:`_managed.restore.newest_loadable`); the newest local step of
    this run the remote lacks is handed to the flusher (in the background,
    while it loads), unless a load-only manager or a step of another world
    size (each rank uploads the files it wrote: that step stays local,
    logged). None without ``local=``.
    """
    if p.tiers is None:
        return None
    tiers = p.tiers
    local, remote = found_in[-2], found_in[-1]

    def probed(found: List[Optional[int]]) -> None:
        lstep, rstep = found[-2], found[-1]
        tiers.run = remote.run
        flusher = tiers.flusher_on(p.root, comm)
        # Durable means loadable: the remote's newest step whose files are all there (rank 0 checks).
        _, durable = agree(comm, lambda: order.newest_loadable(remote.root, rstep, steps=tiers.remote.steps)
                           if comm.rank == 0 else None, what=f"restore: the durable step of {tiers.remote_url}",
                           share=lambda v: v, mode=FROM_ROOT)
        flusher.set_durable(durable)
        if lstep is None or (rstep is not None and lstep <= rstep) or p.load_only:
            return
        if local.world == comm.world:
            flusher.submit(lstep)
        elif comm.rank == 0:
            log.warning("shardckpt: local step %d was saved by %s ranks, this job has %d: it is not flushed to %s (each "
                        "rank uploads the files it wrote); it stays local", lstep, local.world, comm.world, tiers.remote_url)

    return probed
