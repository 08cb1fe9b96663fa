"""The manager's options, grouped: what ``CheckpointManager(...)`` takes besides the root and the transport.

Grouped the way the converters' are (``converters.ConvertOptions``): each
group is a frozen dataclass, checked when built, passed as one keyword::

    CheckpointManager(root, retention=RetentionOptions(keep_last=3, keep_every=1000),
                      tiers=TierOptions(local="/nvme/run", memory=True),
                      writes=WriteOptions(async_save=True, incremental=True))

Every flat keyword of earlier releases (``keep_last=3``, ``async_save=True``,
``local=...``; :class:`FlatOptions` lists them) still works: it names one
field of one group (:data:`FLAT`), and :meth:`ManagerOptions.of`, the one
place flat keywords become groups, sets that field (on top of the group when
both are given). The transport keywords (``storage_options``,
``process_group``, ``io_threads``, ``collective_timeout_s``) stay flat, as in
``save`` and ``load``.

Pure: no storage, no process group (``replicas`` is checked by ``_fingerprint.replicas_mode``, the save's own check).
"""

from __future__ import annotations

from dataclasses import dataclass, fields, replace
from typing import Any, Callable, Dict, Mapping, Optional, Tuple, TypedDict

from .. import _fingerprint
from ..errors import UsageError, format_offenders

__all__ = [
    "DEFAULT_KEEP_LOCAL",
    "RetentionOptions",
    "ScheduleOptions",
    "TierOptions",
    "WriteOptions",
    "ResumeOptions",
    "LastSaveOptions",
    "FlatOptions",
    "FLAT",
    "ManagerOptions",
]

#: Local steps ``CheckpointManager(..., local=DIR)`` keeps besides those not flushed yet (docs/manager.md).
DEFAULT_KEEP_LOCAL = 2


def _positive(name: str, v: Any, *, allow_none: bool = True) -> None:
    if v is None and allow_none:
        return
    if isinstance(v, bool) or not isinstance(v, int) or v < 1:
        raise ValueError(f"{name} must be a positive int{' or None' if allow_none else ''}, got {v!r}")


@dataclass(frozen=True)
class RetentionOptions:
    """Which committed steps stay (``retention=``).

    Attributes:
        keep_last: committed steps to keep (the newest ones); None keeps all.
        keep_every: also keep every step divisible by this (milestones).
        keep_local: (with ``TierOptions.local``) local steps to keep besides
            the one being flushed and the one waiting to be; ``keep_last`` /
            ``keep_every`` then apply to the remote.

    Raises:
        ValueError: a value that is not a positive int (``keep_local``: not None either).
    """

    keep_last: Optional[int] = None
    keep_every: Optional[int] = None
    keep_local: int = DEFAULT_KEEP_LOCAL

    def __post_init__(self) -> None:
        _positive("keep_last", self.keep_last)
        _positive("keep_every", self.keep_every)
        _positive("keep_local", self.keep_local, allow_none=False)


@dataclass(frozen=True)
class ScheduleOptions:
    """When steps are saved (``schedule=``): what :meth:`CheckpointManager.should_save` answers.

    Attributes:
        save_interval: ``should_save`` is true every this many steps.
        enable_first_step_checkpoint: ``should_save`` is also true at step 1.
        load_only: ``restore`` works, ``save`` saves nothing (returns None)
            and ``should_save`` is always false.

    Raises:
        ValueError: ``save_interval`` is not a positive int.
    """

    save_interval: int = 1
    enable_first_step_checkpoint: bool = False
    load_only: bool = False

    def __post_init__(self) -> None:
        _positive("save_interval", self.save_interval, allow_none=False)


