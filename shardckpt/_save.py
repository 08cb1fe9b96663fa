"""save: plan, write, commit.

Save (collective when a process group exists):
  1. flatten the state into named tensors and a JSON tree (``_state``);
  2. compute every tensor's boxes and pick one writer per box (``_plan``),
     with no communication: every rank derives the same answer;
  3. rank 0 checks the target and shares a fresh save id;
  4. each rank writes its boxes to its own files, checksumming as it writes;
  5. chunk metadata goes to rank 0, which validates coverage and writes
     ``manifest.json`` last, atomically — that is the commit;
  6. every rank returns or raises together.

Every exchange (1, 3, 5, 6) is one ``_collective.agree``: bounded by
``collective_timeout_s``, the same error on every rank. Plans are frozen:
``prepare_save`` -> ``stage_save`` (async) -> ``execute_save`` each take a
plan and build new objects, never change one.
"""

from __future__ import annotations

import copy as _copy
import uuid
from dataclasses import dataclass, field, replace
from types import MappingProxyType
from typing import TYPE_CHECKING, Any, Callable, Dict, List, Mapping, Optional, Sequence, Tuple

import torch

from . import _plan
from ._format import (
    DATA_DIR,
    MANIFEST_NAME,
    ChunkMeta,
    FileMeta,
    Manifest,
    TensorMeta,
    chunk_key,
    commit,
    itemsize,
    tiling_problems,
    torch_dtype,
)
from ._io import DEFAULT_IO_THREADS, WriteItem, partition, write_files
from ._collective import DEFAULT_COLLECTIVE_TIMEOUT_S, FROM_ROOT, TO_ROOT, Comm, agree, open_comm
from ._layout import TensorLayout, layout_of
from ._state import flatten_for_save
from ._storage import Storage
from .errors import (
    CheckpointExistsError,
    SaveFailedError,
    UnsupportedStateError,
)

if TYPE_CHECKING:  # pragma: no cover
    from torch.distributed import ProcessGroup

__all__ = ["save", "SavePlan", "prepare_save", "stage_save", "execute_save", "DATA_DIR"]


def _version() -> str:
    from ._version import __version__

    return __version__


#: What a save of an existing checkpoint says to do, unless the caller has its own switch.
OVERWRITE_HINT = "pass overwrite=True to replace it"


def _layouts(tensors: Dict[str, Any], rank: int, world: int, local_only: bool = False) -> Dict[str, TensorLayout]:
    return {
        name: layout_of(name, tensors[name], rank=rank, world_size=world, local_only=local_only) for name in sorted(tensors)
    }


