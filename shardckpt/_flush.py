"""Local first, then remote: the background flusher of ``CheckpointManager(root_url, local=DIR)``.

Every save commits under the local directory (the manager's ordinary save);
the step is then handed to a :class:`Flusher`, one thread per rank, which
copies it to the remote root in the background, so a slow or stalled remote
never blocks the training step.

One flush, on the flusher's own exchange channel (``"flush"``), every rank
together:

1. rank 0 picks the step: the newest one submitted (:func:`next_flush`);
   older pending steps are skipped (coalesced), so the backlog is at most the
   step in flight plus the newest pending one; a ``force=True`` re-save has a
   queue of its own (never coalesced away: the remote may hold the bytes it
   replaced), flushed after the newest pending step;
2. every rank uploads the files it wrote for that step (its data files and
   index file, :func:`shardckpt._memory.plan.files_by_writer`), each one
   verified against its checksums first (``_verify.check_file``,
   through the one verified reader), to ``<remote>/step-N/`` under the same
   relative path; the Storage layer retries as it does for any write;
   references whose writer rank is not in this job (a world-size shrink)
   go to a rank that holds them (:func:`orphan_refs`, :func:`assign_orphans`;
   none: the flush is refused);
3. once every rank uploaded (one agreement), rank 0 writes the remote
   manifest, the same bytes as the local one, last, through the one commit
   point (``_format.commit_bytes``: every file it names, references
   included, checked on the remote before and after): that is the remote
   commit. Then ``durable_step`` advances on every rank and ``on_durable``
   runs.

A failed flush leaves the remote step without a manifest (restore and
``steps()`` never report it), logs a WARNING and is retried after a backoff,
unless a newer step was submitted meanwhile (it supersedes it). A flush no
retry can make succeed (:class:`FlushRefused`: references no live rank
holds, a step of another world size) is refused once, final for that step
(one WARNING; ``durable_step`` unchanged; ``wait()`` returns).

The planning functions here are pure (ints in, ints out) and tested alone
(``tests/unit/test_flush_plan.py``).
"""

from __future__ import annotations

import contextlib
import dataclasses
import logging
import os
import shutil
import stat
import tempfile
import threading
import time
import uuid
from typing import Any, Callable, Dict, Iterable, Iterator, List, Optional, Tuple

from ._collective import ALL, FROM_ROOT, Comm, agree
from ._format import HF_INDEX_NAME, MANIFEST_NAME, MAX_INDEX_BYTES, MetaCache, commit_bytes, manifest_from_bytes, open_manifest
from ._format._v2 import read_index
from ._format.naming import step_dir_name
from ._format.refs import REF_MARK, follow, ref_target
from ._managed import retention
from ._managed.held import Held, load_comm, restore_held
from ._managed.restore import source_order
from ._memory import plan as memory_plan
from ._memory import store as memory_store
from ._storage import Storage
from ._verify import check_file
from .errors import CheckpointError, CheckpointNotFoundError, CorruptCheckpointError, format_offenders

__all__ = ["Flusher", "FlushRefused", "Tiers", "Remote", "PerNodeSource", "next_flush", "local_protected", "restore_source", "commit_save_id", "files_of_rank",
           "orphan_refs", "assign_orphans", "held_refs",
           "upload_step", "check_world", "node_groups", "detect_nodes", "share_manifest", "held_local", "restore_local_held", "remove_stale_stages", "own_chunks", "STAGE_PREFIX", "PROBE_PREFIX", "FLUSH_CHANNEL", "COPY_PIECE_BYTES", "FLUSH_NICE",
           "YIELD_MAX_S"]

log = logging.getLogger("shardckpt")

#: The flusher's sequence of exchanges (independent of saves and async saves).
FLUSH_CHANNEL = "flush"

#: Bytes read from the local file and written to the remote at a time.
COPY_PIECE_BYTES = 16 << 20

#: Longest the flusher's data copies wait for this rank's save in progress
#: (:meth:`Flusher.yield_to_save`): a save that hangs must not stop the flush.
YIELD_MAX_S = 60.0

#: Nice increment of the flusher thread (Linux: per thread), so that the
#: training thread wins the CPU when both want it: the flush has time.
FLUSH_NICE = 10

#: Backoff before retrying a failed flush: first, and the cap (it doubles).
RETRY_FIRST_S = 1.0
RETRY_MAX_S = 60.0


class FlushRefused(CorruptCheckpointError):
    """A step the flusher can never commit on the remote whole, whatever it retries: refused once, never retried.

    Its files are not all in this job (references whose writer rank is gone
    and which no live rank holds, :func:`assign_orphans`; a step of another
    world size, :func:`check_world`). A re-save of the step (``force=True``)
    or a newer step is flushed as usual.
    """


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


def commit_save_id(ids: List[str], step: int) -> str:
    """The save id every rank uploaded (the remote commit's); raises when they differ (a re-save meanwhile).

    Example:
        >>> commit_save_id(["a1", "a1"], 5)
        'a1'
    """
    if len(set(ids)) != 1:
        raise CorruptCheckpointError(
            f"the ranks uploaded the files of different saves of step {step} ({sorted(set(ids))}): it was saved again "
            "while it was flushed; not committed (the re-save is flushed next)")
    return ids[0]


