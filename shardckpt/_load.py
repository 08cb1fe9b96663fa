"""load: plan and check, agree, stream, agree, finish.

Load (two agreements between ranks; with several ranks, byte ranges that
several need are read by one and sent to the others in ``_replicas``' agreed
rounds of point-to-point transfers, between steps 2 and 4):
  1. plan and check everything that needs no tensor bytes: the manifest;
     the live state walked; names, shapes and dtypes matched (every offender
     of every kind in one error); self-overlapping targets refused; the data
     files present at their recorded sizes (``_plan_load``, a frozen
     :class:`LoadPlan`);
  2. agree: every rank's plan succeeded (``_collective.agree``, bounded by
     ``collective_timeout_s``) — the point of no return;
  3. stream: ``_readers.read_verified`` reads only the byte ranges this rank
     needs (rounded to checksum blocks; whole chunks for v1), through a
     bounded, reused buffer pool (pinned for CUDA targets), verifies each
     unit, and each piece is ``copy_``-ed (casting where the dtypes differ)
     straight into the live tensor (a DTensor's local tensor). With
     ``atomic=True`` the pieces go to staging tensors instead;
  4. agree: every rank streamed without error (a damaged block names the
     tensors this rank had already overwritten); then, for ``atomic=True``,
     the staged tensors are copied in; then plain values are put back and
     stateful objects get ``load_state_dict``.
"""

from __future__ import annotations

import dataclasses
import functools
import logging
import math
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Callable, Dict, List, Mapping, NamedTuple, Optional, Sequence, Tuple, Union

import torch

from . import _geometry, _knobs, _replicas
from ._collective import Comm, agree, open_comm
from ._format import (
    Manifest,
    TensorMeta,
    open_manifest,
    torch_dtype,
)
from ._format._v2 import materialize
from ._format.chunk import Chunk
from ._format.refs import follow
from ._format.resolve import MetaCache, resolve_chunks
from ._format.values import TAG as _TAG
from ._format.values import decode_value, is_tensor_ref, tensor_names
from ._hf import ALIAS_OF_KEY, select_for_load, select_paths, with_aliases
from ._io import byte_view, check_files, host_empty
from ._layout import TensorLayout, box_view, layout_of
from ._readers import BufferPool, ReadStats, Want, read_verified
from ._state import flatten_for_load
from ._storage import Storage
from .errors import (
    CheckpointError,
    CorruptCheckpointError,
    LoadFailedError,
    StateMismatchError,
    UsageError,
    format_offenders,
)

if TYPE_CHECKING:  # pragma: no cover
    from torch.distributed import ProcessGroup

log = logging.getLogger("shardckpt")

#: ``key_map``: checkpoint name -> state name, as a dict or a callable (None drops).
KeyMap = Union[Mapping[str, str], Callable[[str], Optional[str]]]

__all__ = ["load", "load_into", "LoadResult", "DEFAULT_CAST"]

#: ``load(cast=...)``: floating-point checkpoint tensors load into floating-point
#: live tensors of another precision (bf16 Hub weights into fp32 masters).
DEFAULT_CAST = True

# safetensors dtype names that may be cast into one another (``copy_`` casts).
_FLOATING = frozenset({"F16", "BF16", "F32", "F64", "F8_E4M3", "F8_E5M2", "F8_E4M3FNUZ", "F8_E5M2FNUZ"})


class LoadResult(NamedTuple):
    """What a non-strict load skipped (both empty after a strict load; with several ranks, entries another rank loaded are not listed)."""

    missing_keys: List[str]
    unexpected_keys: List[str]


def _under_roots(name: str, roots: "set[str] | frozenset[str] | Sequence[str]") -> bool:
    """Whether ``name`` is one of ``roots`` or inside one (``roots`` a set: O(dots in the name)).

    Looks up each dotted prefix of ``name`` in the set rather than testing
    every root, so checking every saved name stays linear in the number of
    names however many roots there are (a flat state of 100,000 tensors has
    100,000 roots).

        >>> _under_roots("model.layers.0.w", {"model"}), _under_roots("modelx.w", {"model"})
        (True, False)
    """
    if not isinstance(roots, (set, frozenset)):
        roots = set(roots)
    if name in roots:
        return True
    i = name.find(".")
    while i != -1:
        if name[:i] in roots:
            return True
        i = name.find(".", i + 1)
    return False


@dataclass(frozen=True)
class _Target:
    name: str
    meta: TensorMeta
    parts: Tuple[Tuple[_geometry.Box, torch.Tensor], ...]  # (box, destination view holding that box)
    pieces: Tuple[Tuple[_geometry.Piece, ...], ...]  # per part: the saved pieces that fill it
    chunks: Tuple[Chunk, ...] = ()  # the saved chunks the pieces index
    #: Other ranks may hold the same boxes (a Replicate mesh dim, a plain
    #: tensor in a multi-rank load): only such targets' ranges are offered to
    #: the read-once exchange, so a purely sharded load exchanges nothing.
    replicated: bool = False


@dataclass(frozen=True)
class LoadPlan:
    """What this rank reads and where it goes; built before any byte is read."""

    manifest: Manifest
    targets: Tuple[_Target, ...]
    creates: Mapping[str, Callable[[torch.Tensor], None]]  # names put as new tensors
    created: Mapping[str, torch.Tensor]  # their new tensors, filled by the stream, put after it
    finalizers: Tuple[Callable[[], None], ...]
    result: "LoadResult"


