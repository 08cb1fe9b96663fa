"""The data path of ``s3://`` on obstore (Rust ``object_store``): puts, multipart uploads, ranged gets, HEADs, deletes.

:class:`ObstoreData` moves the bytes of one
:class:`~shardckpt._storage._s3.S3Storage` root; listing and ``exists``
stay s3fs's there. This module knows nothing of that class: what it needs
from its storage (paths, the retry loop, forgetting cached listings,
aborting leftover uploads) is the :class:`S3Host` protocol below, so the
dependency runs one way (``_s3`` -> ``_obstore`` -> ``_base``). Single
requests run inside the storage's retry loop (``Storage._retry``), so what
is transient, how often and how long to wait is decided in one place.

Why obstore: its requests run on Rust threads that do not hold the GIL
(signing, hashing, socket I/O), where every aiobotocore path of a process
shares ONE asyncio thread; measured against the same server, an
aiobotocore data path saved at less than half its speed (the numbers, and
the measurement that removed that second client: docs/object-storage.md).

Retries: the stores used by our loop have object_store's own retries off
(``max_retries=0``). obstore exposes no part-level multipart API, so the
parts of a streamed upload cannot be retried from Python: that one store
retries in object_store instead, with our attempt count and back-off
ceilings (``STORAGE_RETRIES - 1`` retries), and is never wrapped in our
loop. Either way an operation gets ``STORAGE_RETRIES`` attempts, never more.

Deadlines: each request has a connect timeout (``S3_CONNECT_TIMEOUT_S``), a
read timeout (``S3_STALL_TIMEOUT_S`` without a byte: a stall) and an overall
timeout of ``S3_STALL_TIMEOUT_S`` plus the largest request's bytes at
``S3_MIN_BYTES_PER_S`` (no request moves more than one part or read piece).

Limits: credentials come from ``storage_options`` (``key``/``secret``/
``token``, ``anon``) or, when absent, from botocore's resolver (environment,
``AWS_PROFILE`` and config files, SSO, container and instance metadata),
refreshed through obstore's credential provider.
"""

from __future__ import annotations

import datetime as _dt
import os
import queue
import threading
from concurrent.futures import ThreadPoolExecutor
from typing import Any, Callable, Dict, List, Optional, Protocol, Sequence, Tuple, TypeVar

from .. import _knobs
from ..errors import StorageError
from ._base import Writer

__all__ = [
    "CRED_HINT",
    "ObstoreClient",
    "ObstoreData",
    "S3Host",
    "data_end",
    "import_obstore",
    "map_error",
    "request_pool",
    "split_pieces",
]

_T = TypeVar("_T")

#: Seconds a blocked writer waits between checks that its upload thread is still alive.
_HANDOFF_POLL_S = 0.5

#: How to fix missing or refused credentials (every S3 error about them says it).
CRED_HINT = (
    "check the S3 credentials and endpoint: pass storage_options={'key': ..., 'secret': ..., "
    "'endpoint_url': ...} (or 'anon': True for a public bucket), or set AWS_ACCESS_KEY_ID / "
    "AWS_SECRET_ACCESS_KEY / AWS_PROFILE"
)
_AUTH_MARKERS = ("AccessDenied", "InvalidAccessKeyId", "SignatureDoesNotMatch", "ExpiredToken", "InvalidToken", "403 Forbidden", "401 Unauthorized")
_TIMEOUT_MARKERS = ("timed out", "timeout", "Timeout")


def import_obstore():
    """The ``obstore`` module, or our StorageError saying how to get it."""
    try:
        import obstore
    except ImportError:
        raise StorageError(
            "s3:// needs obstore, which moves its bytes: pip install obstore (or 'shardckpt[s3]')"
        ) from None
    return obstore


