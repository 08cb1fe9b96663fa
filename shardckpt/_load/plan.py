"""Plan a load: everything that needs no tensor bytes, checked before any tensor changes.

:func:`plan_load` opens the manifest (or takes the caller's), selects and
renames (``keys=``/``key_map=``), walks the live state, matches names,
shapes and dtypes (every offender of every kind in one error), refuses
self-overlapping targets, resolves the saved chunks each target needs and
the pieces that fill it, checks the data files it reads are present at
their recorded sizes, and returns a frozen :class:`LoadPlan` that knows its
files (:attr:`LoadPlan.files`) and chunks. Pure apart from reading metadata
(the manifest, index files, file sizes); no tensor byte is read here.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass, field
from typing import Any, Callable, Dict, List, Mapping, NamedTuple, Optional, Sequence, Tuple, Union

import torch

from .. import _geometry
from .._format import Manifest, TensorMeta, open_manifest, torch_dtype, with_block_scales
from .._format._v2 import materialize
from .._format.chunk import Chunk
from .._format.files import check_files
from .._format.resolve import MetaCache, Reads, resolve_chunks, resolve_reads
from .._hf import ALIAS_OF_KEY, select_for_load, with_aliases
from .._layout import TensorLayout, layout_of
from .._state import flatten_for_load
from .._storage import Storage
from ..errors import CorruptCheckpointError, StateMismatchError, UsageError, format_offenders

__all__ = [
    "KeyMap", "DEFAULT_CAST", "LoadResult", "Target", "ScaleSource", "LoadPlan", "plan_load", "plan_for_manifest",
    "open_for_load", "saved_chunks", "dtype_problem", "live_nothing_loaded", "new_tensors",
]

log = logging.getLogger("shardckpt")

#: ``key_map``: checkpoint name -> state name, as a dict or a callable (None drops).
KeyMap = Union[Mapping[str, str], Callable[[str], Optional[str]]]

#: ``load(cast=...)``: floating-point checkpoint tensors load into floating-point
#: live tensors of another precision (bf16 Hub weights into fp32 masters).
DEFAULT_CAST = True

# safetensors dtype names that may be cast into one another (``copy_`` casts).
_FLOATING = frozenset({"F16", "BF16", "F32", "F64", "F8_E4M3", "F8_E5M2", "F8_E4M3FNUZ", "F8_E5M2FNUZ"})


class LoadResult(NamedTuple):
    """What a non-strict load skipped (both empty after a strict load; with several ranks, entries another rank loaded are not listed)."""

    missing_keys: List[str]
    unexpected_keys: List[str]


@dataclass(frozen=True)
class Target:
    """One live tensor a load fills: its boxes' destination views and the saved pieces that fill each."""

    name: str
    meta: TensorMeta
    parts: Tuple[Tuple[_geometry.Box, torch.Tensor], ...]  # (box, destination view holding that box)
    pieces: Tuple[Tuple[_geometry.Piece, ...], ...]  # per part: the saved pieces that fill it
    chunks: Tuple[Chunk, ...] = ()  # the saved chunks the pieces index
    #: Other ranks may hold the same boxes (a Replicate mesh dim, a plain
    #: tensor in a multi-rank load): only such targets' ranges are offered to
    #: the read-once exchange, so a purely sharded load exchanges nothing.
    replicated: bool = False
    #: A block-FP8 weight (Hugging Face sources): the whole chunk of its
    #: ``_scale_inv`` tensor (the stream reads the rows this rank needs) and
    #: the block; None for every other tensor.
    scale: Optional["ScaleSource"] = None


@dataclass(frozen=True)
class ScaleSource:
    """Where a block-FP8 target's scales are stored: one whole chunk (safetensors) of ``dtype``, ``block`` = (rows, cols)."""

    chunk: Chunk
    dtype: str
    block: Tuple[int, int]


