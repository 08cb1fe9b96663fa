"""The one storage factory: which backend serves a URL.

``Storage(url, ...)`` (the public name) asks :func:`backend_for` through a
hook this module installs on :class:`Storage` when the package is imported:
``_base`` cannot import this module (it imports every backend, and every
backend imports ``_base``), so the dependency runs one way only.
"""

from __future__ import annotations

from typing import Any, Dict, Optional, Type

from ..errors import StorageError
from ._base import Storage
from ._fsspec import FsspecStorage
from ._local import LocalStorage
from ._s3 import S3Storage

__all__ = ["S3_PROTOCOLS", "backend_for"]

#: Protocols served by :class:`S3Storage` (s3fs's client, our transfers).
S3_PROTOCOLS = frozenset({"s3", "s3a"})


def _is_local_url(url: str) -> bool:
    return "://" not in url or url.startswith("file://")


def backend_for(url: str, storage_options: Optional[Dict[str, Any]] = None) -> Type[Storage]:
    """The :class:`Storage` subclass for ``url``: local disk for paths and ``file://``, S3Storage for ``s3://``, fsspec otherwise.

    A ``file://`` URL with options still gets the local backend (fsspec's
    local filesystem would add nothing but overhead); any other protocol is
    resolved by fsspec when the storage is built.

    Args:
        url: a local path or any fsspec URL.
        storage_options: the options the storage will get (no backend
            depends on them today; kept so the choice may).

    Raises:
        StorageError: ``url`` is not a non-empty str.

    Example: ``backend_for("s3://bucket/run") is S3Storage``.
    """
    if not isinstance(url, str) or not url:
        raise StorageError(f"checkpoint URL must be a non-empty str, got {url!r}")
    if _is_local_url(url):
        return LocalStorage
    if url.split("://", 1)[0].lower() in S3_PROTOCOLS:
        return S3Storage
    return FsspecStorage


Storage._backend_for = staticmethod(backend_for)
