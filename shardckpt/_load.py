"""load: validate, read, agree, apply.

Load (no collective except one agreement before touching tensors):
  1. plan: read and validate the manifest; walk the live state; match names,
     shapes and dtypes, listing every offender (``_plan_load``, a frozen
     :class:`LoadPlan`);
  2. read: only the saved chunks overlapping this rank's boxes, coalesced and
     in parallel, verified against their checksums into staging memory;
  3. agree: every rank's plan and read succeeded (``_collective.agree``,
     bounded by ``collective_timeout_s``, the same error on every rank);
  4. apply: copy into the live tensors in place (``copy_`` into a DTensor's
     local tensor), then put back plain values and call ``load_state_dict``
     on stateful objects.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Callable, Dict, List, Mapping, NamedTuple, Optional, Sequence, Tuple, Union

import torch

from . import _plan
from ._format import (
    ChunkMeta,
    Manifest,
    TensorMeta,
    open_manifest,
    torch_dtype,
)
from ._io import DEFAULT_IO_THREADS, as_dtype, check_files, read_chunks
from ._collective import DEFAULT_COLLECTIVE_TIMEOUT_S, agree, open_comm
from ._layout import box_view, layout_of
from ._state import flatten_for_load
from ._storage import Storage
from .errors import (
    LoadFailedError,
    StateMismatchError,
    format_offenders,
)

if TYPE_CHECKING:  # pragma: no cover
    from torch.distributed import ProcessGroup

#: ``key_map``: checkpoint name -> state name, as a dict or a callable (None drops).
KeyMap = Union[Mapping[str, str], Callable[[str], Optional[str]]]

__all__ = ["load", "LoadResult", "read_manifest"]


class LoadResult(NamedTuple):
    """What a non-strict load skipped (both empty after a strict load)."""

    missing_keys: List[str]
    unexpected_keys: List[str]


#: Read and validate a committed checkpoint (``_format.open_manifest``; a storage object or a URL).
read_manifest = open_manifest


def _under_roots(name: str, roots: Sequence[str]) -> bool:
    return any(name == r or name.startswith(r + ".") for r in roots)


@dataclass(frozen=True)
class _Target:
    name: str
    meta: TensorMeta
    parts: Tuple[Tuple[_plan.Box, torch.Tensor], ...]  # (box, destination view holding that box)
    pieces: Tuple[Tuple[_plan.Piece, ...], ...]  # per part: the saved pieces that fill it


@dataclass(frozen=True)
class LoadPlan:
    """What this rank reads and where it goes; built before any byte is read."""

    manifest: Manifest
    targets: Tuple[_Target, ...]
    creates: Mapping[str, Callable[[torch.Tensor], None]]  # names put as new tensors
    finalizers: Tuple[Callable[[], None], ...]
    result: "LoadResult"


def load(
    state: Dict[str, Any],
    url: str,
    *,
    storage_options: Optional[Dict[str, Any]] = None,
    strict: bool = True,
    process_group: Optional["ProcessGroup"] = None,
    io_threads: int = DEFAULT_IO_THREADS,
    keys: Optional[Sequence[str]] = None,
    key_map: Optional[KeyMap] = None,
    collective_timeout_s: float = DEFAULT_COLLECTIVE_TIMEOUT_S,
    no_dist: bool = False,
) -> LoadResult:
    """Load a checkpoint into ``state`` in place, resharding to the live layout.

    Works at any world size and mesh, and in a single process with no process
    group. Collective when a process group is initialized: every rank of
    ``process_group`` calls it (ranks agree before any tensor changes); to
    load in one process alone (evaluation on rank 0), pass ``no_dist=True``.
    Each rank reads only the saved chunks that overlap what it holds.
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
            against checkpoint names; a pattern that is a checkpoint name
            selects that name exactly, ``[``, ``*`` or ``?`` included); a
            pattern matching nothing raises.
            Usually with ``strict=False``.
        key_map: checkpoint name -> state name: a dict (unlisted names kept)
            or a callable (``None`` drops a tensor), e.g. to load Hugging Face
            names into a differently named model.
        collective_timeout_s: bound of the agreement between ranks (default
            ``SHARDCKPT_COLLECTIVE_TIMEOUT_S``): a rank that does not call
            within it is named and the others raise ``LoadFailedError``.
        no_dist: this process alone, as if no process group existed; every
            tensor of ``state`` must be whole here (a sharded DTensor is refused).

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
        LoadFailedError: a rank did not call within ``collective_timeout_s`` (named).
        UsageError: under torchrun (``WORLD_SIZE`` > 1) with no process group
            initialised and no ``no_dist=True``.

    Every rank raises the same error type and message (naming the ranks that
    found the problem); nothing was loaded on any rank.

    Memory: the bytes this rank needs are staged in host memory, verified,
    then copied — about one extra copy of the rank's shard at peak.
    """
    comm = open_comm(
        process_group, no_dist=no_dist, collective_timeout_s=collective_timeout_s, op="shardckpt.load", error=LoadFailedError
    )
    storage = Storage(url, storage_options=storage_options)

    def plan_and_read():
        manifest = read_manifest(storage)
        if keys is not None or key_map is not None or manifest.extra.get("source") == "safetensors":
            from ._hf import select_for_load

            manifest = select_for_load(manifest, state, keys=keys, key_map=key_map)
        plan = _plan_load(state, manifest, strict=strict, rank=comm.rank, world=comm.world, local_only=comm.no_dist)
        return plan, _read(storage, plan, io_threads)

    # Agree across ranks before touching any tensor: one rank's damaged file
    # must not leave the others loaded and this one not.
    (plan, (staged, chunk_index)), _ = agree(comm, plan_and_read, what=f"nothing was loaded from {storage.url}")
    _apply(plan, staged, chunk_index)
    return plan.result


def _read(storage: Storage, plan: LoadPlan, io_threads: int):
    """Fetch and verify every saved chunk this rank needs: ``(staged tensors, (name, chunk) -> index)``."""
    chunk_list, chunk_index = _needed_chunks(plan.targets, plan.creates, plan.manifest)
    check_files(storage, {c.file: plan.manifest.files[c.file].size for c in chunk_list})
    pin = any(p[1].is_cuda for t in plan.targets for p in t.parts) and torch.cuda.is_available()
    return read_chunks(storage, chunk_list, threads=io_threads, pin_memory=pin), chunk_index


def _apply(plan: LoadPlan, staged, chunk_index) -> None:
    """Copy the verified bytes into the live state, then run the finalizers (load_state_dict...)."""
    manifest = plan.manifest
    with torch.no_grad():
        for t in plan.targets:
            dtype = torch_dtype(t.meta.dtype)
            for (box, dst), pieces in zip(t.parts, t.pieces):
                for p in pieces:
                    c = t.meta.chunks[p.chunk]
                    src = as_dtype(staged[chunk_index[(t.name, p.chunk)]], dtype, c.sizes)
                    box_view(dst, p.dst_offsets, p.sizes).copy_(box_view(src, p.src_offsets, p.sizes))
        for name, put in plan.creates.items():
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
    for fn in plan.finalizers:
        fn()


def _plan_load(state, manifest: Manifest, *, strict: bool, rank: int, world: int, local_only: bool = False) -> LoadPlan:
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
        lay = layout_of(name, live[name], rank=rank, world_size=world, local_only=local_only)
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
        parts = tuple((p.box, p.view()) for p in lay.parts)
        pieces = tuple(
            tuple(_plan.plan_reads(saved, [_plan.LocalBox(box, (0,) * len(box.offsets))])) for box, _ in parts
        )
        targets.append(_Target(name, meta, parts, pieces))
    if problems:
        raise StateMismatchError(
            f"cannot load, {len(problems)} tensor(s) differ: " + format_offenders(problems, sep="; ")
        )
    return LoadPlan(
        manifest=manifest,
        targets=tuple(targets),
        creates=creates,
        finalizers=tuple(flat.finalizers),
        result=LoadResult(missing_all, unexpected_all),
    )


def _needed_chunks(targets: Sequence[_Target], creates, manifest: Manifest):
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