def load(
    state: Optional[Dict[str, Any]],
    url: str,
    *,
    storage_options: Optional[Dict[str, Any]] = None,
    strict: bool = True,
    process_group: Optional["ProcessGroup"] = None,
    io_threads: Optional[int] = None,
    keys: Optional[Sequence[str]] = None,
    key_map: Optional[KeyMap] = None,
    collective_timeout_s: Optional[float] = None,
    no_dist: bool = False,
    atomic: bool = False,
    buffer_bytes: Optional[int] = None,
    cast: bool = DEFAULT_CAST,
) -> LoadResult:
    """Load a checkpoint into ``state`` in place, resharding to the live layout.

    Works at any world size and mesh, and in a single process with no process
    group. Collective when a process group is initialized: every rank of
    ``process_group`` calls it; to load in one process alone (evaluation on
    rank 0), pass ``no_dist=True``. Each rank reads only the byte ranges it
    needs (rounded to checksum blocks; whole saved chunks for format v1),
    through ``buffer_bytes`` of reused buffers, and copies each verified piece
    straight into its tensor. Tensors are filled with ``copy_`` into their
    existing storage (for a DTensor, its local tensor), so Parameters, their
    dtype, device and object identity are kept — FSDP2's all-gather buffers
    see the new values. Plain values are put back into their dicts; stateful
    objects get ``load_state_dict`` once every tensor is in.

    Everything that needs no tensor bytes is checked first, and all ranks
    agree on it before any tensor changes: names, shapes, dtypes (every
    offender of every kind in one error), self-overlapping targets, files
    present at their sizes. Every byte read is verified before it is copied.
    A block that fails its checksum part-way raises on every rank, naming the
    tensors already overwritten; ``atomic=True`` stages everything first (one
    extra copy of the rank's shard in host memory) so that a failed load
    leaves every tensor as it was.

    Args:
        state: the live state, same structure as when saved. Only the entries
            it names are loaded (a model alone from a full training checkpoint
            is fine).
        url: checkpoint directory or fsspec URL.
        storage_options: passed to fsspec.
        strict: if False, entries missing on either side are skipped and
            reported in the result instead of raising. With several ranks,
            a checkpoint entry counts as unexpected only if no rank's state
            holds it, so pipeline stages load a rank-union checkpoint
            strictly (each distinct list of unclaimed names goes to rank 0
            once).
        process_group: group the load runs over (default: the world).
        io_threads: reads in flight per rank (default: ``SHARDCKPT_IO_THREADS``,
            or ``SHARDCKPT_LOAD_CUDA_IO_THREADS`` when this rank's targets are
            CUDA tensors).
        keys: only these checkpoint tensors (names or glob patterns, matched
            against checkpoint names; a pattern that is a checkpoint name
            selects that name exactly, ``[``, ``*`` or ``?`` included); a
            pattern matching nothing raises.
            Usually with ``strict=False``.
        key_map: checkpoint name -> state name: a dict (unlisted names kept)
            or a callable (``None`` drops a tensor), e.g. to load Hugging Face
            names into a differently named model.
        collective_timeout_s: bound of the agreements between ranks (default
            ``SHARDCKPT_COLLECTIVE_TIMEOUT_S``): a rank that does not call
            within it is named and the others raise ``LoadFailedError``.
        no_dist: this process alone, as if no process group existed; every
            tensor of ``state`` must be whole here (a sharded DTensor is refused).
        atomic: all-or-nothing: stage every piece, agree, then copy in.
        buffer_bytes: read buffers held at once (default
            ``SHARDCKPT_LOAD_BUFFER_BYTES``, 64 MiB; for CUDA targets
            ``SHARDCKPT_LOAD_CUDA_BUFFER_BYTES``, 512 MiB, pinned at exact size
            so that reads overlap the host-to-device copies; released before
            ``load`` returns).
        cast: True (default) lets a floating-point checkpoint tensor (F16,
            BF16, F32, F64, FP8) load into a live floating-point tensor of
            another precision, cast while copying (as ``tensor.to`` rounds);
            the live dtype is kept. Integer, bool and complex tensors never
            cast. False demands the exact dtype (``StateMismatchError``
            naming every differing tensor). The rule, in one place:
            ``docs/interop.md``, "Casting on load".

    ``url`` may also be a Hugging Face safetensors directory (with or without
    ``model.safetensors.index.json``) or one ``.safetensors`` file: its bare
    model keys go under the state's ``"model"`` entry (or its only entry),
    unless ``key_map`` says otherwise, and each rank reads only the rows of
    each tensor it holds (ranged reads). Safetensors files carry no
    checksums, so those bytes are checked for size and bounds only.

        >>> shardckpt.load({"model": fsdp_model}, "Llama-3-8B/")   # doctest: +SKIP

    Without a live state (``state`` is ``None`` or ``{}``), on one process
    (not collective): returns ``{path: value}`` for each path ``keys`` asks
    (tensor names, or dotted paths into saved values: ``"train_state.step"``;
    globs allowed), default the top-level entries. Tensors come back as
    plain CPU tensors of the saved dtype (whole, whatever the saving world
    size), values as Python values, containers with both rebuilt:

        >>> shardckpt.load(None, url, keys=["model.lm_head.weight", "train_state.step"])  # doctest: +SKIP
        {'model.lm_head.weight': tensor(...), 'train_state.step': 1200}

    Returns:
        LoadResult(missing_keys, unexpected_keys); without a live state, a dict.

    Raises:
        CheckpointNotFoundError: no ``manifest.json`` at ``url``.
        StateMismatchError: names, shapes or dtypes disagree, a target
            tensor overlaps itself, or (strict) the live model ties two names
            the checkpoint holds as different tensors (all listed, one error);
            after the tensors are in, a stateful object refused its state.
        CorruptCheckpointError: files missing or truncated (nothing changed),
            or a block failing its checksum (``ChecksumMismatchError``; names
            the tensors already overwritten unless ``atomic=True``).
        LoadFailedError: a rank did not call within ``collective_timeout_s`` (named).
        UsageError: under torchrun (``WORLD_SIZE`` > 1) with no process group
            initialised and no ``no_dist=True``.

    Every rank raises the same error type and message (naming the ranks that
    found the problem).

    Limits: memory beyond the model is ``buffer_bytes`` (a v1 chunk larger
    than it is read into one buffer of its size), plus one copy of the rank's
    shard with ``atomic=True``. Byte ranges that several ranks load
    (replicas: HSDP, DDP, replicated parameters) are read by one of them and
    sent to the others over ``process_group`` (``SHARDCKPT_LOAD_READ_ONCE``,
    default on): that adds three buffers of about ``buffer_bytes / 2`` on
    the GPU (NCCL) or in host memory (gloo). A stateful object's ``load_state_dict`` runs
    after the tensors are in; if it raises, the tensors are already loaded: the
    load raises ``StateMismatchError`` (or our error the object raised) on
    every rank, naming them, with the object's exception as ``__cause__``.
    A live model that ties two names the checkpoint holds as different
    tensors is refused with ``strict=True`` (``strict=False``: a warning, the
    first name's values load).
    """
    if state is None or (isinstance(state, dict) and not state):
        return _load_by_keys(url, keys=keys, storage_options=storage_options, io_threads=io_threads)  # type: ignore[return-value]  # keys=: a dict
    comm = open_comm(
        process_group, no_dist=no_dist, collective_timeout_s=collective_timeout_s, op="shardckpt.load", error=LoadFailedError
    )
    storage = follow(Storage(url, storage_options=storage_options))  # format v4 references (_format.refs)
    return load_into(
        state, storage, comm=comm, process_group=process_group, strict=strict, io_threads=io_threads, keys=keys,
        key_map=key_map, atomic=atomic, buffer_bytes=buffer_bytes, cast=cast,
    )


