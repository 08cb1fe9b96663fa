"""Local disk: ``os`` calls, no fsspec.

``pread``/``preadv`` into caller buffers, unbuffered writes with write-behind
hints, ``pwrite`` for parallel writers, ``fsync`` of files and of the
directories that gained entries, and an atomic rename for every publish.
Temp files are created with ``O_EXCL | O_NOFOLLOW``, so a link planted at a
temp name is never written through. The root may be reached through a
symlink (a "latest" link, on purpose), but reads below it never leave it: a
symlink inside a checkpoint that resolves outside the root is refused, and
only regular files are read (a FIFO would block the open forever, a device
like ``/dev/zero`` never ends), opened non-blocking and checked with
``fstat`` before the first byte.
"""

from __future__ import annotations

import errno
import mmap
import os
import shutil
import stat
import uuid
from typing import Any, Dict, Iterable, List, Optional, Sequence, Tuple, cast

from ..errors import StorageError, UnreadableFileError
from ._base import Capabilities, StagedFile, Storage, Writer, check_rel, pwrite_all, reading

__all__ = ["LocalStorage", "WRITEBACK_BYTES", "fsync_dir", "check_inside"]

#: Local writes hint the kernel every this many bytes: start writing back what
#: was just written, and drop from the page cache what was written back before
#: (a checkpoint is not read back soon; filling the cache with it would evict
#: the training job's useful pages and delay the final fsync).
WRITEBACK_BYTES = 16 << 20
_FADVISE = getattr(os, "posix_fadvise", None)
# Never create a file through a symlink someone planted at a temp name.
_O_NOFOLLOW = getattr(os, "O_NOFOLLOW", 0)
_O_CLOEXEC = getattr(os, "O_CLOEXEC", 0)
# Opening a FIFO for reading blocks until a writer comes: open without waiting, then refuse it.
_O_NONBLOCK = getattr(os, "O_NONBLOCK", 0)
#: Files whose identity :meth:`LocalStorage._open_mapped` remembers (a bound: a checkpoint may have thousands).
_MAPPED_IDS = 4096


def fsync_dir(path: str) -> None:
    """fsync a directory so the entries created in it survive a crash; best effort."""
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


def _local_path(url: str) -> str:
    return url[len("file://") :] if url.startswith("file://") else url


def _tmp_name(path: str, suffix: str) -> str:
    d, base = os.path.split(path)
    return os.path.join(d, f".{base}.{uuid.uuid4().hex[:12]}.{suffix}")


def check_inside(root: str, path: str) -> str:
    """``path`` (a local path below ``root``) if, symlinks resolved, it stays below ``root``.

    The containment rule of every read from a local disk, whichever backend
    reads it (this one, or fsspec's local filesystem behind ``local://`` or a
    cache): a checkpoint's files, its manifest and a Hugging Face index alike.

    Raises:
        UnreadableFileError: it leads out of the checkpoint (naming where to).

    Example:
        >>> check_inside("/ck", "/ck/manifest.json")   # doctest: +SKIP
        '/ck/manifest.json'
    """
    if path == root:
        return path
    real = os.path.realpath(path)
    top = os.path.realpath(root)
    if real != top and not real.startswith(top.rstrip(os.sep) + os.sep):
        raise UnreadableFileError(
            f"{path} is a symlink leading out of the checkpoint (to {real}); "
            "a checkpoint's files must lie inside its directory"
        )
    return path


