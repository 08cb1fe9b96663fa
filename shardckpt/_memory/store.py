"""One node's shared-memory directory: where it is, whose it is, steps, inventory, verification, clean-up (no torch).

Layout (``docs/manager.md``, "Memory tier")::

    <dir>/                       default /dev/shm/shardckpt-<uid>-<hash of the root URL>, 0700
      identity.json              whose copy this is: {"format", "root" (normalized URL), "uid"}, 0600
      step-00000042/             an ordinary checkpoint directory (manifest.json, data/...)
                                 holding the files of this node's ranks and of the
                                 ranks whose copy this node keeps (file names carry
                                 the writer's rank, so own and peer files never clash);
                                 its manifest's ``extra["root"]`` names the root too
      .restore-r<rank>-<pid>/    a restore's staging directory: hard links to this
                                 node's verified files, plus files received from peers

Safety (``docs/manager.md``, "Memory tier: scope and safety"): the directory
is the copy of one root, of one user. :func:`open_dir` creates it 0700 (and
any parent it creates) and refuses it (tier off, storage only) when it is a
symlink, not owned by this user, group- or world-writable, or under a
directory another user can rename it in; it then claims it for the root
(``identity.json``) or tells whose it is. Nothing here follows a symlink to
write or delete: entries are examined with ``lstat``, opened ``O_NOFOLLOW``
and removed relative to a directory descriptor; a ``step-*`` that is not a
real directory is never read as a step, and removing it unlinks the link.
Housekeeping (:func:`remove_step`, :func:`clean_stale`, :func:`close_dir`)
runs only in a directory whose identity is this root's.

The data, index and manifest bytes are written by the save engine (into a
``LocalStorage`` rooted at a step directory, ``storage_options=PRIVATE``:
files 0600) or received from a peer; every file is verified against the
manifest (manifest checksum, index CRC, data block CRCs) before a restore
uses it.
"""

from __future__ import annotations

import errno
import json
import logging
import os
import shutil
import socket
import stat
import tempfile
import uuid
from typing import Any, Callable, Dict, List, Optional, Set, Tuple

from .._format import MANIFEST_NAME, open_manifest
from .._format.naming import parse_staging_dir, parse_step_dir, staging_dir_name
from .._format.naming import step_dir_name as step_name
from .._storage import Storage
from . import normalize_root, uid
from .plan import Inventory

__all__ = [
    "IDENTITY_NAME",
    "PRIVATE",
    "identity",
    "step_extra",
    "open_dir",
    "check_dir",
    "close_dir",
    "make_private_dir",
    "staging_dir",
    "step_dir",
    "memory_steps",
    "inventory",
    "held_files",
    "remove_step",
    "remove_steps_except",
    "clean_stale",
    "free_bytes",
]

log = logging.getLogger("shardckpt")

#: The file naming the root (and user) whose copy the directory holds.
IDENTITY_NAME = "identity.json"
#: Version of the identity file's layout.
IDENTITY_FORMAT = 1
#: An identity file larger than this is not ours (refused unread).
IDENTITY_MAX_BYTES = 64 << 10
#: ``storage_options`` of every ``LocalStorage`` writing under the tier directory: files 0600, directories 0700.
PRIVATE: Dict[str, Any] = {"private": True}

_O_DIR = os.O_RDONLY | getattr(os, "O_DIRECTORY", 0) | getattr(os, "O_NOFOLLOW", 0) | getattr(os, "O_CLOEXEC", 0)
_O_NOFOLLOW = getattr(os, "O_NOFOLLOW", 0)
_O_CLOEXEC = getattr(os, "O_CLOEXEC", 0)
# (directory, reason) already logged by this process: a refusal is said once, not at every save.
_said: Set[Tuple[str, str]] = set()


def _say(level: int, node_dir: str, why: str) -> None:
    if (node_dir, why) not in _said:
        _said.add((node_dir, why))
        log.log(level, "shardckpt: memory tier: %s", why)


# -- identity ---------------------------------------------------------------------


