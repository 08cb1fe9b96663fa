"""What an adapter is handed: the walkers' interfaces and the flat results they fill.

``SaveWalker`` and ``LoadWalker`` are the parts of the walk (``walk``) an
adapter may use: ``walker.walk`` to walk a sub-value, ``walker.flat`` (a
``FlatSave``/``FlatLoad``) to register tensors, creates and finalizers,
``walker.target`` to fill a live tensor. They live here, below ``base``,
so that the adapters (``base`` and the families) name the walkers' types
without importing the walk, which sits above them and asks the adapter list:
the state layer's imports run one way, type-only ones included.

Example (an adapter's load, as ``register_adapter`` users write it):
    >>> def load(self, obj, path, saved, walker: LoadWalker) -> None:  # doctest: +SKIP
    ...     walker.target(path + ".weight", obj.weight)

Limits: interfaces only (``typing.Protocol``); ``walk`` holds the one implementation of each.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Callable, Dict, List, Optional, Protocol, Tuple

import torch

__all__ = ["FlatSave", "FlatLoad", "SaveWalker", "LoadWalker"]


@dataclass
class FlatSave:
    """What a save walk produced: the named tensors and the JSON tree that references them."""

    tensors: Dict[str, Any] = field(default_factory=dict)  # name -> tensor / DTensor / ShardedTensor
    tree: Any = None
    per_rank: Dict[str, Any] = field(default_factory=dict)  # path -> JSON tree of per-rank values
    # Tensors of per-rank state: held and written by this rank alone, under a
    # name that contains the rank (other ranks hold their own).
    per_rank_tensors: List[str] = field(default_factory=list)


@dataclass
class FlatLoad:
    """What a load must fill, and what to do once it is filled."""

    tensors: Dict[str, Any] = field(default_factory=dict)  # name -> live tensor to copy_ into
    # Tensors the checkpoint has but the live state can only take as new
    # objects (e.g. optimizer state before the first step): name -> callback
    # receiving the loaded full tensor.
    creates: Dict[str, Callable[[torch.Tensor], None]] = field(default_factory=dict)
    roots: List[str] = field(default_factory=list)  # name prefixes the live state claims
    finalizers: List[Callable[[], None]] = field(default_factory=list)
    value_paths: List[str] = field(default_factory=list)
    # Saved tensor name prefixes deliberately not loaded (other ranks'
    # per-rank state, optimizer state of parameters reported as unexpected).
    skip: List[str] = field(default_factory=list)
    #: Load: ``(loaded name, other name)`` of each tensor the live model ties
    #: whose names the checkpoint both holds; the load checks they are equal.
    tied: List[Tuple[str, str]] = field(default_factory=list)
    #: ``load(resize=True)``: plain tensors of a dict whose shape differs from
    #: the checkpoint's, by name (also in ``creates``): a new tensor of the
    #: stored shape, the placeholder's dtype and device, replaces each.
    resized: Dict[str, torch.Tensor] = field(default_factory=dict)


class SaveWalker(Protocol):
    """The save walk as an adapter's ``save`` sees it."""

    flat: FlatSave
    root: Dict[str, Any]  # the whole user state: adapters look up related entries
    rank: int
    world: int
    per_rank_depth: int  # > 0 while walking inside a PerRank value

    def walk(self, v: Any, path: str) -> Any:
        """``v`` walked under ``path``: its JSON node (tensors put in ``flat.tensors``)."""
        ...


class LoadWalker(Protocol):
    """The load walk as an adapter's ``load`` sees it."""

    flat: FlatLoad
    saved_tensors: Dict[str, Any]  # name -> TensorMeta of the checkpoint
    strict: bool
    missing_values: List[str]
    root: Dict[str, Any]
    rank: int
    world: int
    saved_world: int
    per_rank: Any  # manifest.extra["per_rank"]: list by saving rank
    late: List[Callable[[], None]]  # finalizers run after all others (random generator restores)

    def adapter_for(self, obj: Any) -> Any:
        """The adapter that takes ``obj`` (the ordered list's first match), or None."""
        ...

    def unexpected(self, path: str) -> None:
        """Report a saved entry the live state has no place for."""
        ...

    def target(self, path: str, live: Any, node: Any = None) -> None:
        """Fill live tensor ``live`` from saved tensor ``path``; ``node``: its saved values-tree node, if known."""
        ...

    def walk(self, live: Any, saved: Any, path: str, setter: Optional[Callable[[Any], None]]) -> None:
        """Match live ``live`` against the saved subtree ``saved``."""
        ...
