"""S3 and S3-compatible servers (``s3://``): obstore moves the bytes, s3fs lists.

:class:`S3Storage` is an :class:`FsspecStorage` (listing, ``exists`` and
tree deletes stay s3fs's) whose data path (puts, multipart uploads, ranged
gets, HEADs, deletes) is :class:`~shardckpt._storage._obstore.ObstoreData`.
This module holds s3fs's side (the filesystem, the request loop on its
client for listings and upload aborts, error classification) and the read
planning; ``_obstore.py`` holds the transfers. The contract:

- writes: parallel multipart uploads. A writer fills one part buffer
  (``S3_PART_BYTES``) and hands full parts to obstore, at most
  ``S3_WRITER_INFLIGHT_PARTS`` in flight per writer, so memory is bounded by
  ``(S3_WRITER_INFLIGHT_PARTS + 2) * S3_PART_BYTES`` per open file and no local
  temp copy is made. A file smaller than one part is one ``PutObject``. An
  object becomes visible only at ``CompleteMultipartUpload``; a failed or
  aborted writer aborts its upload, so a partial object never appears.
- reads: ``read_into`` merges close ranges (``plan_range_fetches``), splits
  them into ``S3_READ_PART_BYTES`` ranged GETs and runs them concurrently;
  each body is copied once, from obstore's buffer into the caller's.
- every request (tunables: ``shardckpt._knobs.S3_*``): a bounded number in
  flight (``S3_MAX_REQUESTS``), a deadline (``S3_STALL_TIMEOUT_S`` plus the
  bytes at ``S3_MIN_BYTES_PER_S``) so a stalled transfer fails instead of
  hanging, and one retry loop (the base class's policy: ``STORAGE_RETRIES``
  attempts, jittered exponential back-off) for 5xx, SlowDown/throttling,
  resets and timeouts. botocore's, s3fs's and object_store's own retries are
  switched off (but for a multipart upload's parts, ``_obstore.py``) so that
  attempts do not multiply.
- errors: missing objects are ``FileNotFoundError``; missing or refused
  credentials a ``StorageError`` with a hint (``storage_options`` keys,
  environment variables, endpoint); everything else after the last attempt
  a ``StorageError`` naming the object (its ``code`` is S3's error code
  where the server gave one).

One data client, measured: an aiobotocore data path (s3fs's client, on
ONE asyncio thread that also signs and hashes every body) saved at less
than half obstore's speed on a 16-core host and was removed
(docs/object-storage.md has the numbers).
"""

from __future__ import annotations

import asyncio
import concurrent.futures as cf
import threading
from typing import Any, Dict, Optional, Sequence, Tuple

from .. import _knobs
from ..errors import StorageError
from ._base import Writer, backoff_delay, plan_range_fetches
from ._fsspec import FsspecStorage, resolve
from ._obstore import CRED_HINT, ObstoreData

__all__ = ["S3Storage"]

# Tunables (part sizes, request limit, timeouts) live in shardckpt/_knobs.py
# as S3_*, read at call time.

#: Error codes that mean "try again later" whatever the HTTP status.
_TRANSIENT_CODES = frozenset(
    {
        "SlowDown",
        "Throttling",
        "ThrottlingException",
        "RequestThrottled",
        "RequestTimeout",
        "RequestTimeoutException",
        "InternalError",
        "ServiceUnavailable",
        "503",
        "500",
        "502",
        "504",
        "XAmzContentSHA256Mismatch",
        "BadDigest",
        "IncompleteBody",
    }
)
#: Error codes that mean the credentials are missing, wrong or refused.
_AUTH_CODES = frozenset(
    {
        "AccessDenied",
        "InvalidAccessKeyId",
        "SignatureDoesNotMatch",
        "ExpiredToken",
        "InvalidToken",
        "TokenRefreshRequired",
        "AllAccessDisabled",
        "403",
        "401",
    }
)
_MISSING_CODES = frozenset({"NoSuchKey", "404", "NotFound"})
#: The oldest s3fs with today's API: ``endpoint_url`` as a top-level option
#: (s3fs 2023.3.0, its #704) on the aiobotocore client we list with. Older
#: ones (0.4.x, which pip's backtracking can pick) fail deep inside with a
#: TypeError. pyproject.toml's ``s3`` and ``test`` extras pin the same bound.
S3FS_MIN_VERSION = "2023.3.0"


