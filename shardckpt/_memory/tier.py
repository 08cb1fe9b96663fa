"""The memory tier at work: save a step into shared memory with a peer copy; restore from the cheapest holder.

``MemoryTier`` (``_memory/__init__``) is what the user configures;
:class:`MemoryStore` is the manager's running tier. Every method is
collective over the manager's ranks (as ``save``/``restore`` are), and
every decision comes from values all ranks exchanged, computed by the pure
functions of ``_memory/plan.py``, so every rank reaches the same one.

Save (``CheckpointManager.save_to_memory``):
  1. the ordinary save engine (``prepare_save`` + ``execute_save``) writes
     each rank's files into its node's ``step-<N>/`` (a ``LocalStorage``
     there); rank 0 commits the manifest on its node;
  2. the manifest goes to every rank (one agreement) and is written on every
     node, so each node can say which step it holds;
  3. each rank's data and index files go to its peer rank (another node)
     over the process group (``_memory/transfer.py``);
  4. once every rank has its step and its peer's (one agreement), every other
     step in memory is removed.
  A step that does not fit the budget (or the directory is missing or full)
  is not written: the tier turns itself off with one warning; storage saves
  go on.

Restore (``CheckpointManager.restore``, before the storage step it picked):
  ``_memory/restore.py``: each rank receives exactly the byte ranges its
  load needs, from its node's memory or from a rank whose node holds them.
"""

from __future__ import annotations

import dataclasses
import logging
import os
import socket
from typing import Any, Callable, Dict, List, Optional, Tuple

from .._collective import ALL, FROM_ROOT, Comm, agree
from .._format import MANIFEST_NAME, open_manifest
from .._save import execute_save, prepare_save
from .._storage import Storage
from . import plan as P
from . import store
from .restore import restore_from_memory
from .transfer import run_sends

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
        #: What the last memory restore did (tests and logs): step, bytes per source.
        self.last_restore: Dict[str, Any] = {}
        #: What the last memory save did: step, own bytes, peer bytes sent/received.
        self.last_save: Dict[str, Any] = {}
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
                "tier survives a training process crash but not the loss of that node; storage saves cover that", shown,
            )
        self._said_no_copy = True

    def _disable(self, why: str) -> None:
        if self.disabled is None:
            log.warning("shardckpt: memory tier off, storage only from now on: %s", why)
        self.disabled = why

    # -- save -----------------------------------------------------------------

    def save(self, step: int, state: Dict[str, Any], comm: Comm, *, process_group, io_threads: Optional[int]) -> bool:
        """Save ``step`` into memory with its peer copy (collective). False when the tier is (or turns) off."""
        if self.disabled is not None:
            return False
        self._start()
        url = store.step_dir(self.dir, step)
        plan = prepare_save(state, url, comm=comm, storage_options=store.PRIVATE, overwrite=True, io_threads=io_threads,
                            extra=store.step_extra(step, self.root))
        own = sum(it.tensor.numel() * it.tensor.element_size() for it in plan.items if it.tensor is not None)

        def probe() -> Tuple[str, int, Optional[int], Optional[str]]:
            why = store.open_dir(self.dir, self.root)
            if why is not None:
                return self._node_key(), own, -1, why
            store.remove_step(self.dir, step)  # a leftover (or a planted link) at this step's name: never written through
            return self._node_key(), own, store.free_bytes(self.dir), None

        _, facts = agree(comm, probe, what=f"memory save of step {step}", share=lambda v: v, mode=ALL)
        world = comm.world
        peers = P.peer_map(world, self._ranks_per_node(world), self.config.peers)
        node_of = {r: facts[r][0] for r in range(world)}
        problems = []
        share = None if self.config.max_bytes is None else self.config.max_bytes // self._ranks_per_node(world)
        need_on: Dict[str, int] = {}
        for r in range(world):
            node, own_r, free, why = facts[r]
            held = own_r + sum(facts[s][1] for s in P.senders_to(r, peers) if node_of[s] != node)
            need_on[node] = need_on.get(node, 0) + held
            if free == -1:
                problems.append(f"rank {r}: {why}")
            elif share is not None and 2 * held > share:
                problems.append(f"rank {r}: a step needs {held} bytes here (twice that while the old step stays), over its share {share} of max_bytes")
        for r in range(world):  # the ranks of a node share its free space
            node, _, free, _ = facts[r]
            if free is not None and free != -1 and need_on[node] > free and not any(node in p for p in problems):
                problems.append(f"{node} has {free} bytes free, a step needs {need_on[node]} there")
        if problems:
            self._disable("; ".join(problems[:4]))
            return False
        self._warn_no_copy(P.ranks_without_copy(peers, node_of), comm.rank)
        execute_save(dataclasses.replace(plan, files_here=False))

        # The manifest to every node: each node can then tell which step it holds.
        def read_manifest_bytes() -> Optional[bytes]:
            if comm.rank != 0:
                return None
            with open(os.path.join(url, MANIFEST_NAME), "rb") as f:
                return f.read()

        _, mbytes = agree(comm, read_manifest_bytes, what=f"memory save of step {step}", share=lambda v: v, mode=FROM_ROOT)
        here = Storage(url, storage_options=store.PRIVATE)

        def place_manifest() -> Tuple[Dict[str, int], List[Tuple[int, int, str]]]:
            try:
                with open(os.path.join(url, MANIFEST_NAME), "rb") as f:
                    same = f.read() == mbytes
            except OSError:
                same = False
            if not same:
                here.write_atomic(MANIFEST_NAME, mbytes)
            m = open_manifest(here, chunks=False)
            by_writer = P.files_by_writer(m.files, {rel: im.rank for rel, im in m.indexes.items()})
            sends = [
                (r, p, rel)
                for r, p in sorted(peers.items())
                if p is not None and node_of[p] != node_of[r]
                for rel in by_writer.get(r, [])
            ]
            return {rel: f.size for rel, f in m.files.items()}, sends

        (sizes, sends), _ = agree(comm, place_manifest, what=f"memory save of step {step}: the manifest on every node")

        def transfer() -> Tuple[int, int]:
            _, sent, got = run_sends(
                sends, me=comm.rank, group_ranks=comm.ranks, group=process_group, sizes=sizes,
                src_path=lambda rel: os.path.join(url, rel), dst_path=lambda rel: os.path.join(url, rel),
            )
            return sent, got

        (sent, got), _ = agree(comm, transfer, what=f"memory save of step {step}: the peer copies")
        # Every rank has its step and its peers' copies: older steps can go.
        removed = store.remove_steps_except(self.dir, step, root=self.root)
        self.last_save = {"step": step, "own_bytes": own, "peer_bytes_sent": sent, "peer_bytes_received": got, "removed": removed}
        return True

    # -- restore --------------------------------------------------------------

    def restore(
        self, state: Dict[str, Any], comm: Comm, *, storage_step: Optional[int], process_group,
        load_kw: Dict[str, Any], load: Optional[Callable[[str], Any]] = None,
    ) -> Optional[int]:
        """Restore the newest step in memory if at least as new as ``storage_step`` (collective); None: use storage.

        The work is ``_memory/restore.restore_from_memory`` (``load``: unused,
        kept for callers that pass the storage load).
        """
        return restore_from_memory(self, state, comm, storage_step=storage_step, process_group=process_group, load_kw=load_kw)

    def close(self) -> None:
        """Remove this root's memory copy from this node (the job is done with it); another root's is never touched."""
        store.close_dir(self.dir, root=self.root)
