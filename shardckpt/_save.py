"""save: plan, write, commit.

Save (collective when a process group exists):
  1. flatten the state into named tensors and a JSON tree (``_state``);
  2. compute every own tensor's boxes and whether this rank writes them
     (``_geometry``), alone, as if every rank held the same names;
  3. the first exchange (``_union``, ``distinct`` mode): rank 0 receives one
     copy of each distinct (tensor records, value tree), checks and merges
     them (a rank-union: each tensor is written by the ranks that hold it),
     and each group of ranks gets back the corrections to step 2's plan
     (none when every rank holds the same names);
  4. rank 0 checks the target and shares a fresh save id;
  5. each rank writes its boxes to its own files, checksumming as it writes;
  6. a small summary per rank goes to rank 0, which validates coverage and
     writes ``manifest.json`` last, atomically — that is the commit;
  7. every rank returns or raises together.

Every exchange (3, 4, 6, 7) is one ``_collective.agree``: bounded by
``collective_timeout_s``, the same error on every rank, O(1) store round
trips per peer. Plans are frozen:
``prepare_save`` -> ``stage_save`` (async) -> ``execute_save`` each take a
plan and build new objects, never change one.
"""

from __future__ import annotations

import copy as _copy
import errno
import json
import logging
import math
import uuid
from dataclasses import dataclass, field, replace
from types import MappingProxyType
from typing import TYPE_CHECKING, Any, Callable, Dict, FrozenSet, List, Mapping, Optional, Sequence, Tuple, Union, cast

import torch

from . import _fingerprint, _geometry, _incremental, _knobs, _union
from ._collective import DISTINCT, FROM_ROOT, TO_ROOT, Comm, agree, open_comm
from ._format import (
    DATA_DIR,
    MANIFEST_NAME,
    ChunkMeta,
    FileMeta,
    Manifest,
    TensorMeta,
    chunk_key,
    commit,
    index_file_name,
    itemsize,
    rank_file_name,
    torch_dtype,
)
from ._format._v2 import index_bytes
from ._format.build import RankOutput, build_manifest
from ._format.checksum import crc32c, default_hash_algo
from ._format.manifest import paused_gc
from ._format.refs import follow
from ._io import WriteItem, partition, write_files
from ._layout import TensorLayout, layout_of
from ._state import flatten_for_save
from ._storage import Storage, open_storage
from .errors import (
    CheckpointError,
    CheckpointExistsError,
    SaveFailedError,
    StorageError,
    UnsupportedStateError,
)

if TYPE_CHECKING:  # pragma: no cover
    from torch.distributed import ProcessGroup

__all__ = ["save", "SavePlan", "prepare_save", "stage_save", "execute_save", "DATA_DIR"]


log = logging.getLogger("shardckpt")

#: Bound of the manifest read that tells a peer whether rank 0 committed.
MANIFEST_PEEK_BYTES = 1 << 30

#: What a save of an existing checkpoint says to do, unless the caller has its own switch.
OVERWRITE_HINT = "pass overwrite=True to replace it"


def _layouts(tensors: Dict[str, Any], rank: int, world: int, local_only: bool = False) -> Dict[str, TensorLayout]:
    return {
        name: layout_of(name, tensors[name], rank=rank, world_size=world, local_only=local_only) for name in sorted(tensors)
    }


#: Writer rotations of the last save's regular tensors, keyed by their
#: (name, layout, itemsize) signature: a manager's repeated saves of the same
#: model plan once.
_ROTATIONS: Dict[Any, Dict[str, int]] = {}


def _rotations(layouts: Dict[str, TensorLayout]) -> Dict[str, int]:
    sig = tuple((n, lay.regular, itemsize(lay.dtype)) for n, lay in layouts.items() if lay.regular is not None)
    got = _ROTATIONS.get(sig)
    if got is None:
        got = _geometry.writer_rotations(list(sig))
        _ROTATIONS.clear()
        _ROTATIONS[sig] = got
    return got