def _client_defaults(options: Dict[str, Any]) -> Dict[str, Any]:
    """``options`` with our timeouts, pool size and no client-side retries (the user's settings win)."""
    out = dict(options)
    cfg = dict(out.get("config_kwargs") or {})
    cfg.setdefault("connect_timeout", _knobs.S3_CONNECT_TIMEOUT_S)
    cfg.setdefault("read_timeout", _knobs.S3_STALL_TIMEOUT_S)
    cfg.setdefault("max_pool_connections", _knobs.S3_MAX_REQUESTS)
    # One retry loop (ours): botocore's would multiply the attempts.
    cfg.setdefault("retries", {"mode": "standard", "total_max_attempts": 1})
    # botocore's default checksums every body it sends on the client's
    # single event-loop thread (measured: docs/object-storage.md). Our data
    # files carry CRC-32C per chunk, verified on every load, so the
    # transport checksum is only asked where S3 requires it.
    # botocore before 1.36 has neither option (nor the default they turn off).
    for opt in ("request_checksum_calculation", "response_checksum_validation"):
        if _botocore_knows(opt):
            cfg.setdefault(opt, "when_required")
    out["config_kwargs"] = cfg
    # A private filesystem instance: we change its retry count below, which
    # must not leak into s3fs instances the caller shares through fsspec's cache.
    out["skip_instance_cache"] = True
    return out


def _botocore_knows(option: str) -> bool:
    try:
        from botocore.config import Config
    except ImportError:  # pragma: no cover - s3fs depends on botocore
        return False
    return option in getattr(Config, "OPTION_DEFAULTS", {})


def _version_tuple(v: str) -> Tuple[int, ...]:
    out = []
    for part in v.split("."):
        digits = "".join(c for c in part if c.isdigit()) if part[:1].isdigit() else ""
        if not digits:
            break
        out.append(int(digits))
    return tuple(out)


def _s3fs_refused(url: str, e: TypeError) -> StorageError:
    """Our error for a TypeError out of s3fs's constructor or session: an s3fs too old for today's options, named."""
    try:
        import s3fs

        version = str(getattr(s3fs, "__version__", "unknown"))
    except ImportError:  # pragma: no cover - we got here through s3fs
        version = "unknown"
    fix = f'pip install -U "s3fs>={S3FS_MIN_VERSION}"'
    if not version[:1].isdigit() or _version_tuple(version) < _version_tuple(S3FS_MIN_VERSION):
        return StorageError(
            f"cannot open {url!r}: the installed s3fs {version} cannot talk to an S3 endpoint with these options "
            f"({e}); shardckpt needs s3fs >= {S3FS_MIN_VERSION}: {fix}"
        )
    return StorageError(f"cannot open {url!r}: s3fs {version} refused the storage options ({e}); check their names")


def _transient_botocore(bex) -> tuple:
    """botocore's exception types for resets, timeouts and garbled answers (names vary by version)."""
    names = ("HTTPClientError", "ConnectionError", "IncompleteReadError", "ResponseStreamingError", "ReadTimeoutError")
    types = [getattr(bex, n) for n in names if isinstance(getattr(bex, n, None), type)]
    try:
        from botocore.parsers import ResponseParserError

        types.append(ResponseParserError)
    except ImportError:  # pragma: no cover
        pass
    return tuple(types)


_FS_CACHE: Dict[Tuple[int, str], Any] = {}
_FS_LOCK = threading.Lock()