def restore_source(local: Optional[int], local_readable: bool, remote: Optional[int]) -> Tuple[str, Optional[int]]:
    """Where restore loads from: ``("local", step)``, ``("remote", step)`` or ``("none", None)``.

    The two-tier case of restore's one rule (``_managed.restore.source_order``):
    the newest committed step wins; the local one when every rank can read
    it and it is at least as new as the remote's newest (a tie: local disk
    is faster).

    Example:
        >>> restore_source(9, True, 7), restore_source(9, False, 7), restore_source(5, True, 7)
        (('local', 9), ('remote', 7), ('remote', 7))
        >>> restore_source(None, False, None)
        ('none', None)
    """
    order = source_order([local if local_readable else None, remote])
    if not order:
        return "none", None
    return ("local", local) if order[0] == 0 else ("remote", remote)


def upload_step(local: Storage, remote: Storage, rank: int, *, pause: Optional[Callable[[], None]] = None,
                extra: Iterable[str] = ()) -> Tuple[List[str], str]:
    """Copy the files rank ``rank`` wrote for a locally committed step to ``remote`` (same paths); returns them and the save id.

    ``local`` and ``remote`` are the step's directories. Each file is first
    verified against the checksums of the local manifest; a damaged file
    raises instead of being uploaded. The manifest is not copied here: the
    save id returned says which save's files went up (a ``force`` re-save
    may commit locally meanwhile; the commit checks every rank uploaded the
    same one).

    Incremental steps: a reference ``@<step dir>/<path>`` is uploaded to
    the same place next to the remote step (``<remote root>/<step dir>/<path>``)
    unless a file of that size is there already (data file names carry their
    save's id: the same name is the same bytes), first, so the remote copy
    resolves every reference whether or not the referenced step was flushed.
    Each reference goes with the rank whose data file name it carries;
    ``extra``: the references this rank uploads in place of writers that
    are not in this job any more (:func:`assign_orphans`).

    ``pause``: called before each file's check and each piece copied (the
    flusher waits there while a save of this rank runs).

    Raises:
        CorruptCheckpointError: a local file is damaged.
        CheckpointNotFoundError: the local step has no manifest.
    """
    try:
        m = open_manifest(local, chunks=False)  # this rank's chunks only (own_chunks): per-node disks hold no other index
    except CheckpointNotFoundError:
        raise CheckpointNotFoundError(
            f"rank {rank} cannot see {local.url_of(MANIFEST_NAME)}, committed by rank 0: the local directory lost it "
            "(removed by hand?), or it is per node and the commit's copy to this node failed"
        ) from None
    mine = sorted(set(files_of_rank(m.files, {rel: im.rank for rel, im in m.indexes.items()}, rank)) | set(extra))
    src = follow(local)
    by_file = own_chunks(m, src, rank)
    refs = [rel for rel in mine if rel.startswith(REF_MARK)]
    for rel in refs + [rel for rel in mine if not rel.startswith(REF_MARK)]:
        tgt = ref_target(rel)
        to, path = (remote, rel) if tgt is None else (remote.sibling(tgt[0]), tgt[1])
        if tgt is not None and to.stat_sizes([path]).get(path) == m.files[rel].size:
            continue  # on the remote already (flushed with the step that wrote it, or by an earlier flush)
        if pause is not None:
            pause()
        problem = check_file(src, m, rel, by_file.get(rel, []))
        if problem is not None:
            raise CorruptCheckpointError(f"not uploading {src.url_of(rel)}: it is damaged: {problem}")
        frm, frm_path = (local, rel) if tgt is None else (local.sibling(tgt[0]), tgt[1])
        _copy(frm, to, path, frm_path, m.files[rel].size, pause=pause)
    return mine, m.save_id


def check_world(local: Storage, world: int) -> None:
    """Before a flush: the local step ``local`` was saved by ``world`` ranks (each rank uploads the files it wrote).

    A step of another world size would go up without its other writers'
    files, so it is refused, never committed half.

    Raises:
        FlushRefused: the world sizes differ.
    """
    saved = open_manifest(local, chunks=False).world_size
    if saved != world:
        raise FlushRefused(
            f"{local.url} was saved by {saved} ranks, this job has {world}: each rank uploads the files it wrote, "
            "so the remote copy would lack some; not flushed")


def own_chunks(m: Any, src: Storage, rank: int) -> Dict[str, List[Tuple[str, Any]]]:
    """``file -> [(tensor name, chunk)]`` of the chunks rank ``rank`` wrote (from its own index file only, v2; v1: inline)."""
    by_file: Dict[str, List[Tuple[str, Any]]] = {}
    if any(t.chunks for t in m.tensors.values()):  # v1: every chunk is in the manifest
        for name, t in m.tensors.items():
            for c in t.chunks:
                by_file.setdefault(c.file, []).append((name, c))
        return by_file
    if rank in {im.rank for im in m.indexes.values()}:
        for name, c in read_index(m, src, rank, MetaCache())["keys"].values():
            by_file.setdefault(c.file, []).append((name, c))
    return by_file


