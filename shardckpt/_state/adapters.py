"""The adapter list: how each kind of object in a state is taken apart and put back.

One visible, ordered list, first match wins:

1. adapters registered with ``register_adapter(a)`` (newest first);
2. the built-ins, in this order: ``PerRankAdapter`` (``PerRank`` values and
   ``RNGState``), ``ModuleAdapter`` (``nn.Module``), ``FlatOptimizerAdapter``
   (optimizers with their own non-torch-shaped ``state_dict``, e.g.
   torchtitan's ``OptimizersContainer``), ``OptimizerAdapter``
   (``torch.optim.Optimizer``), ``StatefulAdapter`` (any object with
   ``state_dict()``/``load_state_dict()``);
3. adapters registered with ``register_adapter(a, first=False)``.

Containers (dicts, lists, tuples), tensors and plain values need no adapter.
Each built-in family has its own module (``module``, ``optim``,
``stateful``, ``per_rank``), built on the walker's helpers (``walk``); they
are imported and created on first use, since ``walk`` asks this list.
"""

from __future__ import annotations

import abc
import threading
from typing import TYPE_CHECKING, Any, List, Optional

if TYPE_CHECKING:  # pragma: no cover
    from .walk import _LoadWalker, _SaveWalker

__all__ = ["Adapter", "register_adapter", "adapter_for", "adapters"]


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


_FIRST: List[Adapter] = []
_LAST: List[Adapter] = []
_BUILTIN: List[Adapter] = []
_LOCK = threading.Lock()


def _builtins() -> List[Adapter]:
    if not _BUILTIN:
        with _LOCK:
            if not _BUILTIN:
                from .module import ModuleAdapter
                from .optim import FlatOptimizerAdapter, OptimizerAdapter
                from .per_rank import PerRankAdapter
                from .stateful import StatefulAdapter

                _BUILTIN.extend(
                    [PerRankAdapter(), ModuleAdapter(), FlatOptimizerAdapter(), OptimizerAdapter(), StatefulAdapter()]
                )
    return _BUILTIN


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


def adapters() -> List[Adapter]:
    """The adapters in the order they are tried."""
    return [*_FIRST, *_builtins(), *_LAST]


def adapter_for(obj: Any) -> Optional[Adapter]:
    """The first adapter that takes ``obj``, or None (containers, tensors, plain values)."""
    for a in adapters():
        if a.matches(obj):
            return a
    return None
