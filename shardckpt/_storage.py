"""A small storage interface over fsspec, with a fast path for local disk.

URLs are strings throughout. A checkpoint lives under a root URL; every other
path is a relative POSIX path below it (``data/x.safetensors``). Local paths
(plain or ``file://``) use ``os`` calls directly: ``pread`` into
caller-provided buffers, unbuffered writes, ``fsync`` and an atomic rename for
the commit. Everything else goes through fsspec (``s3://``, ``gs://``,
``memory://``...), with retries on transient errors and parallel ranged reads.
"""

from __future__ import annotations

import abc
import os
import time
import uuid
from typing import Any, Dict, Iterable, List, Optional, Sequence, Tuple

from .errors import StorageError

__all__ = ["Storage", "open_storage", "join_url", "DEFAULT_RETRIES"]

DEFAULT_RETRIES = 3
_RETRY_BASE_DELAY_S = 0.2
#: Local writes hint the kernel every this many bytes: start writing back what
#: was just written, and drop from the page cache what was written back before
#: (a checkpoint is not read back soon; filling the cache with it would evict
#: the training job's useful pages and delay the final fsync).
WRITEBACK_BYTES = 16 << 20
_FADVISE = getattr(os, "posix_fadvise", None)


def join_url(root: str, rel: str) -> str:
    """Join a root URL and a relative path with ``/`` (never ``os.path`` on URLs)."""
    if not rel:
        return root
    return root.rstrip("/") + "/" + rel.lstrip("/")


def _is_local(url: str) -> bool:
    return "://" not in url or url.startswith("file://")


def _local_path(url: str) -> str:
    return url[len("file://") :] if url.startswith("file://") else url


def _import_fsspec():
    try:
        import fsspec
    except ImportError:  # pragma: no cover - declared dependency
        raise StorageError("fsspec is required for non-local URLs: pip install fsspec") from None
    return fsspec


_PROTOCOL_HINT = {"s3": "s3fs", "s3a": "s3fs", "gs": "gcsfs", "gcs": "gcsfs", "az": "adlfs", "abfs": "adlfs", "hf": "huggingface_hub"}