def identity(root_url: str) -> Dict[str, Any]:
    """What ``identity.json`` says for the manager rooted at ``root_url``: ``{"format", "root", "uid"}``.

    Only ``root`` (normalized, :func:`shardckpt._memory.normalize_root`) and
    ``uid`` are compared; ``host`` and ``run`` (the launcher's run id when the
    directory was made) are for people reading it.

    Example:
        >>> identity("s3://b/run/")["root"]
        's3://b/run'
    """
    return {"format": IDENTITY_FORMAT, "root": normalize_root(root_url), "uid": uid()}


def step_extra(step: int, root_url: str, run: Optional[str] = None) -> Dict[str, Any]:
    """The ``extra`` of a memory step's manifest: the step, the tier, the root whose copy it is, the run (``_managed.identity``; None: left out).

    :func:`inventory` ignores a step whose manifest names another root (or,
    given ``foreign``, another run).

    Example:
        >>> step_extra(7, "s3://b/run", "ab12")
        {'step': 7, 'tier': 'memory', 'root': 's3://b/run', 'run': 'ab12'}
    """
    out: Dict[str, Any] = {"step": int(step), "tier": "memory", "root": normalize_root(root_url)}
    if run is not None:
        out["run"] = run
    return out


def _read_identity(dfd: int) -> Optional[Dict[str, Any]]:
    """The identity file of the directory open at ``dfd``; None when there is none; raises OSError/ValueError when it is not one."""
    try:
        fd = os.open(IDENTITY_NAME, os.O_RDONLY | _O_NOFOLLOW | _O_CLOEXEC | getattr(os, "O_NONBLOCK", 0), dir_fd=dfd)
    except FileNotFoundError:
        return None
    try:
        st = os.fstat(fd)
        if not stat.S_ISREG(st.st_mode) or st.st_size > IDENTITY_MAX_BYTES:
            raise ValueError(f"{IDENTITY_NAME} is not a small regular file")
        with os.fdopen(os.dup(fd), "rb") as f:
            got = json.loads(f.read(IDENTITY_MAX_BYTES + 1))
    finally:
        os.close(fd)
    if not isinstance(got, dict):
        raise ValueError(f"{IDENTITY_NAME} is not a JSON object")
    return got


def _write_identity(dfd: int, ident: Dict[str, Any]) -> None:
    """Create the identity file unless one exists (ranks of a node race here: the first one's stays)."""
    body = dict(ident, host=socket.gethostname(), run=os.environ.get("TORCHELASTIC_RUN_ID") or os.environ.get("SLURM_JOB_ID"))
    tmp = f".{IDENTITY_NAME}.{uuid.uuid4().hex[:12]}.tmp"
    fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_EXCL | _O_NOFOLLOW | _O_CLOEXEC, 0o600, dir_fd=dfd)
    try:
        with os.fdopen(os.dup(fd), "wb") as f:
            f.write(json.dumps(body, sort_keys=True).encode())
            f.flush()
        try:
            os.link(tmp, IDENTITY_NAME, src_dir_fd=dfd, dst_dir_fd=dfd, follow_symlinks=False)  # fails if it exists: never replaced
        except FileExistsError:
            pass
    finally:
        os.close(fd)
        os.unlink(tmp, dir_fd=dfd)


def _same_identity(got: Dict[str, Any], want: Dict[str, Any]) -> bool:
    return got.get("root") == want["root"] and got.get("uid") == want["uid"]


# -- the directory ----------------------------------------------------------------


def _unsafe_ancestor(path: str) -> Optional[str]:
    """Why a directory below ``path`` (a real path) could be swapped by another user; None when it cannot.

    Every directory from ``/`` to ``path`` must belong to this user or root
    and be writable by nobody else, unless sticky (``/tmp``, ``/dev/shm``:
    others cannot rename what is ours there).
    """
    me = uid()
    p = path
    while True:
        st = os.stat(p)
        if st.st_uid not in (0, me):
            return f"{p} belongs to uid {st.st_uid}, not to this user (uid {me}) or root"
        if st.st_mode & 0o022 and not st.st_mode & stat.S_ISVTX:
            return f"{p} is writable by other users (mode {stat.S_IMODE(st.st_mode):04o}) and not sticky"
        head = os.path.dirname(p)
        if head == p:
            return None
        p = head


