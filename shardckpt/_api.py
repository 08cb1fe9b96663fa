"""save, load, inspect, verify: the engine users call.

Save (collective when a process group exists):
  1. flatten the state into named tensors and a JSON tree (``_state``);
  2. compute every tensor's boxes and pick one writer per box (``_plan``),
     with no communication: every rank derives the same answer;
  3. rank 0 checks the target and broadcasts a fresh save id;
  4. each rank writes its boxes to its own files, checksumming as it writes;
  5. one all-gather of chunk metadata; rank 0 validates coverage and writes
     ``manifest.json`` last, atomically — that is the commit;
  6. the outcome is broadcast so every rank returns or raises together.

Load (no collective except one agreement before touching tensors):
  1. read and validate the manifest; walk the live state;
  2. match names, shapes and dtypes, listing every offender;
  3. read only the saved chunks overlapping this rank's boxes, coalesced and
     in parallel, and verify their checksums into staging memory;
  4. all ranks agree every read succeeded, then copy into the live tensors
     in place (``copy_`` into a DTensor's local tensor), then put back plain
     values and call ``load_state_dict`` on stateful objects.
"""

from __future__ import annotations

import copy as _copy
import math
import uuid
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from typing import Any, Callable, Dict, List, NamedTuple, Optional, Sequence, Tuple

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
    manifest_from_bytes,
    manifest_to_bytes,
    parse_safetensors_header,
    tiling_problems,
    torch_dtype,
)
from ._io import DEFAULT_IO_THREADS, WriteItem, as_dtype, check_files, partition, read_chunks, write_files
from ._layout import TensorLayout, box_view, dist_info, layout_of
from ._state import flatten_for_load, flatten_for_save
from ._storage import Storage
from .errors import (
    CheckpointExistsError,
    CheckpointNotFoundError,
    ChecksumMismatchError,
    CorruptCheckpointError,
    SaveFailedError,
    StateMismatchError,
    format_offenders,
)

__all__ = ["save", "load", "inspect", "verify", "LoadResult", "read_manifest", "SavePlan", "prepare_save", "stage_save", "execute_save"]

DATA_DIR = "data"


class LoadResult(NamedTuple):
    """What a non-strict load skipped (both empty after a strict load)."""

    missing_keys: List[str]
    unexpected_keys: List[str]


def _version() -> str:
    from . import __version__

    return __version__


# --------------------------------------------------------------------------
# collectives (all no-ops without a process group)


def _pg_active(group) -> bool:
    import torch.distributed as dist

    return dist.is_available() and dist.is_initialized() and dist.get_world_size(group) > 1


def _broadcast(obj: Any, group) -> Any:
    import torch.distributed as dist

    if not _pg_active(group):
        return obj
    box = [obj]
    src = dist.get_global_rank(group, 0) if group is not None else 0
    dist.broadcast_object_list(box, src=src, group=group)
    return box[0]


def _all_gather(obj: Any, group) -> List[Any]:
    import torch.distributed as dist

    if not _pg_active(group):
        return [obj]
    out: List[Any] = [None] * dist.get_world_size(group)
    dist.all_gather_object(out, obj, group=group)
    return out


# --------------------------------------------------------------------------
# save


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


# --------------------------------------------------------------------------
# load


def read_manifest(storage: Storage) -> Manifest:
    """Read and validate ``manifest.json``; raise if the checkpoint is not committed.

    Without a manifest, safetensors files there (a Hugging Face directory or
    one ``.safetensors`` file) are read as a checkpoint of whole tensors
    without checksums (``_hf.hf_manifest``).
    """
    try:
        data = storage.read_bytes(MANIFEST_NAME, limit=MAX_MANIFEST_BYTES)
    except (FileNotFoundError, NotADirectoryError):
        from ._hf import hf_manifest

        hf = hf_manifest(storage)
        if hf is not None:
            return hf
        raise CheckpointNotFoundError(
            f"no committed checkpoint at {storage.url}: {MANIFEST_NAME} is missing "
            "(the save never finished, or this is not a shardckpt checkpoint)"
        ) from None
    return manifest_from_bytes(data, url=storage.url)


def _under_roots(name: str, roots: Sequence[str]) -> bool:
    return any(name == r or name.startswith(r + ".") for r in roots)


@dataclass
class _Target:
    name: str
    meta: TensorMeta
    parts: List[Tuple[_plan.Box, torch.Tensor]]  # (box, destination view holding that box)
    pieces: List[List[_plan.Piece]] = field(default_factory=list)


