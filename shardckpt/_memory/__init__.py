"""The memory tier: the newest step in host shared memory, with a copy on a peer node (issue 24).

``CheckpointManager(root, memory=MemoryTier(...))`` (or ``memory=True`` for
the defaults) keeps the newest step saved with ``save_to_memory`` in a
shared-memory directory, which outlives the training process on a live
node, and sends each rank's files to a rank on another node; ``restore()``
then restores from the newest step held anywhere — this node's memory,
peers' memory, or storage — verifying every file before use. See
``docs/manager.md`` ("Memory tier").

This module imports nothing heavy: the tier's work is in ``tier.py`` (torch),
``store.py`` (the directory, no torch), ``plan.py`` (pure decisions) and
``transfer.py`` (point-to-point sends).
"""

from __future__ import annotations

import os
import re
from dataclasses import dataclass
from typing import Any, Mapping, Optional

from ..errors import UsageError

__all__ = ["MemoryTier", "DEFAULT_ROOT", "job_id"]

#: Where the default directory lives: tmpfs on Linux, survives the process, not the host.
DEFAULT_ROOT = "/dev/shm"


def job_id() -> str:
    """The launcher's job id (torchrun's ``TORCHELASTIC_RUN_ID``, Slurm's ``SLURM_JOB_ID``), else ``"local"``."""
    for var in ("TORCHELASTIC_RUN_ID", "SLURM_JOB_ID"):
        v = os.environ.get(var)
        if v and v != "none":
            return re.sub(r"[^A-Za-z0-9_.-]", "_", v)[:64]
    return "local"


@dataclass(frozen=True)
class MemoryTier:
    """Options of the memory tier of a :class:`~shardckpt.CheckpointManager`.

    Args:
        dir: this node's shared-memory directory (default
            ``/dev/shm/shardckpt-<job id>``). Ranks of one node must pass the
            same one, ranks of different nodes different ones (on real hosts
            the default does both).
        max_bytes: the most bytes the tier may use on one node, old and new
            step together; None: only the directory's free space bounds it.
            Each rank gets ``max_bytes // ranks_per_node``, and a step needs
            twice its bytes (own files + the copies it keeps) while the
            previous step stays until the new one is complete everywhere.
        ranks_per_node: ranks sharing one node (default ``LOCAL_WORLD_SIZE``,
            else the world: one node, no peer copy).
        peers: ``{rank: peer rank}`` overrides of the default mapping
            (rank r's copy goes to ``(r + ranks_per_node) % world``).

    Raises:
        UsageError: a negative ``max_bytes`` or ``ranks_per_node`` below 1.

    Example:
        >>> MemoryTier(dir="/dev/shm/run1", max_bytes=64 << 30).max_bytes
        68719476736

    Limits: one step in memory (the newest), plus the previous one while a
    new one is being saved; saves are synchronous (the caller waits for the
    write and the peer copy).
    """

    dir: Optional[str] = None
    max_bytes: Optional[int] = None
    ranks_per_node: Optional[int] = None
    peers: Optional[Mapping[int, int]] = None

    def __post_init__(self) -> None:
        if self.max_bytes is not None and (isinstance(self.max_bytes, bool) or not isinstance(self.max_bytes, int) or self.max_bytes < 0):
            raise UsageError(f"MemoryTier: max_bytes must be a non-negative int or None, got {self.max_bytes!r}")
        if self.ranks_per_node is not None and (isinstance(self.ranks_per_node, bool) or not isinstance(self.ranks_per_node, int) or self.ranks_per_node < 1):
            raise UsageError(f"MemoryTier: ranks_per_node must be a positive int or None, got {self.ranks_per_node!r}")

    def resolved_dir(self) -> str:
        """The directory this rank uses."""
        return self.dir if self.dir is not None else os.path.join(DEFAULT_ROOT, f"shardckpt-{job_id()}")

    @staticmethod
    def of(arg: Any) -> "MemoryTier":
        """``memory=`` of the manager: a ``MemoryTier``, True (defaults), a directory, or a dict of options."""
        if isinstance(arg, MemoryTier):
            return arg
        if arg is True:
            return MemoryTier()
        if isinstance(arg, str) and arg.strip():
            return MemoryTier(dir=arg)
        if isinstance(arg, dict):
            try:
                return MemoryTier(**arg)
            except TypeError as e:
                raise UsageError(f"CheckpointManager: memory={arg!r}: {e}; options are dir, max_bytes, ranks_per_node, peers") from None
        raise UsageError(
            f"CheckpointManager: memory={arg!r} is not a memory tier; pass True, a directory, a dict of options or "
            "shardckpt.MemoryTier(dir=..., max_bytes=...)"
        )
