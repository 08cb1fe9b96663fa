"""Tensor subclasses: saved through their own flattening protocol, or refused up front.

A *wrapper* subclass (torchao's ``NF4Tensor`` of QLoRA base weights, its
``OptimState8bit``/``OptimState4bit``/``OptimStateFp8`` low-bit optimizer
states, ``TwoTensor``, float8 wrappers) holds no storage of its own: its
``data_ptr()`` is 0 and its bytes live in *inner* plain tensors. PyTorch's
protocol for taking one apart is ``__tensor_flatten__() -> (inner attribute
names, context)`` and ``__tensor_unflatten__(inner, context, shape, stride)``.

Saving: each inner tensor becomes an ordinary tensor of the checkpoint named
``<name>.<attr>`` (real chunks, checksummed, readable by any safetensors
tool); the values tree holds, where the tensor was, a node
``{TAG: "subclass", "type", "ctx", "shape", "stride", "inner": {attr: ref}}``
with the context encoded as JSON (:func:`encode_ctx`). A context that is not
made of JSON-safe pieces (numbers, strings, dtypes, devices, sizes, tuples,
lists, str-keyed dicts, named tuples and dataclasses of those) is refused, as
is a subclass without the protocol that has no storage: :class:`UnsupportedStateError`
naming the tensor and its type, raised by the save walk, before any byte is
written and on every rank alike.

Inside a DTensor (FSDP2 over float8 weights, NF4, low-bit optimizer states)
the local shard is taken apart the same way, and each inner tensor is saved
as a DTensor of its global layout, given by the subclass family's *shard
rule* (:class:`ShardRule`, :func:`register_shard_rule`; the default
takes an inner tensor of the local shard's shape to lie as the outer tensor
does). The node records the outer (global) shape, so the checkpoint loads at
another world size or into the subclass on one process.

Loading: into a live subclass of the same type, each saved inner tensor is
copied in place into the live inner tensor (the object, and whatever holds
it — an optimizer, FSDP — stays the same) after the saved context is checked
equal to the live one (compared encoded: nothing is constructed). Where the
live state has no tensor yet (an optimizer before its first step), the
subclass is rebuilt with ``__tensor_unflatten__``.

Names in a checkpoint resolve only against what is already loaded: the
subclass type only when its full module is in ``sys.modules``, by static
lookup (``__dict__``, never ``getattr`` through a lazy ``__getattr__``), so
loading imports nothing; a context constructs only the named tuple /
dataclass types the subclass's flattening produces (:data:`_CTX_TYPES`,
:func:`register_ctx_types`), never another type with the file's arguments.

Limits: nested wrapper subclasses (inner tensors that are themselves
wrappers) are refused; a DTensor over a wrapper whose inner tensors have
another shape than the local shard needs a registered shard rule, else it
is refused at save.
"""

from __future__ import annotations

import dataclasses
import sys
import types
from collections.abc import Mapping
from typing import Any, Callable, Dict, FrozenSet, List, Optional, Tuple, cast

import torch

from .._format.values import TAG, decode_value, encode_value, tensor_ref
from .._layout import is_dtensor, is_sharded_tensor
from ..errors import StateMismatchError, UnsupportedStateError, UsageError

__all__ = [
    "SUBCLASS_TAG",
    "as_plain",
    "is_wrapper_subclass",
    "plain_problem",
    "flatten_subclass",
    "encode_ctx",
    "decode_ctx",
    "register_ctx_types",
    "inner_name",
    "check_ctx",
    "rebuild",
    "ShardRule",
    "register_shard_rule",
    "shard_rule_for",
    "sharded_inner",
    "flatten_sharded_subclass",
    "is_sharded_subclass",
    "blocks_refusal",
]

SUBCLASS_TAG = "subclass"


def _type_name(t: Any) -> str:
    return f"{type(t).__module__}.{type(t).__qualname__}"