@dataclass(frozen=True)
class TierOptions:
    """Where steps are kept besides ``root_url`` (``tiers=``; docs/manager.md, "Memory tier" and "Local first, then remote").

    Attributes:
        local: a node-local directory: every save commits there (at local
            disk speed) and a background thread on every rank flushes the
            newest step to ``root_url``, the durable remote, committing it
            there last. ``root_url``/``step_url`` then name the local
            directory and ``remote_url`` the remote. With incremental
            writes, a flush also uploads the files the step references that
            the remote lacks.
        memory: a host-memory tier with a copy on a peer node
            (``shardckpt.MemoryTier(...)``, True for its defaults, a
            directory, or a dict of its options): ``save_to_memory`` keeps
            the newest step there, and ``restore`` takes the newest step held
            in memory or storage.
        on_durable: (with ``local``) called on every rank with each step once
            it is committed on the remote (in the flusher thread).
    """

    local: Optional[str] = None
    memory: Any = None
    on_durable: Optional[Callable[[int], None]] = None


@dataclass(frozen=True)
class WriteOptions:
    """How each save writes (``writes=``).

    Attributes:
        async_save: ``save`` returns once the state is staged in host memory
            and writes in the background (see :func:`shardckpt.async_save`).
        reuse_buffers: (async) keep staging buffers between saves.
        incremental: each save references the chunks whose bytes the newest
            committed step already holds instead of rewriting them
            (:func:`shardckpt.save`'s ``incremental``). Retention then deletes
            a dropped step's files only when no kept step names them
            (docs/manager.md, "Retention with incremental steps").
        replicas: the replica check of every save (:func:`shardckpt.save`'s
            ``replicas``: ``"check"``, ``"warn"`` or ``"off"``; None:
            ``SHARDCKPT_REPLICAS``, ``"warn"``).

    Raises:
        UsageError: ``replicas`` is not one of the modes.
    """

    async_save: bool = False
    reuse_buffers: bool = True
    incremental: bool = False
    replicas: Optional[str] = None

    def __post_init__(self) -> None:
        if self.replicas is not None:
            object.__setattr__(self, "replicas", _fingerprint.replicas_mode(self.replicas))


@dataclass(frozen=True)
class ResumeOptions:
    """What ``restore`` checks and where a fresh run starts (``resume=``; torchtitan's ``initial_load_*``).

    Attributes:
        check_files: before restoring a step, check every data file it lists
            exists with its recorded size (one stat per file; checksums are
            always verified while reading).
        initial_load_path: a checkpoint (shardckpt, or a Hugging Face
            safetensors directory/file) that ``restore`` loads when the run
            has no committed step of its own; ignored once it has one.
        initial_load_model_only: (default True, as torchtitan) load only
            ``state["model"]`` from ``initial_load_path``.

    Raises:
        UsageError: ``initial_load_path`` is not a non-blank str.
    """

    check_files: bool = True
    initial_load_path: Optional[str] = None
    initial_load_model_only: bool = True

    def __post_init__(self) -> None:
        p = self.initial_load_path
        if p is not None and (not isinstance(p, str) or not p.strip()):
            raise UsageError(f"CheckpointManager: initial_load_path must be a checkpoint URL, got {p!r}")


@dataclass(frozen=True)
class LastSaveOptions:
    """What ``save(..., last_step=True)`` writes (``last_save=``; torchtitan's ``last_save_*``).

    Attributes:
        model_only: save only ``state["model"]`` (weights to publish, no optimizer).
        export_dtype: with ``model_only`` or ``in_hf``, cast floating-point
            weights of the last save to this dtype (``torch.bfloat16``,
            ``"bf16"``); tied weights stay one tensor.
        in_hf: also write the model as a Hugging Face safetensors directory
            ``<root>/step-<N>-hf`` (:func:`converters.to_safetensors`, one
            name per tied weight).
    """

    model_only: bool = False
    export_dtype: Any = None
    in_hf: bool = False


