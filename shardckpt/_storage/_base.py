"""The storage interface: shared logic in :class:`Storage`, a small core per backend.

A checkpoint lives under a root URL; every other path is a relative POSIX path
below it (``data/x.safetensors``). :class:`Storage` holds what every backend
shares (path checks, URL joining, retries, bounded reads, range planning for
``read_into``, staged files) and calls a few ``_``-prefixed methods that each
backend implements (the template style of fsspec's ``AbstractFileSystem``).
Callers never branch on the backend: they ask its :class:`Capabilities`.

``Storage(url, storage_options=...)`` is also the factory: it returns the
backend that serves ``url`` (``_factory.backend_for``: :class:`LocalStorage`
for plain paths and ``file://``, :class:`S3Storage` for ``s3://``,
:class:`FsspecStorage` for everything else).
"""

from __future__ import annotations

import abc
import contextlib
import errno
import os
import random
import tempfile
import threading
import time
from dataclasses import dataclass
from typing import Any, Callable, ClassVar, Dict, Iterable, List, Optional, Sequence, Tuple, Type, TypeVar

from .. import _knobs
from ..errors import CheckpointError, StorageError, UnreadableFileError, UnsafeMetadataError

__all__ = [
    "Capabilities",
    "Lane",
    "copy_bytes",
    "RANGE_MERGE_GAP_BYTES",
    "STAT_THREADS",
    "Storage",
    "backoff_delay",
    "StagedFile",
    "Writer",
    "join_url",
    "plan_range_fetches",
    "set_backend_lookup",
]

# The retry policy's tunables live in shardckpt/_knobs.py (STORAGE_RETRIES: the
# ``retries=`` default, read when a Storage is made; RETRY_BASE_DELAY_S,
# RETRY_MAX_DELAY_S, read at each back-off).
#: Threads that stat objects concurrently in ``stat_sizes`` (high-latency backends).
STAT_THREADS = 16
#: ``read_into`` on a remote backend fetches two ranges as one request when at
#: most this many bytes lie between them (one round trip costs more than
#: reading a few hundred KiB more).
RANGE_MERGE_GAP_BYTES = 256 << 10
#: Block size when a staged file is uploaded to a backend without local paths.
UPLOAD_BLOCK_BYTES = 8 << 20

_T = TypeVar("_T")

#: The core each backend implements (the ``_``-prefixed template methods and
#: ``path``); everything else in :class:`Storage` is built on these.
CORE = (
    "path",
    "_exists",
    "_is_file",
    "_size",
    "_listdir",
    "_walk",
    "_read",
    "_read_ranges",
    "_open_writer",
    "_put",
    "_remove",
    "_remove_tree",
    "_makedirs",
)


@dataclass(frozen=True)
class Capabilities:
    """What a backend can do; callers ask these instead of checking the backend's type.

    Attributes:
        atomic_rename: ``rename``/``replace_with`` move a file or directory
            into place atomically (readers see the old or the new, never a
            mix). Without it, a commit relies on single-object PUTs being
            atomic, and ``rename``/``replace_with`` raise ``StorageError``.
        has_dirs: directories are real entries that must exist before files
            are created in them (the backend creates them itself). Object
            stores, whose "directories" are key prefixes, have none.
        positional_write: writers accept ``write_at(data, offset)`` from
            several threads (a file is filled in parallel, out of order).
        high_latency: every call is a network round trip; callers issue
            independent metadata calls (stat, exists) from a thread pool.
        batched_reads: one ``read_into`` call with many ranges runs them
            concurrently; callers hand it all of a file's ranges at once
            instead of one call per block from their own threads.
        consistent_listing: :meth:`Storage.list_sizes` answers from one
            listing (a few pages) asked of the storage itself, and that
            listing shows every completed write and delete at once (strong
            list-after-write/delete consistency: local disk, S3, GCS, Azure,
            ``memory://``). Callers confirm many files' sizes with it instead
            of one stat (HEAD) each; without it they stat each file.
    """

    atomic_rename: bool
    has_dirs: bool
    positional_write: bool
    high_latency: bool
    batched_reads: bool
    consistent_listing: bool = False


def backoff_delay(attempt: int, *, rng: Optional[random.Random] = None) -> float:
    """Seconds to wait before retry ``attempt + 1``: "full jitter" exponential back-off.

    Uniform in ``[0, min(RETRY_MAX_DELAY_S, RETRY_BASE_DELAY_S * 2**attempt)]``
    (``shardckpt._knobs``, read at call time): random, so that ranks throttled
    together (503 SlowDown) do not retry in lock step.

    Example: ``0 <= backoff_delay(0) <= _knobs.RETRY_BASE_DELAY_S``.
    """
    cap = min(_knobs.RETRY_MAX_DELAY_S, _knobs.RETRY_BASE_DELAY_S * (2 ** min(attempt, 30)))
    return (rng or random).uniform(0.0, cap)