def _write_plan(layouts: Dict[str, TensorLayout], rank: int) -> List[WriteItem]:
    """This rank's chunks to write: one writer per distinct box, bytes balanced."""
    items = []
    for name, lay in layouts.items():
        for box in sorted(lay.holders, key=lambda b: b.offsets):
            items.append(((name, box), box.numel * itemsize(lay.dtype), lay.holders[box]))
    writers = _plan.assign_writers(items)
    mine: List[WriteItem] = []
    seen = set()
    for name, lay in layouts.items():
        for part in lay.parts:
            key = (name, part.box)
            if writers.get(key) != rank or key in seen:
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
    url: str,
    *,
    storage_options: Optional[Dict[str, Any]] = None,
    process_group: Optional["ProcessGroup"] = None,
    overwrite: bool = False,
    io_threads: int = DEFAULT_IO_THREADS,
    collective_timeout_s: float = DEFAULT_COLLECTIVE_TIMEOUT_S,
    no_dist: bool = False,
) -> None:
    """Save ``state`` to ``url`` as a sharded, checksummed checkpoint.

    Collective when a process group is initialized: every rank of
    ``process_group`` must call it, with the same structure of state (for
    one process alone, e.g. an export on rank 0, pass ``no_dist=True``). Each rank writes only the boxes it is
    assigned (replicated data once, balanced across replicas); rank 0 commits
    by writing ``manifest.json`` last.

    Args:
        state: dict of tensors, DTensors, ``nn.Module``s, objects with
            ``state_dict()``/``load_state_dict()``, and JSON-able values
            (nested dicts/lists of those too).
        url: a local directory or any fsspec URL (``s3://b/run/step-1``).
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

    Raises:
        CheckpointExistsError: ``url`` holds a committed checkpoint and
            ``overwrite`` is False.
        UnsupportedStateError: a value cannot be saved (its path is named).
        SaveFailedError: writing failed on some rank, or a rank did not call
            within ``collective_timeout_s`` (named); nothing was committed,
            any previous checkpoint at ``url`` is untouched.
        UsageError: under torchrun (``WORLD_SIZE`` > 1) with no process group
            initialised and no ``no_dist=True``.

    Plain (non-distributed) tensors in a multi-rank save are assumed to be
    identical on every rank, as with DDP, and written once.

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
    plan = prepare_save(state, url, comm=comm, storage_options=storage_options, overwrite=overwrite, io_threads=io_threads)
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
    io_threads: int = DEFAULT_IO_THREADS
    extra: Mapping[str, Any] = field(default_factory=lambda: MappingProxyType({}))
    per_rank: Any = None  # this rank's per-rank JSON values, gathered at commit
    #: Said when the target is committed and ``overwrite`` is False: the
    #: switch of the call the user made (the manager's is ``force=True``).
    exists_hint: str = OVERWRITE_HINT

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
    url: str,
    *,
    comm: Comm,
    storage_options: Optional[Dict[str, Any]] = None,
    overwrite: bool = False,
    io_threads: int = DEFAULT_IO_THREADS,
    extra: Optional[Mapping[str, Any]] = None,
    exists_hint: str = OVERWRITE_HINT,
) -> SavePlan:
    """Flatten and plan a save; every rank learns whether any rank's state is invalid (collective).

    ``extra`` goes into the manifest's ``extra`` (the manager's step).
    """
    rank, world = comm.rank, comm.world
    storage = Storage(url, storage_options=storage_options)

    # Validate the state on every rank before any other exchange, so a bad
    # state raises everywhere instead of leaving peers waiting.
    def local():
        flat = flatten_for_save(state, rank=rank, world=world)
        if RESERVED_TENSOR_NAME in flat.tensors:
            raise UnsupportedStateError(
                f"a tensor named {RESERVED_TENSOR_NAME!r} cannot be saved: safetensors reserves that key for a file's "
                "metadata, so the data file would be unreadable by safetensors; rename it or nest it under another key"
            )
        layouts = _layouts(flat.tensors, rank, world, local_only=comm.no_dist)
        own, layouts = _own_tensors(layouts, flat.per_rank_tensors, rank)
        return flat, layouts, own

    (flat, layouts, _), specs = agree(comm, local, what="save aborted before writing", share=lambda r: r[2])
    layouts = _with_peer_tensors(layouts, specs, rank)
    return SavePlan(
        storage=storage,
        comm=comm,
        tree=flat.tree,
        layouts=MappingProxyType(layouts),
        items=tuple(_write_plan(layouts, rank)),
        overwrite=overwrite,
        io_threads=io_threads,
        extra=MappingProxyType(dict(extra or {})),
        per_rank=flat.per_rank or None,
        exists_hint=exists_hint,
    )


def _own_tensors(
    layouts: Dict[str, TensorLayout], names: Sequence[str], rank: int
) -> Tuple[Dict[str, Any], Dict[str, TensorLayout]]:
    """Per-rank tensors: this rank alone holds (and writes) them; their specs for the peers."""
    specs = {}
    out = dict(layouts)
    for n in names:
        lay = layouts[n]
        out[n] = replace(lay, holders={_plan.Box((0,) * len(lay.shape), tuple(lay.shape)): (rank,)})
        specs[n] = (lay.dtype, list(lay.shape))
    return specs, out


def _with_peer_tensors(layouts: Dict[str, TensorLayout], specs: List[Dict[str, Any]], rank: int) -> Dict[str, TensorLayout]:
    """Add the other ranks' per-rank tensors (no local parts) so every rank plans, and rank 0 commits, them all."""
    out = dict(layouts)
    for r, spec in enumerate(specs):
        if r == rank:
            continue
        for n, (dt, shape) in spec.items():
            box = _plan.Box((0,) * len(shape), tuple(shape))
            out[n] = TensorLayout(name=n, dtype=dt, torch_dtype=torch_dtype(dt), shape=tuple(shape), parts=[], holders={box: (r,)})
    # Writer assignment balances bytes greedily: every rank must see the same order.
    return {n: out[n] for n in sorted(out)}


