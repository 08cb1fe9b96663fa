"""Exception types raised by shardckpt.

Every error raised at a boundary (a user's state, a user's URL, bytes read from
storage) is one of these. They subclass the builtin a caller would naturally
catch (``ValueError`` for bad input, ``OSError`` for storage trouble), so code
that predates shardckpt keeps working, while ``except shardckpt.CheckpointError``
catches all of them.
"""

from __future__ import annotations

from typing import Optional

__all__ = [
    "CheckpointError",
    "CorruptCheckpointError",
    "ChecksumMismatchError",
    "NewerFormatError",
    "CheckpointNotFoundError",
    "CheckpointExistsError",
    "StateMismatchError",
    "UnsupportedStateError",
    "UnsafeMetadataError",
    "UnreadableFileError",
    "StorageError",
    "SaveFailedError",
    "ConcurrentUseError",
    "ReplicaDivergenceError",
    "LoadFailedError",
    "UsageError",
    "MAX_OFFENDERS",
    "format_offenders",
]

#: How many offenders (names, ranks, mismatches) one message lists before
#: "... (N more)": the default of :func:`format_offenders`. Not every message
#: uses it: those that list what a directory holds or two lists side by side
#: (a state's names and a checkpoint's, a destination's files, the steps or
#: files of a not-found error) pass a shorter limit so the line stays readable.
MAX_OFFENDERS = 20


class CheckpointError(Exception):
    """Base class of every error shardckpt raises on purpose."""


class CorruptCheckpointError(CheckpointError, ValueError):
    """Saved bytes or metadata are damaged, truncated, missing or inconsistent."""


class NewerFormatError(CorruptCheckpointError):
    """The checkpoint was written by a newer shardckpt (a format version this one does not read): upgrade shardckpt."""


class ChecksumMismatchError(CorruptCheckpointError):
    """A chunk's bytes do not match the checksum recorded when it was saved."""


class UnsafeMetadataError(CorruptCheckpointError):
    """Metadata read from storage breaks a safety rule (path escape, huge header...)."""


class UnreadableFileError(CorruptCheckpointError, OSError):
    """A path in a checkpoint is not a regular file that can be read inside it.

    A directory, FIFO, socket or device where a file should be; a symlink
    loop; a name too long for the filesystem; a path through a regular file;
    a symlink leading out of the checkpoint. It is damage (a
    ``CorruptCheckpointError``) and also an ``OSError``, so code that treats
    storage trouble as ``OSError`` keeps working.
    """


class CheckpointNotFoundError(CheckpointError, FileNotFoundError):
    """No committed checkpoint (no ``manifest.json``) at the given URL."""


class CheckpointExistsError(CheckpointError, FileExistsError):
    """A committed checkpoint already exists where a save was asked to write."""


class StateMismatchError(CheckpointError, ValueError):
    """The live state and the checkpoint disagree (keys, shapes, dtypes, world size)."""


class UnsupportedStateError(CheckpointError, TypeError):
    """A value in the state cannot be saved (unknown type, Partial placement...)."""


class StorageError(CheckpointError, OSError):
    """Storage failed in a way that is not a damaged checkpoint (I/O, permissions).

    Attributes:
        code: the storage service's own error code when it gave one (S3:
            ``"InvalidRange"``, ``"NoSuchUpload"``...), else ``None``; code
            that must tell such answers apart branches on this, never on
            the message text.

    Example: ``StorageError("read s3://b/k: ...", code="InvalidRange").code == "InvalidRange"``.
    """

    code: Optional[str] = None

    def __init__(self, *args: object, code: Optional[str] = None) -> None:
        super().__init__(*args)
        self.code = code


class SaveFailedError(CheckpointError, RuntimeError):
    """A collective save failed on at least one rank; nothing was committed unless the message says "was committed".

    A failure after the commit point (a peer killed once rank 0's manifest
    was written) leaves the new checkpoint complete; the message then says so.
    """


class ConcurrentUseError(SaveFailedError):
    """Another ``CheckpointManager`` took over the root this one saves under; this one saves no more."""


class ReplicaDivergenceError(SaveFailedError):
    """Copies of replicated state differ between ranks (``save(replicas="check")``); nothing was written.

    The message names each diverged tensor and chunk and which ranks hold
    which version (docs/guarantees.md, "Replicas").
    """


class LoadFailedError(CheckpointError, RuntimeError):
    """A collective load could not run on every rank (a rank never called); nothing was loaded."""


class UsageError(CheckpointError, ValueError):
    """A call that cannot work as made: a blank URL, a torchrun job without a process group."""


def format_offenders(items, *, limit: int = MAX_OFFENDERS, sep: str = ", ") -> str:
    """Render a sorted, bounded list of offenders for an error message.

    Args:
        items: names, ranks or whole mismatch descriptions (rendered with ``str``).
        limit: how many to show; the rest are counted as ``... (N more)``.
        sep: between items (``"; "`` for items that contain commas).

    Example:
        >>> format_offenders(["b", "a", "c"], limit=2)
        'a, b, ... (1 more)'
    """
    items = sorted(str(i) for i in items)
    shown = sep.join(items[:limit])
    if len(items) > limit:
        shown += f"{sep}... ({len(items) - limit} more)"
    return shown
