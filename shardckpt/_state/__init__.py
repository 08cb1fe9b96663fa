"""App state <-> a flat map of named tensors plus a JSON tree.

``walk``      flatten_for_save / flatten_for_load: the walk over the user's state;
``base``      the ``Adapter`` base class and ``register_adapter`` (public),
              and the walk's helpers every adapter builds on;
``adapters``  the one ordered adapter list (registered ones around the built-ins);
``module``    the ``nn.Module`` adapter (state dict by FQN, filled in place);
``optim``     the optimizer adapters (by parameter FQN, any world size; flat ones);
``stateful``  the adapter of objects with ``state_dict``/``load_state_dict``;
``per_rank``  ``PerRank`` values and their adapter;
``ranks``     digests of plain values, to refuse at save those that differ
              across ranks (they need ``PerRank``);
``values``    the values codec (``TAG``, ``tensor_ref``, ``encode_value``,
              ``decode_value``): what the manifest's ``values`` tree means;
``subclass``  wrapper tensor subclasses: taken apart by ``__tensor_flatten__``, or refused.

Import order is top-down only: ``values``/``subclass`` <- ``base`` <-
``stateful``/``module``/``per_rank`` <- ``optim`` <- ``adapters`` <- ``walk``;
no module imports one that imports it back.
"""

from __future__ import annotations

from .adapters import Adapter, adapter_for, adapters, register_adapter
from .module import Selected, select, trainable
from .per_rank import PER_RANK_MARK, PerRank
from .values import TAG, decode_value, encode_value, tensor_ref
from .walk import (
    SEP,
    FlatLoad,
    FlatSave,
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
    "Selected",
    "trainable",
    "select",
]