def map_error(e: BaseException, what: str) -> BaseException:
    """obstore's exception for ``what`` as the error our retry loop classifies.

    Missing objects stay ``FileNotFoundError`` (obstore's ``NotFoundError`` is
    one); refused credentials become ``StorageError`` with the hint; an
    unsatisfiable range is ``EOFError`` (the caller's short read); timeouts
    are ``TimeoutError`` ("stalled transfer") and the rest ``ConnectionError``,
    both transient; anything that is not obstore's is returned as is.
    """
    import obstore.exceptions as oe

    # obstore's exceptions carry no status or S3 error code (obstore 0.12:
    # only the message; its GenericError covers 5xx, 416 and auth alike), so
    # this one function reads the text; everything downstream branches on
    # the type it returns (EOFError, StorageError, TimeoutError...).
    if not isinstance(e, oe.BaseError) or isinstance(e, FileNotFoundError):
        if isinstance(e, FileNotFoundError):
            text = str(e)
            if "NoSuchBucket" in text:
                return StorageError(f"{what}: the bucket does not exist; create it or fix the URL")
            return FileNotFoundError(f"{what}: no such object")
        return e
    text = str(e)
    if isinstance(e, (oe.PermissionDeniedError, oe.UnauthenticatedError)) or any(m in text for m in _AUTH_MARKERS):
        return StorageError(f"{what}: access refused: {CRED_HINT}")
    if "InvalidRange" in text or "416 Range Not Satisfiable" in text or "wanted range starting" in text.lower():
        return EOFError(f"{what}: range starts past the end of the object")
    if "NoSuchBucket" in text:
        return StorageError(f"{what}: the bucket does not exist; create it or fix the URL")
    if isinstance(e, (oe.InvalidPathError, oe.NotSupportedError, oe.UnknownConfigurationKeyError)):
        return StorageError(f"{what}: {_first_line(text)}")
    if any(m in text for m in _TIMEOUT_MARKERS):
        return TimeoutError(f"no answer within the deadline (stalled transfer): {_first_line(text)}")
    # 5xx, SlowDown, resets, truncated bodies, refused connections.
    return ConnectionError(_first_line(text))


def _first_line(text: str) -> str:
    return text.split("\n", 1)[0][:500]


def _seconds(x: float) -> str:
    return f"{max(x, 0.001):.3f}s"


def _endpoint(options: Dict[str, Any]) -> Optional[str]:
    ck = options.get("client_kwargs") or {}
    return options.get("endpoint_url") or ck.get("endpoint_url")


def _region(options: Dict[str, Any]) -> Optional[str]:
    ck = options.get("client_kwargs") or {}
    cfg = options.get("config_kwargs") or {}
    return ck.get("region_name") or options.get("region_name") or options.get("region") or cfg.get("region_name")


def _credentials(options: Dict[str, Any], what: str) -> Tuple[Dict[str, Any], Any]:
    """``(config entries, credential provider or None)`` for ``options``.

    Explicit keys win; ``anon`` signs nothing; otherwise botocore resolves
    them as s3fs would (object_store alone reads no profile files), and a
    refreshing provider hands them to obstore.
    """
    if options.get("anon"):
        return {"skip_signature": True}, None
    key = options.get("key") or options.get("aws_access_key_id")
    secret = options.get("secret") or options.get("aws_secret_access_key")
    token = options.get("token") or options.get("aws_session_token")
    if key and secret:
        cfg = {"access_key_id": key, "secret_access_key": secret}
        if token:
            cfg["session_token"] = token
        return cfg, None
    try:
        import botocore.session

        session = botocore.session.Session(profile=options.get("profile"))
        creds = session.get_credentials()
    except Exception as e:
        raise StorageError(f"{what}: no usable credentials ({type(e).__name__}: {e}): {CRED_HINT}") from None
    if creds is None:
        raise StorageError(f"{what}: no usable credentials (none in storage_options, the environment or AWS config): {CRED_HINT}")

    def provide() -> Dict[str, Any]:
        frozen = creds.get_frozen_credentials()
        expiry = getattr(creds, "_expiry_time", None)
        if expiry is None:
            # Static credentials: ask again now and then (cheap) rather than never.
            expiry = _dt.datetime.now(_dt.timezone.utc) + _dt.timedelta(minutes=10)
        return {
            "access_key_id": frozen.access_key,
            "secret_access_key": frozen.secret_key,
            "token": frozen.token,
            "expires_at": expiry,
        }

    return {}, provide


def _build(bucket: str, options: Dict[str, Any], *, retries: int, what: str):
    import_obstore()
    from obstore.store import S3Store

    config: Dict[str, Any] = {}
    endpoint = _endpoint(options)
    if endpoint:
        config["endpoint"] = endpoint
    config["region"] = _region(options) or os.environ.get("AWS_REGION") or os.environ.get("AWS_DEFAULT_REGION") or "us-east-1"
    cred_cfg, provider = _credentials(options, what)
    config.update(cred_cfg)
    biggest = max(_knobs.S3_PART_BYTES, _knobs.S3_READ_PART_BYTES)
    client = {
        "connect_timeout": _seconds(_knobs.S3_CONNECT_TIMEOUT_S),
        "read_timeout": _seconds(_knobs.S3_STALL_TIMEOUT_S),
        "timeout": _seconds(_knobs.S3_STALL_TIMEOUT_S + biggest / _knobs.S3_MIN_BYTES_PER_S),
        "pool_max_idle_per_host": str(_knobs.S3_MAX_REQUESTS),
        # Loopback and private servers speak plain HTTP.
        "allow_http": bool(endpoint and endpoint.startswith("http://")),
    }
    retry = {
        "max_retries": retries,
        "backoff": {
            "init_backoff": _dt.timedelta(seconds=_knobs.RETRY_BASE_DELAY_S),
            "max_backoff": _dt.timedelta(seconds=_knobs.RETRY_MAX_DELAY_S),
            "base": 2,
        },
        # Bounded by the attempt count, not by a clock.
        "retry_timeout": _dt.timedelta(days=1),
    }
    kw: Dict[str, Any] = {"config": config, "client_options": client, "retry_config": retry}
    if provider is not None:
        kw["credential_provider"] = provider
    try:
        return S3Store(bucket, **kw)
    except Exception as e:
        raise StorageError(f"{what}: cannot configure obstore's S3 client: {_first_line(str(e))}") from None