def files_of_rank(files: Iterable[str], index_ranks: Dict[str, int], rank: int) -> List[str]:
    """The files of a manifest rank ``rank`` uploads (sorted): those it wrote; a reference by the file it names.

    Example:
        >>> files_of_rank(["data/ab-r00001-00.safetensors", "@step-00000002/data/cd-r00001-00.safetensors",
        ...                "data/ab-r00000-00.safetensors"], {}, 1)
        ['@step-00000002/data/cd-r00001-00.safetensors', 'data/ab-r00001-00.safetensors']
    """
    out = []
    for rel in files:
        tgt = ref_target(rel)
        if memory_plan.writer_of(rel if tgt is None else tgt[1], index_ranks, MANIFEST_NAME) == rank:
            out.append(rel)
    return sorted(out)


def orphan_refs(files: Iterable[str], index_ranks: Dict[str, int], world: int) -> List[str]:
    """References of a step whose writer rank is not in a job of ``world`` ranks (sorted): nobody would upload them.

    A step saved after a restore at a smaller world size references files
    the larger job's ranks wrote (``@step-N/data/<id>-r00003-00.safetensors``
    in a 2-rank job).

    Example:
        >>> orphan_refs(["@step-00000001/data/ab-r00001-00.safetensors", "@step-00000001/data/ab-r00000-00.safetensors",
        ...              "data/cd-r00000-00.safetensors"], {}, 1)
        ['@step-00000001/data/ab-r00001-00.safetensors']
    """
    out = []
    for rel in files:
        tgt = ref_target(rel)
        if tgt is not None and memory_plan.writer_of(tgt[1], index_ranks, MANIFEST_NAME) >= world:
            out.append(rel)
    return sorted(out)


def assign_orphans(orphans: Iterable[str], held: List[Iterable[str]], step: int) -> Dict[int, List[str]]:
    """``rank -> orphan references it uploads``: each to a rank that holds it (``held[r]``), spread over them in turn.

    Raises:
        FlushRefused: no rank holds some of them (named, the first few): the
            step cannot go up whole, so it is not flushed.

    Example:
        >>> assign_orphans(["@s/a", "@s/b", "@s/c"], [["@s/a", "@s/b", "@s/c"], ["@s/b", "@s/c"]], 2)
        {0: ['@s/a', '@s/c'], 1: ['@s/b']}
    """
    holders: Dict[str, List[int]] = {}
    for r, mine in enumerate(held):
        for rel in mine:
            holders.setdefault(rel, []).append(r)
    out: Dict[int, List[str]] = {}
    lost = []
    for i, rel in enumerate(sorted(set(orphans))):
        hs = sorted(holders.get(rel, []))
        if not hs:
            lost.append(rel)
            continue
        r = hs[i % len(hs)]
        out.setdefault(r, []).append(rel)
    if lost:
        raise FlushRefused(
            f"step {step} references files written by ranks this job of {len(held)} does not have, and no rank holds "
            f"them on its local disk: {format_offenders(lost)}; it is not flushed (durable_step does not advance): "
            "restart with the world size that wrote them, or save a step without incremental references")
    return {r: sorted(v) for r, v in sorted(out.items())}


def held_refs(local: Storage, refs: Iterable[str]) -> List[str]:
    """Of the references ``refs`` of local step ``local``, those this rank can read at their recorded size (sorted)."""
    refs = list(refs)
    if not refs:
        return []
    m = open_manifest(local, chunks=False)
    sizes = follow(local).stat_sizes(refs)
    return sorted(rel for rel in refs if sizes.get(rel) == m.files[rel].size)