def _make_parents(parent: str) -> None:
    """Create the missing directories up to ``parent``, each 0700 (never a more open parent of ours)."""
    missing = []
    p = parent
    while not os.path.lexists(p):
        missing.append(p)
        head = os.path.dirname(p)
        if head == p:
            break
        p = head
    for d in reversed(missing):
        try:
            os.mkdir(d, 0o700)
        except FileExistsError:
            pass


def _open_private(node_dir: str, *, create: bool) -> int:
    """A descriptor of ``node_dir`` after checking it is private; raises _Refused (why) or FileNotFoundError."""
    path = os.path.abspath(node_dir)
    parent, name = os.path.split(path)
    if not name:
        raise _Refused(f"{node_dir!r} is not a directory name")
    if create:
        _make_parents(parent)
    real_parent = os.path.realpath(parent)
    why = _unsafe_ancestor(real_parent)
    if why is not None:
        raise _Refused(f"{node_dir} is not safe: {why}; pass MemoryTier(dir=...) in a directory only you (or root) can write")
    pfd = os.open(real_parent, _O_DIR)
    try:
        if create:
            try:
                os.mkdir(name, 0o700, dir_fd=pfd)
            except FileExistsError:
                pass
        try:
            fd = os.open(name, _O_DIR, dir_fd=pfd)
        except OSError as e:
            if e.errno in (errno.ELOOP, errno.ENOTDIR):
                what = "a symlink" if os.path.islink(path) else "not a directory"
                raise _Refused(f"{node_dir} is {what}; the memory tier never follows a link there (remove it or pass another MemoryTier(dir=))") from None
            raise
    finally:
        os.close(pfd)
    try:
        st = os.fstat(fd)
        if st.st_uid != uid():
            raise _Refused(
                f"{node_dir} belongs to uid {st.st_uid}, not to this user (uid {uid()}): another user could choose what "
                "this job restores; remove it or pass another MemoryTier(dir=)"
            )
        mode = stat.S_IMODE(st.st_mode)
        if mode & 0o022:
            raise _Refused(
                f"{node_dir} is writable by other users (mode {mode:04o}): they could plant what this job restores; "
                f"chmod 700 it, or remove it"
            )
        if mode & 0o077:
            os.fchmod(fd, 0o700)  # ours and only readable by others: closed, so nobody else reads the weights
        return fd
    except BaseException:
        os.close(fd)
        raise


class _Refused(Exception):
    """A directory the tier must not use (the message says why and what to do)."""


def _dir(node_dir: str, root_url: str, *, create: bool) -> Optional[str]:
    want = identity(root_url)
    try:
        dfd = _open_private(node_dir, create=create)
    except FileNotFoundError:
        return f"{node_dir} does not exist"
    except _Refused as e:
        _say(logging.ERROR, node_dir, f"refusing {e}")
        return str(e)
    except OSError as e:
        why = f"cannot {'create or ' if create else ''}open {node_dir}: {e}"
        _say(logging.WARNING, node_dir, why)
        return why
    try:
        try:
            got = _read_identity(dfd)
            if got is None and create:
                stray = sorted(n for n in os.listdir(dfd) if parse_step_dir(n) is not None)
                if stray:
                    why = (
                        f"{node_dir} holds {stray[0]} but no {IDENTITY_NAME}: not known to be the copy of {want['root']}; "
                        "ignored and left alone (remove it, or pass another MemoryTier(dir=))"
                    )
                    _say(logging.WARNING, node_dir, why)
                    return why
                _write_identity(dfd, want)
                got = _read_identity(dfd)
        except (OSError, ValueError) as e:
            why = f"{node_dir}/{IDENTITY_NAME} is unreadable ({e}); the directory is left alone"
            _say(logging.WARNING, node_dir, why)
            return why
        if got is None:
            return f"{node_dir} has no {IDENTITY_NAME}"
        if not _same_identity(got, want):
            why = (
                f"{node_dir} holds the memory copy of root {got.get('root')!r} (uid {got.get('uid')}), not of this "
                f"manager's root {want['root']!r}; that copy is ignored and left alone (pass another MemoryTier(dir=) "
                "or use the default directory, which is derived from the root)"
            )
            _say(logging.WARNING, node_dir, why)
            return why
        return None
    finally:
        os.close(dfd)