_STORES: Dict[Tuple, Any] = {}
_STORES_LOCK = threading.Lock()
_POOLS: Dict[Tuple[int, int], ThreadPoolExecutor] = {}


def request_pool() -> ThreadPoolExecutor:
    """The process's pool for concurrent obstore calls (``S3_MAX_REQUESTS`` threads, blocked in Rust without the GIL)."""
    key = (os.getpid(), _knobs.S3_MAX_REQUESTS)
    with _STORES_LOCK:
        pool = _POOLS.get(key)
        if pool is None:
            pool = _POOLS[key] = ThreadPoolExecutor(max_workers=_knobs.S3_MAX_REQUESTS, thread_name_prefix="shardckpt-s3")
        return pool


class ObstoreClient:
    """obstore stores for one bucket and set of ``storage_options``, built on first use and shared per process.

    ``plain`` (no retries: our loop retries) serves single requests;
    ``streaming`` (object_store retries, our count) serves multipart uploads.

    Example: ``ObstoreClient("bucket", {"endpoint_url": "http://127.0.0.1:8333", "key": "k", "secret": "s"}).plain``.
    """

    def __init__(self, bucket: str, options: Dict[str, Any], *, retries: int, url: str):
        self.bucket, self.options, self.retries, self.url = bucket, dict(options), retries, url

    def _store(self, retries: int):
        from fsspec.utils import tokenize

        knobs = (
            _knobs.S3_PART_BYTES,
            _knobs.S3_READ_PART_BYTES,
            _knobs.S3_MAX_REQUESTS,
            _knobs.S3_CONNECT_TIMEOUT_S,
            _knobs.S3_STALL_TIMEOUT_S,
            _knobs.S3_MIN_BYTES_PER_S,
            _knobs.RETRY_BASE_DELAY_S,
            _knobs.RETRY_MAX_DELAY_S,
        )
        key = (os.getpid(), self.bucket, tokenize(self.options), knobs, retries)
        with _STORES_LOCK:
            store = _STORES.get(key)
        if store is None:
            store = _build(self.bucket, self.options, retries=retries, what=self.url)
            with _STORES_LOCK:
                store = _STORES.setdefault(key, store)
        return store

    @property
    def plain(self):
        return self._store(0)

    @property
    def streaming(self):
        return self._store(max(self.retries - 1, 0))


class StreamingUpload:
    """One multipart upload fed part by part from the writer's thread, uploaded by obstore on another.

    ``send(part)`` blocks while one part waits for the uploader (obstore
    itself holds at most ``S3_WRITER_INFLIGHT_PARTS`` parts in flight), so
    memory stays bounded. ``finish()`` completes the upload; ``cancel()``
    makes obstore fail it (and abort it).
    """

    _END = object()
    _CANCEL = object()

    def __init__(self, store, key: str, *, part_bytes: int, inflight: int):
        self.q: "queue.Queue[Any]" = queue.Queue(maxsize=1)
        self.error: Optional[BaseException] = None
        self.done = threading.Event()
        self.thread = threading.Thread(
            target=self._run, args=(store, key, part_bytes, inflight), name="shardckpt-s3-upload", daemon=True
        )
        self.thread.start()

    def _parts(self):
        while True:
            item = self.q.get()
            if item is self._END:
                return
            if item is self._CANCEL:
                raise RuntimeError("upload cancelled by the writer")
            yield item

    def _run(self, store, key: str, part_bytes: int, inflight: int) -> None:
        import obstore

        try:
            obstore.put(store, key, self._parts(), use_multipart=True, chunk_size=part_bytes, max_concurrency=inflight)
        except BaseException as e:
            self.error = e
        finally:
            self.done.set()
            # Unblock a sender waiting on a full queue after a failure.
            try:
                while True:
                    self.q.get_nowait()
            except queue.Empty:
                pass

    def send(self, item) -> None:
        """Hand one part (or a control marker) to the uploader; raises its error if it already failed."""
        while True:
            if self.done.is_set():
                if self.error is not None:
                    raise self.error
                if item is self._CANCEL:
                    return
                raise RuntimeError("the upload ended before all parts were sent")
            try:
                self.q.put(item, timeout=_HANDOFF_POLL_S)
                return
            except queue.Full:
                continue

    def finish(self) -> None:
        self.send(self._END)
        self.done.wait()
        self.thread.join()
        if self.error is not None:
            raise self.error

    def cancel(self) -> None:
        try:
            self.send(self._CANCEL)
        except BaseException:
            pass
        self.done.wait()
        self.thread.join()


