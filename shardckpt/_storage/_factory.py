"""Which backend serves a URL (``Storage(url)`` calls this)."""

from __future__ import annotations

from typing import Any, Dict, Optional, Type

from ..errors import StorageError
from ._base import Storage

__all__ = ["S3_PROTOCOLS", "backend_for", "open_storage"]

#: Protocols served by :class:`S3Storage` (s3fs's client, our transfers).
S3_PROTOCOLS = frozenset({"s3", "s3a"})


def _is_local_url(url: str) -> bool:
    return "://" not in url or url.startswith("file://")


def backend_for(url: str, storage_options: Optional[Dict[str, Any]] = None) -> Type[Storage]:
    """The :class:`Storage` subclass for ``url``: local disk for paths and ``file://``, S3Storage for ``s3://``, fsspec otherwise.

    A ``file://`` URL with options still gets the local backend (fsspec's
    local filesystem would add nothing but overhead); any other protocol is
    resolved by fsspec when the storage is built.

    Raises:
        StorageError: ``url`` is not a non-empty str.
    """
    if not isinstance(url, str) or not url:
        raise StorageError(f"checkpoint URL must be a non-empty str, got {url!r}")
    from ._fsspec import FsspecStorage
    from ._local import LocalStorage

    if _is_local_url(url):
        return LocalStorage
    if url.split("://", 1)[0].lower() in S3_PROTOCOLS:
        from ._s3 import S3Storage

        return S3Storage
    return FsspecStorage


def open_storage(url: str, storage_options: Optional[Dict[str, Any]] = None) -> Storage:
    """``Storage(url, storage_options=...)``, kept for callers of the old name."""
    return Storage(url, storage_options=storage_options)