def _special(t: Any) -> bool:
    """DTensor / ShardedTensor: handled by the layout layer, not here."""
    return is_dtensor(t) or is_sharded_tensor(t)


def is_wrapper_subclass(t: Any) -> bool:
    """Whether ``t`` is a tensor subclass taken apart through ``__tensor_flatten__``.

    Plain tensors, Parameters, DTensors and ShardedTensors are not.

        >>> is_wrapper_subclass(torch.ones(1)), is_wrapper_subclass(torch.nn.Parameter(torch.ones(1)))
        (False, False)
    """
    if not isinstance(t, torch.Tensor) or type(t) in (torch.Tensor, torch.nn.Parameter) or _special(t):
        return False
    return callable(getattr(t, "__tensor_flatten__", None))


def plain_problem(t: torch.Tensor) -> Optional[str]:
    """Why ``t`` (not a wrapper subclass, not sharded) cannot be written as its bytes; None when it can.

    A subclass made with ``as_subclass`` has real storage and is written as
    the plain tensor it views; one without storage (a wrapper lacking the
    flattening protocol) cannot be.
    """
    if type(t) in (torch.Tensor, torch.nn.Parameter) or _special(t):
        return None
    try:
        # An address compared with 0, never read: a wrapper's storage is a placeholder at 0.
        if t.numel() and (t.untyped_storage().data_ptr() == 0 or t.untyped_storage().nbytes() == 0):
            return "it holds no storage of its own"
    except Exception as e:  # noqa: BLE001 - any failure means: no readable storage
        return f"its storage cannot be reached ({type(e).__name__})"
    return None


def as_plain(t: Any) -> Any:
    """A storage-backed subclass (``as_subclass``) as the plain tensor it views; anything else as is."""
    if isinstance(t, torch.Tensor) and type(t) not in (torch.Tensor, torch.nn.Parameter) and not _special(t):
        return torch.Tensor.as_subclass(t, torch.Tensor)
    return t


def inner_name(name: str, attr: str) -> str:
    """The checkpoint name of inner tensor ``attr`` of subclass tensor ``name``: ``name.attr``."""
    return f"{name}.{attr}"


def encode_ctx(v: Any, where: str, depth: int = 0) -> Any:
    """A ``__tensor_flatten__`` context as JSON, or raise :class:`UnsupportedStateError`.

    Example:
        >>> encode_ctx([True, torch.float32], "x")
        [True, {'__shardckpt__': 'dtype', 'value': 'float32'}]
    """
    if depth > 20:
        raise UnsupportedStateError(f"{where}: its flattening context nests too deeply to save")
    if isinstance(v, torch.Size):
        return {TAG: "size", "items": [int(x) for x in v]}
    if isinstance(v, tuple) and hasattr(v, "_fields"):  # a NamedTuple
        return {
            TAG: "namedtuple",
            "type": f"{type(v).__module__}.{type(v).__qualname__}",
            "fields": {f: encode_ctx(getattr(v, f), where, depth + 1) for f in v._fields},
        }
    if dataclasses.is_dataclass(v) and not isinstance(v, type):
        return {
            TAG: "dataclass",
            "type": f"{type(v).__module__}.{type(v).__qualname__}",
            "fields": {f.name: encode_ctx(getattr(v, f.name), where, depth + 1) for f in dataclasses.fields(v)},
        }
    if isinstance(v, tuple):
        return {TAG: "tuple", "items": [encode_ctx(x, where, depth + 1) for x in v]}
    if isinstance(v, list):
        return [encode_ctx(x, where, depth + 1) for x in v]
    if isinstance(v, dict):
        if not all(isinstance(k, str) for k in v) or TAG in v:
            raise UnsupportedStateError(f"{where}: its flattening context has a dict with non-string keys")
        return {k: encode_ctx(x, where, depth + 1) for k, x in v.items()}
    try:
        return encode_value(v, where)
    except UnsupportedStateError:
        raise UnsupportedStateError(
            f"{where}: its flattening context holds a {type(v).__module__}.{type(v).__qualname__}, which has no "
            "JSON form; the tensor cannot be saved (convert it to a plain tensor, or register an adapter)"
        ) from None


