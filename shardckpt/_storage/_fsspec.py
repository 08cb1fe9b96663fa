"""Any fsspec filesystem: object stores (``s3://``, ``gs://``, ``az://``), ``memory://``, and the rest.

Every call is retried on transient errors (see ``Storage._retry``). A commit
needs no rename: ``write_atomic`` is one PUT (``pipe_file``), atomic on object
stores by itself. Backends with real directories (sftp, hdfs, fsspec's own
local filesystem...) get their parent directories created before a file is
written in them; object stores, whose directories are key prefixes, do not.
"""

from __future__ import annotations

import threading
from typing import Any, Dict, List, Optional, Sequence, Set, Tuple

from ..errors import StorageError
from ._base import Capabilities, Storage, Writer, plan_range_fetches
from ._local import check_inside

__all__ = ["FsspecStorage", "PROTOCOL_HINTS"]

#: The package that provides each well-known protocol (for install hints).
PROTOCOL_HINTS = {
    "s3": "s3fs",
    "s3a": "s3fs",
    "gs": "gcsfs",
    "gcs": "gcsfs",
    "az": "adlfs",
    "abfs": "adlfs",
    "abfss": "adlfs",
    "hf": "huggingface_hub",
}

#: Protocols whose "directories" are key prefixes: nothing to create before
#: writing a key, and an empty "directory" does not exist.
_KEY_PREFIX_PROTOCOLS = frozenset({"s3", "s3a", "gs", "gcs", "az", "abfs", "abfss", "adl", "oss", "r2", "memory"})
#: Protocols where each call is a local function call, not a network round trip.
_IN_PROCESS_PROTOCOLS = frozenset({"memory", "file", "local"})
#: Protocols whose listings show every completed write and delete at once
#: (S3 since December 2020, GCS, Azure Blob, in-process ones): a listing may
#: confirm files' sizes (``Capabilities.consistent_listing``). Others (http,
#: hf, ftp...) are stat'ed file by file.
_CONSISTENT_LIST_PROTOCOLS = frozenset({"s3", "s3a", "gs", "gcs", "az", "abfs", "abfss", "memory", "file", "local"})


def import_fsspec():
    try:
        import fsspec
    except ImportError:  # pragma: no cover - declared dependency
        raise StorageError("fsspec is required for non-local URLs: pip install fsspec") from None
    return fsspec


def resolve(url: str, storage_options: Dict[str, Any]):
    """``(filesystem, path)`` for ``url``; our StorageError with an install hint when the backend is missing."""
    fsspec = import_fsspec()
    proto = url.split("://", 1)[0]
    try:
        return fsspec.core.url_to_fs(url, **storage_options)
    except ImportError as e:
        pkg = PROTOCOL_HINTS.get(proto, "the fsspec backend for " + repr(proto))
        raise StorageError(f"cannot open {url!r}: {e}. Install {pkg} (e.g. pip install {pkg})") from None
    except ValueError as e:
        hint = ""
        # fsspec says "Protocol not known" with a plain ValueError: ask its
        # registry instead of reading the message.
        if proto not in fsspec.available_protocols():
            known = PROTOCOL_HINTS.get(proto)
            hint = (
                f". Install {known} (e.g. pip install {known})"
                if known
                else f". No fsspec backend handles {proto!r}: pip install the package that provides it "
                "(s3fs for s3://, gcsfs for gs://, adlfs for az://; see fsspec's list of known implementations)"
            )
        raise StorageError(f"cannot open {url!r}: {e}{hint}") from None


def _protocols(fs) -> Set[str]:
    p = getattr(fs, "protocol", ())
    return {p} if isinstance(p, str) else set(p)


#: fsspec's names of the local disk (``local://``, and under its caches).
_DISK_PROTOCOLS = frozenset({"file", "local"})


def _on_local_disk(fs) -> bool:
    """Whether ``fs`` reads the local disk, itself or under a cache (``simplecache::file://``: its ``.fs``)."""
    seen = 0
    while fs is not None and seen < 8:
        if _protocols(fs) & _DISK_PROTOCOLS:
            return True
        fs, seen = getattr(fs, "fs", None), seen + 1
    return False