def load(
    state: Dict[str, Any],
    url: str,
    *,
    storage_options: Optional[Dict[str, Any]] = None,
    strict: bool = True,
    process_group=None,
    io_threads: int = DEFAULT_IO_THREADS,
    keys: Optional[Sequence[str]] = None,
    key_map: Any = None,
) -> LoadResult:
    """Load a checkpoint into ``state`` in place, resharding to the live layout.

    Works at any world size and mesh, and in a single process with no process
    group. Collective when a process group is initialized: every rank of
    ``process_group`` calls it (ranks agree before any tensor changes). Each rank reads only the saved chunks that overlap what it holds.
    Tensors are filled with ``copy_`` into their existing storage (for a
    DTensor, its local tensor), so Parameters, their dtype, device and object
    identity are kept — FSDP2's all-gather buffers see the new values. Plain
    values are put back into their dicts; stateful objects get
    ``load_state_dict``.

    Everything is checked first — names, shapes, dtypes, files, sizes,
    checksums of every byte read — and all ranks agree before any tensor is
    touched: a failed load raises and leaves the state as it was.

    Args:
        state: the live state, same structure as when saved. Only the entries
            it names are loaded (a model alone from a full training checkpoint
            is fine).
        url: checkpoint directory or fsspec URL.
        storage_options: passed to fsspec.
        strict: if False, entries missing on either side are skipped and
            reported in the result instead of raising.
        process_group: group the load runs over (default: the world).
        io_threads: parallel readers per rank.
        keys: only these checkpoint tensors (names or glob patterns, matched
            against checkpoint names); a pattern matching nothing raises.
            Usually with ``strict=False``.
        key_map: checkpoint name -> state name: a dict (unlisted names kept)
            or a callable (``None`` drops a tensor), e.g. to load Hugging Face
            names into a differently named model.

    ``url`` may also be a Hugging Face safetensors directory (with or without
    ``model.safetensors.index.json``) or one ``.safetensors`` file: its bare
    model keys go under the state's ``"model"`` entry (or its only entry),
    unless ``key_map`` says otherwise, and each rank reads only the rows of
    each tensor it holds (ranged reads). Safetensors files carry no
    checksums, so those bytes are checked for size and bounds only.

        >>> shardckpt.load({"model": fsdp_model}, "Llama-3-8B/")   # doctest: +SKIP

    Returns:
        LoadResult(missing_keys, unexpected_keys).

    Raises:
        CheckpointNotFoundError: no ``manifest.json`` at ``url``.
        StateMismatchError: names, shapes or dtypes disagree (all listed).
        CorruptCheckpointError: files missing, truncated, or failing their checksum.

    Memory: the bytes this rank needs are staged in host memory, verified,
    then copied — about one extra copy of the rank's shard at peak.
    """
    rank, world = dist_info(process_group)
    storage = Storage(url, storage_options=storage_options)
    err: Optional[BaseException] = None
    plan = None
    try:
        manifest = read_manifest(storage)
        if keys is not None or key_map is not None or manifest.extra.get("source") == "safetensors":
            from ._hf import select_for_load

            manifest = select_for_load(manifest, state, keys=keys, key_map=key_map)
        plan = _plan_load(state, manifest, strict=strict, rank=rank, world=world)
        targets, creates, finalizers, result = plan
        chunk_list, chunk_index = _needed_chunks(targets, creates, manifest)
        check_files(storage, {c.file: manifest.files[c.file].size for c in chunk_list})
        pin = any(p[1].is_cuda for t in targets for p in t.parts) and torch.cuda.is_available()
        staged = read_chunks(storage, chunk_list, threads=io_threads, pin_memory=pin)
    except BaseException as e:
        err = e
    # Agree across ranks before touching any tensor: one rank's damaged file
    # must not leave the others loaded and this one not.
    verdicts = _all_gather(None if err is None else f"rank {rank}: {type(err).__name__}: {err}", process_group)
    if err is not None:
        raise err
    failed = [v for v in verdicts if v]
    if failed:
        raise CorruptCheckpointError("load aborted on another rank, nothing was loaded: " + "; ".join(failed))

    with torch.no_grad():
        for t in targets:
            dtype = torch_dtype(t.meta.dtype)
            for (box, dst), pieces in zip(t.parts, t.pieces):
                for p in pieces:
                    c = t.meta.chunks[p.chunk]
                    src = as_dtype(staged[chunk_index[(t.name, p.chunk)]], dtype, c.sizes)
                    box_view(dst, p.dst_offsets, p.sizes).copy_(box_view(src, p.src_offsets, p.sizes))
        for name, put in creates.items():
            meta = manifest.tensors[name]
            dtype = torch_dtype(meta.dtype)
            if len(meta.chunks) == 1 and list(meta.chunks[0].sizes) == list(meta.shape):
                # Saved whole: the verified staging bytes become the tensor, no copy.
                put(as_dtype(staged[chunk_index[(name, 0)]], dtype, meta.shape))
                continue
            full = torch.empty(tuple(meta.shape), dtype=dtype)
            for i, c in enumerate(meta.chunks):
                src = as_dtype(staged[chunk_index[(name, i)]], full.dtype, c.sizes)
                box_view(full, c.offsets, c.sizes).copy_(src)
            put(full)
    for fn in finalizers:
        fn()
    return result


