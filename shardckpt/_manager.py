"""CheckpointManager: numbered checkpoints under one root, crash-safe, with retention.

Layout: ``<root>/step-00001000/`` holds one ordinary shardckpt checkpoint per
step (8 digits, zero padded, so names sort; bigger steps simply get more
digits). A step is *committed* once its ``manifest.json`` exists — the engine
writes it last, after every rank's data is durable, on local disk and object
stores alike (no rename needed). Everything else under a step directory
without a manifest is a leftover of a save that did not finish: ``restore``
ignores it and the next successful save removes it.

Retention runs on rank 0 after a new step commits: it keeps the newest
``keep_last`` committed steps, every step divisible by ``keep_every``, and the
step just saved; it deletes the others, manifest first (so a crash in the
middle leaves an uncommitted leftover, never a committed step with missing
files). Every rank waits for it (one agreement) before ``save`` returns (or,
async, before the handle's ``result()`` does), so ``steps()`` then lists the
same steps on every rank.

This class holds the lifecycle, the argument checks and the agreements
between ranks; the decisions and the I/O behind them are in
``shardckpt._managed`` (``retention``, ``restore``, ``owners``, ``memory``,
``exports``), each testable alone, and the local/remote tiers in ``_flush``.
"""

from __future__ import annotations

import contextlib
import dataclasses
import logging
import os
import time
from typing import TYPE_CHECKING, Any, Dict, List, Optional, Tuple, cast

from ._async import AsyncSaveHandle, start_async, wait_pending
from ._collective import FROM_ROOT, Comm, NoProcessGroupError, agree, open_comm
from ._flush import Remote, Tiers, detect_nodes, share_manifest
from ._format import MANIFEST_NAME
from ._format.naming import parse_step_dir, step_dir_name
from ._load import load
from ._managed import exports, identity, owners, retention
from ._managed import restore as order
from ._managed.exports import HF_SUFFIX
from ._managed.memory import open_memory, warm_memory
from ._managed.memory import save_to_memory as memory_save
from ._managed.options import (
    FlatOptions,
    LastSaveOptions,
    ManagerOptions,
    ResumeOptions,
    RetentionOptions,
    ScheduleOptions,
    TierOptions,
    WriteOptions,
)
from ._managed.retention import UNKNOWN, check_step, stale_leftovers, steps_to_delete
from ._managed.runs import RunSteps
from ._managed.sources import Places, resume_flush, sources
from ._save import execute_save, prepare_save
from ._storage import Storage
from .errors import (
    CheckpointError,
    LoadFailedError,
    SaveFailedError,
    StorageError,
    UsageError,
    format_offenders,
)

if TYPE_CHECKING:  # pragma: no cover
    from torch.distributed import ProcessGroup
    from typing_extensions import Unpack

__all__ = ["CheckpointManager", "step_dir_name", "parse_step_dir", "steps_to_delete", "stale_leftovers"]

log = logging.getLogger("shardckpt")

#: How a refused save of a committed step says what to do.
FORCE_HINT = "pass force=True to replace it"

