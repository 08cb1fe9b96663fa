"""The async save's writer process: data-file bytes and block CRCs written out of the training process's GIL.

With ``SHARDCKPT_ASYNC_WRITER=process``, ``async_save`` stages into an
*arena*: one anonymous shared-memory file (``memfd``) mapped in this process
and in a persistent writer child. The child runs the one checksummed writer
(``_io.write_files``) over views of the arena and sends back the chunk
metadata (CRCs included); everything else of the save (planning, index file,
agreement between ranks, the manifest commit) stays in the training process,
so the bytes on disk are the thread writer's bytes.

Why a process: format v2 takes one CRC-32C per 1 MiB block. CRC and writes
release the GIL, but the writer thread takes it back once per block, and a
training loop made of many small torch ops pays for that convoy
(docs/performance.md, GIL section).

The child:
  * is started lazily (``subprocess`` running this module: never a fork of
    a process that may hold CUDA state, and the user's ``__main__`` is not
    re-imported, unlike multiprocessing's spawn/forkserver);
  * is reused across saves; ``release_buffers()`` and interpreter exit stop
    it; it exits by itself when this process goes (its end of the socket
    closes) and ignores SIGINT (a Ctrl-C is the parent's to handle);
  * dying mid-save fails that save with ``SaveFailedError`` naming it (no
    hang: its socket closes), and the next save starts a new one.

Why memfd rather than ``/dev/shm`` files or ``share_memory_()`` per tensor:
one mapping per arena (one ``cudaHostRegister`` for CUDA staging, one file
descriptor passed once per child), and nothing with a name that a crash could
leave behind in ``/dev/shm``.
"""

from __future__ import annotations

import atexit
import logging
import os
import pickle
import signal
import socket
import subprocess
import sys
import threading
import traceback
from multiprocessing.connection import Connection
from multiprocessing.reduction import recv_handle, send_handle
from typing import Any, Dict, Optional, Sequence, Tuple, cast

import torch

from ._format import itemsize
from ._io import WriteItem, write_files
from ._storage import Storage, rebuildable
from .errors import SaveFailedError

__all__ = ["Arena", "ProcessWriter", "usable_for", "get_writer", "current_writer", "shutdown", "ARENA_ALIGN", "CHILD_START_TIMEOUT_S"]

log = logging.getLogger("shardckpt")

#: Staged tensors start at multiples of this in the arena (cache line; every dtype's size divides it).
ARENA_ALIGN = 64

#: A writer child that has not said hello within this many seconds (it imports torch) failed to start.
CHILD_START_TIMEOUT_S = 300.0

#: How often a wait for the child checks that it is still alive (the closed socket usually tells first).
_POLL_S = 1.0

#: How long a child whose socket closed may take to exit before it is killed.
_EXIT_WAIT_S = 10.0

#: The environment variable that gives the child its socket's file descriptor.
_FD_ENV = "SHARDCKPT_WRITER_FD"

#: fsspec protocols whose files live in this process only: a child cannot write them.
_IN_PROCESS_PROTOCOLS = ("memory",)


# --------------------------------------------------------------------------
# shared memory