@dataclass(frozen=True)
class LoadPlan:
    """What this rank reads and where it goes; built before any byte is read (:func:`plan_load`).

    ``cache`` holds the metadata the plan read (index files, headers): a
    caller that resolves more chunks of the same checkpoint (the memory
    tier, for ranges it reads only to send) reuses it instead of parsing
    them again.
    """

    manifest: Manifest
    targets: Tuple[Target, ...]
    creates: Mapping[str, Callable[[torch.Tensor], None]]  # names put as new tensors
    created: Mapping[str, torch.Tensor]  # their new tensors, filled by the stream, put after it
    finalizers: Tuple[Callable[[], None], ...]
    result: LoadResult
    cache: MetaCache = field(default_factory=MetaCache, compare=False, repr=False)

    @property
    def files(self) -> Dict[str, int]:
        """``file -> size`` of the data files this plan reads."""
        files = {}
        for t in self.targets:
            for pieces in t.pieces:
                for p in pieces:
                    rel = t.chunks[p.chunk].file
                    files[rel] = self.manifest.files[rel].size
            if t.scale is not None and any(t.pieces):
                files[t.scale.chunk.file] = self.manifest.files[t.scale.chunk.file].size
        return files

    @property
    def chunks(self) -> Tuple[Chunk, ...]:
        """Every saved chunk this plan reads from (each once, in target order)."""
        seen: Dict[Tuple[str, int], Chunk] = {}
        for t in self.targets:
            for pieces in t.pieces:
                for p in pieces:
                    c = t.chunks[p.chunk]
                    seen.setdefault((c.file, c.byte_offset), c)
        return tuple(seen.values())


def plan_load(
    state: Dict[str, Any],
    storage: Storage,
    *,
    rank: int,
    world: int,
    strict: bool = True,
    keys: Optional[Sequence[str]] = None,
    key_map: Optional[KeyMap] = None,
    cast: bool = DEFAULT_CAST,
    resize: bool = False,
    local_only: bool = False,
    union: bool = False,
    opened: Optional[Manifest] = None,
    held: Optional[Callable[[str], bool]] = None,
) -> LoadPlan:
    """The checked plan of one rank's load of ``storage`` into ``state`` (no tensor byte read; nothing changed).

    Args:
        state: the live state (as :func:`shardckpt.load` takes it).
        storage: the checkpoint's storage (references already followed).
        rank, world: this rank in the load's group, and its size.
        strict, keys, key_map, cast, resize: as :func:`shardckpt.load`.
        local_only: this process alone (``no_dist``): every tensor must be whole here.
        union: several ranks load together: an entry this rank does not hold
            is unexpected only if no rank holds it, which the load decides
            across ranks instead of here.
        opened: the storage's manifest, already opened and checked by the
            caller (not read again).
        held: which data files ``storage`` holds (None: all): only those
            are checked present at their sizes (the memory tier: the other
            files come from other ranks).

    Returns:
        A frozen :class:`LoadPlan` (its files: :attr:`LoadPlan.files`).

    Raises:
        StateMismatchError: names, shapes or dtypes disagree, a target
            overlaps itself, or (strict) the live model ties two different
            checkpoint tensors (all in one error).
        UsageError: an optimizer holds meta-device parameters.
        CorruptCheckpointError: the manifest or an index file is damaged,
            the saved chunks do not cover what this rank holds, or a data
            file the plan reads is missing or truncated.

    Example:
        >>> plan = plan_load({"w": torch.zeros(4)}, Storage("ckpt"), rank=0, world=1)  # doctest: +SKIP
        >>> plan.files  # doctest: +SKIP
        {'data/...-r00000-00.safetensors': 80}

    Limits: files are checked by their sizes (listing or stat), not read;
    every byte is verified as the stream reads it.
    """
    refuse_meta_optimizers(state)
    manifest = open_for_load(state, storage, keys=keys, key_map=key_map, opened=opened)
    plan = plan_for_manifest(
        state, manifest, strict=strict, rank=rank, world=world, local_only=local_only, storage=storage, cast=cast, union=union,
        resize=resize,
    )
    needed = plan.files
    check_files(storage, needed if held is None else {f: n for f, n in needed.items() if held(f)})
    return plan


