"""One manager per root: the steps of another writer, seen before they are deleted by our retention.

Two managers saving under one root would each apply retention to the other's
steps. Rank 0 of a manager remembers the committed steps it saw at its first
save and those it saved; any other committed step that appears is another
writer's, and the manager then refuses to save (``ConcurrentUseError``).
Managers of one process are one job (one save in flight per process,
``_async``): their steps are never "another writer's" to each other, so
within a process the owner token of the last saver tells instead.
"""

from __future__ import annotations

import uuid
from typing import Dict, FrozenSet, Iterable, List, Optional, Set

from ..errors import ConcurrentUseError, format_offenders

__all__ = ["Claim", "not_ours", "saved_in_process", "taken_over", "record_save", "refuse_taken_over", "refuse_foreign"]

#: Steps saved under each root by any manager of this process.
_SAVED_IN_PROCESS: Dict[str, Set[int]] = {}

#: Root URL -> token of the manager of this process that saved there last.
_ROOT_OWNER: Dict[str, str] = {}


def not_ours(committed: Iterable[int], known: Iterable[int], saved_here: Iterable[int] = ()) -> List[int]:
    """Of ``committed``, the steps neither ``known`` (seen or saved by this manager) nor ``saved_here`` (this process), sorted.

    Example:
        >>> not_ours([1, 2, 3, 4], known=[1, 2], saved_here=[3])
        [4]
    """
    return sorted(set(committed) - set(known) - set(saved_here))


def saved_in_process(root_url: str) -> FrozenSet[int]:
    """Steps any manager of this process saved under ``root_url``."""
    return frozenset(_SAVED_IN_PROCESS.get(root_url, ()))


def taken_over(root_url: str, token: str) -> bool:
    """Whether another manager of this process saved under ``root_url`` since the manager ``token`` last did."""
    owner = _ROOT_OWNER.get(root_url)
    return owner is not None and owner != token


def record_save(root_url: str, token: str, step: int) -> None:
    """Manager ``token`` of this process saves ``step`` under ``root_url``: it owns the root now."""
    _ROOT_OWNER[root_url] = token
    _SAVED_IN_PROCESS.setdefault(root_url, set()).add(step)


def refuse_taken_over(step: int, root_url: str) -> ConcurrentUseError:
    """The error of a save refused because another manager of this process took the root over."""
    return ConcurrentUseError(
        f"save of step {step} refused: another CheckpointManager of this process saved under "
        f"{root_url} since this one's last save. Two managers must not save under one root (the "
        "retention of one deletes what the other saves). This manager saves no more there; restore() "
        "still works. Keep one manager per root (close() the old one), or give each its own root_url"
    )


def refuse_foreign(step: int, root_url: str, foreign: Iterable[int]) -> ConcurrentUseError:
    """The error of a save refused because another writer committed ``foreign`` steps under the root."""
    return ConcurrentUseError(
        f"save of step {step} refused: steps {format_offenders(list(foreign))} were committed under {root_url} "
        "by another writer since this CheckpointManager's last save. Two managers must not save under one "
        "root (the retention of one deletes what the other saves). This manager saves no more there; "
        "restore() still works. Give each run its own root_url, or stop the other one"
    )


class Claim:
    """Rank 0's claim on a root: the steps it saw at its first save and saved since, and its owner token.

    Example:
        >>> c = Claim("/ckpt/run"); c.claim(3, [1, 2])       # first save: steps 1 and 2 are the past
        >>> c.not_ours([1, 2, 3, 9])                          # step 9 appeared since: another writer's
        [9]
    """

    def __init__(self, root_url: str) -> None:
        self.root_url = root_url
        #: Committed steps this manager has seen or saved; None until its first save.
        self.known: Optional[Set[int]] = None
        self.token = uuid.uuid4().hex

    def not_ours(self, committed: Iterable[int]) -> List[int]:
        """Of ``committed``, the steps neither this manager nor this process saved, nor found at its first save."""
        return not_ours(committed, self.known or (), saved_in_process(self.root_url))

    def claim(self, step: int, committed: Iterable[int]) -> None:
        """Before saving ``step`` (``committed``: the root's committed steps now): record it, or refuse.

        Raises:
            ConcurrentUseError: another manager of this process saved under
                the root since this one's last save, or another writer
                committed steps there (named).
        """
        if self.known is not None and taken_over(self.root_url, self.token):
            # Across processes the steps tell (below); in one process the steps
            # of every manager count as this job's, so the owner token does.
            raise refuse_taken_over(step, self.root_url)
        if self.known is None:  # first save: what is there is the past (a restarted run's predecessor)
            self.known = set(committed)
        else:
            foreign = self.not_ours(committed)
            if foreign:
                raise refuse_foreign(step, self.root_url, foreign)
        self.known.add(step)
        record_save(self.root_url, self.token, step)