class CheckpointManager:
    """Numbered, crash-safe checkpoints under ``root_url``, with retention and async saves.

    Every rank creates the manager with the same arguments and calls
    :meth:`save` and :meth:`restore` together (they are collective when a
    process group exists). Every exchange between ranks is bounded by
    ``collective_timeout_s``: a dead, stuck or absent rank makes the others
    raise (naming it), never hang.

    Options come in groups, each a frozen dataclass passed as one keyword (docs/manager.md, "Options"); every
    field also works as a flat keyword (``keep_last=3`` is ``retention=RetentionOptions(keep_last=3)``).

    Args:
        root_url: directory or fsspec URL under which ``step-<8 digits>/`` (e.g. ``step-00001000/``)
            checkpoints live. One manager (one training job) per root.
        retention: ``RetentionOptions(keep_last, keep_every, keep_local)``: which committed steps stay.
        schedule: ``ScheduleOptions(save_interval, enable_first_step_checkpoint, load_only)``: :meth:`should_save`'s answer.
        tiers: ``TierOptions(local, memory, on_durable)``: a node-local directory every save commits to first, flushed
            to ``root_url`` in the background (:attr:`remote_url`, :attr:`durable_step`); a memory tier (:meth:`save_to_memory`).
        writes: ``WriteOptions(async_save, reuse_buffers, incremental, replicas)``: how each save writes.
        resume: ``ResumeOptions(check_files, initial_load_path, initial_load_model_only)``: what :meth:`restore` checks,
            and what a fresh run starts from (torchtitan's options).
        last_save: ``LastSaveOptions(model_only, export_dtype, in_hf)``: what ``save(..., last_step=True)`` writes.
        storage_options: passed to fsspec.
        process_group: ranks that save and restore (default: the world).
        io_threads: parallel readers/writers per rank (default: each operation's own: ``SHARDCKPT_IO_THREADS``
            for saves and CPU loads, ``SHARDCKPT_LOAD_CUDA_IO_THREADS`` for loads into GPUs).
        collective_timeout_s: bound of every exchange between ranks the manager runs (default
            ``SHARDCKPT_COLLECTIVE_TIMEOUT_S``, as for :func:`shardckpt.save`).
        **flat: the groups' fields by their flat names (``FlatOptions``).

    Raises:
        ValueError: ``keep_last``, ``keep_every``, ``keep_local`` or ``save_interval`` not a positive int.
        UsageError: ``root_url`` is empty or blank; ``local`` is blank, the remote root itself.
        TypeError: a keyword the manager does not take.

    Example:
        >>> import torch, shardckpt, tempfile
        >>> model = torch.nn.Linear(2, 2)
        >>> with shardckpt.CheckpointManager(tempfile.mkdtemp(), keep_last=2) as mgr:
        ...     for step in range(1, 6):
        ...         mgr.save(step, {"model": model, "step": step})
        ...     mgr.steps()
        [4, 5]
        >>> shardckpt.CheckpointManager(mgr.root_url).restore({"model": model, "step": 0})
        5

    Limits: steps are ordered by number. After resuming from an older step,
    newer steps of the abandoned run stay (and win :meth:`restore`) until
    deleted with :meth:`delete` or overwritten with ``save(..., force=True)``.
    """

    def __init__(
        self,
        root_url: str,
        *,
        retention: Optional[RetentionOptions] = None,
        schedule: Optional[ScheduleOptions] = None,
        tiers: Optional[TierOptions] = None,
        writes: Optional[WriteOptions] = None,
        resume: Optional[ResumeOptions] = None,
        last_save: Optional[LastSaveOptions] = None,
        storage_options: Optional[Dict[str, Any]] = None,
        process_group: Optional["ProcessGroup"] = None,
        io_threads: Optional[int] = None,
        collective_timeout_s: Optional[float] = None,
        **flat: Unpack[FlatOptions],
    ):
        if isinstance(root_url, str) and not root_url.strip():
            raise UsageError(f"CheckpointManager: root_url {root_url!r} is blank; pass the directory or URL under which "
                             "step checkpoints live, e.g. CheckpointManager('checkpoints/run1')")
        #: Every option, grouped (``_managed.options.ManagerOptions``): the flat keywords mapped to their groups once, here.
        self.options = o = ManagerOptions.of(dict(retention=retention, schedule=schedule, tiers=tiers, writes=writes,
                                                  resume=resume, last_save=last_save), flat)
        if collective_timeout_s is not None and not (isinstance(collective_timeout_s, (int, float)) and collective_timeout_s > 0):
            raise ValueError(f"collective_timeout_s must be a positive number, got {collective_timeout_s!r}")
        #: With ``local=``: the durable remote (``_flush.Remote``), its flusher, both retentions, the run identity (``_flush.Tiers``).
        self._tiers: Optional[Tiers] = None
        #: With ``local=``: ``(shared, lead, each rank's lead)`` once probed (:meth:`_nodes`): one directory for all ranks, or one per node.
        self._layout: Optional[Tuple[bool, bool, List[int]]] = None
        home: Optional[str] = None  # the root this run's tier steps record (``_managed.identity``): with ``local=``, the remote
        local = o.tiers.local
        if local is not None:
            if not isinstance(local, (str, os.PathLike)) or not str(local).strip():
                raise UsageError(f"CheckpointManager: local must be a directory path, got {local!r}")
            remote = Remote(Storage(root_url, storage_options=storage_options), keep_last=o.retention.keep_last,
                            keep_every=o.retention.keep_every, storage_options=dict(storage_options) if storage_options else None,
                            check_files=o.resume.check_files)
            if Storage(os.fspath(local)).url == remote.root.url:
                raise UsageError(f"CheckpointManager: local={local!r} is the remote root itself; give it a node-local directory")
            # incremental=True: references resolve on each side (the flusher uploads what a step references).
            self._tiers = Tiers(remote, keep_local=o.retention.keep_local, on_durable=o.tiers.on_durable)
            home = remote.root.url
            root_url, storage_options = os.fspath(local), None  # saves, claims and local retention run on the local directory
        self.root = Storage(root_url, storage_options=storage_options)
        self.root_url = self.root.url
        self.storage_options = dict(storage_options or {})
        self.process_group = process_group
        self.io_threads = io_threads  # None: each save/export reads SHARDCKPT_IO_THREADS; a load picks by target device
        self.collective_timeout_s = None if collective_timeout_s is None else float(collective_timeout_s)  # None: the knob, at each call
        self.export_dtype = exports.parse_export_dtype(o.last_save.export_dtype)
        #: URL the last :meth:`restore` loaded (a step, or ``initial_load_path``); None if nothing.
        self.restored_from: Optional[str] = None
        self._handle: Optional[AsyncSaveHandle] = None
        self._closed = False
        #: Rank 0: one manager per root (``_managed.owners.Claim``): another writer's steps refuse the next save.
        self._claims = owners.Claim(self.root_url)
        #: With ``local=``: which local steps are this run's (``_managed.runs.RunSteps``).
        self._runs = RunSteps(self.root, home) if home is not None else None
        # With local=, the memory copy is the remote root's (not the local directory's: node-local paths are reused across jobs).
        self._memory = open_memory(o.tiers.memory, home or self.root_url)

    def __repr__(self) -> str:
        o = self.options
        return f"CheckpointManager({self.root_url!r}, keep_last={o.retention.keep_last}, keep_every={o.retention.keep_every}, async_save={o.writes.async_save})"

    # -- names ----------------------------------------------------------------

    def step_url(self, step: int) -> str:
        """URL of a step's checkpoint (usable with ``shardckpt.load``/``inspect``/``verify``)."""
        return self.root.url_of(step_dir_name(check_step(step)))

    def _nodes(self, comm: Comm) -> Tuple[bool, bool, List[int]]:
        """``(shared, lead, leads)`` of the local directory (collective the first time, with ``local=``; :func:`_flush.detect_nodes`).

        Without ``local=``: ``(True, rank 0, [0] * world)``. Probed once, at the first
        save or restore: every rank sees one directory (one node, or a
        shared file system), or each node has its own (per-node disks).
        """
        if self._tiers is None:
            return True, comm.rank == 0, [0] * comm.world
        if self._layout is None:
            self._layout = detect_nodes(self.root, comm)
            if not self._layout[0]:
                log.info("shardckpt: %s is a per-node directory (rank %d%s)", self.root_url, comm.rank,
                         ", its node's lead" if self._layout[1] else "")
        return self._layout

    def _comm(self, op: str, error=SaveFailedError) -> Comm:
        try:
            return open_comm(self.process_group, collective_timeout_s=self.collective_timeout_s, op=op, error=error)
        except NoProcessGroupError:
            # open_comm's hint (no_dist=True) is for save/load: the manager takes no such argument.
            raise UsageError(
                f"{op}: WORLD_SIZE={os.environ.get('WORLD_SIZE')} (a torchrun job) but no process group is initialised, "
                "so the ranks would race on one root. Call torch.distributed.init_process_group() before the "
                "manager's first save/restore (every rank then calls it together); for one process alone, run it "
                "without torchrun (WORLD_SIZE unset or 1)"
            ) from None

    # -- listing ----------------------------------------------------------------

    def steps(self) -> List[int]:
        """Committed steps, oldest first (a step whose ``manifest.json`` exists).

        Not collective. A save still running in the background is not listed
        until it commits (call :meth:`wait` first to include it).
        """
        return retention.scan(self.root)[0]

    def latest_step(self) -> Optional[int]:
        """The newest committed step, or None."""
        s = self.steps()
        return s[-1] if s else None

    def should_save(self, step: int) -> bool:
        """True when ``step`` is a multiple of ``save_interval`` (or 1 with ``enable_first_step_checkpoint``).

        Always False with ``load_only``.
        """
        step, sched = check_step(step), self.options.schedule
        if sched.load_only:
            return False
        return step % sched.save_interval == 0 or (sched.enable_first_step_checkpoint and step == 1)

    def hf_url(self, step: int) -> str:
        """Where ``last_save_in_hf`` writes step ``step``'s Hugging Face directory."""
        return self.step_url(step) + HF_SUFFIX

    # -- save -------------------------------------------------------------------

    def save(
        self, step: int, state: Dict[str, Any], *, force: bool = False, last_step: bool = False
    ) -> Optional[AsyncSaveHandle]:
        """Save ``state`` as step ``step``; commit, then apply retention (collective).

        With ``async_save=True`` it returns once the state is staged and the
        rest runs in the background; errors come from the returned handle's
        ``result()``, :meth:`wait`, or the next :meth:`save`.

        Leftovers of an unfinished save of the same step are removed first;
        those of other steps after this one commits.

        Args:
            step: non-negative int.
            state: as for :func:`shardckpt.save`.
            force: replace a committed checkpoint of the same step; the old
                one stays loadable until the new one commits, and its files
                that other committed steps reference (incremental) are kept.
            last_step: the run's final save: ``last_save_model_only``,
                ``export_dtype`` and ``last_save_in_hf`` apply (the HF
                export is written once the step is committed, after an
                async save completes).

        Returns:
            The ``AsyncSaveHandle`` with ``async_save=True``, else None.

        Raises:
            CheckpointExistsError: ``step`` is committed and ``force`` is False.
            SaveFailedError: a rank failed or died; this step was not committed
                (or a previous async save failed and its error was unseen).
            UnsupportedStateError: a value in ``state`` cannot be saved.
        """
        self._check_open()
        step, last = check_step(step), self.options.last_save
        if self.options.schedule.load_only:
            return None
        if last_step and last.model_only:
            state = {"model": exports.model_only_state(state, self.export_dtype)}
        flusher = self._tiers.flusher if self._tiers is not None else None
        with flusher.yield_to_save() if flusher is not None else contextlib.nullcontext():
            handle = self._save(step, state, force=force)
        if last_step and last.in_hf:
            if handle is not None:
                handle.result()
            comm = self._comm("CheckpointManager.save", error=SaveFailedError)
            if self._layout is not None and not self._layout[0]:  # per-node: only the remote holds every node's files
                cast(Tiers, self._tiers).flusher_on(self.root, comm)
                exports.export_remote_hf(comm, self._tiers, step, dtype=self.export_dtype, io_threads=self.io_threads)
                return handle
            # Rank 0 writes the committed step as a Hugging Face directory; every rank returns when it is there.
            exports.export_hf(comm, self.step_url(step), self.hf_url(step), step=step, dtype=self.export_dtype,
                              storage_options=self.storage_options or None, io_threads=self.io_threads)
            if self._tiers is not None and comm.rank == 0:  # the export goes to the remote too
                self._tiers.flusher_on(self.root, comm).flush_export(step_dir_name(step) + HF_SUFFIX)
        return handle

    def save_to_memory(self, step: int, state: Dict[str, Any], *, overlap: bool = False) -> bool:
        """Keep ``state`` as step ``step`` in the memory tier, with its copy on the peer node (collective).

        Blocks only for the copy of this rank's shard into the host memory
        that keeps it (pinned shared memory, reused across steps: a
        device-to-host copy per tensor for CUDA, a ``memcpy`` for CPU). The
        checksums, the manifest and the copy to the peer rank on the next
        node run in a background thread, overlapped with training. The step
        is *held* (what :meth:`restore` may use) once both copies are
        complete and verified on every rank; until then the previous held
        step stays, untouched. A failure in the background is raised
        (``SaveFailedError``) by the next ``save_to_memory``, ``restore`` or
        ``close``. Storage is not touched: persistent saves stay :meth:`save`'s.

        Args:
            step: the step number; each call's must exceed the held step's.
            state: as for :meth:`save`.
            overlap: return as soon as the copies are queued on a side CUDA
                stream (CPU tensors: copied by the background thread), so the
                copy runs during the next forward and backward. Parameters and
                optimizer state do not change before the next
                ``optimizer.step()``: a one-shot step pre-hook on every
                optimizer in ``state`` makes that step wait for the copy (the
                GPU waits; the host goes on). Module buffers (BatchNorm
                statistics change in forward) are copied before the call
                returns. Limit: anything else that changes a saved tensor
                before the next optimizer step (an EMA update, a manual edit)
                must wait for the next ``save_to_memory`` or ``close``.

        Returns:
            True when the step was copied and its background part started;
            False when the manager has no memory tier or the tier is off (over
            ``max_bytes``, directory missing or full, also when it filled
            after the free-space check: the slot space is reserved before the
            copy; one warning, then storage only).

        Raises:
            ReplicaDivergenceError: ``replicas="check"`` (the manager's, as
                for :meth:`save`) and replicated copies differ; nothing held.
            SaveFailedError: a rank failed or died while saving; the previous
                memory step's background part failed (raised once).
            UnsupportedStateError: a value in ``state`` cannot be saved.
            UsageError: ``step`` is not after the held step; ``overlap=True``
                with no optimizer in ``state``.

        Memory: at most ``2 x (own + peer shard)`` bytes of host memory per
        rank (two steps: the one being written never overwrites the held
        one), plus kilobytes of index and manifest files.

        Example:
            >>> mgr = CheckpointManager("runs/a", memory=True)   # doctest: +SKIP
            >>> loss.backward()                                   # doctest: +SKIP
            >>> mgr.save_to_memory(step, state, overlap=True)     # doctest: +SKIP
            >>> opt.step()   # waits for the copy of the values it replaces  # doctest: +SKIP
        """
        self._check_open()
        step = check_step(step)
        if self._memory is None or self.options.schedule.load_only:
            return False
        comm = self._comm("CheckpointManager.save_to_memory")
        run = None
        if self._tiers is not None:  # the step records this run (_managed.identity), agreed once as a save does
            if self._tiers.run is None:
                _, self._tiers.run = agree(comm, lambda: self._run_of_save() if comm.rank == 0 else None,
                                           what=f"memory save of step {step}: the run", share=lambda v: v, mode=FROM_ROOT)
            run = self._tiers.run
        return memory_save(self._memory, step, state, comm, process_group=self.process_group,
                           io_threads=self.io_threads, overlap=overlap, replicas=self.options.writes.replicas, run=run)

    # -- one manager per root (_managed.owners), whose steps (_managed.runs) ------------------------

    def _claim(self, step: int) -> Optional[str]:
        """Rank 0, before each save: refuse when another writer committed steps under the root since the last save.

        Two managers saving under one root would each apply retention to the
        other's steps (``_managed.owners.Claim``). Returns the base of an
        incremental save (the newest committed step of this run before
        ``step``), None otherwise.
        """
        committed = retention.scan(self.root)[0]
        self._claims.claim(step, committed)
        if not self.options.writes.incremental:
            return None
        earlier = [s for s in committed if s < step]
        if self._runs is not None:  # never a base of another run (its files are not this run's to reference)
            earlier = self._runs.own(earlier, cast(Tiers, self._tiers).run)
        return step_dir_name(earlier[-1]) if earlier else None

    def _run_of_save(self) -> Optional[str]:
        """Rank 0, before a save: the run's identity (with ``local=``; None without): agreed at restore, else inherited, else new."""
        if self._runs is None or self._tiers is None:
            return None
        self._tiers.run = self._runs.run_of_save(self._tiers.run, retention.scan(self.root)[0])
        return self._tiers.run

    # -- save (engine) ---------------------------------------------------------------

    def _save(self, step: int, state: Dict[str, Any], *, force: bool) -> Optional[AsyncSaveHandle]:
        """Claim the root, plan, write and commit step ``step`` (in the background with ``async_save``), then retention."""
        t0 = time.perf_counter()
        comm = self._comm("CheckpointManager.save")
        wait_pending(new_save=True)
        # Rank 0 claims (or checks) the root; its refusal is raised on every rank.
        # With incremental saves rank 0 also names the base (the newest
        # committed step before this one), the same for every rank.
        # With local=, rank 0 also names the run the step belongs to (_managed.identity).
        _, (base, run) = agree(comm, lambda: (self._claim(step), self._run_of_save()) if comm.rank == 0 else None,
                               what=f"save of step {step} under {self.root_url}", share=lambda v: v, mode=FROM_ROOT)
        extra: Dict[str, Any] = {"step": step}
        if self._tiers is not None:
            self._tiers.run = run
            extra = identity.stamp(step, root=self._tiers.remote_url, run=run)
        url = self.step_url(step)
        try:
            # content_hash: the first step of an incremental run too (later ones reference it).
            plan = prepare_save(state, url, comm=comm, storage_options=self.storage_options or None, overwrite=force,
                                io_threads=self.io_threads, extra=extra, exists_hint=f"step {step} is already committed; {FORCE_HINT}",
                                incremental=base, content_hash=self.options.writes.incremental, replicas=self.options.writes.replicas)
        except CheckpointError:
            raise
        except Exception as e:
            raise SaveFailedError(f"save of step {step} to {url} failed: {type(e).__name__}: {e}") from e
        if not self._nodes(comm)[0]:  # per-node local disks: rank 0's commit cannot see the other nodes' files
            plan = dataclasses.replace(plan, files_here=False)
        if force and plan.rank == 0:  # only rank 0 commits, and so removes the replaced files
            plan = dataclasses.replace(plan, keep_files=retention.referenced_files(self.root, step))
        if self.options.writes.async_save:
            return self._save_async(plan, step, force=force, t0=t0)
        try:
            if plan.rank == 0:
                retention.clear_unfinished(self.root, step_dir_name(step), clear=self._clear_dir)
            execute_save(plan)
        except CheckpointError:
            raise
        except Exception as e:
            raise SaveFailedError(
                f"save of step {step} to {url} failed on rank {plan.rank}: {type(e).__name__}: {e}. "
                "restore() only ever picks committed steps."
            ) from e
        try:
            self._after_commit(comm, step, force=force)
        except Exception as e:  # committed; housekeeping trouble must not fail training
            log.warning("shardckpt: after committing step %d: %s: %s", step, type(e).__name__, e)
        return None

    def _save_async(self, plan: Any, step: int, *, force: bool, t0: float) -> AsyncSaveHandle:
        """Start the background part of an async save of ``plan`` (step ``step``); its handle."""
        name, url = step_dir_name(step), self.step_url(step)

        def precheck() -> Optional[str]:
            if not force and self.root.exists(f"{name}/{MANIFEST_NAME}"):
                return f"step {step} is already committed at {url}; {FORCE_HINT}"
            return None

        try:
            self._handle = start_async(plan, precheck=precheck, before=lambda: retention.clear_unfinished(self.root, name, clear=self._clear_dir),
                                       after=lambda c: self._after_commit(c, step, force=force), reuse_buffers=self.options.writes.reuse_buffers, t0=t0)
        except CheckpointError:
            raise
        except Exception as e:
            raise SaveFailedError(f"save of step {step} to {url} failed: {type(e).__name__}: {e}") from e
        return self._handle

    def _after_commit(self, comm: Comm, step: int, *, force: bool = False) -> None:
        """Every rank, once step ``step`` is committed: hand it to the flusher (``local=``), then retention.

        ``force``: a re-save of ``step``; the flusher uploads it again even if an earlier copy was flushed.
        """
        if self._layout is not None and not self._layout[0]:  # per-node: every node's copy is committed before it is flushed
            share_manifest(self.root, comm, step_dir_name(step), lead=self._layout[1])
        if self._tiers is not None:  # before retention: the pending step is protected
            self._tiers.flusher_on(self.root, comm).submit(step, resave=force)
        self._retain(comm, step)

    def _retain(self, comm: Comm, saved: int) -> None:
        """Retention (:func:`_managed.retention.plan_retention`), then leftovers, on rank 0 (per-node local disks: on each node's lead, for its directory); every rank returns once it is done.

        Another node's lead does not check for other writers (rank 0 alone
        claims the run). Trouble is logged, never raised: the step is committed.
        """
        lead = comm.rank == 0 or (self._layout is not None and not self._layout[0] and self._layout[1])

        def housekeeping() -> None:
            if not lead:
                return
            try:
                committed, partial = retention.scan(self.root)
                foreign = self._claims.not_ours(committed) if comm.rank == 0 else []
                if foreign:
                    log.warning(
                        "shardckpt: step %d committed, retention skipped: steps %s were committed under %s by another "
                        "writer (this manager's next save raises ConcurrentUseError)", saved, format_offenders(foreign), self.root_url,
                    )
                    return
                if self._runs is not None and self._tiers is not None:  # a shared local directory: another run's steps are never this run's to delete
                    committed = self._runs.own(committed, self._tiers.run)
                policy = (self._tiers.retention(saved) if self._tiers is not None else
                          {"keep_last": self.options.retention.keep_last, "keep_every": self.options.retention.keep_every, "protect": [saved]})
                plan = retention.plan_retention(committed, [s for s, _ in partial], **policy)
                retention.apply(self.root, plan, partial, clear=self._clear_dir)
            except Exception as e:  # committed; housekeeping trouble must not fail training
                log.warning("shardckpt: retention after step %d: %s: %s", saved, type(e).__name__, e)

        agree(comm, housekeeping, what=f"retention after step {saved}")

    # -- deletions on the root (_managed.retention) ------------------------------------------

    def _clear_dir(self, name: str, live: Any = UNKNOWN, *, dry_run: bool = False) -> List[str]:
        return retention.clear_dir(self.root, name, live, dry_run=dry_run)

    # -- local first, then remote (shardckpt/_flush.py's Tiers; docs/manager.md) ---------------------------

    @property
    def remote_url(self) -> Optional[str]:
        """With ``local=``: the durable remote root (``root_url`` is then the local directory); else None."""
        return None if self._tiers is None else self._tiers.remote_url

    def remote_steps(self) -> List[int]:
        """With ``local=``: the steps committed on the remote (flushed whole), oldest first; else :meth:`steps`."""
        return self.steps() if self._tiers is None else self._tiers.remote_steps()

    @property
    def durable_step(self) -> Optional[int]:
        """The newest step committed on the remote by this job's flushes (or found there by :meth:`restore`).

        Without ``local=``, every committed step is durable: the newest
        committed step (:meth:`latest_step`, one listing).
        """
        return self.latest_step() if self._tiers is None else self._tiers.durable_step

    # -- restore ----------------------------------------------------------------

    def restore(self, state: Dict[str, Any], step: Optional[int] = None, **load_kw: Any) -> Optional[int]:
        """Load the newest restorable step (or ``step``) into ``state`` in place (collective).

        Waits for a save in flight first. Newest first, a step is skipped (with
        a warning) when its manifest is missing or invalid or, with
        ``check_files``, one of its files is missing or has the wrong size;
        rank 0 picks and every rank loads the same step. Checksums are
        verified while reading: a damaged chunk raises instead of silently
        falling back.

        With a memory tier (``memory=``) and no ``step``, the newest step held
        in the live ranks' memory wins when it is at least as new as the
        storage step: each rank takes its files from its own node, else a peer
        over the process group, each file verified first; a damaged copy is
        fetched from the next holder, and with no good copy left the storage
        step is restored (logged). ``restored_from`` is then ``"memory:<step>"``.
        Then (whatever was restored, or nothing) the tier's slots for
        ``state`` are made and pinned in the background, so the first
        ``save_to_memory`` allocates nothing (a fresh optimizer: after its
        first ``step()``; ``docs/manager.md``, "the warm-up").

        One restore over every place a step may be (``_managed.restore``):
        each is a source (memory; with ``local=`` the per-node or shared
        local directory and the remote; else this root) asked for the newest
        step *of this run* it holds; the newest wins (a tie: the faster
        source), and a copy that cannot be loaded falls through to the next.
        With ``local=``, a local step of another root or run (node-local
        scratch reused by another job) is ignored, logged once naming its
        root, and left in place (``_managed.identity``).

        Args:
            state: live state, as for :func:`shardckpt.load`.
            step: restore exactly this step instead of the newest.
            **load_kw: passed to :func:`shardckpt.load` (``strict=False``...).

        Returns:
            The restored step, or None when nothing is committed (``state``
            untouched; a warning when the root does not even exist).

        Raises:
            CheckpointNotFoundError: ``step`` was given and is not committed.
            NewerFormatError: the newest undamaged step was written by a newer
                shardckpt (never a silent resume of an older step).
            CorruptCheckpointError: every committed step is damaged and
                ``initial_load_path`` is set (never a silent start over);
                or as :func:`shardckpt.load`.
            StateMismatchError: as :func:`shardckpt.load`.

        Example:
            >>> step = CheckpointManager("runs/a").restore({"model": model, "step": 0})  # doctest: +SKIP

        Limits: a step directory whose manifest records another step is
        skipped like damage (a hand copy).
        """
        self._check_open()
        s = None if step is None else check_step(step)
        if "process_group" in load_kw:
            raise TypeError("restore() takes the manager's process_group; do not pass process_group")
        # A failed background save stays pending for the next save()/wait():
        # it must not stand in the way of recovering.
        wait_pending(raise_unobserved=False)
        comm = self._comm("CheckpointManager.restore", error=LoadFailedError)
        if self.io_threads is not None:
            load_kw.setdefault("io_threads", self.io_threads)
        load_kw.setdefault("collective_timeout_s", self.collective_timeout_s)
        o = self.options
        places = Places(self.root, self.storage_options, self.process_group, self._memory, self._tiers, self._runs,
                        self._nodes(comm), o.resume.check_files, o.resume.initial_load_path, o.schedule.load_only)
        found_in = sources(places, state, comm, load_kw)
        got = order.restore_from(found_in, state, s, probed=resume_flush(places, comm, found_in))
        if got is None and s is not None:
            got = found_in[-1].load(state, s, exact=True)  # held nowhere: the durable source says why (not committed there)
        if got is None and s is None and isinstance(found_in[-1], order.RootSource) and found_in[-1].error is not None:
            raise StorageError(f"restore: nothing of this run to restore here, and {found_in[-1].error}")
        if got is not None:
            self.restored_from = got[1]
        elif s is None and o.resume.initial_load_path is not None:
            # A fresh run: start from the given weights (torchtitan's
            # initial_load_path). Once the run has its own steps they win.
            target = order.initial_target(state, model_only=o.resume.initial_load_model_only)
            load(target, o.resume.initial_load_path, process_group=self.process_group, **load_kw)
            self.restored_from = o.resume.initial_load_path
        if self._memory is not None and not o.schedule.load_only:
            # The memory tier's slots for this state, made in the background now: the first save_to_memory
            # then neither allocates nor pins (seconds for a large shard, else paid inside a training step).
            warm_memory(self._memory, state, self._comm("CheckpointManager.restore", error=LoadFailedError),
                        process_group=self.process_group, replicas=o.writes.replicas)
        return None if got is None else got[0]

    # -- lifecycle ----------------------------------------------------------------

    def wait(self) -> None:
        """Finish the save in flight; raise its error if nobody has seen it.

        With ``memory=``, also waits until the memory step in flight is held
        (both copies verified). With ``local=``, also waits until the newest
        saved step is flushed to the remote or its flush is refused for good
        (logged once: files no live rank holds); a failed flush is retried
        and waited for (``close(flush_timeout_s=)`` bounds it).

        Raises:
            SaveFailedError: the background save, or the memory step in flight, failed.
        """
        wait_pending()
        if self._memory is not None:
            self._memory.snapshots.wait()
        if self._tiers is not None and self._tiers.flusher is not None:
            self._tiers.flusher.wait()

    def cleanup(self, *, dry_run: bool = False) -> List[str]:
        """Remove leftovers of unfinished saves; returns what was removed (rank 0).

        Removes step directories without a manifest below the newest committed
        step (a newer one may be a save in flight in another process:
        :func:`stale_leftovers`), and inside committed steps any file the
        manifest does not list (data of a crashed ``force`` save, temporary
        manifest files). Waits for this manager's save in flight first. Only
        rank 0 deletes; on other ranks this is a no-op returning ``[]``.

        Reference-safe (incremental steps): a file that a committed step's
        manifest names is never removed, wherever it lies; a directory
        without a manifest that still holds such files (a step retention
        dropped while later steps reference its bytes) keeps exactly those.
        This is ``shardckpt gc ROOT``; ``dry_run`` lists without removing.

        Limits: safe to run while another process saves forward (every step
        it commits stays whole); not while another process re-saves an older
        committed step with ``force=True`` (its new files are not yet listed).
        """
        self._check_open()
        wait_pending(raise_unobserved=False)
        if self._comm("CheckpointManager.cleanup").rank != 0:
            return []
        return retention.collect_garbage(self.root, dry_run=dry_run)

    def delete(self, step: int) -> None:
        """Delete a step (manifest first, then its files). Rank 0 only; others no-op."""
        self._check_open()
        step = check_step(step)
        wait_pending(raise_unobserved=False)
        if self._comm("CheckpointManager.delete").rank == 0:
            name = step_dir_name(step)
            # Uncommit first: if we die half way, what remains is a leftover that
            # restore skips, never a committed step with missing files.
            retention.uncommit(self.root, name)
            self._clear_dir(name)

    def close(self, *, flush_timeout_s: Optional[float] = None) -> None:
        """Wait for the save in flight (raising its unseen error); further calls raise.

        With ``local=``, then flushes what is pending to the remote, waiting
        at most ``flush_timeout_s`` (None: until done); a step left unflushed
        stays committed locally (logged) and the next run's ``restore()``
        flushes it.
        """
        if self._closed:
            return
        self._closed = True
        try:
            wait_pending()
        finally:
            if self._memory is not None:
                self._memory.close()
            if self._tiers is not None and self._tiers.flusher is not None:
                self._tiers.flusher.close(flush_timeout_s)

    def __enter__(self) -> "CheckpointManager":
        return self

    def __exit__(self, exc_type, exc, tb) -> None:
        if exc_type is None:
            self.close()
            return
        try:
            self.close()
        except Exception as e:  # keep the original exception; log the second
            log.error("shardckpt: while closing after %s: %s: %s", exc_type.__name__, type(e).__name__, e)

    def _check_open(self) -> None:
        if self._closed:
            raise CheckpointError(f"{self!r} is closed")
