"""App state <-> a flat map of named tensors plus a JSON tree.

``flatten_for_save(state)`` walks the user's dict and returns every tensor
under a dotted name (``model.layers.0.weight``) and a JSON tree of the whole
structure in which tensors are references ``{"__shardckpt__": "tensor",
"name": ...}``. ``flatten_for_load`` does the same walk over the live state and
returns the tensors to fill in place plus the actions that put everything else
back (plain values into their dicts, ``load_state_dict`` calls) once every
tensor has been read and checked.

How each kind of object is taken apart is an *adapter* (``adapters``: one
ordered list; the built-ins live in ``module``, ``optim``, ``stateful`` and
``per_rank``, on the base class and helpers of ``base``); the values codec
is ``values``. The walkers here are the one implementation of the
interfaces adapters are typed against (``walker.SaveWalker`` and
``walker.LoadWalker``), which live below the adapters so that no adapter
imports this module back.
"""

from __future__ import annotations

from typing import Any, Callable, Dict, List, Optional, Tuple

import torch

from .._format.naming import chunk_key_clashes, unreadable_names
from .._format.values import MAX_VALUE_DEPTH, TAG, decode_value, encode_value, is_tensor_ref, tensor_ref, value_depth_problem
from .._layout import is_dtensor
from ..errors import StateMismatchError, UnsupportedStateError
from .adapters import adapter_for
from .base import (
    MISSING,
    SEP,
    Adapter,
    Raw,
    canonical_keys,
    decode_saved,
    fill_from_saved,
    is_tensor,
    join_path,
)
from .subclass import (
    as_plain,
    blocks_refusal,
    check_ctx,
    flatten_sharded_subclass,
    flatten_subclass,
    inner_name,
    is_sharded_subclass,
    is_subclass_node,
    is_wrapper_subclass,
    plain_problem,
    sharded_inner,
)
from .walker import FlatLoad, FlatSave

__all__ = [
    "SEP",
    "flatten_for_save",
    "flatten_for_load",
    "Raw",
]

# --------------------------------------------------------------------------
# save walk


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
        if is_tensor(v):
            if is_wrapper_subclass(v):
                # Taken apart through its own protocol (see ``subclass``): its
                # inner tensors are written, never the wrapper's (absent) bytes.
                inner, node = flatten_subclass(v, path)
                for n, x in inner:
                    self._add(n, x)
                return node
            if is_sharded_subclass(v):
                # A DTensor over a wrapper (FSDP2 over float8 weights, NF4,
                # low-bit optimizer states): its inner tensors are saved as
                # DTensors laid out by the subclass family's shard rule.
                inner, node = flatten_sharded_subclass(v, path)
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
            done = {id(k): self.walk(v[k], join_path(path, k)) for k in canonical_keys(v)}
            if all(isinstance(k, str) for k in v):
                return {k: done[id(k)] for k in v}
            return {TAG: "dict", "items": [[encode_value(k, path), done[id(k)]] for k in v]}
        if isinstance(v, list):
            return [self.walk(x, join_path(path, i)) for i, x in enumerate(v)]
        if isinstance(v, tuple):
            return {TAG: "tuple", "items": [self.walk(x, join_path(path, i)) for i, x in enumerate(v)]}
        return encode_value(v, path)