class Arena:
    """One anonymous shared-memory region: staged tensors are views of ``tensor``.

    ``fd`` stays open while the arena lives: it is what a (new) writer child
    receives to map the same pages.
    """

    _next_gen = 0

    def __init__(self, nbytes: int):
        self.nbytes = max(int(nbytes), ARENA_ALIGN)
        self.fd = os.memfd_create("shardckpt-staging", os.MFD_CLOEXEC)
        try:
            os.ftruncate(self.fd, self.nbytes)
            self.tensor: Optional[torch.Tensor] = torch.from_file(
                f"/proc/self/fd/{self.fd}", shared=True, size=self.nbytes, dtype=torch.uint8
            )
        except BaseException:
            os.close(self.fd)
            raise
        self.registered = False
        self._tried = False
        Arena._next_gen += 1
        self.gen = (os.getpid(), Arena._next_gen)

    @property
    def base(self) -> int:
        return self.tensor.data_ptr()  # type: ignore[union-attr]

    def register(self) -> bool:
        """Pin the arena for fast device-to-host copies (``cudaHostRegister``, tried once); False if CUDA refuses."""
        if not self.registered and not self._tried:
            self._tried = True
            rc = int(torch.cuda.cudart().cudaHostRegister(self.base, self.nbytes, 0))
            self.registered = rc == 0
            if not self.registered:
                log.warning("shardckpt: cudaHostRegister of the %d-byte staging arena failed (%d); staging unpinned", self.nbytes, rc)
        return self.registered

    def close(self) -> None:
        """Unpin and drop this process's hold; the pages go once no view (nor a child) maps them."""
        if self.tensor is None:
            return
        if self.registered:
            self.registered = False
            try:
                torch.cuda.cudart().cudaHostUnregister(self.base)
            except Exception:  # freed either way; never fail a save on this
                pass
        self.tensor = None
        os.close(self.fd)


# --------------------------------------------------------------------------
# the parent's side


def usable_for(storage) -> bool:
    """Whether a writer child can write to ``storage`` (its own ``Storage(url)`` reaches the same files)."""
    if not hasattr(os, "memfd_create"):
        return False  # not Linux: no anonymous shared memory to stage into
    if storage.url.split("://", 1)[0] in _IN_PROCESS_PROTOCOLS and "://" in storage.url:
        return False
    try:
        if not rebuildable(storage):
            return False  # a wrapped, test or user-registered storage: only this process has it
        pickle.dumps(storage.storage_options)
    except Exception:
        return False
    return True


#: The child's program. ``python -c`` puts the current directory first on
#: ``sys.path``: a ``torch.py`` or ``shardckpt.py`` there would run in the
#: child. ``sys`` is built in (no file can stand for it); the child drops that
#: entry before importing anything else. (``-P`` does this from Python 3.11 on;
#: ``-I`` would also drop ``PYTHONPATH``, which locates this copy of shardckpt.)
_CHILD_CODE = (
    "import sys; sys.path[:] = [p for p in sys.path if p not in ('', '.')]; "
    "from shardckpt._writerproc import child_main; child_main()"
)