def new_tensors(storage: Storage, manifest: Manifest, names: Sequence[str]) -> Dict[str, torch.Tensor]:
    """Empty CPU tensors of the saved shapes and dtypes of ``names``, allocated only once the load of them is planned.

    Shapes come from the manifest, which a crafted (re-signed) manifest can
    make any size: a meta-device template is planned first by
    :func:`plan_load` (chunks cover the tensors, data files present at their
    recorded sizes), so a 64 GiB claim over a small file is our
    ``CorruptCheckpointError``, never an allocator error.

    Args:
        storage: the checkpoint's storage (references already followed).
        manifest: its manifest, opened (as read there).
        names: saved tensor names (aliases included).

    Returns:
        ``{name: empty tensor}``, to load into (``load_into(..., keys=names, key_map={})``).

    Raises:
        CorruptCheckpointError: a name the manifest lacks, chunks that do not
            cover a tensor, or a data file missing or shorter than recorded.

    Example:
        >>> tpl = new_tensors(storage, manifest, ["model.w"])  # doctest: +SKIP
    """
    names = list(names)
    aliased = with_aliases(manifest)
    lacking = [n for n in names if n not in aliased.tensors]
    if lacking:
        raise CorruptCheckpointError(f"{storage.url}: the saved values reference tensors the checkpoint lacks: {format_offenders(lacking)}")
    metas = {n: aliased.tensors[n] for n in names}
    if not names:
        return {}
    # A block-FP8 weight comes back dequantized, in float32.
    dtypes = {n: torch.float32 if m.scale is not None else torch_dtype(m.dtype) for n, m in metas.items()}
    probe = {n: torch.empty(tuple(m.shape), dtype=dtypes[n], device="meta") for n, m in metas.items()}
    plan_load(probe, storage, rank=0, world=1, local_only=True, keys=names, key_map={}, opened=manifest)
    return {n: torch.empty(tuple(m.shape), dtype=dtypes[n]) for n, m in metas.items()}


def open_for_load(
    state: Dict[str, Any],
    storage: Storage,
    *,
    keys: Optional[Sequence[str]] = None,
    key_map: Optional[KeyMap] = None,
    opened: Optional[Manifest] = None,
) -> Manifest:
    """The manifest a load plans against: opened without chunk lists, aliases added, selected and renamed.

    Chunks are resolved later, per tensor, for the boxes this rank holds
    (v2: only the index files of the ranks that wrote them are read).
    Renaming and selection work on whole chunk lists, so with ``keys=`` or
    ``key_map=`` (or a Hugging Face source) the manifest is materialized
    first — before the aliases are added: v2 index rows are keyed by stored
    names, and an alias shares its stored tensor's chunk list.
    """
    manifest = opened if opened is not None else open_manifest(storage, chunks=False)
    if keys is None and key_map is None and manifest.extra.get("source") != "safetensors":
        return with_aliases(manifest)
    # Block-FP8 weights take their scales along before names are selected
    # or renamed (the scale tensors are consumed, not loaded).
    manifest = with_aliases(with_block_scales(materialize(manifest, storage), storage))
    return select_for_load(manifest, state, keys=keys, key_map=key_map)


def refuse_meta_optimizers(state: Any) -> None:
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


