"""The adapter list: how each kind of object in a state is taken apart and put back.

One visible, ordered list, first match wins:

1. adapters registered with ``register_adapter(a)`` (newest first);
2. the built-ins, in this order: ``PerRankAdapter`` (``PerRank`` values and
   ``RNGState``), ``ModuleAdapter`` (``nn.Module``), ``SelectedAdapter``
   (``trainable(model)``/``select(model, names)``: part of a module), ``FlatOptimizerAdapter``
   (optimizers with their own non-torch-shaped ``state_dict``, e.g.
   torchtitan's ``OptimizersContainer``), ``OptimizerAdapter``
   (``torch.optim.Optimizer``), ``StatefulAdapter`` (any object with
   ``state_dict()``/``load_state_dict()``);
3. adapters registered with ``register_adapter(a, first=False)``.

Containers (dicts, lists, tuples), tensors and plain values need no adapter.
The ``Adapter`` base class lives in ``base`` (below every adapter); each
built-in family has its own module (``module``, ``optim``, ``stateful``,
``per_rank``) built on ``base``. This module sits above them, holds the
registered adapters (``register_adapter``) and assembles the list; ``walk``
asks it. Nothing below imports it back.
"""

from __future__ import annotations

import threading
from typing import Any, List, Optional

from .base import Adapter
from .module import ModuleAdapter, SelectedAdapter
from .optim import FlatOptimizerAdapter, OptimizerAdapter
from .per_rank import PerRankAdapter
from .stateful import StatefulAdapter

__all__ = ["Adapter", "register_adapter", "adapter_for", "adapters"]

#: User adapters, in the order they are tried before (``_FIRST``) and after
#: (``_LAST``) the built-ins; ``adapters()`` reads them.
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


#: The built-ins, in the order they are tried (between ``_FIRST`` and ``_LAST``).
_BUILTIN: List[Adapter] = [PerRankAdapter(), ModuleAdapter(), SelectedAdapter(), FlatOptimizerAdapter(), OptimizerAdapter(), StatefulAdapter()]


def adapters() -> List[Adapter]:
    """The adapters in the order they are tried."""
    return [*_FIRST, *_BUILTIN, *_LAST]


def adapter_for(obj: Any) -> Optional[Adapter]:
    """The first adapter that takes ``obj``, or None (containers, tensors, plain values)."""
    for a in adapters():
        if a.matches(obj):
            return a
    return None