def _filesystem(url: str, options: Dict[str, Any]):
    """``(s3fs filesystem, path)``: one private client per process and options, reused.

    A client costs a second or more to make (botocore loads its service
    model), so Storage objects with the same options share one; it is never
    one that fsspec's cache hands to other code (we change its retries).
    """
    import os

    from fsspec.utils import tokenize

    full = _client_defaults(options)
    key = (os.getpid(), tokenize(full))
    with _FS_LOCK:
        fs = _FS_CACHE.get(key)
    if fs is not None:
        return fs, fs._strip_protocol(url)
    try:
        fs, root = resolve(url, full)
    except TypeError as e:
        raise _s3fs_refused(url, e) from e
    # s3fs retries some errors itself (5 attempts): ours is the one loop.
    fs.retries = 1
    with _FS_LOCK:
        fs = _FS_CACHE.setdefault(key, fs)
    return fs, root


class _Shared:
    """Per-filesystem state shared by a root and its children: the request limit."""

    def __init__(self) -> None:
        self.sem: Optional[asyncio.Semaphore] = None

    def semaphore(self) -> asyncio.Semaphore:
        # Created on first use, inside the filesystem's event loop.
        if self.sem is None:
            self.sem = asyncio.Semaphore(_knobs.S3_MAX_REQUESTS)
        return self.sem


