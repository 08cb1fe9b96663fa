"""The memory tier's save: one copy of the shard, straight into the shared-memory file that keeps it (issue 28).

``CheckpointManager.save_to_memory`` blocks only for the copy of this
rank's shard into host memory that *is* the memory copy; everything else
runs in one background thread, overlapped with training.

Blocking part (:meth:`Snapshots.save`, collective):
  1. plan the save (``prepare_save``: the same validation and layout as a
     storage save, one data file per rank) and check the budget (one
     agreement: sizes and free space of every node);
  2. lay the data file out (its safetensors header and each chunk's offset,
     ``_io.data_file_header``) in a *slot*: a file under the tier's
     directory, its pages allocated when it is made (``posix_fallocate``:
     a filesystem that filled since the budget check is an ``ENOSPC`` that
     turns the tier off, never a SIGBUS at the copy), mapped into this
     process and, when the source is CUDA, registered with
     ``cudaHostRegister`` (pinned), reused across steps; the peer slots are
     made (and reserved) here too, and when any rank made a slot file the
     ranks agree that every one of them got its space;
  3. copy every chunk to its offset: one device-to-host copy per tensor on
     a side CUDA stream (a ``memcpy`` for CPU tensors), then wait for it —
     or, with ``overlap=True``, return at once and let a one-shot
     ``optimizer.step`` pre-hook make the optimizer's stream wait for the
     copies (parameters and optimizer state do not change before it).

Background part (one thread, its own sequence of exchanges, a process group
of its own for the peer copy, created once, so it never interleaves with
training's collectives):
  4. the block CRC-32Cs of every chunk, computed in parallel over the slot's
     bytes; the slot is hard-linked into ``step-<N>/data/`` under the name
     the save engine gives it, the index file written, rank 0 commits the
     manifest (``execute_save`` with this module's writer: the one commit);
  5. the manifest is written on every node; each rank's data and index files
     go to its peer rank on the next node, received straight into the
     peer's slot (gloo: in place; NCCL: through two GPU buffers), and the
     receiver checks every block CRC of what arrived;
  6. one agreement: the step is *held* only when every rank has both copies,
     verified. Older steps are then removed.

Double buffering: two own slots and two peer slots per rank; a step is
written into the slots that do not hold the last held step, so a failure
anywhere in 1-6 leaves that step as it was. The failure is raised at the
next ``save_to_memory``, ``restore`` or ``close``. A step in flight when
the script ends or raises is waited for (bounded, ``EXIT_WAIT_S``) before
``concurrent.futures`` shuts its executors down. Host memory per rank:
at most ``2 x (own + peer bytes)`` plus the index and manifest files
(:func:`host_bytes_bound`).
"""

from __future__ import annotations

import atexit
import errno
import hashlib
import logging
import mmap
import os
import queue
import threading
import time
import uuid
import weakref
from concurrent.futures import ThreadPoolExecutor
from typing import Any, Callable, Dict, List, Mapping, Optional, Sequence, Tuple, cast

import torch

from .. import _knobs
from .._collective import ALL, FROM_ROOT, Comm, agree
from .._format import MANIFEST_NAME, ChunkMeta, FileMeta, crc32c, crc32c_combine, open_manifest
from .._format._v2 import check_index
from .._io import WriteItem, byte_view, data_file_header, partition
from .._p2p import warm_nccl
from .._save import execute_save, prepare_save, stage_save
from .._storage import Storage
from ..errors import SaveFailedError, UsageError
from . import normalize_root, store
from . import plan as P
from .transfer import move_tensors

__all__ = ["Snapshots", "host_bytes_bound", "SLOT_PREFIX", "MEMORY_CHANNEL", "find_optimizers"]

log = logging.getLogger("shardckpt")

#: Slot files start with this (hidden, beside the ``step-*`` directories):
#: ``.slot-r<rank>-p<pid>-<root tag>-<token>-<own|peer><k>-<i>`` (the root tag: ``Snapshots.tag``).
SLOT_PREFIX = ".slot-"
#: The background thread's sequences of exchanges start so (the main thread's is "main", async saves' "async"),
#: one per root (``memory-<hash>``): two tiers in one process never share a sequence.
MEMORY_CHANNEL = "memory"
#: Slots of each kind: the step being written never overwrites the last held one.
SLOTS = 2
#: Bytes one checksum task covers (a run of blocks; crc32c releases the GIL, tasks run in parallel).
CRC_TASK_BYTES = 64 << 20
#: Largest piece of a peer copy staged through the GPU (NCCL); two per transfer.
PIECE_BYTES = 256 << 20


def host_bytes_bound(own: int, peer: int) -> int:
    """The most slot bytes the tier keeps for one rank: two steps of its own and its peers' data files.

    ``own``: this rank's data file bytes of a step; ``peer``: the data file
    bytes it keeps for the ranks whose peer it is. The index files and the
    manifest (kilobytes) come on top.

    Example:
        >>> host_bytes_bound(16 << 30, 16 << 30) == 64 << 30
        True
    """
    return SLOTS * (own + peer)


#: Most threads checksumming a step's bytes per rank: hardware CRC-32C runs near memory speed on a few cores;
#: more would take cores from the training process's own threads.
CRC_THREADS = 4


def _crc_threads() -> int:
    return max(1, min(CRC_THREADS, os.cpu_count() or 1))


# --------------------------------------------------------------------------
# slots: mapped shared-memory files


#: Bytes of zeros written per call where ``posix_fallocate`` is missing or refused (see :func:`reserve`).
ZERO_BYTES = 1 << 20
#: ``posix_fallocate`` errors meaning "not supported here" (fall back to writing zeros), not "no space".
_UNSUPPORTED = {errno.EOPNOTSUPP, errno.EINVAL, errno.ENOSYS, getattr(errno, "ENOTSUP", errno.EOPNOTSUPP)}


