"""The bottom of the state layer: the adapter base class, its registration, and the walk's shared helpers.

``Adapter`` (public) is what every adapter subclasses; ``register_adapter``
(public) records user adapters here. The helpers (``SEP``, ``_join``,
``_is_tensor``, ``Raw``, ``_MISSING``, ``_fill_from_saved``, ...) are what
both the walk (``walk``) and the built-in adapter families (``module``,
``optim``, ``stateful``, ``per_rank``) build on. The ordered list that puts
the registered adapters around the built-ins is ``adapters``, above the
families; ``walk`` asks it. Import order is top-down only:
``values``/``subclass`` <- ``base`` <- the families <- ``adapters`` <- ``walk``.
"""

from __future__ import annotations

import abc
import threading
from typing import TYPE_CHECKING, Any, Dict, List

import torch

from .._layout import is_sharded_tensor
from ..errors import CorruptCheckpointError
from .subclass import is_subclass_node, rebuild
from .values import TAG, _is_ref, decode_value

if TYPE_CHECKING:  # pragma: no cover
    from .walk import _LoadWalker, _SaveWalker

__all__ = ["Adapter", "register_adapter", "SEP", "Raw", "canonical_keys"]


# --------------------------------------------------------------------------
# the adapter base class and its registration


class Adapter(abc.ABC):
    """How one kind of object is saved and loaded.

    ``matches(obj)`` picks the adapter; ``save(obj, path, walker)`` returns the
    value to walk in its place (usually a state dict); ``load(obj, path,
    saved_tree, walker)`` registers targets/finalizers on ``walker.flat``.
    """

    @abc.abstractmethod
    def matches(self, obj: Any) -> bool:
        ...

    @abc.abstractmethod
    def save(self, obj: Any, path: str, walker: "_SaveWalker") -> Any:
        ...

    @abc.abstractmethod
    def load(self, obj: Any, path: str, saved: Any, walker: "_LoadWalker") -> None:
        ...


#: User adapters, in the order they are tried before (``_FIRST``) and after
#: (``_LAST``) the built-ins; ``adapters.adapters()`` reads them.
_FIRST: List[Adapter] = []
_LAST: List[Adapter] = []
_LOCK = threading.Lock()


def register_adapter(adapter: Adapter, *, first: bool = True) -> None:
    """Teach shardckpt a new kind of object in a state.

    Args:
        adapter: an :class:`Adapter` instance (``matches``/``save``/``load``).
        first: True (default) gives it priority over every built-in adapter
            and those registered before it; False puts it after the built-ins
            (only objects no built-in takes reach it).

    Raises:
        TypeError: ``adapter`` is not an :class:`Adapter`.

    Example:
        >>> import shardckpt
        >>> class Counter:
        ...     n = 0
        >>> class CounterAdapter(shardckpt.Adapter):
        ...     def matches(self, obj): return isinstance(obj, Counter)
        ...     def save(self, obj, path, walker): return {"n": obj.n}
        ...     def load(self, obj, path, saved, walker): obj.n = saved["n"]
        >>> shardckpt.register_adapter(CounterAdapter())

    Limits: process-wide; every rank must register the same adapters.
    """
    if not isinstance(adapter, Adapter):
        raise TypeError(f"register_adapter expects a shardckpt.Adapter, got {type(adapter).__name__}")
    with _LOCK:
        if first:
            _FIRST.insert(0, adapter)
        else:
            _LAST.append(adapter)


# --------------------------------------------------------------------------
# the walk's shared helpers


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


def _decoded(node: Any, path: str) -> Any:
    """Decode a saved value now, while planning: a load must fail before any tensor is written."""
    try:
        return decode_value(node)
    except CorruptCheckpointError as e:  # already says what and why
        raise CorruptCheckpointError(f"{path}: {e}") from None
    except Exception as e:
        raise CorruptCheckpointError(f"{path}: saved value {node!r:.100} cannot be decoded ({type(e).__name__}: {e})") from None


def _is_tensor(v: Any) -> bool:
    return isinstance(v, torch.Tensor) or is_sharded_tensor(v)


class Raw:
    """An adapter's already-encoded JSON node, put in the tree as is."""

    __slots__ = ("node",)

    def __init__(self, node: Any):
        self.node = node


class _Missing:
    def __repr__(self):
        return "<missing>"


_MISSING = _Missing()


def _fill_from_saved(container: Any, key: Any, saved: Any, path: str, walker: "_LoadWalker") -> None:
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


def _fill_subclass(container: Any, key: Any, live: Any, saved: Dict[str, Any], path: str, walker: "_LoadWalker") -> None:
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