def plan_for_manifest(
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
    resize: bool = False,
) -> LoadPlan:
    """:func:`plan_load` against an opened manifest: walk, match names, plan each target, check ties, refuse.

    Steps, each its own function: :func:`_match_names` (which entries
    load, which are missing or unexpected), :func:`_live_target` per live
    tensor (shape, dtype, overlap), one :func:`resolve_reads` for every
    tensor's saved chunks and read pieces, :func:`_finish_target`, :func:`_tied_checks`
    (a live tie over two different checkpoint tensors) and
    :func:`_refuse` (one error with every disagreement of every kind:
    fixing one kind must not only reveal the next).
    """
    flat, missing_values, unexpected_values = flatten_for_load(
        state,
        manifest.values,
        manifest.tensors,
        strict=strict,
        rank=rank,
        world=world,
        saved_world=manifest.world_size,
        per_rank=manifest.extra.get("per_rank"),
        resize=resize,
    )
    names = _match_names(flat, missing_values, unexpected_values, manifest, strict=strict, union=union)
    cache = MetaCache()
    created: Dict[str, torch.Tensor] = {}
    wanted = [(n, flat.tensors[n]) for n in sorted(flat.tensors) if n in manifest.tensors]
    for name in sorted(names.creates):
        meta = manifest.tensors[name]
        old = flat.resized.get(name)
        if old is not None:  # resize=True: the placeholder's dtype (cast on load) and device
            created[name] = torch.empty(tuple(meta.shape), dtype=old.dtype, device=old.device)
        else:  # a block-FP8 weight comes back dequantized, in float32
            created[name] = torch.empty(tuple(meta.shape), dtype=torch.float32 if meta.scale is not None else torch_dtype(meta.dtype))
        wanted.append((name, created[name]))
    targets: List[Target] = []
    problems: List[str] = []
    live: List[_Live] = []
    for name, tensor in wanted:
        got = _live_target(name, tensor, manifest, rank=rank, world=world,
                           local_only=local_only if name not in created else True, cast=cast, resize=resize)
        if isinstance(got, str):
            problems.append(got)
        else:
            live.append(got)
    # Every tensor's saved chunks and read pieces in one call: the geometry
    # and the pieces once per distinct (layout, rotation, boxes).
    alias = manifest.extra.get(ALIAS_OF_KEY, {})
    asked = [lv for lv in live if lv.boxes]
    found = resolve_reads(manifest, storage, [(alias.get(lv.name, lv.name), lv.boxes) for lv in asked], cache=cache)
    reads_of = {id(lv): r for lv, r in zip(asked, found)}
    targets.extend(_finish_target(lv, manifest, reads_of.get(id(lv))) for lv in live)
    parts = names.parts + _tied_checks(manifest, storage, flat.tied, cache, strict=strict)
    _refuse(parts, problems, strict=strict, names=names, union=union)
    return LoadPlan(
        manifest=manifest,
        targets=tuple(targets),
        creates=names.creates,
        created=created,
        finalizers=tuple(flat.finalizers),
        result=LoadResult(names.missing, names.unexpected),
        cache=cache,
    )


class _Names(NamedTuple):
    """:func:`_match_names`' verdict: what is put as new tensors, what is missing or unexpected, and the complaints."""

    creates: Dict[str, Callable[[torch.Tensor], None]]
    missing: List[str]
    unexpected: List[str]
    parts: List[str]


def _match_names(flat, missing_values, unexpected_values, manifest: Manifest, *, strict: bool, union: bool) -> _Names:
    """Which live names the checkpoint lacks and which checkpoint names no live entry claims (under the state's roots).

    With ``union`` (several ranks, strict), unexpected names are left for the
    ranks to decide together (``_nobody_holds``). Raises
    ``StateMismatchError`` at once when a non-strict load would fill nothing.
    """
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
    return _Names(creates, missing_all, unexpected_all, parts)


class _Live(NamedTuple):
    """A live tensor checked against its saved record, before its chunks are resolved."""

    name: str
    meta: Any
    lay: TensorLayout
    views: List[torch.Tensor]
    boxes: List[Tuple[Tuple[int, ...], Tuple[int, ...]]]


