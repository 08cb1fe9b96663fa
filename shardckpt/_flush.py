"""Local first, then remote: the background flusher of ``CheckpointManager(root_url, local=DIR)``.

Every save commits under the local directory (the manager's ordinary save);
the step is then handed to a :class:`Flusher`, one thread per rank, which
copies it to the remote root in the background, so a slow or stalled remote
never blocks the training step.

One flush, on the flusher's own exchange channel (``"flush"``), every rank
together:

1. rank 0 picks the step: the newest one submitted (:func:`next_flush`);
   older pending steps are skipped (coalesced), so the backlog is at most the
   step in flight plus the newest pending one;
2. every rank uploads the files it wrote for that step (its data files and
   index file, :func:`shardckpt._memory.plan.files_by_writer`), each one
   verified against its checksums first (``_memory.store.check_file``,
   through the one verified reader), to ``<remote>/step-N/`` under the same
   relative path; the Storage layer retries as it does for any write;
3. once every rank uploaded (one agreement), rank 0 writes the remote
   manifest, the same bytes as the local one, last: that is the remote
   commit. Then ``durable_step`` advances on every rank and ``on_durable``
   runs.

A failed flush leaves the remote step without a manifest (restore and
``steps()`` never report it), logs a WARNING and is retried after a backoff,
unless a newer step was submitted meanwhile (it supersedes it).

The planning functions here are pure (ints in, ints out) and tested alone
(``tests/unit/test_flush_plan.py``).
"""

from __future__ import annotations

import logging
import os
import threading
import time
from typing import Callable, List, Optional, Tuple

from ._collective import FROM_ROOT, Comm, agree
from ._format import HF_INDEX_NAME, MANIFEST_NAME, open_manifest
from ._memory import plan as memory_plan
from ._memory import store as memory_store
from ._storage import Storage
from .errors import CheckpointNotFoundError, CorruptCheckpointError

__all__ = ["Flusher", "next_flush", "local_protected", "restore_source", "FLUSH_CHANNEL", "COPY_PIECE_BYTES", "FLUSH_NICE"]

log = logging.getLogger("shardckpt")

#: The flusher's sequence of exchanges (independent of saves and async saves).
FLUSH_CHANNEL = "flush"

#: Bytes read from the local file and written to the remote at a time.
COPY_PIECE_BYTES = 16 << 20

#: Nice increment of the flusher thread (Linux: per thread), so that the
#: training thread wins the CPU when both want it: the flush has time.
FLUSH_NICE = 10

#: Backoff before retrying a failed flush: first, and the cap (it doubles).
RETRY_FIRST_S = 1.0
RETRY_MAX_S = 60.0


def next_flush(pending: Optional[int], done: Optional[int]) -> Optional[int]:
    """The step to flush next: the newest pending one if newer than the last flushed, else None.

    The flusher keeps one pending step (each submission replaces an older
    one: the skipped steps are never uploaded), so this only drops a step
    that was flushed already.

    Example:
        >>> next_flush(7, 5), next_flush(5, 5), next_flush(None, 3)
        (7, None, None)
    """
    if pending is None or (done is not None and pending <= done):
        return None
    return pending


def local_protected(in_flight: Optional[int], pending: Optional[int]) -> List[int]:
    """Local steps retention must keep: the one being uploaded and the one waiting.

    Every other local step is either durable, or skipped (a newer step
    supersedes it), so local space is ``keep_local`` steps plus at most two.

    Example:
        >>> local_protected(5, 9), local_protected(None, None)
        ([5, 9], [])
    """
    return sorted({s for s in (in_flight, pending) if s is not None})


def restore_source(local: Optional[int], local_readable: bool, remote: Optional[int]) -> Tuple[str, Optional[int]]:
    """Where restore loads from: ``("local", step)``, ``("remote", step)`` or ``("none", None)``.

    The newest committed step wins; the local one when every rank can read
    it and it is at least as new as the remote's newest (a tie: local disk
    is faster).

    Example:
        >>> restore_source(9, True, 7), restore_source(9, False, 7), restore_source(5, True, 7)
        (('local', 9), ('remote', 7), ('remote', 7))
        >>> restore_source(None, False, None)
        ('none', None)
    """
    if local is not None and local_readable and (remote is None or local >= remote):
        return "local", local
    if remote is not None:
        return "remote", remote
    return "none", None


