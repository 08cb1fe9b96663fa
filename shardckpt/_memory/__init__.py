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

import hashlib
import os
from dataclasses import dataclass
from typing import Any, Mapping, Optional

from ..errors import UsageError

__all__ = ["MemoryTier", "DEFAULT_ROOT", "normalize_root", "default_dir", "uid"]

#: Where the default directory lives: tmpfs on Linux, survives the process, not the host.
DEFAULT_ROOT = "/dev/shm"
#: Hex digits of the root's SHA-256 in the default directory name (64 bits: no two roots of one user meet).
ROOT_HASH_CHARS = 16


def uid() -> int:
    """This process's effective user id (the owner the tier's directory must have); -1 where there is none."""
    geteuid = getattr(os, "geteuid", None)
    return geteuid() if geteuid is not None else -1


def normalize_root(root_url: str) -> str:
    """The storage root as the memory tier records it: one spelling per root.

    A local path (or ``file://`` URL) becomes its absolute real path, so
    ``runs/a``, ``./runs/a/`` and ``file:///abs/runs/a`` are one root; a
    remote URL loses its trailing slashes and gets a lower-case scheme.

    Example:
        >>> normalize_root("s3://Bucket/run-1/") == "s3://Bucket/run-1"
        True
    """
    url = root_url.strip()
    scheme, sep, rest = url.partition("://")
    if not sep or scheme.lower() == "file":
        return os.path.realpath(os.path.abspath(rest if sep else url))
    return f"{scheme.lower()}://{rest.rstrip('/')}"


def default_dir(root_url: str, base: str = DEFAULT_ROOT) -> str:
    """``<base>/shardckpt-<uid>-<hash of the root>``: the same on every relaunch of one root, another for any other root or user.

    No launcher job id goes in: ``torchrun --standalone`` draws a new
    ``TORCHELASTIC_RUN_ID`` per launch, and a relaunch must find the copy.

    Example:
        >>> default_dir("s3://b/run-1") == default_dir("s3://b/run-1/") != default_dir("s3://b/run-2")
        True
    """
    digest = hashlib.sha256(normalize_root(root_url).encode()).hexdigest()[:ROOT_HASH_CHARS]
    return os.path.join(base, f"shardckpt-{uid()}-{digest}")


@dataclass(frozen=True)
class MemoryTier:
    """Options of the memory tier of a :class:`~shardckpt.CheckpointManager`.

    Args:
        dir: this node's shared-memory directory (default
            ``/dev/shm/shardckpt-<uid>-<hash of the root URL>``, see
            :func:`default_dir`). Ranks of one node must pass the same one,
            ranks of different nodes different ones (on real hosts the
            default does both). It must be private: owned by this user, not
            group- or world-writable, not a symlink (else the tier is off,
            logged); it is created 0700, and holds the copy of one root only
            (``identity.json``: a copy of another root is ignored, logged).
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

    Limits: one step held in memory (the newest), plus the one being saved;
    ``save_to_memory`` waits only for the copy of the rank's shard into host
    memory (the peer copy runs in the background), so each rank maps at most
    ``2 x (own + peer)`` bytes of slots.
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

    def resolved_dir(self, root_url: str) -> str:
        """The directory this rank uses for the manager rooted at ``root_url``: ``dir``, else :func:`default_dir`."""
        return self.dir if self.dir is not None else default_dir(root_url)

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