def join_url(root: str, rel: str) -> str:
    """Join a root URL and a relative path with ``/`` (never ``os.path`` on URLs).

    Example: ``join_url("s3://b/run/", "data/x")`` is ``"s3://b/run/data/x"``.
    """
    if not rel:
        return root
    return root.rstrip("/") + "/" + rel.lstrip("/")


def check_rel(rel: str, *, where: str) -> str:
    """``rel`` if it is a relative path that stays below the root; raises otherwise.

    Raises:
        UnsafeMetadataError: ``..`` or NUL in the path, or not a str.
    """
    if not isinstance(rel, str):
        raise UnsafeMetadataError(f"{where}: path must be a str, got {type(rel).__name__}")
    if "\x00" in rel or any(part == ".." for part in rel.replace("\\", "/").split("/")):
        raise UnsafeMetadataError(
            f"{where}: path {rel[:200]!r} escapes the checkpoint root; paths must be relative and contain no '..'"
        )
    if not rel.isascii():
        try:
            rel.encode("utf-8")
        except UnicodeEncodeError:  # a lone surrogate (JSON "\ud800"): no file can have this name
            raise UnsafeMetadataError(f"{where}: path {rel[:200]!r} is not valid Unicode (a lone surrogate)") from None
    return rel


def plan_range_fetches(ranges: Sequence[Tuple[int, int]], *, max_gap: int = RANGE_MERGE_GAP_BYTES) -> List[Tuple[int, int, List[int]]]:
    """Merge byte ranges that overlap or lie within ``max_gap`` of each other into fetches.

    Pure planning for ``read_into``: ``ranges`` are ``(offset, length)``;
    returns ``(start, end, [indices of the ranges it serves])`` sorted by
    start. Empty ranges are served by no fetch.

    Example: ``plan_range_fetches([(0, 4), (6, 2), (100, 1)], max_gap=2)``
    is ``[(0, 8, [0, 1]), (100, 101, [2])]``.
    """
    order = sorted((off, off + n, i) for i, (off, n) in enumerate(ranges) if n > 0)
    out: List[Tuple[int, int, List[int]]] = []
    for lo, hi, i in order:
        if out and lo - out[-1][1] <= max_gap:
            start, end, idx = out[-1]
            idx.append(i)
            out[-1] = (start, max(end, hi), idx)
        else:
            out.append((lo, hi, [i]))
    return out


class Writer(abc.ABC):
    """A file being written: ``close()`` makes it durable, ``abort()`` removes it.

    ``write`` appends; ``write_at`` (backends with ``positional_write``)
    writes at an offset and may be called from several threads. Use one or
    the other on a writer, not both. The calls, in order:

    1. ``Storage.open_write(rel)`` returns it (parents created as needed).
    2. ``write(data)`` any number of times, in file order (or ``write_at``).
       ``data`` is any buffer (bytes, memoryview); the caller may reuse it
       once the call returns.
    3. Exactly one of ``close()`` (the whole file is durable at ``rel``
       when it returns; raise if it is not) or ``abort()`` (nothing is left
       at ``rel``; never raises for a file that is already gone).
    """

    url: str

    @abc.abstractmethod
    def write(self, data) -> None: ...

    def write_at(self, data, offset: int) -> int:
        """Write all of ``data`` at ``offset``; returns the bytes written."""
        raise StorageError(f"{self.url}: this storage cannot write at offsets (positional_write is False); use write()")

    @abc.abstractmethod
    def close(self) -> None: ...

    @abc.abstractmethod
    def abort(self) -> None: ...