class ProcessWriter:
    """A persistent writer child and the socket to it; ``write_files`` has ``_io.write_files``'s signature."""

    def __init__(self):
        self._lock = threading.Lock()
        self._proc: Optional[subprocess.Popen] = None
        self._conn: Optional[Connection] = None
        self._sent: set = set()  # arena generations this child has mapped

    @property
    def pid(self) -> Optional[int]:
        return self._proc.pid if self._proc is not None else None

    def alive(self) -> bool:
        return self._proc is not None and self._proc.poll() is None

    def _start(self) -> None:
        parent, child = socket.socketpair(socket.AF_UNIX, socket.SOCK_STREAM)
        env = dict(os.environ)
        env[_FD_ENV] = str(child.fileno())
        # The child imports this very copy of shardckpt, installed or not.
        root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
        env["PYTHONPATH"] = root + (os.pathsep + env["PYTHONPATH"] if env.get("PYTHONPATH") else "")
        # The child never touches a GPU: hiding them keeps CUDA out of it.
        env["CUDA_VISIBLE_DEVICES"] = ""
        try:
            proc = subprocess.Popen(
                [sys.executable, "-c", _CHILD_CODE],
                pass_fds=[child.fileno()],
                env=env,
                stdin=subprocess.DEVNULL,
            )
        finally:
            child.close()
        self._proc, self._conn, self._sent = proc, Connection(parent.detach()), set()
        try:
            msg = self._recv(CHILD_START_TIMEOUT_S, what="starting")
        except BaseException:
            self._kill()
            raise
        if msg != ("ready",):
            self._kill()
            raise SaveFailedError(f"async save writer process (pid {proc.pid}) said {msg!r} instead of ready")
        log.debug("shardckpt: writer process %d started", proc.pid)

    def _kill(self) -> None:
        proc, conn = self._proc, self._conn
        self._proc = self._conn = None
        self._sent = set()
        if conn is not None:
            conn.close()
        if proc is not None:
            if proc.poll() is None:
                proc.kill()
            proc.wait()

    def _died(self, what: str) -> SaveFailedError:
        proc = self._proc
        rc = None
        if proc is not None:
            try:
                rc = proc.wait(_EXIT_WAIT_S)
            except subprocess.TimeoutExpired:  # its socket closed but it lingers: it is of no use any more
                proc.kill()
                rc = proc.wait()
        how = f"killed by signal {-rc}" if rc is not None and rc < 0 else f"exit code {rc}"
        pid = proc.pid if proc is not None else "?"
        self._kill()
        return SaveFailedError(
            f"the async save writer process (pid {pid}) died ({how}) while {what}; nothing of this save was "
            "committed and the previous checkpoint is untouched; the next async save starts a new writer "
            "(or set SHARDCKPT_ASYNC_WRITER=thread)"
        )

    def _recv(self, timeout: Optional[float], *, what: str) -> Any:
        conn = self._conn
        waited = 0.0
        try:
            while not conn.poll(_POLL_S):  # type: ignore[union-attr]
                waited += _POLL_S
                if self._proc.poll() is not None or (timeout is not None and waited >= timeout):  # type: ignore[union-attr]
                    if self._proc.poll() is None:  # type: ignore[union-attr]
                        self._proc.kill()  # type: ignore[union-attr]
                    raise EOFError
            return conn.recv()  # type: ignore[union-attr]
        except (EOFError, OSError):
            raise self._died(what) from None

    def write_files(
        self,
        storage,
        files: Dict[str, Sequence[Any]],
        *,
        arena: Arena,
        threads: int,
        block_bytes: Optional[int] = None,
        chunk_metadata: bool = True,
        hash_algo: str = "",
    ):
        """Have the child write ``files`` (items are views of ``arena``); return ``_io.write_files``'s result.

        Raises:
            SaveFailedError: the child died (named, with its exit status) or could not start.
            OSError / StorageError / ...: the write failed in the child (its own exception).
        """
        if arena.tensor is None:
            raise AssertionError("internal error: process writer called without a staging arena")
        spec = {rel: [_item_spec(it, arena) for it in items] for rel, items in files.items()}
        with self._lock:
            if not self.alive():
                if self._proc is not None:
                    log.warning("shardckpt: async save writer process %s is gone; starting a new one", self.pid)
                    self._kill()
                self._start()
            conn = self._conn
            try:
                if arena.gen not in self._sent:
                    conn.send(("arena", arena.gen, arena.nbytes))  # type: ignore[union-attr]
                    send_handle(cast(Any, conn), arena.fd, self._proc.pid)  # type: ignore[union-attr]
                    self._sent = {arena.gen}  # the child keeps only the arena of the latest request
                conn.send(("write", arena.gen, storage.url, storage.storage_options, spec, threads, block_bytes, chunk_metadata, hash_algo))  # type: ignore[union-attr]
            except (OSError, EOFError):
                raise self._died(f"receiving the save to {storage.url}") from None
            reply = self._recv(None, what=f"writing the save to {storage.url}")
        if reply[0] == "ok":
            return reply[1]
        _, exc, text = reply
        if exc is not None:
            raise exc
        raise SaveFailedError(f"async save writer process failed writing {storage.url}: {text}")

    def drop(self, arena: Arena) -> None:
        """Have the child unmap ``arena`` (so its pages can go)."""
        with self._lock:
            if arena.gen in self._sent and self.alive():
                self._sent.discard(arena.gen)
                try:
                    self._conn.send(("drop", arena.gen))  # type: ignore[union-attr]
                except (OSError, EOFError):
                    pass  # a dead child maps nothing

    def stop(self) -> None:
        """Ask the child to exit and wait for it (killed if it does not go within 30 s)."""
        with self._lock:
            proc, conn = self._proc, self._conn
            if proc is None:
                return
            try:
                conn.send(("stop",))  # type: ignore[union-attr]
                proc.wait(30)
            except Exception:
                pass
            self._kill()


