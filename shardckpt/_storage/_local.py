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
import threading
import uuid
from typing import Any, Dict, Iterable, List, Optional, Sequence, Tuple, cast

from .. import _knobs
from ..errors import StorageError, UnreadableFileError
from ._base import Capabilities, Lane, StagedFile, Storage, Writer, check_rel, copy_bytes, pwrite_all, reading

__all__ = ["LocalStorage", "HotFile", "MEMORY_FILESYSTEMS", "WRITEBACK_BYTES", "fsync_dir", "check_inside", "queue_info", "is_cached",
           "fs_type"]

#: Local writes hint the kernel every this many bytes: start writing back what
#: was just written, and drop from the page cache what was written back before
#: (a checkpoint is not read back soon; filling the cache with it would evict
#: the training job's useful pages and delay the final fsync).
WRITEBACK_BYTES = 16 << 20
#: A positional write at least this big starts its own writeback (see ``_LocalWriter.write_at``).
WRITE_AT_WRITEBACK_BYTES = 1 << 20
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


# -- cold reads: how the disk is asked -------------------------------------------------

_O_DIRECT = getattr(os, "O_DIRECT", 0)
#: File offsets, lengths and memory of ``O_DIRECT`` reads are aligned to this
#: (the largest logical block size in use; a page).
DIRECT_ALIGN = 4096
#: Reads shorter than this never go ``O_DIRECT`` (a few pages: the page cache is as good).
DIRECT_MIN_BYTES = 1 << 20
#: Bounce buffer of a thread's ``O_DIRECT`` reads into memory that is not aligned.
DIRECT_BOUNCE_BYTES = 16 << 20
#: A cold read is hinted (``POSIX_FADV_WILLNEED`` of all of it) only when it is
#: more than this many readahead windows: on the 2026-12-06 H100 hosts
#: (read_ahead_kb 8192) hints of 4-16 MiB reads were no faster or slower.
HINT_WINDOW_RATIO = 4
#: ``POSIX_FADV_WILLNEED`` step when the device's limits cannot be read.
DEFAULT_READAHEAD_STEP = 512 << 10
#: A lane (``LocalStorage.lane_bytes``: a stretch of a file one reader thread
#: reads in order) is this many of the device's readahead windows: the
#: readahead that runs past a lane's end into the next one (another thread's)
#: is then at most a quarter of the lane.
LANE_WINDOWS = 4
#: Bounds of a lane: not shorter than a few read pieces, not so long that a
#: load's last lanes leave most threads idle.
LANE_MIN_BYTES = 8 << 20
LANE_MAX_BYTES = 64 << 20
_RWF_NOWAIT = getattr(os, "RWF_NOWAIT", 0)
_MAP_POPULATE = getattr(mmap, "MAP_POPULATE", 0)
_queue_cache: Dict[int, Dict[str, Any]] = {}
_tls = threading.local()


def queue_info(path: str) -> Dict[str, Any]:
    """What the block device under ``path`` tells of itself (``/sys/dev/block/MAJ:MIN/queue``), read-only; {} if nothing.

    Keys (where present): ``device``, ``read_ahead_kb``, ``max_sectors_kb``,
    ``max_hw_sectors_kb``, ``nr_requests``, ``rotational``,
    ``logical_block_size``, ``scheduler``. A partition's queue is its disk's.

    Example:
        >>> isinstance(queue_info("/"), dict)
        True
    """
    try:
        dev = os.stat(path).st_dev
    except OSError:
        return {}
    got = _queue_cache.get(dev)
    if got is not None:
        return got
    out: Dict[str, Any] = {}
    base = f"/sys/dev/block/{os.major(dev)}:{os.minor(dev)}"
    for q in (base + "/queue", base + "/../queue"):
        if os.path.isdir(q):
            out["device"] = os.path.basename(os.path.realpath(os.path.dirname(q)))
            for k in ("read_ahead_kb", "max_sectors_kb", "max_hw_sectors_kb", "nr_requests", "rotational",
                      "logical_block_size", "scheduler"):
                try:
                    with open(os.path.join(q, k)) as f:
                        v = f.read().strip()
                    out[k] = int(v) if v.isdigit() else v
                except OSError:
                    pass
            break
    _queue_cache[dev] = out
    return out


#: Filesystems whose files are memory (``LocalStorage.open_hot``): read straight into the tensors.
MEMORY_FILESYSTEMS = frozenset({"tmpfs", "ramfs"})
_fs_cache: Dict[int, str] = {}