def _imported(qualname: str) -> Any:
    """The object ``module.Qual.Name`` if its full module is already imported, else None.

    Static lookup only: the longest dotted prefix that is a key of
    ``sys.modules`` is the module, and the rest is looked up in
    ``__dict__`` (class attributes; never a submodule). Nothing is imported
    and no ``__getattr__`` runs (torch's lazy ``torch.onnx``, our
    ``shardckpt.converters``): a checkpoint naming ``torch.onnx.Evil`` finds
    nothing unless ``torch.onnx`` is already loaded, and then only a real
    attribute of it.
    """
    parts = qualname.split(".")
    for cut in range(len(parts) - 1, 0, -1):
        m = sys.modules.get(".".join(parts[:cut]))
        if m is None:
            continue
        obj: Any = m
        for part in parts[cut:]:
            try:
                d = object.__getattribute__(obj, "__dict__")
            except AttributeError:
                return None
            obj = d.get(part) if isinstance(d, Mapping) else None
            if obj is None or isinstance(obj, types.ModuleType):
                return None
        return obj
    return None


#: Named tuple and dataclass types (``module.QualName``) that the flattening
#: context of a subclass type may hold, by subclass type: a context decoded
#: to rebuild a subclass (no live tensor to fill) constructs only these, the
#: types its own ``__tensor_flatten__`` produces. Extended by
#: :func:`register_ctx_types`.
_CTX_TYPES: Dict[str, FrozenSet[str]] = {
    "torchao.float8.fsdp_utils.WeightWithDynamicFloat8CastTensor": frozenset(
        {"torchao.float8.float8_training_tensor.LinearMMConfig", "torchao.float8.float8_training_tensor.ScaledMMConfig"}
    ),
    "torchao.quantization.quantize_.workflows.nf4.nf4_tensor.NF4Tensor": frozenset(
        {"torchao.quantization.quantize_.workflows.nf4.nf4_tensor.SubclassTensorArgs"}
    ),
}


def register_ctx_types(type_name: str, ctx_types: Any, *, override: bool = False) -> None:
    """Allow the context of subclass ``type_name`` to hold the named tuple / dataclass types ``ctx_types``.

    A checkpoint's context is untrusted input: to rebuild a subclass, load
    constructs only the types registered for it (by name, never importing
    one). Registering the same set again is a no-op.

    Args:
        type_name: ``module.QualName`` of the wrapper subclass.
        ctx_types: ``module.QualName`` strings of the types its
            ``__tensor_flatten__`` context holds.
        override: replace the types already registered for ``type_name``.

    Raises:
        UsageError: ``type_name`` already has other types and ``override``
            is False (the message names them).

    Example:
        >>> import shardckpt
        >>> shardckpt.register_ctx_types("my.Wrapper", ["my.WrapperConfig"])
    """
    new = frozenset(str(x) for x in ctx_types)
    have = _CTX_TYPES.get(type_name)
    if have is not None and have != new and not override:
        raise UsageError(
            f"register_ctx_types({type_name!r}, {sorted(new)}): {type_name} already has the context types "
            f"{sorted(have)}; pass override=True to replace them (list every type its context holds)"
        )
    _CTX_TYPES[type_name] = new


