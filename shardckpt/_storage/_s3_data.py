"""The interface of S3Storage's data path, which each S3 client implements in its own module.

:class:`~shardckpt._storage._s3.S3Storage` keeps listing, ``exists`` and
tree deletes on s3fs, and hands every transfer (puts, multipart uploads,
ranged gets, HEADs, deletes) to one :class:`S3DataClient`, chosen once when
the Storage is made (``SHARDCKPT_S3_CLIENT``, read then):

- :class:`~shardckpt._storage._s3_botocore.BotocoreData` (``s3fs``): s3fs's
  aiobotocore client on its event-loop thread;
- :class:`~shardckpt._storage._obstore.ObstoreData` (``obstore``, the
  default): Rust object_store, off the GIL.

Both keep the same contract (docs/storage.md, "S3"): a writer's object
appears only when ``close()`` completes it; a short object raises
``EOFError`` from ``fill`` unless ``allow_short``; missing objects are
``FileNotFoundError``; everything else after the last attempt a
``StorageError``. The storage logic never asks which client it holds.
"""

from __future__ import annotations

import abc
from typing import TYPE_CHECKING, Dict, List, Sequence, Tuple

from ..errors import StorageError
from ._base import Writer

if TYPE_CHECKING:  # the clients are made by S3Storage and call back into it
    from ._s3 import S3Storage

__all__ = ["MAX_PARTS", "PartWriter", "S3DataClient", "data_end", "split_pieces"]

#: S3's limit on the parts of one multipart upload.
MAX_PARTS = 10_000


class S3DataClient(abc.ABC):
    """One S3 client's transfers for one :class:`S3Storage` root.

    Args:
        st: the storage it serves (paths, retries, the s3fs metadata client).

    Example: ``st._data.head("manifest.json")`` is the object's size (a HEAD).

    Limits: one instance per Storage object; children share nothing but
    what the client itself caches per process.
    """

    #: ``SHARDCKPT_S3_CLIENT``'s value that selects this client.
    name: str

    def __init__(self, st: "S3Storage") -> None:
        self.st = st

    @abc.abstractmethod
    def put(self, rel: str, data: bytes) -> None:
        """Publish ``data`` at ``rel`` with one PutObject (atomic by itself)."""

    @abc.abstractmethod
    def open_writer(self, rel: str) -> Writer:
        """A bounded-memory writer of ``rel`` (one PUT below a part, else a multipart upload)."""

    @abc.abstractmethod
    def remove(self, path: str) -> None:
        """Delete the object at the backend path ``path`` (missing: a no-op or ``FileNotFoundError``)."""

    @abc.abstractmethod
    def size(self, path: str) -> int:
        """The size of ``path``; may come from s3fs's listing cache (``head`` never does)."""

    @abc.abstractmethod
    def head(self, rel: str) -> int:
        """The size of ``rel`` asked of the server (one HEAD, no cache)."""

    @abc.abstractmethod
    def get(self, rel: str, start: int, end: int) -> bytes:
        """Bytes ``[start, end)`` of ``rel`` in one request; fewer at the end of the object, ``b""`` past it."""

    @abc.abstractmethod
    def fill(
        self, rel: str, spans: List[Tuple[int, int]], ranges: Sequence[Tuple[int, memoryview]], *, allow_short: bool
    ) -> int:
        """GET ``spans`` in ``S3_READ_PART_BYTES`` pieces, concurrently, into the buffers of ``ranges`` they cover.

        Returns the end of the data (``allow_short``: the object may end
        first); otherwise a short object raises ``EOFError`` (``st._short``).
        Every piece has ended when this returns or raises: no GET writes into
        a caller's buffer afterwards.
        """


class PartWriter(Writer):
    """Fills one part-sized buffer and hands each full part to ``_send_part`` (both clients' writers)."""

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