def reserve(fd: int, size: int) -> None:
    """Allocate the first ``size`` bytes of the open file ``fd`` now, so that writes through a mapping never fault.

    A mapped shared-memory file whose pages are not allocated gets them at
    the first write; when the filesystem is full by then, the writer
    receives SIGBUS (the process dies, exit 135). ``posix_fallocate``
    allocates them up front and says ``ENOSPC`` instead. Where it is missing
    (macOS) or the filesystem refuses it (``EOPNOTSUPP``/``EINVAL``), zeros
    are written (``pwrite``, which fails with ``ENOSPC`` as well).

    Raises:
        OSError: ``ENOSPC`` (no room), or another error of the filesystem.

    Example:
        >>> import tempfile
        >>> with tempfile.TemporaryFile() as f:
        ...     reserve(f.fileno(), 4096); os.fstat(f.fileno()).st_size
        4096
    """
    if size <= 0:
        return
    fallocate = getattr(os, "posix_fallocate", None)
    if fallocate is not None:
        try:
            fallocate(fd, 0, size)
            return
        except OSError as e:
            if e.errno not in _UNSUPPORTED:
                raise
    zeros = bytes(min(size, ZERO_BYTES))
    done = 0
    while done < size:
        done += os.pwrite(fd, zeros[: min(len(zeros), size - done)], done)


class _ShmFile:
    """One file of a slot: created 0600 (never through a symlink), its pages reserved, mapped, pinned for CUDA sources."""

    def __init__(self, path: str, size: int, pin: bool):
        fd = os.open(path, os.O_RDWR | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW | os.O_CLOEXEC, 0o600)
        try:
            os.ftruncate(fd, size)
            try:
                reserve(fd, size)
            except OSError as e:
                raise OSError(e.errno, f"cannot reserve {size} bytes for the slot {path}: {e.strerror}") from e
            self.mm = mmap.mmap(fd, size)
        except BaseException:
            os.close(fd)
            os.unlink(path)
            raise
        os.close(fd)  # the mapping keeps the file
        self.path, self.size = path, size
        self.u8 = torch.frombuffer(self.mm, dtype=torch.uint8)
        self.pinned = False
        if pin and size >= _knobs.REGISTER_MIN_BYTES:
            rc = int(torch.cuda.cudart().cudaHostRegister(self.u8.data_ptr(), size, 0))
            self.pinned = rc == 0
            if not self.pinned:
                log.warning("shardckpt: memory tier: cudaHostRegister of %d bytes failed (%d); copies to it are pageable", size, rc)
        self.want_pin = pin

    def release(self) -> None:
        if self.pinned:
            self.pinned = False
            try:
                torch.cuda.cudart().cudaHostUnregister(self.u8.data_ptr())
            except Exception:  # the mapping goes either way; never fail on this
                pass
        self.u8 = None  # type: ignore[assignment]
        try:
            self.mm.close()
        except BufferError:  # a view is still alive somewhere: the mapping goes with it
            pass
        try:
            os.unlink(self.path)
        except FileNotFoundError:
            pass


class _Slot:
    """The files of one step of one kind (own or peer) on this rank, and where they are linked now."""

    def __init__(self, base: str):
        self.base = base
        self.files: List[_ShmFile] = []
        self.links: List[str] = []

    def unlink_step(self) -> None:
        """Take this slot's files out of the step that used it (that step is not held, or no longer)."""
        for p in self.links:
            try:
                os.unlink(p)
            except FileNotFoundError:
                pass
        self.links = []

    def fit(self, sizes: Sequence[int], pin: bool) -> None:
        """Files of exactly ``sizes`` (kept when they fit already: no new pages, no new registration)."""
        self.unlink_step()
        keep: List[_ShmFile] = []
        for i, size in enumerate(sizes):
            f = self.files[i] if i < len(self.files) else None
            if f is not None and f.size == size and f.want_pin == pin:
                keep.append(f)
                continue
            if f is not None:
                f.release()
            keep.append(_ShmFile(f"{self.base}-{i}", size, pin))
        for f in self.files[len(sizes):]:
            f.release()
        self.files = keep

    def link_into(self, i: int, path: str) -> None:
        """Hard-link file ``i`` as ``path`` (``<step>/data/<name>``), the directories made 0700 (never through a link)."""
        data = os.path.dirname(path)
        store.make_private_dir(os.path.dirname(data))
        store.make_private_dir(data)
        try:
            os.unlink(path)  # a leftover of an abandoned attempt at this step
        except FileNotFoundError:
            pass
        os.link(self.files[i].path, path, follow_symlinks=False)
        self.links.append(path)

    def nbytes(self) -> int:
        return sum(f.size for f in self.files)

    def release(self) -> None:
        self.links = []  # the held step keeps its links: its files outlive this process
        for f in self.files:
            f.release()
        self.files = []


def remove_dead_slots(node_dir: str, *, tag: Optional[str] = None) -> List[str]:
    """Remove the slot names left by dead processes (their bytes stay while a step links them); with ``tag``, this process's of that root too.

    Call it only in a directory that is the root's (``store.check_dir``):
    every slot there is then that root's, and a live process's slot of
    another root (a manager handed the same ``MemoryTier(dir=)``, whose
    tier turned off) is never in it. Returns the names removed.
    """
    out: List[str] = []
    mine = None if tag is None else f"-p{os.getpid()}-{tag}-"
    try:
        names = os.listdir(node_dir)
    except OSError:
        return out
    for n in names:
        if not n.startswith(SLOT_PREFIX):
            continue
        try:
            pid = int(n.split("-p", 1)[1].split("-", 1)[0])
        except (IndexError, ValueError):
            continue
        if (mine is not None and mine in n) or (pid != os.getpid() and not _alive(pid)):
            try:
                os.unlink(os.path.join(node_dir, n))
                out.append(n)
            except OSError:
                pass
    return out


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except OSError:
        return True
    return True


# --------------------------------------------------------------------------
# checksums over the slots