def decode_ctx(node: Any, allowed: FrozenSet[str] = frozenset(), subclass: str = "?") -> Any:
    """The Python context :func:`encode_ctx` encoded.

    A named tuple / dataclass is constructed only if its type is in
    ``allowed`` (the types subclass ``subclass`` produces) and already
    imported (static lookup, :func:`_imported`).

    Raises:
        StateMismatchError: another type, or one not imported.
    """
    if isinstance(node, list):
        return [decode_ctx(x, allowed, subclass) for x in node]
    if isinstance(node, dict):
        kind = node.get(TAG)
        if kind == "size":
            return torch.Size(int(x) for x in node["items"])
        if kind in ("namedtuple", "dataclass"):
            name = str(node.get("type"))
            if name not in allowed:
                raise StateMismatchError(
                    f"the saved context of a {subclass} tensor subclass names the {kind} type {name!r}, which that "
                    f"subclass's flattening does not produce (allowed: {sorted(allowed)}); nothing was constructed. "
                    "If the subclass really holds it, shardckpt.register_ctx_types declares it"
                )
            cls = _imported(name)
            ok = isinstance(cls, type) and (
                dataclasses.is_dataclass(cls) if kind == "dataclass" else issubclass(cls, tuple) and hasattr(cls, "_fields")
            )
            if not ok:
                raise StateMismatchError(f"{kind} type {name!r} of a saved tensor subclass is not imported")
            fields = node.get("fields")
            if not isinstance(fields, dict):
                raise StateMismatchError(f"{kind} {name!r} of a saved tensor subclass has no fields")
            return cast(Any, cls)(**{k: decode_ctx(v, allowed, subclass) for k, v in fields.items()})
        if kind == "tuple":
            return tuple(decode_ctx(x, allowed, subclass) for x in node["items"])
        if kind is None:
            return {k: decode_ctx(v, allowed, subclass) for k, v in node.items()}
        return decode_value(node)
    return node


def flatten_subclass(t: torch.Tensor, name: str) -> Tuple[List[Tuple[str, torch.Tensor]], Dict[str, Any]]:
    """``([(inner name, inner tensor)], node)`` of wrapper subclass ``t`` saved under ``name``.

    ``node`` goes into the values tree where the tensor was; its ``inner``
    holds references to the inner tensors.

    Raises:
        UnsupportedStateError: an inner tensor is itself a wrapper (nested
            subclasses), or the context has no JSON form.

    Example:
        >>> from torch.testing._internal.two_tensor import TwoTensor  # doctest: +SKIP
        >>> flatten_subclass(TwoTensor(torch.ones(2), torch.zeros(2)), "t")[1]["inner"]  # doctest: +SKIP
        {'a': {'__shardckpt__': 'tensor', 'name': 't.a'}, 'b': {...}}
    """
    where = f"{name} (a {_type_name(t)})"
    try:
        attrs, ctx = cast(Any, t).__tensor_flatten__()
    except Exception as e:  # noqa: BLE001 - a subclass's own failure, reported as ours
        raise UnsupportedStateError(f"{where}: __tensor_flatten__ failed ({type(e).__name__}: {e})") from None
    inner: List[Tuple[str, torch.Tensor]] = []
    for a in attrs:
        x = getattr(t, a)
        if type(x) not in (torch.Tensor, torch.nn.Parameter):
            raise UnsupportedStateError(
                f"{where}: inner tensor {a!r} is a {_type_name(x)}; nested tensor subclasses cannot be saved"
            )
        inner.append((inner_name(name, a), x.detach()))
    node = {
        TAG: SUBCLASS_TAG,
        "type": f"{type(t).__module__}.{type(t).__qualname__}",
        "ctx": encode_ctx(ctx, where),
        "shape": [int(s) for s in t.shape],
        "stride": [int(s) for s in t.stride()],
        "inner": {a: tensor_ref(n) for a, (n, _) in zip(attrs, inner)},
    }
    return inner, node


def is_subclass_node(node: Any) -> bool:
    """Whether a values-tree node stands for a flattened subclass tensor."""
    return isinstance(node, dict) and node.get(TAG) == SUBCLASS_TAG and isinstance(node.get("inner"), dict)


def _sans_devices(node: Any) -> Any:
    """An encoded context with its devices blanked: a checkpoint moves between devices."""
    if isinstance(node, list):
        return [_sans_devices(x) for x in node]
    if isinstance(node, dict):
        if node.get(TAG) == "device":
            return None
        return {k: _sans_devices(v) for k, v in node.items()}
    return node


