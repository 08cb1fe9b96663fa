"""save: plan, write, commit.

Save (collective when a process group exists):
  1. flatten the state into named tensors and a JSON tree (``_state``);
  2. compute every tensor's boxes and pick one writer per box (``_plan``),
     with no communication: every rank derives the same answer;
  3. rank 0 checks the target and broadcasts a fresh save id;
  4. each rank writes its boxes to its own files, checksumming as it writes;
  5. one all-gather of chunk metadata; rank 0 validates coverage and writes
     ``manifest.json`` last, atomically — that is the commit;
  6. the outcome is broadcast so every rank returns or raises together.

"""

from __future__ import annotations

import copy as _copy
import uuid
from dataclasses import dataclass, field
from typing import Any, Callable, Dict, List, Optional, Sequence, Tuple

import torch

from . import _plan
from ._format import (
    HF_INDEX_NAME,
    MANIFEST_NAME,
    MAX_MANIFEST_BYTES,
    ChunkMeta,
    FileMeta,
    Manifest,
    TensorMeta,
    chunk_key,
    itemsize,
    manifest_to_bytes,
    tiling_problems,
    torch_dtype,
)
from ._io import DEFAULT_IO_THREADS, WriteItem, partition, write_files
from ._layout import TensorLayout, dist_info, layout_of
from ._state import flatten_for_save
from ._storage import Storage
from .errors import (
    CheckpointExistsError,
    SaveFailedError,
)

from ._collective import _all_gather, _broadcast

__all__ = ["save", "SavePlan", "prepare_save", "stage_save", "execute_save", "DATA_DIR"]

DATA_DIR = "data"


def _version() -> str:
    from ._version import __version__

    return __version__


def _layouts(tensors: Dict[str, Any], rank: int, world: int) -> Dict[str, TensorLayout]:
    return {name: layout_of(name, tensors[name], rank=rank, world_size=world) for name in sorted(tensors)}


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
    process_group=None,
    overwrite: bool = False,
    io_threads: int = DEFAULT_IO_THREADS,
) -> None:
    """Save ``state`` to ``url`` as a sharded, checksummed checkpoint.

    Collective when a process group is initialized: every rank must call it
    with the same structure of state. Each rank writes only the boxes it is
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

    Raises:
        CheckpointExistsError: ``url`` holds a committed checkpoint and
            ``overwrite`` is False.
        UnsupportedStateError: a value cannot be saved (its path is named).
        SaveFailedError: writing failed on some rank; nothing was committed,
            any previous checkpoint at ``url`` is untouched.

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
    plan = prepare_save(
        state, url, storage_options=storage_options, process_group=process_group, overwrite=overwrite, io_threads=io_threads
    )
    execute_save(plan)


@dataclass
class SavePlan:
    """A save split from its I/O: what this rank writes, ready to execute.

    ``prepare_save`` builds it (collective: ranks agree the state is valid);
    ``stage_save`` swaps the tensors for private copies (async save);
    ``execute_save`` writes and commits (collective).
    """

    storage: Storage
    rank: int
    world: int
    tree: Any
    layouts: Dict[str, TensorLayout]
    items: List[WriteItem]
    process_group: Any = None
    overwrite: bool = False
    io_threads: int = DEFAULT_IO_THREADS
    extra: Dict[str, Any] = field(default_factory=dict)
    per_rank: Any = None  # this rank's per-rank JSON values, gathered at commit


def prepare_save(
    state: Dict[str, Any],
    url: str,
    *,
    storage_options: Optional[Dict[str, Any]] = None,
    process_group=None,
    overwrite: bool = False,
    io_threads: int = DEFAULT_IO_THREADS,
) -> SavePlan:
    """Flatten and plan a save; every rank learns whether any rank's state is invalid."""
    rank, world = dist_info(process_group)
    storage = Storage(url, storage_options=storage_options)
    # Validate the state on every rank before any other collective, so a bad
    # state raises everywhere instead of leaving peers blocked.
    local_err = None
    plan = None
    own: Dict[str, Any] = {}
    try:
        flat = flatten_for_save(state, rank=rank, world=world)
        layouts = _layouts(flat.tensors, rank, world)
        own = _own_tensors(layouts, flat.per_rank_tensors, rank)
        plan = SavePlan(
            storage=storage,
            rank=rank,
            world=world,
            tree=flat.tree,
            layouts=layouts,
            items=[],
            process_group=process_group,
            overwrite=overwrite,
            io_threads=io_threads,
            per_rank=flat.per_rank or None,
        )
    except Exception as e:  # re-raised below, after peers know
        local_err = e
    gathered = _all_gather((None if local_err is None else f"rank {rank}: {local_err}", own), process_group)
    errs = [g[0] for g in gathered]
    if local_err is not None:
        raise local_err
    if any(errs):
        raise SaveFailedError("save aborted before writing: " + "; ".join(e for e in errs if e))
    assert plan is not None
    plan.layouts = _with_peer_tensors(plan.layouts, [g[1] for g in gathered], rank)
    plan.items = _write_plan(plan.layouts, rank)
    return plan


