"""App state <-> a flat map of named tensors plus a JSON tree.

``flatten_for_save(state)`` walks the user's dict and returns every tensor
under a dotted name (``model.layers.0.weight``) and a JSON tree of the whole
structure in which tensors are references ``{"__shardckpt__": "tensor",
"name": ...}``. ``flatten_for_load`` does the same walk over the live state and
returns the tensors to fill in place plus the actions that put everything else
back (plain values into their dicts, ``load_state_dict`` calls) once every
tensor has been read and checked.

How each kind of object is taken apart is an *adapter* (``adapters``: one
ordered list); the values codec is ``values``.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Callable, Dict, List, Optional, Tuple

import torch

from .._format.naming import chunk_key_clashes, unreadable_names
from .._format.values import MAX_VALUE_DEPTH, value_depth_problem
from .._layout import is_dtensor, is_sharded_tensor
from .._runtimes import (
    empty_like_meta,
    fsdp1_load_model_state,
    fsdp1_model_state,
    is_fsdp1,
    materialize_device,
    unwrap,
    wrapper_renamer,
)
from ..errors import CorruptCheckpointError, StateMismatchError, UnsupportedStateError, format_offenders
from .adapters import Adapter, adapter_for
from .subclass import (
    as_plain,
    check_ctx,
    flatten_subclass,
    inner_name,
    is_subclass_node,
    is_wrapper_subclass,
    plain_problem,
    rebuild,
)
from .values import TAG, _is_ref, decode_value, encode_value, tensor_ref

__all__ = [
    "SEP",
    "FlatSave",
    "FlatLoad",
    "flatten_for_save",
    "flatten_for_load",
    "Raw",
    "PerRank",
    "PER_RANK_MARK",
    "ModuleAdapter",
    "StatefulAdapter",
    "PerRankAdapter",
]

SEP = "."


def canonical_keys(d: Dict[Any, Any]) -> List[Any]:
    """``d``'s keys in the order every rank walks them: sorted by their text, not by insertion.

    Ranks may build the same state in different insertion orders; what the
    walk calls on objects (``state_dict()``, ``load_state_dict()``, torch's
    FSDP1 and optimizer state-dict helpers) may be collective, so it must
    happen in one order on every rank or the job hangs (or pairs one object's
    collective with another's).
    """
    return sorted(d, key=str)


def _join(prefix: str, key: Any) -> str:
    key = str(key)
    return f"{prefix}{SEP}{key}" if prefix else key


@dataclass
class FlatSave:
    tensors: Dict[str, Any] = field(default_factory=dict)  # name -> tensor / DTensor / ShardedTensor
    tree: Any = None
    per_rank: Dict[str, Any] = field(default_factory=dict)  # path -> JSON tree of per-rank values
    # Tensors of per-rank state: held and written by this rank alone, under a
    # name that contains the rank (other ranks hold their own).
    per_rank_tensors: List[str] = field(default_factory=list)


@dataclass
class FlatLoad:
    """What a load must fill, and what to do once it is filled."""

    tensors: Dict[str, Any] = field(default_factory=dict)  # name -> live tensor to copy_ into
    # Tensors the checkpoint has but the live state can only take as new
    # objects (e.g. optimizer state before the first step): name -> callback
    # receiving the loaded full tensor.
    creates: Dict[str, Callable[[torch.Tensor], None]] = field(default_factory=dict)
    roots: List[str] = field(default_factory=list)  # name prefixes the live state claims
    finalizers: List[Callable[[], None]] = field(default_factory=list)
    value_paths: List[str] = field(default_factory=list)
    # Saved tensor name prefixes deliberately not loaded (other ranks'
    # per-rank state, optimizer state of parameters reported as unexpected).
    skip: List[str] = field(default_factory=list)


# --------------------------------------------------------------------------
# plain values


def _decoded(node: Any, path: str) -> Any:
    """Decode a saved value now, while planning: a load must fail before any tensor is written."""
    try:
        return decode_value(node)
    except Exception as e:
        raise CorruptCheckpointError(f"{path}: saved value {node!r:.100} cannot be decoded ({type(e).__name__}: {e})") from None


def _is_tensor(v: Any) -> bool:
    return isinstance(v, torch.Tensor) or is_sharded_tensor(v)


# --------------------------------------------------------------------------
# save walk


class Raw:
    """An adapter's already-encoded JSON node, put in the tree as is."""

    __slots__ = ("node",)

    def __init__(self, node: Any):
        self.node = node


class _SaveWalker:
    def __init__(self, root: Dict[str, Any], rank: int = 0, world: int = 1):
        self.flat = FlatSave()
        self.root = root  # the whole user state: adapters look up related entries
        self.rank = rank
        self.world = world
        self.per_rank_depth = 0  # > 0 while walking inside a PerRank value

    def _add(self, path: str, v: Any) -> None:
        if path in self.flat.tensors:
            raise UnsupportedStateError(f"{path}: two entries of the state map to the same name")
        self.flat.tensors[path] = v
        if self.per_rank_depth:
            self.flat.per_rank_tensors.append(path)

    def walk(self, v: Any, path: str) -> Any:
        if isinstance(v, Raw):
            return v.node
        if _is_tensor(v):
            if is_wrapper_subclass(v):
                # Taken apart through its own protocol (see ``subclass``): its
                # inner tensors are written, never the wrapper's (absent) bytes.
                inner, node = flatten_subclass(v, path)
                for n, x in inner:
                    self._add(n, x)
                return node
            _refuse_unwritable(v, path)
            self._add(path, as_plain(v))
            return tensor_ref(path)
        adapter = adapter_for(v)
        if adapter is not None:
            out = adapter.save(v, path, self)
            return out.node if isinstance(out, Raw) else self.walk(out, path)
        if isinstance(v, dict):
            if TAG in v:
                raise UnsupportedStateError(f"{path}: dict keys may not be {TAG!r}")
            # Walked in the canonical order (collectives), kept in the user's order.
            done = {id(k): self.walk(v[k], _join(path, k)) for k in canonical_keys(v)}
            if all(isinstance(k, str) for k in v):
                return {k: done[id(k)] for k in v}
            return {TAG: "dict", "items": [[encode_value(k, path), done[id(k)]] for k in v]}
        if isinstance(v, list):
            return [self.walk(x, _join(path, i)) for i, x in enumerate(v)]
        if isinstance(v, tuple):
            return {TAG: "tuple", "items": [self.walk(x, _join(path, i)) for i, x in enumerate(v)]}
        return encode_value(v, path)


def _refuse_unwritable(v: Any, path: str) -> None:
    """Refuse, while walking (before any byte is written), a tensor whose bytes cannot be read safely.

    A DTensor whose local shard is a wrapper subclass (FSDP2 over NF4 or
    low-bit optimizer states) has inner tensors with no global layout to
    reshard; a subclass without storage and without ``__tensor_flatten__``
    has no bytes to read at all.
    """
    local = v._local_tensor if is_dtensor(v) else v
    kind = f"{type(local).__module__}.{type(local).__qualname__}"
    if is_dtensor(v) and (is_wrapper_subclass(local) or plain_problem(local)):
        raise UnsupportedStateError(
            f"{path}: a DTensor whose local shard is a {kind} cannot be saved: the subclass's inner tensors have no "
            "global layout to reshard. Save it unsharded (full_tensor() of a plain dtype, or the subclass on one "
            "process), or convert it to a plain tensor first"
        )
    why = plain_problem(local) if isinstance(local, torch.Tensor) else None
    if why:
        raise UnsupportedStateError(
            f"{path}: a {kind} cannot be saved: {why}, and the type has no __tensor_flatten__ to take it apart. "
            "Convert it to a plain tensor, or implement the flattening protocol"
        )


def flatten_for_save(state: Dict[str, Any], *, rank: int = 0, world: int = 1) -> FlatSave:
    """Split ``state`` into named tensors and a JSON tree referencing them.

    ``rank``/``world`` (of the saving group) name per-rank state.
    """
    if not isinstance(state, dict):
        raise UnsupportedStateError(f"state must be a dict, got {type(state).__name__}")
    bad = [k for k in state if not isinstance(k, str) or not k]
    if bad:
        raise UnsupportedStateError(f"state keys must be non-empty strings, found {bad!r}")
    w = _SaveWalker(state, rank, world)
    try:
        done = {k: w.walk(state[k], k) for k in canonical_keys(state)}
    except RecursionError:
        raise UnsupportedStateError(
            f"the state nests values deeper than Python's recursion limit; values may nest at most {MAX_VALUE_DEPTH} levels"
        ) from None
    w.flat.tree = {k: done[k] for k in state}
    _refuse_names(w.flat)
    return w.flat


def _refuse_names(flat: FlatSave) -> None:
    """Refuse, while walking (every rank alike, before any byte), names and values the format cannot hold.

    Tensor names that equal another tensor's chunk key (``w@0,0`` beside
    ``w``), names safetensors cannot read back (lone surrogates), dims past
    what a safetensors header holds, values nested past ``MAX_VALUE_DEPTH``.
    """
    bad = unreadable_names(flat.tensors)
    if bad:
        raise UnsupportedStateError(
            f"tensor names {[n.encode('utf-8', 'backslashreplace').decode() for n in bad]} are not valid UTF-8 "
            "(lone surrogates): safetensors files could not be read back; rename them"
        )
    clash = chunk_key_clashes(flat.tensors)
    if clash:
        raise UnsupportedStateError(
            f"tensor names {clash} equal the chunk keys ('<name>@<offsets>') of other tensors of the state: their "
            "chunks would share keys in the data files (also after converters.reshard); rename them (no '@' "
            "followed by offsets)"
        )
    for n, t in flat.tensors.items():
        shape = tuple(t.shape)
        if any(int(d) >= 2**63 for d in shape):
            raise UnsupportedStateError(f"{n}: shape {list(shape)} has a dim of 2**63 or more, which no data file can describe")
    for where, tree in [("the state", flat.tree)] + [(p, v) for p, v in flat.per_rank.items()]:
        # The same bound the commit checks (tests/unit/test_tensor_kinds.py
        # pins the two together at the boundary).
        why = value_depth_problem(tree, limit=MAX_VALUE_DEPTH)
        if why:
            raise UnsupportedStateError(f"{where}: {why}; flatten the structure or store it as a tensor")


# --------------------------------------------------------------------------
# load walk


class _LoadWalker:
    def __init__(
        self,
        saved_tensors: Dict[str, Any],
        strict: bool,
        root: Optional[Dict[str, Any]] = None,
        rank: int = 0,
        world: int = 1,
        saved_world: Optional[int] = None,
        per_rank: Any = None,
    ):
        self.flat = FlatLoad()
        self.saved_tensors = saved_tensors  # name -> TensorMeta of the checkpoint
        self.strict = strict
        self.missing_values: List[str] = []
        self.root = root if root is not None else {}
        self.rank = rank
        self.world = world
        self.saved_world = world if saved_world is None else saved_world
        self.per_rank = per_rank  # manifest.extra["per_rank"]: list by saving rank
        # Finalizers that must run after all others: random generator
        # restores (see ``StatefulAdapter``), whatever their key's name.
        self.late: List[Callable[[], None]] = []

    def unexpected(self, path: str) -> None:
        """Report a saved entry the live state has no place for."""
        self.flat.value_paths.append("?" + path)

    def target(self, path: str, live: Any, node: Any = None) -> None:
        """Fill live tensor ``live`` from saved tensor ``path``; ``node``: its saved values-tree node, if known.

        A live wrapper subclass is filled through its inner tensors, in place
        (``subclass``), after its saved context is checked.
        """
        if is_wrapper_subclass(live):
            if node is not None and node is not _MISSING:
                check_ctx(live, node, path)
                names = {a: r["name"] for a, r in node["inner"].items()}
            else:
                names = {a: inner_name(path, a) for a in live.__tensor_flatten__()[0]}
            for a, n in names.items():
                self.flat.tensors[n] = getattr(live, a)
            return
        if is_subclass_node(node):
            check_ctx(live, node, path)  # raises: a plain live tensor where a subclass was saved
        self.flat.tensors[path] = live

    def walk(self, live: Any, saved: Any, path: str, setter: Optional[Callable[[Any], None]]) -> None:
        """Match live ``live`` against the saved subtree ``saved``."""
        if _is_tensor(live):
            self.target(path, live, saved)
            return
        adapter = adapter_for(live)
        if adapter is not None:
            adapter.load(live, path, saved, self)
            return
        if live is None and setter is not None and saved is not _MISSING and _contains_ref(saved):
            # A None placeholder where the checkpoint has tensors: filled with
            # what was saved there (new full tensors, values as saved).
            holder: Dict[str, Any] = {}
            _fill_from_saved(holder, "v", saved, path, self)
            self.flat.finalizers.append(lambda s=setter, h=holder: s(h["v"]))  # type: ignore[misc]
            return
        if isinstance(live, (dict, list)) and _is_plain(live) and saved is not _MISSING and not _contains_ref(saved):
            # Pure JSON containers come back whole: the saved value replaces
            # the live placeholder (e.g. ``{"history": []}``).
            if setter is not None:
                self.flat.value_paths.append(path)
                self.flat.finalizers.append(lambda s=setter, v=_decoded(saved, path): s(v))  # type: ignore[misc]
            return
        if isinstance(live, dict):
            if isinstance(saved, dict) and saved.get(TAG) == "dict":
                items = {str(decode_value(k)): v for k, v in saved["items"]}
            elif isinstance(saved, dict) and TAG not in saved:
                items = saved
            else:
                items = None
            for k in canonical_keys(live):
                sub = None if items is None else items.get(str(k), _MISSING)
                self.walk(live[k], sub, _join(path, k), _dict_setter(live, k))
            if items is not None:
                # One set of the live keys for the whole dict: rebuilding it per
                # saved key made a load quadratic in the number of keys.
                live_keys = {str(x) for x in live}
                for k in items:
                    if k not in live_keys:
                        self._unexpected_value(_join(path, k), items[k])
            return
        if isinstance(live, list):
            seq = saved if isinstance(saved, list) else None
            for i, x in enumerate(live):
                sub = seq[i] if seq is not None and i < len(seq) else _MISSING
                self.walk(x, sub, _join(path, i), _list_setter(live, i))
            return
        if isinstance(live, tuple):
            # Tuples are immutable: values inside come back only if the parent
            # can take a new tuple.
            seq = saved["items"] if isinstance(saved, dict) and saved.get(TAG) == "tuple" else None
            for i, x in enumerate(live):
                sub = seq[i] if seq is not None and i < len(seq) else _MISSING
                self.walk(x, sub, _join(path, i), None)
            if setter is not None and seq is not None and not any(_is_tensor(x) for x in live):
                self.flat.finalizers.append(lambda s=setter, v=_decoded(saved, path): s(v))  # type: ignore[misc]
            return
        # A plain value: the saved one replaces it.
        if saved is _MISSING:
            self.missing_values.append(path)
            return
        if _is_ref(saved):
            self.missing_values.append(path + " (saved as a tensor)")
            return
        if setter is not None:
            self.flat.value_paths.append(path)
            self.flat.finalizers.append(lambda s=setter, v=_decoded(saved, path): s(v))  # type: ignore[misc]

    def _unexpected_value(self, path: str, node: Any) -> None:
        # Unexpected tensors are found by name against the manifest; plain
        # values only matter in strict mode.
        if not _contains_ref(node):
            self.flat.value_paths.append("?" + path)


class _Missing:
    def __repr__(self):
        return "<missing>"


_MISSING = _Missing()


def _is_plain(v: Any) -> bool:
    """True if ``v`` holds only JSON-able values (no tensors, modules or stateful objects)."""
    if isinstance(v, dict):
        return all(_is_plain(x) for x in v.values())
    if isinstance(v, (list, tuple)):
        return all(_is_plain(x) for x in v)
    return v is None or isinstance(v, (bool, int, float, str))


def _contains_ref(node: Any) -> bool:
    if _is_ref(node):
        return True
    if isinstance(node, dict):
        return any(_contains_ref(v) for v in node.values())
    if isinstance(node, list):
        return any(_contains_ref(v) for v in node)
    return False


def _dict_setter(d: dict, k: Any) -> Callable[[Any], None]:
    def set_(v):
        d[k] = v

    return set_


def _list_setter(lst: list, i: int) -> Callable[[Any], None]:
    def set_(v):
        lst[i] = v

    return set_


def flatten_for_load(
    state: Dict[str, Any],
    saved_tree: Any,
    saved_tensors: Dict[str, Any],
    *,
    strict: bool = True,
    rank: int = 0,
    world: int = 1,
    saved_world: Optional[int] = None,
    per_rank: Any = None,
) -> Tuple[FlatLoad, List[str], List[str]]:
    """Walk live ``state`` against the saved tree.

    Returns ``(flat, missing_values, unexpected_values)``: plain values the
    live state has but the checkpoint lacks, and the reverse (only within the
    top-level keys ``state`` names). ``rank``/``world`` are the loading
    group's; ``saved_world`` and ``per_rank`` (``manifest.extra["per_rank"]``)
    come from the checkpoint and serve per-rank state.
    """
    if not isinstance(state, dict):
        raise UnsupportedStateError(f"state must be a dict, got {type(state).__name__}")
    saved_tree = saved_tree if isinstance(saved_tree, dict) else {}
    w = _LoadWalker(saved_tensors, strict, state, rank, world, saved_world, per_rank)
    # The canonical order makes targets and finalizers (load_state_dict calls,
    # which may be collective) come in the same order on every rank.
    for k in canonical_keys(state):
        w.flat.roots.append(k)
        w.walk(state[k], saved_tree.get(k, _MISSING), k, _dict_setter(state, k))
    w.flat.finalizers.extend(w.late)
    unexpected = sorted(p[1:] for p in w.flat.value_paths if p.startswith("?"))
    w.flat.value_paths = [p for p in w.flat.value_paths if not p.startswith("?")]
    return w.flat, sorted(w.missing_values), unexpected


# --------------------------------------------------------------------------
# built-in adapters


class ModuleAdapter(Adapter):
    """``nn.Module`` of any runtime: its state dict by FQN, filled in place.

    Plain modules, FSDP2, TP and HSDP: ``state_dict(keep_vars=True)`` yields
    the Parameters themselves (DTensors when sharded), so a load ``copy_``-es
    into their storage and never swaps a Parameter or its ``.data`` — FSDP2's
    all-gathers and the optimizer keep seeing the same objects.

    DDP and ``torch.compile`` wrappers are looked through, so names carry no
    ``module.``/``_orig_mod.`` prefix and checkpoints move between runtimes.

    FSDP1 goes through torch's sharded state dict (``ShardedTensor``\\ s),
    filled and handed back with ``set_model_state_dict`` (collective).

    Parameters or buffers still on the meta device get new tensors of their
    live dtype and sharding, on the device ``_runtimes.materialize_device``
    picks, installed with ``load_state_dict(assign=True)`` — FSDP2's post-load
    hook then re-pads its sharded storage. Only entries the checkpoint has
    are materialized; the rest stay on meta and are reported missing.
    """

    def matches(self, obj):
        return isinstance(obj, torch.nn.Module)

    def save(self, obj, path, walker):
        m = unwrap(obj)
        if is_fsdp1(m):
            return fsdp1_model_state(m)
        sd = _module_tensors(m, path)
        meta = [k for k, t in sd.items() if _is_tensor(t) and t.is_meta]
        if meta:
            raise UnsupportedStateError(
                f"{path}: tensors on the meta device hold no data and cannot be saved: {format_offenders(meta)}"
            )
        # Tied parameters (one tensor under several names) are written once,
        # under the first name in module order; the others are references to
        # it in the values tree (the manifest's record of the alias).
        for names in tied_groups(sd):
            for alias in names[1:]:
                sd[alias] = Raw(tensor_ref(_join(path, names[0])))
        return sd

    def load(self, obj, path, saved, walker):
        m = unwrap(obj)
        if is_fsdp1(m):
            sd = fsdp1_model_state(m)
            self._targets(sd, path, saved, walker)
            walker.flat.finalizers.append(lambda: fsdp1_load_model_state(m, sd))
            return
        back: Dict[str, str] = {}
        sd = _module_tensors(m, path, back)
        extra = self._extra_state(m, sd, path, saved, walker, back)
        copies = throwaway_copies(m, sd)
        if copies and not routes_state_back(m, [back[k] for k in copies]):
            raise UnsupportedStateError(
                f"{path}: state_dict() returns tensors that are copies, not the module's parameters or buffers "
                f"({format_offenders([_join(path, k) for k in copies])}), and no load_state_dict pre-hook or "
                "_load_from_state_dict override could put them back: a load would fill the copies and leave the "
                "weights as they are. Register the inverse hook (module.register_load_state_dict_pre_hook) or "
                "make state_dict() return views of the parameters"
            )
        assign = self._materialize_meta(m, sd, path, walker)
        self._untie_targets(sd, path, walker)
        self._targets(sd, path, saved, walker)
        if assign:
            walker.flat.finalizers.append(lambda: m.load_state_dict({back[k]: v for k, v in assign.items()}, strict=False, assign=True))
        if copies:
            # DCP's flow for such modules: the copies were filled; the module's
            # own load_state_dict (and its hooks) puts them into the weights.
            # Extra state goes in too: load_state_dict hands it to set_extra_state.
            walker.flat.finalizers.append(
                lambda: m.load_state_dict({back[k]: v for k, v in ({**sd, **{k: h["v"] for k, (_, h) in extra.items()}}).items()}, strict=True)
            )
        else:
            for owner, h in extra.values():
                walker.flat.finalizers.append(lambda o=owner, h=h: o.set_extra_state(h["v"]))

    @staticmethod
    def _extra_state(m, sd, path, saved, walker, back):
        """Give each submodule's ``get_extra_state()`` value back through its ``set_extra_state``.

        As ``nn.Module.load_state_dict`` does: the saved value (a dict, an
        int, ``io.BytesIO``, a tensor, a dict holding tensors...) is rebuilt
        whole (tensors as new full tensors, at any world size) and handed to
        ``set_extra_state`` once every tensor was read and checked. The key
        leaves ``sd``: the live ``get_extra_state()`` result is a copy that
        filling would not reach. Returns ``key -> (submodule, holder)``;
        ``holder["v"]`` is the value once the load's tensors are in.
        """
        from torch.nn.modules.module import _EXTRA_STATE_KEY_SUFFIX

        out: Dict[str, Any] = {}
        for k in [k for k in sd if k == _EXTRA_STATE_KEY_SUFFIX or k.endswith(SEP + _EXTRA_STATE_KEY_SUFFIX)]:
            del sd[k]
            own = back.get(k, k)
            owner = m.get_submodule(own[: -len(_EXTRA_STATE_KEY_SUFFIX)].rstrip(SEP))
            node = saved.get(k, _MISSING) if isinstance(saved, dict) else _MISSING
            where = _join(path, k)
            if node is _MISSING:
                walker.missing_values.append(where)
                continue
            holder: Dict[str, Any] = {}
            _fill_from_saved(holder, "v", node, where, walker)
            out[k] = (owner, holder)
        return out

    @staticmethod
    def _untie_targets(sd, path, walker):
        """Fill each tied tensor once, from whichever of its names the checkpoint has.

        The other names leave ``sd`` (not missing: they are the same tensor)
        and, if the checkpoint holds them too, are skipped rather than
        reported unexpected.
        """
        for names in tied_groups(sd):
            present = [n for n in names if _join(path, n) in walker.saved_tensors]
            primary = present[0] if present else names[0]
            for n in names:
                if n != primary:
                    del sd[n]
                    if n in present:
                        walker.flat.skip.append(_join(path, n))

    @staticmethod
    def _targets(sd, path, saved, walker):
        for k, t in sd.items():
            if _is_tensor(t):
                walker.target(_join(path, k), t, saved.get(k) if isinstance(saved, dict) else None)
            else:
                sub = saved.get(k, _MISSING) if isinstance(saved, dict) else _MISSING
                walker.walk(t, sub, _join(path, k), None)

    @staticmethod
    def _materialize_meta(m, sd, path, walker) -> Dict[str, Any]:
        """Swap meta entries of ``sd`` the checkpoint has for empty real tensors; return them."""
        meta_keys = [k for k, t in sd.items() if _is_tensor(t) and t.is_meta and _join(path, k) in walker.saved_tensors]
        # A tied tensor is materialized under all its names, so that
        # load_state_dict(assign=True) installs one Parameter everywhere and
        # the tie survives (HF directories hold only one of the names).
        for names in tied_groups(sd):
            if any(n in meta_keys for n in names):
                meta_keys += [n for n in names if n not in meta_keys]
        if not meta_keys:
            return {}

        device_of = materialize_device(m)
        made: Dict[int, Any] = {}  # tied weights share one new Parameter
        out = {}
        for k in meta_keys:
            t = sd[k]
            if id(t) not in made:
                new = _empty_like_meta(t, device_of(t))
                if isinstance(t, torch.nn.Parameter):
                    # assign=True installs a Parameter as is: every tied name gets this one object
                    new = torch.nn.Parameter(new, requires_grad=t.requires_grad)
                made[id(t)] = new
            sd[k] = out[k] = made[id(t)]
        return out


def _empty_like_meta(t, device) -> torch.Tensor:
    """An uninitialized tensor (DTensor: same mesh/placements/shape) replacing meta ``t``."""
    return empty_like_meta(t, device)


def _storage_ptr(t: Any) -> Optional[int]:
    """The address of the storage under ``t`` (a DTensor's local shard), or None (meta, empty, no storage)."""
    local = t.to_local() if hasattr(t, "to_local") else t
    if not isinstance(local, torch.Tensor) or local.is_meta or local.numel() == 0:
        return None
    try:
        return local.untyped_storage().data_ptr()
    except Exception:  # tensor subclasses without storage
        return None


def throwaway_copies(m: torch.nn.Module, sd: Dict[str, Any]) -> List[str]:
    """Keys of ``sd`` (``m.state_dict(keep_vars=True)``) whose tensors share no storage with ``m``'s weights.

    A state-dict hook that splits a fused weight into new tensors, or one that
    re-creates them, gives copies: filling them in place would not reach the
    weights. Views of a parameter (a split that is a view) are not copies.

    Example:
        >>> m = torch.nn.Linear(2, 2)
        >>> throwaway_copies(m, {"weight": m.weight.detach().clone(), "bias": m.bias[:1]})
        ['weight']
    """
    own = set()
    for _, t in list(m.named_parameters(remove_duplicate=False)) + list(m.named_buffers(remove_duplicate=False)):
        ptr = _storage_ptr(t)
        if ptr is not None:
            own.add(ptr)
    out = []
    for k, t in sd.items():
        if _is_tensor(t):
            ptr = _storage_ptr(t)
            if ptr is not None and ptr not in own:
                out.append(k)
    return sorted(out)


def routes_state_back(m: torch.nn.Module, keys: List[str]) -> bool:
    """True if ``m.load_state_dict`` can turn the copies under ``keys`` back into weights.

    Copies under the module's own parameter/buffer names are loaded by plain
    ``load_state_dict`` (a hook that re-creates tensors under unchanged
    names). Other names (a fused weight split into new ones) need a
    load-state-dict pre-hook or an overridden
    ``load_state_dict``/``_load_from_state_dict`` somewhere in ``m``: the
    inverse of the hook that made them.
    """
    names = {n for n, _ in m.named_parameters(remove_duplicate=False)} | {n for n, _ in m.named_buffers(remove_duplicate=False)}
    if all(k in names for k in keys):
        return True
    base = torch.nn.Module
    if type(m).load_state_dict is not base.load_state_dict:
        return True
    for sm in m.modules():
        if getattr(sm, "_load_state_dict_pre_hooks", None) or getattr(sm, "_load_state_dict_post_hooks", None):
            return True
        if type(sm)._load_from_state_dict is not base._load_from_state_dict:
            return True
    return False


def tied_groups(sd: Dict[str, Any]) -> List[List[str]]:
    """Names of ``sd`` that hold the same tensor object (tied weights), in order; only groups of two or more.

        >>> w = torch.nn.Parameter(torch.ones(2))
        >>> tied_groups({"emb.weight": w, "bias": torch.zeros(1), "head.weight": w})
        [['emb.weight', 'head.weight']]
    """
    by_id: Dict[int, List[str]] = {}
    for k, t in sd.items():
        if _is_tensor(t):
            by_id.setdefault(id(t), []).append(k)
    return [names for names in by_id.values() if len(names) > 1]


def _module_tensors(m: torch.nn.Module, path: str = "", back: Optional[Dict[str, str]] = None) -> Dict[str, Any]:
    """``m.state_dict(keep_vars=True)`` under plain FQNs: wrapper segments removed at every depth.

    ``back`` (if given) receives plain name -> ``m``'s own key, for calls
    that hand a dict back to ``m.load_state_dict``.
    """
    rename = wrapper_renamer(m)
    out: Dict[str, Any] = {}
    for k, v in m.state_dict(keep_vars=True).items():
        n = rename(k)
        if n in out:
            raise UnsupportedStateError(
                f"{_join(path, n)}: two entries of the module's state dict have this name once wrapper prefixes "
                "(_orig_mod., _checkpoint_wrapped_module., module.) are removed"
            )
        out[n] = v
        if back is not None:
            back[n] = k
    return out


class StatefulAdapter(Adapter):
    """Any object with ``state_dict()`` and ``load_state_dict()`` (schedulers, scalers...).

    On load the live ``state_dict()`` gives the structure and tensors to fill;
    values the checkpoint has come back; ``load_state_dict`` gets the result.
    """

    def matches(self, obj):
        return (
            not isinstance(obj, (dict, list, tuple, torch.Tensor))
            and callable(getattr(obj, "state_dict", None))
            and callable(getattr(obj, "load_state_dict", None))
        )

    def save(self, obj, path, walker):
        return obj.state_dict()

    def load(self, obj, path, saved, walker):
        if saved is _MISSING:
            walker.missing_values.append(path)
            return
        live_sd = obj.state_dict()
        holder = {"sd": live_sd}
        _fill_from_saved(holder, "sd", saved, path, walker)
        def finish():
            obj.load_state_dict(holder["sd"])
            _prime_loader(obj)

        # Generators (``RNGState``) are restored after everything else: a
        # loader primed above draws from them first (issue 19).
        (walker.late if getattr(obj, "restore_last", False) else walker.flat.finalizers).append(finish)


def _prime_loader(obj: Any) -> None:
    """Create a just-loaded torchdata ``StatefulDataLoader``'s iterator now, as its own ``state_dict()`` does.

    Its next ``iter()`` draws a base seed from torch's global generator
    unless an iterator is waiting; restored before that draw, an
    ``RNGState`` would come out one draw off. Created here, before the
    generators are restored (they are restored last), the draw happens
    first and ``iter(loader)`` reuses this iterator: the natural order
    (load, then ``iter``) is exact, and so is ``iter`` then load.
    """
    if type(obj).__name__ == "StatefulDataLoader" and getattr(obj, "_iterator", 1) is None and hasattr(
        obj, "_initial_iter_for_state_dict"
    ):
        obj.state_dict()


class FlatOptimizerAdapter(Adapter):
    """An optimizer whose own ``state_dict()`` is not torch's ``{"state", "param_groups"}`` shape.

    torchtitan's ``OptimizersContainer`` is one ``torch.optim.Optimizer``
    spanning several model parts whose ``state_dict()`` is flat by FQN
    (``state.<fqn>.exp_avg``, ``param_groups.<fqn>.lr``). Such an object is
    saved and loaded through its own ``state_dict()``/``load_state_dict()``
    (tensors under their flat names, DTensors sharded as they are); an
    optimizer returning torch's shape goes to the by-parameter-name
    optimizer adapter as before.
    """

    def matches(self, obj):
        return isinstance(obj, torch.optim.Optimizer) and (
            type(obj).state_dict is not torch.optim.Optimizer.state_dict
            and type(obj).load_state_dict is not torch.optim.Optimizer.load_state_dict
        )

    @staticmethod
    def _torch_shaped(sd: Any) -> bool:
        return isinstance(sd, dict) and set(sd) == {"state", "param_groups"}

    def save(self, obj, path, walker):
        sd = obj.state_dict()
        if self._torch_shaped(sd):
            from .optim import OptimizerAdapter

            return OptimizerAdapter().save(obj, path, walker)
        return sd

    def load(self, obj, path, saved, walker):
        if self._torch_shaped(saved):
            from .optim import OptimizerAdapter

            OptimizerAdapter().load(obj, path, saved, walker)
            return
        StatefulAdapter().load(obj, path, saved, walker)


def _fill_from_saved(container: Any, key: Any, saved: Any, path: str, walker: _LoadWalker) -> None:
    """Rebuild ``container[key]`` from the saved tree, filling live tensors in place.

    Where the live structure has a tensor, it is a target. Where the saved
    tree has a tensor the live one lacks, a new full tensor is created.
    Plain values come from the checkpoint.
    """
    live = container[key] if _has(container, key) else _MISSING

    if is_subclass_node(saved):
        _fill_subclass(container, key, live, saved, path, walker)
        return
    if _is_ref(saved):
        name = saved["name"]
        if live is not _MISSING and _is_tensor(live):
            walker.target(name, live)
        else:
            def put(t, c=container, k=key):
                c[k] = t

            if isinstance(container, dict) and key not in container:
                # A placeholder until the tensor is read: checks made while
                # planning (an optimizer's hyperparameter names, e.g. torchao's
                # tensor ``lr``) see the key the checkpoint has.
                container[key] = None
            walker.flat.creates[name] = put
        return
    if isinstance(saved, dict) and (TAG not in saved or saved.get(TAG) == "dict"):
        if saved.get(TAG) == "dict":
            items = [(decode_value(k), v) for k, v in saved["items"]]
        else:
            items = list(saved.items())
        if not isinstance(live, dict):
            live = {}
            container[key] = live
        for k, sub in items:
            _fill_from_saved(live, k, sub, _join(path, k), walker)
        return
    if isinstance(saved, list):
        if not isinstance(live, list) or len(live) != len(saved):
            live = [None] * len(saved) if not isinstance(live, list) else (live + [None] * (len(saved) - len(live)))[: len(saved)]
            container[key] = live
        for i, sub in enumerate(saved):
            _fill_from_saved(live, i, sub, _join(path, i), walker)
        return
    if isinstance(saved, dict) and saved.get(TAG) == "tuple":
        items = list(live) if isinstance(live, tuple) and len(live) == len(saved["items"]) else [None] * len(saved["items"])  # type: ignore[list-item]
        for i, sub in enumerate(saved["items"]):
            _fill_from_saved(items, i, sub, _join(path, i), walker)
        # Rebuild the tuple after tensors are in (finalizers run in order).
        def rebuild(c=container, k=key, it=items):
            c[k] = tuple(it)

        rebuild()
        walker.flat.finalizers.insert(0, rebuild)
        return
    container[key] = _decoded(saved, path)


def _fill_subclass(container: Any, key: Any, live: Any, saved: Dict[str, Any], path: str, walker: _LoadWalker) -> None:
    """A saved tensor subclass: its inner tensors copied into the live one, or a new one rebuilt from them."""
    if live is not _MISSING and _is_tensor(live):
        walker.target(path, live, saved)
        return
    inner: Dict[str, Any] = {}
    for a, ref in saved["inner"].items():
        if not _is_ref(ref):
            raise CorruptCheckpointError(f"{path}: inner tensor {a!r} of a saved tensor subclass is not a tensor reference")

        def put(t, a=a):
            inner[a] = t

        walker.flat.creates[ref["name"]] = put

    def make(c=container, k=key):
        c[k] = rebuild(saved, inner, path)

    # Before the finalizers that hand the container on (an optimizer's load_state_dict).
    walker.flat.finalizers.insert(0, make)


def _has(c: Any, k: Any) -> bool:
    if isinstance(c, dict):
        return k in c
    if isinstance(c, list):
        return 0 <= k < len(c)
    return False


# --------------------------------------------------------------------------
# per-rank state

PER_RANK_MARK = "@rank"


class PerRank:
    """Mark a value as per-rank: every rank saves and restores its own copy.

    Most training state is global (the same on every rank, or one sharded
    tensor). Some is not: a data loader's position, a sampler's shuffle
    state, RNG streams. Wrap such a value and each rank's copy is kept
    separately: its JSON values go to ``manifest.extra["per_rank"][rank]``,
    its tensors are written by that rank alone under names containing
    ``@rank<r>`` (``loader.@rank1.buffer``).

    Args:
        obj: an object with ``state_dict()``/``load_state_dict()``, a dict
            (filled in place on load), or a tensor.
        on_resize: what a load does when the checkpoint was saved by a
            different number of ranks. ``"error"`` (default) raises
            ``StateMismatchError`` before anything is loaded. ``"skip"`` keeps
            every rank's live value (an explicit choice, nothing is loaded).
            A callable ``fn(saved, rank, world) -> state`` gets the list of
            all saved ranks' states (JSON values decoded, tensors as full CPU
            tensors) and returns the state for this rank, which goes to
            ``obj.load_state_dict`` (or into the dict).

    A multi-rank save compares every rank's plain values: values that differ
    across ranks and are not wrapped are refused (``UnsupportedStateError``
    naming their paths), never saved from rank 0 alone.

    Same world size: rank ``r`` gets what rank ``r`` saved. The saving and
    loading groups are matched by rank within ``process_group``.

    Example:
        >>> loader_state = {"epoch": 0, "position": 0}
        >>> state = {"model": model, "loader": shardckpt.PerRank(loader_state)}  # doctest: +SKIP
        >>> shardckpt.save(state, url)                                           # doctest: +SKIP

        Resuming 4 ranks' positions on 2 ranks, each taking two old shards::

            def remap(saved, rank, world):
                mine = saved[rank::world]
                return {"epoch": mine[0]["epoch"], "position": sum(s["position"] for s in mine)}

            state = {"loader": shardckpt.PerRank(loader_state, on_resize=remap)}
    """

    def __init__(self, obj: Any, *, on_resize: Any = "error"):
        if not (on_resize in ("error", "skip") or callable(on_resize)):
            raise UnsupportedStateError(f"PerRank on_resize must be 'error', 'skip' or a callable, got {on_resize!r}")
        if isinstance(obj, PerRank):
            raise UnsupportedStateError("PerRank(PerRank(...)): wrap the value once")
        self.obj = obj
        self.on_resize = on_resize

    def __repr__(self) -> str:
        return f"PerRank({self.obj!r}, on_resize={self.on_resize!r})"


def per_rank_prefix(path: str, rank: int) -> str:
    return f"{path}{SEP}{PER_RANK_MARK}{rank}"


class PerRankAdapter(Adapter):
    """:class:`PerRank` values (and :class:`shardckpt.RNGState`)."""

    def matches(self, obj):
        return isinstance(obj, PerRank)

    def save(self, obj, path, walker):
        walker.per_rank_depth += 1
        try:
            node = walker.walk(obj.obj, per_rank_prefix(path, walker.rank))
        finally:
            walker.per_rank_depth -= 1
        if path in walker.flat.per_rank:
            raise UnsupportedStateError(f"{path}: two per-rank entries map to the same name")
        walker.flat.per_rank[path] = node
        return Raw({TAG: "per_rank", "world_size": walker.world})

    def load(self, obj, path, saved, walker):
        if saved is _MISSING:
            walker.missing_values.append(path)
            return
        if not (isinstance(saved, dict) and saved.get(TAG) == "per_rank"):
            raise StateMismatchError(f"{path}: the checkpoint holds a plain value here, the live state a PerRank value")
        saved_world = walker.saved_world
        trees = walker.per_rank
        if not isinstance(trees, list) or len(trees) != saved_world or not all(isinstance(t, dict) for t in trees):
            raise CorruptCheckpointError(
                f"{path}: per-rank state is damaged: manifest extra['per_rank'] must list one dict for each of "
                f"the {saved_world} saving ranks"
            )
        lost = [r for r in range(saved_world) if path not in trees[r]]
        if lost:
            raise CorruptCheckpointError(f"{path}: per-rank state of rank(s) {lost} is missing from the manifest")
        # Other ranks' tensors are theirs, not unexpected.
        walker.flat.skip.extend(per_rank_prefix(path, r) for r in range(saved_world) if r != walker.rank or saved_world != walker.world)
        if saved_world == walker.world:
            prefix = per_rank_prefix(path, walker.rank)
            _load_into(obj.obj, trees[walker.rank][path], prefix, walker)
            return
        if obj.on_resize == "error":
            raise StateMismatchError(
                f"{path}: per-rank state was saved by {saved_world} ranks but this load runs on {walker.world}; "
                "one rank's state cannot be split or merged automatically. Load with "
                f"{saved_world} ranks, or wrap it as PerRank(obj, on_resize=fn) to remap the {saved_world} saved "
                "states, or on_resize='skip' to keep the live values, or leave "
                f"{path!r} out of the state you load"
            )
        if obj.on_resize == "skip":
            return
        holders = []
        for r in range(saved_world):
            h: Dict[str, Any] = {}
            _fill_from_saved(h, "v", trees[r][path], per_rank_prefix(path, r), walker)
            holders.append(h)
        fn, rank, world = obj.on_resize, walker.rank, walker.world

        def remap():
            _apply_state(obj.obj, fn([h["v"] for h in holders], rank, world), path)

        walker.flat.finalizers.append(remap)


def _load_into(live: Any, saved: Any, prefix: str, walker: "_LoadWalker") -> None:
    if isinstance(live, dict):
        # The dict is the user's object: refill it rather than replace it.
        def refill(v, d=live):
            d.clear()
            d.update(v)

        walker.walk(live, saved, prefix, refill)
        return
    if _is_tensor(live):
        if _is_ref(saved):
            walker.target(saved["name"], live)
        else:
            walker.missing_values.append(prefix + " (not saved as a tensor)")
        return
    adapter = adapter_for(live)
    if adapter is None:
        raise UnsupportedStateError(
            f"{prefix}: PerRank needs a dict, a tensor or an object with state_dict()/load_state_dict(), "
            f"got {type(live).__name__}"
        )
    adapter.load(live, prefix, saved, walker)


def _apply_state(live: Any, new: Any, path: str) -> None:
    if isinstance(live, dict):
        if not isinstance(new, dict):
            raise StateMismatchError(f"{path}: on_resize returned {type(new).__name__}, the live value is a dict")
        live.clear()
        live.update(new)
    elif _is_tensor(live):
        with torch.no_grad():
            live.copy_(new)
    else:
        live.load_state_dict(new)
