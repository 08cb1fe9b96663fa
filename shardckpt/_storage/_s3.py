"""S3 and S3-compatible servers (``s3://``): s3fs for listing, our own transfers on one of two clients.

:class:`S3Storage` is an :class:`FsspecStorage` (listing, ``exists`` and
tree deletes stay s3fs's) whose data path (puts, multipart uploads, ranged
gets, HEADs, deletes) is an :class:`~shardckpt._storage._s3_data.S3DataClient`
chosen once when the Storage is made, by ``SHARDCKPT_S3_CLIENT``:
``obstore`` (the default; ``_obstore.py``) or ``s3fs`` (``_s3_botocore.py``:
s3fs's aiobotocore client and event loop). This module holds what both
share: s3fs's filesystem, the request loop on its client (listings, and the
botocore client's transfers), error classification, and the read planning.
Both clients keep the same contract (on obstore, its multipart writer
retries parts inside object_store with our attempt count, and each body
arrives as one Rust buffer copied once into the caller's):

- writes: parallel multipart uploads. A writer fills one part buffer
  (``S3_PART_BYTES``) and hands full parts to the client, at most
  ``S3_WRITER_INFLIGHT_PARTS`` in flight per writer, so memory is bounded by
  ``(S3_WRITER_INFLIGHT_PARTS + 1) * S3_PART_BYTES`` per open file and no local
  temp copy is made. A file smaller than one part is one ``PutObject``. An
  object becomes visible only at ``CompleteMultipartUpload``; a failed or
  aborted writer aborts its upload, so a partial object never appears.
- reads: ``read_into`` merges close ranges (``plan_range_fetches``), splits
  them into ``S3_READ_PART_BYTES`` ranged GETs and runs them concurrently;
  each body goes into the caller's buffer as it arrives (no joined copy).
- every request (tunables: ``shardckpt._knobs.S3_*``): at most ``S3_MAX_REQUESTS`` in flight per process and root,
  a deadline (``S3_STALL_TIMEOUT_S`` plus the bytes at ``S3_MIN_BYTES_PER_S``)
  so a stalled transfer fails instead of hanging, and one retry loop (the
  base class's policy: ``STORAGE_RETRIES`` attempts, jittered exponential
  back-off) for 5xx, SlowDown/throttling, resets and timeouts. botocore's
  and s3fs's own retries are switched off so that attempts do not multiply.
- errors: missing objects are ``FileNotFoundError``; missing or refused
  credentials a ``StorageError`` with a hint (``storage_options`` keys,
  environment variables, endpoint); everything else after the last attempt
  a ``StorageError`` naming the object (its ``code`` is S3's error code
  where the server gave one).

Why two clients: measured against SeaweedFS on loopback (benchmarks/bench_s3.py;
docs/object-storage.md), every aiobotocore path of a process runs on ONE
asyncio thread that also signs and hashes every body, which caps uploads
near 0.4 GB/s; obstore does that work in Rust without the GIL. s3fs stays
selectable (``SHARDCKPT_S3_CLIENT=s3fs``) and serves when obstore is not
installed.
"""

from __future__ import annotations

import asyncio
import concurrent.futures as cf
import threading
from typing import Any, Dict, List, Optional, Sequence, Tuple

from .. import _knobs
from ..errors import StorageError
from ._base import Writer, backoff_delay, plan_range_fetches
from ._fsspec import FsspecStorage, resolve
from ._obstore import ObstoreData, import_obstore
from ._s3_botocore import BotocoreData
from ._s3_data import S3DataClient

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

_CRED_HINT = (
    "check the S3 credentials and endpoint: pass storage_options={'key': ..., 'secret': ..., "
    "'endpoint_url': ...} (or 'anon': True for a public bucket), or set AWS_ACCESS_KEY_ID / "
    "AWS_SECRET_ACCESS_KEY / AWS_PROFILE"
)


def _client_defaults(options: Dict[str, Any]) -> Dict[str, Any]:
    """``options`` with our timeouts, pool size and no client-side retries (the user's settings win)."""
    out = dict(options)
    cfg = dict(out.get("config_kwargs") or {})
    cfg.setdefault("connect_timeout", _knobs.S3_CONNECT_TIMEOUT_S)
    cfg.setdefault("read_timeout", _knobs.S3_STALL_TIMEOUT_S)
    cfg.setdefault("max_pool_connections", _knobs.S3_MAX_REQUESTS)
    # One retry loop (ours): botocore's would multiply the attempts.
    cfg.setdefault("retries", {"mode": "standard", "total_max_attempts": 1})
    # botocore's default checksums every PutObject/UploadPart body (CRC32)
    # on the client's single event-loop thread, which serialised all uploads
    # of a process (measured: docs/object-storage.md). Our data files carry
    # CRC-32C per chunk, verified on every load, and the commit checks every
    # object's size, so the transport checksum is only asked where S3 requires it.
    cfg.setdefault("request_checksum_calculation", "when_required")
    cfg.setdefault("response_checksum_validation", "when_required")
    out["config_kwargs"] = cfg
    # A private filesystem instance: we change its retry count below, which
    # must not leak into s3fs instances the caller shares through fsspec's cache.
    out["skip_instance_cache"] = True
    return out


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
    fs, root = resolve(url, full)
    # s3fs retries some errors itself (5 attempts): ours is the one loop.
    fs.retries = 1
    with _FS_LOCK:
        fs = _FS_CACHE.setdefault(key, fs)
    return fs, root