class S3Host(Protocol):
    """What :class:`ObstoreData` needs from the storage it serves (:class:`~shardckpt._storage._s3.S3Storage` has it).

    Declared here, on the lower side, so that this module never imports the
    storage class: paths and messages, the retry loop, the short-read error,
    and two things only s3fs's side can do (drop its cached listings of a
    key; list and abort a key's leftover multipart uploads, which obstore
    has no call for).
    """

    url: str
    root: str
    retries: int
    storage_options: Dict[str, Any]

    def url_of(self, rel: str) -> str: ...

    def _bucket_key(self, rel: str) -> Tuple[str, str]: ...

    def _retry(self, what: str, fn: Callable[..., _T], *args: Any, **kwargs: Any) -> _T: ...

    def _short(self, rel: str, end: int) -> EOFError: ...

    def _forget(self, rel: str) -> None: ...

    def _abort_uploads(self, rel: str) -> None: ...


def split_pieces(spans: List[Tuple[int, int]], piece: int) -> List[Tuple[int, int]]:
    """``spans`` cut into ranged GETs of at most ``piece`` bytes (``S3_READ_PART_BYTES``).

    Example: ``split_pieces([(0, 10)], 4)`` is ``[(0, 4), (4, 8), (8, 10)]``.
    """
    return [(a, min(a + piece, e)) for s, e in spans for a in range(s, e, piece)]


def data_end(pieces: List[Tuple[int, int]], got: Dict[int, int]) -> int:
    """Where the object's data ends after ``pieces`` were fetched (``got``: piece start -> bytes it returned).

    The first piece that came back short ends it.
    """
    for a, b in pieces:
        if a + got[a] < b:
            return a + got[a]
    return pieces[-1][1] if pieces else 0