def _live_target(name: str, tensor: Any, manifest: Manifest, *, rank: int, world: int, local_only: bool, cast: bool,
                 resize: bool = False) -> Union[_Live, str]:
    """A live tensor's checks against its saved record: shape, dtype and self-overlap checks, and the boxes to resolve."""
    meta = manifest.tensors[name]
    lay = layout_of(name, tensor, rank=rank, world_size=world, local_only=local_only)
    if list(lay.shape) != list(meta.shape):
        shape_msg = f"{name}: checkpoint shape {list(meta.shape)}, live shape {list(lay.shape)}"
        if resize:
            shape_msg += (f" (resize=True replaces only plain tensors held in a dict or list of the state; this one is a "
                          f"{type(tensor).__name__} or belongs to a module, and is never swapped for a new object: build it "
                          "with the checkpoint's shape)")
        return shape_msg
    # A block-FP8 weight dequantizes to float32 (then rounds to the live dtype, as a cast).
    why = dtype_problem(name, "F32" if meta.scale is not None else meta.dtype, lay.dtype, cast=cast)
    if why is not None:
        return why
    views = [p.view() for p in lay.parts]
    if any(_self_overlapping(v) for v in views):
        return (
            f"{name}: the live tensor overlaps itself (an expand()-ed or stride-0 tensor); "
            "loading into it would write several values to one element — give it its own memory (.clone())"
        )
    return _Live(name, meta, lay, views, [(p.box.offsets, p.box.sizes) for p in lay.parts if p.box.numel])


def _finish_target(lv: _Live, manifest: Manifest, reads: Optional[Reads]) -> Target:
    """A live tensor's :class:`Target`: its resolved chunks and the read pieces of each live box.

    ``reads`` (None: the tensor holds no element here) gives the pieces of
    each non-empty box (``lv.boxes``, in part order); an empty box gets none.
    """
    chunks: Tuple[Chunk, ...] = tuple(reads.chunks) if reads is not None else ()
    parts = tuple((p.box, v) for p, v in zip(lv.lay.parts, lv.views))
    if reads is not None and len(parts) == 1:
        pieces = tuple(reads.pieces)
    else:
        given = iter(reads.pieces if reads is not None else ())
        pieces = tuple(next(given) if box.numel else () for box, _ in parts)
    scale = None
    if lv.meta.scale is not None:
        scale = ScaleSource(Chunk.from_meta(lv.meta.scale.name, lv.meta.scale.meta.chunks[0], 0), lv.meta.scale.meta.dtype,
                            lv.meta.scale.block)
    return Target(lv.name, lv.meta, parts, pieces, chunks, replicated=_replicated(lv.lay), scale=scale)


def _tied_checks(manifest: Manifest, storage: Optional[Storage], tied: Sequence[Tuple[str, str]], cache: MetaCache,
                 *, strict: bool) -> List[str]:
    """The complaint (strict) about live ties over two different checkpoint tensors; warnings for the rest."""
    untied = _untied_copies(manifest, storage, tied, cache)
    differ = [f"{b} (tied to {a} in the live model)" for a, b, same in untied if same is False]
    parts: List[str] = []
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
    return parts


def _refuse(parts: List[str], problems: List[str], *, strict: bool, names: _Names, union: bool) -> None:
    """Raise one ``StateMismatchError`` naming every disagreement of every kind (nothing when there is none)."""
    if problems:
        parts = parts + [f"{len(problems)} tensor(s) differ: " + format_offenders(problems, sep="; ")]
    if not parts:
        return
    hint = " Pass strict=False to load the common entries." if strict and (names.missing or (names.unexpected and not union)) else ""
    if any("cast=False" in p for p in problems):
        hint += " Pass cast=True (the default) to cast floating-point tensors to the live dtype."
    elif any("are cast" in p for p in problems):
        hint += " Convert the live tensors (or the checkpoint) to the saved dtype; integers and bools are never cast."
    raise StateMismatchError("cannot load, state and checkpoint disagree: " + "; ".join(parts) + "." + hint)


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


def saved_chunks(manifest: Manifest, storage: Optional[Storage], name: str, boxes, cache: Optional[MetaCache]) -> List[Chunk]:
    """The saved chunks of ``name`` meeting ``boxes``, as the reader takes them (``_format.resolve_chunks``).

    A tensor whose chunk list the manifest holds (v1, Hugging Face, renamed
    or keyed loads) reads no index file; ``storage`` may then be None. An
    alias of a tied weight resolves through the tensor it names.
    """
    stored = manifest.extra.get(ALIAS_OF_KEY, {}).get(name, name)
    return resolve_chunks(manifest, storage, stored, boxes, cache=cache)


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
