"""Restore from the memory tier: each rank receives exactly the byte ranges its load needs, from the cheapest holder.

``CheckpointManager.restore`` calls :func:`restore_from_memory` (through
``MemoryStore.restore``) before the storage step it picked. Collective over
the manager's ranks; every decision comes from values all ranks exchanged.

1. *choose*: every rank reports what its node holds (``store.inventory``);
   the newest step whose files the live nodes hold between them, if at least
   as new as the storage step, wins (``plan.choose_step``); else storage
   (logged when memory held a newer, incomplete step).
2. *metadata*: each rank stages, in a private directory of its node, hard
   links to every file its node holds of that step (no copy) and, from other
   holders, the manifest and index files its node lacks (small, whole files,
   verified: ``_memory/transfer.run_sends``).
3. *load*: ``_load.load_into`` — the one load (``plan_load`` once, check, agree,
   stream, agree; casting, resharding, ``atomic=``) — over the staged
   directory, with ``_replicas.Sources`` saying which ranks' nodes hold each
   data file. The stream reads the ranges this rank needs from its own
   node's memory (verified block by block, straight into the live tensor;
   pinned buffers and an asynchronous host-to-device copy for CUDA targets);
   a range of a file its node lacks is read (and verified) by a rank whose
   node holds it and sent over the process group in pipelined rounds
   (``_replicas.read_once``: reads run ahead into reused round buffers while
   earlier rounds are sent and placed). A rank receives the ranges it needs
   and nothing else; no byte is checked twice.
4. *damage*: a block failing its CRC-32C on some rank names its copy (node,
   file); every rank learns it, and the stream runs again (same plan) with
   that copy excluded, so the file comes from its other holder (logged).
   When a file some rank needs has no good copy left, the restore returns to
   storage (logged); the storage load then overwrites every tensor.

Steps 2-4 are ``_managed.held.restore_held``, the mechanism the per-node
``local=`` restore (``_flush.restore_local_held``) shares, with each node's
local step directory in place of its memory copy.

Limits: the manifest and index files travel whole (a few KB to MB); with
``keys=``/``key_map=`` the load still reads only what it needs.
"""

from __future__ import annotations

import logging
import shutil
from typing import Any, Dict, Optional

from .._collective import ALL, Comm, agree
from .._managed.held import Held, load_comm, restore_held
from . import plan as P
from . import store

__all__ = ["restore_from_memory"]

log = logging.getLogger("shardckpt")


def restore_from_memory(
    tier: Any,
    state: Dict[str, Any],
    comm: Comm,
    *,
    storage_step: Optional[int],
    process_group: Any,
    load_kw: Dict[str, Any],
) -> Optional[int]:
    """Restore the newest step in the live nodes' memory if at least as new as ``storage_step`` (collective).

    Args:
        tier: the manager's ``MemoryStore`` (its directory and root, node key, stats).
        state: the live state, loaded in place.
        comm: the manager's comm (every rank calls).
        storage_step: the step storage would restore (None: none).
        process_group: the manager's group (the bytes travel over it).
        load_kw: ``restore``'s load options.

    Returns:
        The step restored, or None: restore ``storage_step`` from storage
        (nothing complete in memory, or no good copy of some file left).

    Raises:
        LoadFailedError: a rank died or hung (named), as any load.
        StateMismatchError, UsageError: as ``shardckpt.load`` (the state
            does not fit the checkpoint: storage would fail alike).

    Example:
        >>> mgr.restore(state)  # doctest: +SKIP  (a manager with memory=...: this runs first)
    """
    held_comm = load_comm(comm, load_kw)
    if held_comm is None:
        return None
    comm = held_comm
    tier._start()
    mine = store.inventory(tier.dir, root=tier.root)
    _, reports = agree(comm, lambda: (tier._node_key(), mine), what="restore from the memory tier", share=lambda v: v, mode=ALL)
    choice = P.choose_step([inv for _, inv in reports], storage_step)
    if choice is None:
        newer = sorted({s for _, inv in reports for s in inv if storage_step is None or s > storage_step})
        if newer:
            log.warning(
                "shardckpt: memory tier: step %d is not held whole by the live nodes' memory (both copies of some "
                "file lost); restoring from storage (step %s)", newer[-1], storage_step,
            )
        return None
    step, sid = choice
    holders, sizes = P.holders_of([inv for _, inv in reports], step, sid)
    own_entry = mine.get(step, ("", {}, set()))
    held = Held(step=step, save_id=sid, holders=holders, sizes=sizes, node_of={r: reports[r][0] for r in range(comm.world)},
                own_dir=store.step_dir(tier.dir, step), own_held=set(own_entry[2]) if own_entry[0] == sid else set())
    stage = store.staging_dir(tier.dir, tier.root, comm.rank)  # never fails: every rank takes part in the fetches
    stats: Dict[str, Any] = {}
    try:
        got = restore_held(state, held, comm, stage=stage, process_group=process_group, load_kw=load_kw, stats=stats,
                           label="memory tier")
    finally:
        shutil.rmtree(stage, ignore_errors=True)
    if got is not None:
        tier.last_restore = stats
    return got