def _item_spec(it, arena: Arena) -> Tuple[str, str, str, Tuple[int, ...], Tuple[int, ...], int]:
    """A WriteItem as the child rebuilds it: its bytes are ``nbytes`` at an offset of the arena."""
    n = it.nbytes
    off = 0
    if n:
        t = it.tensor
        off = t.data_ptr() - arena.base
        if t.device.type != "cpu" or not t.is_contiguous() or off < 0 or off + n > arena.nbytes:
            raise AssertionError(f"internal error: staged chunk {it.key} is not a view of the staging arena")
    return (it.name, it.key, it.dtype, tuple(it.offsets), tuple(it.sizes), off)


_WRITER: Optional[ProcessWriter] = None
_WRITER_LOCK = threading.Lock()


def get_writer() -> ProcessWriter:
    """The process-wide writer (its child starts at its first write)."""
    global _WRITER
    with _WRITER_LOCK:
        if _WRITER is None:
            _WRITER = ProcessWriter()
        return _WRITER


def current_writer() -> Optional[ProcessWriter]:
    """The process-wide writer if one was made (``get_writer``), else None; never starts one."""
    return _WRITER


def shutdown() -> None:
    """Stop the writer child, if any (``release_buffers()`` and interpreter exit)."""
    w = _WRITER
    if w is not None:
        w.stop()


def _forget_after_fork() -> None:
    # A forked copy (a DataLoader worker) must not talk on the parent's socket.
    global _WRITER
    _WRITER = None


atexit.register(shutdown)
os.register_at_fork(after_in_child=_forget_after_fork)


# --------------------------------------------------------------------------
# the child's side


def child_main() -> None:
    """The writer child: map arenas, write what the parent asks with ``_io.write_files``, until told to stop."""
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    conn = Connection(int(os.environ.pop(_FD_ENV)))
    torch.set_num_threads(1)

    arenas: Dict[Any, torch.Tensor] = {}
    conn.send(("ready",))
    while True:
        try:
            msg = conn.recv()
        except (EOFError, OSError):
            return  # the parent is gone
        if msg[0] == "stop":
            return
        if msg[0] == "drop":
            arenas.pop(msg[1], None)
            continue
        if msg[0] == "arena":
            _, gen, nbytes = msg
            fd = recv_handle(conn)
            try:
                arenas[gen] = torch.from_file(f"/proc/self/fd/{fd}", shared=True, size=nbytes, dtype=torch.uint8)
            finally:
                os.close(fd)
            continue
        _, gen, url, options, spec, threads, block_bytes, chunk_metadata, hash_algo = msg
        for g in [g for g in arenas if g != gen]:
            del arenas[g]  # the parent moved to a newer arena
        try:
            arena = arenas[gen]
            files: Dict[str, Sequence[WriteItem]] = {
                rel: [
                    WriteItem(name=name, key=key, dtype=dtype, offsets=offsets, sizes=sizes, tensor=_view(arena, off, sizes, dtype))
                    for name, key, dtype, offsets, sizes, off in items
                ]
                for rel, items in spec.items()
            }
            out = write_files(Storage(url, storage_options=options), files, threads=threads, block_bytes=block_bytes, chunk_metadata=chunk_metadata,
                              hash_algo=hash_algo)
            reply: Tuple[Any, ...] = ("ok", out)
        except BaseException as e:  # noqa: BLE001 - every failure goes back to the save
            text = f"{type(e).__name__}: {e}\n{traceback.format_exc()}"
            try:
                pickle.loads(pickle.dumps(e))  # the parent must be able to rebuild it
                reply = ("err", e, text)
            except Exception:
                reply = ("err", None, text)
        try:
            conn.send(reply)
        except (EOFError, OSError):
            return


def _view(arena: torch.Tensor, off: int, sizes: Sequence[int], dtype: str) -> torch.Tensor:
    n = itemsize(dtype)
    for s in sizes:
        n *= s
    # The writer needs the bytes only: a flat uint8 view of exactly nbytes.
    return arena[off : off + n]