def upload_step(local: Storage, remote: Storage, rank: int) -> List[str]:
    """Copy the files rank ``rank`` wrote for a locally committed step to ``remote`` (same paths); returns them.

    ``local`` and ``remote`` are the step's directories. Each file is first
    verified against the checksums of the local manifest; a damaged file
    raises instead of being uploaded. The manifest is not copied here.

    Raises:
        CorruptCheckpointError: a local file is damaged.
        CheckpointNotFoundError: the local step has no manifest.
    """
    try:
        m = open_manifest(local)
    except CheckpointNotFoundError:
        raise CheckpointNotFoundError(
            f"rank {rank} cannot see {local.url_of(MANIFEST_NAME)}, committed by rank 0: local= needs a directory every "
            "rank of the job can read (the ranks of one node share its disk; per-node directories of a multi-node job "
            "are not supported yet)"
        ) from None
    mine = memory_plan.files_by_writer(m.files, {rel: im.rank for rel, im in m.indexes.items()}, MANIFEST_NAME).get(rank, [])
    by_file: dict = {}
    for name, t in m.tensors.items():
        for c in t.chunks:
            by_file.setdefault(c.file, []).append((name, c))
    for rel in mine:
        problem = memory_store.check_file(local, m, rel, by_file.get(rel, []))
        if problem is not None:
            raise CorruptCheckpointError(f"not uploading {local.url_of(rel)}: it is damaged: {problem}")
        _copy(local, remote, rel, m.files[rel].size)
    return mine


def _copy(src: Storage, dst: Storage, rel: str, size: int) -> None:
    w = dst.open_write(rel)
    try:
        for off in range(0, size, COPY_PIECE_BYTES):
            w.write(src.read_range(rel, off, min(COPY_PIECE_BYTES, size - off)))
    except BaseException:
        w.abort()
        raise
    w.close()


