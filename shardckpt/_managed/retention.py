"""Steps under one root: their names, what retention keeps, and the deletions that keep every kept step whole.

Two halves, kept apart:

* pure decisions over step numbers (no storage, no process group):
  :func:`check_step`,
  :func:`steps_to_delete`, :func:`stale_leftovers`, :func:`plan_retention`
  (a frozen :class:`RetentionPlan`) and :func:`stray_files` (what ``gc``
  removes inside a committed step);
* small I/O functions, each taking the root's ``Storage`` explicitly:
  :func:`scan`, :func:`uncommit`, :func:`live_files_of`,
  :func:`referenced_files`, :func:`clear_dir`, :func:`remove_leftover`,
  :func:`collect_garbage` (``CheckpointManager.cleanup`` / ``shardckpt gc``)
  and :func:`apply`, the one executor of a retention plan, for the
  manager's root and for the remote of ``local=`` alike.

Deletion order is what makes a crash harmless: a dropped step's manifest goes
first (a crash leaves a leftover that ``restore`` skips, never a committed
step with missing files), and only files that no kept manifest names are
removed (docs/manager.md, "Retention with incremental steps").
"""

from __future__ import annotations

import logging
import operator
import uuid
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from typing import Any, Callable, Dict, FrozenSet, Iterable, List, Optional, Set, Tuple

from .._format import DATA_DIR, DATA_SUFFIX, HF_INDEX_NAME, MANIFEST_NAME, open_manifest
from .._format.naming import STEP_PREFIX, parse_step_dir, step_dir_name
from .._format.refs import live_files, removable
from .._storage import Storage
from ..errors import CheckpointError, CheckpointNotFoundError, UsageError

__all__ = [
    "MAX_STEP", "UNKNOWN", "ASIDE_PREFIX",
    "check_step", "steps_to_delete", "stale_leftovers",
    "RetentionPlan", "plan_retention", "stray_files",
    "scan", "uncommit", "clear_unfinished", "live_files_of", "referenced_files", "clear_dir", "remove_leftover", "collect_garbage", "apply",
]

log = logging.getLogger("shardckpt")

#: Largest step number (int64, what trainers count in): a bigger one has no directory name to write.
MAX_STEP = 2**63 - 1

#: :func:`clear_dir`'s "liveness not computed yet".
UNKNOWN: Any = object()

#: Name prefix of a step directory moved aside by :func:`remove_leftover` (``.removing-step-00000007-<hex>``).
ASIDE_PREFIX = ".removing-"

#: Listing more step directories than this on a high-latency store checks their manifests in parallel.
SERIAL_SCAN_MAX = 2
#: Threads of that parallel check.
SCAN_THREADS = 16


# --------------------------------------------------------------------------
# pure decisions


def check_step(step: Any) -> int:
    """``step`` as an int, checked: a non-negative integer (numpy ints and 0-d int tensors too) up to :data:`MAX_STEP`.

    Raises:
        UsageError: a bool, a negative or too large number, or not an integer.

    Example:
        >>> check_step(7)
        7
    """
    try:
        value = operator.index(step)  # ints, numpy ints, 0-d int tensors
    except TypeError:
        value = -1
    if isinstance(step, bool) or not 0 <= value <= MAX_STEP:
        # repr of a 5,000-digit int would itself raise: show its size instead.
        shown = f"an int of {value.bit_length()} bits" if value > MAX_STEP else repr(step)[:80]
        raise UsageError(f"step must be a non-negative int (at most 2**63 - 1), got {shown}")
    return value


def steps_to_delete(committed: Iterable[int], *, keep_last: Optional[int], keep_every: Optional[int], protect: Iterable[int] = ()) -> List[int]:
    """Committed steps retention removes: all but the newest ``keep_last``,
    multiples of ``keep_every`` and ``protect``. ``keep_last=None`` keeps all.

    Example:
        >>> steps_to_delete([1, 2, 3, 4, 5], keep_last=2, keep_every=2)
        [1, 3]
    """
    steps = sorted(set(committed))
    if keep_last is None or not steps:
        return []
    keep: Set[int] = set(steps[-keep_last:]) | set(protect)
    if keep_every:
        keep |= {s for s in steps if s % keep_every == 0}
    return [s for s in steps if s not in keep]


