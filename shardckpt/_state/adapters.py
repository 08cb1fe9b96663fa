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
The ``Adapter`` base class and ``register_adapter`` live in ``base`` (below
every adapter); each built-in family has its own module (``module``,
``optim``, ``stateful``, ``per_rank``) built on ``base``. This module sits
above them and assembles the list; ``walk`` asks it.
"""

from __future__ import annotations

from typing import Any, List, Optional

from .base import _FIRST, _LAST, Adapter, register_adapter
from .module import ModuleAdapter, SelectedAdapter
from .optim import FlatOptimizerAdapter, OptimizerAdapter
from .per_rank import PerRankAdapter
from .stateful import StatefulAdapter

__all__ = ["Adapter", "register_adapter", "adapter_for", "adapters"]

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
