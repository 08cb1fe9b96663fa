"""shardckpt: checkpoints for sharded PyTorch training.

Open (safetensors + JSON manifest, no pickle), checksummed, reshardable at
load, on local disk or any fsspec storage.

    >>> import shardckpt                                   # doctest: +SKIP
    >>> shardckpt.save({"model": model, "step": 10}, "s3://bucket/run/step-10")
    >>> shardckpt.load({"model": model, "step": 0}, "s3://bucket/run/step-10")

Extension points (docs/extending.md): ``register_backend`` (a storage for a
URL scheme; ``Storage`` objects are accepted wherever a URL is),
``register_shard_rule`` / ``register_ctx_types`` (tensor subclasses) and
``register_adapter`` (state objects).

``import shardckpt`` is cheap: torch and the engine load on first use.
"""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING, Any

from . import errors as _errors
from ._version import __version__

#: Every exception class shardckpt raises on purpose, re-exported here. Built
#: from ``errors.__all__`` so the list is written once (errors.py): a new error
#: type is public as ``shardckpt.X`` the moment errors.py exports it.
_ERROR_NAMES = tuple(
    name for name in _errors.__all__ if isinstance(getattr(_errors, name), type) and issubclass(getattr(_errors, name), Exception)
)

__all__ = [
    "save",
    "load",
    "read",
    "async_save",
    "inspect",
    "verify",
    "LoadResult",
    "Manifest",
    "CheckpointManager",
    "RetentionOptions",
    "ScheduleOptions",
    "TierOptions",
    "WriteOptions",
    "ResumeOptions",
    "LastSaveOptions",
    "MemoryTier",
    "AsyncSaveHandle",
    "RNGState",
    "PerRank",
    "release_buffers",
    "register_adapter",
    "Adapter",
    "trainable",
    "select",
    "register_shard_rule",
    "register_ctx_types",
    "ShardRule",
    "register_backend",
    "Storage",
    "Capabilities",
    "Writer",
    "converters",
    "errors",
    *_ERROR_NAMES,
    "__version__",
]

# public name -> module that defines it (imported on first access)
_LAZY = {
    "MemoryTier": "._memory",
    "save": "._save",
    "load": "._load",
    "read": "._load",
    "inspect": "._verify",
    "verify": "._verify",
    "LoadResult": "._load",
    "Manifest": "._format",
    "async_save": "._async",
    "AsyncSaveHandle": "._async",
    "CheckpointManager": "._manager",
    "RetentionOptions": "._managed.options",
    "ScheduleOptions": "._managed.options",
    "TierOptions": "._managed.options",
    "WriteOptions": "._managed.options",
    "ResumeOptions": "._managed.options",
    "LastSaveOptions": "._managed.options",
    "RNGState": "._rng",
    "PerRank": "._state",
    "release_buffers": "._async",
    "register_adapter": "._state",
    "Adapter": "._state",
    "trainable": "._state",
    "select": "._state",
    "register_shard_rule": "._state.subclass",
    "register_ctx_types": "._state.subclass",
    "ShardRule": "._state.subclass",
    "register_backend": "._storage",
    "Storage": "._storage",
    "Capabilities": "._storage",
    "Writer": "._storage",
}


def __getattr__(name: str) -> Any:
    if name in _LAZY:
        mod = importlib.import_module(_LAZY[name], __name__)
        value = getattr(mod, name)
    elif name in _ERROR_NAMES:
        value = getattr(_errors, name)
    elif name == "errors":
        value = _errors
    elif name == "converters":
        value = importlib.import_module("." + name, __name__)
    else:
        raise AttributeError(f"module 'shardckpt' has no attribute {name!r}")
    globals()[name] = value
    return value


def __dir__():
    return sorted(__all__)


if TYPE_CHECKING:  # pragma: no cover
    from . import converters, errors
    from ._async import AsyncSaveHandle, async_save, release_buffers
    from ._format import Manifest
    from ._load import LoadResult, load, read
    from ._managed.options import (
        LastSaveOptions,
        ResumeOptions,
        RetentionOptions,
        ScheduleOptions,
        TierOptions,
        WriteOptions,
    )
    from ._manager import CheckpointManager
    from ._memory import MemoryTier
    from ._rng import RNGState
    from ._save import save
    from ._state import Adapter, PerRank, register_adapter, select, trainable
    from ._state.subclass import ShardRule, register_ctx_types, register_shard_rule
    from ._storage import Capabilities, Storage, Writer, register_backend
    from ._verify import inspect, verify
    from .errors import *  # noqa: F401,F403