def stale_leftovers(committed: Iterable[int], unfinished: Iterable[int]) -> List[int]:
    """Steps without a manifest that retention and ``cleanup()`` may remove: those below the newest committed step.

    A step directory without a manifest is either a crashed save's leftover
    or a save in flight, maybe in another process (a ``cleanup()`` loop, a
    second job): removing files under a save about to commit would leave a
    committed step with missing files. Saves go forward, so one below the
    newest committed step is no save in flight; a newer one may be and stays
    (the next save of that step, or the first commit past it, removes it).

    Example:
        >>> stale_leftovers([3, 5], [4, 6])
        [4]
    """
    done = list(committed)
    newest = max(done) if done else None
    return sorted(s for s in set(unfinished) if newest is not None and s < newest)


@dataclass(frozen=True)
class RetentionPlan:
    """What retention does after a commit: uncommit and clear ``drop``, clear ``stale``; ``kept`` name the live files.

    Attributes:
        drop: committed steps to delete (manifest first), oldest first.
        stale: step directories without a manifest to clear (:func:`stale_leftovers`).
        kept: committed steps that stay; only files their manifests do not name are removed.
    """

    drop: Tuple[int, ...]
    stale: Tuple[int, ...]
    kept: Tuple[int, ...]

    @property
    def empty(self) -> bool:
        """Nothing to delete (so no manifest needs reading)."""
        return not self.drop and not self.stale


def plan_retention(
    committed: Iterable[int], unfinished: Iterable[int], *, keep_last: Optional[int], keep_every: Optional[int],
    protect: Iterable[int] = (),
) -> RetentionPlan:
    """Retention's plan for a root holding ``committed`` steps and ``unfinished`` ones (no manifest).

    Args:
        committed: steps with a manifest.
        unfinished: steps whose directory has no manifest.
        keep_last, keep_every, protect: as :func:`steps_to_delete`.

    Example:
        >>> plan_retention([1, 2, 3], [0, 4], keep_last=1, keep_every=None, protect=[3])
        RetentionPlan(drop=(1, 2), stale=(0,), kept=(3,))
    """
    done = sorted(set(committed))
    drop = steps_to_delete(done, keep_last=keep_last, keep_every=keep_every, protect=protect)
    gone = set(drop)
    return RetentionPlan(
        drop=tuple(drop), stale=tuple(stale_leftovers(done, unfinished)), kept=tuple(s for s in done if s not in gone)
    )


def stray_files(name: str, present: Iterable[str], listed: Iterable[str], live: Iterable[Tuple[str, str]]) -> List[str]:
    """Files inside committed step ``name`` that ``gc`` removes: stale temporary files and unlisted data files.

    Args:
        name: the step's directory name.
        present: its files (paths inside it).
        listed: the files its manifest lists.
        live: ``(dir, path)`` of the files any kept manifest names (a later
            incremental step may reference a replaced file of this step).

    Example:
        >>> stray_files("step-00000001", ["manifest.json", "data/a.safetensors", "data/b.safetensors", ".m.tmp"],
        ...             ["data/a.safetensors"], [])
        ['data/b.safetensors', '.m.tmp']
    """
    keep = set(listed) | {MANIFEST_NAME, HF_INDEX_NAME} | {rel for d, rel in live if d == name}
    out = []
    for rel in present:
        stale_tmp = rel.rsplit("/", 1)[-1].startswith(".") and rel.endswith(".tmp")
        orphan = rel.startswith(DATA_DIR + "/") and rel.endswith(DATA_SUFFIX) and rel not in keep
        if stale_tmp or orphan:
            out.append(rel)
    return out


# --------------------------------------------------------------------------
# I/O on the root


def scan(root: Storage) -> Tuple[List[int], List[Tuple[int, str]]]:
    """``(committed steps, [(step, dir name) without a manifest])`` under ``root``, both sorted."""
    # Listing caches (s3fs, gcsfs) would hide steps committed since.
    root.invalidate_cache()
    found = sorted((s, name) for name in root.listdir("") for s in [parse_step_dir(name)] if s is not None)
    if not found:
        return [], []

    def committed(item: Tuple[int, str]) -> bool:
        return root.exists(f"{item[1]}/{MANIFEST_NAME}")

    if not root.caps.high_latency or len(found) <= SERIAL_SCAN_MAX:
        flags = [committed(it) for it in found]
    else:
        with ThreadPoolExecutor(max_workers=min(SCAN_THREADS, len(found))) as ex:
            flags = list(ex.map(committed, found))
    done = [s for (s, _), ok in zip(found, flags) if ok]
    partial = [it for it, ok in zip(found, flags) if not ok]
    return sorted(set(done)), partial


def uncommit(root: Storage, name: str) -> None:
    """Remove step directory ``name``'s manifest (gone already: nothing to do)."""
    try:
        root.remove(f"{name}/{MANIFEST_NAME}")
    except FileNotFoundError:
        pass


