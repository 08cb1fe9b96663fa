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

One restore over several places (``CheckpointManager(memory=, local=)``): each
place is a :class:`Source` (name, the newest step of this run it holds, load a
step): the memory tier, per-node or shared ``local=`` directories, the remote,
or the manager's root (:class:`RootSource`). :func:`restore_from` loads from
the newest one (:func:`source_order`: a tie goes to the faster source) and
falls through to the next when a copy turns out damaged; another run's steps
are not this run's (``_managed.identity``), so no source reports them.
"""

from __future__ import annotations

import errno
import logging
from typing import Any, Callable, Dict, List, Optional, Protocol, Sequence, Tuple, cast

from .._collective import ALL, FROM_ROOT, Comm, agree
from .._format import MANIFEST_NAME, open_manifest
from .._format.files import check_files
from .._format.naming import step_dir_name
from .._format.refs import follow
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
from .identity import whose

__all__ = [
    "RESTORE_ATTEMPTS", "DAMAGE_ERRNOS", "is_damage", "validate_step", "choose_step", "pick_again",
    "say_why_empty", "initial_target", "Source", "source_order", "restore_from", "RootSource", "newest_loadable",
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


def newest_loadable(root: Storage, newest: Optional[int], *, steps: Callable[[], Sequence[int]]) -> Optional[int]:
    """The newest committed step of ``root`` that may be called durable: ``newest`` when it is loadable, else the newest older one that is.

    Loadable as the commit checks it (:func:`validate_step`: the manifest
    reads, every file it names, references included, is present at its
    recorded size; one listing per directory, the check behind
    ``_format.commit_bytes``). ``durable_step`` is never ahead of what
    ``shardckpt.verify`` accepts, so a remote step whose files were removed
    out of band (a lifecycle rule, another tool, a commit from before the
    check) is not announced. ``steps``: the committed steps, oldest first,
    listed only when ``newest`` is not loadable.

    Returns None when none is, or when storage cannot answer (logged: not
    known to be loadable).

    Example:
        >>> newest_loadable(root, 7, steps=lambda: [5, 6, 7])  # doctest: +SKIP
        6
    """
    if newest is None:
        return None
    try:
        for s in [newest] + [s for s in reversed(list(steps())) if s < newest]:
            try:
                validate_step(root, s, files=True, chunks=False)
                return s
            except Exception as e:
                if not is_damage(e):
                    raise
                log.warning("shardckpt: step %d at %s cannot be loaded (%s: %s): it is not counted durable",
                            s, root.url_of(step_dir_name(s)), type(e).__name__, e)
    except Exception as e:  # noqa: BLE001 - storage trouble: not known to be loadable, so not announced
        log.warning("shardckpt: cannot check the steps at %s (%s: %s): no step counted durable until a flush",
                    root.url, type(e).__name__, e)
    return None


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


# --------------------------------------------------------------------------
# sources: the places one restore may load a step of this run from


class Source(Protocol):
    """One place :meth:`CheckpointManager.restore` may load a step of this run from.

    Implemented for the memory tier (``_memory.restore.MemorySource``),
    per-node ``local=`` directories (``_flush.PerNodeSource``), and a root of
    committed steps, the local directory, the remote or the manager's own
    (:class:`RootSource`). Both methods are collective: every rank calls them
    in the same order and gets the same answer.
    """

    name: str

    def newest(self, step: Optional[int]) -> Optional[int]:
        """The newest step of this run it holds whole (``step`` given: ``step`` if it holds it); None: none."""

    def load(self, state: Dict[str, Any], step: int, *, exact: bool) -> Optional[Tuple[int, str]]:
        """Load ``step`` (``exact``: that step, else it or the newest undamaged one before it): ``(step, restored_from)``.

        None: its copy cannot be loaded (damaged or gone, logged); the next
        source's load then overwrites every value.
        """


def source_order(newest: Sequence[Optional[int]]) -> List[int]:
    """Which sources to try, in order: newest step first, a tie to the earlier (faster) source; none for a source holding nothing.

    Example:
        >>> source_order([4, None, 5, 4])
        [2, 0, 3]
    """
    return sorted((i for i, n in enumerate(newest) if n is not None), key=lambda i: (-cast(int, newest[i]), i))


def restore_from(
    sources: Sequence[Source], state: Dict[str, Any], step: Optional[int], *,
    probed: Optional[Callable[[List[Optional[int]]], None]] = None,
) -> Optional[Tuple[int, str]]:
    """Collective: load the newest step of this run any of ``sources`` holds (or ``step``), falling through a copy that cannot be loaded.

    ``sources`` go fastest first (a tie goes to the earlier one). Each is
    asked for its newest step durable first (the last source: the run of
    its newest step decides which steps of the others are this run's);
    ``probed`` then sees them all (in ``sources`` order) before any load.

    Returns ``(step, restored_from)``, or None when no source holds one
    (or, ``step`` given, none holds it). Errors that are not a damaged copy
    (a state that does not fit, storage down, a newer format) propagate.

    Example:
        >>> restore_from([], {}, None) is None
        True
    """
    found: List[Optional[int]] = [None] * len(sources)
    for i in reversed(range(len(sources))):
        found[i] = sources[i].newest(step)
    if probed is not None:
        probed(found)
    order = source_order(found)
    log.info("shardckpt: restore: newest step of this run in %s: %s", ", ".join(src.name for src in sources),
             ", ".join("-" if n is None else str(n) for n in found))
    for k, i in enumerate(order):
        got = sources[i].load(state, cast(int, found[i]), exact=step is not None)
        if got is not None:
            return got
        if k + 1 < len(order):
            nxt = order[k + 1]
            log.warning("shardckpt: restore: the %s copy of step %d cannot be loaded; loading the %s copy of step %d instead "
                        "(it replaces every value loaded)", sources[i].name, found[i], sources[nxt].name, found[nxt])
    return None


class RootSource:
    """A root of committed steps as a :class:`Source`: the manager's root, the local directory of ``local=``, or its remote.

    Rank 0 lists (``steps()``: this run's committed steps) and picks; every
    rank loads the same step. ``validate``: a step's check before it is
    loaded (:func:`validate_step`); damaged steps are skipped for older ones
    (:func:`choose_step`). ``every_rank``: the check runs on every rank
    (agreed) instead of rank 0 (a local directory each rank must read).
    ``choose_first``: :meth:`newest` already skips damaged steps (the
    manager's own root: the step it reports is the one it loads); else it
    reports the newest listed (one listing: a remote the caller may not use).
    ``tolerate``: a root that cannot be listed holds nothing (logged;
    :attr:`error` says why) instead of failing the restore: the remote of
    ``local=``, while the local disk can still resume the run.

    A step picked and then deleted while it loads (another process's
    retention) is picked again (:func:`pick_again`); another error of the load
    is raised (a damaged chunk too: checksums are verified while reading).
    """

    def __init__(
        self, name: str, root: Storage, comm: Comm, *, steps: Callable[[], List[int]], validate: Callable[[int], None],
        load: Callable[[str], Any], initial_load_path: Optional[str] = None, every_rank: bool = False,
        choose_first: bool = False, say_empty: Optional[Callable[[], None]] = None, tolerate: bool = False,
    ):
        self.name, self.root, self.comm = name, root, comm
        self._steps, self._validate, self._load = steps, validate, load
        self.initial_load_path, self.every_rank, self.choose_first, self._say_empty = initial_load_path, every_rank, choose_first, say_empty
        self.tolerate = tolerate
        #: The newest step's manifest world size and run (``_managed.identity``; rank 0's listing), None when unknown.
        self.world: Optional[int] = None
        self.run: Optional[str] = None
        #: Why the root could not be listed (``tolerate``), else None.
        self.error: Optional[str] = None

    def _listing(self) -> List[int]:
        try:
            return self._steps()
        except CheckpointError:
            raise
        except Exception as e:
            raise StorageError(f"cannot list {self.root.url}: {type(e).__name__}: {e}") from e

    def _choose(self, step: Optional[int]) -> Optional[int]:
        committed = self._listing()
        if step is None and not committed:
            if self._say_empty is not None:
                self._say_empty()
            return None
        return choose_step(committed, step, self._validate, root_url=self.root.url, step_url=self.url,
                           initial_load_path=self.initial_load_path)

    def url(self, step: int) -> str:
        return self.root.url_of(step_dir_name(step))

    def newest(self, step: Optional[int]) -> Optional[int]:
        def pick() -> Tuple[Optional[int], Optional[int], Optional[str], Optional[str]]:
            try:
                if self.choose_first and not self.every_rank:
                    got = self._choose(step)
                else:
                    committed = self._listing()
                    got = (committed[-1] if committed else None) if step is None else (step if step in committed else None)
                    if step is None and not committed and self._say_empty is not None:
                        self._say_empty()
            except Exception as e:
                if not self.tolerate:
                    raise
                log.warning("shardckpt: restore: cannot list %s (%s: %s); choosing among the other sources only",
                            self.root.url, type(e).__name__, e)
                return None, None, None, f"cannot list {self.root.url}: {type(e).__name__}: {e}"
            world = run = None
            if got is not None and not self.choose_first:  # the tiers' roots: the flusher's world, the remote's run
                try:
                    m = open_manifest(self.root.child(step_dir_name(got)), chunks=False)
                    world, run = m.world_size, whose(m.extra)[1]
                except Exception:  # noqa: BLE001 - unreadable: the load's own checks say why
                    pass
            return got, world, run, None

        _, (got, self.world, self.run, self.error) = agree(
            self.comm, lambda: pick() if self.comm.rank == 0 else None, what=f"restore from {self.root.url}",
            share=lambda v: v, mode=FROM_ROOT)
        if got is None or not self.every_rank:
            return got

        def check() -> bool:
            try:
                self._validate(got)
                return True
            except Exception as e:
                log.warning("shardckpt: rank %d cannot restore step %d of %s (%s: %s)", self.comm.rank, got, self.root.url,
                            type(e).__name__, e)
                return False

        _, oks = agree(self.comm, check, what=f"restore from {self.root.url}: step {got}", share=lambda v: v, mode=ALL)
        return got if all(oks) else None

    def load(self, state: Dict[str, Any], step: int, *, exact: bool) -> Optional[Tuple[int, str]]:
        value: Optional[int] = step
        for attempt in range(RESTORE_ATTEMPTS):
            if attempt > 0 or not (self.choose_first or self.every_rank):
                _, value = agree(self.comm, lambda: self._choose(step if exact else None) if self.comm.rank == 0 else None,
                                 what=f"restore from {self.root.url}", share=lambda v: v, mode=FROM_ROOT)
            if value is None:
                return None
            try:
                self._load(self.url(value))
            except (CorruptCheckpointError, StorageError) as e:
                # Errors of a load are agreed, so every rank is here and rank 0 decides.
                name = f"{step_dir_name(value)}/{MANIFEST_NAME}"
                _, gone = agree(self.comm, lambda name=name: not self.root.exists(name) if self.comm.rank == 0 else None,  # type: ignore[misc]
                                what=f"restore from {self.root.url}", share=lambda v: v, mode=FROM_ROOT)
                if not pick_again(gone=bool(gone), step_given=exact, attempt=attempt):
                    raise
                log.warning("shardckpt: step %d was deleted while it loaded (%s); picking the newest step again", value, type(e).__name__)
                continue
            return value, self.url(value)
        return None  # not reached: the last attempt returns or raises