def _write_plan(layouts: Dict[str, TensorLayout], rank: int) -> List[WriteItem]:
    """This rank's chunks to write: one writer per distinct box, bytes balanced.

    Regular tensors (DTensors, replicated plain tensors): ``_geometry.is_writer``
    from the tensor's layout, this rank's coordinate and the writer rotation,
    O(own boxes) per tensor whatever the world size. Replicas of a box take
    the tensors round-robin, largest first (``_geometry.writer_rotations``).
    Irregular tensors (ShardedTensor, per-rank data): greedy
    ``assign_writers`` over their boxes.
    """
    rotations = _rotations(layouts)
    items = []
    writers = {}
    for name, lay in layouts.items():
        if lay.regular is None:
            for box in sorted(lay.holders, key=lambda b: b.offsets):
                if len(lay.holders[box]) == 1:  # per-rank data: its one holder writes it
                    writers[(name, box)] = lay.holders[box][0]
                else:
                    items.append(((name, box), box.numel * itemsize(lay.dtype), lay.holders[box]))
    writers.update(cast(Any, _geometry.assign_writers(items)) if items else {})
    mine: List[WriteItem] = []
    seen = set()
    for name, lay in layouts.items():
        if lay.regular is not None:
            rot = lay.rotation if lay.rotation is not None else rotations[name]
            if not lay.parts or not _geometry.is_writer(lay.regular, rot, cast(Tuple[int, ...], lay.coord)):
                continue
        for part in lay.parts:
            key = (name, part.box)
            if key in seen or (lay.regular is None and writers.get(key) != rank):
                continue
            seen.add(key)
            whole = part.box.sizes == lay.shape
            mine.append(
                WriteItem(
                    name=name,
                    key=chunk_key(name, part.box.offsets, whole),
                    dtype=lay.dtype,
                    offsets=part.box.offsets,
                    sizes=part.box.sizes,
                    tensor=part.view(),
                )
            )
    return mine


def save(
    state: Dict[str, Any],
    url: Union[str, Storage],
    *,
    storage_options: Optional[Dict[str, Any]] = None,
    process_group: Optional["ProcessGroup"] = None,
    overwrite: bool = False,
    io_threads: Optional[int] = None,
    collective_timeout_s: Optional[float] = None,
    no_dist: bool = False,
    incremental: Optional[str] = None,
    content_hash: bool = False,
    replicas: Optional[str] = None,
) -> None:
    """Save ``state`` to ``url`` as a sharded, checksummed checkpoint.

    Collective when a process group is initialized: every rank of
    ``process_group`` must call it (for one process alone, e.g. an export on
    rank 0, pass ``no_dist=True``). Ranks may hold different names (pipeline
    stages): the checkpoint holds the union, each tensor written by the
    ranks that hold it; a name held by several ranks must agree in dtype,
    shape and placements, a plain value held by several ranks must be equal.
    Each rank writes only the boxes it is assigned (replicated data once,
    balanced across replicas); rank 0 commits by writing ``manifest.json``
    last.

    Args:
        state: dict of tensors, DTensors, ``nn.Module``s, objects with
            ``state_dict()``/``load_state_dict()``, and JSON-able values
            (nested dicts/lists of those too).
        url: a local directory or any fsspec URL (``s3://b/run/step-1``),
            or a :class:`Storage` object (then no ``storage_options``).
        storage_options: passed to fsspec (credentials, endpoint_url...).
        process_group: group to save over (default: the world).
        overwrite: replace a committed checkpoint at ``url``. The old one stays
            intact and loadable until the new manifest lands.
        io_threads: parallel writers per rank.
        collective_timeout_s: bound of every exchange between ranks (default
            ``SHARDCKPT_COLLECTIVE_TIMEOUT_S``, 1800 s): a rank that does not
            call within it is named and the others raise. Must exceed the
            longest write of one rank's shard.
        no_dist: this process alone, as if no process group existed (world
            size 1); every tensor must be whole here (plain tensors, or
            DTensors on a one-rank mesh), a sharded one is refused.
        incremental: an earlier committed checkpoint next to ``url`` (same
            parent directory; its URL or its directory name). A chunk whose
            bytes (content hash), dtype, global shape and box equal one of
            it is not written: the new checkpoint references that one's
            file (format v4, ``@<dir>/<path>``). Every reader follows the
            references; the checkpoint is only whole while the files it
            references exist (``CheckpointManager(incremental=True)``'s
            retention keeps them; ``converters.consolidate`` makes a copy
            without references). Implies ``content_hash``.
        content_hash: record a content hash (BLAKE3) of every chunk, so that
            a later ``incremental`` save can reference this one (a base
            saved without hashes is compared with nothing: everything is
            written again). Off by default: hashing runs in the write pass
            and costs CPU time (docs/incremental.md has the numbers).
        replicas: what to do when the copies of replicated state (DDP and
            HSDP replicas, tensors replicated over a TP group, the scalars
            every rank holds) differ between ranks: ``"warn"`` (the
            default, ``SHARDCKPT_REPLICAS``) logs each diverged chunk on
            rank 0 and saves the writing replica's copy, ``"check"``
            refuses the save before any byte is written, ``"off"`` skips
            the check.
            Each holder fingerprints its copy where it lives (on the GPU
            for GPU tensors); docs/guarantees.md says what it catches.

    Raises:
        CheckpointExistsError: ``url`` holds a committed checkpoint and
            ``overwrite`` is False.
        UnsupportedStateError: a value cannot be saved (its path is named);
            a name held by several ranks differs in dtype, shape or
            placements, or a plain value differs (named, with the ranks).
        ReplicaDivergenceError: ``replicas="check"`` and copies of a
            replicated chunk differ (each named, with the ranks holding each
            version); nothing was written.
        SaveFailedError: writing failed on some rank, or a rank did not call
            within ``collective_timeout_s`` (named); nothing was committed,
            any previous checkpoint at ``url`` is untouched.
        UsageError: under torchrun (``WORLD_SIZE`` > 1) with no process group
            initialised and no ``no_dist=True``.

    Plain (non-distributed) tensors held by several ranks are assumed to be
    identical on them, as with DDP, and written once. A save over a
    sub-group records its meshes in the group's rank numbering.

    Example:
        >>> import torch, shardckpt, tempfile
        >>> d = tempfile.mkdtemp()
        >>> shardckpt.save({"w": torch.ones(2, 3), "step": 7}, d)
        >>> state = {"w": torch.zeros(2, 3), "step": 0}
        >>> _ = shardckpt.load(state, d)
        >>> state["step"], state["w"].sum().item()
        (7, 6.0)
    """
    comm = open_comm(process_group, no_dist=no_dist, collective_timeout_s=collective_timeout_s, op="shardckpt.save")
    plan = prepare_save(state, url, comm=comm, storage_options=storage_options, overwrite=overwrite, io_threads=io_threads,
                        incremental=incremental, content_hash=content_hash, replicas=replicas)
    execute_save(plan)


