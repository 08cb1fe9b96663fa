"""S3 and S3-compatible servers (``s3://``): s3fs for listing, our own transfers on obstore or on s3fs's client.

:class:`S3Storage` is an :class:`FsspecStorage` (listing, ``exists`` and
tree deletes stay s3fs's) whose data path (puts, multipart uploads, ranged
gets, HEADs, deletes) is its own, on one of two clients chosen by
``SHARDCKPT_S3_CLIENT`` when the Storage is made: ``obstore`` (the default;
``_obstore.py``) or ``s3fs``, which drives s3fs's aiobotocore client and
event loop as described below. Both keep the same contract (on obstore,
its multipart writer retries parts inside object_store with our attempt
count, and each body arrives as one Rust buffer copied once into the
caller's: ``_obstore.py``):

- writes: parallel multipart uploads. A writer fills one part buffer
  (``S3_PART_BYTES``) and hands full parts to the loop, at most
  ``S3_WRITER_INFLIGHT_PARTS`` in flight per writer, so memory is bounded by
  ``(S3_WRITER_INFLIGHT_PARTS + 1) * S3_PART_BYTES`` per open file and no local
  temp copy is made. A file smaller than one part is one ``PutObject``. An
  object becomes visible only at ``CompleteMultipartUpload``; a failed or
  aborted writer aborts its upload, so a partial object never appears.
- reads: ``read_into`` merges close ranges (``plan_range_fetches``), splits
  them into ``S3_READ_PART_BYTES`` ranged GETs and runs them concurrently;
  each body streams into the caller's buffer as it arrives (no joined copy).
- every request (tunables: ``shardckpt._knobs.S3_*``): at most ``S3_MAX_REQUESTS`` in flight per process and root,
  a deadline (``S3_STALL_TIMEOUT_S`` plus the bytes at ``S3_MIN_BYTES_PER_S``)
  so a stalled transfer fails instead of hanging, and one retry loop (the
  base class's policy: ``DEFAULT_RETRIES`` attempts, jittered exponential
  back-off) for 5xx, SlowDown/throttling, resets and timeouts. botocore's
  and s3fs's own retries are switched off so that attempts do not multiply.
- errors: missing objects are ``FileNotFoundError``; missing or refused
  credentials a ``StorageError`` with a hint (``storage_options`` keys,
  environment variables, endpoint); everything else after the last attempt
  a ``StorageError`` naming the object.

Why two clients: measured against SeaweedFS on loopback (benchmarks/bench_s3.py;
docs/object-storage.md), every aiobotocore path of a process runs on ONE
asyncio thread that also signs and hashes every body, which caps uploads
near 0.4 GB/s; obstore does that work in Rust without the GIL. s3fs stays
selectable (``SHARDCKPT_S3_CLIENT=s3fs``) and serves when obstore is not
installed.
"""

from __future__ import annotations

import abc
import asyncio
import concurrent.futures as cf
import threading
from typing import Any, Dict, List, Optional, Sequence, Tuple

from .. import _knobs
from ..errors import StorageError
from ._base import DEFAULT_RETRIES, Writer, backoff_delay, plan_range_fetches
from ._fsspec import FsspecStorage
from ._obstore import ObstoreClient, StreamingUpload, import_obstore, request_pool
from ._obstore import map_error as map_obstore_error

__all__ = ["S3Storage"]

# Tunables (part sizes, request limit, timeouts) live in shardckpt/_knobs.py
# as S3_*, read at call time.
_MAX_PARTS = 10_000

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

    from ._fsspec import resolve

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