def execute_save(plan: SavePlan) -> None:
    """Write this rank's files, gather chunk metadata, commit on rank 0 (collective).

    Three agreements: rank 0's go (target free, fresh save id), every rank's
    write result (to rank 0), rank 0's commit outcome. A failure anywhere
    raises on every rank, removes this save's data files and leaves any
    previous checkpoint at the URL as it was.
    """
    storage, rank, comm = plan.storage, plan.rank, plan.comm

    def check_target() -> Optional[str]:
        if rank != 0:
            return None
        try:
            exists = storage.exists(MANIFEST_NAME)
        except Exception as e:
            raise SaveFailedError(f"cannot check {storage.url}: {type(e).__name__}: {e}") from e
        if exists and not plan.overwrite:
            raise CheckpointExistsError(f"{storage.url_of(MANIFEST_NAME)} already exists; {plan.exists_hint}")
        return uuid.uuid4().hex

    _, save_id = agree(comm, check_target, what=f"save to {storage.url} not started", share=lambda v: v, mode=FROM_ROOT)

    groups = partition(list(plan.items), plan.io_threads)
    files = {f"{DATA_DIR}/{save_id[:12]}-r{rank:05d}-{i:02d}.safetensors": g for i, g in enumerate(groups)}
    # A chunk's tensor name travels with it: (file, key) identifies the item written.
    names = {(rel, it.key): it.name for rel, items in files.items() for it in items}

    def write() -> Tuple[Any, ...]:
        chunks, fmetas = write_files(storage, files, threads=plan.io_threads)
        return (
            None,
            [c.to_json() | {"name": names[(c.file, c.key)]} for c in chunks],
            {k: v.size for k, v in fmetas.items()},
            plan.per_rank,
        )

    def commit_on_root(gathered) -> None:
        if rank != 0:
            return
        try:
            _commit(plan, gathered, save_id)
        except Exception as e:
            raise SaveFailedError(f"nothing was committed at {storage.url}: commit failed: {type(e).__name__}: {e}") from e

    try:
        _, gathered = agree(comm, write, what=f"nothing was committed at {storage.url}", share=lambda v: v, mode=TO_ROOT)
        agree(comm, lambda: commit_on_root(gathered), what=f"save to {storage.url} failed")
    except BaseException:
        for rel in files:
            try:
                storage.remove(rel)
            except Exception:
                pass
        raise


def _commit(plan: SavePlan, gathered, save_id: str) -> None:
    """Rank 0: build the manifest from every rank's chunks and write it last (the commit)."""
    storage = plan.storage
    manifest = _build_manifest(plan.layouts, gathered, plan.world, save_id, plan.tree)
    manifest.extra.update(plan.extra)
    per_rank = [g[3] for g in gathered]
    if any(p is not None for p in per_rank):
        manifest.extra["per_rank"] = per_rank
    commit(storage, manifest, replace=plan.overwrite)


def stage_save(plan: SavePlan, copy: Callable[[List[torch.Tensor]], List[torch.Tensor]]) -> SavePlan:
    """A copy of ``plan`` whose tensors are private copies (async save).

    ``copy`` receives the tensors (views of the live state, in plan order) and
    returns same-shaped, same-dtype CPU tensors whose contents no later update
    of the live state can reach. The JSON part of the state is copied too, so
    ``execute_save`` may then run in a background thread while training goes on.
    Local to this rank, no collective.
    """
    staged = copy([it.tensor for it in plan.items])
    if len(staged) != len(plan.items):
        raise AssertionError(f"stage_save: {len(staged)} copies for {len(plan.items)} tensors")
    return replace(
        plan,
        items=tuple(replace(it, tensor=t) for it, t in zip(plan.items, staged)),
        tree=_copy.deepcopy(plan.tree),
        per_rank=_copy.deepcopy(plan.per_rank),
        extra=MappingProxyType(_copy.deepcopy(dict(plan.extra))),
    )


def _build_manifest(layouts: Dict[str, TensorLayout], gathered, world: int, save_id: str, tree: Any) -> Manifest:
    tensors = {
        name: TensorMeta(dtype=lay.dtype, shape=list(lay.shape), layout=lay.layout_json) for name, lay in layouts.items()
    }
    files: Dict[str, FileMeta] = {}
    for _, chunks, fsizes, _ in gathered:
        for rel, size in fsizes.items():
            files[rel] = FileMeta(size)
        for c in chunks:
            name = c.pop("name")
            tensors[name].chunks.append(ChunkMeta(**c))
    bad = tiling_problems(tensors)
    assert not bad, "internal error, saved chunks do not tile: " + "; ".join(bad)
    return Manifest(world_size=world, tensors=tensors, files=files, values=tree, save_id=save_id, library_version=_version())