def _data_client(st: "S3Storage") -> S3DataClient:
    """The data-path client of ``st``, chosen once by ``SHARDCKPT_S3_CLIENT`` (read now).

    obstore by default; s3fs's aiobotocore client when asked for, or when
    obstore is not installed and the knob was left unset.

    Raises:
        StorageError: ``SHARDCKPT_S3_CLIENT=obstore`` was set and obstore is not installed.
    """
    if _knobs.S3_CLIENT == "obstore":
        try:
            import_obstore()
        except StorageError:
            if _knobs.S3_CLIENT_EXPLICIT:
                raise
        else:
            return ObstoreData(st)
    return BotocoreData(st)


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
    """``s3://`` through s3fs's client, with parallel multipart writes and parallel ranged reads.

    Args: as :class:`FsspecStorage`; ``storage_options`` are s3fs's
    (``key``, ``secret``, ``token``, ``endpoint_url``, ``client_kwargs``,
    ``config_kwargs``, ``s3_additional_kwargs``...).

    Raises:
        StorageError: s3fs is not installed (with the hint to install it).

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
        self._data = _data_client(self)

    def child(self, rel: str) -> "S3Storage":
        return S3Storage(
            self.url_of(rel),
            storage_options=self.storage_options,
            retries=self.retries,
            fs=self.fs,
            root=self._p(rel),
            _shared=self._shared,
        )

    @property
    def client(self) -> str:
        """The data path's client: ``"obstore"`` or ``"s3fs"`` (``SHARDCKPT_S3_CLIENT``, read when the Storage is made)."""
        return self._data.name

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
                return StorageError(f"{what}: access refused ({code}): {_CRED_HINT}")
            if code in _TRANSIENT_CODES or status >= 500 or status == 429:
                return None
            # S3's own code travels as an attribute: callers branch on it
            # (InvalidRange: a short read; NoSuchUpload: a completed upload).
            return StorageError(f"{what}: {e}", code=code)
        if bex is not None and isinstance(
            e, (bex.NoCredentialsError, bex.PartialCredentialsError, bex.CredentialRetrievalError, bex.UnauthorizedSSOTokenError)
        ):
            return StorageError(f"{what}: no usable credentials ({e}): {_CRED_HINT}")
        if isinstance(e, PermissionError):
            # s3fs turned AccessDenied & co into PermissionError.
            return StorageError(f"{what}: access refused ({e}): {_CRED_HINT}")
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
        await self.fs.set_session()
        return self.fs._s3

    async def _request(self, what: str, method: str, *, nbytes: int = 0, consume=None, **kwargs):
        """One S3 call with the request limit, a deadline and the retry policy.

        ``consume(response)`` (a coroutine function) reads the response body
        inside the same attempt, so that a reset while reading is retried too.
        """
        deadline = _knobs.S3_STALL_TIMEOUT_S + nbytes / _knobs.S3_MIN_BYTES_PER_S
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
                        resp = await fn(**kw)
                        return await consume(resp) if consume is not None else resp

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

    def _submit(self, coro) -> cf.Future:
        return asyncio.run_coroutine_threadsafe(coro, self.fs.loop)

    # -- core overrides: reads planned here, transfers by the data client -----------

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
        got = self._fill(rel, [(start, end)], [(start, memoryview(buf))], allow_short=True)
        return bytes(buf[: got - start]) if got < end else bytes(buf)

    def _read_ranges(self, rel: str, ranges: Sequence[Tuple[int, memoryview]]) -> None:
        fetches = plan_range_fetches([(o, len(b)) for o, b in ranges])
        if fetches:
            self._fill(rel, [(s, e) for s, e, _ in fetches], ranges, allow_short=False)

    def _fill(
        self, rel: str, spans: List[Tuple[int, int]], ranges: Sequence[Tuple[int, memoryview]], *, allow_short: bool
    ) -> int:
        """The one batched read: ``spans`` fetched concurrently into the buffers they cover (:meth:`S3DataClient.fill`)."""
        return self._data.fill(rel, spans, ranges, allow_short=allow_short)

    def _size(self, path: str) -> int:
        return self._data.size(path)

    def _fresh_size(self, path: str) -> int:
        return self._data.head(self._rel_of(path))

    def _list_sizes(self, path: str, name_prefix: str) -> Dict[str, int]:
        # ListObjectsV2 under "<dir>/<name prefix>" with a delimiter: only
        # this directory's keys of that prefix, 1,000 a page, sizes included.
        # On s3fs's client whichever data client is chosen (listing stays
        # s3fs's), through _request (request limit, deadline, retries); no
        # listing cache involved.
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
        self._data.remove(path)

    def _abort_upload(self, rel: str, upload_id: str) -> None:
        """Abort multipart upload ``upload_id`` of ``rel``: its parts are stored (and billed) until then.

        On s3fs's client whichever data client started it (obstore has no
        call for it).
        """
        bucket, key = self._bucket_key(rel)
        self._sync(
            self._request(f"abort upload of {self.url_of(rel)}", "abort_multipart_upload", Bucket=bucket, Key=key, UploadId=upload_id)
        )

    def _forget(self, rel: str) -> None:
        """Drop s3fs's cached listings of ``rel`` and its parents: listing stays s3fs's, and it did not see this change."""
        self.fs.invalidate_cache(self.path(rel))