class StagedFile:
    """A file built at a local path (for tools that need one), published at ``rel`` by ``commit()``.

    ``path`` is an OS path: write it with any tool (``torch.save``), patch it
    with ``write_at``, then ``commit()`` makes it appear at ``rel`` whole, or
    ``abort()`` (also on leaving a ``with`` block by an exception) removes it.
    This base version stages in the system temp directory and uploads on
    commit; local disk stages next to the target and renames.
    """

    def __init__(self, storage: "Storage", rel: str, path: str):
        self.storage, self.rel, self.path = storage, rel, path
        self._fd = -1
        self._done = False
        self._lock = threading.Lock()

    def write_at(self, data, offset: int) -> int:
        """Write all of ``data`` at ``offset`` of the staged file (thread-safe); returns the bytes written."""
        if self._fd < 0:
            # Opened on first use: the caller may create the file with another tool first.
            with self._lock:
                if self._fd < 0:
                    self._fd = os.open(self.path, os.O_RDWR | os.O_CREAT, 0o644)
        return pwrite_all(self._fd, data, offset)

    def _close_fd(self, sync: bool) -> None:
        if self._fd >= 0:
            try:
                if sync:
                    os.fsync(self._fd)
            finally:
                os.close(self._fd)
                self._fd = -1

    def commit(self) -> None:
        """Publish the staged file at ``rel`` (durably) and forget the staging copy."""
        self._close_fd(sync=False)
        w = self.storage.open_write(self.rel)
        try:
            with open(self.path, "rb") as f:
                while True:
                    block = f.read(UPLOAD_BLOCK_BYTES)
                    if not block:
                        break
                    w.write(block)
            w.close()
        except BaseException:
            w.abort()
            raise
        finally:
            self._unlink()
        self._done = True

    def abort(self) -> None:
        """Remove the staged file; ``rel`` is left as it was. A no-op after ``commit()``."""
        if self._done:
            return
        self._close_fd(sync=False)
        self._unlink()
        self._done = True

    def _unlink(self) -> None:
        try:
            os.unlink(self.path)
        except OSError:
            pass

    def __enter__(self) -> "StagedFile":
        return self

    def __exit__(self, exc_type, exc, tb) -> None:
        if exc_type is not None or not self._done:
            # Leaving without commit() publishes nothing.
            self.abort()


def set_backend_lookup(lookup: Callable[[str, Optional[Dict[str, Any]]], Type["Storage"]]) -> None:
    """Make ``Storage(url)`` build ``lookup(url, storage_options)`` (``_factory`` installs its ``backend_for``)."""
    Storage._backend_for = staticmethod(lookup)


def copy_bytes(dst: memoryview, src: memoryview) -> None:
    """``dst[:] = src``, out of the GIL where NumPy is there (reader threads copy in parallel).

    The one byte copy of the readers (an ``O_DIRECT`` bounce buffer, a block
    kept aside before it is read into a live tensor).

    Example:
        >>> b = bytearray(3); copy_bytes(memoryview(b), memoryview(b"abc")); bytes(b)
        b'abc'
    """
    try:
        import numpy as np
    except ImportError:
        dst[:] = src
        return
    np.frombuffer(dst, dtype=np.uint8)[:] = np.frombuffer(src, dtype=np.uint8)


def pwrite_all(fd: int, data, pos: int) -> int:
    """Write all of ``data`` at ``pos`` (``os.pwrite`` may write less than asked); returns the bytes written."""
    mv = memoryview(data).cast("B")
    n = 0
    while n < len(mv):
        n += os.pwrite(fd, mv[n:], pos + n)
    return n


#: OS errors a read meets when the checkpoint itself is damaged (the thing at
#: a path is not a readable file), as opposed to storage trouble (EIO, EACCES).
_DAMAGE_ERRNOS = {
    errno.EISDIR: "is a directory, not a file",
    errno.ELOOP: "is a symlink loop (or too many levels of symlinks)",
    errno.ENAMETOOLONG: "has a name too long for the filesystem",
    errno.ENXIO: "is a device or socket, not a file",
    errno.ENODEV: "is a device, not a file",
}


@contextlib.contextmanager
def reading(url: str):
    """Turn the OS errors of a read that mean "this path is not a readable file" into ``UnreadableFileError``.

    The one place where read-side ``OSError``s of every backend become
    shardckpt's types: a missing file stays ``FileNotFoundError`` (an answer
    callers branch on, as is ``NotADirectoryError``: a path through a file
    names nothing), damage becomes :class:`UnreadableFileError`, and the
    rest (I/O errors, permissions) becomes ``StorageError``; all three are
    ``OSError``s.
    """
    try:
        yield
    except (FileNotFoundError, NotADirectoryError, StorageError, UnreadableFileError, UnsafeMetadataError, EOFError):
        raise
    except OSError as e:
        why = _DAMAGE_ERRNOS.get(e.errno) if e.errno is not None else None
        if why is not None:
            err: OSError = UnreadableFileError(f"{url} {why}; the checkpoint is damaged ({e.strerror})")
        else:
            err = StorageError(f"cannot read {url}: {type(e).__name__}: {e}")
        err.errno = e.errno  # callers that branch on errno still can
        raise err from e
    except (CheckpointError, ValueError, MemoryError):
        raise
    except Exception as e:  # a backend's own types (botocore, aiohttp...): storage trouble
        raise StorageError(f"cannot read {url}: {type(e).__name__}: {e}{_credentials_hint(e)}") from e


def _credentials_hint(e: BaseException) -> str:
    if "credential" not in f"{type(e).__name__} {e}".lower():
        return ""
    return (
        "; no credentials were found for this storage: pass them in storage_options "
        "(e.g. {'key': ..., 'secret': ...}, or {'anon': True} for a public bucket; the CLI takes "
        "--storage-option key=value) or set the provider's environment variables (AWS_ACCESS_KEY_ID...)"
    )