class S3Storage(FsspecStorage):
    """``s3://``: listing through s3fs's client, parallel multipart writes and parallel ranged reads through obstore.

    Args: as :class:`FsspecStorage`; ``storage_options`` are s3fs's
    (``key``, ``secret``, ``token``, ``endpoint_url``, ``client_kwargs``,
    ``config_kwargs``, ``s3_additional_kwargs``...), mapped for obstore as
    docs/object-storage.md says.

    Raises:
        StorageError: s3fs or obstore is not installed (with the hint to
            install it).

    Example::

        st = Storage("s3://bucket/run/step-10", storage_options={"endpoint_url": "http://127.0.0.1:8333"})
        isinstance(st, S3Storage)  # True

    Limits: like every object store, no atomic rename and no positional
    writes; a process killed mid-upload leaves an invisible incomplete
    multipart upload (storage, not data) that a bucket lifecycle rule
    (AbortIncompleteMultipartUpload) removes.
    """

    def __init__(
        self,
        url: str,
        *,
        storage_options: Optional[Dict[str, Any]] = None,
        retries: Optional[int] = None,
        fs: Any = None,
        root: Optional[str] = None,
        _shared: Optional[_Shared] = None,
    ):
        if fs is None:
            fs, root = _filesystem(url.rstrip("/") or url, storage_options or {})
        super().__init__(url, storage_options=storage_options, retries=retries, fs=fs, root=root)
        if _shared is None:
            # One request limit per client, whichever Storage objects use it.
            _shared = getattr(self.fs, "_shardckpt_shared", None)
            if _shared is None:
                _shared = _Shared()
                self.fs._shardckpt_shared = _shared
        self._shared = _shared
        self._data = ObstoreData(self)

    def child(self, rel: str) -> "S3Storage":
        return S3Storage(
            self.url_of(rel),
            storage_options=self.storage_options,
            retries=self.retries,
            fs=self.fs,
            root=self._p(rel),
            _shared=self._shared,
        )

    # -- errors -----------------------------------------------------------------

    def _classify(self, e: Exception, what: str) -> Optional[Exception]:
        try:
            import botocore.exceptions as bex
        except ImportError:  # pragma: no cover - s3fs depends on botocore
            bex = None
        if isinstance(e, StorageError):
            return e
        if bex is not None and isinstance(e, bex.ClientError):
            err = (getattr(e, "response", None) or {}).get("Error", {}) or {}
            code = str(err.get("Code", ""))
            status = int(((getattr(e, "response", None) or {}).get("ResponseMetadata", {}) or {}).get("HTTPStatusCode") or 0)
            if code in _MISSING_CODES or status == 404 and code != "NoSuchBucket" and code != "NoSuchUpload":
                return FileNotFoundError(f"{what}: no such object ({code})")
            if code == "NoSuchBucket":
                return StorageError(f"{what}: the bucket does not exist ({e}); create it or fix the URL")
            if code in _AUTH_CODES or status in (401, 403):
                return StorageError(f"{what}: access refused ({code}): {CRED_HINT}")
            if code in _TRANSIENT_CODES or status >= 500 or status == 429:
                return None
            # S3's own code travels as an attribute, for callers to branch
            # on (never as text to search).
            return StorageError(f"{what}: {e}", code=code)
        if bex is not None and isinstance(
            e, (bex.NoCredentialsError, bex.PartialCredentialsError, bex.CredentialRetrievalError, bex.UnauthorizedSSOTokenError)
        ):
            return StorageError(f"{what}: no usable credentials ({e}): {CRED_HINT}")
        if isinstance(e, PermissionError):
            # s3fs turned AccessDenied & co into PermissionError.
            return StorageError(f"{what}: access refused ({e}): {CRED_HINT}")
        if isinstance(e, (FileNotFoundError, IsADirectoryError, NotADirectoryError)):
            return e
        if isinstance(e, (OSError, asyncio.TimeoutError, cf.TimeoutError)):
            return None  # resets, timeouts, s3fs's EREMOTEIO for 5xx
        if bex is not None and isinstance(e, _transient_botocore(bex)):
            return None
        try:
            import aiohttp

            if isinstance(e, aiohttp.ClientError):
                return None
        except ImportError:  # pragma: no cover
            pass
        if type(e).__name__ in ("IncompleteRead", "ResponseStreamingError", "ReadTimeoutError"):
            return None
        return e

    # -- async data path ------------------------------------------------------------

    def _bucket_key(self, rel: str) -> Tuple[str, str]:
        path = self._p(rel).lstrip("/")
        bucket, _, key = path.partition("/")
        return bucket, key

    async def _client(self):
        try:
            await self.fs.set_session()
        except TypeError as e:  # s3fs/aiobotocore of another API: not transient, and not the server's fault
            raise _s3fs_refused(self.url, e) from e
        return self.fs._s3

    async def _request(self, what: str, method: str, **kwargs):
        """One S3 call on s3fs's client (listings, upload aborts) with the request limit, a deadline and the retry policy.

        No call here moves a body: the deadline is ``S3_STALL_TIMEOUT_S``.
        """
        deadline = _knobs.S3_STALL_TIMEOUT_S
        for attempt in range(self.retries):
            try:
                # The client is made (the first time: botocore's models
                # parsed, seconds of CPU on a loaded machine) before the
                # deadline starts: an attempt cut short here sent nothing,
                # yet counted as one of our ``retries`` (a "stalled
                # transfer" that never reached the server).
                s3 = await self._client()
                async with self._shared.semaphore():

                    async def attempt_once(s3=s3):
                        fn = getattr(s3, method)
                        kw = kwargs
                        extra = getattr(self.fs, "_get_s3_method_kwargs", None)
                        if extra is not None:
                            kw = extra(fn, **kwargs)
                        return await fn(**kw)

                    return await asyncio.wait_for(attempt_once(), deadline)
            except Exception as e:
                if isinstance(e, asyncio.TimeoutError):
                    e = TimeoutError(f"no answer within {deadline:.0f} s (stalled transfer)")
                err = self._classify(e, what)
                if err is not None:
                    if err is e:
                        raise
                    raise err from e
                if attempt + 1 == self.retries:
                    raise StorageError(f"{what} failed after {self.retries} attempts: {type(e).__name__}: {e}") from e
                await asyncio.sleep(backoff_delay(attempt))
        raise AssertionError("unreachable")  # pragma: no cover

    def _sync(self, coro):
        """Run ``coro`` on the filesystem's event loop from this (non-loop) thread."""
        return asyncio.run_coroutine_threadsafe(coro, self.fs.loop).result()

    # -- core overrides: reads planned here, transfers by obstore ------------------

    def _rel_of(self, path: str) -> str:
        root = self.root.rstrip("/")
        if path == root:
            return ""
        return path[len(root) + 1 :] if root and path.startswith(root + "/") else path

    def _read(self, path: str, start: int, end: Optional[int]) -> bytes:
        rel = self._rel_of(path)
        if end is None or end - start > _knobs.S3_READ_PART_BYTES:
            # Large or open-ended: learn the size (callers pass generous
            # limits) and fetch the pieces in parallel.
            size = self._fresh_size(path)
            end = size if end is None else min(end, size)
        if end <= start:
            return b""
        if end - start <= _knobs.S3_READ_PART_BYTES:
            return self._data.get(rel, start, end)
        buf = bytearray(end - start)
        got = self._data.fill(rel, [(start, end)], [(start, memoryview(buf))], allow_short=True)
        return bytes(buf[: got - start]) if got < end else bytes(buf)

    def _read_ranges(self, rel: str, ranges: Sequence[Tuple[int, memoryview]]) -> None:
        fetches = plan_range_fetches([(o, len(b)) for o, b in ranges])
        if fetches:
            self._data.fill(rel, [(s, e) for s, e, _ in fetches], ranges, allow_short=False)

    def _size(self, path: str) -> int:
        # No listing cache on the data path: always a HEAD.
        return self._data.head(self._rel_of(path))

    def _fresh_size(self, path: str) -> int:
        return self._size(path)  # already asked of the server

    def _list_sizes(self, path: str, name_prefix: str) -> Dict[str, int]:
        # ListObjectsV2 under "<dir>/<name prefix>" with a delimiter: only
        # this directory's keys of that prefix, 1,000 a page, sizes included.
        # On s3fs's client (listing stays s3fs's), through _request (request
        # limit, deadline, retries); no listing cache involved.
        rel = self._rel_of(path)
        bucket, key = self._bucket_key(rel)
        base = key.rstrip("/") + "/" if key else ""
        what = f"list {self.url_of(rel)}"
        return self._sync(self._list_pages(what, bucket, base, name_prefix))

    async def _list_pages(self, what: str, bucket: str, base: str, name_prefix: str) -> Dict[str, int]:
        out: Dict[str, int] = {}
        kwargs: Dict[str, Any] = {"Bucket": bucket, "Prefix": base + name_prefix, "Delimiter": "/"}
        while True:
            resp = await self._request(what, "list_objects_v2", **kwargs)
            for obj in resp.get("Contents") or ():
                name = str(obj.get("Key", ""))[len(base) :]
                if name.startswith(name_prefix) and name and "/" not in name:
                    out[name] = int(obj.get("Size", 0))
            token = resp.get("NextContinuationToken")
            if not resp.get("IsTruncated") or not token:
                return out
            kwargs["ContinuationToken"] = token

    def _put(self, rel: str, data: bytes) -> None:
        self._data.put(rel, data)

    def _open_writer(self, rel: str) -> Writer:
        return self._data.open_writer(rel)

    def _remove(self, path: str) -> None:
        self._data.remove(self._rel_of(path))

    def _abort_uploads(self, rel: str) -> None:
        """Abort every multipart upload of ``rel``'s key: their parts are stored (and billed) until then.

        On s3fs's client: obstore has no call to list or abort uploads.
        """
        bucket, key = self._bucket_key(rel)
        url = self.url_of(rel)
        ups = self._sync(self._request(f"list uploads of {url}", "list_multipart_uploads", Bucket=bucket, Prefix=key))
        for up in ups.get("Uploads") or []:
            if up.get("Key") == key:
                self._sync(
                    self._request(
                        f"abort upload of {url}", "abort_multipart_upload", Bucket=bucket, Key=key, UploadId=up["UploadId"]
                    )
                )

    def _forget(self, rel: str) -> None:
        """Drop s3fs's cached listings of ``rel`` and its parents: listing stays s3fs's, and it did not see this change."""
        self.fs.invalidate_cache(self.path(rel))