def live_files_of(root: Storage, kept: Iterable[int]) -> Optional[Set[Tuple[str, str]]]:
    """``(dir, path)`` of every file the manifests of ``kept`` steps name (own and referenced); None if one is unreadable.

    None makes the caller delete nothing a reference could need: an
    unreadable manifest's references are unknown.
    """
    named: Dict[str, List[str]] = {}
    for s in kept:
        name = step_dir_name(s)
        try:
            named[name] = list(open_manifest(root.child(name), chunks=False).files)
        except (FileNotFoundError, NotADirectoryError, CheckpointNotFoundError):
            continue  # deleted since the scan: names nothing
        except Exception as e:
            log.warning("shardckpt: cannot read the manifest of kept step %d (%s: %s): files other steps may "
                        "reference are kept this time", s, type(e).__name__, e)
            return None
    return live_files(named)


def referenced_files(root: Storage, step: int) -> Optional[FrozenSet[str]]:
    """Rank 0, before a ``force`` re-save of ``step``: its files other committed steps reference; None: unknown.

    The replacing commit leaves them in place (later incremental steps
    read their bytes there); ``cleanup`` removes them once no kept
    step names them. None (a manifest unreadable, the root unlistable)
    keeps every file of the replaced checkpoint. Never raises: rank 0
    must not leave the save's exchanges.
    """
    name = step_dir_name(step)
    try:
        live = live_files_of(root, [s for s in scan(root)[0] if s != step])
    except Exception as e:
        log.warning("shardckpt: cannot tell which files of step %d other steps reference (%s: %s): the re-save "
                    "keeps all of its old files", step, type(e).__name__, e)
        return None
    if live is None:
        return None
    keep = frozenset(rel for d, rel in live if d == name)
    if keep:
        log.info("shardckpt: the re-save of step %d keeps %d replaced files that later steps reference",
                 step, len(keep))
    return keep


def clear_dir(root: Storage, name: str, live: Any = UNKNOWN, *, dry_run: bool = False) -> List[str]:
    """Delete a step directory without a manifest, except the files a kept step names (references).

    Args:
        root: the run root.
        name: the step directory.
        live: from :func:`live_files_of` (read from the committed steps when
            not given, and only when the directory holds files; None:
            unknown, so only a directory holding no data file is removed).
        dry_run: remove nothing, return what would go.

    Returns:
        What was (or, ``dry_run``, would be) removed: the directory's name
        when all of it goes, else ``name/path`` of each removed file.
    """
    try:
        present = root.child(name).walk_files("")
    except (FileNotFoundError, NotADirectoryError):
        return []
    if present and live is UNKNOWN:
        live = live_files_of(root, scan(root)[0])
    if live is None:
        if any(rel.endswith(DATA_SUFFIX) for rel in present):
            return []
        live = set()
    gone = removable(name, present, live or set())
    if len(gone) == len(present):
        if not dry_run:
            remove_leftover(root, name)
        return [name]
    if not dry_run:
        for rel in gone:
            root.remove(f"{name}/{rel}")
    return [f"{name}/{rel}" for rel in gone]


def clear_unfinished(root: Storage, name: str, *, clear: Callable[[str], Any]) -> None:
    """Rank 0, before any rank writes step directory ``name`` (the others wait for its go): remove an unfinished save's leftovers.

    ``clear``: the manager's :func:`clear_dir` on ``root``. It never raises
    (logged instead): rank 0 would skip the save's exchanges and leave its
    peers waiting. Files left are not in the new manifest, and ``cleanup()``
    removes them.
    """
    try:
        if not root.exists(f"{name}/{MANIFEST_NAME}"):
            clear(name)
    except Exception as e:
        log.warning("shardckpt: cannot remove leftovers of %s: %s: %s", root.url_of(name), type(e).__name__, e)


def remove_leftover(root: Storage, name: str) -> None:
    """Remove a step directory without a manifest, never one that commits meanwhile.

    Another process may be committing into it right now (a second writer).
    Where renames are atomic (local disks) the directory is first moved
    aside: a commit after the move fails (its directory is gone, it never
    re-creates one), and a manifest found in the moved directory means the
    commit came first, so it is moved back whole. Object stores have no
    such move: there a commit racing this removal can lose files (a second
    writer is refused, see ``_managed.owners``; ``restore`` skips such a step).
    """
    if not root.caps.atomic_rename:
        root.remove_tree(name)
        return
    aside = f"{ASIDE_PREFIX}{name}-{uuid.uuid4().hex[:12]}"
    try:
        root.rename(name, aside)
    except FileNotFoundError:
        return  # gone already
    if root.exists(f"{aside}/{MANIFEST_NAME}"):
        log.warning("shardckpt: %s was committed while its leftovers were being removed: kept", root.url_of(name))
        try:
            root.rename(aside, name)
            return
        except OSError as e:  # a new directory of that name appeared: keep both, cleanup() says so
            log.warning("shardckpt: cannot put %s back: %s", root.url_of(name), e)
            return
    root.remove_tree(aside)


