"""A held restore: load one save of a step whose files lie spread over the ranks' nodes, each file read where it is held.

The mechanism both node-held sources restore with (``_managed/restore.py``'s
sources): the memory tier (``_memory/restore.MemorySource``: each
node's shared-memory copy) and per-node ``local=`` directories
(``_flush.restore_local_held``: each node's own disk). The caller says what
each node holds (a :class:`Held`, agreed by every rank); :func:`restore_held`
then

1. *metadata*: each rank stages, in a private directory of its node, hard
   links to every file its node holds of that step (no copy) and, from other
   holders, the manifest and index files its node lacks (small, whole files,
   verified: ``_memory/transfer.run_sends``);
2. *load*: ``_load.load_into`` (the one load) over the staged directory, with
   ``_replicas.Sources`` naming which ranks' nodes hold each data file: a rank
   reads the ranges it needs from its own node (verified block by block) and
   receives the others from a rank whose node holds them, in pipelined rounds;
3. *damage*: a block failing its CRC-32C names its copy (node, file); every
   rank learns it and the stream runs again with that copy excluded (logged).
   With no good copy of a needed file left it returns None: the caller's next
   source restores (and overwrites every tensor).

Limits: the manifest and index files travel whole (a few KB to MB); with
``keys=``/``key_map=`` the load still reads only what it needs.
"""

from __future__ import annotations

import dataclasses
import logging
import os
import shutil
import time
from typing import Any, Callable, Dict, List, Optional, Set, Tuple

from .._collective import ALL, Comm, agree
from .._format import DATA_SUFFIX, MANIFEST_NAME, open_manifest
from .._format._v2 import read_index
from .._format.resolve import MetaCache, resolve_chunks
from .._load import LoadPlan, load_into
from .._memory import plan as P
from .._memory import store
from .._memory.transfer import run_sends
from .._readers import ReadStats, read_verified
from .._replicas import Sources
from .._storage import Storage
from .._verify import check_file
from ..errors import CheckpointError, ChecksumMismatchError, CorruptCheckpointError

__all__ = ["restore_held", "Held", "load_comm", "FETCH_ROUNDS"]

log = logging.getLogger("shardckpt")

#: Rounds of a fetch or stream: each round retries what a damaged copy spoiled from the next holder.
FETCH_ROUNDS = 4

#: ``restore(**load_kw)`` options that are the load's (``collective_timeout_s`` is the comm's).
_LOAD_OPTIONS = ("strict", "io_threads", "keys", "key_map", "atomic", "buffer_bytes", "cast")


def load_comm(comm: Comm, load_kw: Dict[str, Any]) -> Optional[Comm]:
    """The comm a held restore runs on (``collective_timeout_s`` applied); None when ``load_kw`` has options only the storage load knows.

    Every rank gets the same answer (the options are the same on every rank).
    """
    unknown = sorted(set(load_kw) - set(_LOAD_OPTIONS) - {"collective_timeout_s", "storage_options"})
    if unknown:
        return None  # the storage load's error (or result) is the user's answer
    if load_kw.get("collective_timeout_s") is not None:
        comm = dataclasses.replace(comm, timeout_s=float(load_kw["collective_timeout_s"]))
    return comm


@dataclasses.dataclass
class Held:
    """One save of a step as the ranks' nodes hold it (a held restore's input; every rank's the same but the last two).

    Attributes:
        step, save_id: the step and the save (its manifest's id) restored.
        holders: file -> the ranks whose node holds it (the manifest and
            index files too); every file of the manifest has one.
        sizes: file -> bytes (the manifest's own included).
        node_of: rank -> its node's key (a node is one copy of a file).
        own_dir: this rank's node's directory of the step.
        own_held: the files of ``own_dir`` at the right size (unverified yet).
    """

    step: int
    save_id: str
    holders: Dict[str, List[int]]
    sizes: Dict[str, int]
    node_of: Dict[int, Any]
    own_dir: str
    own_held: Set[str]