def open_dir(node_dir: str, root_url: str) -> Optional[str]:
    """Make ``node_dir`` the memory tier directory of ``root_url``: create, check, claim. None: usable; else why not.

    Creates the directory (and every missing parent) 0700; refuses (logged
    once at ERROR, the reason returned) a symlink, a directory of another
    user, one group- or world-writable, or one under a directory another
    user may write; then claims it for the root (``identity.json``, 0600,
    never replaced) or, when it holds another root's copy or steps of no
    known root, leaves it alone (logged once at WARNING). The caller turns
    the tier off on a reason (storage only). Pair of :func:`close_dir`.

    Example:
        >>> import tempfile, os
        >>> d = os.path.join(tempfile.mkdtemp(), "tier")
        >>> open_dir(d, "s3://b/run") is None, oct(os.stat(d).st_mode & 0o777)
        (True, '0o700')
        >>> "holds the memory copy of root 's3://b/run'" in open_dir(d, "s3://b/other")
        True
    """
    return _dir(node_dir, root_url, create=True)


def check_dir(node_dir: str, root_url: str) -> Optional[str]:
    """:func:`open_dir`'s checks without creating or claiming anything (restore, clean-up). None: the directory is ``root_url``'s."""
    return _dir(node_dir, root_url, create=False)


def make_private_dir(path: str) -> str:
    """Create ``path`` 0700 (or accept it if it is a real directory of this user); refuse a link (OSError). Returns ``path``.

    For directories inside the tier directory (a restore's staging): the
    tier directory is checked by :func:`open_dir`, this checks the last step.
    """
    try:
        os.mkdir(path, 0o700)
    except FileExistsError:
        pass
    st = os.lstat(path)
    if not stat.S_ISDIR(st.st_mode) or st.st_uid != uid():
        raise OSError(errno.EEXIST, f"{path} exists and is not a directory of this user (a link or a planted entry); not used")
    return path


def staging_dir(node_dir: str, root_url: str, rank: int) -> str:
    """A new private directory for one restore's staging: ``<node_dir>/.restore-r<rank>-<pid>``, else one in the temp dir.

    Never fails: a rank whose node has no directory yet (a replacement node)
    gets it made (:func:`open_dir`); where the tier directory is refused or
    the name is taken by a link, a fresh ``tempfile.mkdtemp`` (0700) serves
    (hard links to this node's files then become copies). The caller removes
    it. Every rank of a restore must take part in its exchanges, so no rank
    may give up here.
    """
    stage = os.path.join(node_dir, staging_dir_name(rank, os.getpid()))
    if open_dir(node_dir, root_url) is None:
        try:
            dfd = os.open(node_dir, _O_DIR)
            try:
                _remove_at(dfd, os.path.basename(stage))  # this pid's leftover: never followed
            finally:
                os.close(dfd)
        except FileNotFoundError:
            pass
        except OSError as e:
            log.debug("shardckpt: memory tier: cannot clear %s: %s", stage, e)
        try:
            return make_private_dir(stage)
        except OSError as e:
            log.warning("shardckpt: memory tier: cannot stage a restore in %s (%s); staging in the temporary directory", stage, e)
    return tempfile.mkdtemp(prefix="shardckpt-restore-")


def close_dir(node_dir: str, *, root: str) -> List[str]:
    """Remove this root's memory copy from ``node_dir`` (its steps, identity, dead staging); the directory if then empty.

    Nothing happens in a directory that is not ``root``'s (:func:`check_dir`):
    another root's copy is never removed. Other entries (a live rank's
    files) stay, and so does the directory holding them. Returns what was
    removed. Pair of :func:`open_dir`.
    """
    if check_dir(node_dir, root) is not None:
        return []
    removed = clean_stale(node_dir, root=root)
    for step, _ in memory_steps(node_dir):
        if remove_step(node_dir, step):
            removed.append(step_dir(node_dir, step))
    try:
        dfd = os.open(node_dir, _O_DIR)
    except OSError:
        return removed
    try:
        left = [n for n in os.listdir(dfd) if n != IDENTITY_NAME]
        if not left:
            try:
                os.unlink(IDENTITY_NAME, dir_fd=dfd)
            except FileNotFoundError:
                pass
    finally:
        os.close(dfd)
    if not left:
        try:
            os.rmdir(node_dir)  # fails (kept) if a node-mate wrote something meanwhile
            removed.append(node_dir)
        except OSError:
            pass
    return removed