_NO_CTX = object()


def check_ctx(
    live: torch.Tensor, node: Any, path: str, *, shape: Optional[Tuple[int, ...]] = None, ctx: Any = _NO_CTX
) -> None:
    """Refuse (before any tensor changes) a saved subclass that does not fit live subclass ``live``.

    ``shape``/``ctx``: the whole tensor's shape and flattening context
    where ``live`` is a DTensor's local shard (the node records the whole).

    Raises:
        StateMismatchError: another type, other inner tensors, another
            context (quantization block sizes, dtype...) or shape.
    """
    if not is_subclass_node(node):
        raise StateMismatchError(
            f"{path}: the live tensor is a {_type_name(live)} but the checkpoint holds a plain tensor here; "
            "load it into a plain tensor, or save from the same kind of model"
        )
    if not is_wrapper_subclass(live):
        raise StateMismatchError(
            f"{path}: the checkpoint holds a {node.get('type')} tensor subclass here but the live tensor is a "
            f"{_type_name(live)}; load it into the same kind of tensor (e.g. the quantized model it was saved from)"
        )
    attrs, live_ctx = cast(Any, live).__tensor_flatten__()
    if ctx is _NO_CTX:
        ctx = live_ctx
    want = f"{type(live).__module__}.{type(live).__qualname__}"
    problems = []
    if node.get("type") != want:
        problems.append(f"type {node.get('type')} saved, {want} live")
    if sorted(node["inner"]) != sorted(attrs):
        problems.append(f"inner tensors {sorted(node['inner'])} saved, {sorted(attrs)} live")
    elif _sans_devices(node.get("ctx")) != _sans_devices(encode_ctx(ctx, path)):
        problems.append(f"context {node.get('ctx')!r:.200} saved, {encode_ctx(ctx, path)!r:.200} live")
    want_shape = list(live.shape) if shape is None else list(shape)
    if list(node.get("shape", [])) != want_shape:
        problems.append(f"shape {node.get('shape')} saved, {want_shape} live")
    if problems:
        raise StateMismatchError(f"{path}: the saved tensor subclass does not fit the live one: " + "; ".join(problems))


def rebuild(node: Dict[str, Any], inner: Dict[str, torch.Tensor], path: str) -> torch.Tensor:
    """A new subclass tensor from its saved node and loaded inner tensors (``__tensor_unflatten__``).

    Raises:
        StateMismatchError: its type is not imported in this process (it is
            never imported because a checkpoint names it), or it refuses.
    """
    type_name = str(node.get("type"))
    cls = _imported(type_name)
    if not (isinstance(cls, type) and issubclass(cls, torch.Tensor) and callable(getattr(cls, "__tensor_unflatten__", None))):
        raise StateMismatchError(
            f"{path}: the checkpoint holds a {node.get('type')} tensor subclass and the live state has no tensor "
            "there to fill; import its module (or create the state first, e.g. one optimizer step) before loading"
        )
    try:
        ctx = decode_ctx(node.get("ctx"), _CTX_TYPES.get(type_name, frozenset()), type_name)
    except StateMismatchError as e:
        raise StateMismatchError(f"{path}: {e}") from None
    try:
        return cast(Any, cls).__tensor_unflatten__(inner, ctx, torch.Size(node["shape"]), tuple(node["stride"]))
    except Exception as e:  # noqa: BLE001
        raise StateMismatchError(f"{path}: {node.get('type')}.__tensor_unflatten__ failed ({type(e).__name__}: {e})") from None


# --------------------------------------------------------------------------
# wrapper subclasses inside DTensors (FSDP2 shards through fsdp_pre_all_gather)