def _obstore_client(st: "S3Storage") -> Optional[ObstoreClient]:
    """The obstore client of ``st``'s bucket, or None when s3fs serves the data path (``SHARDCKPT_S3_CLIENT``)."""
    if _knobs.S3_CLIENT != "obstore":
        return None
    try:
        import_obstore()
    except StorageError:
        if _knobs.S3_CLIENT_EXPLICIT:
            raise
        return None  # the default, without obstore installed: s3fs serves
    bucket = st.root.lstrip("/").partition("/")[0]
    return ObstoreClient(bucket, st.storage_options, retries=st.retries, url=st.url)


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
        retries: int = DEFAULT_RETRIES,
        fs=None,
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
        self._ob = _obstore_client(self)

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
        return "obstore" if self._ob is not None else "s3fs"

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
            return StorageError(f"{what}: {e}")
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

    async def _get(self, rel: str, start: int, end: Optional[int]) -> bytes:
        bucket, key = self._bucket_key(rel)
        rng = {} if (start == 0 and end is None) else {"Range": f"bytes={start}-" + ("" if end is None else str(end - 1))}

        async def body(resp):
            async with resp["Body"] as stream:
                return await stream.read()

        what = f"read {self.url_of(rel)}" + (f"[{start}:{end}]" if rng else "")
        try:
            return await self._request(
                what, "get_object", nbytes=(end - start) if end is not None else 0, consume=body, Bucket=bucket, Key=key, **rng
            )
        except StorageError as e:
            # A range that starts at or past the end of the object: short read.
            if "InvalidRange" in str(e.__cause__ or ""):
                return b""
            raise

    async def _get_into(self, rel: str, start: int, end: int, dest: memoryview) -> int:
        """GET bytes ``[start, end)`` straight into ``dest`` (``len(dest) == end - start``); returns the bytes the object had.

        The body is copied from the HTTP client's receive chunks into ``dest``
        as they arrive: no whole-range ``bytes`` is joined and copied again
        (profiled: that was one of three full copies on the load path).
        """
        bucket, key = self._bucket_key(rel)

        async def body(resp):
            want = int(resp.get("ContentLength", end - start))
            got = 0
            async with resp["Body"] as stream:
                content = getattr(getattr(stream, "raw_stream", None), "content", None)
                if content is None or not hasattr(content, "readany"):
                    # Another HTTP backend (httpx): its own read, one extra copy.
                    data = await stream.read()
                    got = min(len(data), len(dest))
                    dest[:got] = memoryview(data)[:got]
                else:
                    while got < want:
                        chunk = await content.readany()
                        if not chunk:
                            break
                        n = min(len(chunk), len(dest) - got)
                        dest[got : got + n] = chunk[:n] if n < len(chunk) else chunk
                        got += len(chunk)
            if got != want:
                # A body that ended early although the server announced more:
                # a cut connection, retried like a reset.
                raise ConnectionResetError(f"body ended after {got} of {want} bytes")
            return min(got, len(dest))

        what = f"read {self.url_of(rel)}[{start}:{end}]"
        try:
            return await self._request(
                what, "get_object", nbytes=end - start, consume=body, Bucket=bucket, Key=key, Range=f"bytes={start}-{end - 1}"
            )
        except StorageError as e:
            # A range that starts at or past the end of the object: nothing there.
            if "InvalidRange" in str(e.__cause__ or ""):
                return 0
            raise

    # -- core overrides -----------------------------------------------------------

    def _rel_of(self, path: str) -> str:
        root = self.root.rstrip("/")
        if path == root:
            return ""
        return path[len(root) + 1 :] if root and path.startswith(root + "/") else path

    def _read(self, path: str, start: int, end: Optional[int]) -> bytes:
        rel = self._rel_of(path)
        if self._ob is not None:
            return self._ob_read(rel, start, end)
        if end is None or end - start > _knobs.S3_READ_PART_BYTES:
            # Large or open-ended: learn the size (callers pass generous
            # limits) and fetch the pieces in parallel.
            size = self._fresh_size(path)
            end = size if end is None else min(end, size)
            if end - start <= _knobs.S3_READ_PART_BYTES:
                return self._sync(self._get(rel, start, end)) if end > start else b""
            buf = bytearray(end - start)
            got = self._fill(rel, [(start, end)], [(start, memoryview(buf))], allow_short=True)
            return bytes(buf[: got - start]) if got < end else bytes(buf)
        return self._sync(self._get(rel, start, end))

    def _read_ranges(self, rel: str, ranges: Sequence[Tuple[int, memoryview]]) -> None:
        fetches = plan_range_fetches([(o, len(b)) for o, b in ranges])
        if fetches:
            self._fill(rel, [(s, e) for s, e, _ in fetches], ranges, allow_short=False)

    def _fill(
        self, rel: str, spans: List[Tuple[int, int]], ranges: Sequence[Tuple[int, memoryview]], *, allow_short: bool
    ) -> int:
        """The one batched read: ``spans`` fetched concurrently into the buffers they cover, by the chosen client."""
        if self._ob is not None:
            return self._ob_fill(rel, spans, ranges, allow_short=allow_short)
        return self._sync(self._aio_fill(rel, spans, ranges, allow_short=allow_short))

    async def _aio_fill(
        self, rel: str, spans: List[Tuple[int, int]], ranges: Sequence[Tuple[int, memoryview]], *, allow_short: bool
    ) -> int:
        """GET ``spans`` in ``S3_READ_PART_BYTES`` pieces, concurrently, into the buffers they cover.

        Returns the end of the data when ``allow_short`` (the object may end
        first); otherwise a short object raises EOFError.
        """
        pieces = [(a, min(a + _knobs.S3_READ_PART_BYTES, e)) for s, e in spans for a in range(s, e, _knobs.S3_READ_PART_BYTES)]
        bufs = [(o, b if b.format == "B" else b.cast("B")) for o, b in ranges]
        got: Dict[int, int] = {}  # piece start -> bytes it returned

        async def one(a: int, b: int) -> None:
            # The common case: one caller buffer holds the whole piece; the
            # body goes straight into it.
            for off, buf in bufs:
                if off <= a and b <= off + len(buf):
                    n = await self._get_into(rel, a, b, buf[a - off : b - off])
                    got[a] = n
                    if n < b - a and not allow_short:
                        raise self._short(rel, off + len(buf))
                    return
            data = memoryview(await self._get(rel, a, b))  # slices of it copy nothing
            got[a] = len(data)
            for off, buf in bufs:
                lo, hi = max(a, off), min(b, off + len(buf), a + len(data))
                if min(b, off + len(buf)) > a + len(data) and lo < min(b, off + len(buf)) and not allow_short:
                    raise self._short(rel, off + len(buf))
                if lo < hi:
                    buf[lo - off : hi - off] = data[lo - a : hi - a]

        tasks = [asyncio.ensure_future(one(a, b)) for a, b in pieces]
        try:
            await asyncio.gather(*tasks)
        except BaseException:
            for t in tasks:
                t.cancel()
            await asyncio.gather(*tasks, return_exceptions=True)
            raise
        # The data ends at the first piece that came back short.
        for a, b in pieces:
            if a + got[a] < b:
                return a + got[a]
        return pieces[-1][1] if pieces else 0

    def _size(self, path: str) -> int:
        if self._ob is not None:
            return self._fresh_size(path)
        return super()._size(path)

    def _fresh_size(self, path: str) -> int:
        rel = self._rel_of(path)
        bucket, key = self._bucket_key(rel)
        if self._ob is not None:
            return int(self._ob_call(f"stat {self.url_of(rel)}", "head", key)["size"])
        resp = self._sync(self._request(f"stat {self.url_of(rel)}", "head_object", Bucket=bucket, Key=key))
        return int(resp["ContentLength"])

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
        bucket, key = self._bucket_key(rel)
        if self._ob is not None:
            self._ob_call(f"write {self.url_of(rel)}", "put", key, data, use_multipart=False)
            self._forget(rel)
            return
        self._sync(self._request(f"write {self.url_of(rel)}", "put_object", nbytes=len(data), Bucket=bucket, Key=key, Body=data))

    def _open_writer(self, rel: str) -> Writer:
        if self._ob is not None:
            return _ObstoreWriter(self, rel)
        return _S3Writer(self, rel)

    def _remove(self, path: str) -> None:
        if self._ob is None:
            return super()._remove(path)
        rel = self._rel_of(path)
        # S3 answers a DELETE of a missing key with success: nothing to map.
        self._ob_call(f"delete {self.url_of(rel)}", "delete", self._bucket_key(rel)[1])
        self._forget(rel)

    def _forget(self, rel: str) -> None:
        """Drop s3fs's cached listings of ``rel`` and its parents: listing stays s3fs's, and it did not see this change."""
        self.fs.invalidate_cache(self.path(rel))

    # -- obstore data path (SHARDCKPT_S3_CLIENT=obstore; _obstore.py) ----------------

    def _ob_call(self, what: str, fn: str, *args, store: str = "plain", **kwargs):
        """``obstore.<fn>(store, *args, **kwargs)`` inside the base class's retry loop, errors mapped for it."""
        import obstore

        call = getattr(obstore, fn)

        def once():
            try:
                return call(getattr(self._ob, store), *args, **kwargs)
            except Exception as e:
                mapped = map_obstore_error(e, what)
                if mapped is e:
                    raise
                raise mapped from e

        return self._retry(what, once)

    def _ob_get_into(self, rel: str, start: int, end: int, dest: memoryview) -> int:
        """GET ``[start, end)`` into ``dest``; returns the bytes the object had there (fewer at its end)."""
        key = self._bucket_key(rel)[1]
        try:
            data = self._ob_call(f"read {self.url_of(rel)}[{start}:{end}]", "get_range", key, start=start, end=end)
        except EOFError:
            return 0  # the range starts at or past the end of the object
        n = min(len(data), len(dest))
        # One copy, Rust's buffer to the caller's, without the GIL-bound join of a body.
        dest[:n] = memoryview(data).cast("B")[:n]
        return n

    def _ob_read(self, rel: str, start: int, end: Optional[int]) -> bytes:
        if end is None or end - start > _knobs.S3_READ_PART_BYTES:
            end = self._fresh_size(self.path(rel)) if end is None else min(end, self._fresh_size(self.path(rel)))
        if end <= start:
            return b""
        buf = bytearray(end - start)
        got = self._fill(rel, [(start, end)], [(start, memoryview(buf))], allow_short=True)
        return bytes(buf[: got - start]) if got < end else bytes(buf)

    def _ob_fill(
        self, rel: str, spans: List[Tuple[int, int]], ranges: Sequence[Tuple[int, memoryview]], *, allow_short: bool
    ) -> int:
        """:meth:`_fill` on obstore: ``S3_READ_PART_BYTES`` pieces GET concurrently on the request pool."""
        piece = _knobs.S3_READ_PART_BYTES
        pieces = [(a, min(a + piece, e)) for s, e in spans for a in range(s, e, piece)]
        bufs = [(o, b if b.format == "B" else b.cast("B")) for o, b in ranges]

        def one(a: int, b: int) -> int:
            for off, buf in bufs:
                if off <= a and b <= off + len(buf):
                    n = self._ob_get_into(rel, a, b, buf[a - off : b - off])
                    if n < b - a and not allow_short:
                        raise self._short(rel, off + len(buf))
                    return n
            tmp = memoryview(bytearray(b - a))
            n = self._ob_get_into(rel, a, b, tmp)
            for off, buf in bufs:
                lo, hi = max(a, off), min(b, off + len(buf), a + n)
                if min(b, off + len(buf)) > a + n and lo < min(b, off + len(buf)) and not allow_short:
                    raise self._short(rel, off + len(buf))
                if lo < hi:
                    buf[lo - off : hi - off] = tmp[lo - a : hi - a]
            return n

        if len(pieces) == 1:
            got = {pieces[0][0]: one(*pieces[0])}
        else:
            futs = [(a, b, request_pool().submit(one, a, b)) for a, b in pieces]
            got, first = {}, None
            # Every piece ends before this returns or raises: no GET may write
            # into a caller's buffer after the call is over.
            for a, _, f in futs:
                try:
                    got[a] = f.result()
                except BaseException as e:
                    if first is None:
                        first = e
                        for _, _, g in futs:
                            g.cancel()
            if first is not None:
                raise first
        for a, b in pieces:
            if a + got[a] < b:
                return a + got[a]
        return pieces[-1][1] if pieces else 0


