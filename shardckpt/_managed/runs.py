"""Which local steps are this run's: the run-identity checks of a manager with ``local=`` (``_managed.identity``'s rules, on a root).

Node-local scratch is reused across jobs: a local step of another root or
run is ignored by restore and retention, logged once naming its root, and
left in place. :class:`RunSteps` reads the steps' manifests and applies
:func:`shardckpt._managed.identity.foreign`.
"""

from __future__ import annotations

import logging
from typing import Any, Iterable, List, Optional, Set, Tuple

from .._format import open_manifest
from .._format.naming import step_dir_name
from .._storage import Storage
from ..errors import CorruptCheckpointError
from . import identity

__all__ = ["RunSteps"]

log = logging.getLogger("shardckpt")


class RunSteps:
    """The local steps under ``root`` of the run whose remote root is ``home``.

    Args:
        root: the local directory (``CheckpointManager(local=)``).
        home: the remote root the run's steps record (``identity.ROOT_KEY``).
    """

    def __init__(self, root: Storage, home: str) -> None:
        self.root, self.home = root, home
        #: (step, why) of local steps of another run already logged (said once each).
        self.said: Set[Tuple[int, str]] = set()

    def extra(self, step: int) -> Any:
        """The ``extra`` of local step ``step``'s manifest (its identity); raises when it cannot be read."""
        return open_manifest(self.root.child(step_dir_name(step)), chunks=False).extra

    def run_of_save(self, run: Optional[str], committed: Iterable[int]) -> str:
        """Rank 0, before a save: ``run`` (agreed at restore), else the run of the newest local step of this root, else new."""
        if run is not None:
            return run
        own = self.own(committed, None)
        return identity.inherit(identity.whose(self.extra(own[-1]))[1] if own else None)

    def foreign(self, step: int, run: Optional[str]) -> Optional[str]:
        """Why local step ``step`` is not this run's (:func:`identity.foreign`; unreadable: not known to be), None if it is; said once per step."""
        try:
            why = identity.foreign(self.extra(step), root=self.home, run=run)
        except Exception as e:  # noqa: BLE001 - unreadable: not known to be this run's, so never deleted as ours
            why = f"its manifest cannot be read ({type(e).__name__}: {e})"
        if why is not None and (step, why) not in self.said:
            self.said.add((step, why))
            log.warning("shardckpt: local step %d at %s is not taken as a step of this run (whose root is %s): %s; "
                        "ignored and left in place", step, self.root.url_of(step_dir_name(step)), self.home, why)
        return why

    def own(self, steps: Iterable[int], run: Optional[str]) -> List[int]:
        """Of local ``steps``, those of this run (``run``; None: any run of this root); the others are logged once and left alone."""
        return [s for s in steps if self.foreign(s, run) is None]

    def check_own(self, step: int, run: Optional[str]) -> None:
        """Raise ``CorruptCheckpointError`` (restore skips the step as it skips damage) unless local step ``step`` is this run's."""
        why = self.foreign(step, run)
        if why is not None:
            raise CorruptCheckpointError(f"local step {step} at {self.root.url_of(step_dir_name(step))} is not this run's: {why}")