#: ``load_into(stream=...)``: wraps the stream; called with ``run(**stream_into options)``.
StreamHook = Callable[[Callable[..., ReadStats]], ReadStats]


def load_into(
    state: Dict[str, Any],
    storage: Storage,
    *,
    comm: Comm,
    process_group: Optional["ProcessGroup"],
    strict: bool = True,
    io_threads: Optional[int] = None,
    keys: Optional[Sequence[str]] = None,
    key_map: Optional[KeyMap] = None,
    atomic: bool = False,
    buffer_bytes: Optional[int] = None,
    cast: bool = DEFAULT_CAST,
    held: Optional[Callable[[str], bool]] = None,
    stream: Optional[StreamHook] = None,
    opened: Optional[Manifest] = None,
) -> LoadResult:
    """:func:`load` from an open storage and comm (collective): plan and check, agree, stream, agree, finish.

    The one load; :func:`load` and the memory tier's restore call it. The
    memory tier passes ``held`` (which data files this rank's storage holds:
    only those are checked present; the others come from other ranks) and
    ``stream``, which runs the stream itself — ``stream(run)``, ``run`` being
    :func:`stream_into` bound to this load's plan and destinations, taking
    its ``sources=``/``read=`` options, and possibly run again after a
    damaged copy (the plan is made once). ``opened``: the storage's
    manifest, already opened and checked by the caller (not parsed again).

    Raises:
        As :func:`load`.
    """

    def plan_and_check() -> LoadPlan:
        # Chunks are resolved per tensor for the boxes this rank holds (v2:
        # only the index files of the ranks that wrote them are read).
        _refuse_meta_optimizers(state)
        manifest = opened if opened is not None else open_manifest(storage, chunks=False)
        if keys is not None or key_map is not None or manifest.extra.get("source") == "safetensors":
            # Renaming and selection work on whole chunk lists. Materialized
            # before the aliases are added: v2 index rows are keyed by stored
            # names, and an alias shares its stored tensor's chunk list.
            manifest = with_aliases(materialize(manifest, storage))
            manifest = select_for_load(manifest, state, keys=keys, key_map=key_map)
        else:
            manifest = with_aliases(manifest)
        plan = _plan_load(
            state, manifest, strict=strict, rank=comm.rank, world=comm.world, local_only=comm.no_dist, storage=storage, cast=cast,
            union=union,
        )
        needed = needed_files(plan)
        check_files(storage, needed if held is None else {f: n for f, n in needed.items() if held(f)})
        return plan

    # Agree across ranks before touching any tensor: one rank's missing file
    # must not leave the others loaded and this one not. Strict with several
    # ranks: what a rank leaves unclaimed is unexpected only if every rank
    # leaves it (ranks of one pipeline stage send the same list, so each
    # distinct list travels once).
    union = strict and comm.world > 1
    if union:
        plan, _ = agree(
            comm, plan_and_check, what=f"nothing was loaded from {storage.url}", mode="distinct",
            share=lambda p: p.result.unexpected_keys, decide=_nobody_holds,
        )
        # Every entry this rank left is another rank's: a strict load reports none.
        plan = dataclasses.replace(plan, result=LoadResult(plan.result.missing_keys, []))
    else:
        plan, _ = agree(comm, plan_and_check, what=f"nothing was loaded from {storage.url}")
    hook: StreamHook = stream if stream is not None else (lambda run: run())
    if atomic:
        staged = _stage_targets(plan)
        agree(
            comm,
            lambda: hook(functools.partial(
                stream_into, storage, plan, staged, threads=io_threads, buffer_bytes=buffer_bytes, comm=comm, process_group=process_group
            )),
            what=f"nothing was loaded from {storage.url}",
        )
        with torch.no_grad():
            for t, dsts in zip(plan.targets, staged):
                for (_, live), tmp in zip(t.parts, dsts):
                    live.copy_(tmp)
    else:
        agree(
            comm,
            lambda: hook(functools.partial(
                stream_into, storage, plan, None, threads=io_threads, buffer_bytes=buffer_bytes, comm=comm, process_group=process_group
            )),
            what=f"the load from {storage.url} stopped part-way (ranks not named here loaded all their tensors)",
        )
    _finish(comm, storage.url, plan)
    return plan.result