def collect_garbage(root: Storage, *, dry_run: bool = False) -> List[str]:
    """Remove leftovers of unfinished saves under ``root``; returns what was removed, sorted (``shardckpt gc``).

    Removes directories moved aside by a :func:`remove_leftover` that did not
    finish, step directories without a manifest below the newest committed
    step (:func:`stale_leftovers`), and inside committed steps the files
    :func:`stray_files` names. A file that a committed step's manifest names
    is never removed, wherever it lies; a step whose manifest is unreadable
    is left alone (logged), and with any kept manifest unreadable nothing
    inside committed steps is removed (references unknown).
    """
    removed: List[str] = []
    committed, partial = scan(root)
    for name in root.listdir(""):
        # Moved aside by a leftover removal that did not finish (remove_leftover).
        if name.startswith(ASIDE_PREFIX + STEP_PREFIX) and not root.exists(f"{name}/{MANIFEST_NAME}"):
            if not dry_run:
                root.remove_tree(name)
            removed.append(name)
    live = live_files_of(root, committed)
    stale = set(stale_leftovers(committed, [s for s, _ in partial]))
    for s, name in partial:
        if s in stale:
            removed.extend(clear_dir(root, name, live, dry_run=dry_run))
    for s in committed:
        name = step_dir_name(s)
        st = root.child(name)
        try:
            m = open_manifest(st)
        except (FileNotFoundError, NotADirectoryError):
            continue  # deleted since the scan (another process's retention): nothing left to clean
        except CheckpointError as e:
            log.warning("shardckpt: cleanup leaves step %d alone, its manifest is unreadable: %s", s, e)
            continue
        if live is None:
            continue  # a kept manifest is unreadable: its references are unknown
        # Files another kept step references stay too (a forced re-save's
        # replaced data may be referenced by later incremental steps).
        for rel in stray_files(name, st.walk_files(""), m.files, live):
            if not dry_run:
                st.remove(rel)
            removed.append(f"{name}/{rel}")
    return sorted(removed)


def apply(
    root: Storage, plan: RetentionPlan, unfinished: Iterable[Tuple[int, str]] = (), *, resaved: Optional[int] = None,
    label: str = "retention", clear: Optional[Callable[[str, Any], List[str]]] = None,
) -> None:
    """Carry out retention's ``plan`` on ``root``: the one executor of the local and the remote root's retention.

    Dropped steps are uncommitted first (their manifests: a crash then
    leaves leftovers that restore skips, never a committed step with missing
    files); then their directories and the stale leftovers among
    ``unfinished`` (``(step, dir name)`` without a manifest, :func:`scan`'s)
    are cleared, keeping every file a kept manifest names (references of
    incremental steps). ``resaved``: that step was replaced by a re-save
    (a ``force`` re-flush): its replaced files go the same way. With a kept
    manifest unreadable, no data file is removed (references unknown).

    Args:
        root: the root (the manager's, or the remote of ``local=``).
        plan: :func:`plan_retention`'s.
        unfinished: the step directories without a manifest.
        resaved: a step whose replaced files to remove (its manifest kept).
        label: what the log lines call this retention.
        clear: :func:`clear_dir` on ``root`` (the manager passes its own, the seam its fault tests use).

    Example:
        >>> import tempfile
        >>> apply(Storage(tempfile.mkdtemp()), plan_retention([1, 2], [], keep_last=1, keep_every=None))
    """
    do_clear = clear if clear is not None else (lambda name, live: clear_dir(root, name, live))
    for s in plan.drop:
        log.info("shardckpt: %s removes step %d from %s", label, s, root.url)
        uncommit(root, step_dir_name(s))
    if plan.empty and resaved is None:
        return  # nothing to delete: no manifest to read
    live = live_files_of(root, plan.kept)
    stale = set(plan.stale)
    for s, name in unfinished:
        if s in stale:
            log.info("shardckpt: removing leftovers of an unfinished save: %s", root.url_of(name))
            do_clear(name, live)
    for s in plan.drop:
        do_clear(step_dir_name(s), live)
    if resaved is not None and live is not None:
        name = step_dir_name(resaved)
        for rel in removable(name, root.child(name).walk_files(""), live):
            if rel not in (MANIFEST_NAME, HF_INDEX_NAME):
                root.remove(f"{name}/{rel}")  # the replaced copy's files
