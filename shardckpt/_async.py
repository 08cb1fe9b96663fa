"""async_save: snapshot the state, write it in a background thread.

The call blocks only for planning (the same collective validation as a
synchronous save) and *staging*: every tensor this rank writes is copied into
a private host buffer. From then on training may change the live tensors; the
background thread writes the staged copy and commits, with ``execute_save``
unchanged.

Staging:
  * CPU tensors: one ``copy_`` each into a reused buffer of the same
    shape/dtype (after the first save, no allocation and no page faults).
  * CUDA tensors: device-to-host copies on a side stream, ordered after the
    work already queued on the current stream, into pinned host buffers
    reused across saves. Large buffers are ordinary allocations registered
    with ``cudaHostRegister`` (torch's pinned allocator rounds every request
    up to a power of two, which can double the host memory of a big shard).
    Copies run while the ranks exchange their staging verdicts; the call
    returns once they are done, so the stall is the copy.

At most one save is in flight per process: a new save (async or through a
``CheckpointManager``) first waits for the previous one, and if that one
failed and nobody looked at its error yet (``result()``/``exception()``), the
new save raises it instead of starting. Errors are never dropped.

Writer: a thread of this process (default), or with
``SHARDCKPT_ASYNC_WRITER=process`` a persistent writer child
(``_writerproc``): staging then goes into one shared-memory arena (pinned
for CUDA sources) and the child writes the data files from it with the same
``_io.write_files``, out of this process's GIL; the index file, exchanges and
commit stay in the background thread here, so the bytes on disk are the same.

Exchanges between ranks go through ``_collective.agree`` (the process
group's store, bounded by ``collective_timeout_s``); the background thread
uses its own channel of them, never the training group's collectives the
main thread keeps using.
"""

from __future__ import annotations

import functools
import logging
import threading
import time
import traceback
from dataclasses import replace
from typing import TYPE_CHECKING, Any, Callable, Dict, List, Optional, Tuple, Union, cast

import torch

from . import _knobs, _writerproc
from ._collective import Comm, agree, open_comm
from ._format import MANIFEST_NAME
from ._save import OVERWRITE_HINT, SavePlan, execute_save, prepare_save, stage_save
from .errors import CheckpointError, CheckpointExistsError, SaveFailedError

if TYPE_CHECKING:  # pragma: no cover
    from torch.distributed import ProcessGroup

    from ._storage import Storage

__all__ = [
    "async_save",
    "AsyncSaveHandle",
    "start_async",
    "wait_pending",
    "release_buffers",
]

log = logging.getLogger("shardckpt")


#: The background thread's sequence of exchanges (the main thread's is "main").
ASYNC_CHANNEL = "async"


# --------------------------------------------------------------------------
# staging buffers


class _Buf:
    """A host buffer for one staged tensor; ``registered`` ones must be unregistered."""

    __slots__ = ("tensor", "registered")

    def __init__(self, tensor: torch.Tensor, registered: bool):
        self.tensor = tensor
        self.registered = registered

    def release(self) -> None:
        if self.registered:
            self.registered = False
            try:
                torch.cuda.cudart().cudaHostUnregister(self.tensor.data_ptr())
            except Exception:  # the memory is freed either way; never fail a save on this
                pass
        self.tensor = None  # type: ignore[assignment]


_Key = Tuple[Tuple[int, ...], torch.dtype, bool]