class _PartWriter(Writer):
    """Fills one part-sized buffer and hands each full part to ``_send_part`` (both S3 clients' writers)."""

    url: str
    buf: bytearray
    n: int
    closed: bool

    def write(self, data) -> None:
        if self.closed:
            raise StorageError(f"{self.url}: write after close/abort")
        mv = memoryview(data).cast("B")
        while len(mv):
            take = min(len(mv), len(self.buf) - self.n)
            self.buf[self.n : self.n + take] = mv[:take]
            self.n += take
            mv = mv[take:]
            if self.n == len(self.buf):
                self._send_part()

    @abc.abstractmethod
    def _send_part(self) -> None:
        """Upload ``buf[:n]`` as the next part (the buffer may be handed over) and empty it."""


class _S3Writer(_PartWriter):
    """Parallel multipart upload with bounded memory; visible only once ``close()`` completes it."""

    def __init__(self, st: S3Storage, rel: str):
        self.st, self.rel, self.url = st, rel, st.url_of(rel)
        self.bucket, self.key = st._bucket_key(rel)
        self.part_bytes = _knobs.S3_PART_BYTES
        self.buf = bytearray(self.part_bytes)
        self.n = 0
        self.total = 0
        self.upload_id: Optional[str] = None
        self.futures: List[Tuple[int, cf.Future]] = []
        self.slots = threading.BoundedSemaphore(_knobs.S3_WRITER_INFLIGHT_PARTS)
        self.closed = False

    def _raise_failed(self) -> None:
        for _, f in self.futures:
            if f.done() and f.exception() is not None:
                raise f.exception()

    def _send_part(self) -> None:
        self._raise_failed()
        if self.upload_id is None:
            resp = self.st._sync(
                self.st._request(f"start upload of {self.url}", "create_multipart_upload", Bucket=self.bucket, Key=self.key)
            )
            self.upload_id = resp["UploadId"]
        number = len(self.futures) + 1
        if number >= _MAX_PARTS:
            raise StorageError(
                f"{self.url}: more than {_MAX_PARTS} parts of {self.part_bytes} bytes; raise SHARDCKPT_S3_PART_BYTES"
            )
        body = bytes(memoryview(self.buf)[: self.n])
        self.total += self.n
        self.n = 0
        # Blocks while S3_WRITER_INFLIGHT_PARTS parts are in flight: bounded memory.
        self.slots.acquire()
        fut = self.st._submit(
            self.st._request(
                f"upload part {number} of {self.url}",
                "upload_part",
                nbytes=len(body),
                Bucket=self.bucket,
                Key=self.key,
                UploadId=self.upload_id,
                PartNumber=number,
                Body=body,
            )
        )
        fut.add_done_callback(lambda _f: self.slots.release())
        self.futures.append((number, fut))

    def close(self) -> None:
        if self.closed:
            return
        try:
            if self.upload_id is None:
                # Small file: one PutObject, atomic by itself.
                body = bytes(memoryview(self.buf)[: self.n])
                self.st._sync(
                    self.st._request(
                        f"write {self.url}", "put_object", nbytes=len(body), Bucket=self.bucket, Key=self.key, Body=body
                    )
                )
            else:
                if self.n:
                    self._send_part()
                parts = [{"PartNumber": num, "ETag": f.result()["ETag"]} for num, f in self.futures]
                self.st._sync(self._complete(parts))
        except BaseException:
            self.abort()
            raise
        self.closed = True
        self.buf = bytearray()

    async def _complete(self, parts) -> None:
        try:
            await self.st._request(
                f"complete upload of {self.url}",
                "complete_multipart_upload",
                Bucket=self.bucket,
                Key=self.key,
                UploadId=self.upload_id,
                MultipartUpload={"Parts": parts},
            )
        except StorageError as e:
            # A retried complete whose first try succeeded (answer lost):
            # the upload is gone and the object is whole.
            if "NoSuchUpload" not in str(e.__cause__ or e):
                raise
            resp = await self.st._request(f"stat {self.url}", "head_object", Bucket=self.bucket, Key=self.key)
            if int(resp["ContentLength"]) != self.total:
                raise

    def abort(self) -> None:
        if self.closed:
            return
        self.closed = True
        self.buf = bytearray()
        for _, f in self.futures:
            f.cancel()
        for _, f in self.futures:
            try:
                f.result()
            except BaseException:
                pass
        if self.upload_id is not None:
            # The parts are stored (and billed) until the upload is aborted.
            try:
                self.st._sync(
                    self.st._request(
                        f"abort upload of {self.url}",
                        "abort_multipart_upload",
                        Bucket=self.bucket,
                        Key=self.key,
                        UploadId=self.upload_id,
                    )
                )
            except Exception:
                pass