def _finish(comm: Comm, url: str, plan: LoadPlan) -> None:
    """Put created tensors and run the finalizers (``load_state_dict`` of stateful objects...), agreed by every rank.

    They run once every rank's tensors are in. One that raises (a user
    object refusing its saved state: its own version check) cannot be
    checked before: the object decides. The load then raises our error on
    every rank, naming the tensors this rank had already loaded and keeping
    the object's exception as ``__cause__`` (the streaming contract, as for a
    block that fails its checksum part-way).
    """
    original: List[BaseException] = []

    def run() -> None:
        for name, put in plan.creates.items():
            put(plan.created[name])
        for fn in plan.finalizers:
            try:
                fn()
            except Exception as e:
                cause = e.__cause__ if isinstance(e, CheckpointError) and e.__cause__ is not None else e
                original.append(cause)
                loaded = [t.name for t in plan.targets] + sorted(plan.created)
                cls = type(e) if isinstance(e, CheckpointError) else StateMismatchError
                text = str(e) if isinstance(e, CheckpointError) else f"{type(e).__name__}: {e}"
                msg = (f"{text}. The tensors were loaded before it (the live state now holds the checkpoint's "
                       f"values there; load again once this is fixed): {format_offenders(loaded) if loaded else 'none'}")
                try:
                    err = cls(msg)
                except Exception:  # a subclass with another signature
                    err = StateMismatchError(msg)
                raise err from cause

    try:
        agree(comm, run, what=f"the load from {url} stopped after the tensors were loaded", error=LoadFailedError)
    except CheckpointError as e:
        if original and e.__cause__ is not original[0]:
            e.__cause__ = original[0]  # the object's own exception, not our wrapper of it
        raise


def _refuse_meta_optimizers(state: Any) -> None:
    """Refuse, before anything loads, an optimizer built over meta-device parameters.

    Loading materializes a meta model by installing new parameter tensors;
    an optimizer built before holds the old meta ones, so its state could
    not be matched (and the model would be loaded, the optimizer not).
    """
    stack, seen = [(state, "")], 0
    while stack and seen < 10_000:
        node, path = stack.pop()
        seen += 1
        if isinstance(node, torch.optim.Optimizer):
            meta = [i for i, g in enumerate(node.param_groups) for p in g.get("params", ()) if getattr(p, "is_meta", False)]
            if meta:
                raise UsageError(
                    f"{path or 'state'}: the optimizer holds parameters on the meta device (param group(s) "
                    f"{sorted(set(meta))[:10]}): load installs new parameter tensors into a meta model, which an "
                    "optimizer built before does not hold. Build the optimizer after load(), or materialize the "
                    "model first (model.to_empty(device=...)) and build the optimizer on it; nothing was loaded"
                )
        elif isinstance(node, dict):
            stack.extend((v, f"{path}.{k}" if path else str(k)) for k, v in node.items())
        elif isinstance(node, (list, tuple)):
            stack.extend((v, f"{path}.{i}") for i, v in enumerate(node))


def needed_files(plan: LoadPlan) -> Dict[str, int]:
    """``file -> size`` of the data files ``plan`` reads."""
    files = {}
    for t in plan.targets:
        for pieces in t.pieces:
            for p in pieces:
                rel = t.chunks[p.chunk].file
                files[rel] = plan.manifest.files[rel].size
    return files