def restore_held(
    state: Dict[str, Any],
    held: Held,
    comm: Comm,
    *,
    stage: str,
    process_group: Any,
    load_kw: Dict[str, Any],
    stats: Dict[str, Any],
    label: str,
) -> Optional[int]:
    """Load one save of a step whose files lie spread over the ranks' nodes (collective): each file read where it is held.

    Every rank stages, in ``stage`` (its own private directory, on the
    filesystem of ``held.own_dir``: hard links, no copies), its node's
    files of the step, and fetches whole from other holders the manifest
    and index files its node lacks (verified); then ``_load.load_into``
    streams the data with ``_replicas.Sources`` naming each data file's
    holders: a rank reads (verified, block CRCs) the ranges it needs from
    its node and receives the others from a holder rank. A damaged copy is
    skipped for the next holder (logged); no good copy left: None.

    Args:
        state: the live state, loaded in place.
        held: what the nodes hold (the caller's inventory, agreed).
        comm: the ranks (:func:`load_comm`'s).
        stage: an empty private directory; the caller removes it afterwards.
        process_group: the bytes travel over it.
        load_kw: the load options (:func:`load_comm` accepted them).
        stats: filled in: ``local_bytes`` (read from this node: its own
            ranges and those it only sends), ``verified_bytes`` (CRC-checked
            here: its reads and what it received unchecked), ``peer_bytes``
            (data received), ``sent_bytes``, ``meta_bytes`` (manifest and
            index files received), ``needed_bytes`` (its load's ranges),
            ``damaged`` copies, ``seconds`` per phase (``metadata``: the
            manifest and index files staged; ``load``: the load, of which
            ``stream``: the bytes read, received, checked and placed).
        label: the tier in log messages (``"memory tier"``).

    Returns:
        ``held.step``, or None: some file has no good copy (logged; the
        caller restores from its fallback, which overwrites every value).

    Raises:
        LoadFailedError: a rank died or hung (named), as any load.
        StateMismatchError, UsageError: as ``shardckpt.load``.

    Example:
        >>> restore_held(state, held, comm, stage=d, process_group=None, load_kw={}, stats={}, label="local")  # doctest: +SKIP
    """
    step, sid, holders, sizes = held.step, held.save_id, held.holders, held.sizes
    node_of, own_held = held.node_of, held.own_held
    st = Storage(stage, storage_options=store.PRIVATE)
    stats.update({
        "step": step, "local_bytes": 0, "peer_bytes": 0, "meta_bytes": 0, "sent_bytes": 0, "needed_bytes": 0,
        "verified_bytes": 0, "damaged": [], "seconds": {},
    })
    t0 = time.perf_counter()

    def lap(what: str) -> None:
        nonlocal t0
        now = time.perf_counter()
        stats["seconds"][what] = round(now - t0, 4)
        t0 = now

    ctx = _Fetch(comm, process_group, held, stage, stats, label)
    manifest: List[Any] = [None]

    def check_manifest(rel: str) -> Optional[str]:
        try:
            m = open_manifest(st, chunks=False)
        except Exception as e:  # noqa: BLE001 - any failure is a damaged copy
            return f"{type(e).__name__}: {e}"
        if m.save_id != sid:
            return f"save id {m.save_id}, expected {sid}"
        manifest[0] = m
        return None

    def check_meta(rel: str) -> Optional[str]:
        if rel == MANIFEST_NAME:
            return check_manifest(rel)
        if manifest[0] is None:  # checked after the manifest; without a good one here, fetched with it
            return "no manifest to check it against on this node"
        return check_file(st, manifest[0], rel, None)

    # The manifest and the index files in one fetch (their names are in
    # every inventory): the manifest is checked first, the indexes against it.
    index_files = sorted(rel for rel in sizes if rel != MANIFEST_NAME and not rel.endswith(DATA_SUFFIX))
    if not ctx.fetch([MANIFEST_NAME] + index_files, check_meta):
        return None
    m = manifest[0]
    lap("metadata")
    data = set(m.data_files)
    for rel in sorted(own_held & data):
        ctx.link_local(rel)  # verified as it is read, block by block: no pass of its own
    bad: Set[Tuple[str, str]] = set(ctx.bad)

    def hook(plan: LoadPlan, run: Callable[..., ReadStats]) -> ReadStats:
        # Ranges this rank reads only to send are found in the index files
        # through the plan's own metadata cache (nothing parsed twice).
        chunks = _ChunkIndex(m, st, plan.cache)

        def sources(found: List[Tuple[Any, str]]) -> Sources:
            return Sources(
                readers={rel: [r for r in holders.get(rel, ()) if (node_of[r], rel) not in bad] for rel in data},
                chunk_of=chunks.chunk_of,
                # A range read only to send (a lost node's shard) is checked on arrival: the sender's copy is damaged.
                on_damage=lambda rel, sender: found.append((node_of[sender], rel)),
            )

        for attempt in range(FETCH_ROUNDS + 1):
            found: List[Tuple[Any, str]] = []  # (node, file): copies found damaged by this rank, read here or received

            def read(storage, wants, deliver, found=found, **kw):
                def damaged(unit, crc):
                    found.append((node_of[comm.rank], unit.chunk.file))
                    raise ChecksumMismatchError(
                        f"checksum mismatch in {storage.url_of(unit.chunk.file)} ({label} copy of step {step}): "
                        f"{unit.label} (bytes {unit.start}..{unit.stop})"
                    )

                return read_verified(storage, wants, deliver, on_mismatch=damaged, **kw)

            got = ReadStats()
            failure: Optional[str] = None
            t_stream = time.perf_counter()
            try:
                run(sources=sources(found), read=read, stats=got)
            except (CheckpointError, ValueError) as e:
                failure = f"{type(e).__name__}: {e}"
            stats["seconds"]["stream"] = round(stats["seconds"].get("stream", 0.0) + time.perf_counter() - t_stream, 4)
            stats["local_bytes"] += got.read_bytes
            stats["peer_bytes"] += got.received_bytes
            stats["sent_bytes"] += got.sent_bytes
            stats["verified_bytes"] += got.verified_bytes
            stats["needed_bytes"] = got.needed_bytes
            if failure is None:
                # With sources (several ranks) every failure is raised on
                # every rank: none here means none anywhere.
                return got
            _, outcomes = agree(
                comm, lambda found=found, failure=failure: (sorted(set(found)), failure),  # type: ignore[misc]
                what=f"restore of step {step} from the {label}", share=lambda v: v, mode=ALL,
            )
            newly = [tuple(nr) for pairs, _ in outcomes for nr in pairs]
            if not newly or attempt == FETCH_ROUNDS:
                why = next(f for _, f in outcomes if f is not None)
                raise CorruptCheckpointError(f"the {label} copies of step {step} cannot be read: {why}")
            for node, rel in newly:
                if (node, rel) not in bad:
                    bad.add((node, rel))
                    stats["damaged"].append(f"{node}:{rel}")
                    others = [node_of[r] for r in holders.get(rel, ()) if (node_of[r], rel) not in bad]
                    log.warning(
                        "shardckpt: %s: the copy of %s (step %d) on %s is damaged; %s", label, rel, step, node,
                        f"reading it from {sorted(set(others))[0]}" if others else "no other copy: restoring from storage",
                    )
            # A file some rank needs with no good copy left: the next run's
            # plan fails alike on every rank (ValueError) and storage takes over.
        raise CorruptCheckpointError(f"step {step}: {label} copies still damaged after {FETCH_ROUNDS} rounds")  # not reached

    opts = {k: load_kw[k] for k in _LOAD_OPTIONS if k in load_kw}
    try:
        load_into(state, st, comm=comm, process_group=process_group, held=lambda rel: rel in own_held, stream=hook,
                  opened=m, **opts)
    except CorruptCheckpointError as e:
        # The load's own checks passed on every rank: the copies are the
        # problem. Storage has its turn (it overwrites every tensor).
        log.warning("shardckpt: %s: restoring step %d from it failed (%s); restoring from storage", label, step, e)
        return None
    lap("load")
    log.info(
        "shardckpt: restored step %d from the %s: %d bytes read from this node, %d received from peers "
        "(%d needed), %d sent, %d verified; seconds %s%s",
        step, label, stats["local_bytes"], stats["peer_bytes"], stats["needed_bytes"], stats["sent_bytes"],
        stats["verified_bytes"], stats["seconds"],
        f"; damaged copies skipped: {stats['damaged']}" if stats["damaged"] else "",
    )
    return step


