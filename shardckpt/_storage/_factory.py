"""The one storage factory: the backend registry, and which backend serves a URL.

A backend is a :class:`Storage` subclass registered for one or more URL
schemes (:func:`register_backend`); the built-in ones are registered here
(``file`` -> :class:`LocalStorage`, ``s3``/``s3a`` -> :class:`S3Storage`).
A plain path is local disk; a scheme nobody registered goes to
:class:`FsspecStorage`, which serves whatever fsspec knows (``gs://``,
``az://``, ``memory://``...). Adding a backend is one module holding the
class and its ``register_backend`` call (docs/extending.md).

``Storage(url, ...)`` (the public name) asks :func:`backend_for` through a
hook this module installs (``set_backend_lookup``) when the package is imported:
``_base`` cannot import this module (it imports every backend, and every
backend imports ``_base``), so the dependency runs one way only.
"""

from __future__ import annotations

import re
from typing import Any, Dict, Optional, Type, Union

from ..errors import StorageError, UsageError
from ._base import Capabilities, Storage, set_backend_lookup
from ._fsspec import FsspecStorage
from ._local import LocalStorage
from ._s3 import S3Storage

__all__ = ["S3_PROTOCOLS", "backend_for", "open_storage", "register_backend", "rebuildable"]

#: Protocols served by :class:`S3Storage` (s3fs's client, our transfers).
S3_PROTOCOLS = frozenset({"s3", "s3a"})

#: A URL scheme as RFC 3986 spells it, lower-case (the case URLs are matched in).
_SCHEME = re.compile(r"[a-z][a-z0-9+.-]*\Z")

#: scheme -> backend class; the built-ins are registered at the end of this module.
_BACKENDS: Dict[str, Type[Storage]] = {}
#: The backends shardckpt itself registers: a fresh process (a writer child)
#: builds the same backend from the URL alone; a user's needs the user's code.
_BUILTIN: Dict[str, Type[Storage]] = {}


def register_backend(scheme: str, backend: Type[Storage], *, override: bool = False) -> None:
    """Serve URLs ``scheme://...`` with the :class:`Storage` subclass ``backend``.

    From then on ``Storage(url)`` and every ``url`` argument of shardckpt
    (``save``, ``load``, ``inspect``, ``verify``, the manager, the
    converters) build ``backend(url, storage_options=..., retries=...)`` for
    such a URL. The class implements the storage core (the ``_``-prefixed
    methods and ``path`` that :class:`Storage` lists; a class missing one
    fails where it is defined) and sets ``caps`` (:class:`Capabilities`),
    which tells callers what it can do. Registering the same class again for
    a scheme is a no-op.

    Args:
        scheme: the URL scheme, without ``://`` (``"mem2"``), lower-case
            as URLs spell it. Plain paths are served as ``file`` is.
        backend: a subclass of :class:`Storage`.
        override: replace the backend already registered for ``scheme``
            (a built-in one included: ``file``, ``s3``, ``s3a``).

    Raises:
        UsageError: ``scheme`` is not a URL scheme, ``backend`` is not a
            :class:`Storage` subclass, or another backend is registered for
            ``scheme`` and ``override`` is False (the message names it).

    Example (``MemStorage``: the whole class is in docs/extending.md)::

        shardckpt.register_backend("mem2", MemStorage)
        shardckpt.save(state, "mem2://run/step-10")

    Limits: registrations are per process: every rank (and every process
    that opens such a URL) registers it. A user's backend is used in this
    process only (an async save writes from a thread, never from a writer
    child that has not registered it).
    """
    key = scheme
    if not isinstance(key, str) or not _SCHEME.match(key):
        raise UsageError(f"register_backend: scheme must be a URL scheme such as 'mem2' (letters, digits, '+', '-', '.'; no '://'), got {scheme!r}")
    if not (isinstance(backend, type) and issubclass(backend, Storage)) or backend is Storage:
        raise UsageError(f"register_backend({scheme!r}, ...): the backend must be a subclass of shardckpt.Storage, got {backend!r}")
    have = _BACKENDS.get(key)
    if have is not None and have is not backend and not override:
        raise UsageError(
            f"register_backend({scheme!r}, {backend.__qualname__}): {key}:// is already served by "
            f"{have.__module__}.{have.__qualname__}; pass override=True to replace it"
        )
    _BACKENDS[key] = backend


def backend_for(url: str, storage_options: Optional[Dict[str, Any]] = None) -> Type[Storage]:
    """The :class:`Storage` subclass for ``url``: its scheme's registered backend; local disk for paths; fsspec otherwise.

    A ``file://`` URL with options still gets the local backend (fsspec's
    local filesystem would add nothing but overhead); a protocol nobody
    registered is resolved by fsspec when the storage is built.

    Args:
        url: a local path or any URL.
        storage_options: the options the storage will get (no backend
            depends on them today; kept so the choice may).

    Raises:
        StorageError: ``url`` is not a non-empty str.

    Example: ``backend_for("s3://bucket/run") is S3Storage``.
    """
    if not isinstance(url, str) or not url:
        raise StorageError(f"checkpoint URL must be a non-empty str, got {url!r}")
    if "://" not in url:
        return _BACKENDS.get("file", LocalStorage)
    return _BACKENDS.get(url.split("://", 1)[0], FsspecStorage)


def open_storage(target: Union[str, Storage], *, storage_options: Optional[Dict[str, Any]] = None) -> Storage:
    """``target`` itself if it is a :class:`Storage`, else ``Storage(target, storage_options=...)``.

    The one place where a ``url`` argument of the API becomes a storage, so
    that every call taking a URL also takes a storage object (as DCP takes a
    ``StorageWriter``).

    Raises:
        UsageError: a storage object and ``storage_options`` together (the
            object already holds its options), or a storage whose ``caps``
            is not a :class:`Capabilities`.
        StorageError: a bad URL (see :class:`Storage`).
    """
    if isinstance(target, Storage):
        if storage_options:
            raise UsageError(
                f"storage_options were given with the storage object {target!r}; it already holds its options: "
                "build it with them, or pass its URL instead"
            )
        if not isinstance(getattr(target, "caps", None), Capabilities):
            raise UsageError(
                f"{type(target).__qualname__} has no capability flags: set its caps to a shardckpt.Capabilities "
                "(class attribute, or in __init__)"
            )
        return target
    return Storage(target, storage_options=storage_options)


def rebuildable(storage: Storage) -> bool:
    """Whether a fresh process's ``Storage(storage.url)`` builds this same backend (shardckpt's own backends only: fsspec's too)."""
    try:
        cls = backend_for(storage.url, storage.storage_options)
    except StorageError:
        return False
    return type(storage) is cls and (cls is FsspecStorage or cls in _BUILTIN.values())


for _scheme, _backend in (("file", LocalStorage), *((p, S3Storage) for p in sorted(S3_PROTOCOLS))):
    register_backend(_scheme, _backend)
    _BUILTIN[_scheme] = _backend

set_backend_lookup(backend_for)