def _load_by_keys(url: str, *, keys, storage_options, io_threads: Optional[int]) -> Dict[str, Any]:
    """``load(None, url, keys=...)``: what was asked, as plain tensors and values (one process)."""
    storage = follow(Storage(url, storage_options=storage_options))  # format v4 references (_format.refs)
    manifest = with_aliases(open_manifest(storage))
    asked = select_paths(manifest, keys)
    names = sorted({n for node in asked.values() for n in tensor_names(node) if n in manifest.tensors})
    # Reading goes through the one load path (verified reads), into a flat
    # template of new tensors named exactly as saved.
    template = {n: torch.empty(tuple(manifest.tensors[n].shape), dtype=torch_dtype(manifest.tensors[n].dtype)) for n in names}
    if names:
        load(template, url, storage_options=storage_options, io_threads=io_threads, keys=names, key_map={}, no_dist=True)

    def build(node: Any, path: str) -> Any:
        if is_tensor_ref(node):
            return template.get(node.get("name"))
        if isinstance(node, dict) and _TAG in node and node[_TAG] in ("tuple", "dict"):
            if node[_TAG] == "tuple":
                return tuple(build(x, f"{path}.{i}") for i, x in enumerate(node["items"]))
            return {(key := decoded(k, path)): build(v, f"{path}.{key}") for k, v in node["items"]}
        if isinstance(node, dict) and _TAG not in node:
            return {k: build(v, f"{path}.{k}") for k, v in node.items()}
        if isinstance(node, list):
            return [build(x, f"{path}.{i}") for i, x in enumerate(node)]
        return decoded(node, path)

    def decoded(node: Any, path: str) -> Any:
        try:
            return decode_value(node)
        except CorruptCheckpointError as e:
            # Damage named by its saved path, as the live-state path reports it.
            raise CorruptCheckpointError(f"{path}: {e}") from None

    # Selected paths sorted (the values inside them keep their saved order).
    out = {}
    for path in sorted(asked):
        try:
            out[path] = build(asked[path], path)
        except (KeyError, TypeError, ValueError) as e:
            # A malformed container node ("items" missing or not pairs) is
            # damage too; our other errors pass unchanged.
            if isinstance(e, CheckpointError):
                raise
            raise CorruptCheckpointError(f"{path}: saved value cannot be decoded ({type(e).__name__}: {e})") from None
    return out




def _stage_targets(plan: LoadPlan) -> List[List[torch.Tensor]]:
    """Host tensors shaped like each destination: ``atomic=True`` streams into these first."""
    return [[torch.empty(tuple(dst.shape), dtype=dst.dtype) for _, dst in t.parts] for t in plan.targets]


def saved_chunks(manifest: Manifest, storage: Optional[Storage], name: str, boxes, cache: Optional[MetaCache]) -> List[Chunk]:
    """The saved chunks of ``name`` meeting ``boxes``, as the reader takes them (``_format.resolve_chunks``).

    A tensor whose chunk list the manifest holds (v1, Hugging Face, renamed
    or keyed loads) reads no index file; ``storage`` may then be None. An
    alias of a tied weight resolves through the tensor it names.
    """
    stored = manifest.extra.get(ALIAS_OF_KEY, {}).get(name, name)
    return resolve_chunks(manifest, storage, stored, boxes, cache=cache)


def _strides(sizes: Sequence[int]) -> Tuple[int, ...]:
    out, acc = [], 1
    for n in reversed(sizes):
        out.append(acc)
        acc *= n
    return tuple(reversed(out))


@dataclass(frozen=True)
class _Copy:
    """Deliver-time job: copy elements of a saved chunk (a box of it) into ``dst``."""

    target: int
    dst: torch.Tensor
    src_offsets: Tuple[int, ...]
    sizes: Tuple[int, ...]
    strides: Tuple[int, ...]  # the chunk's, contiguous
    first: int  # flat element index of the first byte read
    dtype: torch.dtype


