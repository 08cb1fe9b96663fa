"""Storage backends: one interface, a small core per backend, capability flags.

``Storage(url, storage_options=...)`` returns the backend for ``url``, chosen
by ``_factory.backend_for`` from the backends registered by URL scheme
(``register_backend``): :class:`LocalStorage` (plain paths, ``file://``),
:class:`S3Storage` (``s3://``, ``s3a://``), a user's own, or
:class:`FsspecStorage` (any other fsspec URL). ``Storage``, ``Capabilities``,
``Writer`` and ``register_backend`` are public as ``shardckpt.*``. Callers ask ``storage.caps``
(:class:`Capabilities`) instead of checking which backend they hold. See
docs/storage.md.
"""

from ._base import (
    RANGE_MERGE_GAP_BYTES,
    Capabilities,
    Lane,
    StagedFile,
    Storage,
    Writer,
    backoff_delay,
    copy_bytes,
    join_url,
    plan_range_fetches,
    pwrite_all,
)
from ._factory import backend_for, open_storage, rebuildable, register_backend
from ._fsspec import FsspecStorage
from ._local import WRITEBACK_BYTES, LocalStorage, fsync_dir
from ._s3 import S3Storage

__all__ = [
    "Capabilities",
    "FsspecStorage",
    "Lane",
    "LocalStorage",
    "RANGE_MERGE_GAP_BYTES",
    "S3Storage",
    "StagedFile",
    "Storage",
    "WRITEBACK_BYTES",
    "Writer",
    "backend_for",
    "copy_bytes",
    "open_storage",
    "rebuildable",
    "register_backend",
    "backoff_delay",
    "fsync_dir",
    "join_url",
    "plan_range_fetches",
    "pwrite_all",
]
