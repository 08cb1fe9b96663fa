"""The bottom of the adapters: the ``Adapter`` base class and the walk's shared helpers.

``Adapter`` (public) is what every adapter subclasses. The helpers
(``SEP``, ``join_path``, ``is_tensor``, ``Raw``, ``MISSING``,
``fill_from_saved``, ...) are what both the walk (``walk``) and the built-in
adapter families (``module``, ``optim``, ``stateful``, ``per_rank``) build
on. The walkers an adapter is handed are typed by their interfaces in
``walker`` (below this module); the ordered list and ``register_adapter``
are ``adapters``, above the families; ``walk`` asks it. Import order is
top-down only, type-only imports included: ``values``/``subclass``/``walker``
<- ``base`` <- the families <- ``adapters`` <- ``walk``.
"""

from __future__ import annotations

import abc
from typing import Any, Dict, List

import torch

from .._format.values import TAG, decode_value, is_tensor_ref
from .._layout import is_sharded_tensor
from ..errors import CorruptCheckpointError
from .subclass import is_subclass_node, rebuild
from .walker import LoadWalker, SaveWalker

__all__ = ["Adapter", "SEP", "Raw", "canonical_keys", "join_path", "decode_saved", "is_tensor", "MISSING", "fill_from_saved"]


# --------------------------------------------------------------------------
# the adapter base class


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
    def save(self, obj: Any, path: str, walker: SaveWalker) -> Any:
        ...

    @abc.abstractmethod
    def load(self, obj: Any, path: str, saved: Any, walker: LoadWalker) -> None:
        ...


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


def join_path(prefix: str, key: Any) -> str:
    """``prefix.key`` (just ``key`` at the top): the dotted path of an entry, and the name of a tensor there."""
    key = str(key)
    return f"{prefix}{SEP}{key}" if prefix else key


def decode_saved(node: Any, path: str) -> Any:
    """Decode a saved value now, while planning: a load must fail before any tensor is written."""
    try:
        return decode_value(node)
    except CorruptCheckpointError as e:  # already says what and why
        raise CorruptCheckpointError(f"{path}: {e}") from None
    except Exception as e:
        raise CorruptCheckpointError(f"{path}: saved value {node!r:.100} cannot be decoded ({type(e).__name__}: {e})") from None


def is_tensor(v: Any) -> bool:
    """A tensor the walk saves or fills: any ``torch.Tensor`` (DTensors and subclasses too) or a ``ShardedTensor``."""
    return isinstance(v, torch.Tensor) or is_sharded_tensor(v)


class Raw:
    """An adapter's already-encoded JSON node, put in the tree as is."""

    __slots__ = ("node",)

    def __init__(self, node: Any):
        self.node = node


class _Missing:
    def __repr__(self):
        return "<missing>"


MISSING = _Missing()


def fill_from_saved(container: Any, key: Any, saved: Any, path: str, walker: LoadWalker) -> None:
    """Rebuild ``container[key]`` from the saved tree, filling live tensors in place.

    Where the live structure has a tensor, it is a target. Where the saved
    tree has a tensor the live one lacks, a new full tensor is created.
    Plain values come from the checkpoint.
    """
    live = container[key] if _has(container, key) else MISSING

    if is_subclass_node(saved):
        _fill_subclass(container, key, live, saved, path, walker)
        return
    if is_tensor_ref(saved):
        name = saved["name"]
        if live is not MISSING and is_tensor(live):
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
            fill_from_saved(live, k, sub, join_path(path, k), walker)
        return
    if isinstance(saved, list):
        if not isinstance(live, list) or len(live) != len(saved):
            live = [None] * len(saved) if not isinstance(live, list) else (live + [None] * (len(saved) - len(live)))[: len(saved)]
            container[key] = live
        for i, sub in enumerate(saved):
            fill_from_saved(live, i, sub, join_path(path, i), walker)
        return
    if isinstance(saved, dict) and saved.get(TAG) == "tuple":
        items = list(live) if isinstance(live, tuple) and len(live) == len(saved["items"]) else [None] * len(saved["items"])  # type: ignore[list-item]
        for i, sub in enumerate(saved["items"]):
            fill_from_saved(items, i, sub, join_path(path, i), walker)
        # Rebuild the tuple after tensors are in (finalizers run in order).
        def rebuild(c=container, k=key, it=items):
            c[k] = tuple(it)

        rebuild()
        walker.flat.finalizers.insert(0, rebuild)
        return
    container[key] = decode_saved(saved, path)


def _fill_subclass(container: Any, key: Any, live: Any, saved: Dict[str, Any], path: str, walker: LoadWalker) -> None:
    """A saved tensor subclass: its inner tensors copied into the live one, or a new one rebuilt from them."""
    if live is not MISSING and is_tensor(live):
        walker.target(path, live, saved)
        return
    inner: Dict[str, Any] = {}
    for a, ref in saved["inner"].items():
        if not is_tensor_ref(ref):
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