class Flusher:
    """One rank's background uploader of locally committed steps to the remote root.

    Every rank of the job runs one, fed the same steps in the same order
    (:meth:`submit` after each local commit); their flushes are agreed on
    the ``"flush"`` channel, so they upload the same step together.

    Args:
        local: the local root (``step-N/`` directories).
        remote: the remote root.
        comm: the ranks and bound of the exchanges (moved to :data:`FLUSH_CHANNEL`).
        step_dir: the directory name of a step (``step-00000005``).
        after_commit: rank 0, after each remote commit (remote retention);
            its errors are logged, the flush stays done.
        on_durable: every rank, after each remote commit, with the step.

    Limits: a rank that dies in a flush's exchange leaves the others'
    flusher waiting up to the collective timeout (then the flush fails and
    is retried, logged); a job that lost a rank restarts anyway.
    """

    def __init__(
        self,
        local: Storage,
        remote: Storage,
        comm: Comm,
        *,
        step_dir: Callable[[int], str],
        after_commit: Optional[Callable[[int], None]] = None,
        on_durable: Optional[Callable[[int], None]] = None,
    ):
        self.local = local
        self.remote = remote
        self.comm = comm.on_channel(FLUSH_CHANNEL)
        self.step_dir = step_dir
        self.after_commit = after_commit
        self.on_durable = on_durable
        self._cond = threading.Condition()
        self._pending: Optional[int] = None
        self._in_flight: Optional[int] = None
        self._picked: Optional[int] = None  # the last step the ranks agreed to flush
        self._durable: Optional[int] = None
        self._stopping = False
        self._failures = 0
        self._retry_at = 0.0
        #: (step, seconds) of the last remote commit, for logs and benchmarks.
        self.last_flush: Optional[Tuple[int, float]] = None
        self.skipped: List[int] = []
        self._thread = threading.Thread(target=self._run, name="shardckpt-flush", daemon=True)
        self._thread.start()

    # -- the trainer's side ---------------------------------------------------------

    @property
    def durable_step(self) -> Optional[int]:
        """The newest step committed on the remote (by this job's flushes, or found there at restore)."""
        with self._cond:
            return self._durable

    def set_durable(self, step: Optional[int]) -> None:
        """Record ``step`` as durable (restore found it committed on the remote)."""
        with self._cond:
            if step is not None and (self._durable is None or step > self._durable):
                self._durable = step

    def submit(self, step: int) -> None:
        """Queue a locally committed step; an older pending step is skipped (logged at INFO)."""
        with self._cond:
            if self._picked is not None and step <= self._picked:
                return  # flushed (or being flushed) already: the ranks agreed on a newer one
            if self._pending is not None and self._pending != step:
                if self.comm.rank == 0:
                    log.info("shardckpt: flush of step %d skipped: step %d supersedes it (the remote is behind)", self._pending, step)
                self.skipped.append(self._pending)
            self._pending = step if self._pending is None else max(step, self._pending)
            self._retry_at = 0.0
            self._cond.notify_all()

    def protected(self) -> List[int]:
        """Local steps that must not be deleted now (:func:`local_protected`)."""
        with self._cond:
            return local_protected(self._in_flight, self._pending)

    def busy(self) -> bool:
        with self._cond:
            return self._pending is not None or self._in_flight is not None

    def wait(self, timeout: Optional[float] = None) -> bool:
        """Block until nothing is pending or in flight; False when ``timeout`` passed first."""
        deadline = None if timeout is None else time.monotonic() + timeout
        with self._cond:
            while self._pending is not None or self._in_flight is not None:
                if not self._thread.is_alive():
                    return False
                left = None if deadline is None else deadline - time.monotonic()
                if left is not None and left <= 0:
                    return False
                self._cond.wait(timeout=1.0 if left is None else min(left, 1.0))
            return True

    def close(self, timeout: Optional[float] = None) -> bool:
        """Flush what is pending (up to ``timeout`` seconds), then stop the thread; False if work was left."""
        done = self.wait(timeout)
        with self._cond:
            self._stopping = True
            left = local_protected(self._in_flight, self._pending)
            self._cond.notify_all()
        if done:
            self._thread.join(timeout=5.0)
        else:
            log.warning("shardckpt: closing with step(s) %s not flushed to %s: they stay committed locally only "
                        "(the next run's restore() flushes the newest one)", left, self.remote.url)
        return done

    # -- the thread -------------------------------------------------------------------

    def _wait_for_work(self) -> bool:
        with self._cond:
            while True:
                if self._pending is not None:
                    delay = self._retry_at - time.monotonic()
                    if delay <= 0:
                        return True
                    if self._stopping:
                        return False
                    self._cond.wait(timeout=delay)
                    continue
                if self._stopping:
                    return False
                self._cond.wait()

    def _take(self) -> Optional[int]:
        """Rank 0: the step to flush now (the newest pending), in flight from now on (protected from local retention)."""
        with self._cond:
            step = next_flush(self._pending, self._picked)
            if step is not None:
                self._picked = self._in_flight = step
                self._pending = None
            return step

    def _run(self) -> None:
        try:
            os.setpriority(os.PRIO_PROCESS, threading.get_native_id(), FLUSH_NICE)  # this thread only (Linux)
        except (AttributeError, OSError):
            pass  # not Linux, or not allowed: the same priority as training
        while self._wait_for_work():
            try:
                _, step = agree(self.comm, lambda: self._take() if self.comm.rank == 0 else None,
                                what=f"flush to {self.remote.url}: the step", share=lambda v: v, mode=FROM_ROOT)
            except Exception as e:
                log.error("shardckpt: the flusher to %s stops: %s: %s", self.remote.url, type(e).__name__, e)
                with self._cond:
                    self._pending = self._in_flight = None
                    self._cond.notify_all()
                return
            if step is None:
                continue
            with self._cond:
                self._picked = step
                self._in_flight = step
                if self._pending is not None and self._pending <= step:
                    self._pending = None
            ok = self._flush(step)
            with self._cond:
                self._in_flight = None
                if ok:
                    self._failures = 0
                    self._durable = step if self._durable is None else max(step, self._durable)
                else:
                    self._failures += 1
                    if self._pending is None:
                        self._pending = step  # retried, unless a newer step supersedes it
                        self._picked = step - 1
                    self._retry_at = time.monotonic() + min(RETRY_MAX_S, RETRY_FIRST_S * 2 ** (self._failures - 1))
                self._cond.notify_all()
            if ok and self.on_durable is not None:
                try:
                    self.on_durable(step)
                except Exception as e:  # the trainer's callback must not stop the flusher
                    log.warning("shardckpt: on_durable(%d) raised %s: %s", step, type(e).__name__, e)

    def _flush(self, step: int) -> bool:
        name = self.step_dir(step)
        src, dst = self.local.child(name), self.remote.child(name)
        t0 = time.perf_counter()
        try:
            agree(self.comm, lambda: upload_step(src, dst, self.comm.rank), what=f"flush of step {step} to {dst.url}")

            def commit() -> None:
                if self.comm.rank != 0:
                    return
                if src.exists(HF_INDEX_NAME):  # the Hugging Face index (not in the manifest's files): before the commit
                    _copy(src, dst, HF_INDEX_NAME, src.size(HF_INDEX_NAME))
                dst.write_atomic(MANIFEST_NAME, src.read_bytes(MANIFEST_NAME))

            agree(self.comm, commit, what=f"flush of step {step} to {dst.url}: the remote commit")
        except Exception as e:
            log.warning("shardckpt: flush of step %d to %s failed (it stays uncommitted there; retried unless a newer step "
                        "supersedes it): %s: %s", step, dst.url, type(e).__name__, e)
            return False
        secs = time.perf_counter() - t0
        self.last_flush = (step, secs)
        log.info("shardckpt: step %d is durable at %s (flushed in %.1f s)", step, dst.url, secs)
        if self.comm.rank == 0 and self.after_commit is not None:
            try:
                self.after_commit(step)
            except Exception as e:
                log.warning("shardckpt: remote retention after step %d: %s: %s", step, type(e).__name__, e)
        return True