def _copy(src: Storage, dst: Storage, rel: str, src_rel: str, size: int, *, pause: Optional[Callable[[], None]] = None) -> None:
    w = dst.open_write(rel)
    try:
        for off in range(0, size, COPY_PIECE_BYTES):
            if pause is not None:
                pause()
            w.write(src.read_range(src_rel, off, min(COPY_PIECE_BYTES, size - off)))
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
        after_commit: rank 0, after each remote commit, with the step and
            whether it replaced an earlier copy (remote retention); its
            errors are logged, the flush stays done.
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
        after_commit: Optional[Callable[[int, bool], None]] = None,
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
        self._exports: List[threading.Thread] = []  # rank 0: copies of Hugging Face exports in flight
        self._retry_at = 0.0
        self._resaved: set = set()  # steps re-saved since their last flush: their replaced remote files go after the commit
        # Re-saves of steps at or below the newest flushed or pending one: a queue of their own (step -> the number
        # of this rank's re-save submissions when it came), never coalesced away by a newer step. Every rank counts
        # the same submissions, so the number names one re-save on every rank; _resave_done: the newest taken.
        self._resaves: Dict[int, int] = {}
        self._resave_seq = 0
        self._resave_done: Dict[int, int] = {}
        #: (step, seconds) of the last remote commit, for logs and benchmarks.
        self.last_flush: Optional[Tuple[int, float]] = None
        self.skipped: List[int] = []
        self._saving = 0  # this rank's saves in progress (yield_to_save)
        self._quiet = threading.Event()  # set when none is
        self._quiet.set()
        self._thread = threading.Thread(target=self._run, name="shardckpt-flush", daemon=True)
        self._thread.start()

    @contextlib.contextmanager
    def yield_to_save(self) -> Iterator[None]:
        """While this rank saves: the flush's data copies wait between files and pieces (at most :data:`YIELD_MAX_S`).

        Why: a flush copying while the training loop saves takes disk,
        memory bandwidth and CPUs from the save, which is what the loop waits
        for (on a 2-CPU box it tripled the saves it overlapped). Exchanges
        with the other ranks do not wait, so a rank saving never holds up
        another rank's flush for longer than its save.
        """
        with self._cond:
            self._saving += 1
            self._quiet.clear()
        try:
            yield
        finally:
            with self._cond:
                self._saving -= 1
                if self._saving == 0:
                    self._quiet.set()

    def _pause(self) -> None:
        self._quiet.wait(YIELD_MAX_S)

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

    def submit(self, step: int, *, resave: bool = False) -> None:
        """Queue a locally committed step; an older pending step is skipped (logged at INFO).

        ``resave``: the step was saved again (``force=True``): it is flushed
        again even if its earlier copy was, replacing that copy on the remote
        (its new manifest last; the old files go once no kept step names them).
        A re-save (but of the step waiting) goes to a queue of its own: a
        newer step never supersedes it (the user replaced those bytes on
        purpose, and the remote may hold the replaced ones); the newest
        pending step is flushed first.
        """
        with self._cond:
            if resave:
                self._resave_seq += 1
                seq = self._resave_seq
                self._resaved.add(step)
                if self._resave_done.get(step, 0) >= seq:
                    return  # the ranks already agreed to flush this re-save (rank 0 submitted it first)
                # Any re-save but one of the step waiting (whose flush uploads the newest local copy anyway): its
                # earlier copy may be on the remote (flushed by this job or an earlier one), so a newer step must
                # not supersede it.
                if self._pending != step:
                    self._resaves[step] = seq
                    if self.comm.rank == 0:
                        log.info("shardckpt: step %d was saved again: it is flushed again (queued apart from newer steps)", step)
                    self._retry_at = 0.0
                    self._cond.notify_all()
                    return
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
            return sorted(set(local_protected(self._in_flight, self._pending)) | set(self._resaves))

    def busy(self) -> bool:
        with self._cond:
            return self._has_work() or self._in_flight is not None

    def _has_work(self) -> bool:
        return self._pending is not None or bool(self._resaves)

    def flush_export(self, name: str) -> None:
        """Rank 0: copy the directory ``name`` next to the steps (a Hugging Face export) to the remote, in the background.

        Its files as written, the ``.index.json`` last; a failure is logged
        (the export stays local). :meth:`wait` and :meth:`close` wait for it.
        """
        t = threading.Thread(target=self._copy_export, args=(name,), name="shardckpt-flush-export", daemon=True)
        with self._cond:
            self._exports = [x for x in self._exports if x.is_alive()] + [t]
        t.start()

    def _copy_export(self, name: str) -> None:
        src, dst = self.local.child(name), self.remote.child(name)
        try:
            for rel in sorted(src.walk_files(""), key=lambda r: (r.endswith(".index.json"), r)):  # the index last
                _copy(src, dst, rel, rel, src.size(rel))
        except Exception as e:
            log.warning("shardckpt: copy of %s to %s failed (it stays local only): %s: %s", src.url, dst.url, type(e).__name__, e)
            return
        log.info("shardckpt: %s copied to %s", src.url, dst.url)

    def _join_exports(self, deadline: Optional[float]) -> bool:
        with self._cond:
            exports = list(self._exports)
        for t in exports:
            t.join(None if deadline is None else max(0.0, deadline - time.monotonic()))
        return not any(t.is_alive() for t in exports)

    def wait(self, timeout: Optional[float] = None) -> bool:
        """Block until nothing is pending or in flight (exports too); False when ``timeout`` passed first."""
        deadline = None if timeout is None else time.monotonic() + timeout
        if not self._join_exports(deadline):
            return False
        with self._cond:
            while self._has_work() or self._in_flight is not None:
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
            left = sorted(set(local_protected(self._in_flight, self._pending)) | set(self._resaves))
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
                if self._has_work():
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

    def _take(self) -> Optional[Tuple[int, int]]:
        """Rank 0: ``(step, re-save number)`` to flush now, in flight from now on (protected from local retention).

        The newest pending step first (number 0), else the oldest re-saved
        step waiting (:meth:`submit`); None: nothing.
        """
        with self._cond:
            step = next_flush(self._pending, self._picked)
            self._pending = None
            if step is not None:
                self._picked = self._in_flight = step
                return step, 0
            if self._resaves:
                step = min(self._resaves)
                seq = self._resaves.pop(step)
                self._resave_done[step] = max(seq, self._resave_done.get(step, 0))
                self._in_flight = step
                return step, seq
            return None

    def _run(self) -> None:
        try:
            os.setpriority(os.PRIO_PROCESS, threading.get_native_id(), FLUSH_NICE)  # this thread only (Linux)
        except (AttributeError, OSError):
            pass  # not Linux, or not allowed: the same priority as training
        while self._wait_for_work():
            try:
                _, took = agree(self.comm, lambda: self._take() if self.comm.rank == 0 else None,
                                what=f"flush to {self.remote.url}: the step", share=lambda v: v, mode=FROM_ROOT)
            except Exception as e:
                log.error("shardckpt: the flusher to %s stops: %s: %s", self.remote.url, type(e).__name__, e)
                with self._cond:
                    self._pending = self._in_flight = None
                    self._resaves.clear()
                    self._cond.notify_all()
                return
            if took is None:
                with self._cond:  # rank 0 had nothing (this rank's work was flushed already)
                    if self._pending is not None and self._picked is not None and self._pending <= self._picked:
                        self._pending = None
                continue
            step, seq = took
            with self._cond:
                self._in_flight = step
                # A flush of a step uploads its newest local copy: it serves every re-save of it queued here (a
                # rank whose flusher lagged may have queued what rank 0 had pending, or the reverse); a re-save
                # committed meanwhile fails the commit's save id check and is retried.
                queued = self._resaves.pop(step, 0)
                if queued or seq:
                    self._resave_done[step] = max(seq, queued, self._resave_done.get(step, 0))
                if not seq:
                    self._picked = step
                if self._pending is not None and (self._pending == step if seq else self._pending <= step):
                    self._pending = None
            ok = self._flush(step)
            with self._cond:
                self._in_flight = None
                if ok is None:
                    pass  # refused (logged): final for this step, durable_step unchanged; nothing left to wait for
                elif ok:
                    self._failures = 0
                    self._durable = step if self._durable is None else max(step, self._durable)
                else:
                    self._failures += 1
                    if seq or queued:
                        self._resaves[step] = max(seq, queued, self._resaves.get(step, 0))  # retried: a re-save is never superseded
                    elif self._pending is None:
                        self._pending = step  # retried, unless a newer step supersedes it
                        self._picked = step - 1
                    self._retry_at = time.monotonic() + min(RETRY_MAX_S, RETRY_FIRST_S * 2 ** (self._failures - 1))
                self._cond.notify_all()
            if ok and self.on_durable is not None:
                try:
                    self.on_durable(step)
                except Exception as e:  # the trainer's callback must not stop the flusher
                    log.warning("shardckpt: on_durable(%d) raised %s: %s", step, type(e).__name__, e)

    def _flush(self, step: int) -> Optional[bool]:
        """Flush ``step`` (every rank): True committed, False failed (retried), None refused (:class:`FlushRefused`: final)."""
        name = self.step_dir(step)
        src, dst = self.local.child(name), self.remote.child(name)
        t0 = time.perf_counter()
        with self._cond:
            resaved = step in self._resaved
            self._resaved.discard(step)
        try:
            def survey() -> Tuple[List[str], List[str]]:
                check_world(src, self.comm.world)  # never a step whose other writers' files no rank would upload
                m = open_manifest(src, chunks=False)
                orphans = orphan_refs(m.files, {rel: im.rank for rel, im in m.indexes.items()}, self.comm.world)
                return orphans, held_refs(src, orphans)

            _, found = agree(self.comm, survey, what=f"flush of step {step} to {dst.url}: the files", share=lambda v: v, mode=ALL)
            extra = assign_orphans(found[0][0], [h for _, h in found], step).get(self.comm.rank, [])
            _, ids = agree(self.comm, lambda: upload_step(src, dst, self.comm.rank, pause=self._pause, extra=extra),
                           what=f"flush of step {step} to {dst.url}", share=lambda v: v[1], mode=ALL)
            save_id = commit_save_id(ids, step)

            def commit() -> None:
                if self.comm.rank != 0:
                    return
                data = src.read_bytes(MANIFEST_NAME)
                m = manifest_from_bytes(data, url=src.url)
                if m.save_id != save_id:
                    raise CorruptCheckpointError(
                        f"the local step {step} was saved again (save {m.save_id}) while save {save_id} was uploaded: not committed")
                # The Hugging Face index (not in the manifest's files) goes before the manifest; every file the
                # manifest names, references included, is checked on the remote first: durable means loadable.
                index = src.read_bytes(HF_INDEX_NAME, limit=MAX_INDEX_BYTES) if src.exists(HF_INDEX_NAME) else None
                commit_bytes(dst, data, {rel: f.size for rel, f in m.files.items()}, index=index, create_dirs=not m.files)

            agree(self.comm, commit, what=f"flush of step {step} to {dst.url}: the remote commit")
        except FlushRefused as e:
            log.warning("shardckpt: flush of step %d to %s refused, not retried (durable_step stays %s; the step stays "
                        "committed locally only): %s", step, dst.url, self.durable_step, e)
            return None
        except Exception as e:
            log.warning("shardckpt: flush of step %d to %s failed (it stays uncommitted there; retried unless a newer step "
                        "supersedes it): %s: %s", step, dst.url, type(e).__name__, e)
            if resaved:
                with self._cond:
                    self._resaved.add(step)
            return False
        secs = time.perf_counter() - t0
        self.last_flush = (step, secs)
        log.info("shardckpt: step %d is durable at %s (flushed in %.1f s)", step, dst.url, secs)
        if self.comm.rank == 0 and self.after_commit is not None:
            try:
                self.after_commit(step, resaved)
            except Exception as e:
                log.warning("shardckpt: remote retention after step %d: %s: %s", step, type(e).__name__, e)
        return True



