"""Whose step is this: the run identity every step of a tier records, and the check restore and retention make.

A step saved under ``CheckpointManager(remote, local=DIR)`` (the local
directory, each node's own disk, and the memory tier's steps,
``_memory.store.step_extra``) records in its manifest's ``extra``:

* ``root``: the remote root, normalized (:func:`shardckpt._memory.normalize_root`:
  one spelling per root), the same key the memory tier's steps carry;
* ``run``: the run's identity, agreed at its first save or restore
  (:func:`inherit`): the run of the step it resumed from, or of the newest
  step of this root on the local directory, else a new one. A restarted run
  keeps its identity; a new run (a new root, or nothing of this root left
  to resume) gets a new one.

Node-local scratch (``/local_nvme/ckpt``) is reused across jobs: a step
whose ``root`` is another root (or that records none) is another run's.
Restore ignores it (logged once, naming that root), and retention never
deletes it. A step of this root whose ``run`` differs from the run of the
remote's newest step belongs to another lineage of the root (a remote
emptied and started over): restore ignores it too, a memory step as well
(``_memory.restore.MemorySource``).

Limit: the remote's newest step is what names the run at restore. A new run
that starts on an emptied remote (and local directory) has no step naming
it yet, so an earlier run's memory or local step of the same root is taken
as its own, exactly as a restart of that run whose remote was lost would
take it; the two cannot be told apart. Without ``local=`` a manager's steps
record no run at all (plain saves): its memory steps record the root only.

Pure functions over ``extra`` dicts (no storage), tested alone.
"""

from __future__ import annotations

import uuid
from typing import Any, Dict, Optional, Tuple

from .._memory import normalize_root

__all__ = ["ROOT_KEY", "RUN_KEY", "new_run", "stamp", "whose", "foreign", "inherit"]

#: ``extra`` key naming the root whose step this is (the memory tier's key too).
ROOT_KEY = "root"
#: ``extra`` key naming the run (:func:`new_run`).
RUN_KEY = "run"


def new_run() -> str:
    """A new run identity (16 hex digits)."""
    return uuid.uuid4().hex[:16]


def stamp(step: int, *, root: str, run: Optional[str]) -> Dict[str, Any]:
    """The ``extra`` of a tier's step: the step, the normalized root, the run (None: not known yet, left out).

    Example:
        >>> stamp(5, root="s3://b/run/", run="ab12")
        {'step': 5, 'root': 's3://b/run', 'run': 'ab12'}
    """
    out: Dict[str, Any] = {"step": int(step), ROOT_KEY: normalize_root(root)}
    if run is not None:
        out[RUN_KEY] = run
    return out


def whose(extra: Any) -> Tuple[Optional[str], Optional[str]]:
    """``(root, run)`` a manifest's ``extra`` records (None for what it does not record).

    Example:
        >>> whose({"step": 1, "root": "s3://b/a", "run": "x"}), whose({"step": 1})
        (('s3://b/a', 'x'), (None, None))
    """
    if not isinstance(extra, dict):
        return None, None
    root, run = extra.get(ROOT_KEY), extra.get(RUN_KEY)
    return (root if isinstance(root, str) else None), (run if isinstance(run, str) else None)


def foreign(extra: Any, *, root: str, run: Optional[str] = None) -> Optional[str]:
    """None when the step whose ``extra`` this is belongs to ``root`` (and ``run``, when both know theirs); else why not.

    Args:
        extra: the step manifest's ``extra``.
        root: this run's root (normalized here).
        run: this run's identity; None: any run of ``root`` (not known).

    Example:
        >>> foreign({"step": 5, "root": "/r/a", "run": "x"}, root="/r/a"), foreign({"step": 5}, root="/r/a")[:20]
        (None, 'it records no root (')
        >>> foreign({"step": 5, "root": "/r/b"}, root="/r/a")
        "it belongs to root '/r/b'"
    """
    got_root, got_run = whose(extra)
    if got_root is None:
        return "it records no root (saved by a plain save, or by a shardckpt older than the tiers' identity)"
    if got_root != normalize_root(root):
        return f"it belongs to root {got_root!r}"
    if run is not None and got_run is not None and got_run != run:
        return f"it belongs to run {got_run} of this root, not to run {run} (the remote's newest step's)"
    return None


def inherit(*candidates: Optional[str]) -> str:
    """The run identity to keep: the first known of ``candidates`` (the step resumed from, the newest step of the root), else a new one.

    Example:
        >>> inherit(None, "ab12")
        'ab12'
    """
    for c in candidates:
        if c is not None:
            return c
    return new_run()
