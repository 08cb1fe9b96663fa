"""The manager's glue to the memory tier (``CheckpointManager(memory=...)``, ``save_to_memory``).

The tier itself (``shardckpt._memory``) saves, holds and restores; this
module only turns the manager's ``memory=`` option into a tier and says
whether a call uses it.
"""

from __future__ import annotations

from typing import Any, Dict, Optional

from .._collective import Comm
from .._memory import MemoryTier
from .._memory.tier import MemoryStore

__all__ = ["open_memory", "save_to_memory", "warm_memory"]


def open_memory(option: Any, root_url: str) -> Optional[MemoryStore]:
    """The memory tier of ``CheckpointManager(root_url, memory=option)``; None for ``None``/``False``.

    Args:
        option: a ``MemoryTier``, True (its defaults), a directory, or a dict of its options.
        root_url: the manager's root (the tier records which root its steps belong to).

    Raises:
        UsageError: ``option`` is not one of those (as ``MemoryTier.of``).
    """
    if option is None or option is False:
        return None
    return MemoryStore(MemoryTier.of(option), root_url)


def save_to_memory(
    store: Optional[MemoryStore], step: int, state: Dict[str, Any], comm: Comm, *,
    process_group: Any = None, io_threads: Optional[int] = None, overlap: bool = False, replicas: Optional[str] = None,
    run: Optional[str] = None,
) -> bool:
    """Keep ``state`` as ``step`` in ``store`` (collective over ``comm``); False without a tier or with the tier off.

    As ``CheckpointManager.save_to_memory`` (its docstring has the contract);
    ``replicas``: the manager's replica check mode, as its storage saves use;
    ``run``: the run identity the step records (``_managed.identity``).
    """
    if store is None:
        return False
    return store.save(step, state, comm, process_group=process_group, io_threads=io_threads, overlap=bool(overlap),
                      replicas=replicas, run=run)


def warm_memory(store: Optional[MemoryStore], state: Dict[str, Any], comm: Comm, *, process_group: Any = None,
                replicas: Optional[str] = None) -> bool:
    """Make the tier's slots for ``state`` in the background (collective; the manager calls it after ``restore``).

    So the first ``save_to_memory`` neither allocates nor pins (``MemoryStore.warm``).
    False without a tier, with the tier off, or when its slots exist already.
    """
    if store is None:
        return False
    return store.warm(state, comm, process_group=process_group, replicas=replicas)