class _ObstoreWriter(_PartWriter):
    """Bounded-memory upload on obstore: one PUT below a part, else a multipart upload fed part by part.

    Memory: the part being filled, one part handed over, and at most
    ``S3_WRITER_INFLIGHT_PARTS`` in obstore's hands. The object appears only
    when ``close()`` completes the upload; ``abort()`` (or a failure) cancels
    it and aborts any multipart upload left behind under the key.
    """

    def __init__(self, st: S3Storage, rel: str):
        self.st, self.rel, self.url = st, rel, st.url_of(rel)
        self.bucket, self.key = st._bucket_key(rel)
        self.buf = bytearray(_knobs.S3_PART_BYTES)
        self.n = 0
        self.upload: Optional[StreamingUpload] = None
        self.closed = False

    def _send_part(self) -> None:
        if self.upload is None:
            self.upload = StreamingUpload(
                self.st._ob.streaming, self.key, part_bytes=len(self.buf), inflight=_knobs.S3_WRITER_INFLIGHT_PARTS
            )
        # The filled buffer itself goes to obstore (no copy); this writer
        # never touches it again and fills a fresh one.
        part = self.buf if self.n == len(self.buf) else memoryview(self.buf)[: self.n]
        self.buf = bytearray(len(self.buf))
        self.n = 0
        try:
            self.upload.send(part)
        except Exception as e:
            raise self._failed(e) from e

    def _failed(self, e: BaseException) -> BaseException:
        mapped = map_obstore_error(e, f"upload of {self.url}")
        if isinstance(mapped, (StorageError, FileNotFoundError)):
            return mapped
        # object_store already retried each part (our attempt count): say so.
        return StorageError(f"upload of {self.url} failed after {self.st.retries} attempts: {type(mapped).__name__}: {mapped}")

    def close(self) -> None:
        if self.closed:
            return
        try:
            if self.upload is None:
                # Small file: one PUT, atomic by itself.
                self.st._ob_call(f"write {self.url}", "put", self.key, bytes(memoryview(self.buf)[: self.n]), use_multipart=False)
                self.st._forget(self.rel)
            else:
                if self.n:
                    self._send_part()
                try:
                    self.upload.finish()
                except Exception as e:
                    raise self._failed(e) from e
                self.st._forget(self.rel)
        except BaseException:
            self.abort()
            raise
        self.closed = True
        self.buf = bytearray()

    def abort(self) -> None:
        if self.closed:
            return
        self.closed = True
        self.buf = bytearray()
        if self.upload is None:
            return
        self.upload.cancel()
        # obstore aborts a failed upload itself, but that request can fail
        # too (a reset, a server still busy with a part): make sure no
        # parts stay stored (and billed) under this key.
        try:
            ups = self.st._sync(
                self.st._request(f"list uploads of {self.url}", "list_multipart_uploads", Bucket=self.bucket, Prefix=self.key)
            )
            for up in ups.get("Uploads") or []:
                if up.get("Key") == self.key:
                    self.st._sync(
                        self.st._request(
                            f"abort upload of {self.url}",
                            "abort_multipart_upload",
                            Bucket=self.bucket,
                            Key=self.key,
                            UploadId=up["UploadId"],
                        )
                    )
        except Exception:
            pass