class Storage:
    """Files under one root URL.

    ``Storage(url, ...)`` returns the backend serving ``url``; every backend
    has the methods below, with the same errors: a missing file raises
    ``FileNotFoundError`` from ``size``/``read_*`` (``exists`` is False,
    ``listdir``/``walk_files`` return ``[]``, ``remove*`` do nothing); a path
    with ``..`` raises ``UnsafeMetadataError``; other failures raise
    ``StorageError`` (after retries on remote backends).

    Args:
        url: a local path, ``file://`` URL or any fsspec URL.
        storage_options: passed to the fsspec filesystem (credentials, endpoint...).
        retries: attempts for each remote operation before giving up
            (default: ``SHARDCKPT_STORAGE_RETRIES``, read now).

    Raises:
        StorageError: empty URL, unknown protocol, or its fsspec backend is
            not installed (the message names the package to install).

    Example::

        st = Storage("s3://bucket/run/step-10", storage_options={"anon": False})
        if st.caps.high_latency: ...
        st.write_atomic("manifest.json", body)

    Limits: URLs are strings; directories are only created, never required,
    by callers (backends with ``has_dirs`` create parents themselves).

    Writing a backend (docs/extending.md has a whole one): subclass this,
    implement the core (``path`` and the ``_``-prefixed methods that
    ``CORE`` lists; a class missing one fails where it is defined), set
    ``caps``, and register it for a URL scheme with
    ``shardckpt.register_backend``; or pass an instance where a URL goes
    (``shardckpt.save(state, storage)``). shardckpt calls a storage in this
    order (``rel`` is always a relative path below the root):

    1. Construction, on every rank: ``cls(url, storage_options=...,
       retries=...)``; :meth:`child` and :meth:`sibling` build more of the
       same class for related roots. It must not need the network.
    2. Save, rank 0, before any rank writes: the target is checked
       (``exists("manifest.json")``; ``read_bytes`` of a manifest found).
    3. Save, every rank at once (ranks are processes, maybe on other
       hosts; each rank uses its object from several threads, so every
       method is thread-safe): :meth:`makedirs`, then per data file the rank
       owns :meth:`open_write`, ``Writer.write`` (or ``write_at`` from
       several threads where ``caps.positional_write``) and
       ``Writer.close``, which makes the whole file durable under its name
       (``abort`` instead on failure); then :meth:`fsync_dirs`. Each file is
       written by one rank under a name no earlier save used, and is not
       read before step 5 names it.
    4. Save, rank 0, once every rank finished step 3: the files are
       confirmed whole by :meth:`stat_sizes` (or :meth:`list_sizes` where
       ``caps.consistent_listing``).
    5. Save, rank 0, the commit: ``write_atomic("manifest.json", body,
       create_dirs=False)``, which must be atomic (a reader sees no manifest
       or all of it, never part). The checkpoint exists once it returns;
       nothing of it is written after.
    6. A failed save, each rank: :meth:`remove` of its own files of this
       save; a committed checkpoint (an earlier one) is never touched.
    7. Load, read, inspect, verify, every rank at once, from several
       threads, only after step 5: ``read_bytes("manifest.json",
       limit=...)``, :meth:`size`, :meth:`read_range`, :meth:`read_into`
       (many ranges per call where ``caps.batched_reads``), :meth:`exists`,
       :meth:`listdir`. Files are never written while they are read.
    8. Retention and cleanup (the manager, ``shardckpt gc``), rank 0:
       :meth:`listdir`, :meth:`walk_files`, :meth:`remove`,
       :meth:`remove_tree`; :meth:`rename` and :meth:`replace_with` only
       where ``caps.atomic_rename``.
    """

    #: What this backend can do (a class attribute, or set in ``__init__``);
    #: callers ask it instead of checking the backend's type.
    caps: Capabilities
    #: URL -> backend class: ``_factory.backend_for``, installed by that module
    #: through :func:`set_backend_lookup` (it imports every backend, so this
    #: module cannot import it).
    _backend_for: ClassVar[Callable[[str, Optional[Dict[str, Any]]], Type["Storage"]]]

    def __init_subclass__(cls, **kwargs: Any) -> None:
        # A plain class rather than an ABC, so that ``Storage(url)`` (the
        # factory) type-checks; this keeps the ABC's guarantee, earlier: a
        # backend that misses part of the core fails where it is defined.
        super().__init_subclass__(**kwargs)
        missing = [name for name in CORE if getattr(cls, name) is getattr(Storage, name)]
        if missing:
            raise TypeError(f"{cls.__name__} must implement the storage core: {', '.join(missing)} (see Storage)")

    def __new__(cls, url: str = "", *args: Any, **kwargs: Any) -> "Storage":
        # ``Storage(url)`` is the factory; a backend class builds itself.
        if cls is Storage:
            cls = Storage._backend_for(url, kwargs.get("storage_options"))
        return super().__new__(cls)

    def __init__(self, url: str, *, storage_options: Optional[Dict[str, Any]] = None, retries: Optional[int] = None):
        if not isinstance(url, str) or not url:
            raise StorageError(f"checkpoint URL must be a non-empty str, got {url!r}")
        self.url = url.rstrip("/") or url
        self.storage_options = dict(storage_options or {})
        self.retries = max(1, int(_knobs.STORAGE_RETRIES if retries is None else retries))

    def __repr__(self) -> str:
        return f"{type(self).__name__}({self.url!r})"

    @property
    def is_local(self) -> bool:
        """Files are plain OS files (informational: branch on ``caps``, not on this)."""
        return False

    # -- the core each backend implements ------------------------------------

    def path(self, rel: str) -> str:
        """The backend's own path of ``rel`` (an OS path, or a bucket/key path)."""
        raise self._unimplemented("path")

    def _exists(self, path: str) -> bool:
        raise self._unimplemented("_exists")

    def _is_file(self, path: str) -> bool:
        raise self._unimplemented("_is_file")

    def _size(self, path: str) -> int:
        raise self._unimplemented("_size")

    def _listdir(self, path: str) -> List[str]:
        """Names directly under ``path``; raises FileNotFoundError when missing."""
        raise self._unimplemented("_listdir")

    def _walk(self, path: str) -> List[str]:
        """Every file below ``path``, relative to the root."""
        raise self._unimplemented("_walk")

    def _read(self, path: str, start: int, end: Optional[int]) -> bytes:
        """Bytes ``[start, end)`` (``end=None``: to the end); short at end of file."""
        raise self._unimplemented("_read")

    def _read_ranges(self, rel: str, ranges: Sequence[Tuple[int, memoryview]]) -> None:
        """Fill each buffer from its offset; raise EOFError via :meth:`_short` if the file is short."""
        raise self._unimplemented("_read_ranges")

    def _open_writer(self, rel: str) -> Writer:
        raise self._unimplemented("_open_writer")

    def _put(self, rel: str, data: bytes) -> None:
        """Publish ``data`` at ``rel`` atomically (see :meth:`write_atomic`)."""
        raise self._unimplemented("_put")

    def _remove(self, path: str) -> None:
        """Delete a file; raises FileNotFoundError when missing."""
        raise self._unimplemented("_remove")

    def _remove_tree(self, path: str) -> None:
        raise self._unimplemented("_remove_tree")

    def _makedirs(self, path: str) -> None:
        raise self._unimplemented("_makedirs")

    def _unimplemented(self, name: str) -> NotImplementedError:
        return NotImplementedError(f"{type(self).__name__}.{name}: part of the storage core every backend implements")

    # -- shared logic -----------------------------------------------------------

    def _retry(self, what: str, fn: Callable[..., _T], *args, **kwargs) -> _T:
        """``fn(*args, **kwargs)`` with retries and jittered back-off on transient errors.

        What is transient is the backend's call (:meth:`_classify`): missing
        files and permission errors are answers, not hiccups, and are raised at
        once. The last transient failure becomes a ``StorageError`` naming ``what``.
        """
        for attempt in range(self.retries):
            try:
                return fn(*args, **kwargs)
            except Exception as e:
                err = self._classify(e, what)
                if err is not None:
                    if err is e:
                        raise
                    raise err from e
                if attempt + 1 == self.retries:
                    raise StorageError(f"{what} failed after {self.retries} attempts: {e}") from e
                time.sleep(backoff_delay(attempt))
        raise AssertionError("unreachable")  # pragma: no cover

    def _classify(self, e: Exception, what: str) -> Optional[Exception]:
        """``None`` if ``e`` is transient (retry it), else the exception to raise for it.

        Base rule: ``OSError`` is transient on remote backends (timeouts,
        5xx, throttling) except missing files and permission errors, which
        are raised as they are; anything else is a bug and is raised as is.
        Backends override this to recognise their client's own exceptions.
        """
        if isinstance(e, (FileNotFoundError, PermissionError, IsADirectoryError, NotADirectoryError, StorageError)):
            return e
        if isinstance(e, OSError):
            return None
        return e

    def _p(self, rel: str) -> str:
        return self.path(check_rel(rel, where=self.url))

    def url_of(self, rel: str) -> str:
        """The URL of ``rel`` (for messages and for other APIs)."""
        return join_url(self.url, check_rel(rel, where=self.url))

    def child(self, rel: str) -> "Storage":
        """Storage rooted at ``rel`` below this root, sharing options."""
        return type(self)(self.url_of(rel), storage_options=self.storage_options, retries=self.retries)

    def sibling(self, name: str) -> "Storage":
        """Storage rooted at ``name`` next to this root (same parent), sharing options.

        Example: ``Storage("/ck/out").sibling(".out.tmp").url == "/ck/.out.tmp"``.
        """
        if not name or "/" in name or name in (".", ".."):
            raise UnsafeMetadataError(f"{self.url}: sibling name must be one path component, got {name!r}")
        head = self._parent_url()
        return type(self)(join_url(head, name), storage_options=self.storage_options, retries=self.retries)

    def _parent_url(self) -> str:
        head, _, base = self.url.rstrip("/").rpartition("/")
        if not base or not head or head.endswith(":/"):
            raise StorageError(f"{self.url!r} has no parent directory")
        return head

    def invalidate_cache(self) -> None:
        """Forget cached listings (some fsspec backends cache them); a no-op elsewhere."""
        return None

    def exists(self, rel: str) -> bool:
        return bool(self._exists(self._p(rel)))

    def is_file(self, rel: str = "") -> bool:
        """True if ``rel`` (the root itself by default) is a file."""
        return bool(self._is_file(self._p(rel)))

    def size(self, rel: str) -> int:
        """Size in bytes; raises ``FileNotFoundError`` when missing."""
        path = self._p(rel)
        with reading(self.url_of(rel)):
            return int(self._size(path))

    def stat_sizes(self, rels: Iterable[str]) -> Dict[str, Optional[int]]:
        """Current size of each file (``None`` if missing), asked of the storage itself, not of a cache.

        High-latency backends stat the files concurrently (``STAT_THREADS``).
        No listing: each file is one stat (HEAD), so the cost does not grow
        with what else lies under the root.

        Raises:
            StorageError: a stat failed for another reason than absence.
        """
        rels = sorted(set(rels))
        for rel in rels:
            check_rel(rel, where=self.url)

        def one(rel: str) -> Tuple[str, Optional[int]]:
            try:
                # The same damage mapping as every read (symlink loops, names
                # too long... become UnreadableFileError): no raw OSError escapes.
                with reading(self.url_of(rel)):
                    return rel, int(self._fresh_size(self.path(rel)))
            except (FileNotFoundError, NotADirectoryError, IsADirectoryError):
                # A directory where a file should be is as good as missing.
                return rel, None

        if len(rels) > 1 and self.caps.high_latency:
            from concurrent.futures import ThreadPoolExecutor

            with ThreadPoolExecutor(max_workers=min(STAT_THREADS, len(rels)), thread_name_prefix="shardckpt-stat") as ex:
                return dict(ex.map(one, rels))
        return dict(one(rel) for rel in rels)

    def list_sizes(self, prefix: str) -> Dict[str, int]:
        """Every regular file named ``prefix*`` in ``prefix``'s directory, with its size, from one listing.

        ``prefix`` is a relative path whose last part is a name prefix:
        ``"data/0123456789ab-"`` lists the files of ``data/`` whose names
        start with ``0123456789ab-`` (not files below them, not directories,
        not symlinks or other special files: a caller that expects a file
        the listing lacks stats it alone). One listing request (paged: on S3
        1,000 keys a page) instead of one stat per file, asked of the storage
        itself, never of a listing cache. Only backends with
        ``caps.consistent_listing``.

        Returns:
            ``{relative path: size}``; ``{}`` when the directory does not exist.

        Raises:
            StorageError: the backend cannot list consistently, or the
                listing failed (refused: e.g. no ``s3:ListBucket`` permission).
            UnreadableFileError: the directory is not one inside the root
                (a symlink out of it).

        Example: ``st.list_sizes("data/0123456789ab-")`` is
        ``{"data/0123456789ab-r00000-00.safetensors": 4096, ...}``.
        """
        if not self.caps.consistent_listing:
            raise StorageError(f"{self.url}: this storage cannot list sizes consistently (consistent_listing is False); stat each file")
        check_rel(prefix, where=self.url)
        head, _, name = prefix.rpartition("/")
        try:
            with reading(self.url_of(head)):
                found = self._list_sizes(self.path(head), name)
        except (FileNotFoundError, NotADirectoryError):
            return {}
        return {(f"{head}/{n}" if head else n): int(size) for n, size in found.items()}

    def _list_sizes(self, path: str, name_prefix: str) -> Dict[str, int]:
        """``{name: size}`` of the regular files directly in ``path`` whose names start with ``name_prefix``."""
        raise StorageError(f"{self.url}: listing sizes is not implemented for {type(self).__name__}")

    def _fresh_size(self, path: str) -> int:
        """``_size`` bypassing any cache the backend keeps (default: ``_size``)."""
        return self._size(path)

    def listdir(self, rel: str = "") -> List[str]:
        """Names (not paths) directly under ``rel``, sorted; ``[]`` if it does not exist."""
        try:
            return sorted(set(self._listdir(self._p(rel))))
        except (FileNotFoundError, NotADirectoryError):
            return []

    def walk_files(self, rel: str = "") -> List[str]:
        """Every file below ``rel``, as sorted paths relative to the root; ``[]`` if missing."""
        try:
            return sorted(self._walk(self._p(rel)))
        except FileNotFoundError:
            return []

    def read_bytes(self, rel: str, *, limit: Optional[int] = None) -> bytes:
        """Whole file, refusing more than ``limit`` bytes (never reading more than ``limit + 1``).

        The size is never trusted on its own (FIFOs and devices report 0):
        at most ``limit + 1`` bytes are read whatever the stat said.

        Raises:
            FileNotFoundError: missing.
            UnsafeMetadataError: the file is larger than ``limit``.
            UnreadableFileError: not a regular file inside the checkpoint
                (directory, FIFO, device, symlink loop or escape...).
        """
        path = self._p(rel)
        with reading(self.url_of(rel)):
            if limit is None:
                return self._read(path, 0, None)
            # Read first (the backend checks the file type), stat only to word a refusal.
            data = self._read(path, 0, limit + 1)
            if len(data) > limit:
                try:
                    n = f"{int(self._size(path))} bytes"
                except Exception:
                    n = f"more than {limit} bytes"
                raise UnsafeMetadataError(f"{self.url_of(rel)}: {n} exceeds the {limit}-byte limit")
        return data

    def read_range(self, rel: str, start: int, length: int) -> bytes:
        """Bytes ``[start, start + length)``; shorter if the file ends first."""
        if start < 0 or length < 0:
            raise ValueError(f"{self.url_of(rel)}: bad range start={start} length={length}")
        path = self._p(rel)
        with reading(self.url_of(rel)):
            if length == 0:
                # Some backends read [0, 0) as "the whole file": ask nothing but its existence.
                self._size(path)
                return b""
            return self._read(path, start, start + length)

    def read_into(self, rel: str, ranges: Sequence[Tuple[int, memoryview]]) -> None:
        """Fill each ``(offset, buffer)`` from the file.

        Raises:
            FileNotFoundError: missing.
            EOFError: the file ends before a buffer is full (names the byte).
        """
        check_rel(rel, where=self.url)
        if ranges:
            with reading(self.url_of(rel)):
                self._read_ranges(rel, ranges)

    @property
    def can_map(self) -> bool:
        """Whether :meth:`map_range` maps files here (local files) rather than returning None."""
        return False

    def open_hot(self, rel: str, start: int, stop: int) -> Optional[Any]:
        """A file to ``readv(offset, views)`` bytes ``[start, stop)`` of ``rel`` from, where they are in memory already; or None.

        Local files of a memory filesystem (tmpfs, ramfs): the reader reads
        each checksum block straight into its destination (one kernel copy).
        None for files on disks (:meth:`map_range` then reads them with its
        cold-read rules, as it always did) and where the backend has no
        such files. The caller ``close()``-s it. One whose ``shareable`` is
        True may serve every piece of the file up to its ``size`` during one
        read, from any thread (it is closed when that read ends).

        Raises:
            FileNotFoundError: missing.
            EOFError: the file ends before ``stop``.
        """
        return None

    def map_range(self, rel: str, start: int, stop: int) -> Optional[Tuple[Any, int]]:
        """A read-only memory mapping holding bytes ``[start, stop)`` of ``rel`` at an offset, or None.

        Returns ``(mapping, offset)``: the bytes are ``memoryview(mapping)[offset
        : offset + stop - start]``; the caller closes the mapping. None where the
        backend has no mappable files (object stores, fsspec): read instead.

        Raises:
            FileNotFoundError: missing.
            EOFError: the file ends before ``stop``.
        """
        return None

    def lane_bytes(self, rel: str) -> int:
        """Bytes of ``rel`` one reader thread should read in order (a *lane*), or 0: no lanes here.

        Where reads go through a kernel readahead (files on a block device),
        a thread that reads a stretch of a file in order keeps its readahead
        sequential, instead of many threads' readaheads running into each
        other's pieces. 0 (default): other backends, memory filesystems.
        """
        return 0

    def open_lane(self, rel: str) -> "Lane":
        """A :class:`Lane`: one thread's in-order reads of ``rel`` (a kept file where the backend has one); ``close()`` it."""
        return Lane(self, rel)

    def _short(self, rel: str, end: int) -> EOFError:
        return EOFError(f"{self.url_of(rel)}: file ends before byte {end}")

    def makedirs(self, rel: str = "") -> None:
        """Create directory ``rel`` and its parents where the backend has directories."""
        self._makedirs(self._p(rel))

    def open_write(self, rel: str) -> Writer:
        """A writer that creates ``rel`` (parents included); ``close()`` makes it durable."""
        self._p(rel)
        return self._open_writer(rel)

    def write_atomic(self, rel: str, data: bytes, *, create_dirs: bool = True) -> None:
        """Publish ``data`` at ``rel`` all at once: readers see the old state or all of it.

        Local disk: temp file, fsync, rename, fsync of the directory. Object
        stores: a single PUT, which is atomic by itself (no rename needed).

        Args:
            create_dirs: create missing parent directories. ``False`` for a
                commit: a directory removed under it (another process's
                ``cleanup()``) must fail the write, not come back holding
                only this file.

        Raises:
            FileNotFoundError: ``create_dirs=False`` and the parent is gone.
        """
        self._p(rel)
        if create_dirs:
            self._put(rel, bytes(data))
        else:
            self._put_existing(rel, bytes(data))

    def _put_existing(self, rel: str, data: bytes) -> None:
        """:meth:`_put` into a parent that must already exist.

        Without directories there is nothing that can vanish. Backends with
        directories but no race-free way to refuse check first (a window
        remains; local disk overrides this without one).
        """
        if self.caps.has_dirs:
            parent = rel.rpartition("/")[0]
            if not self._exists(self.path(parent)):
                raise FileNotFoundError(errno.ENOENT, f"{self.url_of(parent)} vanished before {rel} was written")
        self._put(rel, data)

    def open_staged(self, rel: str) -> StagedFile:
        """A :class:`StagedFile` to build at a local path and publish at ``rel`` on ``commit()``."""
        self._p(rel)
        fd, tmp = tempfile.mkstemp(prefix="shardckpt-", suffix=".staged")
        os.close(fd)
        return StagedFile(self, rel, tmp)

    def fsync_dirs(self, rels: Iterable[str]) -> None:
        """Make directory entries (new files) durable; a no-op where there is nothing to sync."""
        return None

    def remove(self, rel: str) -> None:
        """Delete a file; missing is fine."""
        try:
            self._remove(self._p(rel))
        except FileNotFoundError:
            pass

    def remove_tree(self, rel: str = "") -> None:
        """Delete everything under ``rel``; missing is fine."""
        try:
            self._remove_tree(self._p(rel))
        except FileNotFoundError:
            pass

    def rename(self, src: str, dst: str) -> None:
        """Move file ``src`` to ``dst`` atomically, replacing it (``caps.atomic_rename`` only).

        Raises:
            StorageError: the backend cannot rename atomically.
        """
        self._p(src), self._p(dst)
        raise StorageError(
            f"{self.url}: this storage cannot rename atomically (atomic_rename is False); write the final name directly"
        )

    def replace_with(self, staging: "Storage") -> None:
        """Make the tree at ``staging`` (a :meth:`sibling`) appear at this root in one step.

        Whatever was here is moved aside first and deleted after; an empty
        directory is simply replaced. ``caps.atomic_rename`` only.

        Raises:
            StorageError: the backend cannot rename atomically.
        """
        raise StorageError(
            f"{self.url}: this storage cannot swap directories atomically (atomic_rename is False); write in place"
        )


