"""Restore order: which committed step ``CheckpointManager.restore`` loads, and what happens when none will do.

Newest first, a step is skipped (logged) when it is *damaged* — its manifest
missing or invalid, a file missing or of the wrong size, a manifest that
records another step (a hand copy) — and the next older one is tried.
Anything else stops the choice instead of silently resuming an older step:
storage trouble (:class:`StorageError`), a step written by a newer shardckpt
(:class:`NewerFormatError`), or every step damaged while the run was started
from ``initial_load_path`` (starting over would discard its training).

The choice is a function of the committed steps and a ``validate`` callable,
so it is tested with fake inventories; :func:`validate_step` is the real
check of one step on storage.
"""

from __future__ import annotations

import errno
import logging
from typing import Any, Callable, Dict, List, Optional, Sequence

from .._format import open_manifest
from .._format.refs import follow
from .._io import check_files
from .._storage import Storage
from ..errors import (
    CheckpointError,
    CheckpointNotFoundError,
    CorruptCheckpointError,
    NewerFormatError,
    StorageError,
    UsageError,
    format_offenders,
)
from .retention import step_dir_name

__all__ = [
    "RESTORE_ATTEMPTS", "DAMAGE_ERRNOS", "is_damage", "validate_step", "choose_step", "pick_again",
    "say_why_empty", "initial_target",
]

log = logging.getLogger("shardckpt")

#: Attempts of restore() when the step it picked is deleted while it loads (another process's retention).
RESTORE_ATTEMPTS = 3

#: Characters of one skipped step's error kept in the "every step is damaged" message.
SKIPPED_ERROR_CHARS = 300

#: ``errno``s of an OS error that says a step's own files are damaged (the
#: manifest is a directory, a name too long, a path through a file...), not
#: that storage is unavailable: restore skips such a step like a corrupt one.
DAMAGE_ERRNOS = frozenset(getattr(errno, n) for n in ("EISDIR", "ENOTDIR", "ELOOP", "ENAMETOOLONG", "ENXIO", "ENODEV", "EINVAL") if hasattr(errno, n))


def is_damage(e: BaseException) -> bool:
    """Whether ``e``, met while validating a step, means the step is damaged (skip it) rather than storage trouble.

    Example:
        >>> is_damage(CorruptCheckpointError("bad")), is_damage(StorageError("down"))
        (True, False)
    """
    if isinstance(e, (CheckpointNotFoundError, CorruptCheckpointError)):
        return True
    if isinstance(e, CheckpointError):
        return False
    if isinstance(e, OSError):
        return e.errno in DAMAGE_ERRNOS or isinstance(e, (FileNotFoundError, NotADirectoryError, IsADirectoryError))
    # Malformed metadata that a parser failed to turn into our type: still the step's own damage.
    return isinstance(e, (ValueError, TypeError, KeyError, RecursionError, UnicodeError))


def validate_step(root: Storage, step: int, *, files: bool = True, chunks: bool = True) -> None:
    """Check that committed step ``step`` under ``root`` can be restored: its manifest, its step, its files.

    Args:
        root: the run root.
        step: the step.
        files: also check every data file it lists exists with its recorded
            size (one stat per file; ``CheckpointManager(check_files=)``).
        chunks: read every rank's index file too (False: per-node local
            directories, which hold only their own ranks' index files).

    Raises:
        CorruptCheckpointError: the manifest records another step (a renamed
            or copied directory), or as :func:`_format.open_manifest`.
        CheckpointNotFoundError: the manifest or a listed file is missing.
    """
    st = follow(root.child(step_dir_name(step)))  # a referenced file is checked where it lies
    m = open_manifest(st, chunks=chunks)
    saved = m.extra.get("step") if isinstance(m.extra, dict) else None
    # A step directory copied or renamed by hand holds another step's state:
    # resuming it would restart the schedule at the wrong step.
    if isinstance(saved, int) and not isinstance(saved, bool) and saved != step:
        raise CorruptCheckpointError(
            f"{st.url} holds the checkpoint of step {saved} (its manifest says so), not of step {step}; "
            f"was the directory renamed or copied? Move it back to {step_dir_name(saved)} or delete it"
        )
    if files:
        check_files(st, {rel: f.size for rel, f in m.files.items()})


