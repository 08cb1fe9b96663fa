"""A storage backend written from scratch on shardckpt's public API alone (docs/extending.md).

``dir2://<absolute path>``: files on local disk through plain ``os`` calls,
with no atomic rename (like an object store) and a count of every call of
the storage core per process (``DirStorage.calls``), so tests see that
shardckpt really went through it. The whole backend is this one file plus
its ``register_backend`` call: adding a backend touches no file of the
package.
"""

from __future__ import annotations

import collections
import os
import shutil
import uuid

import shardckpt

SCHEME = "dir2"
PREFIX = SCHEME + "://"


def _tmp_name(path: str) -> str:
    return f"{path}.{uuid.uuid4().hex[:12]}.tmp"


class DirWriter(shardckpt.Writer):
    """Appends to a hidden temporary file; ``close()`` fsyncs it and renames it into place whole."""

    def __init__(self, path: str, url: str):
        self.url, self.path, self.tmp = url, path, _tmp_name(path)
        self.f = open(self.tmp, "wb")

    def write(self, data) -> None:
        self.f.write(data)

    def close(self) -> None:
        self.f.flush()
        os.fsync(self.f.fileno())
        self.f.close()
        os.replace(self.tmp, self.path)

    def abort(self) -> None:
        self.f.close()
        try:
            os.unlink(self.tmp)
        except FileNotFoundError:
            pass


class DirStorage(shardckpt.Storage):
    """``dir2:///abs/path``: the storage core on plain ``os`` calls."""

    caps = shardckpt.Capabilities(
        atomic_rename=False, has_dirs=True, positional_write=False, high_latency=False, batched_reads=False
    )
    #: Calls of each core method in this process.
    calls: "collections.Counter[str]" = collections.Counter()

    def __init__(self, url: str, *, storage_options=None, retries=None):
        super().__init__(url, storage_options=storage_options, retries=retries)
        if not self.url.startswith(PREFIX + "/"):
            raise shardckpt.StorageError(f"{url!r}: a {PREFIX} URL names an absolute path ({PREFIX}/abs/path)")
        self.root = self.url[len(PREFIX):]

    def _count(self, name: str) -> None:
        DirStorage.calls[name] += 1

    def path(self, rel: str) -> str:
        return os.path.join(self.root, rel) if rel else self.root

    def _exists(self, path):
        self._count("_exists")
        return os.path.exists(path)

    def _is_file(self, path):
        self._count("_is_file")
        return os.path.isfile(path)

    def _size(self, path):
        self._count("_size")
        return os.stat(path).st_size

    def _listdir(self, path):
        self._count("_listdir")
        return os.listdir(path)

    def _walk(self, path):
        self._count("_walk")
        if not os.path.isdir(path):
            raise FileNotFoundError(path)
        return [os.path.relpath(os.path.join(d, f), self.root) for d, _, files in os.walk(path) for f in files]

    def _read(self, path, start, end):
        self._count("_read")
        with open(path, "rb") as f:
            f.seek(start)
            return f.read() if end is None else f.read(end - start)

    def _read_ranges(self, rel, ranges):
        self._count("_read_ranges")
        with open(self.path(rel), "rb") as f:
            for offset, buf in ranges:
                f.seek(offset)
                if f.readinto(buf) != len(buf):
                    raise self._short(rel, offset + len(buf))

    def _open_writer(self, rel):
        self._count("_open_writer")
        path = self.path(rel)
        os.makedirs(os.path.dirname(path), exist_ok=True)
        return DirWriter(path, self.url_of(rel))

    def _put(self, rel, data):
        self._count("_put")
        w = self._open_writer(rel)
        w.write(data)
        w.close()

    def _remove(self, path):
        self._count("_remove")
        os.remove(path)

    def _remove_tree(self, path):
        self._count("_remove_tree")
        if os.path.isdir(path):
            shutil.rmtree(path)
        else:
            os.remove(path)

    def _makedirs(self, path):
        self._count("_makedirs")
        os.makedirs(path, exist_ok=True)


def register() -> None:
    """Serve ``dir2://`` with :class:`DirStorage` in this process (again: a no-op)."""
    shardckpt.register_backend(SCHEME, DirStorage)