@dataclass(frozen=True)
class SavePlan:
    """A save split from its I/O: what this rank writes, ready to execute.

    ``prepare_save`` builds it (collective: ranks agree the state is valid);
    ``stage_save`` returns a copy whose tensors are private (async save);
    ``execute_save`` writes and commits (collective). Never changed in place.
    """

    storage: Storage
    comm: Comm
    tree: Any
    layouts: Mapping[str, TensorLayout]
    items: Tuple[WriteItem, ...]
    overwrite: bool = False
    io_threads: int = field(default_factory=lambda: _knobs.IO_THREADS)
    extra: Mapping[str, Any] = field(default_factory=lambda: MappingProxyType({}))
    per_rank: Any = None  # this rank's per-rank JSON values, gathered at commit
    #: Said when the target is committed and ``overwrite`` is False: the
    #: switch of the call the user made (the manager's is ``force=True``).
    exists_hint: str = OVERWRITE_HINT
    #: Stand-in for ``_io.write_files`` (same signature): the async save's
    #: writer process (``_writerproc``). None: this process writes.
    writer: Optional[Callable[..., Any]] = None
    #: This rank's per-rank tensors: name -> (dtype, shape), told to rank 0 at commit.
    per_rank_specs: Mapping[str, Any] = field(default_factory=lambda: MappingProxyType({}))
    #: Directory name of the earlier checkpoint (a sibling) whose chunks this
    #: save references instead of rewriting (``_incremental``); None: write all.
    incremental: Optional[str] = None
    #: Content hash algorithm of this save's chunks (``_io.write_files``'s
    #: ``hash_algo``): "" hashes nothing (the default: it costs CPU time).
    hash_algo: str = ""
    #: False for the memory tier: each rank writes on its own host, so rank 0's
    #: commit cannot see the other hosts' files (``commit(files_here=False)``).
    files_here: bool = True
    #: With ``overwrite``: files of the replaced checkpoint that other
    #: checkpoints reference, left in place by the replacing commit (the
    #: manager's ``force`` re-save of a step later incremental steps read);
    #: None: leave every file of the replaced checkpoint (``cleanup()``
    #: removes those no kept step names).
    keep_files: Optional[FrozenSet[str]] = frozenset()

    @property
    def rank(self) -> int:
        return self.comm.rank

    @property
    def world(self) -> int:
        return self.comm.world


#: The one key of a safetensors header that is not a tensor.
RESERVED_TENSOR_NAME = "__metadata__"