class _Stager:
    """Copies tensors into private host buffers, reusing them across saves."""

    def __init__(self):
        self.free: Dict[_Key, List[_Buf]] = {}
        self.streams: Dict[int, Any] = {}
        self.pending: List[Any] = []  # side streams with copies in flight

    def _alloc(self, shape: Tuple[int, ...], dtype: torch.dtype, pinned: bool, reuse: bool) -> _Buf:
        if not pinned:
            return _Buf(torch.empty(shape, dtype=dtype), False)
        nbytes = torch.Size(shape).numel() * torch.empty((), dtype=dtype).element_size()
        if reuse and nbytes >= _knobs.REGISTER_MIN_BYTES:
            t = torch.empty(shape, dtype=dtype)
            if int(torch.cuda.cudart().cudaHostRegister(t.data_ptr(), nbytes, 0)) == 0:
                return _Buf(t, True)
            log.debug("cudaHostRegister of %d bytes failed; using torch's pinned allocator", nbytes)
        return _Buf(torch.empty(shape, dtype=dtype, pin_memory=True), False)

    def _stream(self, device: torch.device):
        idx = device.index if device.index is not None else torch.cuda.current_device()
        s = self.streams.get(idx)
        if s is None:
            s = self.streams[idx] = torch.cuda.Stream(device=idx)
        return s

    def stage(self, tensors: List[torch.Tensor], *, reuse: bool = True) -> List[torch.Tensor]:
        free = self.free if reuse else {}
        if not reuse:
            self.release()
        used: Dict[_Key, List[_Buf]] = {}
        out: List[torch.Tensor] = []
        try:
            for t in tensors:
                pinned = t.is_cuda
                key = (tuple(t.shape), t.dtype, pinned)
                bucket = free.get(key)
                buf = bucket.pop() if bucket else self._alloc(key[0], t.dtype, pinned, reuse)
                used.setdefault(key, []).append(buf)
                out.append(buf.tensor)
            self._copy(out, tensors)
        finally:
            # Buffers not used by this save go; the used ones are reused next
            # time (the next staging waits for this save to finish first).
            for bucket in free.values():
                for b in bucket:
                    b.release()
            if reuse:
                self.free = used
        return out

    def _copy(self, dsts: List[torch.Tensor], srcs: List[torch.Tensor]) -> None:
        """Copy each source into its buffer: host copies now, device-to-host ones launched on side streams."""
        cuda: Dict[int, List[Tuple[torch.Tensor, torch.Tensor]]] = {}
        host: List[Tuple[torch.Tensor, torch.Tensor]] = []
        for dst, t in zip(dsts, srcs):
            t = t.detach()
            if t.is_cuda:
                cuda.setdefault(t.device.index or 0, []).append((dst, t))
            else:
                host.append((dst, t))
        with torch.no_grad():
            # Launch the device-to-host copies first so the DMA runs while
            # the host copies below keep the CPU busy. They are waited for
            # in wait_copies(), after the peers' verdicts arrive.
            for idx, pairs in cuda.items():
                dev = torch.device("cuda", idx)
                s = self._stream(dev)
                # Order after the work already queued (e.g. an optimizer
                # step) on the stream training uses.
                s.wait_stream(torch.cuda.current_stream(dev))
                self.pending.append(s)
                with torch.cuda.stream(s):
                    for dst, src in pairs:
                        dst.copy_(src, non_blocking=True)
            for dst, src in host:
                dst.copy_(src)

    def wait_copies(self) -> None:
        """Block until the device-to-host copies of the last ``stage`` are done."""
        streams, self.pending = self.pending, []
        for s in streams:
            s.synchronize()

    def release(self) -> None:
        self.wait_copies()
        for bucket in self.free.values():
            for b in bucket:
                b.release()
        self.free = {}