def _own_tensors(layouts: Dict[str, TensorLayout], names: Sequence[str], rank: int) -> Dict[str, Any]:
    """Per-rank tensors: this rank alone holds (and writes) them; their specs for the peers."""
    specs = {}
    for n in names:
        lay = layouts[n]
        lay.holders = {_plan.Box((0,) * len(lay.shape), tuple(lay.shape)): (rank,)}
        specs[n] = (lay.dtype, list(lay.shape))
    return specs


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
    """Write this rank's files, gather chunk metadata, commit on rank 0 (collective)."""
    storage, rank, group = plan.storage, plan.rank, plan.process_group
    header = None
    if rank == 0:
        try:
            if storage.exists(MANIFEST_NAME) and not plan.overwrite:
                header = ("exists", f"{storage.url_of(MANIFEST_NAME)} already exists; pass overwrite=True to replace it")
            else:
                header = ("ok", uuid.uuid4().hex)
        except Exception as e:
            header = ("error", f"rank 0: cannot check {storage.url}: {e}")
    header = _broadcast(header, group)
    if header[0] == "exists":
        raise CheckpointExistsError(header[1])
    if header[0] == "error":
        raise SaveFailedError(header[1])
    save_id = header[1]

    groups = partition(plan.items, plan.io_threads)
    files = {f"{DATA_DIR}/{save_id[:12]}-r{rank:05d}-{i:02d}.safetensors": g for i, g in enumerate(groups)}
    result: Tuple[Any, ...]
    try:
        chunks, fmetas = write_files(storage, files, threads=plan.io_threads)
        result = (
            None,
            [c.to_json() | {"name": _name_of(c, files)} for c in chunks],
            {k: v.size for k, v in fmetas.items()},
            plan.per_rank,
        )
    except Exception as e:
        result = (f"rank {rank}: {type(e).__name__}: {e}", [], {}, None)
    gathered = _all_gather(result, group)
    errors = [g[0] for g in gathered if g[0]]

    outcome: Tuple[Optional[str], Optional[str]] = (None, None)
    if rank == 0:
        if errors:
            outcome = ("; ".join(errors), None)
        else:
            try:
                manifest = _build_manifest(plan.layouts, gathered, plan.world, save_id, plan.tree)
                manifest.extra.update(plan.extra)
                per_rank = [g[3] for g in gathered]
                if any(p is not None for p in per_rank):
                    manifest.extra["per_rank"] = per_rank
                body = manifest_to_bytes(manifest)
                # Data files removed since they were written (cleanup() on the
                # same root, a lifecycle rule) must not be named by a commit.
                storage.check_objects({rel: fm.size for rel, fm in manifest.files.items()})
                # The HF index first: before the commit it is just another file.
                # When replacing a checkpoint, keep the old index to put back
                # if the commit fails: it must keep naming the old files.
                prev_index = _read_optional(storage, HF_INDEX_NAME) if plan.overwrite else None
                _write_hf_index(storage, manifest)
                try:
                    storage.write_atomic(MANIFEST_NAME, body)
                except BaseException:
                    if plan.overwrite:
                        _restore(storage, HF_INDEX_NAME, prev_index)
                    raise
                outcome = (None, "committed")
            except Exception as e:
                outcome = (f"rank 0: commit failed: {type(e).__name__}: {e}", None)
    outcome = _broadcast(outcome, group)
    if outcome[0]:
        for rel in files:
            try:
                storage.remove(rel)
            except Exception:
                pass
        raise SaveFailedError(f"nothing was committed at {storage.url}: {outcome[0]}")
    if rank == 0 and plan.overwrite:
        _remove_stale(storage, save_id)