class Lane:
    """One reader thread's reads of one file, in file order (:meth:`Storage.open_lane`).

    Has the reading methods of a :class:`Storage` (``read_into``,
    ``map_range``, ``open_hot``, ``url_of``), so the reader's jobs take it
    where they take a storage. This base class only forwards to the storage;
    a local file's lane keeps one open descriptor for all its reads (the
    kernel's readahead state lives in it). Opened lazily: a missing file
    raises from the first read, as the storage's own reads do.

    Example:
        >>> lane = st.open_lane("data/0.safetensors")   # doctest: +SKIP
        >>> lane.read_into("data/0.safetensors", [(0, view)]); lane.close()   # doctest: +SKIP
    """

    def __init__(self, storage: "Storage", rel: str):
        self.storage, self.rel = storage, rel

    def url_of(self, rel: str) -> str:
        return self.storage.url_of(rel)

    def read_into(self, rel: str, ranges: Sequence[Tuple[int, memoryview]]) -> None:
        self.storage.read_into(rel, ranges)

    def map_range(self, rel: str, start: int, stop: int) -> Optional[Tuple[Any, int]]:
        return self.storage.map_range(rel, start, stop)

    def open_hot(self, rel: str, start: int, stop: int) -> Optional[Any]:
        return self.storage.open_hot(rel, start, stop)

    def close(self) -> None:
        """Release what the lane holds (nothing here)."""