@dataclasses.dataclass(frozen=True)
class ShardRule:
    """How the inner tensors of one subclass family lie when it is a DTensor's local shard.

    Each inner tensor is, in order of preference:

    * of the local shard's own shape: laid out as the outer DTensor (float8
      weight wrappers, the ``codes`` of 8-bit / fp8 optimizer states);
    * named in ``flat``: a 1-D array over the outer tensor's elements in
      row-major order, one entry per ``unit`` elements (packed codes, block
      scales): sharded on its dim 0 wherever the outer tensor is sharded on
      dim 0, so shard boundaries must fall on whole units (quantization
      blocks);
    * named in ``replicated``: the same on every rank (lookup tables, a
      global mean).

    ``global_ctx(ctx, outer)`` rewrites a local shard's flattening context
    into the whole tensor's (a recorded shape), so that contexts compare
    across world sizes and a rebuild on one process gets the whole shape.
    """

    flat: FrozenSet[str] = frozenset()
    replicated: FrozenSet[str] = frozenset()
    global_ctx: Optional[Callable[[Any, Any], Any]] = None


#: Rules by subclass type (``module.QualName``), one per subclass family; a
#: type without one gets the default (only inner tensors of the local
#: shard's shape). Registered by type name: nothing is imported for it.
_SHARD_RULES: Dict[str, ShardRule] = {}


def register_shard_rule(type_name: str, rule: ShardRule, *, override: bool = False) -> None:
    """Record how the inner tensors of subclass ``type_name`` lie when it is a DTensor's local shard.

    Registering an equal rule again is a no-op.

    Args:
        type_name: ``module.QualName`` of the wrapper subclass.
        rule: its :class:`ShardRule`.
        override: replace the rule already registered for ``type_name``
            (shardckpt's own rules for torchao types included).

    Raises:
        UsageError: ``rule`` is not a ``ShardRule``, or ``type_name`` has
            another rule and ``override`` is False (the message names it).

    Example:
        >>> import shardckpt
        >>> shardckpt.register_shard_rule("my.Blockwise", shardckpt.ShardRule(flat=frozenset({"scale"})))
    """
    if not isinstance(rule, ShardRule):
        raise UsageError(f"register_shard_rule({type_name!r}, ...): the rule must be a shardckpt.ShardRule, got {type(rule).__name__}")
    have = _SHARD_RULES.get(type_name)
    if have is not None and have != rule and not override:
        raise UsageError(
            f"register_shard_rule({type_name!r}, {rule!r}): {type_name} already has the rule {have!r}; "
            "pass override=True to replace it"
        )
    _SHARD_RULES[type_name] = rule


def shard_rule_for(local: torch.Tensor) -> ShardRule:
    """The registered rule of ``local``'s type, else the default (same-shape inner tensors only)."""
    return _SHARD_RULES.get(_type_name(local), _DEFAULT_RULE)


_DEFAULT_RULE = ShardRule()


def _nf4_global_ctx(ctx: Any, outer: Any) -> Any:
    meta = ctx.get("tensor_meta") if isinstance(ctx, dict) else None
    if meta is None or not dataclasses.is_dataclass(meta):
        return ctx
    whole = dataclasses.replace(cast(Any, meta), original_shape=torch.Size(outer.shape), original_strides=tuple(outer.stride()))
    return {**ctx, "tensor_meta": whole}


def _shape_at_1_global_ctx(ctx: Any, outer: Any) -> Any:
    """``[signed, shape, dtype]`` (torchao ``OptimState4bit``): the shape made the whole tensor's."""
    if isinstance(ctx, list) and len(ctx) == 3:
        return [ctx[0], tuple(outer.shape), ctx[2]]
    return ctx


for _name, _rule in {
    "torchao.quantization.quantize_.workflows.nf4.nf4_tensor.NF4Tensor": ShardRule(
        flat=frozenset({"quantized_data", "quantized_scalers", "quantization_factor"}),
        replicated=frozenset({"scaler_mean", "nf4"}),
        global_ctx=_nf4_global_ctx,
    ),
    "torchao.optim.subclass_8bit.OptimState8bit": ShardRule(flat=frozenset({"scale"}), replicated=frozenset({"qmap"})),
    "torchao.optim.subclass_4bit.OptimState4bit": ShardRule(
        flat=frozenset({"codes", "scale"}), replicated=frozenset({"qmap"}), global_ctx=_shape_at_1_global_ctx
    ),
    "torchao.optim.subclass_fp8.OptimStateFp8": ShardRule(flat=frozenset({"scale"})),
}.items():
    register_shard_rule(_name, _rule)