def _wants(plan: LoadPlan, dests: Sequence[Sequence[torch.Tensor]], range_bytes: int) -> List[Want]:
    """Byte ranges to read, one per piece cut to at most ``range_bytes`` of its chunk (along dim 0)."""
    out: List[Want] = []
    for ti, t in enumerate(plan.targets):
        chunks = t.chunks
        dtype = torch_dtype(t.meta.dtype)
        isz = torch.empty((), dtype=dtype).element_size()
        for dst_part, pieces in zip(dests[ti], t.pieces):
            for p in pieces:
                c = chunks[p.chunk]
                strides = _strides(c.sizes)
                if not p.sizes or math.prod(p.sizes) == 0:
                    if not p.sizes and c.nbytes:  # a 0-d tensor
                        out.append(Want(c, 0, c.nbytes, _Copy(ti, dst_part, (), (), (), 0, dtype)))
                    continue
                row_bytes = strides[0] * isz
                rows = max(1, range_bytes // max(row_bytes, 1))
                for r in range(0, p.sizes[0], rows):
                    n = min(rows, p.sizes[0] - r)
                    src = (p.src_offsets[0] + r,) + tuple(p.src_offsets[1:])
                    sizes = (n,) + tuple(p.sizes[1:])
                    first = sum(o * st for o, st in zip(src, strides))
                    last = sum((o + k - 1) * st for o, k, st in zip(src, sizes, strides))
                    dst = box_view(dst_part, (p.dst_offsets[0] + r,) + tuple(p.dst_offsets[1:]), sizes)
                    out.append(Want(c, first * isz, (last + 1) * isz, _Copy(ti, dst, src, sizes, strides, first, dtype)))
    return out


def _host_alloc(pinned: bool):
    """The pool's allocator: plain host tensors, or page-locked ones of exactly the size asked."""

    def alloc(n: int):
        t = host_empty(n)  # byte_view can view it writably, NumPy or not
        if pinned and n and int(torch.cuda.cudart().cudaHostRegister(t.data_ptr(), n, 0)) != 0:
            pinned_t = torch.empty(n, dtype=torch.uint8, pin_memory=True)  # registration refused: the allocator's
            return byte_view(pinned_t), (pinned_t, False)
        return byte_view(t), (t, pinned and n > 0)

    def free(owner) -> None:
        t, registered = owner
        if registered:
            try:
                torch.cuda.cudart().cudaHostUnregister(t.data_ptr())
            except Exception:  # the memory is freed either way; never fail a load on this
                pass

    return alloc, free


def load_settings(cuda: bool, *, threads: Optional[int] = None, buffer_bytes: Optional[int] = None) -> Tuple[int, int]:
    """``(io threads, buffer bytes)`` of a load: the values given, else the defaults for its targets.

    CUDA targets: ``SHARDCKPT_LOAD_CUDA_IO_THREADS`` and
    ``SHARDCKPT_LOAD_CUDA_BUFFER_BYTES`` (pinned buffers, so reads overlap
    the device copies); otherwise ``SHARDCKPT_IO_THREADS`` and
    ``SHARDCKPT_LOAD_BUFFER_BYTES`` (host memory beyond the model stays
    small). Knobs are read at call time.

        >>> load_settings(False, threads=2, buffer_bytes=1 << 20)
        (2, 1048576)
    """
    if threads is None:
        threads = _knobs.LOAD_CUDA_IO_THREADS if cuda else _knobs.IO_THREADS
    if buffer_bytes is None:
        buffer_bytes = _knobs.LOAD_CUDA_BUFFER_BYTES if cuda else _knobs.LOAD_BUFFER_BYTES
    return threads, buffer_bytes


def stream_into(
    storage: Storage,
    plan: LoadPlan,
    staged: Optional[Sequence[Sequence[torch.Tensor]]],
    *,
    threads: Optional[int] = None,
    buffer_bytes: Optional[int] = None,
    stats: Optional[ReadStats] = None,
    comm: Optional[Comm] = None,
    process_group: Optional["ProcessGroup"] = None,
    sources: Optional[_replicas.Sources] = None,
    read: Callable[..., ReadStats] = read_verified,
) -> ReadStats:
    """Read, verify and copy every piece of ``plan`` into its tensor (or into ``staged``).

    ``threads``/``buffer_bytes`` None: :func:`load_settings` for the targets.
    With ``comm`` of several ranks (the load's; collective then), a byte
    range several ranks need is read by one of them and sent to the others
    over ``process_group`` (``shardckpt/_replicas.py``;
    ``SHARDCKPT_LOAD_READ_ONCE=0`` turns it off). With ``sources`` (the
    memory tier: ``storage`` holds only some files), a range of a file this
    rank's storage lacks is read by a rank that has it and sent here, over
    the same transfer engine (always on). ``read``: the verified reader
    (``_readers.read_verified``, or a wrapper of it).

    Raises:
        ChecksumMismatchError / CorruptCheckpointError / StorageError: as the
            reader does; unless staging, the message names the tensors this
            rank had already overwritten.
    """
    dests = staged if staged is not None else [[dst for _, dst in t.parts] for t in plan.targets]
    cuda = staged is None and torch.cuda.is_available() and any(d.is_cuda for ds in dests for d in ds)
    threads, buffer_bytes = load_settings(cuda, threads=threads, buffer_bytes=buffer_bytes)
    range_bytes = min(_knobs.LOAD_RANGE_BYTES, buffer_bytes)
    alloc, free = _host_alloc(cuda)
    pool = BufferPool(buffer_bytes, slot_bytes=range_bytes, alloc=alloc, free=free)
    touched: Dict[int, None] = {}
    events: List[Any] = []

    def place(w: Want, raw: torch.Tensor):
        """Copy a want's bytes (``raw``: uint8, host or device) into its destination; a fence or None."""
        job: _Copy = w.tag
        isz = raw.new_empty((), dtype=job.dtype).element_size()
        if raw.data_ptr() % isz:
            raw = raw.clone()  # a foreign file's chunk not aligned to its item size
        flat = raw.view(job.dtype)
        # as_strided's offset counts from the start of the storage, not of the view.
        at = flat.storage_offset() + sum(o * s for o, s in zip(job.src_offsets, job.strides)) - job.first
        src = flat.as_strided(job.sizes, job.strides, at)
        touched[job.target] = None
        if job.dst.is_cuda or src.is_cuda:
            job.dst.copy_(src, non_blocking=True)
            ev = torch.cuda.Event()
            ev.record()
            events.append(ev)
            return ev
        job.dst.copy_(src)
        return None

    def deliver(w: Want, data: memoryview, owner, off: int):
        return place(w, owner[0][off : off + len(data)])

    wants = _wants(plan, dests, range_bytes)
    stats = stats or ReadStats()
    stats.needed_bytes += sum(w.stop - w.start for w in wants)
    try:
        with torch.no_grad():
            if sources is not None and comm is not None and comm.world > 1 and not _replicas.transfer_device(process_group):
                raise LoadFailedError(
                    f"{comm.op}: the process group's backend ({process_group!r}) can send neither CPU nor CUDA tensors: "
                    "the memory tier needs gloo or NCCL"
                )
            if comm is not None and comm.world > 1 and (_replicas.enabled() or sources is not None) and _replicas.transfer_device(process_group):
                # Ranges several ranks need are read by one and sent to the others.
                return _replicas.read_once(
                    storage, wants, comm=comm, group=process_group, read=read, deliver=deliver, place=place,
                    shareable=lambda w: plan.targets[w.tag.target].replicated and _replicas.enabled(),
                    pool=pool, threads=threads, stats=stats,
                    # The memory tier's rounds carry a shard, not a few replicated tensors: fewer, larger ones.
                    round_bytes=max(range_bytes, buffer_bytes if sources is not None else buffer_bytes // 2),
                    sources=sources,
                )
            return read(storage, wants, deliver, threads=threads, pool=pool, stats=stats)
    except CheckpointError as e:
        if staged is None and touched:
            names = [plan.targets[i].name for i in touched]
            raise type(e)(f"{e}. Tensors already overwritten: {format_offenders(names)}; load a good checkpoint "
                          "into this state again (atomic=True stages first and changes nothing on failure)") from None
        raise
    finally:
        pool.close()  # waits for the device copies; releases the pinned memory
        if events:
            events[-1].synchronize()


def _nobody_holds(groups) -> Tuple[None, List[None]]:
    """Rank 0 of a strict multi-rank load: refuse the checkpoint entries that no rank's state holds.

    ``groups``: ``_collective.Group``s whose values are the ranks' unclaimed
    names (sorted lists). Raises ``StateMismatchError`` (on every rank).
    """
    nobody = set(groups[0].value)
    for g in groups[1:]:
        nobody &= set(g.value)
    if nobody:
        raise StateMismatchError(
            "cannot load, state and checkpoint disagree: in the checkpoint but not in the state of any rank: "
            f"{format_offenders(sorted(nobody))}. Pass strict=False to load the common entries."
        )
    return None, [None] * len(groups)


def _replicated(lay: TensorLayout) -> bool:
    """Whether other ranks may hold boxes of this live tensor too (replicas: read-once candidates)."""
    if lay.regular is not None:
        return any(isinstance(p, _geometry.Replicate) and n > 1 for p, n in zip(lay.regular.placements, lay.regular.mesh_shape))
    return any(len(h) > 1 for h in lay.holders.values())


def dtype_problem(name: str, saved: str, live: str, *, cast: bool = DEFAULT_CAST) -> Optional[str]:
    """Why a checkpoint tensor of dtype ``saved`` cannot fill a live tensor of dtype ``live``, or None.

    The one rule (``docs/interop.md``, "Casting on load"): equal dtypes
    always load; two floating-point dtypes load when ``cast`` (the copy
    rounds to the live dtype); anything else — integers, bool, complex,
    integer <-> float — is refused, so no index or count is silently changed.

        >>> dtype_problem("w", "BF16", "F32") is None
        True
    """
    if saved == live:
        return None
    if saved in _FLOATING and live in _FLOATING:
        if cast:
            return None
        return f"{name}: checkpoint dtype {saved}, live dtype {live} (cast=False refuses casting)"
    return f"{name}: checkpoint dtype {saved}, live dtype {live} (only floating-point tensors are cast)"


def live_nothing_loaded(flat, creates, manifest: Manifest) -> bool:
    """A non-strict load that would fill no tensor and no value although the state asks for some."""
    asked = bool(flat.tensors) or bool(flat.creates)
    hit = any(n in manifest.tensors for n in flat.tensors) or bool(creates)
    return asked and not hit and not flat.value_paths


def _untied_copies(manifest: Manifest, storage: Optional[Storage], tied: Sequence[Tuple[str, str]],
                   cache: MetaCache) -> List[Tuple[str, str, Optional[bool]]]:
    """For each ``(loaded, other)`` name pair the live model ties: whether the checkpoint's two tensors are equal.

    Decided from metadata only, before any byte is read: one stored tensor
    under two names (a tied save, an alias) is equal; else equal when every
    chunk has the same box and the same content hash, or the same CRC-32Cs
    (whole and per block); different when any of them differs, or the dtype
    or shape does; None when there is nothing to compare by (a Hugging Face
    file has no checksums, or the two were chunked differently).
    """
    stored = manifest.extra.get(ALIAS_OF_KEY, {}) or {}
    out: List[Tuple[str, str, Optional[bool]]] = []
    for a, b in tied:
        if a not in manifest.tensors or b not in manifest.tensors or stored.get(a, a) == stored.get(b, b):
            continue
        ta, tb = manifest.tensors[a], manifest.tensors[b]
        if ta.dtype != tb.dtype or list(ta.shape) != list(tb.shape):
            out.append((a, b, False))
            continue
        whole = [((0,) * len(ta.shape), tuple(ta.shape))]
        ca, cb = (sorted(saved_chunks(manifest, storage, n, whole, cache), key=lambda c: tuple(c.offsets)) for n in (a, b))
        same: Optional[bool] = True
        if [(tuple(c.offsets), tuple(c.sizes)) for c in ca] != [(tuple(c.offsets), tuple(c.sizes)) for c in cb]:
            same = None
        else:
            for x, y in zip(ca, cb):
                if x.content_hash and y.content_hash:
                    if x.content_hash != y.content_hash:
                        same = False
                        break
                elif x.crc32c is None and not x.block_crcs or y.crc32c is None and not y.block_crcs:
                    same = None
                elif (x.crc32c, x.block_bytes, tuple(x.block_crcs)) != (y.crc32c, y.block_bytes, tuple(y.block_crcs)):
                    same = False
                    break
        out.append((a, b, same))
    return out


def _self_overlapping(t: torch.Tensor) -> bool:
    """Whether some element of ``t`` shares memory with another (``expand``-ed, stride 0...)."""
    if t.numel() <= 1:
        return False
    if any(st == 0 and n > 1 for st, n in zip(t.stride(), t.shape)):
        return True
    # 1: overlaps, 0: does not, 2: too hard to tell -> check by sorting the spans.
    verdict = torch._debug_has_internal_overlap(t)
    if verdict != 2:
        return verdict == 1
    dims = sorted((st, n) for st, n in zip(t.stride(), t.shape) if n > 1)
    extent = 1
    for st, n in dims:
        if st < extent:
            return True
        extent = st * (n - 1) + extent
    return False


def _plan_load(
    state,
    manifest: Manifest,
    *,
    strict: bool,
    rank: int,
    world: int,
    local_only: bool = False,
    storage: Optional[Storage] = None,
    cast: bool = DEFAULT_CAST,
    union: bool = False,
) -> LoadPlan:
    # union: several ranks load together; an entry this rank does not hold is
    # unexpected only if no rank holds it (pipeline stages), which the load
    # decides across ranks (_nobody_holds) instead of here.
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
    roots, skip = set(flat.roots), set(flat.skip)
    unexpected = sorted(
        n for n in manifest.tensors if n not in claimed and _under_roots(n, roots) and not _under_roots(n, skip)
    )
    missing_all = sorted(set(missing) | set(missing_values))
    unexpected_all = sorted(set(unexpected) | set(unexpected_values))
    # Every kind of disagreement goes into one error: fixing one kind must
    # not only reveal the next.
    parts: List[str] = []
    if strict and missing_all:
        parts.append(f"missing from the checkpoint: {format_offenders(missing_all)}")
    if strict and unexpected_all and not union:
        parts.append(f"in the checkpoint but not in the state: {format_offenders(unexpected_all)}")
    if not strict and live_nothing_loaded(flat, creates, manifest):
        raise StateMismatchError(
            "strict=False would load nothing: no tensor of the state is in the checkpoint "
            f"(state: {format_offenders(missing_all, limit=5)}; checkpoint: {format_offenders(sorted(manifest.tensors), limit=5)}). "
            "Map the names with key_map= (or keys=), or check that this is the right checkpoint"
        )
    problems: List[str] = []
    targets: List[_Target] = []
    created: Dict[str, torch.Tensor] = {}
    wanted = [(n, live[n]) for n in sorted(live) if n in manifest.tensors]
    cache = MetaCache()
    for name in sorted(creates):
        meta = manifest.tensors[name]
        created[name] = torch.empty(tuple(meta.shape), dtype=torch_dtype(meta.dtype))
        wanted.append((name, created[name]))
    for name, tensor in wanted:
        meta = manifest.tensors[name]
        lay = layout_of(name, tensor, rank=rank, world_size=world, local_only=local_only if name not in created else True)
        if list(lay.shape) != list(meta.shape):
            problems.append(f"{name}: checkpoint shape {list(meta.shape)}, live shape {list(lay.shape)}")
            continue
        why = dtype_problem(name, meta.dtype, lay.dtype, cast=cast)
        if why is not None:
            problems.append(why)
            continue
        views = [p.view() for p in lay.parts]
        if any(_self_overlapping(v) for v in views):
            problems.append(
                f"{name}: the live tensor overlaps itself (an expand()-ed or stride-0 tensor); "
                "loading into it would write several values to one element — give it its own memory (.clone())"
            )
            continue
        # Chunks without checksums (safetensors sources) are read exactly;
        # checksummed ones are rounded to their blocks by the reader.
        boxes = [(p.box.offsets, p.box.sizes) for p in lay.parts if p.box.numel]
        chunks = tuple(saved_chunks(manifest, storage, name, boxes, cache)) if boxes else ()
        saved = [_geometry.Box(c.offsets, c.sizes) for c in chunks]
        parts_ = tuple((p.box, v) for p, v in zip(lay.parts, views))
        try:
            pieces = tuple(
                tuple(_geometry.plan_reads(saved, [_geometry.LocalBox(box, (0,) * len(box.offsets))])) for box, _ in parts_
            )
        except ValueError as e:
            raise CorruptCheckpointError(f"{name}: the checkpoint's chunks do not cover what this rank holds: {e}") from None
        targets.append(_Target(name, meta, parts_, pieces, chunks, replicated=_replicated(lay)))
    untied = _untied_copies(manifest, storage, flat.tied, cache)
    differ = [f"{b} (tied to {a} in the live model)" for a, b, same in untied if same is False]
    if strict and differ:
        parts.append(
            "the checkpoint holds two different tensors where the live model ties one (an untied checkpoint; "
            f"loading would keep the first name's values and drop the other's): {format_offenders(differ, sep='; ')}. "
            "Untie the live model to load both (e.g. tie_word_embeddings=False), or pass strict=False to load the first "
            "name's values into the tied tensor (with a warning)"
        )
    for a, b, same in untied:
        if same is not True and not (strict and same is False):
            log.warning(
                "shardckpt: %s and %s are one tensor in the live model (tied) but two tensors in the checkpoint%s: "
                "%s's values were loaded, %s's were not used",
                a, b, "" if same is False else " that may differ (no checksums to compare them by)", a, b,
            )
    if problems:
        parts.append(f"{len(problems)} tensor(s) differ: " + format_offenders(problems, sep="; "))
    if parts:
        hint = " Pass strict=False to load the common entries." if strict and (missing_all or (unexpected_all and not union)) else ""
        if any("cast=False" in p for p in problems):
            hint += " Pass cast=True (the default) to cast floating-point tensors to the live dtype."
        elif any("are cast" in p for p in problems):
            hint += " Convert the live tensors (or the checkpoint) to the saved dtype; integers and bools are never cast."
        raise StateMismatchError("cannot load, state and checkpoint disagree: " + "; ".join(parts) + "." + hint)
    return LoadPlan(
        manifest=manifest,
        targets=tuple(targets),
        creates=creates,
        created=created,
        finalizers=tuple(flat.finalizers),
        result=LoadResult(missing_all, unexpected_all),
    )
