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
"""

from __future__ import annotations

import dataclasses
import errno
import logging
import operator
import os
import re
import time
import uuid
from concurrent.futures import ThreadPoolExecutor
from typing import TYPE_CHECKING, Any, Callable, Dict, FrozenSet, Iterable, List, Optional, Set, Tuple, cast

from . import _fingerprint
from ._async import AsyncSaveHandle, start_async, wait_pending
from ._collective import FROM_ROOT, Comm, NoProcessGroupError, agree, open_comm
from ._flush import Tiers
from ._format import HF_INDEX_NAME, MANIFEST_NAME, open_manifest, torch_dtype
from ._format.committed import _nearby
from ._format.refs import follow, live_files, removable
from ._io import check_files
from ._load import load
from ._memory import MemoryTier
from ._memory.tier import MemoryStore
from ._runtimes import unwrap
from ._save import DATA_DIR, execute_save, prepare_save
from ._storage import Storage
from .errors import (
    CheckpointError,
    CheckpointNotFoundError,
    ConcurrentUseError,
    CorruptCheckpointError,
    LoadFailedError,
    NewerFormatError,
    SaveFailedError,
    StorageError,
    UsageError,
    format_offenders,
)

if TYPE_CHECKING:  # pragma: no cover
    from torch.distributed import ProcessGroup

__all__ = ["CheckpointManager", "step_dir_name", "parse_step_dir", "steps_to_delete", "stale_leftovers"]

log = logging.getLogger("shardckpt")

STEP_PREFIX = "step-"
STEP_DIGITS = 8
_STEP_RE = re.compile(r"^step-(\d+)$")


#: Steps saved under each root by any manager of this process. Managers of one
#: process are one job (one save in flight per process, ``_async``): their
#: steps are never "another writer's" to each other.
_SAVED_IN_PROCESS: Dict[str, Set[int]] = {}

#: Root URL -> token of the manager of this process that saved there last. A
#: manager that saved before and finds another's token was taken over by a
#: second manager on its root in this process (see ``_claim``).
_ROOT_OWNER: Dict[str, str] = {}

#: Attempts of restore() when the step it picked is deleted while it loads (another process's retention).
RESTORE_ATTEMPTS = 3

#: Local steps ``CheckpointManager(..., local=DIR)`` keeps besides those not flushed yet (docs/manager.md).
DEFAULT_KEEP_LOCAL = 2

#: Suffix of the directory ``last_save_in_hf`` writes next to a step (``step-00001000-hf``).
HF_SUFFIX = "-hf"


def _export_dtype(dtype: Any) -> Any:
    # The converters package imports every converter: only when a dtype is given.
    from .converters._options import parse_dtype

    return parse_dtype(dtype)


def _model_state(state: Dict[str, Any], dtype: Any) -> Any:
    """``state["model"]`` for a model-only save, its floating-point tensors cast to ``dtype`` when given.

    Cast copies keep ties: a tensor under several names is cast once and,
    as ``save_pretrained`` does, kept under its first name only.
    """
    if not isinstance(state, dict) or "model" not in state:
        raise UsageError(
            "CheckpointManager: last_save_model_only saves state['model'], and the state has no 'model' entry "
            f"(it has {format_offenders(list(state) if isinstance(state, dict) else [])})"
        )
    model = state["model"]
    if dtype is None:
        return model
    import torch

    sd = unwrap(model).state_dict(keep_vars=True) if isinstance(model, torch.nn.Module) else model
    if not isinstance(sd, dict):
        raise UsageError(f"CheckpointManager: export_dtype needs state['model'] to be a module or a dict, got {type(model).__name__}")
    out, seen = {}, set()
    with torch.no_grad():
        for k, v in sd.items():
            if isinstance(v, torch.Tensor):
                if id(v) in seen:
                    continue
                seen.add(id(v))
                v = v.detach()
                if v.is_floating_point():
                    v = v.to(torch_dtype(dtype))
            out[k] = v
    return out


def step_dir_name(step: int) -> str:
    """``step-00001000`` for step 1000 (sortable; more digits past 99,999,999)."""
    return f"{STEP_PREFIX}{step:0{STEP_DIGITS}d}"


def parse_step_dir(name: str) -> Optional[int]:
    """The step of a directory name made by :func:`step_dir_name`, else None."""
    m = _STEP_RE.match(name.rstrip("/"))
    return int(m.group(1)) if m else None


def steps_to_delete(committed: Iterable[int], *, keep_last: Optional[int], keep_every: Optional[int], protect: Iterable[int] = ()) -> List[int]:
    """Committed steps retention removes: all but the newest ``keep_last``,
    multiples of ``keep_every`` and ``protect``. ``keep_last=None`` keeps all."""
    steps = sorted(set(committed))
    if keep_last is None or not steps:
        return []
    keep: Set[int] = set(steps[-keep_last:]) | set(protect)
    if keep_every:
        keep |= {s for s in steps if s % keep_every == 0}
    return [s for s in steps if s not in keep]


#: ``errno``s of an OS error that says a step's own files are damaged (the
#: manifest is a directory, a name too long, a path through a file...), not
#: that storage is unavailable: restore skips such a step like a corrupt one.
_DAMAGE_ERRNOS = frozenset(getattr(errno, n) for n in ("EISDIR", "ENOTDIR", "ELOOP", "ENAMETOOLONG", "ENXIO", "ENODEV", "EINVAL") if hasattr(errno, n))


def stale_leftovers(committed: Iterable[int], unfinished: Iterable[int]) -> List[int]:
    """Steps without a manifest that retention and ``cleanup()`` may remove: those below the newest committed step.

    A step directory without a manifest is either a crashed save's leftover
    or a save in flight, maybe in another process (a ``cleanup()`` loop, a
    second job): removing files under a save about to commit would leave a
    committed step with missing files. Saves go forward, so one below the
    newest committed step is no save in flight; a newer one may be and stays
    (the next save of that step, or the first commit past it, removes it).

    Example:
        >>> stale_leftovers([3, 5], [4, 6])
        [4]
    """
    done = list(committed)
    newest = max(done) if done else None
    return sorted(s for s in set(unfinished) if newest is not None and s < newest)


def _is_damage(e: BaseException) -> bool:
    """Whether ``e``, met while validating a step, means the step is damaged (skip it) rather than storage trouble."""
    if isinstance(e, (CheckpointNotFoundError, CorruptCheckpointError)):
        return True
    if isinstance(e, CheckpointError):
        return False
    if isinstance(e, OSError):
        return e.errno in _DAMAGE_ERRNOS or isinstance(e, (FileNotFoundError, NotADirectoryError, IsADirectoryError))
    # Malformed metadata that a parser failed to turn into our type: still the step's own damage.
    return isinstance(e, (ValueError, TypeError, KeyError, RecursionError, UnicodeError))


#: ``_clear_dir``'s "liveness not computed yet".
_UNKNOWN = object()

#: Largest step number (int64, what trainers count in): a bigger one has no directory name to write.
MAX_STEP = 2**63 - 1


def _check_step(step: Any) -> int:
    try:
        value = operator.index(step)  # ints, numpy ints, 0-d int tensors
    except TypeError:
        value = -1
    if isinstance(step, bool) or not 0 <= value <= MAX_STEP:
        # repr of a 5,000-digit int would itself raise: show its size instead.
        shown = f"an int of {value.bit_length()} bits" if value > MAX_STEP else repr(step)[:80]
        raise UsageError(f"step must be a non-negative int (at most 2**63 - 1), got {shown}")
    return value


def _positive(name: str, v: Any, *, allow_none: bool = True) -> Optional[int]:
    if v is None and allow_none:
        return None
    if isinstance(v, bool) or not isinstance(v, int) or v < 1:
        raise ValueError(f"{name} must be a positive int{' or None' if allow_none else ''}, got {v!r}")
    return v


class CheckpointManager:
    """Numbered, crash-safe checkpoints under ``root_url``, with retention and async saves.

    Every rank creates the manager with the same arguments and calls
    :meth:`save` and :meth:`restore` together (they are collective when a
    process group exists). Every exchange between ranks is bounded by
    ``collective_timeout_s``: a dead, stuck or absent rank makes the others
    raise (naming it), never hang.

    Args:
        root_url: directory or fsspec URL under which ``step-<8 digits>/`` (e.g. ``step-00001000/``)
            checkpoints live. One manager (one training job) per root.
        keep_last: committed steps to keep (the newest ones); None keeps all.
        keep_every: also keep every step divisible by this (milestones).
        save_interval: :meth:`should_save` is true every this many steps.
        storage_options: passed to fsspec.
        async_save: :meth:`save` returns once the state is staged in host
            memory and writes in the background (see :func:`shardckpt.async_save`).
        process_group: ranks that save and restore (default: the world).
        io_threads: parallel readers/writers per rank (default: each
            operation's own: ``SHARDCKPT_IO_THREADS`` for saves and CPU
            loads, ``SHARDCKPT_LOAD_CUDA_IO_THREADS`` for loads into GPUs).
        collective_timeout_s: bound of every exchange between ranks the
            manager runs (default ``SHARDCKPT_COLLECTIVE_TIMEOUT_S``, as for
            :func:`shardckpt.save`).
        reuse_buffers: (async) keep staging buffers between saves.
        check_files: before restoring a step, check every data file it lists
            exists with its recorded size (one stat per file; checksums are
            always verified while reading).
        incremental: each save references the chunks whose bytes the newest
            committed step already holds instead of rewriting them
            (:func:`shardckpt.save`'s ``incremental``). Retention then
            deletes a dropped step's files only when no kept step names
            them (docs/manager.md, "Retention with incremental steps").
        replicas: the replica check of every save (:func:`shardckpt.save`'s
            ``replicas``: ``"check"``, ``"warn"`` or ``"off"``; default
            ``SHARDCKPT_REPLICAS``, ``"warn"``).

    torchtitan's checkpointer options (``docs/manager.md``, migration table):

    Args:
        initial_load_path: a checkpoint (shardckpt, or a Hugging Face
            safetensors directory/file) that :meth:`restore` loads when the
            run has no committed step of its own; ignored once it has one.
        initial_load_model_only: (default True, as torchtitan) load only
            ``state["model"]`` from ``initial_load_path``.
        last_save_model_only: ``save(..., last_step=True)`` saves only
            ``state["model"]`` (weights to publish, no optimizer).
        export_dtype: with ``last_save_model_only`` or ``last_save_in_hf``,
            cast floating-point weights of the last save to this dtype
            (``torch.bfloat16``, ``"bf16"``); tied weights stay one tensor.
        last_save_in_hf: ``save(..., last_step=True)`` also writes the model
            as a Hugging Face safetensors directory ``<root>/step-<N>-hf``
            (:func:`converters.to_safetensors`, one name per tied weight).
        enable_first_step_checkpoint: :meth:`should_save` is also true at step 1.
        load_only: :meth:`restore` works, :meth:`save` saves nothing (returns
            None) and :meth:`should_save` is always false.
        memory: a host-memory tier with a copy on a peer node
            (``shardckpt.MemoryTier(...)``, True for its defaults, a
            directory, or a dict of its options): :meth:`save_to_memory`
            keeps the newest step there, and :meth:`restore` takes the
            newest step held in memory or storage (``docs/manager.md``,
            "Memory tier").
        local: a node-local directory: every save commits there (at local
            disk speed) and a background thread on every rank flushes the
            newest step to ``root_url``, the durable remote, committing it
            there last (``docs/manager.md``, "Local first, then remote").
            ``keep_last``/``keep_every`` then apply to the remote;
            ``root_url``/:meth:`step_url` name the local directory and
            :attr:`remote_url` the remote. With ``incremental``, a flush
            also uploads the files the step references that the remote lacks.
        keep_local: (with ``local``) local steps to keep besides the one
            being flushed and the one waiting to be.
        on_durable: (with ``local``) called on every rank with each step
            once it is committed on the remote (in the flusher thread).

    Raises:
        ValueError: ``keep_last``, ``keep_every`` or ``save_interval`` not a
            positive int.
        UsageError: ``root_url`` is empty or blank; ``local`` is blank, the
            remote root itself.

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
        keep_last: Optional[int] = None,
        keep_every: Optional[int] = None,
        save_interval: int = 1,
        storage_options: Optional[Dict[str, Any]] = None,
        async_save: bool = False,
        process_group: Optional["ProcessGroup"] = None,
        io_threads: Optional[int] = None,
        collective_timeout_s: Optional[float] = None,
        reuse_buffers: bool = True,
        check_files: bool = True,
        initial_load_path: Optional[str] = None,
        initial_load_model_only: bool = True,
        last_save_model_only: bool = False,
        export_dtype: Any = None,
        last_save_in_hf: bool = False,
        enable_first_step_checkpoint: bool = False,
        load_only: bool = False,
        memory: Any = None,
        incremental: bool = False,
        replicas: Optional[str] = None,
        local: Optional[str] = None,
        keep_local: int = DEFAULT_KEEP_LOCAL,
        on_durable: Optional[Callable[[int], None]] = None,
    ):
        if isinstance(root_url, str) and not root_url.strip():
            raise UsageError(
                f"CheckpointManager: root_url {root_url!r} is blank; pass the directory or URL under which "
                "step checkpoints live, e.g. CheckpointManager('checkpoints/run1')"
            )
        self.replicas = _fingerprint.replicas_mode(replicas) if replicas is not None else None
        self.keep_last = _positive("keep_last", keep_last)
        self.keep_every = _positive("keep_every", keep_every)
        self.save_interval = _positive("save_interval", save_interval, allow_none=False)
        if collective_timeout_s is not None and not (isinstance(collective_timeout_s, (int, float)) and collective_timeout_s > 0):
            raise ValueError(f"collective_timeout_s must be a positive number, got {collective_timeout_s!r}")
        #: With ``local=``: the durable remote (a read-only manager of ``root_url``), its flusher, both retentions (``_flush.Tiers``).
        self._tiers: Optional[Tiers] = None
        self.on_durable = on_durable
        self.keep_local = _positive("keep_local", keep_local, allow_none=False)
        if local is not None:
            if not isinstance(local, (str, os.PathLike)) or not str(local).strip():
                raise UsageError(f"CheckpointManager: local must be a directory path, got {local!r}")
            remote: Any = CheckpointManager(root_url, storage_options=storage_options, load_only=True, keep_last=keep_last,
                                            keep_every=keep_every, process_group=process_group,
                                            collective_timeout_s=collective_timeout_s, check_files=check_files)
            if Storage(os.fspath(local)).url == remote.root.url:
                raise UsageError(f"CheckpointManager: local={local!r} is the remote root itself; give it a node-local directory")
            # incremental=True: references resolve on each side (the flusher uploads what a step references).
            self._tiers = Tiers(remote, keep_local=cast(int, self.keep_local), on_durable=on_durable, step_dir=step_dir_name,
                                parse_step=parse_step_dir, steps_to_delete=steps_to_delete, stale_leftovers=stale_leftovers)
            root_url, storage_options = os.fspath(local), None  # saves, claims and local retention run on the local directory
        self.root = Storage(root_url, storage_options=storage_options)
        self.root_url = self.root.url
        self.storage_options = dict(storage_options or {})
        self.async_save = bool(async_save)
        self.process_group = process_group
        self.io_threads = io_threads
        # None: each save/export reads SHARDCKPT_IO_THREADS; a load picks by target device.
        self._write_threads = io_threads  # None: SHARDCKPT_IO_THREADS, read at each save
        self.collective_timeout_s = None if collective_timeout_s is None else float(collective_timeout_s)  # None: the knob, at each call
        self.reuse_buffers = reuse_buffers
        self.check_files = check_files
        if initial_load_path is not None and (not isinstance(initial_load_path, str) or not initial_load_path.strip()):
            raise UsageError(f"CheckpointManager: initial_load_path must be a checkpoint URL, got {initial_load_path!r}")
        self.initial_load_path = initial_load_path
        self.initial_load_model_only = bool(initial_load_model_only)
        self.last_save_model_only = bool(last_save_model_only)
        self.export_dtype = None if export_dtype is None else _export_dtype(export_dtype)
        self.last_save_in_hf = bool(last_save_in_hf)
        self.enable_first_step_checkpoint = bool(enable_first_step_checkpoint)
        self.load_only = bool(load_only)
        self.incremental = bool(incremental)
        #: URL the last :meth:`restore` loaded (a step, or ``initial_load_path``); None if nothing.
        self.restored_from: Optional[str] = None
        self._handle: Optional[AsyncSaveHandle] = None
        self._closed = False
        # Rank 0: committed steps this manager has seen or saved (None until
        # its first save); any other step that appears is another writer's.
        self._known: Optional[Set[int]] = None
        self._token = uuid.uuid4().hex
        self._memory = None
        if memory is not None and memory is not False:
            self._memory = MemoryStore(MemoryTier.of(memory), self.root_url)

    def __repr__(self) -> str:
        return f"CheckpointManager({self.root_url!r}, keep_last={self.keep_last}, keep_every={self.keep_every}, async_save={self.async_save})"

    # -- names ----------------------------------------------------------------

    def step_url(self, step: int) -> str:
        """URL of a step's checkpoint (usable with ``shardckpt.load``/``inspect``/``verify``)."""
        return self.root.url_of(step_dir_name(_check_step(step)))

    def _rank(self, op: str) -> int:
        # Through open_comm: under torchrun without a process group every
        # process would think it is rank 0 and delete.
        return self._comm(op).rank

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

    def _scan(self) -> Tuple[List[int], List[Tuple[int, str]]]:
        """``(committed steps, [(step, dir name) without a manifest])``, both sorted."""
        # Listing caches (s3fs, gcsfs) would hide steps committed since.
        self.root.invalidate_cache()
        found = sorted((s, name) for name in self.root.listdir("") for s in [parse_step_dir(name)] if s is not None)
        if not found:
            return [], []

        def committed(item):
            return self.root.exists(f"{item[1]}/{MANIFEST_NAME}")

        if not self.root.caps.high_latency or len(found) <= 2:
            flags = [committed(it) for it in found]
        else:
            with ThreadPoolExecutor(max_workers=min(16, len(found))) as ex:
                flags = list(ex.map(committed, found))
        done = [s for (s, _), ok in zip(found, flags) if ok]
        partial = [it for it, ok in zip(found, flags) if not ok]
        return sorted(set(done)), partial

    def steps(self) -> List[int]:
        """Committed steps, oldest first (a step whose ``manifest.json`` exists).

        Not collective. A save still running in the background is not listed
        until it commits (call :meth:`wait` first to include it).
        """
        return self._scan()[0]

    def latest_step(self) -> Optional[int]:
        """The newest committed step, or None."""
        s = self.steps()
        return s[-1] if s else None

    def should_save(self, step: int) -> bool:
        """True when ``step`` is a multiple of ``save_interval`` (or 1 with ``enable_first_step_checkpoint``).

        Always False with ``load_only``.
        """
        step = _check_step(step)
        if self.load_only:
            return False
        return step % cast(int, self.save_interval) == 0 or (self.enable_first_step_checkpoint and step == 1)

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
        step = _check_step(step)
        if self.load_only:
            return None
        if last_step and self.last_save_model_only:
            state = {"model": _model_state(state, self.export_dtype)}
        handle = self._save(step, state, force=force)
        if last_step and self.last_save_in_hf:
            if handle is not None:
                handle.result()
            self._export_hf(step)
            if self._tiers is not None and self._rank("CheckpointManager.save") == 0:  # the export goes to the remote too
                self._tiers.flusher_on(self.root, self._comm("CheckpointManager.save")).flush_export(step_dir_name(step) + HF_SUFFIX)
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
            ``max_bytes``, directory missing or full: one warning, then
            storage only).

        Raises:
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
        step = _check_step(step)
        if self._memory is None or self.load_only:
            return False
        comm = self._comm("CheckpointManager.save_to_memory")
        return self._memory.save(step, state, comm, process_group=self.process_group, io_threads=self._write_threads,
                                 overlap=bool(overlap))

    def _export_hf(self, step: int) -> None:
        """Rank 0 writes the committed step as a Hugging Face directory; every rank returns when it is there."""
        # The converters package imports every converter: only when exporting.
        from .converters import to_safetensors

        comm = self._comm("CheckpointManager.save", error=SaveFailedError)

        def export() -> None:
            if comm.rank == 0:
                to_safetensors(self.step_url(step), self.hf_url(step), dtype=self.export_dtype, overwrite=True,
                               storage_options=self.storage_options or None,
                               dst_storage_options=self.storage_options or None, io_threads=self._write_threads)

        agree(comm, export, what=f"Hugging Face export of step {step} to {self.hf_url(step)}")

    # -- one manager per root ------------------------------------------------------------

    def _foreign_steps(self) -> List[int]:
        """Rank 0: committed steps this manager did not write and had not seen (another writer's), sorted."""
        committed = self._scan()[0]
        if self._known is None:  # first save: what is there is the past (a restarted run's predecessor)
            self._known = set(committed)
            return []
        return self._not_ours(committed)

    def _not_ours(self, committed: Iterable[int]) -> List[int]:
        """Of ``committed``, the steps neither this manager nor this process saved, nor found at its first save."""
        ours = (self._known or set()) | _SAVED_IN_PROCESS.get(self.root_url, set())
        return sorted(set(committed) - ours)

    def _claim(self, step: int) -> Optional[str]:
        """Rank 0, before each save: refuse when another writer committed steps under the root since the last save.

        Two managers saving under one root would each apply retention to the
        other's steps. Every step that appears without this manager saving
        it is another writer's: this manager then stops saving there.
        """
        owner = _ROOT_OWNER.get(self.root_url)
        if self._known is not None and owner is not None and owner != self._token:
            # Across processes the steps tell (below); in one process the steps
            # of every manager count as this job's, so the owner token does.
            raise ConcurrentUseError(
                f"save of step {step} refused: another CheckpointManager of this process saved under "
                f"{self.root_url} since this one's last save. Two managers must not save under one root (the "
                "retention of one deletes what the other saves). This manager saves no more there; restore() "
                "still works. Keep one manager per root (close() the old one), or give each its own root_url"
            )
        foreign = self._foreign_steps()
        if foreign:
            raise ConcurrentUseError(
                f"save of step {step} refused: steps {format_offenders(foreign)} were committed under {self.root_url} "
                "by another writer since this CheckpointManager's last save. Two managers must not save under one "
                "root (the retention of one deletes what the other saves). This manager saves no more there; "
                "restore() still works. Give each run its own root_url, or stop the other one"
            )
        cast(Set[int], self._known).add(step)
        _ROOT_OWNER[self.root_url] = self._token
        _SAVED_IN_PROCESS.setdefault(self.root_url, set()).add(step)
        if not self.incremental:
            return None
        earlier = [s for s in self._scan()[0] if s < step]
        return step_dir_name(earlier[-1]) if earlier else None

    # -- save (engine) ---------------------------------------------------------------
    # -- save (engine) ---------------------------------------------------------------

    def _save(self, step: int, state: Dict[str, Any], *, force: bool) -> Optional[AsyncSaveHandle]:
        t0 = time.perf_counter()
        comm = self._comm("CheckpointManager.save")
        wait_pending(new_save=True)
        # Rank 0 claims (or checks) the root; its refusal is raised on every rank.
        # With incremental saves rank 0 also names the base (the newest
        # committed step before this one), the same for every rank.
        _, base = agree(comm, lambda: self._claim(step) if comm.rank == 0 else None,
                        what=f"save of step {step} under {self.root_url}", share=lambda v: v, mode=FROM_ROOT)
        url = self.step_url(step)
        name = step_dir_name(step)
        hint = "pass force=True to replace it"
        try:
            plan = prepare_save(
                state,
                url,
                comm=comm,
                storage_options=self.storage_options or None,
                overwrite=force,
                io_threads=self._write_threads,
                extra={"step": step},
                exists_hint=f"step {step} is already committed; {hint}",
                incremental=base,
                content_hash=self.incremental,  # the first step too: later ones reference it
                replicas=self.replicas,
            )
        except CheckpointError:
            raise
        except Exception as e:
            raise SaveFailedError(f"save of step {step} to {url} failed: {type(e).__name__}: {e}") from e
        if force and plan.rank == 0:  # only rank 0 commits, and so removes the replaced files
            plan = dataclasses.replace(plan, keep_files=self._referenced_files(step))

        def before() -> None:
            # Rank 0, before any rank writes (the others wait for its go). It
            # must not raise: rank 0 would skip the save's exchanges and
            # leave its peers waiting. Files left here are not in the new
            # manifest, and cleanup() removes them.
            try:
                if not self.root.exists(f"{name}/{MANIFEST_NAME}"):
                    self._clear_dir(name)
            except Exception as e:
                log.warning("shardckpt: cannot remove leftovers of step %d at %s: %s: %s", step, url, type(e).__name__, e)

        def after(c: Comm) -> None:
            if self._tiers is not None:  # before retention: the pending step is protected
                self._tiers.flusher_on(self.root, c).submit(step, resave=force)
            self._retain(c, step)

        if self.async_save:
            def precheck() -> Optional[str]:
                if not force and self.root.exists(f"{name}/{MANIFEST_NAME}"):
                    return f"step {step} is already committed at {url}; {hint}"
                return None

            try:
                self._handle = start_async(plan, precheck=precheck, before=before, after=after, reuse_buffers=self.reuse_buffers, t0=t0)
            except CheckpointError:
                raise
            except Exception as e:
                raise SaveFailedError(f"save of step {step} to {url} failed: {type(e).__name__}: {e}") from e
            return self._handle
        try:
            if plan.rank == 0:
                before()
            execute_save(plan)
        except CheckpointError:
            raise
        except Exception as e:
            raise SaveFailedError(
                f"save of step {step} to {url} failed on rank {plan.rank}: {type(e).__name__}: {e}. "
                "restore() only ever picks committed steps."
            ) from e
        try:
            after(comm)
        except Exception as e:  # committed; housekeeping trouble must not fail training
            log.warning("shardckpt: after committing step %d: %s: %s", step, type(e).__name__, e)
        return None

    def _retain(self, comm: Comm, saved: int) -> None:
        """Retention on rank 0; every rank returns once it is done, so their ``steps()`` agree."""

        def housekeeping() -> None:
            if comm.rank != 0:
                return
            try:
                self._housekeeping(saved)
            except Exception as e:  # committed; housekeeping trouble must not fail training
                log.warning("shardckpt: retention after step %d: %s: %s", saved, type(e).__name__, e)

        agree(comm, housekeeping, what=f"retention after step {saved}")

    def _housekeeping(self, saved: int) -> None:
        committed, partial = self._scan()
        foreign = self._not_ours(committed)
        if foreign:
            log.warning(
                "shardckpt: step %d committed, retention skipped: steps %s were committed under %s by another "
                "writer (this manager's next save raises ConcurrentUseError)", saved, format_offenders(foreign), self.root_url,
            )
            return
        drop = steps_to_delete(committed, **self._retention(saved))
        # Uncommit the dropped steps first: if we die half way, what remains
        # are leftovers that restore skips, never a committed step with
        # missing files. Then delete only files no kept manifest names
        # (the kept manifests are never touched here).
        for s in drop:
            log.info("shardckpt: retention removes step %d", s)
            self._uncommit(step_dir_name(s))
        stale = set(stale_leftovers(committed, [s for s, _ in partial]))
        if not drop and not stale:
            return  # nothing to delete: no manifest to read
        kept = [s for s in committed if s not in set(drop)]
        live = self._live_files(kept)
        for s, name in partial:
            if s in stale:
                log.info("shardckpt: removing leftovers of an unfinished save: %s", self.root.url_of(name))
                self._clear_dir(name, live)
        for s in drop:
            self._clear_dir(step_dir_name(s), live)

    def _uncommit(self, name: str) -> None:
        try:
            self.root.remove(f"{name}/{MANIFEST_NAME}")
        except FileNotFoundError:
            pass

    def _remove_step(self, step: int) -> None:
        name = step_dir_name(step)
        # Uncommit first: if we die half way, what remains is a leftover that
        # restore skips, never a committed step with missing files.
        self._uncommit(name)
        self._clear_dir(name)

    def _referenced_files(self, step: int) -> Optional[FrozenSet[str]]:
        """Rank 0, before a ``force`` re-save of ``step``: its files other committed steps reference; None: unknown.

        The replacing commit leaves them in place (later incremental steps
        read their bytes there); :meth:`cleanup` removes them once no kept
        step names them. None (a manifest unreadable, the root unlistable)
        keeps every file of the replaced checkpoint. Never raises: rank 0
        must not leave the save's exchanges.
        """
        name = step_dir_name(step)
        try:
            live = self._live_files([s for s in self._scan()[0] if s != step])
        except Exception as e:
            log.warning("shardckpt: cannot tell which files of step %d other steps reference (%s: %s): the re-save "
                        "keeps all of its old files", step, type(e).__name__, e)
            return None
        if live is None:
            return None
        keep = frozenset(rel for d, rel in live if d == name)
        if keep:
            log.info("shardckpt: the re-save of step %d keeps %d replaced files that later steps reference",
                     step, len(keep))
        return keep

    def _live_files(self, kept: Iterable[int]) -> Optional[Set[Tuple[str, str]]]:
        """``(dir, path)`` of every file the manifests of ``kept`` steps name (own and referenced); None if one is unreadable.

        None makes the caller delete nothing a reference could need: an
        unreadable manifest's references are unknown.
        """
        named: Dict[str, List[str]] = {}
        for s in kept:
            name = step_dir_name(s)
            try:
                named[name] = list(open_manifest(self.root.child(name), chunks=False).files)
            except (FileNotFoundError, NotADirectoryError, CheckpointNotFoundError):
                continue  # deleted since the scan: names nothing
            except Exception as e:
                log.warning("shardckpt: cannot read the manifest of kept step %d (%s: %s): files other steps may "
                            "reference are kept this time", s, type(e).__name__, e)
                return None
        return live_files(named)

    def _clear_dir(self, name: str, live: Any = _UNKNOWN, *, dry_run: bool = False) -> List[str]:
        """Delete a step directory without a manifest, except the files a kept step names (references).

        ``live``: from :meth:`_live_files` (read from the committed steps
        when not given, and only when the directory holds files; None:
        unknown, so only a directory holding no data file is removed).
        Returns what was (or, ``dry_run``, would be) removed.
        """
        try:
            present = self.root.child(name).walk_files("")
        except (FileNotFoundError, NotADirectoryError):
            return []
        if present and live is _UNKNOWN:
            live = self._live_files(self._scan()[0])
        if live is None:
            if any(rel.endswith(".safetensors") for rel in present):
                return []
            live = set()
        gone = removable(name, present, live or set())
        if len(gone) == len(present):
            if not dry_run:
                self._remove_leftover(name)
            return [name]
        if not dry_run:
            for rel in gone:
                self.root.remove(f"{name}/{rel}")
        return [f"{name}/{rel}" for rel in gone]

    def _remove_dir(self, name: str) -> None:
        self.root.remove_tree(name)

    def _remove_leftover(self, name: str) -> None:
        """Remove a step directory without a manifest, never one that commits meanwhile.

        Another process may be committing into it right now (a second writer).
        Where renames are atomic (local disks) the directory is first moved
        aside: a commit after the move fails (its directory is gone, it never
        re-creates one), and a manifest found in the moved directory means the
        commit came first, so it is moved back whole. Object stores have no
        such move: there a commit racing this removal can lose files (a second
        writer is refused, see ``_claim``; ``restore`` skips such a step).
        """
        if not self.root.caps.atomic_rename:
            self._remove_dir(name)
            return
        aside = f".removing-{name}-{uuid.uuid4().hex[:12]}"
        try:
            self.root.rename(name, aside)
        except FileNotFoundError:
            return  # gone already
        if self.root.exists(f"{aside}/{MANIFEST_NAME}"):
            log.warning("shardckpt: %s was committed while its leftovers were being removed: kept", self.root.url_of(name))
            try:
                self.root.rename(aside, name)
                return
            except OSError as e:  # a new directory of that name appeared: keep both, cleanup() says so
                log.warning("shardckpt: cannot put %s back: %s", self.root.url_of(name), e)
                return
        self._remove_dir(aside)

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

    def _retention(self, saved: int) -> Dict[str, Any]:
        """:func:`steps_to_delete`'s policy here: the manager's, or with ``local=`` the local one (``Tiers.retention``)."""
        if self._tiers is None:
            return {"keep_last": self.keep_last, "keep_every": self.keep_every, "protect": [saved]}
        return self._tiers.retention(saved)

    # -- restore ----------------------------------------------------------------

    def _validate(self, step: int) -> None:
        st = follow(self.root.child(step_dir_name(step)))  # a referenced file is checked where it lies
        m = open_manifest(st)
        saved = m.extra.get("step") if isinstance(m.extra, dict) else None
        # A step directory copied or renamed by hand holds another step's state:
        # resuming it would restart the schedule at the wrong step.
        if isinstance(saved, int) and not isinstance(saved, bool) and saved != step:
            raise CorruptCheckpointError(
                f"{st.url} holds the checkpoint of step {saved} (its manifest says so), not of step {step}; "
                f"was the directory renamed or copied? Move it back to {step_dir_name(saved)} or delete it"
            )
        if self.check_files:
            check_files(st, {rel: f.size for rel, f in m.files.items()})

    def _choose(self, step: Optional[int]) -> Optional[int]:
        """Rank 0: the step to restore, None when nothing is committed."""
        try:
            committed = self.steps()
        except CheckpointError:
            raise
        except Exception as e:
            raise StorageError(f"cannot list {self.root_url}: {type(e).__name__}: {e}") from e
        if step is not None:
            if step not in committed:
                have = f"committed steps: {format_offenders(committed)}" if committed else "no step is committed there"
                raise CheckpointNotFoundError(
                    f"step {step} is not committed at {self.step_url(step)}; {have}. "
                    "Call restore() without step= for the newest one"
                )
            self._validate(step)
            return step
        if not committed:
            self._say_why_empty()
            return None
        skipped: List[str] = []
        for s in reversed(committed):
            try:
                self._validate(s)
                return s
            except NewerFormatError as e:
                # Not damage: a newer shardckpt wrote it. Resuming an older
                # step instead would silently throw training away.
                raise NewerFormatError(
                    f"step {s} under {self.root_url} (the newest undamaged step) cannot be restored by this shardckpt: {e}. "
                    f"To resume from an older step on purpose, pass restore(state, step=N)"
                ) from None
            except Exception as e:
                if not _is_damage(e):
                    if isinstance(e, CheckpointError):
                        raise
                    raise StorageError(f"cannot read step {s} under {self.root_url}: {type(e).__name__}: {e}") from e
                log.warning("shardckpt: skipping step %d, it cannot be restored: %s: %s", s, type(e).__name__, e)
                skipped.append(f"step {s}: {type(e).__name__}: {str(e)[:300]}")
        if self.initial_load_path is not None:
            # The run has steps of its own: starting again from the initial
            # weights would silently discard all of its training.
            raise CorruptCheckpointError(
                f"every committed step under {self.root_url} is damaged, so restore() will not start over from "
                f"initial_load_path={self.initial_load_path!r} (that would discard the run's training). "
                f"{format_offenders(skipped)}. Repair or delete the damaged steps (shardckpt verify), or restore one "
                "with restore(state, step=N)"
            )
        return None

    def _say_why_empty(self) -> None:
        """Rank 0, nothing committed: warn when the root does not even exist (a typo would restart the run)."""
        try:
            exists = self.root.exists("")
        except Exception:
            return
        if not exists:
            log.warning(
                "shardckpt: CheckpointManager.restore: %s does not exist: nothing to restore, the run starts fresh "
                "(check the path for a typo if it should resume)%s", self.root_url, _nearby(self.root),
            )

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
        s = None if step is None else _check_step(step)
        if "process_group" in load_kw:
            raise TypeError("restore() takes the manager's process_group; do not pass process_group")
        # A failed background save stays pending for the next save()/wait():
        # it must not stand in the way of recovering.
        wait_pending(raise_unobserved=False)
        comm = self._comm("CheckpointManager.restore", error=LoadFailedError)
        if self.io_threads is not None:
            load_kw.setdefault("io_threads", self.io_threads)
        load_kw.setdefault("collective_timeout_s", self.collective_timeout_s)
        memory_tried = False
        if self._tiers is not None and s is None:
            mem = self._memory

            def from_memory(storage_step: Optional[int]) -> Optional[int]:
                if mem is None:
                    return None
                return mem.restore(state, comm, storage_step=storage_step, process_group=self.process_group, load_kw=load_kw)

            source, got, where = self._tiers.restore(state, comm, load_kw, local=self.root, local_steps=self.steps,
                                                     validate=self._validate, flush=not self.load_only, memory=from_memory)
            if source in ("remote", "memory"):
                self.restored_from = where
                return got
            s, memory_tried = got, True  # "local": that step, below; "none": nothing anywhere (initial_load_path applies)
        elif self._tiers is not None and s is not None:
            _, here = agree(comm, lambda: s in self.steps() if comm.rank == 0 else None,
                            what=f"restore of step {s} from {self.root_url}", share=lambda v: v, mode=FROM_ROOT)
            if not here:  # not (or no longer) on the local disk: the remote's copy
                remote = self._tiers.remote
                got = remote.restore(state, step=s, **load_kw)
                self.restored_from = remote.restored_from
                return got
        for attempt in range(RESTORE_ATTEMPTS):
            # Rank 0 picks; its error (the same type and text) is raised on every rank.
            _, value = agree(
                comm,
                lambda: self._choose(s) if comm.rank == 0 else None,
                what=f"restore from {self.root_url}",
                share=lambda v: v,
                mode=FROM_ROOT,
            )
            if self._memory is not None and s is None and attempt == 0 and not memory_tried:
                got = self._memory.restore(
                    state, comm, storage_step=value, process_group=self.process_group, load_kw=load_kw,
                    load=lambda url: load(state, url, process_group=self.process_group, **load_kw),
                )
                if got is not None:
                    self.restored_from = f"memory:{got}"
                    return got
            if value is None:
                break
            try:
                load(state, self.step_url(value), storage_options=self.storage_options or None, process_group=self.process_group, **load_kw)
            except (CorruptCheckpointError, StorageError) as e:
                # Another process's retention can delete the picked step while
                # it loads (its manifest goes first): pick again. Errors of a
                # load are agreed, so every rank is here and rank 0 decides.
                name = f"{step_dir_name(value)}/{MANIFEST_NAME}"
                _, gone = agree(comm, lambda name=name: not self.root.exists(name) if comm.rank == 0 else None,  # type: ignore[misc]
                                what=f"restore from {self.root_url}", share=lambda v: v, mode=FROM_ROOT)
                if not gone or s is not None or attempt == RESTORE_ATTEMPTS - 1:
                    raise
                log.warning("shardckpt: step %d was deleted while it loaded (%s); picking the newest step again", value, type(e).__name__)
                continue
            self.restored_from = self.step_url(value)
            return value
        if value is None:
            if self.initial_load_path is None or s is not None:
                return None
            # A fresh run: start from the given weights (torchtitan's
            # initial_load_path). Once the run has its own steps they win.
            target = state
            if self.initial_load_model_only:
                if not isinstance(state, dict) or "model" not in state:
                    raise UsageError(
                        "CheckpointManager.restore: initial_load_model_only=True loads state['model'], and the state "
                        f"has no 'model' entry (it has {format_offenders(list(state) if isinstance(state, dict) else [])}); "
                        "put the model under 'model' or pass initial_load_model_only=False"
                    )
                target = {"model": state["model"]}
            load(target, self.initial_load_path, process_group=self.process_group, **load_kw)
            self.restored_from = self.initial_load_path
        return None

    # -- lifecycle ----------------------------------------------------------------

    def wait(self) -> None:
        """Finish the save in flight; raise its error if nobody has seen it.

        With ``local=``, also waits until the newest saved step is flushed
        to the remote (or its flush failed, logged).

        Raises:
            SaveFailedError: the background save failed.
        """
        wait_pending()
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
        if self._rank("CheckpointManager.cleanup") != 0:
            return []
        removed = []
        committed, partial = self._scan()
        for name in self.root.listdir(""):
            # Moved aside by a leftover removal that did not finish (_remove_leftover).
            if name.startswith(".removing-step-") and not self.root.exists(f"{name}/{MANIFEST_NAME}"):
                if not dry_run:
                    self._remove_dir(name)
                removed.append(name)
        live = self._live_files(committed)
        stale = set(stale_leftovers(committed, [s for s, _ in partial]))
        for s, name in partial:
            if s in stale:
                removed.extend(self._clear_dir(name, live, dry_run=dry_run))
        for s in committed:
            name = step_dir_name(s)
            st = self.root.child(name)
            try:
                m = open_manifest(st)
            except (FileNotFoundError, NotADirectoryError):
                continue  # deleted since the scan (another process's retention): nothing left to clean
            except CheckpointError as e:
                log.warning("shardckpt: cleanup leaves step %d alone, its manifest is unreadable: %s", s, e)
                continue
            # Files another kept step references stay too (a forced re-save's
            # replaced data may be referenced by later incremental steps).
            keep = set(m.files) | {MANIFEST_NAME, HF_INDEX_NAME} | {rel for d, rel in (live or ()) if d == name}
            if live is None:
                continue  # a kept manifest is unreadable: its references are unknown
            for rel in st.walk_files(""):
                stale_tmp = rel.rsplit("/", 1)[-1].startswith(".") and rel.endswith(".tmp")
                orphan = rel.startswith(DATA_DIR + "/") and rel.endswith(".safetensors") and rel not in keep
                if stale_tmp or orphan:
                    if not dry_run:
                        st.remove(rel)
                    removed.append(f"{name}/{rel}")
        return sorted(removed)

    def delete(self, step: int) -> None:
        """Delete a step (manifest first, then its files). Rank 0 only; others no-op."""
        self._check_open()
        step = _check_step(step)
        wait_pending(raise_unobserved=False)
        if self._rank("CheckpointManager.delete") == 0:
            self._remove_step(step)

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
