"""App state <-> a flat map of named tensors plus a JSON tree.

``walk``      flatten_for_save / flatten_for_load: the walk over the user's state;
``adapters``  the one ordered adapter list (registered ones around the
              built-ins) and ``register_adapter`` (public);
``base``      the ``Adapter`` base class (public) and the walk's helpers
              every adapter builds on;
``walker``    the walkers' interfaces adapters are typed against
              (``SaveWalker``, ``LoadWalker``) and what they fill
              (``FlatSave``, ``FlatLoad``);
``module``    the ``nn.Module`` adapter (state dict by FQN, filled in place);
``optim``     the optimizer adapters (by parameter FQN, any world size; flat ones);
``stateful``  the adapter of objects with ``state_dict``/``load_state_dict``;
``per_rank``  ``PerRank`` values and their adapter;
``ranks``     digests of plain values, to refuse at save those that differ
              across ranks (they need ``PerRank``);
``values``    the values codec (``TAG``, ``tensor_ref``, ``encode_value``,
              ``decode_value``): what the manifest's ``values`` tree means;
``subclass``  wrapper tensor subclasses: taken apart by ``__tensor_flatten__``, or refused.

Import order is top-down only, type-only imports included:
``values``/``subclass``/``walker`` <- ``base`` <- ``stateful``/``module``/``per_rank``
<- ``optim`` <- ``adapters`` <- ``walk``; no module imports one that imports it back.
"""

from __future__ import annotations

from .._format.values import TAG, decode_value, encode_value, tensor_ref
from .adapters import Adapter, adapter_for, adapters, register_adapter
from .module import Selected, select, trainable
from .per_rank import PER_RANK_MARK, PerRank
from .walk import (
    SEP,
    Raw,
    flatten_for_load,
    flatten_for_save,
)
from .walker import FlatLoad, FlatSave

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