def prepare_save(
    state: Dict[str, Any],
    url: Union[str, Storage],
    *,
    comm: Comm,
    storage_options: Optional[Dict[str, Any]] = None,
    overwrite: bool = False,
    io_threads: Optional[int] = None,
    extra: Optional[Mapping[str, Any]] = None,
    exists_hint: str = OVERWRITE_HINT,
    incremental: Optional[str] = None,
    content_hash: bool = False,
    replicas: Optional[str] = None,
) -> SavePlan:
    """Flatten and plan a save; every rank learns whether any rank's state is invalid (collective).

    ``extra`` goes into the manifest's ``extra`` (the manager's step).
    ``content_hash`` (implied by ``incremental``): hash every chunk written.
    ``replicas``: the replica check's mode (``_fingerprint``), run here,
    before anything is staged or written.
    """
    mode = _fingerprint.replicas_mode(replicas)
    rank, world = comm.rank, comm.world
    storage = open_storage(url, storage_options=storage_options)
    url = storage.url
    base = None
    if incremental:
        base = _incremental.base_name(storage.url, incremental)
        storage = follow(storage)  # the commit checks the referenced files' sizes

    # Validate the state on every rank before any other exchange, so a bad
    # state raises everywhere instead of leaving peers waiting.
    def local():
        flat = flatten_for_save(state, rank=rank, world=world)
        if RESERVED_TENSOR_NAME in flat.tensors:
            raise UnsupportedStateError(
                f"a tensor named {RESERVED_TENSOR_NAME!r} cannot be saved: safetensors reserves that key for a file's "
                "metadata, so the data file would be unreadable by safetensors; rename it or nest it under another key"
            )
        layouts = _union.normalize(_layouts(flat.tensors, rank, world, local_only=comm.no_dist), comm.ranks)
        own, layouts = _own_tensors(layouts, flat.per_rank_tensors, rank)
        return flat, layouts, own

    # Rank-union: each rank sends a hash of its tensor records and value tree;
    # rank 0 gets one full copy per distinct hash (a handful: one per pipeline
    # stage or sub-mesh copy), checks that shared names agree, merges, and
    # returns to each group only the corrections to its local plan.
    union: Dict[str, Any] = {}

    def decide(groups):
        return _union.decide(groups, comm.ranks, url, union)

    if world == 1:  # one rank holds everything: nothing to merge
        (flat, layouts, own), _ = agree(comm, local, what="save aborted before writing")
    else:
        (flat, layouts, own), (_, fix) = agree(
            comm,
            local,
            what="save aborted before writing",
            share=lambda r: _union.Packed((_union.records(r[1], _rotations(r[1])), r[0].tree)),
            mode=DISTINCT,
            decide=decide,
        )
        layouts = _union.apply(layouts, fix, comm.ranks[rank])
    _fingerprint.check_replicas(comm, layouts, url=url, mode=mode)
    if rank == 0 and world > 1:
        layouts = _union.with_peers(layouts, union)
    tree = union.get("tree", flat.tree) if rank == 0 else flat.tree
    return SavePlan(
        storage=storage,
        comm=comm,
        tree=tree,
        layouts=MappingProxyType(layouts),
        items=tuple(_write_plan(layouts, rank)),
        overwrite=overwrite,
        io_threads=_knobs.IO_THREADS if io_threads is None else io_threads,
        extra=MappingProxyType(dict(extra or {})),
        per_rank=flat.per_rank or None,
        exists_hint=exists_hint,
        per_rank_specs=MappingProxyType(own),
        incremental=base,
        hash_algo=default_hash_algo() if (content_hash or incremental) else "",
    )


def _own_tensors(
    layouts: Dict[str, TensorLayout], names: Sequence[str], rank: int
) -> Tuple[Dict[str, Any], Dict[str, TensorLayout]]:
    """Per-rank tensors: this rank alone holds (and writes) them; their specs for the peers."""
    specs = {}
    out = dict(layouts)
    for n in names:
        lay = layouts[n]
        out[n] = replace(lay, holders={_geometry.Box((0,) * len(lay.shape), tuple(lay.shape)): (rank,)}, regular=None)
        specs[n] = (lay.dtype, list(lay.shape))
    return specs, out


def execute_save(plan: SavePlan) -> None:
    """Write this rank's files, gather chunk metadata, commit on rank 0 (collective).

    Three agreements: rank 0's go (target free, fresh save id:
    :func:`_agree_target`), every rank's write result (to rank 0:
    :func:`_write_own`), rank 0's commit outcome (:func:`_commit_on_root`).
    A failure anywhere raises on every rank, removes this save's data files
    and leaves any previous checkpoint at the URL as it was
    (:func:`_after_failure`).
    """
    storage, comm = plan.storage, plan.comm
    save_id = _agree_target(plan)
    files: Dict[str, Sequence[WriteItem]] = {}  # this rank's data files (filled by _write_own; removed on failure)
    # Rank 0: how far its commit got ("before", "writing", "committed"): the
    # commit point is decided here, once, and the failure branch reads it.
    stage = ["before"]
    try:
        _, gathered = agree(comm, lambda: _write_own(plan, save_id, files), what=f"nothing was committed at {storage.url}",
                            share=lambda v: v, mode=TO_ROOT)
        agree(comm, lambda: _commit_on_root(plan, gathered, save_id, stage), what=f"save to {storage.url} failed")
    except BaseException as e:
        if _after_failure(plan, e, save_id, stage[0], list(files) + [index_file_name(save_id, plan.rank)]):
            return
        raise


