"""Storage backends: one interface, a small core per backend, capability flags.

``Storage(url, storage_options=...)`` returns the backend for ``url``:
:class:`LocalStorage` (plain paths, ``file://``) or :class:`FsspecStorage`
(any other fsspec URL), :class:`S3Storage` (``s3://``). Callers ask ``storage.caps`` (:class:`Capabilities`)
instead of checking which backend they hold. See docs/storage.md.
"""

from ._base import (
    DEFAULT_RETRIES,
    RANGE_MERGE_GAP_BYTES,
    Capabilities,
    StagedFile,
    Storage,
    Writer,
    backoff_delay,
    join_url,
    plan_range_fetches,
    pwrite_all,
)
from ._factory import backend_for, open_storage
from ._fsspec import FsspecStorage
from ._local import WRITEBACK_BYTES, LocalStorage, fsync_dir
from ._s3 import S3Storage

__all__ = [
    "Capabilities",
    "DEFAULT_RETRIES",
    "FsspecStorage",
    "LocalStorage",
    "RANGE_MERGE_GAP_BYTES",
    "S3Storage",
    "StagedFile",
    "Storage",
    "WRITEBACK_BYTES",
    "Writer",
    "backend_for",
    "backoff_delay",
    "fsync_dir",
    "join_url",
    "open_storage",
    "plan_range_fetches",
    "pwrite_all",
]
