"""The memory tier at work: save a step into shared memory with a peer copy; restore from the cheapest holder.

``MemoryTier`` (``_memory/__init__``) is what the user configures;
:class:`MemoryStore` is the manager's running tier. Every method is
collective over the manager's ranks (as ``save``/``restore`` are), and
every decision comes from values all ranks exchanged, computed by the pure
functions of ``_memory/plan.py``, so every rank reaches the same one.

Save (``CheckpointManager.save_to_memory``): ``_memory/snapshot.py``. The
call blocks only for the copy of the rank's shard into mapped (pinned)
shared-memory slots that are the memory copy; checksums, the commit, the
manifest on every node and the peer copy run in a background thread, and
the step is held once both copies are verified everywhere. A step that does
not fit the budget (or whose directory is refused) is not written: the tier
turns itself off with one warning; storage saves go on.

Restore (``CheckpointManager.restore``: one of its sources, :meth:`MemoryStore.source`):
  ``_memory/restore.py``: each rank receives exactly the byte ranges its
  load needs, from its node's memory or from a rank whose node holds them.
"""

from __future__ import annotations

import logging
import os
import socket
from typing import Any, Callable, Dict, List, Optional

from .._collective import Comm
from . import plan as P
from . import store
from .restore import MemorySource
from .snapshot import Snapshots, find_optimizers

__all__ = ["MemoryStore"]

log = logging.getLogger("shardckpt")



class MemoryStore:
    """The running memory tier of one manager on one rank (see the module docstring)."""

    def __init__(self, config: Any, root_url: str):
        self.config = config
        #: The storage root whose copy this is (its identity: store.open_dir, store.step_extra).
        self.root = root_url
        self.dir = config.resolved_dir(root_url)
        self._said_no_copy = False
        self.disabled: Optional[str] = None
        #: What the last memory restore did on this rank (benchmarks, tests, logs): step, bytes read, checked,
        #: received, sent and needed, seconds per phase (``_memory/restore.py``).
        self.last_restore: Dict[str, Any] = {}
        #: The save half: slots, the background thread (``_memory/snapshot.py``).
        self.snapshots = Snapshots(self.dir, root_url)
        self._cleaned = False
        self._node = None

    # -- helpers --------------------------------------------------------------

    def _node_key(self) -> str:
        return f"{socket.gethostname()}:{os.path.realpath(self.dir)}"

    def _start(self) -> None:
        """First use in this process: remove what dead processes left in the directory."""
        if self._cleaned:
            return
        self._cleaned = True
        for what in store.clean_stale(self.dir, root=self.root):
            log.info("shardckpt: memory tier: removed a stale leftover %s", what)

    def _ranks_per_node(self, world: int) -> int:
        rpn = self.config.ranks_per_node
        if rpn is None:
            try:
                rpn = int(os.environ.get("LOCAL_WORLD_SIZE", "0")) or world
            except ValueError:
                rpn = world
        return max(1, min(int(rpn), world))

    def _warn_no_copy(self, ranks: List[int], me: int) -> None:
        """Say once (rank 0) that some ranks' memory copy has no second holder."""
        if ranks and not self._said_no_copy and me == 0:
            shown = ", ".join(map(str, ranks[:8])) + (", ..." if len(ranks) > 8 else "")
            log.warning(
                "shardckpt: memory tier: no second copy of rank(s) %s (one node, or no peer on another node): the memory "
                "tier survives a training process crash but not the loss of that node; storage saves cover that. Nodes "
                "simulated on one host (tests, containers) need ranks_per_node= and a directory per node computed from the "
                "rank, e.g. MemoryTier(dir=f'/dev/shm/run1-node{rank // 2}', ranks_per_node=2) for nodes of 2 ranks", shown,
            )
        self._said_no_copy = True

    def _disable(self, why: str) -> None:
        if self.disabled is None:
            log.warning("shardckpt: memory tier off, storage only from now on: %s", why)
        self.disabled = why

    # -- save -----------------------------------------------------------------

    def save(self, step: int, state: Dict[str, Any], comm: Comm, *, process_group, io_threads: Optional[int],
             overlap: bool = False, replicas: Optional[str] = None, run: Optional[str] = None) -> bool:
        """Copy ``step`` into memory and start its checksums and peer copy in the background (collective).

        False when the tier is (or turns) off. ``replicas``: the replica
        check's mode (the manager's). ``run``: the run identity the step
        records (``_managed.identity``). See ``_memory/snapshot.py``.
        """
        if self.disabled is not None:
            return False
        self._start()
        world = comm.world
        rpn = self._ranks_per_node(world)
        peers = P.peer_map(world, rpn, self.config.peers)
        share = None if self.config.max_bytes is None else self.config.max_bytes // rpn
        return self.snapshots.save(step, state, comm, process_group=process_group, overlap=overlap, peers=peers,
                                   node_key=self._node_key(), share=share, disable=self._disable,
                                   warn_no_copy=self._warn_no_copy, io_threads=io_threads, replicas=replicas, run=run)

    def warm(self, state: Dict[str, Any], comm: Comm, *, process_group, replicas: Optional[str] = None) -> bool:
        """Start making this rank's slots for ``state`` in the background (collective; after a restore).

        The first ``save`` then allocates and pins nothing: ``Snapshots.warm``.
        An optimizer in ``state`` that has not stepped yet (a fresh run) has
        no state to size the slots from: the warm-up then starts after its
        first ``step()`` (a one-shot post-hook; every rank steps). False when
        the tier is off, has slots already, or cannot plan ``state``.
        """
        if self.disabled is not None:
            return False
        unstepped = [o for o in find_optimizers(state) if not o.state and any(len(g["params"]) for g in o.param_groups)]
        if unstepped:
            # An optimizer not stepped yet has no state (AdamW's moments come at its first step): the shard's size is
            # known after that step, so the warm-up starts there (every rank steps: the warm-up is collective).
            hooks: List[Any] = []

            def after_first_step(_opt: Any, _args: Any, _kwargs: Any) -> None:
                for h in hooks:
                    h.remove()
                hooks.clear()
                self.warm(state, comm, process_group=process_group, replicas=replicas)

            hooks.extend(o.register_step_post_hook(after_first_step) for o in unstepped)
            return True
        self._start()
        world = comm.world
        rpn = self._ranks_per_node(world)
        peers = P.peer_map(world, rpn, self.config.peers)
        share = None if self.config.max_bytes is None else self.config.max_bytes // rpn
        return self.snapshots.warm(state, comm, process_group=process_group, peers=peers, node_key=self._node_key(),
                                   share=share, disable=self._disable, warn_no_copy=self._warn_no_copy, replicas=replicas)

    @property
    def last_save(self) -> Dict[str, Any]:
        """What the last held memory step's save did: step, own bytes, peer bytes sent/received, seconds."""
        return self.snapshots.last_save

    # -- restore --------------------------------------------------------------

    def source(self, comm: Comm, *, process_group: Any, load_kw: Dict[str, Any],
               run: Optional[Callable[[], Optional[str]]] = None) -> MemorySource:
        """This tier as one of restore's sources (``_memory/restore.MemorySource``; its ``newest`` waits for the step in flight)."""
        return MemorySource(self, comm, process_group=process_group, load_kw=load_kw, run=run)

    def close(self) -> None:
        """Remove this root's memory copy from this node (the job is done with it); another root's is never touched."""
        self.snapshots.close()  # unmaps and unlinks this process's slots first, so the directory can go
        store.close_dir(self.dir, root=self.root)