def _agree_target(plan: SavePlan) -> str:
    """Rank 0 checks the target is free (or ``overwrite``) and draws the save id; every rank gets it (agreed)."""
    storage = plan.storage

    def check_target() -> Optional[str]:
        if plan.rank != 0:
            return None
        try:
            exists = storage.exists(MANIFEST_NAME)
        except Exception as e:
            raise SaveFailedError(f"cannot check {storage.url}: {type(e).__name__}: {e}") from e
        if exists and not plan.overwrite:
            raise CheckpointExistsError(f"{storage.url_of(MANIFEST_NAME)} already exists; {plan.exists_hint}")
        return uuid.uuid4().hex

    _, save_id = agree(plan.comm, check_target, what=f"save to {storage.url} not started", share=lambda v: v, mode=FROM_ROOT)
    return save_id


@dataclass(frozen=True)
class RankResult:
    """What one rank's write tells rank 0 for the commit (:func:`_write_own` makes it, :func:`_commit` reads it).

    O(own tensors) per rank, none of it per-box for sharded tensors.

    Attributes:
        chunks: the irregular tensors' chunks and whole-tensor chunks (the
            HF index), each ``ChunkMeta.to_json()`` plus its tensor's ``"name"``.
        file_sizes: ``{file: size}`` of the files it wrote and those it references.
        per_rank: its per-rank JSON values (None: none).
        index: its index file ``(path, size, crc32c)``, or None (it wrote no chunk).
        regular_bytes: bytes it wrote of regular tensors (a missing writer shows).
        per_rank_specs: its per-rank tensors, ``name -> (dtype, shape)``.
    """

    chunks: List[Dict[str, Any]]
    file_sizes: Dict[str, int]
    per_rank: Any
    index: Optional[Tuple[str, int, int]]
    regular_bytes: int
    per_rank_specs: Dict[str, Any]

    def to_wire(self) -> Tuple[Any, ...]:
        """The tuple gathered to rank 0 (slot 0 is unused, kept so the wire is unchanged)."""
        return (None, self.chunks, self.file_sizes, self.per_rank, self.index, self.regular_bytes, self.per_rank_specs)

    @classmethod
    def from_wire(cls, raw: Sequence[Any]) -> "RankResult":
        """The inverse of :meth:`to_wire`: the one place the gathered tuple is read."""
        _, chunks, file_sizes, per_rank, index, regular_bytes, per_rank_specs = raw
        return cls(chunks, file_sizes, per_rank, None if index is None else tuple(index), regular_bytes, per_rank_specs)


def _write_own(plan: SavePlan, save_id: str, files: Dict[str, Sequence[WriteItem]]) -> Tuple[Any, ...]:
    """Write this rank's data files and index file (``files`` filled first, so a failure can remove them); what rank 0 needs.

    Rank 0 needs only: the irregular tensors' chunks (to check their tiling
    and name their writers), whole-tensor chunks (the HF index), and the
    bytes written of regular tensors (a missing writer shows): O(own
    tensors) per rank, none of it per-box for sharded tensors.
    """
    storage, rank = plan.storage, plan.rank
    regular = {n for n, lay in plan.layouts.items() if lay.regular is not None}
    items = list(plan.items)
    referenced: List[Tuple[str, ChunkMeta]] = []
    ref_sizes: Dict[str, int] = {}
    if plan.incremental:
        shapes = {n: tuple(lay.shape) for n, lay in plan.layouts.items()}
        items, referenced, ref_sizes = _incremental.match_earlier(storage, plan.incremental, items, shapes)
    groups = partition(items, plan.io_threads)
    files.update({rank_file_name(save_id, rank, i): g for i, g in enumerate(groups)})
    try:
        named, fmetas, index = write_rank(storage, files, save_id, rank, threads=plan.io_threads, writer=plan.writer,
                                          referenced=referenced, hash_algo=plan.hash_algo)
    except OSError as e:
        err = _write_failed(e, storage, f"rank {rank} could not write its files")
        raise err from err.__cause__
    if plan.hash_algo:  # an incremental run's first save too: the next one orders its work by it
        _incremental.note_written(storage, named, referenced)
    return RankResult(
        chunks=[c.to_json() | {"name": n} for n, c in named if n not in regular or c.key == n],
        file_sizes={k: v.size for k, v in fmetas.items()} | ref_sizes,
        per_rank=plan.per_rank,
        index=index,
        regular_bytes=sum(c.nbytes for n, c in named if n in regular),
        per_rank_specs=dict(plan.per_rank_specs),
    ).to_wire()