# -- steps ------------------------------------------------------------------------


def step_dir(node_dir: str, step: int) -> str:
    """``<node_dir>/step-<8 digits>`` (the manager's step naming, inside the memory directory)."""
    return os.path.join(node_dir, step_name(step))


def memory_steps(node_dir: str) -> List[Tuple[int, str]]:
    """``[(step, path)]`` of the ``step-*`` entries under ``node_dir``, oldest first (committed or not; links too: see :func:`inventory`)."""
    try:
        names = os.listdir(node_dir)
    except OSError:
        return []
    out = []
    for n in names:
        step = parse_step_dir(n)
        if step is not None:
            out.append((step, os.path.join(node_dir, n)))
    return sorted(out)


def _real_dir(path: str) -> bool:
    try:
        st = os.lstat(path)
    except OSError:
        return False
    return stat.S_ISDIR(st.st_mode) and st.st_uid == uid()


def inventory(node_dir: str, *, root: str, foreign: Optional[Callable[[Dict[str, Any]], Optional[str]]] = None) -> Inventory:
    """What this node holds of ``root``'s copy: ``step -> (save id, {file: size} of the step, files present here at that size)``.

    Empty unless ``node_dir`` is ``root``'s (:func:`check_dir`; another
    root's copy is ignored, logged). Only real directories count (a
    ``step-*`` link is never read), and only steps whose manifest reads,
    passes its own checksum and names ``root`` in its ``extra`` (a step of
    another root is ignored, logged). ``foreign``: why a step's ``extra`` is
    not this run's (``_managed.identity.foreign``), None when it is: such a
    step is ignored too (logged once, naming its root and run; never
    removed here). File contents are not read here: a restore verifies each
    file it uses.
    """
    out: Inventory = {}
    if check_dir(node_dir, root) is not None:
        return out
    want = normalize_root(root)
    for step, d in memory_steps(node_dir):
        if not _real_dir(d):
            _say(logging.WARNING, node_dir, f"{d} is not a directory of this user (a link?); never read as a step, removed at the next save")
            continue
        try:
            m = open_manifest(Storage(d), chunks=False)
            msize = os.path.getsize(os.path.join(d, MANIFEST_NAME))
        except Exception as e:  # damage or a save in flight: not a usable copy of this step
            log.debug("shardckpt: memory tier: %s is not usable: %s: %s", d, type(e).__name__, e)
            continue
        extra = m.extra if isinstance(m.extra, dict) else {}
        if extra.get("step") != step:
            continue
        if extra.get("root") != want:
            _say(logging.WARNING, node_dir, f"{d} is the memory copy of root {extra.get('root')!r}, not of {want!r}: ignored")
            continue
        why = None if foreign is None else foreign(extra)
        if why is not None:
            _say(logging.WARNING, node_dir, f"{d} (step {step}) is not a memory step of this run: {why}; not restored, left in place")
            continue
        need, held = held_files(d, m, msize)
        out[step] = (m.save_id, need, held)
    return out


def held_files(step_path: str, manifest: Any, manifest_size: int) -> Tuple[Dict[str, int], Set[str]]:
    """``({file: size} the step needs, the files present in ``step_path`` at that size)``: one node's holdings of a step.

    The sizes are the manifest's (``manifest_size``: the manifest file's
    own); contents are not read (a restore verifies each file it uses). A
    reference (``@<dir>/<path>``, incremental) is never held here: its file
    lies in another step's directory.
    """
    need = {rel: f.size for rel, f in manifest.files.items()}
    need[MANIFEST_NAME] = manifest_size
    held: Set[str] = set()
    for rel, size in need.items():
        try:
            if os.path.getsize(os.path.join(step_path, rel)) == size:
                held.add(rel)
        except OSError:
            pass
    return need, held