class _ChunkIndex:
    """``(file, byte offset) -> Chunk`` from the writers' index files, parsed on first use (a rank reading only to send)."""

    def __init__(self, manifest: Any, storage: Storage, cache: MetaCache):
        self.m, self.st = manifest, storage
        self.cache = cache
        self.index_ranks = {rel: im.rank for rel, im in manifest.indexes.items()}
        self.by_file: Dict[str, Dict[int, Any]] = {}  # (name, ChunkMeta) until resolved, then the Chunk

    def chunk_of(self, rel: str, byte_offset: int) -> Any:
        if rel not in self.by_file:
            keys = read_index(self.m, self.st, P.writer_of(rel, self.index_ranks), self.cache)["keys"]
            for name, c in keys.values():
                self.by_file.setdefault(c.file, {})[c.byte_offset] = (name, c)
        try:
            got = self.by_file[rel][byte_offset]
        except KeyError:
            raise CorruptCheckpointError(f"{rel}: no chunk at byte {byte_offset} in its index") from None
        if type(got) is tuple:  # (name, ChunkMeta) until resolved once, as the load resolves it (a Chunk is a NamedTuple)
            name, meta = got
            found = [c for c in resolve_chunks(self.m, self.st, name, [(meta.offsets, meta.sizes)], cache=self.cache)
                     if c.file == rel and c.byte_offset == byte_offset]
            if not found:
                raise CorruptCheckpointError(f"{rel}: the chunk of {name} at byte {byte_offset} does not resolve")
            got = self.by_file[rel][byte_offset] = found[0]
        return got