def _commit_on_root(plan: SavePlan, gathered: Any, save_id: str, stage: List[str]) -> None:
    """Rank 0: build and write the manifest (``_commit``), recording in ``stage`` how far it got; other ranks: nothing.

    A failure after the manifest landed is logged, not raised (the save is
    done); one whose outcome cannot be read back keeps the files.
    """
    if plan.rank != 0:
        return
    storage = plan.storage
    try:
        _commit(plan, [RankResult.from_wire(g) for g in gathered], save_id, progress=lambda s: stage.__setitem__(0, s))
    except Exception as e:
        landed = _commit_landed(storage, save_id, stage[0])
        if landed:
            # The manifest is ours (written, then an error: a lost PUT
            # answer, a failed clean-up of the replaced files): the save
            # is done, whatever the error says.
            log.warning("shardckpt: %s was committed (the manifest names this save), then: %s: %s", storage.url, type(e).__name__, e)
            return
        if landed is None:
            raise SaveFailedError(
                f"cannot tell whether {storage.url} was committed: the manifest write failed ({type(e).__name__}: "
                f"{e}) and the manifest cannot be read back; this save's files are kept. Run "
                f"shardckpt.verify({storage.url!r}) to see which checkpoint is there"
            ) from e
        if isinstance(e, OSError) and not isinstance(e, CheckpointError):
            err = _write_failed(e, storage, "commit failed")
            raise err from err.__cause__
        raise SaveFailedError(f"nothing was committed at {storage.url}: commit failed: {type(e).__name__}: {e}") from e


def _after_failure(plan: SavePlan, e: BaseException, save_id: str, stage: str, rels: Sequence[str]) -> bool:
    """After a failed save: True when the save stands after all (committed; a peer failed after), else the caller re-raises.

    The commit point: once rank 0's manifest write passed it, no rank
    removes a file the manifest names (with overwrite, the replaced
    checkpoint's files may already be gone: this save's are all there is).
    Rank 0 knows how far its commit got (and reads the manifest back when
    the write's outcome is unknown); a peer can miss rank 0's verdict
    although rank 0 committed (rank 0 died just after, taking the store
    with it) and reads the manifest back. Files (``rels``) are removed only
    when the manifest is known not to be this save's.

    Raises:
        SaveFailedError: on rank 0, the save was committed and a rank failed after.
    """
    storage, rank = plan.storage, plan.rank
    committed = _commit_landed(storage, save_id, stage) if rank == 0 else _committed_by(storage, save_id)
    if committed and isinstance(e, Exception):
        if rank != 0:
            log.warning("shardckpt: %s was committed, then a peer failed: %s", storage.url, e)
            return True
        raise SaveFailedError(
            f"{storage.url} was committed (complete: its manifest names only files every rank had written; "
            f"it is this save's and it loads), then a rank failed. What the failure said (about what came "
            f"after the commit, which stands): {e}"
        ) from e
    if committed is not False:  # committed (an interrupt), or cannot tell: the files stay (cleanup() removes leftovers)
        return False
    for rel in rels:
        try:
            storage.remove(rel)
        except Exception:
            pass
    return False