@dataclasses.dataclass(frozen=True)
class Remote:
    """The durable remote root of ``CheckpointManager(root_url, local=DIR)``: where it is, its retention, its restore's file check.

    Restore reads it as one of its sources (``_managed.restore.RootSource``);
    the flusher writes it; :meth:`Tiers.retain_remote` applies ``keep_last``
    and ``keep_every`` on it.
    """

    root: Storage
    keep_last: Optional[int] = None
    keep_every: Optional[int] = None
    storage_options: Optional[Dict[str, Any]] = None
    check_files: bool = True

    @property
    def root_url(self) -> str:
        return self.root.url

    def steps(self) -> List[int]:
        """Committed steps on the remote, oldest first (a fresh listing)."""
        return retention.scan(self.root)[0]

    def step_url(self, step: int) -> str:
        return self.root.url_of(step_dir_name(step))


class Tiers:
    """The local and remote tiers of ``CheckpointManager(root_url, local=DIR)``: the remote, the flusher, both retentions, the run.

    The manager saves, retains and restores on the local directory as
    usual and asks this object what differs: which local steps retention
    must keep (:meth:`retention`), the remote's retention
    (:meth:`retain_remote`), and what is durable (:attr:`durable_step`).
    Restore reads the remote and the local directory as two of its
    sources (``_managed.restore``; per-node directories: :class:`PerNodeSource`).

    Args:
        remote: the remote root (:class:`Remote`).
        keep_local: local steps to keep besides those being flushed.
        on_durable: every rank, after each remote commit, with the step.
    """

    def __init__(
        self,
        remote: Remote,
        *,
        keep_local: int,
        on_durable: Optional[Callable[[int], None]],
    ):
        self.remote = remote
        self.keep_local = keep_local
        self.on_durable = on_durable
        self.step_dir = step_dir_name
        self.flusher: Optional[Flusher] = None
        #: This run's identity (``_managed.identity``), every rank: agreed at the first restore or save; None until then.
        self.run: Optional[str] = None
        #: Per-node: the last local restore's numbers (bytes read here, received, sent, damaged copies; :func:`restore_local_held`).
        self.last_restore: Optional[Dict[str, Any]] = None

    @property
    def remote_url(self) -> str:
        return self.remote.root_url

    def remote_steps(self) -> List[int]:
        return self.remote.steps()

    @property
    def durable_step(self) -> Optional[int]:
        return None if self.flusher is None else self.flusher.durable_step

    def flusher_on(self, local: Storage, comm: Comm) -> Flusher:
        """This rank's flusher (started on first use: the first save or restore, when the comm is known)."""
        if self.flusher is None:
            self.flusher = Flusher(local, self.remote.root, comm, step_dir=self.step_dir,
                                   after_commit=self.retain_remote, on_durable=self.on_durable)
        return self.flusher

    def retention(self, saved: int) -> Dict[str, Any]:
        """The local retention policy: the newest ``keep_local`` steps, and never a step being flushed or waiting to be."""
        pending = self.flusher.protected() if self.flusher is not None else []
        return {"keep_last": self.keep_local, "keep_every": None, "protect": [saved, *pending]}

    def retain_remote(self, flushed: int, resaved: bool = False) -> None:
        """Rank 0's flusher, after step ``flushed`` committed on the remote: ``keep_last``/``keep_every`` there.

        The manager's retention on another root: :func:`_managed.retention.plan_retention`
        over a fresh listing, carried out by :func:`_managed.retention.apply`
        (reference-safe: dropped steps uncommitted first, then only files no
        kept manifest names removed, from them and from the leftovers of
        failed or skipped flushes). After a re-flush (``resaved``) the
        replaced files of ``flushed`` itself go the same way.
        """
        root = self.remote.root
        committed, unfinished = retention.scan(root)  # a fresh listing (caches invalidated)
        plan = retention.plan_retention(committed, [s for s, _ in unfinished], keep_last=self.remote.keep_last,
                                        keep_every=self.remote.keep_every, protect=[flushed])
        retention.apply(root, plan, unfinished, resaved=flushed if resaved else None, label="remote retention")