def fs_type(dev: int) -> str:
    """The filesystem type of device ``dev`` (``st_dev``) from ``/proc/self/mountinfo``; "" if unknown.

    Example:
        >>> isinstance(fs_type(os.stat("/").st_dev), str)
        True
    """
    got = _fs_cache.get(dev)
    if got is not None:
        return got
    want = f"{os.major(dev)}:{os.minor(dev)}"
    out = ""
    try:
        with open("/proc/self/mountinfo") as f:
            for line in f:
                fields = line.split()
                if len(fields) > 2 and fields[2] == want and " - " in line:
                    out = line.split(" - ", 1)[1].split()[0]
                    break
    except OSError:
        pass
    _fs_cache[dev] = out
    return out


def is_cached(fd: int, offset: int) -> Optional[bool]:
    """Whether the page of ``fd`` at ``offset`` is in the page cache (a one-byte ``RWF_NOWAIT`` read); None: cannot tell."""
    if not _RWF_NOWAIT:
        return None
    try:
        return os.preadv(fd, [bytearray(1)], offset, _RWF_NOWAIT) >= 0
    except BlockingIOError:
        return False
    except OSError:  # EOPNOTSUPP (a filesystem without non-blocking reads), EINVAL
        return None


def _readahead_step(path: str) -> int:
    """Bytes one ``POSIX_FADV_WILLNEED`` reads ahead at most (the kernel caps it at max(readahead, max request))."""
    q = queue_info(path)
    kb = max([v for v in (q.get("read_ahead_kb"), q.get("max_sectors_kb")) if isinstance(v, int)], default=0)
    return kb << 10 if kb >= 64 else DEFAULT_READAHEAD_STEP


def _readahead_window(path: str) -> int:
    """The device's readahead window in bytes (``read_ahead_kb``); 0 where there is no block device (tmpfs, network)."""
    kb = queue_info(path).get("read_ahead_kb")
    return kb << 10 if isinstance(kb, int) else 0


def _will_need(fd: int, path: str, offset: int, n: int) -> None:
    """Ask the kernel to start reading ``[offset, offset + n)`` now, all of it (a hint: failures change nothing).

    One ``WILLNEED`` reads ahead at most the device's window, so the range
    is asked in steps of it: every request goes to the disk at once (a deep
    queue), instead of one readahead window at a time as the bytes are used.
    """
    if _FADVISE is None:
        return
    step = _readahead_step(path)
    try:
        for a in range(offset, offset + n, step):
            _FADVISE(fd, a, min(step, offset + n - a), os.POSIX_FADV_WILLNEED)
    except OSError:
        pass


