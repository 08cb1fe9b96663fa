"""S3Storage's data path on s3fs's aiobotocore client (``SHARDCKPT_S3_CLIENT=s3fs``).

Every request goes through :meth:`S3Storage._request` (the request limit, a
deadline, the retry loop) on s3fs's event-loop thread. Selected explicitly,
or when obstore is not installed and the knob was left unset. Measured
slower than obstore for uploads: that one thread also signs and hashes every
body (docs/object-storage.md).
"""

from __future__ import annotations

import asyncio
import concurrent.futures as cf
import threading
from typing import TYPE_CHECKING, Dict, List, Optional, Sequence, Tuple

from .. import _knobs
from ..errors import StorageError
from ._base import Writer
from ._fsspec import FsspecStorage
from ._s3_data import MAX_PARTS, PartWriter, S3DataClient, data_end, split_pieces

if TYPE_CHECKING:
    from ._s3 import S3Storage

__all__ = ["BotocoreData"]


class BotocoreData(S3DataClient):
    """Transfers through s3fs's aiobotocore client (see :class:`S3DataClient` for each method's contract)."""

    name = "s3fs"

    def put(self, rel: str, data: bytes) -> None:
        bucket, key = self.st._bucket_key(rel)
        self.st._sync(self.st._request(f"write {self.st.url_of(rel)}", "put_object", nbytes=len(data), Bucket=bucket, Key=key, Body=data))

    def open_writer(self, rel: str) -> Writer:
        return _BotocoreWriter(self.st, rel)

    def remove(self, path: str) -> None:
        # s3fs's delete (it also drops s3fs's cached listings of the key).
        FsspecStorage._remove(self.st, path)

    def size(self, path: str) -> int:
        # s3fs's info(): may answer from its listing cache (cheap for ``size``).
        return FsspecStorage._size(self.st, path)

    def head(self, rel: str) -> int:
        bucket, key = self.st._bucket_key(rel)
        resp = self.st._sync(self.st._request(f"stat {self.st.url_of(rel)}", "head_object", Bucket=bucket, Key=key))
        return int(resp["ContentLength"])

    def get(self, rel: str, start: int, end: int) -> bytes:
        return self.st._sync(self._get(rel, start, end))

    def fill(
        self, rel: str, spans: List[Tuple[int, int]], ranges: Sequence[Tuple[int, memoryview]], *, allow_short: bool
    ) -> int:
        return self.st._sync(self._aio_fill(rel, spans, ranges, allow_short=allow_short))

    async def _get(self, rel: str, start: int, end: Optional[int]) -> bytes:
        bucket, key = self.st._bucket_key(rel)
        rng = {} if (start == 0 and end is None) else {"Range": f"bytes={start}-" + ("" if end is None else str(end - 1))}

        async def body(resp):
            async with resp["Body"] as stream:
                return await stream.read()

        what = f"read {self.st.url_of(rel)}" + (f"[{start}:{end}]" if rng else "")
        try:
            return await self.st._request(
                what, "get_object", nbytes=(end - start) if end is not None else 0, consume=body, Bucket=bucket, Key=key, **rng
            )
        except StorageError as e:
            # A range that starts at or past the end of the object: short read.
            if e.code == "InvalidRange":
                return b""
            raise

    async def _get_into(self, rel: str, start: int, end: int, dest: memoryview) -> int:
        """GET bytes ``[start, end)`` straight into ``dest`` (``len(dest) == end - start``); returns the bytes the object had.

        The body is copied from the HTTP client's receive chunks into ``dest``
        as they arrive: no whole-range ``bytes`` is joined and copied again
        (profiled: that was one of three full copies on the load path).
        """
        bucket, key = self.st._bucket_key(rel)

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

        what = f"read {self.st.url_of(rel)}[{start}:{end}]"
        try:
            return await self.st._request(
                what, "get_object", nbytes=end - start, consume=body, Bucket=bucket, Key=key, Range=f"bytes={start}-{end - 1}"
            )
        except StorageError as e:
            # A range that starts at or past the end of the object: nothing there.
            if e.code == "InvalidRange":
                return 0
            raise

    async def _aio_fill(
        self, rel: str, spans: List[Tuple[int, int]], ranges: Sequence[Tuple[int, memoryview]], *, allow_short: bool
    ) -> int:
        pieces = split_pieces(spans, _knobs.S3_READ_PART_BYTES)
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
                        raise self.st._short(rel, off + len(buf))
                    return
            data = memoryview(await self._get(rel, a, b))  # slices of it copy nothing
            got[a] = len(data)
            for off, buf in bufs:
                lo, hi = max(a, off), min(b, off + len(buf), a + len(data))
                if min(b, off + len(buf)) > a + len(data) and lo < min(b, off + len(buf)) and not allow_short:
                    raise self.st._short(rel, off + len(buf))
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
        return data_end(pieces, got)


class _BotocoreWriter(PartWriter):
    """Parallel multipart upload with bounded memory; visible only once ``close()`` completes it."""

    def __init__(self, st: "S3Storage", rel: str):
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
            exc = f.exception() if f.done() else None
            if exc is not None:
                raise exc

    def _send_part(self) -> None:
        self._raise_failed()
        if self.upload_id is None:
            resp = self.st._sync(
                self.st._request(f"start upload of {self.url}", "create_multipart_upload", Bucket=self.bucket, Key=self.key)
            )
            self.upload_id = resp["UploadId"]
        number = len(self.futures) + 1
        if number >= MAX_PARTS:
            raise StorageError(
                f"{self.url}: more than {MAX_PARTS} parts of {self.part_bytes} bytes; raise SHARDCKPT_S3_PART_BYTES"
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
            if e.code != "NoSuchUpload":
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
                self.st._abort_upload(self.rel, self.upload_id)
            except Exception:
                pass