# -- per-node local directories (a multi-node job whose local= is each node's own disk) ------------------

#: Probe file each rank writes in the local root to tell a shared directory from per-node ones.
PROBE_PREFIX = ".shardckpt-probe-"


def node_groups(seen: List[List[int]]) -> Tuple[bool, List[int]]:
    """From what each rank sees (``seen[r]``: the ranks whose probe rank ``r`` found): ``(shared, lead of each rank)``.

    Shared: every rank sees every probe. Otherwise a rank's node is the
    ranks whose probes it sees; its lead is the lowest of them.

    Example:
        >>> node_groups([[0, 1], [0, 1]])
        (True, [0, 0])
        >>> node_groups([[0, 1], [0, 1], [2, 3], [2, 3]])
        (False, [0, 0, 2, 2])
    """
    world = len(seen)
    shared = all(sorted(s) == list(range(world)) for s in seen)
    return shared, [min(s) if s else r for r, s in enumerate(seen)]


def detect_nodes(local: Storage, comm: Comm) -> Tuple[bool, bool, List[int]]:
    """Collective: ``(shared, lead, leads)``: is ``local`` one directory all ranks see, is this rank its node's lead, each rank's lead.

    Rank 0 draws a token for this probe (shared by one agreement); each
    rank writes a private probe file ``<PROBE_PREFIX><token>-<rank>``, the
    ranks agree (so every probe exists before any rank looks), each lists
    which probes it sees, and a last agreement shares the lists. A rank's
    probe is removed by that rank afterwards.

    Limits: a node whose ranks see different directories under one name
    (a per-rank directory) is taken as one node per rank.
    """
    _, token = agree(comm, lambda: uuid.uuid4().hex[:12] if comm.rank == 0 else None,
                     what=f"probe of the local directory {local.url}", share=lambda v: v, mode=FROM_ROOT)
    mine = f"{PROBE_PREFIX}{token}-{comm.rank}"
    existed = _is_dir(local)
    agree(comm, lambda: local.write_atomic(mine, b""), what=f"probe of the local directory {local.url}")
    prefix = f"{PROBE_PREFIX}{token}-"

    def look() -> List[int]:
        return sorted(int(n[len(prefix):]) for n in local.listdir("") if n.startswith(prefix) and n[len(prefix):].isdigit())

    _, seen = agree(comm, look, what=f"probe of the local directory {local.url}", share=lambda v: v, mode=ALL)

    def unprobe() -> None:
        try:
            local.remove(mine)
        except Exception as e:  # a leftover probe is harmless (a hidden empty file)
            log.warning("shardckpt: cannot remove the probe %s: %s: %s", local.url_of(mine), type(e).__name__, e)

    agree(comm, unprobe, what=f"probe of the local directory {local.url}")
    if not existed:  # a restore on a fresh node leaves no empty directory behind (the ranks of a node race: rmdir is atomic)
        try:
            os.rmdir(local.path(""))
        except (OSError, NotImplementedError, CheckpointError):
            pass  # not empty (a save is next, or another rank's), or not an OS directory
    shared, leads = node_groups(seen)
    return shared, leads[comm.rank] == comm.rank, leads