def _crc_tasks(u8: torch.Tensor, start: int, nbytes: int, block_bytes: int, pool: ThreadPoolExecutor) -> List[Any]:
    """Futures of the block CRC-32Cs of ``u8[start:start+nbytes]``, runs of blocks in parallel."""
    per = max(1, CRC_TASK_BYTES // block_bytes) * block_bytes
    mv = byte_view(u8) if nbytes else memoryview(b"")
    on = _knobs.CHECKSUMS

    def run(a: int, b: int) -> List[int]:
        return [crc32c(mv[start + o : start + min(o + block_bytes, b)]) if on else 0 for o in range(a, b, block_bytes)]

    return [pool.submit(run, a, min(nbytes, a + per)) for a in range(0, nbytes, per)]


def _joined(futs: List[Any], nbytes: int, block_bytes: int) -> Tuple[List[int], int]:
    """Block CRCs from their futures, and the whole chunk's CRC joined from them (as ``BlockCrcs.crc``)."""
    blocks = [c for f in futs for c in f.result()]
    crc = 0
    for i, b in enumerate(blocks):
        crc = crc32c_combine(crc, b, min(block_bytes, nbytes - i * block_bytes))
    return blocks, crc


# --------------------------------------------------------------------------
# the optimizer pre-hook of overlap mode


def find_optimizers(state: Any) -> List[torch.optim.Optimizer]:
    """The optimizers in ``state`` (nested dicts/lists/tuples; containers with ``.optimizers``), each once."""
    out: List[torch.optim.Optimizer] = []
    seen = set()

    def walk(v: Any, depth: int) -> None:
        if depth > 8 or id(v) in seen:
            return
        seen.add(id(v))
        if isinstance(v, torch.optim.Optimizer):
            out.append(v)
        if isinstance(v, Mapping):
            for x in v.values():
                walk(x, depth + 1)
        elif isinstance(v, (list, tuple)):
            for x in v:
                walk(x, depth + 1)
        else:
            inner = getattr(v, "optimizers", None)
            if isinstance(inner, (list, tuple)):
                for x in inner:
                    walk(x, depth + 1)

    walk(state, 0)
    return out


def _buffer_ptrs(state: Any) -> set:
    """Storage addresses of every module buffer in ``state``: they may change in forward (BatchNorm statistics)."""
    ptrs = set()

    def walk(v: Any, depth: int) -> None:
        if depth > 8:
            return
        if isinstance(v, torch.nn.Module):
            for b in v.buffers():
                local = b.to_local() if hasattr(b, "to_local") else b
                if local.numel():
                    ptrs.add(local.untyped_storage().data_ptr())
        elif isinstance(v, Mapping):
            for x in v.values():
                walk(x, depth + 1)
        elif isinstance(v, (list, tuple)):
            for x in v:
                walk(x, depth + 1)

    walk(state, 0)
    return ptrs


# --------------------------------------------------------------------------
# one step in flight


class _Job:
    """A step between its copy and its being held."""

    def __init__(self, step: int, slot: int):
        self.step, self.slot = step, slot
        self.plan: Any = None
        self.groups: List[List[WriteItem]] = []
        self.layouts: List[Tuple[bytes, List[int]]] = []
        self.events: List[Any] = []  # CUDA events: every copy done, per device
        self.cpu_pairs: List[Tuple[torch.Tensor, torch.Tensor]] = []  # copies left to the thread (overlap, CPU)
        self.copied = threading.Event()
        self.copy_error: Optional[BaseException] = None
        self.device: Optional[int] = None
        self.pin = False  # the slots are pinned (CUDA sources)
        self.peers: Dict[int, Optional[int]] = {}
        self.node_of: Dict[int, str] = {}
        self.hooks: List[Any] = []
        self.t0 = time.perf_counter()
        self.blocked_s = 0.0
        self.own_bytes = 0


#: Every live ``Snapshots`` of this process, for the wait at exit.
_LIVE: "weakref.WeakSet[Snapshots]" = weakref.WeakSet()

#: Longest wait at interpreter exit for a step in flight.
EXIT_WAIT_S = 60.0


def _wait_at_exit() -> None:
    """At exit, let a step in flight finish (bounded) before the interpreter tears torch down.

    The background thread is a daemon: a script that ends (or raises) while a
    step's checksums or copies run would otherwise finalize the interpreter,
    and torch's C++ state with it, under the thread's feet (seen as
    ``terminate called without an active exception``, exit -6).
    """
    for snaps in list(_LIVE):
        snaps.done.wait(EXIT_WAIT_S)


def _register_exit_wait() -> None:
    """Run :func:`_wait_at_exit` at interpreter exit, before ``concurrent.futures`` refuses new work.

    ``atexit`` handlers run after ``threading``'s exit hooks, one of which
    (``concurrent.futures.thread``'s) shuts every thread pool down: the
    step's checksum tasks were then refused ("cannot schedule new futures
    after interpreter shutdown") and a step in flight at a normal end or an
    uncaught exception was lost. ``threading._register_atexit`` hooks run
    last-registered first, at the start of the shutdown, so this one,
    registered after ``concurrent.futures.thread`` is imported, runs before
    that shutdown. Where the hook is missing, ``atexit`` (as before).
    """
    import concurrent.futures.thread  # noqa: F401 - its exit hook registered first, so it runs after ours

    hook = getattr(threading, "_register_atexit", None)
    try:
        if hook is not None:
            hook(_wait_at_exit)
            return
    except RuntimeError:  # imported while the interpreter already shuts down: too late for threading's hooks
        pass
    atexit.register(_wait_at_exit)


_register_exit_wait()


class Snapshots:
    """The save half of one rank's memory tier: slots, the background thread, the peer group (see the module docstring)."""

    def __init__(self, node_dir: str, root: str):
        self.dir = node_dir
        self.root = root  # the storage root whose copy this is (``store.open_dir``, ``store.step_extra``)
        #: The root's short name: in the channel and the slot names (a process's slots of one root, not of another).
        self.tag = hashlib.sha256(normalize_root(root).encode()).hexdigest()[:12]
        self.channel = f"{MEMORY_CHANNEL}-{self.tag}"
        self.own = [_Slot("") for _ in range(SLOTS)]
        self.peer = [_Slot("") for _ in range(SLOTS)]
        self.held: Optional[int] = None  # slot index of the last held step (own and peer alike)
        #: Per slot index, the files every rank's slots have, reserved (:meth:`_fit`): ``{rank: (own sizes, peer sizes, pin)}``.
        self.fitted: List[Optional[Dict[int, Any]]] = [None] * SLOTS
        self.held_step: Optional[int] = None
        self.job: Optional[_Job] = None
        self.thread: Optional[threading.Thread] = None  # one worker, started once, fed through ``queue``
        self.queue: "queue.SimpleQueue[Any]" = queue.SimpleQueue()
        self.done = threading.Event()
        _LIVE.add(self)
        self.done.set()
        self.layouts_memo: Dict[Any, Tuple[List[List[int]], List[Tuple[bytes, List[int]]]]] = {}
        self.error: Optional[Tuple[str, BaseException]] = None
        self.group: Any = None
        self.group_ranks: Optional[Tuple[int, ...]] = None
        self.group_on_gpu = False
        self.streams: Dict[int, Any] = {}
        self.pool: Optional[ThreadPoolExecutor] = None
        #: What the last held step's save did (tests, the benchmark): step, bytes, seconds.
        self.last_save: Dict[str, Any] = {}
        self.last_block_s = 0.0
        #: What the warm-up did (tests, the benchmark): seconds in the background, slot bytes made.
        self.last_warm: Dict[str, Any] = {}
        self._named = False
        self._dead_cleaned = False

    # -- public ----------------------------------------------------------------

    def host_bytes(self) -> int:
        """Bytes of the slot files this rank has mapped now (own and peer, both slots)."""
        return sum(s.nbytes() for s in self.own + self.peer)

    def wait(self, *, raise_error: bool = True) -> None:
        """Wait for the step in flight; raise its failure (once) as ``SaveFailedError``."""
        self.done.wait()
        job = self.job
        if job is not None:
            for h in job.hooks:
                h.remove()
            job.hooks = []
            self.job = None
        if raise_error and self.error is not None:
            what, e = self.error
            self.error = None
            held = f"step {self.held_step} is still held" if self.held_step is not None else "no step is held"
            raise SaveFailedError(
                f"memory tier: {what}: {type(e).__name__}: {e}; {held} (its copies were not touched)"
            ) from e

    def close(self) -> None:
        """Wait for the step in flight, then unmap the slots (the held step's files stay, linked in its directory)."""
        try:
            self.wait()
        finally:
            for s in self.own + self.peer:
                s.release()
            self.fitted = [None] * SLOTS
            # A killed run's slots, and those of a manager of this process never closed: the root's copy goes.
            # Only in this root's directory: one that is another root's (this tier turned off) is not ours to clean.
            if store.check_dir(self.dir, self.root) is None:
                remove_dead_slots(self.dir, tag=self.tag)
            if self.pool is not None:
                self.pool.shutdown(wait=False)
                self.pool = None

    def save(
        self, step: int, state: Dict[str, Any], comm: Comm, *, process_group: Any, overlap: bool,
        peers: Dict[int, Optional[int]], node_key: str, share: Optional[int],
        disable: Callable[[str], None], warn_no_copy: Callable[[List[int], int], None],
        io_threads: Optional[int] = None, replicas: Optional[str] = None, run: Optional[str] = None,
    ) -> bool:
        """Copy this rank's shard into a slot and start the background part (collective). False: the tier turned off.

        ``replicas``: the replica check's mode (the manager's ``replicas=``,
        as its storage saves): ``"check"`` raises ``ReplicaDivergenceError``
        on every rank before anything is copied. ``run``: the run identity
        the step's manifest records (``_managed.identity``; the same on every
        rank), None when the manager has none.
        """
        t0 = time.perf_counter()
        self.wait()  # one step in flight; the previous one's failure is raised here
        if self.held_step is not None and step <= self.held_step:
            raise UsageError(
                f"CheckpointManager.save_to_memory: step {step} is not after step {self.held_step}, which the memory "
                "tier holds; memory steps must increase (the held step is never overwritten)"
            )
        optimizers = find_optimizers(state) if overlap else []
        if overlap and not optimizers:
            raise UsageError(
                "CheckpointManager.save_to_memory(overlap=True): no torch.optim.Optimizer found in the state; the "
                "overlapped copy needs the optimizer (its step pre-hook waits for the copy). Put the optimizer in "
                "the state, or pass overlap=False"
            )
        planned = self._plan(step, state, comm, peers=peers, node_key=node_key, share=share, disable=disable,
                             warn_no_copy=warn_no_copy, replicas=replicas, clear=True, run=run)
        if planned is None:
            return False
        plan, groups, layouts, own, pin, facts, node_of = planned

        if any(p is not None and node_of[p] != node_of[r] for r, p in peers.items()):
            self._peer_group(comm, process_group)  # collective: from the main thread, once
        job = _Job(step, 0 if self.held != 0 else 1)
        job.groups, job.layouts, job.own_bytes = groups, layouts, own
        job.peers, job.node_of, job.pin = peers, node_of, pin
        self._name_slots(comm.rank)
        if not self._fit(comm, job.slot, _slot_files(facts, peers, node_of), disable):
            return False
        slot = self.own[job.slot]
        items = list(plan.items)
        where: Dict[str, torch.Tensor] = {}
        for f, (header, starts), g in zip(slot.files, layouts, groups):
            f.u8[: len(header)].copy_(torch.frombuffer(bytearray(header), dtype=torch.uint8))
            for it, start in zip(g, starts):
                where[it.key] = f.u8[start : start + it.nbytes]
        dsts = [where[it.key] for it in items]
        try:
            self._copy(job, items, dsts, overlap, _buffer_ptrs(state) if overlap else set())
            job.plan = stage_save(plan, lambda ts: dsts)
        except BaseException:
            self._settle(job)
            raise
        job.plan = _with(job.plan, comm.on_channel(self.channel), self._writer(job))
        if overlap:
            job.hooks = [opt.register_step_pre_hook(self._hook(job)) for opt in optimizers]
        self.job = job
        self._start_worker(job, process_group)
        if not overlap:
            for _, ev in job.events:
                ev.synchronize()  # the copy is the call's floor: it returns when the shard is in host memory
        job.blocked_s = self.last_block_s = time.perf_counter() - t0
        return True

    def warm(
        self, state: Dict[str, Any], comm: Comm, *, process_group: Any, peers: Dict[int, Optional[int]], node_key: str,
        share: Optional[int], disable: Callable[[str], None], warn_no_copy: Callable[[List[int], int], None],
        replicas: Optional[str] = None,
    ) -> bool:
        """Make both slots for ``state``'s shard in the background now, so the first save allocates nothing (collective).

        The cheap part runs here: the save's plan and budget check (one
        agreement) and the tier's process group. The expensive part, the
        slot files' pages reserved, mapped and (CUDA sources) pinned with
        ``cudaHostRegister`` (seconds for tens of GB), runs in the
        background thread, overlapped with whatever the caller does next;
        the first :meth:`save` waits for it if it is still running, then
        finds both slots fitted (``_fit``: nothing made, nothing exchanged).
        A state whose shard changes shape later simply re-fits at its save.
        No-op (False) when a slot is fitted already or a step is in flight.

        Raises:
            Nothing of its own: a state that cannot be saved is left for
            :meth:`save` to refuse; a full filesystem turns the tier off
            (``disable``), as at a save.

        Example:
            >>> snaps.warm(state, comm, process_group=None, peers={0: None}, node_key="h:/dev/shm/x",
            ...            share=None, disable=print, warn_no_copy=lambda r, m: None)  # doctest: +SKIP
            True
        """
        if not self.done.is_set() or self.held_step is not None or any(f is not None for f in self.fitted):
            return False
        step = 0
        try:
            planned = self._plan(step, state, comm, peers=peers, node_key=node_key, share=share, disable=disable,
                                 warn_no_copy=warn_no_copy, replicas=replicas, clear=False)
        except Exception as e:  # noqa: BLE001 - the first save plans again and raises it where it belongs
            log.debug("shardckpt: memory tier: no warm-up: %s: %s", type(e).__name__, e)
            return False
        if planned is None:
            return False
        _plan, _groups, _layouts, _own, pin, facts, node_of = planned
        if any(p is not None and node_of[p] != node_of[r] for r, p in peers.items()):
            self._peer_group(comm, process_group)  # collective: from the main thread, once
        self._name_slots(comm.rank)
        files = _slot_files(facts, peers, node_of)
        bg = comm.on_channel(self.channel)  # the background thread's sequence: steps queued after run after this
        device = torch.cuda.current_device() if pin else None

        def run() -> None:
            t0 = time.perf_counter()
            try:
                if device is not None:
                    torch.cuda.set_device(device)
                for k in range(SLOTS):
                    if not self._fit(bg, k, files, disable):
                        return
                self.last_warm = {"s": time.perf_counter() - t0, "host_bytes": self.host_bytes()}
            except BaseException as e:  # noqa: BLE001 - raised by the next save_to_memory / restore / close
                self.error = ("the slots could not be made", e)
                log.warning("shardckpt: memory tier: the slots could not be made: %s: %s", type(e).__name__, e)

        self._start_worker(run, process_group)
        return True

    # -- the blocking part --------------------------------------------------------

    def _plan(
        self, step: int, state: Dict[str, Any], comm: Comm, *, peers: Dict[int, Optional[int]], node_key: str,
        share: Optional[int], disable: Callable[[str], None], warn_no_copy: Callable[[List[int], int], None],
        replicas: Optional[str], clear: bool, run: Optional[str] = None,
    ) -> Optional[Tuple[Any, List[List[WriteItem]], List[Tuple[bytes, List[int]]], int, bool, List[Any], Dict[int, str]]]:
        """The save's plan, its data files' layout and every rank's facts, the budget checked (collective); None: the tier turned off.

        Returns ``(plan, groups, layouts, own bytes, pin, facts, node_of)``.
        ``clear``: remove this node's leftover steps at ``step`` or later
        (a save; a warm-up writes nothing and removes nothing). ``run``: the
        run the step records (``store.step_extra``).
        """
        url = store.step_dir(self.dir, step)
        plan = prepare_save(state, url, comm=comm, storage_options=store.PRIVATE, overwrite=True, io_threads=1,
                            extra=store.step_extra(step, self.root, run), replicas=replicas)
        groups, layouts = self._layout(list(plan.items))
        sizes = [len(h) + sum(it.nbytes for it in g) for (h, _), g in zip(layouts, groups)]
        own = sum(sizes)

        pin = any(cast(torch.Tensor, it.tensor).is_cuda for it in plan.items)

        def probe() -> Tuple[str, int, Optional[int], int, Optional[str], Tuple[int, ...], bool]:
            why = store.open_dir(self.dir, self.root)  # created 0700, ours, of this root; else why not
            if why is not None:
                return node_key, own, -1, 0, why, (), pin
            self._first_use()
            # Leftovers of this step or later (an abandoned run, a failed attempt, a planted link): never the held step.
            for s, _ in store.memory_steps(self.dir) if clear else ():
                if s >= step:
                    store.remove_step(self.dir, s)
            return node_key, own, store.free_bytes(self.dir), self.host_bytes(), None, tuple(sizes), pin

        _, facts = agree(comm, probe, what=f"memory save of step {step}", share=lambda v: v, mode=ALL)
        world = comm.world
        node_of = {r: facts[r][0] for r in range(world)}
        problems = []
        need_on: Dict[str, int] = {}
        for r in range(world):
            node, own_r, free, mapped, why = facts[r][:5]
            kept = own_r + sum(facts[s][1] for s in P.senders_to(r, peers) if node_of[s] != node)
            need_on[node] = need_on.get(node, 0) + max(0, host_bytes_bound(kept, 0) - mapped)
            if free == -1:
                problems.append(f"rank {r}: {why}")
            elif share is not None and host_bytes_bound(kept, 0) > share:
                problems.append(
                    f"rank {r}: two steps of its own and its peer's files need {host_bytes_bound(kept, 0)} bytes here, "
                    f"over its share {share} of max_bytes"
                )
        for r in range(world):  # the ranks of a node share its free space
            node, _, free = facts[r][:3]
            if free is not None and free != -1 and need_on[node] > free and not any(node in p for p in problems):
                problems.append(f"{node} has {free} bytes free, two steps need {need_on[node]} more there")
        if problems:
            disable("; ".join(problems[:4]))
            return None
        warn_no_copy(P.ranks_without_copy(peers, node_of), comm.rank)
        return plan, groups, layouts, own, pin, facts, node_of


    def _layout(self, items: List[WriteItem]) -> Tuple[List[List[WriteItem]], List[Tuple[bytes, List[int]]]]:
        """The data files of a save (``partition`` into one file, cut by header size) and their headers; memoized.

        The same state saves the same chunks every step: planning them again
        (a JSON estimate and a header per chunk) would be per-step Python work.
        """
        key = tuple((it.key, it.name, it.dtype, tuple(it.sizes), tuple(it.offsets)) for it in items)
        got = self.layouts_memo.get(key)
        if got is None:
            pos = {it.key: i for i, it in enumerate(items)}
            groups = partition(items, 1)
            got = ([[pos[it.key] for it in g] for g in groups], [data_file_header(g) for g in groups])
            self.layouts_memo = {key: got}
        order, layouts = got
        return [[items[i] for i in g] for g in order], layouts

    def _first_use(self) -> None:
        """Remove dead processes' slot names, once, from a directory ``store.open_dir`` accepted (this root's)."""
        if not self._dead_cleaned:
            self._dead_cleaned = True
            for n in remove_dead_slots(self.dir):
                log.info("shardckpt: memory tier: removed the slot %s of a dead process", n)

    def _fit(self, comm: Comm, k: int, files: Dict[int, Any], disable: Callable[[str], None]) -> bool:
        """Give slot ``k`` (own and peer) of every rank the files ``files`` says, their space reserved; False: the tier turned off.

        ``files``: ``{rank: (own sizes, peer sizes, pin)}``, the same on every
        rank (:func:`_slot_files`). When every rank's slot ``k`` has these
        files already (every step after the first two, while the state
        keeps its shapes), nothing is made and nothing is exchanged.
        Otherwise each rank makes what changed (:func:`reserve`: a full
        filesystem is an ``OSError`` here, not a SIGBUS at the copy) and the
        ranks agree; where any rank failed, every rank frees slot ``k`` (it
        holds no held step) and the tier turns off with one warning naming
        the ranks and the cause.
        """
        own, peer, pin = files[comm.rank]
        if self.fitted[k] == files:
            self.own[k].fit(own, pin)  # the files it has: only takes them out of the step that used them last
            self.peer[k].fit(peer, pin)
            return True
        self.fitted[k] = None

        def make() -> Optional[str]:
            try:
                self.own[k].fit(own, pin)
                self.peer[k].fit(peer, pin)
            except OSError as e:
                return f"rank {comm.rank}: {e}"
            return None

        _, whys = agree(comm, make, what="memory save: the slots", share=lambda v: v, mode=ALL)
        bad = [w for w in whys if w]
        if bad:
            self.own[k].release()
            self.peer[k].release()
            disable(f"no room for the memory copy in {self.dir}: " + "; ".join(bad[:4]))
            return False
        self.fitted[k] = files
        return True

    def _name_slots(self, rank: int) -> None:
        if self._named:
            return
        self._named = True
        # The pid tells a dead process's slots; the root tag, a process's slots of this root (``close``); the token,
        # two tiers of one process and root (a manager never closed) apart.
        base = os.path.join(self.dir, f"{SLOT_PREFIX}r{rank:05d}-p{os.getpid()}-{self.tag}-{uuid.uuid4().hex[:8]}")
        for k in range(SLOTS):
            self.own[k].base = f"{base}-own{k}"
            self.peer[k].base = f"{base}-peer{k}"

    def _stream(self, idx: int) -> Any:
        s = self.streams.get(idx)
        if s is None:
            s = self.streams[idx] = torch.cuda.Stream(device=idx)
        return s

    def _copy(self, job: _Job, items: List[WriteItem], dsts: List[torch.Tensor], overlap: bool, buffers: set) -> None:
        """Copy each chunk to its bytes in the slot: CUDA on side streams (waited unless ``overlap``), CPU now or in the thread."""
        first: List[Tuple[torch.Tensor, torch.Tensor, bool]] = []
        for it, dst in zip(items, dsts):
            src = cast(torch.Tensor, it.tensor).detach()
            if src.is_conj() or src.is_neg():
                src = src.resolve_conj().resolve_neg()
            changes_in_forward = bool(buffers) and src.numel() > 0 and src.untyped_storage().data_ptr() in buffers
            first.append((src, dst, changes_in_forward))
        # Buffers that change in forward first: in overlap mode they are waited for before returning.
        first.sort(key=lambda x: not x[2])
        cuda: Dict[int, List[Tuple[torch.Tensor, torch.Tensor, bool]]] = {}
        with torch.no_grad():
            for src, dst, sync in first:
                if src.is_cuda:
                    cuda.setdefault(src.device.index or 0, []).append((src, dst, sync))
                elif overlap and not sync:
                    job.cpu_pairs.append((dst, src))
                else:
                    dst.copy_(_bytes_of(src))
            sync_events = []
            for idx, triples in cuda.items():
                s = self._stream(idx)
                s.wait_stream(torch.cuda.current_stream(idx))  # after the work queued on training's stream
                job.device = idx
                with torch.cuda.stream(s):
                    for k, (src, dst, sync) in enumerate(triples):
                        dst.copy_(_bytes_of(src), non_blocking=True)
                        if overlap:
                            src.record_stream(s)  # keep it alive until the copy ran, whatever training frees
                        if sync and (k + 1 == len(triples) or not triples[k + 1][2]):
                            ev = torch.cuda.Event()
                            ev.record(s)
                            sync_events.append(ev)
                    done = torch.cuda.Event()
                    done.record(s)
                job.events.append((idx, done))
            if overlap:
                for ev in sync_events:
                    ev.synchronize()
            # Without overlap, ``save`` waits for ``job.events`` last: the rest of the call runs during the copies.

    def _hook(self, job: _Job) -> Callable[..., None]:
        """The one-shot ``optimizer.step`` pre-hook: the step's updates wait for the copy of the values they replace."""

        def hook(_opt: Any, _args: Any, _kwargs: Any) -> None:
            if job.hooks:
                hooks, job.hooks = job.hooks, []
                for h in hooks:
                    h.remove()
            for idx, ev in job.events:
                torch.cuda.current_stream(idx).wait_event(ev)  # the GPU waits; the host goes on
            if job.cpu_pairs:
                job.copied.wait()

        return hook

    def _settle(self, job: _Job) -> None:
        for _, ev in job.events:
            ev.synchronize()
        self.own[job.slot].unlink_step()

    # -- the background part ------------------------------------------------------

    def _worker(self) -> None:
        while True:
            job, process_group = self.queue.get()
            try:
                if callable(job):
                    job()  # the warm-up (:meth:`warm`): catches its own failures
                else:
                    self._background(job, process_group)
            finally:
                self.done.set()

    def _start_worker(self, job: Any, process_group: Any) -> None:
        """Hand ``job`` (a step, or the warm-up) to the one background thread, started on first use."""
        self.done.clear()
        if self.thread is None:
            self.thread = threading.Thread(target=self._worker, name="shardckpt-memory", daemon=True)
            self.thread.start()
        self.queue.put((job, process_group))

    def _background(self, job: _Job, process_group: Any) -> None:
        try:
            try:
                if job.device is not None:
                    torch.cuda.set_device(job.device)
                for _, ev in job.events:
                    ev.synchronize()
                with torch.no_grad():
                    for dst, src in job.cpu_pairs:
                        dst.copy_(_bytes_of(src))
            finally:
                job.copied.set()
            execute_save(job.plan)
            self._peer_copy(job, process_group)
            self.held, self.held_step = job.slot, job.step
            for s, _ in store.memory_steps(self.dir):
                if s < job.step:
                    store.remove_step(self.dir, s)  # link-safe; ranks of one node race here: same end state
            self.last_save.update(step=job.step, own_bytes=job.own_bytes, blocked_s=job.blocked_s,
                                  held_s=time.perf_counter() - job.t0, host_bytes=self.host_bytes())
        except BaseException as e:  # noqa: BLE001 - raised at the next call (wait())
            self.error = (f"step {job.step} was not kept in memory", e)
            log.warning("shardckpt: memory tier: step %d was not kept in memory: %s: %s", job.step, type(e).__name__, e)
            self.own[job.slot].unlink_step()
            self.peer[job.slot].unlink_step()

    def _writer(self, job: _Job) -> Callable[..., Any]:
        """``_io.write_files``'s stand-in for ``execute_save``: the bytes are in the slot already; checksum and link them."""
        slot = self.own[job.slot]

        def write(storage: Storage, files: Mapping[str, Sequence[WriteItem]], *, threads: Optional[int] = None,
                  block_bytes: Optional[int] = None, hash_algo: Optional[str] = None,
                  chunk_metadata: bool = True) -> Tuple[List[ChunkMeta], Dict[str, FileMeta]]:
            bb = block_bytes or _knobs.BLOCK_BYTES
            if len(files) != len(job.groups) or [[it.key for it in g] for g in files.values()] != [[it.key for it in g] for g in job.groups]:
                raise AssertionError("internal error: the memory save's files differ from the slot's layout")
            pool = self._pool()
            pending = []
            for (rel, items), f, (_, starts) in zip(files.items(), slot.files, job.layouts):
                for it, start in zip(items, starts):
                    pending.append((rel, it, start, _crc_tasks(f.u8, start, it.nbytes, bb, pool)))
            chunks = []
            for rel, it, start, futs in pending:
                blocks, crc = _joined(futs, it.nbytes, bb)
                chunks.append(ChunkMeta(file=rel, key=it.key, offsets=list(it.offsets), sizes=list(it.sizes),
                                        byte_offset=start, nbytes=it.nbytes, crc32c=crc, blocks=blocks, hash=None))
            metas = {}
            for i, rel in enumerate(files):
                slot.link_into(i, storage.path(rel))
                metas[rel] = FileMeta(slot.files[i].size)
            return chunks, metas

        return write

    def _pool(self) -> ThreadPoolExecutor:
        if self.pool is None:
            self.pool = ThreadPoolExecutor(max_workers=_crc_threads(), thread_name_prefix="shardckpt-crc")
        return self.pool

    def _peer_group(self, comm: Comm, process_group: Any) -> Any:
        """The tier's own process group (created once, collectively, from the main thread's first save)."""
        if self.group is not None and self.group_ranks == comm.ranks:
            return self.group
        import torch.distributed as dist

        backend = _knobs.MEMORY_PEER_BACKEND or ("nccl" if "nccl" in str(dist.get_backend(process_group)).lower() else "gloo")
        self.group = dist.new_group(ranks=list(comm.ranks), backend=backend)
        self.group_ranks = comm.ranks
        self.group_on_gpu = backend == "nccl"
        if self.group_on_gpu:
            warm_nccl(self.group)  # NCCL: one collective on the group before batched point-to-point calls
        return self.group

    def _peer_copy(self, job: _Job, process_group: Any) -> None:
        """The manifest on every node, each rank's files to its peer, received into the peer slot and verified."""
        plan = job.plan
        comm: Comm = plan.comm
        url = plan.storage.url
        here = Storage(url, storage_options=store.PRIVATE)
        me = comm.rank

        def read_manifest() -> Optional[bytes]:
            return here.read_bytes(MANIFEST_NAME) if me == 0 else None

        _, mbytes = agree(comm, read_manifest, what=f"memory save of step {job.step}", share=lambda v: v, mode=FROM_ROOT)

        def place_manifest() -> None:  # in an agreement: a node whose tmpfs is full fails every rank at once, none waits
            if job.node_of[me] != job.node_of[0]:
                here.write_atomic(MANIFEST_NAME, mbytes)

        if comm.world == 1 or not any(p is not None and job.node_of[p] != job.node_of[r] for r, p in job.peers.items()):
            agree(comm, place_manifest, what=f"memory save of step {job.step}: held")
            return
        agree(comm, place_manifest, what=f"memory save of step {job.step}: the manifest on every node")
        m = open_manifest(here, chunks=False)
        by_writer = P.files_by_writer(m.files, {rel: im.rank for rel, im in m.indexes.items()})
        index_of = {im.rank: rel for rel, im in m.indexes.items()}
        out_to = job.peers.get(me)
        if out_to is not None and job.node_of[out_to] == job.node_of[me]:
            out_to = None
        senders = [s for s in P.senders_to(me, job.peers) if job.node_of[s] != job.node_of[me]]
        data_of = {r: [rel for rel in by_writer.get(r, []) if rel in m.files and rel not in m.indexes] for r in range(comm.world)}
        # The receiving side: one peer-slot file per data file received, in (sender, file) order.
        incoming = [(s, rel) for s in senders for rel in data_of[s]]
        pslot = self.peer[job.slot]
        pslot.fit([m.files[rel].size for _, rel in incoming], pin=job.pin)  # made and reserved by ``_fit``: kept as is
        group = self.group
        t0 = time.perf_counter()
        sent = got = 0
        # Index files first (small, host bytes), then the data files.
        ops_out = []
        if out_to is not None and me in index_of:
            ops_out.append((out_to, torch.frombuffer(bytearray(here.read_bytes(index_of[me])), dtype=torch.uint8)))
        ops_in = [(s, torch.empty(m.indexes[index_of[s]].size, dtype=torch.uint8)) for s in senders if s in index_of]
        wire = (job.device if job.device is not None else torch.cuda.current_device()) if self.group_on_gpu else None
        _move(ops_out, ops_in, group, comm.ranks, wire, comm)
        own_files: Dict[str, _ShmFile] = {}
        if out_to is not None:
            # Data files: the ones this rank wrote, in name order (the save engine's numbering = the slot's order).
            linked = {os.path.basename(p): f for p, f in zip(self.own[job.slot].links, self.own[job.slot].files)}
            own_files = {rel: linked[os.path.basename(rel)] for rel in data_of[me]}
        data_out = [(out_to, own_files[rel].u8) for rel in data_of[me]] if out_to is not None else []
        data_in = [(s, f.u8) for (s, _), f in zip(incoming, pslot.files)]
        _move(data_out, data_in, group, comm.ranks, wire, comm)
        sent = sum(t.numel() for _, t in ops_out + data_out)
        got = sum(t.numel() for _, t in ops_in + data_in)
        xfer_s = time.perf_counter() - t0

        def verify_and_place() -> None:
            pool = self._pool()
            checks = []
            for s, buf in ops_in:
                rel = index_of[s]
                parsed = check_index(m, bytes(byte_view(buf)), rel, f"the copy of {rel} received from rank {s}")
                by_file: Dict[str, List[ChunkMeta]] = {}
                for _name, c in parsed["keys"].values():
                    by_file.setdefault(c.file, []).append(c)
                for (s2, drel), f in zip(incoming, pslot.files):
                    if s2 != s:
                        continue
                    for c in by_file.get(drel, []):
                        checks.append((s, drel, c, _crc_tasks(f.u8, c.byte_offset, c.nbytes, m.block_bytes, pool)))
            bad = []
            for s, drel, c, futs in checks:
                blocks, _ = _joined(futs, c.nbytes, m.block_bytes)
                if _knobs.CHECKSUMS and blocks != list(c.blocks or []):
                    bad.append(f"{drel} chunk {c.key} from rank {s}")
            if bad:
                raise SaveFailedError(f"the peer copy arrived damaged: {', '.join(bad[:4])}")
            for s, buf in ops_in:
                here.write_atomic(index_of[s], bytes(byte_view(buf)))
            for i, (_, drel) in enumerate(incoming):
                pslot.link_into(i, here.path(drel))

        agree(comm, verify_and_place, what=f"memory save of step {job.step}: the peer copies")
        self.last_save.update(peer_bytes_sent=sent, peer_bytes_received=got, peer_copy_s=xfer_s)


def _bytes_of(t: torch.Tensor) -> torch.Tensor:
    """``t``'s bytes as a flat ``uint8`` tensor (a view when contiguous)."""
    if not t.is_contiguous():
        t = t.contiguous()
    return t.reshape(-1).view(torch.uint8)


def _slot_files(facts: Sequence[Any], peers: Mapping[int, Optional[int]], node_of: Mapping[int, str]) -> Dict[int, Any]:
    """``{rank: (its data files' sizes, the sizes of the files it keeps for its peers, pin)}`` from the save's probe.

    A rank keeps the data files of the ranks on other nodes whose peer it
    is, in sender order, each sender's files in the order of their names
    (``-r<rank>-<i:02d>``: file 100 sorts before file 11): the order in
    which the background part receives them (``_peer_copy``).
    """

    def by_name(sizes: Sequence[int]) -> List[int]:
        return [sizes[i] for i in sorted(range(len(sizes)), key=lambda i: f"{i:02d}")]

    out: Dict[int, Any] = {}
    for r in range(len(facts)):
        kept = [size for s in P.senders_to(r, peers) if node_of[s] != node_of[r] for size in by_name(facts[s][5])]
        out[r] = (tuple(facts[r][5]), tuple(kept), bool(facts[r][6]))
    return out


def _with(plan: Any, comm: Comm, writer: Callable[..., Any]) -> Any:
    import dataclasses

    return dataclasses.replace(plan, comm=comm, writer=writer, files_here=False)


def _move(outgoing: List[Tuple[int, torch.Tensor]], incoming: List[Tuple[int, torch.Tensor]], group: Any,
          group_ranks: Sequence[int], device: Optional[int], comm: Optional[Comm] = None) -> None:
    """Send each ``(dst, bytes)`` and receive each ``(src, buffer)`` over ``group``: ``transfer.move_tensors``.

    gloo (``device`` None): the host tensors go as they are, in place.
    NCCL: in pieces through two GPU buffers per transfer on a side stream.
    With ``comm``, waits are bounded and a dead peer is named.
    """
    move_tensors(outgoing, incoming, group=group, group_ranks=group_ranks, device=device, comm=comm)