class LocalStorage(Storage):
    """Files on local disk (a plain path or ``file://`` URL).

    Example: ``LocalStorage("/ckpt/step-10").write_atomic("manifest.json", b"{}")``.

    ``storage_options={"private": True}`` creates files 0600 and directories
    0700 (the memory tier's files in shared memory: never readable by other
    local users); otherwise files 0644 and directories by the umask.

    Limits: other ``storage_options`` are kept for children but change nothing here.
    """

    caps = Capabilities(
        atomic_rename=True, has_dirs=True, positional_write=True, high_latency=False, batched_reads=False, consistent_listing=True
    )

    def __init__(self, url: str, *, storage_options: Optional[Dict[str, Any]] = None, retries: Optional[int] = None, root: Optional[str] = None):
        super().__init__(url, storage_options=storage_options, retries=retries)
        self.root = os.path.abspath(root if root is not None else _local_path(self.url))
        private = bool(self.storage_options.get("private"))
        self._file_mode = 0o600 if private else 0o644
        self._dir_mode = 0o700 if private else 0o777
        self._mapped_ids: Dict[str, Tuple[int, int]] = {}  # path -> (st_dev, st_ino), checked inside the root

    def _mkdirs(self, path: str) -> None:
        """``os.makedirs(exist_ok=True)``, every directory it creates with this storage's mode (not only the last)."""
        if self._dir_mode == 0o777:
            os.makedirs(path, exist_ok=True)
            return
        missing = []
        p = path
        while p and not os.path.isdir(p):
            missing.append(p)
            head = os.path.dirname(p)
            if head == p:
                break
            p = head
        for d in reversed(missing):
            try:
                os.mkdir(d, self._dir_mode)
            except FileExistsError:
                if not os.path.isdir(d):
                    raise

    @property
    def is_local(self) -> bool:
        return True

    def path(self, rel: str) -> str:
        return os.path.join(self.root, *rel.split("/")) if rel else self.root

    def _parent_url(self) -> str:
        parent = os.path.dirname(self.root)
        if parent == self.root:
            raise StorageError(f"{self.url!r} has no parent directory")
        return "file://" + parent if self.url.startswith("file://") else parent

    # -- core -------------------------------------------------------------------

    def _inside(self, path: str) -> str:
        """``path`` if, symlinks resolved, it stays below the root; else UnreadableFileError."""
        return check_inside(self.root, path)

    def _open_regular(self, path: str) -> int:
        """A read-only fd of ``path``, refused unless it is a regular file inside the root."""
        fd = os.open(self._inside(path), os.O_RDONLY | _O_CLOEXEC | _O_NONBLOCK)
        try:
            mode = os.fstat(fd).st_mode
            if not stat.S_ISREG(mode):
                what = "a directory" if stat.S_ISDIR(mode) else "a FIFO" if stat.S_ISFIFO(mode) else "a device or socket"
                err = UnreadableFileError(f"{path} is {what}, not a regular file; the checkpoint is damaged")
                err.errno = errno.EISDIR if stat.S_ISDIR(mode) else errno.ENXIO
                raise err
        except BaseException:
            os.close(fd)
            raise
        return fd

    def _exists(self, path: str) -> bool:
        return os.path.exists(path)

    def _is_file(self, path: str) -> bool:
        return os.path.isfile(path)

    def _size(self, path: str) -> int:
        return os.stat(self._inside(path)).st_size

    def _listdir(self, path: str) -> List[str]:
        return os.listdir(path)

    def _list_sizes(self, path: str, name_prefix: str) -> Dict[str, int]:
        # One directory scan. Only regular files, not followed: a symlink (or
        # FIFO, directory) where a file is expected is left out, so the
        # caller's own stat of it applies the checks reads apply (_inside).
        out = {}
        with os.scandir(self._inside(path)) as it:
            for e in it:
                if e.name.startswith(name_prefix) and e.is_file(follow_symlinks=False):
                    out[e.name] = e.stat(follow_symlinks=False).st_size
        return out

    def _walk(self, path: str) -> List[str]:
        out = []
        for dirpath, _, files in os.walk(path):
            for f in files:
                out.append(os.path.relpath(os.path.join(dirpath, f), self.root).replace(os.sep, "/"))
        return out

    def _read(self, path: str, start: int, end: Optional[int]) -> bytes:
        fd = self._open_regular(path)
        with open(fd, "rb", closefd=True) as f:
            if end is None:
                f.seek(start)
                return f.read()
            # pread may return less than asked before the end: loop to ``end`` or EOF.
            out = bytearray()
            while start + len(out) < end:
                got = os.pread(fd, end - start - len(out), start + len(out))
                if not got:
                    break
                out += got
            return bytes(out)

    def _read_ranges(self, rel: str, ranges: Sequence[Tuple[int, memoryview]]) -> None:
        fd = self._open_regular(self.path(rel))
        try:
            for offset, buf in ranges:
                done = 0
                n = len(buf)
                while done < n:
                    got = os.preadv(fd, [buf[done:]], offset + done)
                    if got <= 0:
                        raise self._short(rel, offset + n)
                    done += got
        finally:
            os.close(fd)

    @property
    def can_map(self) -> bool:
        return hasattr(mmap, "PROT_READ")  # POSIX (Windows maps through another signature)

    def map_range(self, rel: str, start: int, stop: int) -> Optional[Tuple[Any, int]]:
        # The file is opened (and checked inside the root, regular) for each
        # range, and its size checked just before the mapping: the mapping of
        # a file truncated by someone else *while* its bytes are read would
        # fault (SIGBUS); the window is one range's checksum and copy.
        check_rel(rel, where=self.url)
        with reading(self.url_of(rel)):
            fd = self._open_mapped(self.path(rel))
            try:
                if os.fstat(fd).st_size < stop:
                    raise self._short(rel, stop)
                at = start - start % mmap.ALLOCATIONGRANULARITY
                return mmap.mmap(fd, stop - at, prot=mmap.PROT_READ, offset=at), start - at
            finally:
                os.close(fd)

    def _open_mapped(self, path: str) -> int:
        """:meth:`_open_regular` for the pieces of a mapped load: the full check once per file, then its identity.

        A load maps a file in many pieces; resolving every component of its
        path (``check_inside``: two ``realpath``s) for each piece cost more
        than the mapping itself. The first open of ``path`` is checked in
        full and remembers the file's ``(st_dev, st_ino)``; a later one is
        accepted when the file it opened is that same regular file, else it
        is checked in full again (a file replaced by a link leading out is
        refused as before).
        """
        ids = self.__dict__.setdefault("_mapped_ids", {})  # (a copy made without __init__ has none yet)
        known = ids.get(path)
        if known is not None:
            fd = os.open(path, os.O_RDONLY | _O_CLOEXEC | _O_NONBLOCK)
            try:
                st = os.fstat(fd)
            except BaseException:
                os.close(fd)
                raise
            if (st.st_dev, st.st_ino) == known and stat.S_ISREG(st.st_mode):
                return fd
            os.close(fd)
        fd = self._open_regular(path)
        st = os.fstat(fd)
        if len(ids) >= _MAPPED_IDS:
            ids.clear()
        ids[path] = (st.st_dev, st.st_ino)
        return fd

    def _open_writer(self, rel: str) -> Writer:
        path = self.path(rel)
        self._mkdirs(os.path.dirname(path))
        return _LocalWriter(path, self.url_of(rel), self._file_mode)

    def _put(self, rel: str, data: bytes, *, make_dirs: bool = True) -> None:
        path = self.path(rel)
        d = os.path.dirname(path)
        if make_dirs:
            self._mkdirs(d)
        # Without make_dirs, a directory removed under us fails the O_EXCL
        # create or the rename (FileNotFoundError): never re-created.
        tmp = _tmp_name(path, "tmp")
        try:
            fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_EXCL | _O_NOFOLLOW | _O_CLOEXEC, self._file_mode)
            try:
                pwrite_all(fd, data, 0)
                os.fsync(fd)
            finally:
                os.close(fd)
            os.replace(tmp, path)
        except BaseException:
            try:
                os.unlink(tmp)
            except OSError:
                pass
            raise
        fsync_dir(d)

    def _put_existing(self, rel: str, data: bytes) -> None:
        self._put(rel, data, make_dirs=False)

    def _remove(self, path: str) -> None:
        os.unlink(path)

    def _remove_tree(self, path: str) -> None:
        if os.path.isdir(path) and not os.path.islink(path):
            shutil.rmtree(path, ignore_errors=True)
        elif os.path.lexists(path):
            os.unlink(path)

    def _makedirs(self, path: str) -> None:
        self._mkdirs(path)

    # -- local-only abilities -----------------------------------------------------

    def fsync_dirs(self, rels: Iterable[str]) -> None:
        for rel in sorted(set(rels)):
            fsync_dir(self._p(rel))

    def open_staged(self, rel: str) -> StagedFile:
        path = self._p(rel)
        self._mkdirs(os.path.dirname(path))
        tmp = _tmp_name(path, "tmp")
        os.close(os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_EXCL | _O_NOFOLLOW | _O_CLOEXEC, self._file_mode))
        return _LocalStagedFile(self, rel, tmp)

    def rename(self, src: str, dst: str) -> None:
        s, d = self._p(src), self._p(dst)
        self._mkdirs(os.path.dirname(d))
        os.replace(s, d)
        fsync_dir(os.path.dirname(d))
        if os.path.dirname(s) != os.path.dirname(d):
            fsync_dir(os.path.dirname(s))

    def replace_with(self, staging: Storage) -> None:
        if not isinstance(staging, LocalStorage) or os.path.dirname(staging.root) != os.path.dirname(self.root):
            raise StorageError(f"{self.url}: replace_with needs a sibling on the same disk, got {staging.url!r}")
        fsync_dir(staging.root)
        parent = os.path.dirname(self.root)
        old = None
        if os.path.lexists(self.root):
            if os.path.isdir(self.root) and not os.path.islink(self.root) and not os.listdir(self.root):
                os.rmdir(self.root)
            else:
                old = _tmp_name(self.root, "old")
                os.rename(self.root, old)
        try:
            os.rename(staging.root, self.root)
        except BaseException:
            if old is not None:
                os.rename(old, self.root)  # put the previous contents back
            raise
        fsync_dir(parent)
        if old is not None:
            LocalStorage(old).remove_tree("")


class _LocalStagedFile(StagedFile):
    """Staged next to its target: ``commit()`` is fsync, rename, fsync of the directory."""

    def commit(self) -> None:
        if self._fd < 0:
            self._fd = os.open(self.path, os.O_RDONLY)
        self._close_fd(sync=True)
        try:
            self.storage.rename(os.path.relpath(self.path, cast(LocalStorage, self.storage).root).replace(os.sep, "/"), self.rel)
        except BaseException:
            self._unlink()
            raise
        self._done = True


class _LocalWriter(Writer):
    def __init__(self, path: str, url: str = "", mode: int = 0o644):
        self.path = path
        self.url = url or path
        # Private (memory tier) files: a link planted at the name is never written through.
        nofollow = _O_NOFOLLOW if mode == 0o600 else 0
        self.fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC | _O_CLOEXEC | nofollow, mode)
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

    def write_at(self, data, offset: int) -> int:
        # Positional writes come from several threads: no write-behind
        # bookkeeping (close() still fsyncs and drops the cache).
        return pwrite_all(self.fd, data, offset)

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