def choose_step(
    committed: Sequence[int],
    step: Optional[int],
    validate: Callable[[int], None],
    *,
    root_url: str,
    step_url: Callable[[int], str],
    initial_load_path: Optional[str] = None,
) -> Optional[int]:
    """The step restore loads: ``step`` if given (it must be committed and valid), else the newest undamaged one.

    Args:
        committed: the committed steps, oldest first.
        step: the step asked for, or None for the newest restorable one.
        validate: raises when a step cannot be restored (:func:`validate_step`).
        root_url: the root, for messages.
        step_url: a step's URL, for messages.
        initial_load_path: the run's ``initial_load_path`` (with every step
            damaged, restore then refuses rather than start over).

    Returns:
        The step, or None when nothing is committed or every committed step
        is damaged (each logged) and no ``initial_load_path`` is set.

    Raises:
        CheckpointNotFoundError: ``step`` was given and is not committed.
        NewerFormatError: the newest undamaged step was written by a newer shardckpt.
        StorageError: a step could not be read for a reason other than damage.
        CorruptCheckpointError: every committed step is damaged and ``initial_load_path`` is set.

    Example:
        >>> def validate(s):
        ...     if s == 3:
        ...         raise CorruptCheckpointError("torn")
        >>> choose_step([1, 2, 3], None, validate, root_url="r", step_url=str)
        2
    """
    if step is not None:
        if step not in committed:
            have = f"committed steps: {format_offenders(list(committed))}" if committed else "no step is committed there"
            raise CheckpointNotFoundError(
                f"step {step} is not committed at {step_url(step)}; {have}. "
                "Call restore() without step= for the newest one"
            )
        validate(step)
        return step
    skipped: List[str] = []
    for s in reversed(committed):
        try:
            validate(s)
            return s
        except NewerFormatError as e:
            # Not damage: a newer shardckpt wrote it. Resuming an older
            # step instead would silently throw training away.
            raise NewerFormatError(
                f"step {s} under {root_url} (the newest undamaged step) cannot be restored by this shardckpt: {e}. "
                f"To resume from an older step on purpose, pass restore(state, step=N)"
            ) from None
        except Exception as e:
            if not is_damage(e):
                if isinstance(e, CheckpointError):
                    raise
                raise StorageError(f"cannot read step {s} under {root_url}: {type(e).__name__}: {e}") from e
            log.warning("shardckpt: skipping step %d, it cannot be restored: %s: %s", s, type(e).__name__, e)
            skipped.append(f"step {s}: {type(e).__name__}: {str(e)[:SKIPPED_ERROR_CHARS]}")
    if skipped and initial_load_path is not None:
        # The run has steps of its own: starting again from the initial
        # weights would silently discard all of its training.
        raise CorruptCheckpointError(
            f"every committed step under {root_url} is damaged, so restore() will not start over from "
            f"initial_load_path={initial_load_path!r} (that would discard the run's training). "
            f"{format_offenders(skipped)}. Repair or delete the damaged steps (shardckpt verify), or restore one "
            "with restore(state, step=N)"
        )
    return None


def pick_again(*, gone: bool, step_given: bool, attempt: int) -> bool:
    """After a load of the picked step failed: whether to pick again (its manifest is gone: another process's retention).

    A step asked for by number is never replaced by another; after
    :data:`RESTORE_ATTEMPTS` attempts the error stands.

    Example:
        >>> pick_again(gone=True, step_given=False, attempt=0), pick_again(gone=False, step_given=False, attempt=0)
        (True, False)
    """
    return gone and not step_given and attempt < RESTORE_ATTEMPTS - 1


def say_why_empty(root: Storage, *, nearby: Callable[[Any], str], remote: Optional[Storage] = None) -> None:
    """Rank 0, nothing committed: warn when the root does not even exist (a typo would restart the run).

    ``nearby(root)`` names similar paths that do exist (the hint of a missing
    checkpoint). ``remote``: with ``local=``, the durable remote, which held
    no step either: the notice names both places looked at.
    """
    try:
        exists = root.exists("")
    except Exception:
        return
    if exists:
        return
    if remote is None:
        log.warning(
            "shardckpt: CheckpointManager.restore: %s does not exist: nothing to restore, the run starts fresh "
            "(check the path for a typo if it should resume)%s", root.url, nearby(root),
        )
        return
    try:
        there = "holds no committed step" if remote.exists("") else "does not exist"
    except Exception as e:
        there = f"cannot be listed ({type(e).__name__})"
    log.warning(
        "shardckpt: CheckpointManager.restore: the local directory %s does not exist and the remote %s %s: nothing to "
        "restore, the run starts fresh (check both paths for a typo if it should resume)%s%s",
        root.url, remote.url, there, nearby(root), nearby(remote),
    )


def initial_target(state: Dict[str, Any], *, model_only: bool) -> Dict[str, Any]:
    """What ``initial_load_path`` is loaded into: ``state``, or with ``model_only`` just ``{"model": state["model"]}``.

    Raises:
        UsageError: ``model_only`` and ``state`` has no ``"model"`` entry.

    Example:
        >>> initial_target({"model": 1, "optim": 2}, model_only=True)
        {'model': 1}
    """
    if not model_only:
        return state
    if not isinstance(state, dict) or "model" not in state:
        raise UsageError(
            "CheckpointManager.restore: initial_load_model_only=True loads state['model'], and the state "
            f"has no 'model' entry (it has {format_offenders(list(state) if isinstance(state, dict) else [])}); "
            "put the model under 'model' or pass initial_load_model_only=False"
        )
    return {"model": state["model"]}