def _is_dir(local: Storage) -> bool:
    try:
        return os.path.isdir(local.path(""))
    except (NotImplementedError, CheckpointError):
        return True  # not an OS directory: nothing to tidy


def share_manifest(local: Storage, comm: Comm, name: str, *, lead: bool) -> None:
    """Collective, per-node mode, after rank 0 committed ``name`` on its node: every other node's lead writes the same manifest.

    The bytes go from rank 0 (one agreement); each lead writes them
    atomically into its node's ``name/``, so every node's copy of the step
    is committed with the same save id; a second agreement returns once
    they are all written (the flusher reads them next).
    """
    _, data = agree(comm, lambda: local.child(name).read_bytes(MANIFEST_NAME) if comm.rank == 0 else None,
                    what=f"commit of {name} on every node's local directory", share=lambda v: v, mode=FROM_ROOT)

    def write() -> None:
        if lead and comm.rank != 0:
            local.child(name).write_atomic(MANIFEST_NAME, data)

    agree(comm, write, what=f"commit of {name} on every node's local directory")


#: A per-node restore's private staging directory in the local root: a dot-name, so never a step, probe or leftover.
STAGE_PREFIX = ".shardckpt-restore-"


def held_local(local: Storage, step: int, comm: Comm, leads: List[int], *, check: Callable[[], None]) -> Optional[Held]:
    """Collective, per-node: what each rank's node holds of local step ``step``; None unless the nodes hold every file between them.

    Every rank reports its node's copy (``check()`` first: the manifest is
    valid; then the manifest's save id, the step's files and which of them
    its node holds at the right size, :func:`_memory.store.held_files`; no
    file is read). The step is readable when the union of one save's
    copies covers every file of its manifest (:func:`_memory.plan.choose_step`,
    the memory tier's rule); the bytes are verified while they load
    (:func:`restore_local_held`). A node's key is its lead rank.

    Limits: a reference of an incremental step (``@<dir>/<path>``) counts as
    held nowhere, so such a step is not readable here (the remote's is used).
    """
    path = local.path(step_dir_name(step))

    def report() -> memory_plan.Inventory:
        try:
            check()
            m = open_manifest(Storage(path), chunks=False)
            need, held = memory_store.held_files(path, m, os.path.getsize(os.path.join(path, MANIFEST_NAME)))
        except Exception as e:  # this node holds nothing usable of the step: the others may
            log.info("shardckpt: rank %d: local step %d is not on this node (%s: %s)", comm.rank, step, type(e).__name__, e)
            return {}
        return {step: (m.save_id, need, held)}

    _, reports = agree(comm, report, what=f"restore from {local.url}: what each node holds of step {step}", share=lambda v: v, mode=ALL)
    choice = memory_plan.choose_step(reports, None)
    if choice is None or choice[0] != step:
        log.warning("shardckpt: restore: the nodes' local directories do not hold every file of step %d between them", step)
        return None
    sid = choice[1]
    holders, sizes = memory_plan.holders_of(reports, step, sid)
    own = reports[comm.rank].get(step)
    return Held(step=step, save_id=sid, holders=holders, sizes=sizes,
                node_of={r: f"the node of rank {leads[r]}" for r in range(comm.world)},
                own_dir=path, own_held=set(own[2]) if own is not None and own[0] == sid else set())