def _inner_global(outer: Any, local: torch.Tensor, attr: str, x: torch.Tensor, rule: ShardRule) -> Tuple[Optional[Any], int]:
    """``(inner tensor as a global DTensor, or None where it has no layout, unit)``: see :class:`ShardRule`."""
    from torch.distributed.tensor import DTensor, Replicate, Shard
    from torch.distributed.tensor._utils import compute_local_shape_and_global_offset

    mesh, placements = outer.device_mesh, list(outer.placements)
    if tuple(x.shape) == tuple(local.shape):
        return DTensor.from_local(x, mesh, placements, run_check=False, shape=outer.shape, stride=outer.stride()), 1
    if attr in rule.replicated:
        return DTensor.from_local(x, mesh, [Replicate()] * mesh.ndim, run_check=False, shape=x.shape, stride=x.stride()), 1
    if attr not in rule.flat or x.dim() != 1 or x.numel() == 0 or local.numel() % x.numel():
        return None, 1
    unit = local.numel() // x.numel()
    if outer.numel() % unit or not all(p.is_replicate() or p == Shard(0) for p in placements):
        return None, unit
    inner_pl = [Shard(0) if p == Shard(0) else Replicate() for p in placements]
    shape = (outer.numel() // unit,)
    # The proportional map holds only where this shard starts on a whole unit
    # and torch lays the inner array's chunk out at the same place.
    _, off = compute_local_shape_and_global_offset(tuple(outer.shape), mesh, placements)
    row = int(torch.Size(outer.shape[1:]).numel())
    ishape, ioff = compute_local_shape_and_global_offset(shape, mesh, inner_pl)
    if (off[0] * row) % unit or tuple(ishape) != tuple(x.shape) or ioff[0] * unit != off[0] * row:
        return None, unit
    return DTensor.from_local(x, mesh, inner_pl, run_check=False, shape=torch.Size(shape), stride=(1,)), unit


def _working_worlds(outer: Any, unit: int, limit: int = 64) -> List[int]:
    """Numbers of ranks sharding ``outer``'s dim 0 evenly whose shards hold whole units."""
    rows, row = int(outer.shape[0]) if outer.dim() else 1, int(torch.Size(outer.shape[1:]).numel())
    return [w for w in range(1, limit + 1) if rows % w == 0 and (rows // w * row) % unit == 0]


def is_sharded_subclass(t: Any) -> bool:
    """Whether ``t`` is a DTensor whose local shard is a wrapper subclass."""
    return is_dtensor(t) and is_wrapper_subclass(t._local_tensor)


def sharded_inner(outer: Any, path: str) -> Tuple[List[str], Any, Dict[str, Any]]:
    """``(inner attrs, context, {attr: inner as a global DTensor})`` of DTensor ``outer`` with a wrapper local shard.

    Raises:
        UnsupportedStateError: an inner tensor has no global layout under the
            subclass's rule (or is itself a wrapper).
    """
    local = outer._local_tensor
    where = f"{path} (a DTensor whose local shard is a {_type_name(local)})"
    try:
        attrs, ctx = cast(Any, local).__tensor_flatten__()
    except Exception as e:  # noqa: BLE001 - a subclass's own failure, reported as ours
        raise UnsupportedStateError(f"{where}: __tensor_flatten__ failed ({type(e).__name__}: {e})") from None
    rule = shard_rule_for(local)
    out: Dict[str, Any] = {}
    bad, units = [], []
    for a in attrs:
        x = getattr(local, a)
        if type(x) not in (torch.Tensor, torch.nn.Parameter):
            raise UnsupportedStateError(
                f"{where}: inner tensor {a!r} is a {_type_name(x)}; nested tensor subclasses cannot be saved"
            )
        g, unit = _inner_global(outer, local, a, x.detach(), rule)
        if g is None:
            bad.append(f"{a} {list(x.shape)}")
            units.append(unit)
        else:
            out[a] = g
    if bad and max(units) > 1:
        unit = max(units)
        raise UnsupportedStateError(
            f"{where}: inner tensors {bad} are blocks of {unit} elements of the whole tensor {list(outer.shape)}, "
            f"and this rank's shard (placements {list(outer.placements)} over {outer.device_mesh.size()} ranks, "
            f"local shape {list(local.shape)}) does not start and end on whole blocks. Shard dim 0 over a number "
            f"of ranks whose shards hold whole blocks: {_working_worlds(outer, unit)}"
        )
    if bad:
        raise UnsupportedStateError(
            f"{where}: inner tensors {bad} have no global layout under the outer placements {list(outer.placements)} "
            f"(local shape {list(local.shape)}), and {_type_name(local)} has no shard rule for them "
            "(shardckpt.register_shard_rule). Save it unsharded (the subclass on one process), or "
            "convert it to a plain tensor first"
        )
    if rule.global_ctx is not None:
        ctx = rule.global_ctx(ctx, outer)
    return list(attrs), ctx, out


def flatten_sharded_subclass(outer: Any, name: str) -> Tuple[List[Tuple[str, Any]], Dict[str, Any]]:
    """:func:`flatten_subclass` for a DTensor whose local shard is a wrapper: inner tensors as global DTensors.

    The node records the outer (global) shape and stride, so the checkpoint
    loads into the subclass on one process, or sharded at another world size.
    """
    attrs, ctx, inner = sharded_inner(outer, name)
    where = f"{name} (a DTensor whose local shard is a {_type_name(outer._local_tensor)})"
    node = {
        TAG: SUBCLASS_TAG,
        "type": _type_name(outer._local_tensor),
        "ctx": encode_ctx(ctx, where),
        "shape": [int(s) for s in outer.shape],
        "stride": [int(s) for s in outer.stride()],
        "inner": {a: tensor_ref(inner_name(name, a)) for a in attrs},
    }
    return [(inner_name(name, a), inner[a]) for a in attrs], node


def blocks_refusal(live: Any, node: Any, saved_tensors: Dict[str, Any], path: str) -> Optional[str]:
    """Why a subclass saved in quantization blocks cannot fill plain DTensor ``live``; None if it was not.

    A low-bit optimizer keeps a shard unquantized where it is not whole
    blocks (torchao's AdamW8bit at a world size that cuts its blocks): the
    saved blocks have no place there. The message names the block size and
    the world sizes whose shards hold whole blocks.
    """
    if not (is_dtensor(live) and is_subclass_node(node)):
        return None
    whole = int(torch.Size(int(x) for x in node.get("shape", [])).numel())
    unit = 1
    for ref in node["inner"].values():
        meta = saved_tensors.get(str(ref.get("name"))) if isinstance(ref, dict) else None
        shape = list(getattr(meta, "shape", []) or [])
        if len(shape) == 1 and 0 < int(shape[0]) < whole and whole % int(shape[0]) == 0:
            unit = max(unit, whole // int(shape[0]))
    if unit == 1:
        return None
    return (
        f"{path}: saved as a {node.get('type')} in blocks of {unit} elements, but the live DTensor's local shard "
        f"here is a plain tensor of shape {list(live._local_tensor.shape)}: the live state left this shard "
        "unquantized (torchao's low-bit optimizers quantize only shards of whole blocks and at least 4,096 "
        f"values), so the saved blocks have no place here. World sizes whose shards hold whole blocks: "
        f"{_working_worlds(live, unit)} (where the shards are also large enough to be quantized), or one process"
    )