def write_rank(
    storage: Storage,
    files: Mapping[str, Sequence[WriteItem]],
    save_id: str,
    rank: int,
    *,
    threads: Optional[int] = None,
    block_bytes: Optional[int] = None,
    writer: Optional[Callable[..., Any]] = None,
    referenced: Sequence[Tuple[str, ChunkMeta]] = (),
    hash_algo: str = "",
) -> Tuple[List[Tuple[str, ChunkMeta]], Dict[str, FileMeta], Optional[Tuple[str, int, int]]]:
    """Write one rank's data files, then its v2 index file: the bytes of a save (and of a converter's output).

    Args:
        storage: the checkpoint being written.
        files: relative path -> this rank's chunks in it (``_io.write_files``).
        save_id / rank: name the index file (``data/<save>-index-r<rank>.json``).
        threads / block_bytes: as ``write_files`` (block CRC size, default ``SHARDCKPT_BLOCK_BYTES``).
        writer: who writes the data files (default ``_io.write_files``, here;
            the async save's writer process passes its own, same signature).
        referenced: ``(tensor name, chunk)`` of chunks not written but
            referenced in an earlier checkpoint (incremental save): listed
            in the index file beside the written ones, and returned in the
            first list too.

    Returns:
        ``([(tensor name, chunk)], {file: FileMeta}, (index path, size, crc32c) or None)``;
        the caller puts them in the manifest and commits with ``_format.commit``.

    Raises:
        OSError / StorageError: a write failed (the caller removes the files).

    Example:
        >>> named, sizes, index = write_rank(storage, {"data/x.safetensors": items}, sid, 0)   # doctest: +SKIP
    """
    block_bytes = block_bytes or _knobs.BLOCK_BYTES
    # A chunk's tensor name travels with it: (file, key) identifies the item written.
    names = {(rel, it.key): it.name for rel, items in files.items() for it in items}
    chunks, fmetas = (writer or write_files)(storage, files, threads=threads, block_bytes=block_bytes, hash_algo=hash_algo)
    named = [(names[(c.file, c.key)], c) for c in chunks] + list(referenced)
    index = None
    if named:
        index_rel = index_file_name(save_id, rank)
        body = index_bytes(save_id, rank, block_bytes, named)
        # The data files just written made data/: if it is gone now
        # (cleanup(), a removed run), fail rather than re-create it. A rank
        # whose chunks are all references (incremental) wrote none: it makes data/.
        storage.write_atomic(index_rel, body, create_dirs=not fmetas)
        index = (index_rel, len(body), crc32c(body))
    return named, fmetas, index


def _write_failed(e: OSError, storage: Storage, doing: str) -> Exception:
    """A save's failed write as ``SaveFailedError`` caused by a ``StorageError`` naming the path and the reason.

    Our own errors (``StorageError``, ``UnreadableFileError``) pass as they are.
    """
    if isinstance(e, CheckpointError):
        return e
    path = e.filename or storage.url
    reason = e.strerror or str(e)
    code = errno.errorcode.get(e.errno, "") if e.errno else ""
    cause = StorageError(f"cannot write {path}: {reason}{f' ({code})' if code else ''}")
    cause.__cause__ = e
    err = SaveFailedError(
        f"nothing was committed at {storage.url}: {doing}: StorageError: {cause}. Check that the path is "
        "writable (permissions, a read-only mount, free space); any previous checkpoint there is untouched"
    )
    err.__cause__ = cause
    return err


def _committed_by(storage: Storage, save_id: str) -> Optional[bool]:
    """Whether the manifest at ``storage`` is this save's: True, False, or None (cannot tell)."""
    try:
        if not storage.exists(MANIFEST_NAME):
            return False
        raw = json.loads(storage.read_bytes(MANIFEST_NAME, limit=MANIFEST_PEEK_BYTES))
        return isinstance(raw, dict) and raw.get("save_id") == save_id
    except Exception:
        return None


def _commit_landed(storage: Storage, save_id: str, stage: str) -> Optional[bool]:
    """Rank 0: whether its commit passed the commit point, from how far it got (``commit``'s progress).

    Before the manifest write: False. After it returned: True. Its
    directory gone right after (``"vanished"``): None. In between
    (the write raised or was interrupted: a lost PUT answer, Ctrl-C right
    after the rename) only the manifest there can say: ``_committed_by``.
    """
    if stage in ("before", "incomplete"):  # incomplete: files vanished under the manifest write, it was taken back
        return False
    if stage == "committed":
        return True
    if stage == "vanished":  # moved aside by another process's leftover removal, maybe put back later: unknown
        return None
    return _committed_by(storage, save_id)


def _commit(plan: SavePlan, results: Sequence[RankResult], save_id: str, progress: Optional[Callable[[str], None]] = None) -> None:
    """Rank 0: build the manifest from every rank's chunks and write it last (the commit)."""
    storage = plan.storage
    layouts = dict(plan.layouts)
    for r, res in enumerate(results):  # the peers' per-rank tensors: only rank r holds (and wrote) them
        for n, (dt, shape) in res.per_rank_specs.items():
            box = _geometry.Box((0,) * len(shape), tuple(shape))
            layouts[n] = TensorLayout(name=n, dtype=dt, torch_dtype=torch_dtype(dt), shape=tuple(shape), parts=[], holders={box: (r,)})
    layouts = {n: layouts[n] for n in sorted(layouts)}
    manifest = _build_manifest(layouts, results, plan.world, save_id, plan.tree, plan.comm.ranks)
    manifest.extra.update(plan.extra)
    per_rank = [res.per_rank for res in results]
    if any(p is not None for p in per_rank):
        manifest.extra["per_rank"] = per_rank
    keep = plan.keep_files
    commit(storage, manifest, replace=plan.overwrite and keep is not None, progress=progress,
           files_here=plan.files_here, keep=keep or frozenset())


