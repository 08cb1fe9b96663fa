"""App state <-> a flat map of named tensors plus a JSON tree.

``walk``      flatten_for_save / flatten_for_load: the walk over the user's state,
              and the built-in adapters for modules, Stateful objects, PerRank;
``adapters``  the one ordered adapter list and ``register_adapter`` (public);
``optim``     the optimizer adapter (by parameter FQN, any world size);
``ranks``     digests of plain values, to refuse at save those that differ
              across ranks (they need ``PerRank``);
``values``    the values codec (``TAG``, ``tensor_ref``, ``encode_value``,
              ``decode_value``): what the manifest's ``values`` tree means;
``subclass``  wrapper tensor subclasses: taken apart by ``__tensor_flatten__``, or refused.

At import time the order is one way: ``values`` <- ``adapters`` <- ``walk``
<- ``optim``; but ``adapters`` imports the built-ins from ``walk`` and
``optim`` on first use, and ``walk`` imports ``optim`` inside functions: a
circle that ``tests/unit/test_layers.py`` lists as still to break (issue 22).
"""

from __future__ import annotations

from .adapters import Adapter, adapter_for, adapters, register_adapter
from .values import TAG, decode_value, encode_value, tensor_ref
from .walk import (
    PER_RANK_MARK,
    SEP,
    FlatLoad,
    FlatSave,
    PerRank,
    Raw,
    flatten_for_load,
    flatten_for_save,
)

__all__ = [
    "TAG",
    "SEP",
    "FlatSave",
    "FlatLoad",
    "Adapter",
    "register_adapter",
    "adapters",
    "adapter_for",
    "flatten_for_save",
    "flatten_for_load",
    "encode_value",
    "decode_value",
    "tensor_ref",
    "Raw",
    "PerRank",
    "PER_RANK_MARK",
]