class _ArenaStager(_Stager):
    """Stages into one shared-memory arena that the writer process maps (``SHARDCKPT_ASYNC_WRITER=process``).

    The arena is reused while a save fits in it; a bigger save replaces it.
    For CUDA sources it is pinned whole with ``cudaHostRegister`` (unpinned
    staging if CUDA refuses: correct, slower copies).
    """

    def __init__(self):
        super().__init__()
        self.arena: Optional[_writerproc.Arena] = None

    def stage(self, tensors: List[torch.Tensor], *, reuse: bool = True) -> List[torch.Tensor]:
        align = _writerproc.ARENA_ALIGN
        offs: List[int] = []
        total = 0
        for t in tensors:
            offs.append(total)
            total += -(-(t.numel() * t.element_size()) // align) * align
        if self.arena is None or self.arena.nbytes < total or not reuse:
            self.release()
            self.arena = _writerproc.Arena(total)
        arena = self.arena
        if any(t.is_cuda for t in tensors) and total >= _knobs.REGISTER_MIN_BYTES:
            arena.register()
        flat = arena.tensor
        out = [
            flat[o : o + t.numel() * t.element_size()].view(t.dtype).view(t.shape)  # type: ignore[index]
            for t, o in zip(tensors, offs)
        ]
        self._copy(out, tensors)
        return out

    def release(self) -> None:
        self.wait_copies()
        arena, self.arena = self.arena, None
        if arena is not None:
            writer = _writerproc.current_writer()
            if writer is not None:
                writer.drop(arena)
            arena.close()


_STAGER = _Stager()
_ARENA_STAGER = _ArenaStager()


# --------------------------------------------------------------------------
# handles and the one save in flight


class AsyncSaveHandle:
    """A save running in the background: ``result()`` waits and raises its error.

    Attributes:
        url: where the checkpoint is being written.
        staging_seconds: how long ``async_save`` blocked (planning + staging).
    """

    def __init__(self, url: str, staging_seconds: float):
        self.url = url
        self.staging_seconds = staging_seconds
        self._event = threading.Event()
        self._error: Optional[BaseException] = None
        self._observed = False
        self._thread: Optional[threading.Thread] = None

    def __repr__(self) -> str:
        state = "running" if not self.done() else ("failed" if self._error else "done")
        return f"AsyncSaveHandle({self.url!r}, {state})"

    def done(self) -> bool:
        """True once the save committed or failed."""
        return self._event.is_set()

    def result(self, timeout: Optional[float] = None) -> None:
        """Wait for the save; raise its error if it failed.

        Raises:
            TimeoutError: not finished within ``timeout`` seconds (the save goes on).
            SaveFailedError / CheckpointExistsError / ...: the save failed. Nothing
                was committed, except when rank 0 committed and a peer lost
                contact just after (docs/guarantees.md).
        """
        if not self._event.wait(timeout):
            raise TimeoutError(f"async save to {self.url} still running after {timeout}s")
        if self._error is not None:
            self._observed = True
            raise self._error

    def exception(self, timeout: Optional[float] = None) -> Optional[BaseException]:
        """Wait for the save and return its error (None if it committed)."""
        if not self._event.wait(timeout):
            raise TimeoutError(f"async save to {self.url} still running after {timeout}s")
        self._observed = True
        return self._error

    def _finish(self, error: Optional[BaseException]) -> None:
        self._error = error
        self._event.set()


_INFLIGHT: Optional[AsyncSaveHandle] = None
_INFLIGHT_LOCK = threading.Lock()


def wait_pending(*, raise_unobserved: bool = True, new_save: bool = False) -> None:
    """Wait for the save in flight in this process, if any.

    If it failed and its error was not looked at yet, raise it now (once)
    wrapped in ``SaveFailedError`` naming the failed URL (and, with
    ``new_save``, saying that the save about to start was not started).
    """
    global _INFLIGHT
    with _INFLIGHT_LOCK:
        h = _INFLIGHT
    if h is None:
        return
    h._event.wait()
    if h._thread is not None:
        h._thread.join()
    unseen = h._error is not None and not h._observed
    with _INFLIGHT_LOCK:
        # An unseen error stays pending until someone is told about it.
        if _INFLIGHT is h and (raise_unobserved or not unseen):
            _INFLIGHT = None
    if raise_unobserved and unseen:
        h._observed = True
        if new_save:
            msg = f"the previous async save to {h.url} failed, so this save was not started: {h._error}"
        else:
            msg = f"async save to {h.url} failed: {h._error}"
        raise SaveFailedError(msg) from h._error


def release_buffers() -> None:
    """Free the host staging buffers async saves keep for reuse.

    Waits for the save in flight first (its error, if any, stays for
    ``result()`` or the next save). The next async save allocates again.

    Example:
        >>> import shardckpt
        >>> shardckpt.release_buffers()

    Also stops the async save writer process (``SHARDCKPT_ASYNC_WRITER=process``);
    the next async save starts a new one.

    Limits: process-wide (every async save and manager of this process).
    """
    wait_pending(raise_unobserved=False)
    _STAGER.release()
    _ARENA_STAGER.release()
    _writerproc.shutdown()


def _run(handle: AsyncSaveHandle, plan: SavePlan, before, after, cleanup=None) -> None:
    err: Optional[BaseException] = None
    if before is not None and plan.rank == 0:
        try:
            before()
        except Exception as e:  # rank 0 must still join the save's exchanges
            log.warning("shardckpt: before saving %s: %s: %s", plan.storage.url, type(e).__name__, e)
    try:
        execute_save(plan)
    except CheckpointError as e:
        err = e
    except BaseException as e:  # noqa: BLE001 - everything reaches result()
        err = SaveFailedError(f"async save to {plan.storage.url} failed: {type(e).__name__}: {e}")
        err.__cause__ = e
    # Every rank saw the same outcome, so every rank runs ``after`` or none does.
    if err is None and after is not None:
        try:
            after(plan.comm)
        except Exception as e:  # the save is committed; housekeeping failures only warn
            log.warning("shardckpt: after committing %s: %s: %s", plan.storage.url, type(e).__name__, e)
    if err is not None:
        _drop_frame_locals(err)
    # This frame is in err's traceback too: it must not keep the staged copies.
    plan = None  # type: ignore[assignment]
    if cleanup is not None:
        cleanup()
    handle._finish(err)


def _drop_frame_locals(err: BaseException) -> None:
    """Clear the locals of the frames in ``err``'s tracebacks (which still print).

    A failed save's error is kept until someone reads it; its frames would
    otherwise keep the staged copies (a shared-memory arena too) alive.
    """
    seen = set()
    e: Optional[BaseException] = err
    while e is not None and id(e) not in seen:
        seen.add(id(e))
        traceback.clear_frames(e.__traceback__)
        e = e.__cause__ or e.__context__


def start_async(
    plan: SavePlan,
    *,
    precheck: Optional[Callable[[], Optional[str]]] = None,
    before: Optional[Callable[[], None]] = None,
    after: Optional[Callable[[Comm], None]] = None,
    reuse_buffers: bool = True,
    t0: Optional[float] = None,
) -> AsyncSaveHandle:
    """Stage ``plan``'s tensors and execute it in a background thread (collective).

    ``precheck`` (rank 0) returns a message when the target already holds a
    committed checkpoint that may not be replaced. ``before`` runs on rank 0
    in the background before any rank writes; ``after(comm)`` runs on every
    rank once the save committed, with the background thread's ``Comm`` (for
    an agreement of its own). Every rank learns whether staging (or the
    precheck) failed anywhere before any background work starts. ``before``
    must not raise (an error is logged and the save goes on).
    """
    global _INFLIGHT
    t0 = time.perf_counter() if t0 is None else t0
    # A writer process needs storage it can open itself (not memory://, not a wrapped backend).
    in_process = _knobs.ASYNC_WRITER == "process" and _writerproc.usable_for(plan.storage)
    if _knobs.ASYNC_WRITER == "process" and not in_process:
        log.debug("shardckpt: %s cannot be written by another process; the async save writes in a thread", plan.storage.url)
    stager = _ARENA_STAGER if in_process else _STAGER

    def stage() -> SavePlan:
        if plan.rank == 0 and precheck is not None:
            msg = precheck()
            if msg:
                raise CheckpointExistsError(msg)
        return stage_save(plan, lambda ts: stager.stage(ts, reuse=reuse_buffers))

    try:
        # The round trip overlaps the device-to-host copies still running.
        staged, _ = agree(plan.comm, stage, what=f"async save to {plan.storage.url} aborted before writing")
    finally:
        stager.wait_copies()
    # The background thread exchanges on its own channel: the main thread may
    # run other saves and loads meanwhile, each rank in the same order.
    staged = replace(staged, comm=staged.comm.on_channel(ASYNC_CHANNEL))
    cleanup = None
    if in_process:
        # The writer process writes the data files from the arena; the rest
        # of execute_save (index file, exchanges, commit) stays in this process.
        staged = replace(staged, writer=functools.partial(_writerproc.get_writer().write_files, arena=cast(Any, _ARENA_STAGER.arena)))
        if not reuse_buffers:
            cleanup = _ARENA_STAGER.release
    handle = AsyncSaveHandle(plan.storage.url, time.perf_counter() - t0)
    # Non-daemon: a script that ends without wait() still finishes its save.
    th = threading.Thread(target=_run, args=(handle, staged, before, after, cleanup), name="shardckpt-async-save", daemon=False)
    handle._thread = th
    with _INFLIGHT_LOCK:
        _INFLIGHT = handle
    th.start()
    return handle


def async_save(
    state: Dict[str, Any],
    url: Union[str, "Storage"],
    *,
    storage_options: Optional[Dict[str, Any]] = None,
    process_group: Optional["ProcessGroup"] = None,
    overwrite: bool = False,
    io_threads: Optional[int] = None,
    reuse_buffers: bool = True,
    collective_timeout_s: Optional[float] = None,
    no_dist: bool = False,
    timeout_s: Optional[float] = None,
    replicas: Optional[str] = None,
) -> AsyncSaveHandle:
    """Save ``state`` to ``url`` in the background; return once it is staged.

    Collective when a process group is initialized: every rank of
    ``process_group`` calls it (``no_dist=True``: this process alone).
    Blocks for planning and for copying this rank's tensors into private host
    buffers — pinned and reused for CUDA tensors, copied on a side stream —
    then writes and commits in a background thread exactly as :func:`save`
    does. Changes to the state after the call returns do not reach this
    checkpoint.

    Only one save is in flight per process: the call first waits for the
    previous one, and raises its error if nobody has seen it yet.

    With ``SHARDCKPT_ASYNC_WRITER=process`` the data files are written by a
    persistent writer child from shared-memory staging (out of this
    process's GIL; same bytes on disk); a child that dies fails the save
    with ``SaveFailedError`` naming it. See docs/knobs.md.

    Args:
        state: as for :func:`shardckpt.save`.
        url: local directory or fsspec URL, or a :class:`Storage` object.
        storage_options: passed to fsspec.
        process_group: ranks that save (default: the world). The background
            thread never runs collectives on it (see ``_collective``).
        overwrite: replace a committed checkpoint at ``url``.
        io_threads: parallel writers per rank.
        reuse_buffers: keep the staging buffers for the next save (one host
            copy of this rank's shard stays allocated; ``release_buffers()``
            frees it). False allocates fresh buffers each time.
        collective_timeout_s: bound of every exchange between ranks, in the
            call and in the background (default
            ``SHARDCKPT_COLLECTIVE_TIMEOUT_S``); a rank that does not call
            within it is named and the others raise ``SaveFailedError``.
        no_dist: this process alone, as if no process group existed; every
            tensor must be whole here (see :func:`shardckpt.save`).
        timeout_s: the former name of ``collective_timeout_s`` (kept working).
        replicas: the replica check, as for :func:`shardckpt.save`; it runs
            in the call, on the live tensors, before staging.

    Returns:
        AsyncSaveHandle: ``result(timeout=None)`` waits and raises the save's
        error; ``done()``; ``exception()``.

    Raises:
        CheckpointExistsError: ``url`` holds a committed checkpoint and
            ``overwrite`` is False (checked before staging returns).
        SaveFailedError: the previous async save failed (unseen error),
            staging failed on some rank, or a rank did not call (named).
        UnsupportedStateError: a value in ``state`` cannot be saved.
        ReplicaDivergenceError: ``replicas="check"`` and replicas differ
            (named); nothing was staged or written.
        UsageError: under torchrun without an initialised process group.

    Memory: one host copy of the tensors this rank writes, while the save
    runs (and kept for reuse unless ``reuse_buffers=False``).

    Example:
        >>> import torch, shardckpt, tempfile
        >>> d = tempfile.mkdtemp()
        >>> w = torch.ones(3)
        >>> h = shardckpt.async_save({"w": w}, d)
        >>> w.add_(1)   # training goes on; the checkpoint holds ones
        tensor([2., 2., 2.])
        >>> h.result()
    """
    t0 = time.perf_counter()
    timeout = collective_timeout_s if timeout_s is None else timeout_s
    comm = open_comm(process_group, no_dist=no_dist, collective_timeout_s=timeout, op="shardckpt.async_save")
    wait_pending(new_save=True)
    plan = prepare_save(state, url, comm=comm, storage_options=storage_options, overwrite=overwrite, io_threads=io_threads,
                        replicas=replicas)

    def precheck() -> Optional[str]:
        if not overwrite and plan.storage.exists(MANIFEST_NAME):
            return f"{plan.storage.url_of(MANIFEST_NAME)} already exists; {OVERWRITE_HINT}"
        return None

    return start_async(plan, precheck=precheck, reuse_buffers=reuse_buffers, t0=t0)