class FsspecStorage(Storage):
    """Files behind an fsspec filesystem.

    ``fs`` is the filesystem and ``root`` the root's path on it (for tests
    and diagnostics; callers go through the methods).

    Example: ``FsspecStorage("s3://b/run", storage_options={"endpoint_url": ...}).listdir()``.

    Limits: no positional writes (a file is one sequential stream) and no
    atomic rename; ranges of one ``read_into`` call are merged when close and
    fetched concurrently by fsspec's ``cat_ranges``.
    """

    def __init__(
        self,
        url: str,
        *,
        storage_options: Optional[Dict[str, Any]] = None,
        retries: Optional[int] = None,
        fs=None,
        root: Optional[str] = None,
    ):
        super().__init__(url, storage_options=storage_options, retries=retries)
        if fs is None:
            fs, root = resolve(self.url, self.storage_options)
        self.fs = fs
        self.root = (root or "").rstrip("/") or (root or "")
        protos = _protocols(fs)
        self.caps = Capabilities(
            atomic_rename=False,
            has_dirs=not (protos & _KEY_PREFIX_PROTOCOLS),
            positional_write=False,
            high_latency=not (protos & _IN_PROCESS_PROTOCOLS),
            batched_reads=True,
            consistent_listing=bool(protos & _CONSISTENT_LIST_PROTOCOLS),
        )
        # On the local disk a symlink may lead out of the checkpoint: reads
        # then follow LocalStorage's containment rule (check_inside).
        self._disk = _on_local_disk(fs)
        self._made: Set[str] = set()  # directories known to exist (has_dirs backends)
        self._made_lock = threading.Lock()

    def child(self, rel: str) -> "Storage":
        # Share the filesystem instance: no second url_to_fs, same caches.
        return type(self)(
            self.url_of(rel), storage_options=self.storage_options, retries=self.retries, fs=self.fs, root=self._p(rel)
        )

    def path(self, rel: str) -> str:
        if not rel:
            return self.root
        return self.root.rstrip("/") + "/" + rel.lstrip("/") if self.root else rel.lstrip("/")

    def invalidate_cache(self) -> None:
        if hasattr(self.fs, "invalidate_cache"):
            self.fs.invalidate_cache(self.root)

    # -- core -------------------------------------------------------------------

    def _exists(self, path: str) -> bool:
        return self._retry(f"exists {self._url(path)}", self.fs.exists, path)

    def _is_file(self, path: str) -> bool:
        return self._retry(f"stat {self._url(path)}", self.fs.isfile, path)

    def _size(self, path: str) -> int:
        info = self._retry(f"stat {self._url(path)}", self.fs.info, path)
        return int(info["size"])

    def _fresh_size(self, path: str) -> int:
        # fsspec may answer info() from a listing cached before another
        # process deleted the file: drop it first.
        if hasattr(self.fs, "invalidate_cache"):
            self.fs.invalidate_cache(path)
        return self._size(path)

    def _listdir(self, path: str) -> List[str]:
        entries = self._retry(f"list {self._url(path)}", self.fs.ls, path, detail=False)
        base = path.rstrip("/")
        out = []
        for e in entries:
            e = e.rstrip("/")
            name = e[len(base) + 1 :] if e.startswith(base + "/") else e.rsplit("/", 1)[-1]
            if name and e != base:
                out.append(name)
        return out

    def _list_sizes(self, path: str, name_prefix: str) -> Dict[str, int]:
        # Fresh: drop fsspec's cached listing of the directory first.
        if hasattr(self.fs, "invalidate_cache"):
            self.fs.invalidate_cache(path)
        entries = self._retry(f"list {self._url(path)}", self.fs.ls, path, detail=True)
        base = path.rstrip("/")
        out = {}
        for e in entries:
            if not isinstance(e, dict) or e.get("type") != "file" or e.get("size") is None:
                continue
            full = str(e.get("name", "")).rstrip("/")
            name = full[len(base) + 1 :] if full.startswith(base + "/") else full.rsplit("/", 1)[-1]
            if name.startswith(name_prefix) and "/" not in name:
                out[name] = int(e["size"])
        return out

    def _walk(self, path: str) -> List[str]:
        found = self._retry(f"find {self._url(path)}", self.fs.find, path, detail=True)
        # Files only: s3fs answers a find of an emptied prefix with the
        # prefix itself, typed "directory", on servers that keep folders.
        found = [p for p, info in found.items() if (info or {}).get("type") != "directory"]
        root = self.root.rstrip("/") + "/"
        out = []
        for p in found:
            p = p.lstrip("/") if not root.startswith("/") else p
            if p.startswith(root):
                out.append(p[len(root) :])
            elif ("/" + p).startswith(root):
                out.append(("/" + p)[len(root) :])
        return out

    def _read(self, path: str, start: int, end: Optional[int]) -> bytes:
        if self._disk:
            check_inside(self.root, path)
        what = f"read {self._url(path)}" + (f"[{start}:{end}]" if start or end is not None else "")
        if end is None and not start:
            return self._retry(what, self.fs.cat_file, path)
        return self._retry(what, self.fs.cat_file, path, start=start, end=end)

    def _read_ranges(self, rel: str, ranges: Sequence[Tuple[int, memoryview]]) -> None:
        path = self.path(rel)
        if self._disk:
            check_inside(self.root, path)
        fetches = plan_range_fetches([(o, len(b)) for o, b in ranges])
        if not fetches:
            return
        datas = self._retry(
            f"read {len(fetches)} ranges of {self.url_of(rel)}",
            self.fs.cat_ranges,
            [path] * len(fetches),
            [s for s, _, _ in fetches],
            [e for _, e, _ in fetches],
            on_error="raise",
        )
        for (start, _, idx), data in zip(fetches, datas):
            if isinstance(data, Exception):
                raise data
            for i in idx:
                offset, buf = ranges[i]
                a = offset - start
                if a + len(buf) > len(data):
                    raise self._short(rel, offset + len(buf))
                buf[:] = data[a : a + len(buf)]

    def _ensure_parent(self, rel: str) -> None:
        """Create ``rel``'s parent directory once, on backends that need it."""
        if not self.caps.has_dirs:
            return
        parent = self.path(rel.rsplit("/", 1)[0] if "/" in rel else "")
        with self._made_lock:
            if parent in self._made:
                return
        self._makedirs(parent)
        with self._made_lock:
            self._made.add(parent)

    def _open_writer(self, rel: str) -> Writer:
        self._ensure_parent(rel)
        path = self.path(rel)
        f = self._retry(f"open {self.url_of(rel)}", self.fs.open, path, "wb")
        return _FsspecWriter(f, self.url_of(rel), lambda: self.remove(rel))

    def _put(self, rel: str, data: bytes) -> None:
        self._ensure_parent(rel)
        self._retry(f"write {self.url_of(rel)}", self.fs.pipe_file, self.path(rel), data)

    def _remove(self, path: str) -> None:
        self._retry(f"delete {self._url(path)}", self.fs.rm_file, path)

    def _remove_tree(self, path: str) -> None:
        self._retry(f"delete {self._url(path)}", self.fs.rm, path, recursive=True)
        with self._made_lock:
            self._made = {d for d in self._made if not (d == path or d.startswith(path.rstrip("/") + "/"))}

    def _makedirs(self, path: str) -> None:
        if not self.caps.has_dirs:
            # Key-prefix stores have nothing to create; some (memory://) keep
            # a pseudo-directory, which is harmless, others refuse.
            try:
                self.fs.makedirs(path, exist_ok=True)
            except (OSError, NotImplementedError):
                pass
            return
        self._retry(f"mkdir {self._url(path)}", self.fs.makedirs, path, exist_ok=True)

    def _url(self, path: str) -> str:
        root = self.root.rstrip("/")
        if path == root or not root:
            return self.url if path == root else path
        if path.startswith(root + "/"):
            return self.url + path[len(root) :]
        return path


class _FsspecWriter(Writer):
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
                # Discarded: closing it later (at garbage collection) must not
                # try to flush the buffer discard dropped.
                self.f.closed = True
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