def remove_stale_stages(root: str, rank: int) -> List[str]:
    """Remove this rank's staging directories in ``root`` that a restore which died left behind; returns their names.

    One process per rank: none of this rank's is in use when it starts a
    restore. Only directories (never a symlink) owned by this user, with
    this rank's suffix; their entries are hard links, so the step's files
    stay.

    Example:
        >>> remove_stale_stages("/nonexistent", 0)
        []
    """
    suffix = f"-r{rank}"
    try:
        names = os.listdir(root)
    except OSError:
        return []
    gone = []
    for name in sorted(names):
        if not (name.startswith(STAGE_PREFIX) and name.endswith(suffix)):
            continue
        path = os.path.join(root, name)
        try:
            st = os.lstat(path)
        except OSError:
            continue
        if stat.S_ISDIR(st.st_mode) and st.st_uid == os.getuid():
            shutil.rmtree(path, ignore_errors=True)
            gone.append(name)
    if gone:
        log.info("shardckpt: removed staging directories a restore of rank %d left in %s: %s", rank, root, gone)
    return gone


def restore_local_held(state: Dict[str, Any], held: Held, local: Storage, comm: Comm, *, process_group: Any,
                       load_kw: Dict[str, Any], stats: Dict[str, Any]) -> Optional[int]:
    """Collective, per-node: load the local step ``held`` describes, each file from a node that holds it; None: it cannot be.

    ``_managed.held.restore_held`` over a private staging directory in
    the local root (``<local>/.shardckpt-restore-<token>-r<rank>``, 0700,
    hard links to this node's files: the same filesystem, no copy; removed
    afterwards). A file no node holds a good copy of: None (logged), and
    the caller restores the remote's step.
    """
    hcomm = load_comm(comm, load_kw)
    if hcomm is None:
        log.info("shardckpt: restore: options only a storage load takes (%s): not loading from the per-node local directories",
                 sorted(load_kw))
        return None
    root = local.path("")
    remove_stale_stages(root, comm.rank)
    try:
        stage = memory_store.make_private_dir(os.path.join(root, f"{STAGE_PREFIX}{uuid.uuid4().hex[:12]}-r{comm.rank}"))
    except OSError as e:  # no local root on this node (it holds nothing): staged copies in the temporary directory
        log.info("shardckpt: restore: cannot stage in %s (%s); staging in the temporary directory", root, e)
        stage = tempfile.mkdtemp(prefix="shardckpt-restore-")
    try:
        return restore_held(state, held, hcomm, stage=stage, process_group=process_group, load_kw=load_kw, stats=stats,
                            label="per-node local directories")
    finally:
        shutil.rmtree(stage, ignore_errors=True)


class PerNodeSource:
    """Per-node ``local=`` directories as a restore source (``_managed.restore.Source``): each file read on a node that holds it.

    :meth:`newest`: rank 0 lists this run's steps on its node's directory
    (``steps``); every node then reports what it holds of the newest one
    (:func:`held_local`, ``check`` first: a valid manifest of this run's
    step), which counts when the nodes hold every file between them.
    :meth:`load`: :func:`restore_local_held`; None (logged) when some file
    has no good copy on any node, and the next source (the remote) restores.
    ``stats``: filled with the load's numbers (bytes read here, received,
    sent, damaged copies).
    """

    name = "per-node directories"

    def __init__(self, local: Storage, comm: Comm, *, leads: List[int], steps: Callable[[], List[int]],
                 check: Callable[[int], None], process_group: Any, load_kw: Dict[str, Any], stats: Dict[str, Any]):
        self.local, self.comm, self.leads, self._steps, self._check = local, comm, leads, steps, check
        self.process_group, self.load_kw, self.stats = process_group, load_kw, stats
        #: The newest step's manifest world size (rank 0's node), None when unknown.
        self.world: Optional[int] = None
        self._held: Optional[Held] = None

    def newest(self, step: Optional[int]) -> Optional[int]:
        def pick() -> Tuple[Optional[int], Optional[int]]:
            own = self._steps()
            got = (own[-1] if own else None) if step is None else (step if step in own else None)
            world = None
            if got is not None:
                try:
                    world = open_manifest(self.local.child(step_dir_name(got)), chunks=False).world_size
                except Exception:  # noqa: BLE001 - unreadable: held_local's check says why
                    world = None
            return got, world

        _, (got, self.world) = agree(self.comm, lambda: pick() if self.comm.rank == 0 else None,
                                     what=f"restore from {self.local.url}", share=lambda v: v, mode=FROM_ROOT)
        if got is None:
            return None
        self._held = held_local(self.local, got, self.comm, self.leads, check=lambda: self._check(got))
        return got if self._held is not None else None

    def load(self, state: Dict[str, Any], step: int, *, exact: bool) -> Optional[Tuple[int, str]]:
        assert self._held is not None and self._held.step == step
        got = restore_local_held(state, self._held, self.local, self.comm, process_group=self.process_group,
                                 load_kw=self.load_kw, stats=self.stats)
        return None if got is None else (got, self.local.url_of(step_dir_name(got)))