class _Fetch:
    """One restore's whole-file fetches (manifest, index files): from this node, else from peers, verified."""

    def __init__(self, comm, group, held: Held, stage, stats, label):
        self.comm, self.group, self.step = comm, group, held.step
        self.own_dir, self.own_held, self.stage = held.own_dir, held.own_held, stage
        self.holders, self.sizes, self.node_of, self.stats = held.holders, held.sizes, held.node_of, stats
        self.label = label
        self.bad: Set[Tuple[str, str]] = set()

    def link_local(self, rel: str) -> None:
        """Stage this node's copy of ``rel`` (a hard link: same filesystem, no copy)."""
        src, dst = os.path.join(self.own_dir, rel), os.path.join(self.stage, rel)
        os.makedirs(os.path.dirname(dst), mode=0o700, exist_ok=True)
        try:
            os.link(src, dst, follow_symlinks=False)
        except OSError:
            shutil.copyfile(src, dst, follow_symlinks=False)

    def _discard(self, rel: str) -> None:
        try:
            os.remove(os.path.join(self.stage, rel))
        except OSError:
            pass

    def fetch(self, rels: List[str], check: Callable[[str], Optional[str]]) -> bool:
        """Stage ``rels`` (every rank's list is the same; collective). False on every rank when some file has no good holder."""
        comm, me = self.comm, self.comm.rank
        node = self.node_of[me]
        todo: Set[str] = set()
        found_bad: List[Tuple[str, str]] = []
        for rel in rels:
            if rel in self.own_held:
                self.link_local(rel)
                why = check(rel)
                if why is None:
                    continue
                self._discard(rel)
                if why.startswith("no manifest"):
                    todo.add(rel)  # not damaged: fetched with the manifest, checked then
                    continue
                log.warning("shardckpt: %s: this node's copy of %s (step %d) is damaged: %s; fetching it from another holder", self.label, rel, self.step, why)
                self.stats["damaged"].append(f"{node}:{rel}")
                found_bad.append((node, rel))
            todo.add(rel)
        # Round 0's needs come from the inventories (what each node holds), so
        # its transfer needs no exchange of its own; damage found here or in
        # what arrives is shared by the transfer's agreement and joins the next round.
        needs: Dict[int, List[str]] = {}
        for r in range(comm.world):
            lacks = [rel for rel in rels if r not in self.holders.get(rel, ())]
            if lacks:
                needs[r] = lacks
        for attempt in range(FETCH_ROUNDS + 1):
            if attempt == FETCH_ROUNDS:
                log.warning("shardckpt: %s: step %d: copies still damaged after %d rounds; restoring from storage", self.label, self.step, FETCH_ROUNDS)
                return False
            sends, missing = P.assign_sources(needs, self.holders, self.node_of, self.sizes, self.bad)
            if missing:
                shown = "; ".join(f"rank {r}: {', '.join(v[:3])}" for r, v in sorted(missing.items())[:4])
                log.warning("shardckpt: %s: step %d cannot be restored from it (no good copy of %s); restoring from storage", self.label, self.step, shown)
                return False

            def transfer(sends=sends, bad=found_bad) -> Tuple[List[str], List[Tuple[str, str]]]:
                got, _, nbytes = run_sends(
                    sends, me=me, group_ranks=comm.ranks, group=self.group, sizes=self.sizes, comm=comm,
                    src_path=lambda f: os.path.join(self.own_dir, f), dst_path=lambda f: os.path.join(self.stage, f),
                )
                self.stats["meta_bytes"] += nbytes
                source = {rel: src for src, dst, rel in sends if dst == me}
                for rel in sorted(got, key=lambda f: f != MANIFEST_NAME):  # the manifest first: the others are checked against it
                    why = check(rel)
                    if why is None:
                        todo.discard(rel)
                        continue
                    self._discard(rel)
                    holder = self.node_of[source[rel]]
                    log.warning("shardckpt: %s: the copy of %s (step %d) from rank %d (%s) is damaged: %s; trying the next holder",
                                self.label, rel, self.step, source[rel], holder, why)
                    self.stats["damaged"].append(f"{holder}:{rel}")
                    bad.append((holder, rel))
                return sorted(todo), list(bad)

            _, reports = agree(comm, transfer, what=f"restore of step {self.step} from the {self.label}: metadata transfers",
                               share=lambda v: v, mode=ALL)
            found_bad = []
            for _, b in reports:
                self.bad.update(tuple(x) for x in b)
            needs = {r: rs for r, (rs, _) in enumerate(reports) if rs}
            if not needs:
                return True
        return False  # not reached: the last round returns above