def _refuse_unwritable(v: Any, path: str) -> None:
    """Refuse, while walking (before any byte is written), a tensor whose bytes cannot be read safely.

    A subclass without storage and without ``__tensor_flatten__`` (plain or
    as a DTensor's local shard) has no bytes to read at all.
    """
    local = v._local_tensor if is_dtensor(v) else v
    kind = f"{type(local).__module__}.{type(local).__qualname__}"
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
        self.resize = False  # load(resize=True)

    def adapter_for(self, obj: Any) -> Optional[Adapter]:
        """The adapter that takes ``obj`` (``adapters.adapter_for``), for adapters below the list (``per_rank``)."""
        return adapter_for(obj)

    def unexpected(self, path: str) -> None:
        """Report a saved entry the live state has no place for."""
        self.flat.value_paths.append("?" + path)

    def target(self, path: str, live: Any, node: Any = None) -> None:
        """Fill live tensor ``live`` from saved tensor ``path``; ``node``: its saved values-tree node, if known.

        A live wrapper subclass is filled through its inner tensors, in place
        (``subclass``), after its saved context is checked.
        """
        if is_sharded_subclass(live):
            _, ctx, inner = sharded_inner(live, path)
            if node is not None and node is not MISSING:
                check_ctx(live._local_tensor, node, path, shape=tuple(live.shape), ctx=ctx)
            for a, x in inner.items():
                n = node["inner"][a]["name"] if is_subclass_node(node) else inner_name(path, a)
                self.flat.tensors[n] = x
            return
        if is_wrapper_subclass(live):
            if node is not None and node is not MISSING:
                check_ctx(live, node, path)
                names = {a: r["name"] for a, r in node["inner"].items()}
            else:
                names = {a: inner_name(path, a) for a in live.__tensor_flatten__()[0]}
            for a, n in names.items():
                self.flat.tensors[n] = getattr(live, a)
            return
        if is_subclass_node(node):
            why = blocks_refusal(live, node, self.saved_tensors, path)
            if why:
                raise StateMismatchError(why)
            check_ctx(live, node, path)  # raises: a plain live tensor where a subclass was saved
        self.flat.tensors[path] = live

    def walk(self, live: Any, saved: Any, path: str, setter: Optional[Callable[[Any], None]]) -> None:
        """Match live ``live`` against the saved subtree ``saved``."""
        if is_tensor(live):
            meta = self.saved_tensors.get(path) if self.resize and setter is not None else None
            # Exactly torch.Tensor: a Parameter, DTensor or subclass is never swapped for a new object.
            if meta is not None and type(live) is torch.Tensor and tuple(live.shape) != tuple(meta.shape):
                self.flat.creates[path] = setter  # type: ignore[assignment]
                self.flat.resized[path] = live
                return
            self.target(path, live, saved)
            return
        adapter = adapter_for(live)
        if adapter is not None:
            adapter.load(live, path, saved, self)
            return
        if live is None and setter is not None and saved is not MISSING and _contains_ref(saved):
            # A None placeholder where the checkpoint has tensors: filled with
            # what was saved there (new full tensors, values as saved).
            holder: Dict[str, Any] = {}
            fill_from_saved(holder, "v", saved, path, self)
            self.flat.finalizers.append(lambda s=setter, h=holder: s(h["v"]))  # type: ignore[misc]
            return
        if isinstance(live, (dict, list)) and _is_plain(live) and saved is not MISSING and not _contains_ref(saved):
            # Pure JSON containers come back whole: the saved value replaces
            # the live placeholder (e.g. ``{"history": []}``).
            if setter is not None:
                self.flat.value_paths.append(path)
                self.flat.finalizers.append(lambda s=setter, v=decode_saved(saved, path): s(v))  # type: ignore[misc]
            return
        if isinstance(live, dict):
            if isinstance(saved, dict) and saved.get(TAG) == "dict":
                items = {str(decode_value(k)): v for k, v in saved["items"]}
            elif isinstance(saved, dict) and TAG not in saved:
                items = saved
            else:
                items = None
            for k in canonical_keys(live):
                sub = None if items is None else items.get(str(k), MISSING)
                self.walk(live[k], sub, join_path(path, k), _dict_setter(live, k))
            if items is not None:
                # One set of the live keys for the whole dict: rebuilding it per
                # saved key made a load quadratic in the number of keys.
                live_keys = {str(x) for x in live}
                for k in items:
                    if k not in live_keys:
                        self._unexpected_value(join_path(path, k), items[k])
            return
        if isinstance(live, list):
            seq = saved if isinstance(saved, list) else None
            for i, x in enumerate(live):
                sub = seq[i] if seq is not None and i < len(seq) else MISSING
                self.walk(x, sub, join_path(path, i), _list_setter(live, i))
            return
        if isinstance(live, tuple):
            # Tuples are immutable: values inside come back only if the parent
            # can take a new tuple.
            seq = saved["items"] if isinstance(saved, dict) and saved.get(TAG) == "tuple" else None
            for i, x in enumerate(live):
                sub = seq[i] if seq is not None and i < len(seq) else MISSING
                self.walk(x, sub, join_path(path, i), None)
            if setter is not None and seq is not None and not any(is_tensor(x) for x in live):
                self.flat.finalizers.append(lambda s=setter, v=decode_saved(saved, path): s(v))  # type: ignore[misc]
            return
        # A plain value: the saved one replaces it.
        if saved is MISSING:
            self.missing_values.append(path)
            return
        if is_tensor_ref(saved):
            self.missing_values.append(path + " (saved as a tensor)")
            return
        if setter is not None:
            self.flat.value_paths.append(path)
            self.flat.finalizers.append(lambda s=setter, v=decode_saved(saved, path): s(v))  # type: ignore[misc]

    def _unexpected_value(self, path: str, node: Any) -> None:
        # Unexpected tensors are found by name against the manifest; plain
        # values only matter in strict mode.
        if not _contains_ref(node):
            self.flat.value_paths.append("?" + path)


def _is_plain(v: Any) -> bool:
    """True if ``v`` holds only JSON-able values (no tensors, modules or stateful objects)."""
    if isinstance(v, dict):
        return all(_is_plain(x) for x in v.values())
    if isinstance(v, (list, tuple)):
        return all(_is_plain(x) for x in v)
    return v is None or isinstance(v, (bool, int, float, str))


def _contains_ref(node: Any) -> bool:
    if is_tensor_ref(node):
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
    resize: bool = False,
) -> Tuple[FlatLoad, List[str], List[str]]:
    """Walk live ``state`` against the saved tree.

    Returns ``(flat, missing_values, unexpected_values)``: plain values the
    live state has but the checkpoint lacks, and the reverse (only within the
    top-level keys ``state`` names). ``rank``/``world`` are the loading
    group's; ``saved_world`` and ``per_rank`` (``manifest.extra["per_rank"]``)
    come from the checkpoint and serve per-rank state. ``resize``: a plain
    tensor held in a dict or list of the state (never a module's parameter
    or buffer, a DTensor or a subclass) whose shape differs from the saved
    one is replaced by a new tensor (``FlatLoad.resized``), not filled.
    """
    if not isinstance(state, dict):
        raise UnsupportedStateError(f"state must be a dict, got {type(state).__name__}")
    saved_tree = saved_tree if isinstance(saved_tree, dict) else {}
    w = _LoadWalker(saved_tensors, strict, state, rank, world, saved_world, per_rank)
    w.resize = resize
    # The canonical order makes targets and finalizers (load_state_dict calls,
    # which may be collective) come in the same order on every rank.
    for k in canonical_keys(state):
        w.flat.roots.append(k)
        w.walk(state[k], saved_tree.get(k, MISSING), k, _dict_setter(state, k))
    w.flat.finalizers.extend(w.late)
    unexpected = sorted(p[1:] for p in w.flat.value_paths if p.startswith("?"))
    w.flat.value_paths = [p for p in w.flat.value_paths if not p.startswith("?")]
    return w.flat, sorted(w.missing_values), unexpected