def _remove_at(dfd: int, name: str) -> None:
    """Remove entry ``name`` of the directory open at ``dfd``: a link or file is unlinked, a directory emptied first; nothing followed."""
    st = os.stat(name, dir_fd=dfd, follow_symlinks=False)
    if not stat.S_ISDIR(st.st_mode):
        os.unlink(name, dir_fd=dfd)
        return
    sub = os.open(name, _O_DIR, dir_fd=dfd)
    try:
        for n in os.listdir(sub):
            try:
                _remove_at(sub, n)
            except FileNotFoundError:
                pass  # a node-mate removed it first: same end state
    finally:
        os.close(sub)
    os.rmdir(name, dir_fd=dfd)


def remove_step(node_dir: str, step: int) -> bool:
    """Remove ``step-<step>`` from ``node_dir`` without following links (a planted link is unlinked, its target untouched).

    Ranks of one node may race here (same end state). Returns whether
    something was there. Call it only in a directory :func:`open_dir` accepted.
    """
    try:
        dfd = os.open(node_dir, _O_DIR)
    except OSError:
        return False
    try:
        _remove_at(dfd, os.path.basename(step_dir(node_dir, step)))
        return True
    except FileNotFoundError:
        return False
    except OSError as e:
        if e.errno != errno.ENOTEMPTY:  # ENOTEMPTY: a node-mate is writing it again
            log.debug("shardckpt: memory tier: cannot remove step %d from %s: %s", step, node_dir, e)
        return False
    finally:
        os.close(dfd)


def remove_steps_except(node_dir: str, keep: int, *, root: str) -> List[int]:
    """Remove every step of ``root``'s copy but ``keep``'s (older ones, and newer leftovers of an abandoned run).

    Nothing is removed in a directory that is not ``root``'s (:func:`check_dir`).
    """
    if check_dir(node_dir, root) is not None:
        return []
    return [step for step, _ in memory_steps(node_dir) if step != keep and remove_step(node_dir, step)]


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except OSError:
        return True  # exists, another user's
    return True


def _stale_files(dfd: int, where: str, out: List[str]) -> None:
    """Remove ``.*.tmp``/``.*.part`` files below the directory open at ``dfd``, descending only into real directories."""
    for n in os.listdir(dfd):
        try:
            st = os.stat(n, dir_fd=dfd, follow_symlinks=False)
            if stat.S_ISDIR(st.st_mode):
                sub = os.open(n, _O_DIR, dir_fd=dfd)
                try:
                    _stale_files(sub, f"{where}/{n}", out)
                finally:
                    os.close(sub)
            elif n.startswith(".") and n.endswith((".tmp", ".part")):
                os.unlink(n, dir_fd=dfd)  # a link is unlinked, never followed
                out.append(f"{where}/{n}")
        except OSError:
            pass  # vanished meanwhile, or not ours to open


def clean_stale(node_dir: str, *, root: str) -> List[str]:
    """Remove what a dead process left in ``root``'s directory: staging directories and half-written temporary files.

    Nothing happens in a directory that is not ``root``'s; ``step-*`` links
    are not entered (never followed); ``.slot-*`` files are the save's
    (``snapshot``) to judge.
    """
    removed: List[str] = []
    if check_dir(node_dir, root) is not None:
        return removed
    try:
        dfd = os.open(node_dir, _O_DIR)
    except OSError:
        return removed
    try:
        for n in os.listdir(dfd):
            pid = parse_staging_dir(n)
            if pid is not None and not _alive(pid):
                try:
                    _remove_at(dfd, n)
                    removed.append(os.path.join(node_dir, n))
                except OSError:
                    pass
            elif parse_step_dir(n) is not None:
                try:
                    if not stat.S_ISDIR(os.stat(n, dir_fd=dfd, follow_symlinks=False).st_mode):
                        continue
                    sub = os.open(n, _O_DIR, dir_fd=dfd)
                except OSError:
                    continue
                try:
                    _stale_files(sub, os.path.join(node_dir, n), removed)
                finally:
                    os.close(sub)
    finally:
        os.close(dfd)
    return removed


def free_bytes(path: str) -> Optional[int]:
    """Free bytes of the filesystem under ``path`` (None when it cannot be told)."""
    try:
        return shutil.disk_usage(path).free
    except OSError:
        return None