class Storage:
    """Files under one root URL.

    Args:
        url: a local path, ``file://`` URL or any fsspec URL.
        storage_options: passed to the fsspec filesystem (credentials, endpoint...).
        retries: attempts for each remote operation before giving up.
    """

    def __init__(self, url: str, *, storage_options: Optional[Dict[str, Any]] = None, retries: int = DEFAULT_RETRIES):
        if not isinstance(url, str) or not url:
            raise StorageError(f"checkpoint URL must be a non-empty str, got {url!r}")
        self.url = url.rstrip("/") or url
        self.storage_options = dict(storage_options or {})
        self.retries = max(1, retries)
        self.is_local = _is_local(url) and not self.storage_options
        if self.is_local:
            self.root = os.path.abspath(_local_path(url))
            self.fs = None
        else:
            fsspec = _import_fsspec()
            try:
                fs, path = fsspec.core.url_to_fs(url, **self.storage_options)
            except ImportError as e:
                proto = url.split("://", 1)[0]
                pkg = _PROTOCOL_HINT.get(proto, "the fsspec backend for " + repr(proto))
                raise StorageError(f"cannot open {url!r}: {e}. Install {pkg} (e.g. pip install {pkg})") from None
            except ValueError as e:
                proto = url.split("://", 1)[0]
                hint = ""
                if "protocol not known" in str(e).lower():
                    pkg = _PROTOCOL_HINT.get(proto)
                    hint = (
                        f". Install {pkg} (e.g. pip install {pkg})"
                        if pkg
                        else f". No fsspec backend handles {proto!r}: pip install the package that provides it "
                        "(s3fs for s3://, gcsfs for gs://, adlfs for az://; see fsspec's list of known implementations)"
                    )
                raise StorageError(f"cannot open {url!r}: {e}{hint}") from None
            self.fs = fs
            self.root = path.rstrip("/")
            # fsspec's local filesystem behind a file:// URL with options.
            self.is_local = type(fs).__name__ == "LocalFileSystem"
            if self.is_local:
                self.root = os.path.abspath(path)
                self.fs = None

    # -- paths --------------------------------------------------------------

    def path(self, rel: str) -> str:
        if self.is_local:
            return os.path.join(self.root, *rel.split("/")) if rel else self.root
        return join_url(self.root, rel)

    def url_of(self, rel: str) -> str:
        return join_url(self.url, rel)

    def child(self, rel: str) -> "Storage":
        """Storage rooted at ``rel`` below this root, sharing options."""
        return Storage(join_url(self.url, rel), storage_options=self.storage_options, retries=self.retries)

    # -- retries --------------------------------------------------------------

    def _retry(self, what: str, fn, *args, **kwargs):
        delay = _RETRY_BASE_DELAY_S
        for attempt in range(self.retries):
            try:
                return fn(*args, **kwargs)
            except (FileNotFoundError, PermissionError, IsADirectoryError, NotADirectoryError):
                raise
            except OSError as e:  # transient on object stores: timeouts, 5xx, throttling
                if attempt + 1 == self.retries:
                    raise StorageError(f"{what} failed after {self.retries} attempts: {e}") from e
                time.sleep(delay)
                delay *= 2

    # -- queries --------------------------------------------------------------

    def exists(self, rel: str) -> bool:
        if self.is_local:
            return os.path.exists(self.path(rel))
        return bool(self._retry(f"exists {self.url_of(rel)}", self.fs.exists, self.path(rel)))

    def size(self, rel: str) -> int:
        """Size in bytes; raises ``FileNotFoundError`` when missing."""
        if self.is_local:
            return os.stat(self.path(rel)).st_size
        info = self._retry(f"stat {self.url_of(rel)}", self.fs.info, self.path(rel))
        return int(info["size"])

    def listdir(self, rel: str = "") -> List[str]:
        """Names (not paths) directly under ``rel``; ``[]`` if it does not exist."""
        if self.is_local:
            try:
                return sorted(os.listdir(self.path(rel)))
            except FileNotFoundError:
                return []
        try:
            entries = self._retry(f"list {self.url_of(rel)}", self.fs.ls, self.path(rel), detail=False)
        except FileNotFoundError:
            return []
        base = self.path(rel).rstrip("/")
        out = []
        for e in entries:
            e = e.rstrip("/")
            name = e[len(base) + 1 :] if e.startswith(base + "/") else e.rsplit("/", 1)[-1]
            if name:
                out.append(name)
        return sorted(set(out))

    def walk_files(self, rel: str = "") -> List[str]:
        """Every file below ``rel``, as paths relative to the root."""
        out = []
        if self.is_local:
            top = self.path(rel)
            for dirpath, _, files in os.walk(top):
                for f in files:
                    full = os.path.join(dirpath, f)
                    out.append(os.path.relpath(full, self.root).replace(os.sep, "/"))
            return sorted(out)
        try:
            found = self._retry(f"find {self.url_of(rel)}", self.fs.find, self.path(rel))
        except FileNotFoundError:
            return []
        root = self.root.rstrip("/") + "/"
        for p in found:
            p = p.lstrip("/") if not root.startswith("/") else p
            if p.startswith(root):
                out.append(p[len(root) :])
            elif ("/" + p).startswith(root):
                out.append(("/" + p)[len(root) :])
        return sorted(out)

    # -- reads ----------------------------------------------------------------

    def read_bytes(self, rel: str, *, limit: Optional[int] = None) -> bytes:
        """Whole file (refusing more than ``limit`` bytes)."""
        if limit is not None:
            n = self.size(rel)
            if n > limit:
                from .errors import UnsafeMetadataError

                raise UnsafeMetadataError(f"{self.url_of(rel)}: {n} bytes exceeds the {limit}-byte limit")
        if self.is_local:
            with open(self.path(rel), "rb") as f:
                return f.read()
        return self._retry(f"read {self.url_of(rel)}", self.fs.cat_file, self.path(rel))

    def read_range(self, rel: str, start: int, length: int) -> bytes:
        if self.is_local:
            with open(self.path(rel), "rb") as f:
                return os.pread(f.fileno(), length, start)
        return self._retry(
            f"read {self.url_of(rel)}[{start}:{start + length}]", self.fs.cat_file, self.path(rel), start=start, end=start + length
        )

    def read_into(self, rel: str, ranges: Sequence[Tuple[int, memoryview]]) -> None:
        """Fill each ``(offset, buffer)`` from the file; raises if the file is short."""
        if self.is_local:
            fd = os.open(self.path(rel), os.O_RDONLY)
            try:
                for offset, buf in ranges:
                    done = 0
                    n = len(buf)
                    while done < n:
                        got = os.preadv(fd, [buf[done:]], offset + done)
                        if got <= 0:
                            raise EOFError(f"{self.url_of(rel)}: file ends before byte {offset + n}")
                        done += got
            finally:
                os.close(fd)
            return
        path = self.path(rel)
        starts = [o for o, _ in ranges]
        ends = [o + len(b) for o, b in ranges]
        datas = self._retry(
            f"read {len(ranges)} ranges of {self.url_of(rel)}",
            self.fs.cat_ranges,
            [path] * len(ranges),
            starts,
            ends,
            on_error="raise",
        )
        for (offset, buf), data in zip(ranges, datas):
            if isinstance(data, Exception):
                raise data
            if len(data) != len(buf):
                raise EOFError(f"{self.url_of(rel)}: file ends before byte {offset + len(buf)}")
            buf[:] = data

    # -- writes ---------------------------------------------------------------

    def makedirs(self, rel: str = "") -> None:
        if self.is_local:
            os.makedirs(self.path(rel), exist_ok=True)
        else:
            try:
                self.fs.makedirs(self.path(rel), exist_ok=True)
            except (OSError, NotImplementedError):
                pass  # object stores have no directories

    def open_write(self, rel: str) -> "_Writer":
        """A writer that creates ``rel`` (parents included); ``close()`` makes it durable."""
        if self.is_local:
            path = self.path(rel)
            os.makedirs(os.path.dirname(path), exist_ok=True)
            return _LocalWriter(path)
        return _RemoteWriter(self.fs.open(self.path(rel), "wb"), self.url_of(rel), lambda: self.remove(rel))

    def write_atomic(self, rel: str, data: bytes) -> None:
        """Publish ``data`` at ``rel`` all at once: readers see the old state or all of it.

        Local disk: temp file, fsync, rename, fsync of the directory. Object
        stores: a single PUT, which is atomic by itself.
        """
        if self.is_local:
            path = self.path(rel)
            d = os.path.dirname(path)
            os.makedirs(d, exist_ok=True)
            tmp = os.path.join(d, f".{os.path.basename(path)}.{uuid.uuid4().hex}.tmp")
            try:
                with open(tmp, "wb") as f:
                    f.write(data)
                    f.flush()
                    os.fsync(f.fileno())
                os.replace(tmp, path)
            except BaseException:
                try:
                    os.unlink(tmp)
                except OSError:
                    pass
                raise
            fsync_dir(d)
            return
        self._retry(f"write {self.url_of(rel)}", self.fs.pipe_file, self.path(rel), data)

    def fsync_dirs(self, rels: Iterable[str]) -> None:
        """Make directory entries (new files) durable; no-op off local disk."""
        if self.is_local:
            for rel in sorted(set(rels)):
                fsync_dir(self.path(rel))

    def remove(self, rel: str) -> None:
        """Delete a file; missing is fine."""
        try:
            if self.is_local:
                os.unlink(self.path(rel))
            else:
                self._retry(f"delete {self.url_of(rel)}", self.fs.rm_file, self.path(rel))
        except FileNotFoundError:
            pass

    def remove_tree(self, rel: str = "") -> None:
        """Delete everything under ``rel``; missing is fine."""
        if self.is_local:
            import shutil

            shutil.rmtree(self.path(rel), ignore_errors=True)
            return
        try:
            self._retry(f"delete {self.url_of(rel)}", self.fs.rm, self.path(rel), recursive=True)
        except FileNotFoundError:
            pass