class FlatOptions(TypedDict, total=False):
    """The flat keywords ``CheckpointManager`` still takes, each one field of a group (:data:`FLAT`).

    ``keep_last``, ``keep_every``, ``keep_local`` (:class:`RetentionOptions`);
    ``save_interval``, ``enable_first_step_checkpoint``, ``load_only``
    (:class:`ScheduleOptions`); ``local``, ``memory``, ``on_durable``
    (:class:`TierOptions`); ``async_save``, ``reuse_buffers``,
    ``incremental``, ``replicas`` (:class:`WriteOptions`); ``check_files``,
    ``initial_load_path``, ``initial_load_model_only``
    (:class:`ResumeOptions`); ``last_save_model_only``, ``export_dtype``,
    ``last_save_in_hf`` (:class:`LastSaveOptions`).
    """

    keep_last: Optional[int]
    keep_every: Optional[int]
    keep_local: int
    save_interval: int
    enable_first_step_checkpoint: bool
    load_only: bool
    local: Optional[str]
    memory: Any
    on_durable: Optional[Callable[[int], None]]
    async_save: bool
    reuse_buffers: bool
    incremental: bool
    replicas: Optional[str]
    check_files: bool
    initial_load_path: Optional[str]
    initial_load_model_only: bool
    last_save_model_only: bool
    export_dtype: Any
    last_save_in_hf: bool


#: flat keyword -> (group keyword, field of that group's class).
FLAT: Dict[str, Tuple[str, str]] = {
    "keep_last": ("retention", "keep_last"),
    "keep_every": ("retention", "keep_every"),
    "keep_local": ("retention", "keep_local"),
    "save_interval": ("schedule", "save_interval"),
    "enable_first_step_checkpoint": ("schedule", "enable_first_step_checkpoint"),
    "load_only": ("schedule", "load_only"),
    "local": ("tiers", "local"),
    "memory": ("tiers", "memory"),
    "on_durable": ("tiers", "on_durable"),
    "async_save": ("writes", "async_save"),
    "reuse_buffers": ("writes", "reuse_buffers"),
    "incremental": ("writes", "incremental"),
    "replicas": ("writes", "replicas"),
    "check_files": ("resume", "check_files"),
    "initial_load_path": ("resume", "initial_load_path"),
    "initial_load_model_only": ("resume", "initial_load_model_only"),
    "last_save_model_only": ("last_save", "model_only"),
    "export_dtype": ("last_save", "export_dtype"),
    "last_save_in_hf": ("last_save", "in_hf"),
}


@dataclass(frozen=True)
class ManagerOptions:
    """Every group, resolved (:meth:`of`): what the manager keeps as ``options``."""

    retention: RetentionOptions = RetentionOptions()
    schedule: ScheduleOptions = ScheduleOptions()
    tiers: TierOptions = TierOptions()
    writes: WriteOptions = WriteOptions()
    resume: ResumeOptions = ResumeOptions()
    last_save: LastSaveOptions = LastSaveOptions()

    @classmethod
    def of(cls, groups: Mapping[str, Any], flat: Mapping[str, Any]) -> "ManagerOptions":
        """The options from the group keywords given (None: defaults) and the flat keywords (each sets one field).

        Raises:
            TypeError: a flat keyword the manager does not take (all listed),
                as Python raises for an unknown keyword argument; a group of
                the wrong class.
            ValueError / UsageError: as the groups' checks.

        Example:
            >>> o = ManagerOptions.of({"retention": RetentionOptions(keep_every=10)}, {"keep_last": 3})
            >>> o.retention.keep_last, o.retention.keep_every
            (3, 10)
        """
        unknown = sorted(set(flat) - set(FLAT))
        if unknown:
            raise TypeError(
                f"CheckpointManager() got unexpected keyword argument{'s' if len(unknown) > 1 else ''} "
                f"{format_offenders(map(repr, unknown))} (besides root_url and the transport keywords it takes "
                f"{', '.join(f.name for f in fields(cls))} and {', '.join(sorted(FLAT))})"
            )
        out: Dict[str, Any] = {}
        for f in fields(cls):
            group = groups.get(f.name)
            klass: Any = type(getattr(_DEFAULTS, f.name))
            if group is None:
                group = klass()
            elif not isinstance(group, klass):
                raise TypeError(f"CheckpointManager({f.name}=...) takes a {klass.__name__}, got {type(group).__name__}")
            mine = {field: flat[k] for k, (g, field) in FLAT.items() if g == f.name and k in flat}
            out[f.name] = replace(group, **mine) if mine else group
        return cls(**out)


#: The defaults of every group (their classes name the group keywords' types).
_DEFAULTS = ManagerOptions()