def stage_save(plan: SavePlan, copy: Callable[[List[torch.Tensor]], List[torch.Tensor]]) -> None:
    """Swap every tensor ``plan`` will write for a private copy (async save).

    ``copy`` receives the tensors (views of the live state, in plan order) and
    returns same-shaped, same-dtype CPU tensors whose contents no later update
    of the live state can reach. The JSON part of the state is copied too, so
    ``execute_save`` may then run in a background thread while training goes on.
    Local to this rank, no collective.
    """
    staged = copy([it.tensor for it in plan.items])
    if len(staged) != len(plan.items):
        raise AssertionError(f"stage_save: {len(staged)} copies for {len(plan.items)} tensors")
    for it, t in zip(plan.items, staged):
        it.tensor = t
    plan.tree = _copy.deepcopy(plan.tree)
    plan.per_rank = _copy.deepcopy(plan.per_rank)
    plan.extra = _copy.deepcopy(plan.extra)


def _name_of(c: ChunkMeta, files: Dict[str, List[WriteItem]]) -> str:
    for it in files[c.file]:
        if it.key == c.key:
            return it.name
    raise AssertionError(c.key)


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


def _write_hf_index(storage: Storage, m: Manifest) -> None:
    """When every tensor is whole, add ``model.safetensors.index.json`` (HF layout)."""
    if not m.tensors or any(len(t.chunks) != 1 or t.chunks[0].key != name for name, t in m.tensors.items()):
        return
    index = {
        # save_id marks the index as part of a native save: without the
        # manifest (written right after) readers must not take it as HF.
        "metadata": {"total_size": m.total_bytes, "format": "pt", "shardckpt_save_id": m.save_id},
        "weight_map": {name: t.chunks[0].file for name, t in sorted(m.tensors.items())},
    }
    import json

    storage.write_atomic(HF_INDEX_NAME, (json.dumps(index, indent=2, sort_keys=True) + "\n").encode())


def _read_optional(storage: Storage, rel: str) -> Optional[bytes]:
    try:
        return storage.read_bytes(rel, limit=MAX_MANIFEST_BYTES)
    except FileNotFoundError:
        return None


def _restore(storage: Storage, rel: str, data: Optional[bytes]) -> None:
    """Put ``rel`` back as it was (``None``: it did not exist); best effort."""
    try:
        if data is None:
            storage.remove(rel)
        else:
            storage.write_atomic(rel, data)
    except Exception:
        pass


def _remove_stale(storage: Storage, save_id: str) -> None:
    """After an overwrite commits, drop data files of the replaced checkpoint."""
    prefix = save_id[:12] + "-"
    for name in storage.listdir(DATA_DIR):
        if name.endswith(".safetensors") and not name.startswith(prefix):
            try:
                storage.remove(f"{DATA_DIR}/{name}")
            except Exception:
                pass
    # A sharded save over a whole one leaves the old HF index naming files
    # just removed: drop it rather than leave a broken HF directory.
    try:
        import json

        from ._format import check_relpath

        index = json.loads(storage.read_bytes(HF_INDEX_NAME, limit=MAX_MANIFEST_BYTES))
        named = set(index.get("weight_map", {}).values()) if isinstance(index, dict) else set()
        for rel in named:
            check_relpath(rel, where=HF_INDEX_NAME)
        dangling = any(not storage.exists(rel) for rel in named)
    except FileNotFoundError:
        return
    except Exception:
        dangling = True
    if dangling:
        try:
            storage.remove(HF_INDEX_NAME)
        except Exception:
            pass