def _plan_load(state, manifest: Manifest, *, strict: bool, rank: int, world: int):
    flat, missing_values, unexpected_values = flatten_for_load(
        state,
        manifest.values,
        manifest.tensors,
        strict=strict,
        rank=rank,
        world=world,
        saved_world=manifest.world_size,
        per_rank=manifest.extra.get("per_rank"),
    )
    live = flat.tensors
    missing = sorted(n for n in live if n not in manifest.tensors)
    creates = {n: f for n, f in flat.creates.items() if n in manifest.tensors}
    missing += sorted(n for n in flat.creates if n not in manifest.tensors)
    claimed = set(live) | set(flat.creates)
    unexpected = sorted(
        n for n in manifest.tensors if _under_roots(n, flat.roots) and n not in claimed and not _under_roots(n, flat.skip)
    )
    missing_all = sorted(set(missing) | set(missing_values))
    unexpected_all = sorted(set(unexpected) | set(unexpected_values))
    if strict and (missing_all or unexpected_all):
        parts = []
        if missing_all:
            parts.append(f"missing from the checkpoint: {format_offenders(missing_all)}")
        if unexpected_all:
            parts.append(f"in the checkpoint but not in the state: {format_offenders(unexpected_all)}")
        raise StateMismatchError(
            "state and checkpoint disagree: " + "; ".join(parts) + ". Pass strict=False to load the common entries."
        )
    problems = []
    targets: List[_Target] = []
    for name in sorted(live):
        if name not in manifest.tensors:
            continue
        meta = manifest.tensors[name]
        lay = layout_of(name, live[name], rank=rank, world_size=world)
        if list(lay.shape) != list(meta.shape):
            problems.append(f"{name}: checkpoint shape {list(meta.shape)}, live shape {list(lay.shape)}")
            continue
        if lay.dtype != meta.dtype:
            problems.append(f"{name}: checkpoint dtype {meta.dtype}, live dtype {lay.dtype}")
            continue
        if any(c.crc32c is None for c in meta.chunks):
            # No checksum to verify (safetensors sources): read only our rows.
            from ._hf import narrow_unchecked

            meta = narrow_unchecked(meta, [p.box for p in lay.parts])
        saved = [_plan.Box(tuple(c.offsets), tuple(c.sizes)) for c in meta.chunks]
        t = _Target(name, meta, [(p.box, p.view()) for p in lay.parts])
        for box, _ in t.parts:
            t.pieces.append(_plan.plan_reads(saved, [_plan.LocalBox(box, (0,) * len(box.offsets))]))
        targets.append(t)
    if problems:
        raise StateMismatchError("cannot load: " + "; ".join(sorted(problems)))
    return targets, creates, flat.finalizers, LoadResult(missing_all, unexpected_all)


def _needed_chunks(targets: List[_Target], creates, manifest: Manifest):
    chunk_list: List[ChunkMeta] = []
    index: Dict[Tuple[str, int], int] = {}

    def need(name: str, i: int, c: ChunkMeta):
        if (name, i) not in index:
            index[(name, i)] = len(chunk_list)
            chunk_list.append(c)

    for t in targets:
        for pieces in t.pieces:
            for p in pieces:
                need(t.name, p.chunk, t.meta.chunks[p.chunk])
    for name in creates:
        for i, c in enumerate(manifest.tensors[name].chunks):
            need(name, i, c)
    return chunk_list, index


# --------------------------------------------------------------------------
# inspect / verify


