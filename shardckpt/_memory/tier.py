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
  1. every rank reports what its node holds; the newest step whose files the
     live nodes hold between them, if at least as new as the storage step, wins;
  2. three fetch phases, each rank staging what it needs in a private
     directory (hard links to its node's files, files received from peers):
     the manifest, every index file, then the data files this rank's load
     reads (the load's own plan). Each file is verified before use; a damaged
     copy is reported and fetched from the next holder (logged);
  3. ``shardckpt.load`` from the staging directory: the normal verified,
     resharding load.
  When no holder is left for some file, the restore returns to storage.
"""

from __future__ import annotations

import logging
import os
import shutil
import socket
import time
from typing import Any, Callable, Dict, List, Optional, Set, Tuple

from .._collective import ALL, Comm, agree
from .._format import MANIFEST_NAME, open_manifest
from .._format._v2 import _read_index
from .._format.resolve import MetaCache
from .._hf import with_aliases
from .._load import _needed_files, _plan_load
from .._storage import Storage
from ..errors import CorruptCheckpointError
from . import plan as P
from . import store
from .snapshot import Snapshots
from .transfer import run_sends

__all__ = ["MemoryStore"]

log = logging.getLogger("shardckpt")

#: Rounds of a fetch: each round retries the files whose copy was damaged from the next holder.
FETCH_ROUNDS = 4


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
                "tier survives a training process crash but not the loss of that node; storage saves cover that", shown,
            )
        self._said_no_copy = True

    def _disable(self, why: str) -> None:
        if self.disabled is None:
            log.warning("shardckpt: memory tier off, storage only from now on: %s", why)
        self.disabled = why

    # -- save -----------------------------------------------------------------

    def save(self, step: int, state: Dict[str, Any], comm: Comm, *, process_group, io_threads: Optional[int],
             overlap: bool = False) -> bool:
        """Copy ``step`` into memory and start its checksums and peer copy in the background (collective).

        False when the tier is (or turns) off. See ``_memory/snapshot.py``.
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
                                   warn_no_copy=self._warn_no_copy, io_threads=io_threads)

    @property
    def last_save(self) -> Dict[str, Any]:
        """What the last held memory step's save did: step, own bytes, peer bytes sent/received, seconds."""
        return self.snapshots.last_save

    # -- restore --------------------------------------------------------------

    def restore(
        self, state: Dict[str, Any], comm: Comm, *, storage_step: Optional[int], process_group,
        load: Callable[[str], Any], load_kw: Dict[str, Any],
    ) -> Optional[int]:
        """Restore the newest step in memory if at least as new as ``storage_step`` (collective); None: use storage."""
        self.snapshots.wait()  # a step in flight first; its failure is raised here
        self._start()
        mine = store.inventory(self.dir, root=self.root)
        _, reports = agree(
            comm, lambda: (self._node_key(), mine), what="restore from the memory tier", share=lambda v: v, mode=ALL
        )
        node_of = {r: reports[r][0] for r in range(comm.world)}
        choice = P.choose_step([inv for _, inv in reports], storage_step)
        if choice is None:
            return None
        step, sid = choice
        holders: Dict[str, List[int]] = {}
        sizes: Dict[str, int] = {}
        for r, (_, inv) in enumerate(reports):
            entry = inv.get(step)
            if entry is None or entry[0] != sid:
                continue
            sizes.update(entry[1])
            for rel in entry[2]:
                holders.setdefault(rel, []).append(r)
        own_dir = store.step_dir(self.dir, step)
        own_entry = mine.get(step, ("", {}, set()))
        own_held = own_entry[2] if own_entry[0] == sid else set()
        stage = store.staging_dir(self.dir, self.root, comm.rank)  # no early return: every rank takes part in the fetches
        st = Storage(stage, storage_options=store.PRIVATE)
        stats: Dict[str, Any] = {"step": step, "local_bytes": 0, "peer_bytes": 0, "damaged": [], "seconds": {}}
        t0 = time.perf_counter()

        def lap(what: str) -> None:
            nonlocal t0
            now = time.perf_counter()
            stats["seconds"][what] = round(now - t0, 4)
            t0 = now

        ctx = _Fetch(self, comm, process_group, step, own_dir, own_held, stage, holders, sizes, node_of, stats)
        try:
            manifest: List[Any] = [None]

            def check_manifest(rel: str) -> Optional[str]:
                try:
                    m = open_manifest(st, chunks=False)
                except Exception as e:
                    return f"{type(e).__name__}: {e}"
                if m.save_id != sid:
                    return f"save id {m.save_id}, expected {sid}"
                manifest[0] = m
                return None

            if not ctx.fetch([MANIFEST_NAME], check_manifest):
                return None
            m = manifest[0]
            lap("manifest")
            if not ctx.fetch(sorted(m.indexes), lambda rel: store.check_file(st, m, rel, None)):
                return None
            lap("indexes")
            # A data file's chunks (with block CRCs) are in its writer's index:
            # only the indexes of the files this rank uses are parsed.
            cache = MetaCache()
            index_ranks = {rel: im.rank for rel, im in m.indexes.items()}

            def data_chunks(rel: str) -> list:
                keys = _read_index(m, st, P.writer_of(rel, index_ranks), cache)["keys"]
                return [(name, c) for name, c in keys.values() if c.file == rel]

            need = _needed_data_files(state, st, comm, m, load_kw)
            lap("plan")
            if not ctx.fetch(sorted(need), lambda rel: store.check_file(st, m, rel, data_chunks(rel))):
                return None
            lap("data")
            try:
                load(stage)
            except CorruptCheckpointError as e:
                # Verified above, so this is not a damaged copy: say so, and let storage have its turn.
                log.warning("shardckpt: memory tier: loading step %d from memory failed (%s: %s); restoring from storage", step, type(e).__name__, e)
                return None
            lap("load")
            self.last_restore = stats
            log.info(
                "shardckpt: restored step %d from the memory tier: %d bytes from this node, %d from peers%s",
                step, stats["local_bytes"], stats["peer_bytes"],
                f"; damaged copies skipped: {stats['damaged']}" if stats["damaged"] else "",
            )
            return step
        finally:
            shutil.rmtree(stage, ignore_errors=True)

    def close(self) -> None:
        """Remove this root's memory copy from this node (the job is done with it); another root's is never touched."""
        self.snapshots.close()  # unmaps and unlinks this process's slots first, so the directory can go
        store.close_dir(self.dir, root=self.root)


class _Fetch:
    """One restore's fetches: stage files from this node, else from peers, verified, retried past damaged copies."""

    def __init__(self, tier, comm, group, step, own_dir, own_held, stage, holders, sizes, node_of, stats):
        self.tier, self.comm, self.group, self.step = tier, comm, group, step
        self.own_dir, self.own_held, self.stage = own_dir, own_held, stage
        self.holders, self.sizes, self.node_of, self.stats = holders, sizes, node_of, stats
        self.bad: Set[Tuple[str, str]] = set()

    def _link_local(self, rel: str) -> None:
        src, dst = os.path.join(self.own_dir, rel), os.path.join(self.stage, rel)
        os.makedirs(os.path.dirname(dst), mode=0o700, exist_ok=True)
        try:
            os.link(src, dst)  # same filesystem: no copy
        except OSError:
            shutil.copyfile(src, dst)

    def _discard(self, rel: str) -> None:
        try:
            os.remove(os.path.join(self.stage, rel))
        except OSError:
            pass

    def fetch(self, rels: List[str], check: Callable[[str], Optional[str]]) -> bool:
        """Stage ``rels`` (this rank's needs; collective). False on every rank when some file has no good holder."""

        comm, me = self.comm, self.comm.rank
        node = self.node_of[me]
        todo: Set[str] = set()
        found_bad: List[Tuple[str, str]] = []
        for rel in rels:
            if rel in self.own_held:
                self._link_local(rel)
                why = check(rel)
                if why is None:
                    self.stats["local_bytes"] += self.sizes.get(rel, 0)
                    continue
                self._discard(rel)
                log.warning("shardckpt: memory tier: this node's copy of %s (step %d) is damaged: %s; fetching it from another holder", rel, self.step, why)
                self.stats["damaged"].append(f"{node}:{rel}")
                found_bad.append((node, rel))
            todo.add(rel)
        for attempt in range(FETCH_ROUNDS + 1):
            def report(bad: List[Tuple[str, str]] = found_bad) -> Tuple[List[str], List[Tuple[str, str]]]:
                return sorted(todo), bad

            _, reports = agree(comm, report, what=f"restore of step {self.step} from the memory tier", share=lambda v: v, mode=ALL)
            for _, b in reports:
                self.bad.update(tuple(x) for x in b)
            needs = {r: rs for r, (rs, _) in enumerate(reports) if rs}
            if not needs:
                return True
            if attempt == FETCH_ROUNDS:
                log.warning("shardckpt: memory tier: step %d: copies still damaged after %d rounds; restoring from storage", self.step, FETCH_ROUNDS)
                return False
            sends, missing = P.assign_sources(needs, self.holders, self.node_of, self.sizes, self.bad)
            if missing:
                shown = "; ".join(f"rank {r}: {', '.join(v[:3])}" for r, v in sorted(missing.items())[:4])
                log.warning("shardckpt: memory tier: step %d cannot be restored from memory (no good copy of %s); restoring from storage", self.step, shown)
                return False

            def transfer(sends=sends) -> List[str]:
                got, _, nbytes = run_sends(
                    sends, me=me, group_ranks=comm.ranks, group=self.group, sizes=self.sizes,
                    src_path=lambda f: os.path.join(self.own_dir, f), dst_path=lambda f: os.path.join(self.stage, f),
                )
                self.stats["peer_bytes"] += nbytes
                return got

            got, _ = agree(comm, transfer, what=f"restore of step {self.step} from the memory tier: peer transfers")
            source = {rel: src for src, dst, rel in sends if dst == me}
            found_bad = []
            for rel in got:
                why = check(rel)
                if why is None:
                    todo.discard(rel)
                    continue
                self._discard(rel)
                holder = self.node_of[source[rel]]
                log.warning("shardckpt: memory tier: the copy of %s (step %d) from rank %d (%s) is damaged: %s; trying the next holder",
                            rel, self.step, source[rel], holder, why)
                self.stats["damaged"].append(f"{holder}:{rel}")
                found_bad.append((holder, rel))
        return False  # not reached: the last round returns above


def _needed_data_files(state, st: Storage, comm: Comm, manifest, load_kw: Dict[str, Any]) -> Set[str]:
    """The data files this rank's load of the staged step reads (the load's own plan); all of them when it cannot tell."""
    data = set(manifest.data_files)
    if load_kw.get("keys") is not None or load_kw.get("key_map") is not None:
        return data
    try:
        m = with_aliases(open_manifest(st, chunks=False))
        plan = _plan_load(state, m, strict=False, rank=comm.rank, world=comm.world, local_only=comm.no_dist, storage=st,
                          cast=load_kw.get("cast", True))
        return set(_needed_files(plan)) & data
    except Exception as e:  # the load itself reports what is wrong; stage everything for it
        log.debug("shardckpt: memory tier: cannot plan the load (%s: %s); staging every data file", type(e).__name__, e)
        return data