def fsync_dir(path: str) -> None:
    try:
        fd = os.open(path, os.O_RDONLY)
    except OSError:
        return
    try:
        os.fsync(fd)
    except OSError:
        pass  # some filesystems refuse fsync on directories
    finally:
        os.close(fd)


class _Writer(abc.ABC):
    """A file being written: ``close()`` makes it durable, ``abort()`` removes it."""

    @abc.abstractmethod
    def write(self, data) -> None: ...

    @abc.abstractmethod
    def close(self) -> None: ...

    @abc.abstractmethod
    def abort(self) -> None: ...


class _LocalWriter(_Writer):
    def __init__(self, path: str):
        self.path = path
        self.fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o644)
        self.pos = 0
        self.hinted = 0  # bytes before this were handed to writeback
        self.dropped = 0  # bytes before this were dropped from the page cache

    def write(self, data) -> None:
        mv = memoryview(data).cast("B")
        while len(mv):
            n = os.write(self.fd, mv)
            mv = mv[n:]
            self.pos += n
        if self.pos - self.hinted >= WRITEBACK_BYTES:
            self._writeback()

    def _writeback(self) -> None:
        # POSIX_FADV_DONTNEED on Linux starts writeback of dirty pages in the
        # range and drops the clean ones. Over [dropped, pos): the previous
        # window, written back by now, leaves the cache; the new one starts
        # going to disk while the next block is prepared, so the final fsync
        # has little left to do. A hint: failures change nothing.
        if _FADVISE is not None:
            try:
                _FADVISE(self.fd, self.dropped, self.pos - self.dropped, os.POSIX_FADV_DONTNEED)
            except OSError:
                pass
        self.dropped, self.hinted = self.hinted, self.pos

    def close(self) -> None:
        try:
            os.fsync(self.fd)
            if _FADVISE is not None:
                try:
                    _FADVISE(self.fd, 0, 0, os.POSIX_FADV_DONTNEED)
                except OSError:
                    pass
        finally:
            os.close(self.fd)
            self.fd = -1

    def abort(self) -> None:
        if self.fd >= 0:
            os.close(self.fd)
            self.fd = -1
        try:
            os.unlink(self.path)
        except OSError:
            pass


class _RemoteWriter(_Writer):
    def __init__(self, f, url: str, remove=None):
        self.f = f
        self.url = url
        self.remove = remove

    def write(self, data) -> None:
        self.f.write(memoryview(data).cast("B"))

    def close(self) -> None:
        self.f.close()

    def abort(self) -> None:
        try:
            if hasattr(self.f, "discard"):
                self.f.discard()
            else:
                self.f.close()
        except Exception:
            pass
        # Some backends publish the file at open or close (memory://), and
        # discard cannot take it back: delete whatever is there.
        try:
            if self.remove is not None:
                self.remove()
        except Exception:
            pass


def open_storage(url: str, storage_options: Optional[Dict[str, Any]] = None) -> Storage:
    return Storage(url, storage_options=storage_options)