def inspect(url: str, *, storage_options: Optional[Dict[str, Any]] = None) -> Manifest:
    """Return a committed checkpoint's metadata without reading tensor bytes.

    The result lists every tensor (dtype, global shape, chunks with file,
    offsets, sizes, checksum), the files and their sizes, the world size that
    saved it, the saved plain values, and ``total_bytes``.

    Raises:
        CheckpointNotFoundError: nothing committed at ``url``.
        CorruptCheckpointError: the manifest is damaged or unsafe.

    Example:
        >>> import torch, shardckpt, tempfile
        >>> d = tempfile.mkdtemp(); shardckpt.save({"w": torch.ones(4)}, d)
        >>> m = shardckpt.inspect(d); (m.world_size, m.tensors["w"].shape, m.total_bytes)
        (1, [4], 16)
    """
    return read_manifest(Storage(url, storage_options=storage_options))


VERIFY_BLOCK_BYTES = 32 << 20


def verify(
    url: str, *, storage_options: Optional[Dict[str, Any]] = None, io_threads: int = DEFAULT_IO_THREADS
) -> Manifest:
    """Re-read every byte of a checkpoint and check every checksum.

    Also checks that each data file's safetensors header agrees with the
    manifest (keys, dtypes, shapes, offsets). Reads in bounded blocks, so
    memory stays small whatever the checkpoint size.

    Raises:
        CheckpointNotFoundError: nothing committed at ``url``.
        CorruptCheckpointError / ChecksumMismatchError: listing every damaged
            file and chunk found.

    Example:
        >>> import torch, shardckpt, tempfile
        >>> d = tempfile.mkdtemp(); shardckpt.save({"w": torch.ones(4)}, d)
        >>> shardckpt.verify(d).world_size
        1
    """
    from ._io import crc32c

    storage = Storage(url, storage_options=storage_options)
    m = read_manifest(storage)
    check_files(storage, {rel: f.size for rel, f in m.files.items()})
    by_file: Dict[str, List[Tuple[str, ChunkMeta]]] = {}
    for name, t in m.tensors.items():
        for c in t.chunks:
            by_file.setdefault(c.file, []).append((name, c))

    def check_file(rel: str) -> List[str]:
        errs = []
        size = m.files[rel].size
        head = storage.read_range(rel, 0, min(size, 1 << 20))
        try:
            import struct

            (n,) = struct.unpack("<Q", head[:8]) if len(head) >= 8 else (0,)
            from . import _format

            # Re-read a long header only within the limit: the length prefix is untrusted.
            if 8 + n > len(head) and 8 + n <= size and n <= _format.MAX_HEADER_BYTES:
                head = storage.read_range(rel, 0, 8 + n)
            header, start = parse_safetensors_header(head, file_size=size, where=storage.url_of(rel))
        except CorruptCheckpointError as e:
            return [str(e)]
        for name, c in by_file.get(rel, []):
            e = header.get(c.key)
            want_dt = m.tensors[name].dtype
            if not isinstance(e, dict) or e.get("dtype") != want_dt or e.get("shape") != c.sizes or (
                start + e["data_offsets"][0] != c.byte_offset
            ):
                errs.append(f"{storage.url_of(rel)}: header entry {c.key!r} disagrees with the manifest")
                continue
            if c.crc32c is None:
                continue  # safetensors source: no checksum; header, bounds and size checked
            crc = 0
            for off in range(0, c.nbytes, VERIFY_BLOCK_BYTES):
                n = min(VERIFY_BLOCK_BYTES, c.nbytes - off)
                data = storage.read_range(rel, c.byte_offset + off, n)
                if len(data) != n:
                    errs.append(f"{storage.url_of(rel)}: chunk {c.key!r} truncated")
                    break
                crc = crc32c(data, crc)
            else:
                if crc != c.crc32c:
                    errs.append(
                        f"{storage.url_of(rel)}: chunk {c.key!r} of tensor {name!r} has crc32c {crc:#010x}, "
                        f"manifest says {c.crc32c:#010x}"
                    )
        return errs

    rels = sorted(m.files)
    if io_threads > 1 and len(rels) > 1:
        with ThreadPoolExecutor(max_workers=io_threads) as ex:
            errors = [e for errs in ex.map(check_file, rels) for e in errs]
    else:
        errors = [e for rel in rels for e in check_file(rel)]
    if errors:
        cls = ChecksumMismatchError if all("crc32c" in e for e in errors) else CorruptCheckpointError
        raise cls(f"{storage.url} is damaged ({len(errors)} problems): " + "; ".join(sorted(errors)[:20]))
    return m