def stage_save(plan: SavePlan, copy: Callable[[List[torch.Tensor]], List[torch.Tensor]]) -> SavePlan:
    """A copy of ``plan`` whose tensors are private copies (async save).

    ``copy`` receives the tensors (views of the live state, in plan order) and
    returns same-shaped, same-dtype CPU tensors whose contents no later update
    of the live state can reach. The JSON part of the state is copied too, so
    ``execute_save`` may then run in a background thread while training goes on.
    Local to this rank, no collective.
    """
    staged = copy([cast(Any, it.tensor) for it in plan.items])
    if len(staged) != len(plan.items):
        raise AssertionError(f"stage_save: {len(staged)} copies for {len(plan.items)} tensors")
    return replace(
        plan,
        items=tuple(replace(it, tensor=t) for it, t in zip(plan.items, staged)),
        tree=_copy.deepcopy(plan.tree),
        per_rank=_copy.deepcopy(plan.per_rank),
        extra=MappingProxyType(_copy.deepcopy(dict(plan.extra))),
    )


@paused_gc
def _build_manifest(
    layouts: Dict[str, TensorLayout], results: Sequence[RankResult], world: int, save_id: str, tree: Any, group_ranks: Optional[Sequence[int]] = None
) -> Manifest:
    """Rank 0: the v2 manifest, O(tensors + ranks + irregular chunks).

    Regular tensors get their layout record; irregular ones their writer
    ranks, after a tiling check of their chunks. The bytes written of regular
    tensors must add up to their sizes (a writer that wrote nothing shows).
    """
    tensors: Dict[str, TensorMeta] = {}
    meshes: List[Any] = []
    mesh_ids: Dict[Any, int] = {}
    rotations = _rotations(layouts)
    want_regular = 0
    records: Dict[Any, Dict[str, Any]] = {}  # a few distinct layouts among thousands of tensors
    for name, lay in layouts.items():
        t = TensorMeta(dtype=lay.dtype, shape=list(lay.shape), layout=lay.layout_json)
        if lay.regular is not None:
            key = (id(lay.mesh_ranks), lay.regular.world)
            if key not in mesh_ids:
                mesh_ids[key] = len(meshes)
                meshes.append(_group_mesh(lay.mesh_ranks, lay.regular.world, group_ranks))
            rec = records.get(lay.regular)
            if rec is None:
                rec = records[lay.regular] = _geometry.layout_to_json(lay.regular)
            t.regular = {
                "mesh_shape": rec["mesh_shape"],
                "placements": rec["placements"],
                "mesh": mesh_ids[key],
                "rotation": lay.rotation if lay.rotation is not None else rotations[name],
            }
            want_regular += math.prod(lay.shape) * itemsize(lay.dtype)
        tensors[name] = t
    outputs = []
    got_regular = 0
    for rank, res in enumerate(results):
        got_regular += res.regular_bytes
        chunks = [(c["name"], ChunkMeta(**{k: v for k, v in c.items() if k != "name"})) for c in res.chunks]
        outputs.append(RankOutput(rank, chunks, dict(res.file_sizes), res.index))
    assert got_regular == want_regular, f"internal error: {got_regular} bytes of regular tensors written, {want_regular} expected"
    return build_manifest(
        tensors, outputs, world_size=world, values=tree, save_id=save_id, block_bytes=_knobs.BLOCK_BYTES, meshes=meshes
    )


def _group_mesh(mesh_ranks: Optional[Sequence[int]], n: int, group_ranks: Optional[Sequence[int]]) -> Any:
    """A mesh's ranks in the save group's numbering (what the manifest records): ``"iota"`` for 0..n-1.

    Layouts hold global ranks (None: 0..n-1); a save over a sub-group
    records positions in that group, so that the checkpoint loads.
    """
    ranks = list(range(n)) if mesh_ranks is None else list(mesh_ranks)
    if group_ranks is not None and tuple(group_ranks) != tuple(range(len(group_ranks))):
        pos = {r: i for i, r in enumerate(group_ranks)}
        outside = [r for r in ranks if r not in pos]
        assert not outside, f"internal error: mesh ranks {outside[:8]} are outside the save's group"
        ranks = [pos[r] for r in ranks]
    return "iota" if ranks == list(range(len(ranks))) else ranks
