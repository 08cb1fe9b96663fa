"""Restore from the memory tier: each rank receives exactly the byte ranges its load needs, from the cheapest holder.

:class:`MemorySource` is the memory tier's ``_managed.restore.Source``:
``CheckpointManager.restore`` asks it, with the other sources (per-node or
shared local directory, remote, root), for the newest step of this run it
holds, and loads from the newest source (a tie goes to memory, the cheaper
one). Collective over the manager's ranks; every decision comes from values
all ranks exchanged.

1. *choose* (:meth:`MemorySource.newest`): every rank reports what its node
   holds (``store.inventory``: only this root's copy, only steps naming this
   root and, when the run is known, this run: ``_managed.identity``; a step
   of another run is logged once, naming its root and run, and left in
   place); the newest step whose files the live nodes hold between them wins
   (``plan.choose_step``; a newer, incomplete step is logged).
2. *metadata*, 3. *load*, 4. *damage* (:meth:`MemorySource.load`): the held
   restore ``_managed.held.restore_held`` (the mechanism per-node ``local=``
   directories share): each rank stages hard links to its node's files,
   fetches the metadata it lacks, then streams the ranges it needs from its
   node's memory or receives them from a holder rank, a damaged copy skipped
   for the next holder. With no good copy of some file left, ``load`` returns
   None and the next source restores (it overwrites every tensor).

After a node loss every byte is read once and checked once: a survivor reads
and checks its own shard in its node's memory; the lost node's shard is read
there unchecked by the survivors holding its copy (the least loaded first,
so several share it), sent, and checked by the replacement on arrival
(``_replicas.interior``: the whole CRC blocks; the partial blocks at a
range's ends, whose other bytes do not travel, by the sender). What each
rank did is ``MemoryStore.last_restore`` (and logged at INFO): bytes read
(``local_bytes``), checked (``verified_bytes``), received (``peer_bytes``
data, ``meta_bytes`` manifest and index files), sent, needed, and seconds
per phase (``choose``, ``metadata``, ``load`` and its ``stream``).

Limits: the manifest and index files travel whole (a few KB to MB); with
``keys=``/``key_map=`` the load still reads only what it needs. A step given
to ``restore(step=N)`` is never taken from memory (storage answers for it).
"""

from __future__ import annotations

import logging
import shutil
import time
from typing import Any, Callable, Dict, Optional, Tuple

from .._collective import ALL, Comm, agree
from .._managed import identity
from .._managed.held import Held, load_comm, restore_held
from . import plan as P
from . import store

__all__ = ["MemorySource"]

log = logging.getLogger("shardckpt")


class MemorySource:
    """The memory tier as a restore source (``_managed.restore.Source``), over the manager's ranks.

    Args:
        tier: the manager's ``MemoryStore`` (its directory and root, node key, stats).
        comm: the manager's comm (every rank calls).
        process_group: the manager's group (the bytes travel over it).
        load_kw: ``restore``'s load options (options only a storage load
            takes turn this source off: it then holds nothing).
        run: this run's identity when :meth:`newest` runs (the run of the
            remote's newest step, ``_managed.identity``; the manager probes
            the remote first); None or returning None: any run of the root.

    Raises (from :meth:`load`):
        LoadFailedError: a rank died or hung (named), as any load.
        StateMismatchError, UsageError: as ``shardckpt.load`` (the state
            does not fit the checkpoint: storage would fail alike).

    Example:
        >>> mgr.restore(state)  # doctest: +SKIP  (a manager with memory=...: memory is one of its sources)
    """

    name = "memory"

    def __init__(self, tier: Any, comm: Comm, *, process_group: Any, load_kw: Dict[str, Any],
                 run: Optional[Callable[[], Optional[str]]] = None):
        self.tier, self.process_group, self.load_kw, self.run = tier, process_group, load_kw, run
        self.comm = load_comm(comm, load_kw)
        self._held: Optional[Held] = None
        self._choose_s = 0.0

    def newest(self, step: Optional[int]) -> Optional[int]:
        """The newest step the live nodes' memory holds whole (collective); None: none, or ``step`` was given."""
        if step is not None or self.comm is None:
            return None
        tier, comm = self.tier, self.comm
        tier.snapshots.wait()  # a step in flight first; its failure is raised here
        t0 = time.perf_counter()
        tier._start()
        run = None if self.run is None else self.run()
        mine = store.inventory(tier.dir, root=tier.root,
                               foreign=lambda extra: identity.foreign(extra, root=tier.root, run=run))
        _, reports = agree(comm, lambda: (tier._node_key(), mine), what="restore from the memory tier", share=lambda v: v, mode=ALL)
        choice = P.choose_step([inv for _, inv in reports], None)
        newer = sorted({s for _, inv in reports for s in inv if choice is None or s > choice[0]})
        if newer:
            log.warning("shardckpt: memory tier: step %d is not held whole by the live nodes' memory (both copies of some "
                        "file lost); not restored from memory", newer[-1])
        if choice is None:
            return None
        got, sid = choice
        holders, sizes = P.holders_of([inv for _, inv in reports], got, sid)
        own = mine.get(got, ("", {}, set()))
        self._held = Held(step=got, save_id=sid, holders=holders, sizes=sizes, node_of={r: reports[r][0] for r in range(comm.world)},
                          own_dir=store.step_dir(tier.dir, got), own_held=set(own[2]) if own[0] == sid else set())
        self._choose_s = time.perf_counter() - t0
        return got

    def load(self, state: Dict[str, Any], step: int, *, exact: bool) -> Optional[Tuple[int, str]]:
        """Load the step :meth:`newest` chose (collective): ``(step, "memory:<step>")``; None: no good copy of some file left (logged)."""
        held, comm, tier = self._held, self.comm, self.tier
        assert held is not None and held.step == step and comm is not None
        stage = store.staging_dir(tier.dir, tier.root, comm.rank)  # never fails: every rank takes part in the fetches
        stats: Dict[str, Any] = {}
        try:
            got = restore_held(state, held, comm, stage=stage, process_group=self.process_group, load_kw=self.load_kw,
                               stats=stats, label="memory tier")
        finally:
            shutil.rmtree(stage, ignore_errors=True)
        if got is None:
            return None
        stats["seconds"] = {"choose": round(self._choose_s, 4), **stats["seconds"]}
        tier.last_restore = stats
        return got, f"memory:{got}"