def _direct_into(fd: int, mm: Any, a: int, need: int) -> int:
    """``O_DIRECT`` read of file bytes ``[a, ...)`` into the aligned ``mm`` until ``need`` bytes or EOF; returns bytes read."""
    got = 0
    view = memoryview(mm)
    end = min(len(view), -(-need // DIRECT_ALIGN) * DIRECT_ALIGN)  # O_DIRECT lengths are aligned too
    try:
        while got < need:
            n = os.preadv(fd, [view[got:end]], a + got)
            if n <= 0:
                break
            got += n
            if got % DIRECT_ALIGN:
                break  # the file's end (O_DIRECT returns the tail unaligned)
    finally:
        view.release()
    return got


def _anon(n: int) -> mmap.mmap:
    """Page-aligned anonymous memory of ``n`` bytes, populated (an ``O_DIRECT`` target)."""
    return mmap.mmap(-1, n, flags=mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS | _MAP_POPULATE)


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


def _iov_max() -> int:
    try:
        n = os.sysconf("SC_IOV_MAX")
    except (AttributeError, ValueError, OSError):
        n = -1
    return n if n > 0 else 1024


#: Buffers one ``preadv`` takes (the kernel's ``UIO_MAXIOV``; 1024 on Linux).
IOV_MAX = _iov_max()


class HotFile:
    """An open local file whose bytes are cached (``LocalStorage.open_hot``): ``readv`` scatters them into buffers."""

    __slots__ = ("fd", "url", "size")
    #: Whether several reader threads may share this file through one read
    #: (``preadv`` takes its offset: no shared file position), for pieces up
    #: to ``size``: a memory file's, not a lane's (that belongs to its thread).
    shareable = True

    def __init__(self, fd: int, url: str, size: int = -1):
        self.fd, self.url, self.size = fd, url, size

    def readv(self, offset: int, views: Sequence[memoryview]) -> None:
        """Fill ``views`` in order from file bytes at ``offset`` (``preadv``, looped on short reads).

        Raises:
            EOFError: the file ends first (another process truncated it).
        """
        views = [v for v in views if len(v)]
        i = 0
        while i < len(views):
            # At most IOV_MAX buffers a call: a block of many small tensors
            # (an HF file of 2,000 norms) is more, and preadv refuses with EINVAL.
            got = os.preadv(self.fd, views[i : i + IOV_MAX], offset)
            if got <= 0:
                raise EOFError(f"{self.url}: file ends before byte {offset + sum(len(v) for v in views[i:])}")
            offset += got
            while i < len(views) and got >= len(views[i]):
                got -= len(views[i])
                i += 1
            if got:
                views[i] = views[i][got:]

    def close(self) -> None:
        if self.fd >= 0:
            os.close(self.fd)
            self.fd = -1


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
        self._direct_refused = False  # the filesystem refused O_DIRECT once
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

    def _open_regular(self, path: str, flags: int = 0) -> int:
        """A read-only fd of ``path`` (``flags`` added), refused unless it is a regular file inside the root."""
        fd = os.open(self._inside(path), os.O_RDONLY | _O_CLOEXEC | _O_NONBLOCK | flags)
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

    def _direct_mode(self, path: str, fd: int, offset: int, n: int) -> str:
        """How to read ``n`` bytes at ``offset``: ``"direct"`` (``O_DIRECT``), ``"cold"`` (page cache, read ahead whole at once) or ``"warm"``.

        Decided from what the storage shows. Only files on a block device
        (sysfs has its queue: not tmpfs, not a network filesystem) and reads
        of at least ``DIRECT_MIN_BYTES`` are considered. ``SHARDCKPT_LOAD_DIRECT``
        ``0`` (default): through the page cache; a range whose last page is not
        cached (a one-byte ``RWF_NOWAIT`` probe) and that is more than
        ``HINT_WINDOW_RATIO`` of the device's readahead windows (``read_ahead_kb``:
        a mapping's faults read one window at a time) is asked of the disk whole with
        ``POSIX_FADV_WILLNEED`` first. ``auto``: uncached ranges ``O_DIRECT``.
        ``1``: every range ``O_DIRECT``. A filesystem that refuses ``O_DIRECT``
        is remembered and read through the cache.
        """
        if n < DIRECT_MIN_BYTES or not queue_info(path):
            return "warm"
        mode = _knobs.LOAD_DIRECT
        direct = mode != "0" and _O_DIRECT and not self._direct_refused
        if direct and mode == "1":
            return "direct"
        if not direct and _readahead_window(path) * HINT_WINDOW_RATIO >= n:
            return "warm"  # the kernel's own readahead nearly covers the request: no probe, no hint
        if is_cached(fd, offset + n - 1) is not False:
            return "warm"
        return "direct" if direct else "cold"

    def _open_direct(self, path: str) -> Optional[int]:
        try:
            return self._open_regular(path, _O_DIRECT)
        except OSError as e:
            if e.errno in (errno.EINVAL, errno.EOPNOTSUPP):
                self._direct_refused = True  # this filesystem: never again
                return None
            raise

    def _read_direct(self, rel: str, path: str, offset: int, buf: memoryview) -> bool:
        """Read ``buf`` from ``offset`` with ``O_DIRECT`` through this thread's aligned bounce buffer; False: refused."""
        dfd = self._open_direct(path)
        if dfd is None:
            return False
        try:
            bounce = getattr(_tls, "bounce", None)
            if bounce is None:
                bounce = _tls.bounce = _anon(DIRECT_BOUNCE_BYTES)
            n, done = len(buf), 0
            while done < n:
                pos = offset + done
                a = pos - pos % DIRECT_ALIGN
                want = min(len(bounce), -(-(offset + n - a) // DIRECT_ALIGN) * DIRECT_ALIGN)
                got = _direct_into(dfd, bounce, a, want)
                take = min(n - done, got - (pos - a))
                if take <= 0:
                    raise self._short(rel, offset + n)
                with memoryview(bounce) as bv:
                    copy_bytes(buf[done : done + take], bv[pos - a : pos - a + take])
                done += take
        finally:
            os.close(dfd)
        return True

    def _read_ranges(self, rel: str, ranges: Sequence[Tuple[int, memoryview]]) -> None:
        path = self.path(rel)
        kept = _lane_fd(self, rel)
        if kept >= 0:
            self._read_fd(rel, path, kept, ranges)
            return
        fd = self._open_regular(path)
        try:
            self._read_fd(rel, path, fd, ranges)
        finally:
            os.close(fd)

    def _read_fd(self, rel: str, path: str, fd: int, ranges: Sequence[Tuple[int, memoryview]]) -> None:
        """Fill each ``(offset, buffer)`` from the open ``fd`` of ``path``, with the cold-read rules (:meth:`_direct_mode`)."""
        for offset, buf in ranges:
            done = 0
            n = len(buf)
            how = self._direct_mode(path, fd, offset, n)
            if how == "direct" and self._read_direct(rel, path, offset, buf):
                continue
            if how != "warm":
                _will_need(fd, path, offset, n)
            while done < n:
                got = os.preadv(fd, [buf[done:]], offset + done)
                if got <= 0:
                    raise self._short(rel, offset + n)
                done += got

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
            path = self.path(rel)
            kept = _lane_fd(self, rel)
            if kept >= 0:
                return self._map_fd(rel, path, kept, start, stop)
            fd = self._open_mapped(path)
            try:
                return self._map_fd(rel, path, fd, start, stop)
            finally:
                os.close(fd)

    def _map_fd(self, rel: str, path: str, fd: int, start: int, stop: int) -> Tuple[Any, int]:
        """:meth:`map_range` of the open ``fd`` of ``path`` (its size checked now)."""
        if os.fstat(fd).st_size < stop:
            raise self._short(rel, stop)
        how = self._direct_mode(path, fd, start, stop - start)
        if how == "direct":
            # Not in the page cache: one O_DIRECT read of the whole
            # piece into fresh aligned memory (handed over as the mapping).
            dfd = self._open_direct(path)
            if dfd is not None:
                try:
                    a = start - start % DIRECT_ALIGN
                    mm = _anon(-(-(stop - a) // DIRECT_ALIGN) * DIRECT_ALIGN)
                    if _direct_into(dfd, mm, a, stop - a) < stop - a:
                        mm.close()
                        raise self._short(rel, stop)
                    return mm, start - a
                finally:
                    os.close(dfd)
            how = "cold"
        if how == "cold":
            _will_need(fd, path, start, stop - start)
        at = start - start % mmap.ALLOCATIONGRANULARITY
        return mmap.mmap(fd, stop - at, prot=mmap.PROT_READ, offset=at), start - at

    def lane_bytes(self, rel: str) -> int:
        # Lanes where the kernel reads ahead for us: a file on a block device
        # (sysfs shows its queue and a readahead window). 16 threads reading
        # neighbouring pieces of one file through fresh descriptors kept the
        # disk's queue at 2-5 requests on the 2-core development box's virtio
        # disk (each thread's readahead runs into pieces the others are
        # reading, and faults wait on those pages) against 10-60 when each
        # thread read its own 32 MiB stretch in order (docs/performance.md, wave 12).
        if _knobs.LOAD_LANES == "0":
            return 0
        try:
            window = _readahead_window(self._inside(self.path(rel)))
        except OSError:
            return 0  # the read itself reports it
        if window <= 0:
            return 0
        return max(LANE_MIN_BYTES, min(LANE_MAX_BYTES, LANE_WINDOWS * window))

    def open_lane(self, rel: str) -> Lane:
        check_rel(rel, where=self.url)
        return _LocalLane(self, rel)

    def open_hot(self, rel: str, start: int, stop: int) -> Optional["HotFile"]:
        # In memory: a file of a memory filesystem (tmpfs, ramfs: its pages are
        # the file). Files on disks are mapped, cached or not: a probe of their
        # pages (a one-byte RWF_NOWAIT read) starts the kernel's readahead,
        # which would change what ``map_range``'s cold-read rules (O_DIRECT,
        # WILLNEED) see next.
        check_rel(rel, where=self.url)
        with reading(self.url_of(rel)):
            path = self.path(rel)
            kept = _lane_fd(self, rel)
            if kept >= 0 and _knobs.LOAD_DIRECT == "0" and _lane_reads(kept, start):
                # A lane's file on a disk: read in order through the lane's
                # descriptor (the kernel's sequential readahead runs ahead of
                # it). With O_DIRECT asked for, mapped instead (``map_range``
                # applies its rules).
                if os.fstat(kept).st_size < stop:
                    raise self._short(rel, stop)
                return _LaneHotFile(kept, self.url_of(rel))
            if not _knobs.LOAD_INTO:
                return None  # besides lanes, only memory files with LOAD_INTO are read: mapped (no second open per piece)
            fd = self._open_mapped(path)
            try:
                st = os.fstat(fd)
                if st.st_size < stop:
                    raise self._short(rel, stop)
                if _knobs.LOAD_INTO and fs_type(st.st_dev) in MEMORY_FILESYSTEMS:
                    out = HotFile(fd, self.url_of(rel), st.st_size)
                    fd = -1
                    return out
                return None
            finally:
                if fd >= 0:
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


class _LocalLane(Lane):
    """A lane of a local file: one descriptor (checked as :meth:`LocalStorage.map_range` checks) for all its reads.

    The kernel keeps a file's readahead state per open descriptor, so one
    thread's in-order reads (and the faults of mappings made from it) are
    one sequential stream to it. Its reads go through the storage's own
    ``read_into``/``map_range`` (whatever wraps them still sees every read),
    which take this lane's descriptor while it is the thread's current lane.
    Opened at the first read; closed by ``close``.
    """

    def __init__(self, storage: LocalStorage, rel: str):
        super().__init__(storage, rel)
        self._local = storage
        self._fd = -1
        self.reads: Optional[bool] = None  # pieces read with preadv, or mapped (``_lane_reads``, at the first piece)

    def fd_for(self, storage: LocalStorage, rel: str) -> int:
        """This lane's descriptor if it reads ``rel`` of ``storage`` (opened now if need be), else -1."""
        if storage is not self._local or rel != self.rel:
            return -1
        if self._fd < 0:
            self._fd = storage._open_mapped(storage.path(rel))
        return self._fd

    def read_into(self, rel: str, ranges: Sequence[Tuple[int, memoryview]]) -> None:
        prev, _tls.lane = getattr(_tls, "lane", None), self
        try:
            self.storage.read_into(rel, ranges)
        finally:
            _tls.lane = prev

    def open_hot(self, rel: str, start: int, stop: int) -> Optional[Any]:
        prev, _tls.lane = getattr(_tls, "lane", None), self
        try:
            return self.storage.open_hot(rel, start, stop)
        finally:
            _tls.lane = prev

    def map_range(self, rel: str, start: int, stop: int) -> Optional[Tuple[Any, int]]:
        prev, _tls.lane = getattr(_tls, "lane", None), self
        try:
            return self.storage.map_range(rel, start, stop)
        finally:
            _tls.lane = prev

    def close(self) -> None:
        if self._fd >= 0:
            os.close(self._fd)
            self._fd = -1


class _LaneHotFile(HotFile):
    """A :class:`HotFile` on a lane's descriptor: ``close`` leaves it to the lane."""

    __slots__ = ()
    shareable = False

    def close(self) -> None:
        self.fd = -1


def _lane_reads(fd: int, start: int) -> bool:
    """Whether this thread's current lane reads its pieces with ``preadv`` (else they are mapped), decided at its first piece.

    ``SHARDCKPT_LOAD_LANES=read``: always; ``all``: where tmpfs pieces are
    read too (``LOAD_INTO``: few cores), or where the lane's first page is
    not in the page cache (a one-byte ``RWF_NOWAIT`` probe: a cold lane. Its
    side effect, the kernel's readahead from that page, starts where the lane
    reads next). A warm lane on many cores is mapped: with 16 readers the
    second pass through a scratch costs more than the mappings' page tables
    (docs/performance.md, wave 13).
    """
    if _knobs.LOAD_LANES not in ("read", "all"):
        return False
    lane = _tls.lane
    if lane.reads is None:
        lane.reads = _knobs.LOAD_LANES == "read" or _knobs.LOAD_INTO or is_cached(fd, start) is False
    return lane.reads


def _lane_fd(storage: LocalStorage, rel: str) -> int:
    """The descriptor of this thread's current lane for ``rel`` of ``storage`` (:class:`_LocalLane`), or -1."""
    lane = getattr(_tls, "lane", None)
    return lane.fd_for(storage, rel) if lane is not None else -1


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
        # Positional writes come from several threads: each large one is
        # handed to writeback at once (POSIX_FADV_DONTNEED starts it; the
        # pages, dirty, stay until written), so the threads keep the disk's
        # queue full instead of leaving it all to the final fsync.
        n = pwrite_all(self.fd, data, offset)
        if n >= WRITE_AT_WRITEBACK_BYTES and _FADVISE is not None:
            try:
                _FADVISE(self.fd, offset, n, os.POSIX_FADV_DONTNEED)
            except OSError:
                pass
        return n

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
