"""load: validate, read, agree, apply.

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

from dataclasses import dataclass, field
from typing import Any, Dict, List, NamedTuple, Optional, Sequence, Tuple

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
from ._layout import box_view, dist_info, layout_of
from ._state import flatten_for_load
from ._storage import Storage
from .errors import (
    CorruptCheckpointError,
    StateMismatchError,
    format_offenders,
)

from ._collective import _all_gather

__all__ = ["load", "LoadResult", "read_manifest"]


class LoadResult(NamedTuple):
    """What a non-strict load skipped (both empty after a strict load)."""

    missing_keys: List[str]
    unexpected_keys: List[str]


#: Read and validate a committed checkpoint (``_format.open_manifest``; a storage object or a URL).
read_manifest = open_manifest


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