class ObstoreData:
    """The transfers of one ``s3://`` root through obstore.

    Single requests run in the host's retry loop (:meth:`call`); ``fill``
    runs its pieces on :func:`request_pool`; uploads stream through
    :class:`StreamingUpload`. Every change drops s3fs's cached listings of
    the key (listing stays s3fs's, and it did not see the change). Paths
    are relative to the host's root.

    Args:
        host: the storage served (:class:`S3Host`).

    Raises:
        StorageError: obstore is not installed (with the install hint).

    Example: ``ObstoreData(st).head("manifest.json")`` is the object's size (one HEAD).

    Limits: one instance per Storage object; stores are shared per process,
    bucket and options (:class:`ObstoreClient`).
    """

    def __init__(self, host: S3Host) -> None:
        import_obstore()
        self.st = host
        bucket = host.root.lstrip("/").partition("/")[0]
        self.client = ObstoreClient(bucket, host.storage_options, retries=host.retries, url=host.url)

    def _key(self, rel: str) -> str:
        return self.st._bucket_key(rel)[1]

    def call(self, what: str, fn: str, *args: Any, store: str = "plain", **kwargs: Any) -> Any:
        """``obstore.<fn>(store, *args, **kwargs)`` inside the storage's retry loop, errors mapped for it."""
        import obstore

        call = getattr(obstore, fn)

        def once():
            try:
                return call(getattr(self.client, store), *args, **kwargs)
            except Exception as e:
                mapped = map_error(e, what)
                if mapped is e:
                    raise
                raise mapped from e

        return self.st._retry(what, once)

    def put(self, rel: str, data: bytes) -> None:
        """Publish ``data`` at ``rel`` with one PUT (atomic by itself)."""
        self.call(f"write {self.st.url_of(rel)}", "put", self._key(rel), data, use_multipart=False)
        self.st._forget(rel)

    def open_writer(self, rel: str) -> Writer:
        """A bounded-memory writer of ``rel`` (one PUT below a part, else a multipart upload)."""
        return _ObstoreWriter(self, rel)

    def remove(self, rel: str) -> None:
        """Delete ``rel``; S3 answers a DELETE of a missing key with success, so missing is a no-op."""
        self.call(f"delete {self.st.url_of(rel)}", "delete", self._key(rel))
        self.st._forget(rel)

    def head(self, rel: str) -> int:
        """The size of ``rel`` asked of the server (one HEAD, no cache)."""
        return int(self.call(f"stat {self.st.url_of(rel)}", "head", self._key(rel))["size"])

    def get(self, rel: str, start: int, end: int) -> bytes:
        """Bytes ``[start, end)`` of ``rel`` in one request; fewer at the end of the object, ``b""`` past it."""
        buf = bytearray(end - start)
        n = self._get_into(rel, start, end, memoryview(buf))
        return bytes(buf[:n]) if n < len(buf) else bytes(buf)

    def _get_into(self, rel: str, start: int, end: int, dest: memoryview) -> int:
        """GET ``[start, end)`` into ``dest``; returns the bytes the object had there (fewer at its end)."""
        try:
            data = self.call(f"read {self.st.url_of(rel)}[{start}:{end}]", "get_range", self._key(rel), start=start, end=end)
        except EOFError:
            return 0  # the range starts at or past the end of the object
        n = min(len(data), len(dest))
        # One copy, Rust's buffer to the caller's, without the GIL-bound join of a body.
        dest[:n] = memoryview(data).cast("B")[:n]
        return n

    def fill(
        self, rel: str, spans: List[Tuple[int, int]], ranges: Sequence[Tuple[int, memoryview]], *, allow_short: bool
    ) -> int:
        """GET ``spans`` in ``S3_READ_PART_BYTES`` pieces, concurrently, into the buffers of ``ranges`` (``(offset, memoryview)``) they cover.

        Returns the end of the data (``allow_short``: the object may end
        first); otherwise a short object raises ``EOFError`` (the host's
        ``_short``). Every piece has ended when this returns or raises: no
        GET writes into a caller's buffer afterwards.
        """
        pieces = split_pieces(spans, _knobs.S3_READ_PART_BYTES)
        bufs = [(o, b if b.format == "B" else b.cast("B")) for o, b in ranges]

        def one(a: int, b: int) -> int:
            for off, buf in bufs:
                if off <= a and b <= off + len(buf):
                    n = self._get_into(rel, a, b, buf[a - off : b - off])
                    if n < b - a and not allow_short:
                        raise self.st._short(rel, off + len(buf))
                    return n
            tmp = memoryview(bytearray(b - a))
            n = self._get_into(rel, a, b, tmp)
            for off, buf in bufs:
                lo, hi = max(a, off), min(b, off + len(buf), a + n)
                if min(b, off + len(buf)) > a + n and lo < min(b, off + len(buf)) and not allow_short:
                    raise self.st._short(rel, off + len(buf))
                if lo < hi:
                    buf[lo - off : hi - off] = tmp[lo - a : hi - a]
            return n

        got: Dict[int, int] = {}
        if len(pieces) == 1:
            got[pieces[0][0]] = one(*pieces[0])
        else:
            futs = [(a, b, request_pool().submit(one, a, b)) for a, b in pieces]
            first: Optional[BaseException] = None
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
        return data_end(pieces, got)


class _ObstoreWriter(Writer):
    """Bounded-memory upload on obstore: one PUT below a part, else a multipart upload fed part by part.

    Memory: the part being filled, one part handed over, and at most
    ``S3_WRITER_INFLIGHT_PARTS`` in obstore's hands. The object appears only
    when ``close()`` completes the upload; ``abort()`` (or a failure) cancels
    it and aborts any multipart upload left behind under the key.
    """

    def __init__(self, data: ObstoreData, rel: str):
        self.data, self.st, self.rel = data, data.st, rel
        self.url = self.st.url_of(rel)
        self.key = data._key(rel)
        self.buf = bytearray(_knobs.S3_PART_BYTES)
        self.n = 0
        self.upload: Optional[StreamingUpload] = None
        self.closed = False

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

    def _send_part(self) -> None:
        if self.upload is None:
            self.upload = StreamingUpload(
                self.data.client.streaming, self.key, part_bytes=len(self.buf), inflight=_knobs.S3_WRITER_INFLIGHT_PARTS
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
        mapped = map_error(e, f"upload of {self.url}")
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
                self.data.put(self.rel, bytes(memoryview(self.buf)[: self.n]))
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
            self.st._abort_uploads(self.rel)
        except Exception:
            pass
