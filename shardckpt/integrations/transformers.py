"""Hugging Face ``Trainer``: its checkpoints (FSDP2 through Accelerate) saved and resumed through shardckpt.

One line after the ``Trainer`` is built::

    args = TrainingArguments("out", fsdp="full_shard", fsdp_config={"version": 2}, save_steps=100, ...)
    trainer = Trainer(model=model, args=args, train_dataset=ds)
    shardckpt.integrations.transformers.enable(trainer)      # the one added line
    trainer.train()                                # out/checkpoint-100 ... are shardckpt checkpoints
    trainer.train(resume_from_checkpoint=True)     # resumes from the newest, at any world size

Why this seam: the Trainer does not checkpoint through ``Accelerator.save_state``;
its ``_save_checkpoint`` calls Accelerate's ``save_fsdp_model`` /
``save_fsdp_optimizer`` (DCP) and ``torch.save`` for the scheduler, scaler
and each rank's RNG, and ``train(resume_from_checkpoint=...)`` reads them
back through ``_load_from_checkpoint``, ``_load_optimizer_and_scheduler``,
``_load_scaler`` and ``_load_rng_state`` (the last one when the resumed
epoch starts, after skipped batches). ``enable`` rebinds those methods on
this one Trainer object (nothing global is patched), each keeping its
Trainer signature and its moment: the Trainer's own flow (checkpoint folder
naming ``checkpoint-<step>``, ``trainer_state.json``, ``save_total_limit``
rotation, ``get_last_checkpoint``, callbacks) runs unchanged around them.

One checkpoint per save, in ``<output_dir>/checkpoint-<step>``: ``model``
(FSDP2 shards, resharded on load), ``optimizer`` (by parameter FQN),
``scheduler``, ``scaler`` (when there is one), ``rng`` (each rank's
generators: Python, NumPy, torch, CUDA) and ``trainer`` (``global_step``,
``epoch``), committed atomically by ``manifest.json``; the Trainer then
writes its ``trainer_state.json`` beside it, as always. A checkpoint the
Trainer wrote itself (DCP ``pytorch_model_fsdp_0/``, ``optimizer.pt``...)
still resumes through the Trainer's own code.
"""

from __future__ import annotations

import os
import types
from typing import Any, Callable, Dict, Optional

from .._format import MANIFEST_NAME
from .._load import load
from .._rng import RNGState
from .._save import save
from .._storage import Storage
from ..errors import CorruptCheckpointError, UsageError
from .accelerate import fsdp_on_cpu

__all__ = ["enable", "disable", "is_enabled", "trainer_state", "is_shardckpt_checkpoint", "STATE_KEY", "TRAINER_STATE_FILE"]

#: The value entry with the Trainer's position (``global_step``, ``epoch``) at the save.
STATE_KEY = "trainer"
#: The file the Trainer writes beside each checkpoint and reads first on resume.
TRAINER_STATE_FILE = "trainer_state.json"
#: The attribute ``enable`` keeps its options under, on the Trainer.
_ATTR = "_shardckpt_options"
#: Trainer methods replaced (those the installed transformers has); the first three are required.
_REQUIRED = ("_save_optimizer_and_scheduler", "_load_from_checkpoint", "_load_optimizer_and_scheduler", "_load_rng_state")
_OPTIONAL = ("_save_rng_state", "_save_scaler", "_load_scaler", "_load_best_model")


def is_shardckpt_checkpoint(path: Optional[str]) -> bool:
    """True when ``path`` holds a committed shardckpt checkpoint (its ``manifest.json``)."""
    if not path:
        return False
    return bool(Storage(os.fspath(path)).exists(MANIFEST_NAME))


def _scaler(trainer: Any) -> Any:
    return getattr(getattr(trainer, "accelerator", None), "scaler", None)


def trainer_state(trainer: Any, *, with_model: bool = True, with_optimizer: bool = True) -> Dict[str, Any]:
    """The shardckpt state of a Trainer's checkpoint: what ``enable`` saves and restores.

    Args:
        trainer: a ``transformers.Trainer`` inside ``train`` (model wrapped, optimizer and scheduler made).
        with_model: include ``model``.
        with_optimizer: include ``optimizer``, ``scheduler`` and ``scaler``.

    Returns:
        ``{"model", "optimizer", "scheduler", "scaler"?, "rng": RNGState, "trainer": {...}}``.
    """
    state: Dict[str, Any] = {}
    if with_model:
        state["model"] = trainer.model
    if with_optimizer:
        # AcceleratedOptimizer / AcceleratedScheduler: the torch objects, whose state shardckpt knows.
        state["optimizer"] = getattr(trainer.optimizer, "optimizer", trainer.optimizer)
        if trainer.lr_scheduler is not None:
            state["scheduler"] = getattr(trainer.lr_scheduler, "scheduler", trainer.lr_scheduler)
        if _scaler(trainer) is not None:
            state["scaler"] = _scaler(trainer)
    state["rng"] = RNGState(on_resize="skip")
    st = trainer.state
    state[STATE_KEY] = {"global_step": int(st.global_step), "epoch": float(st.epoch or 0.0)}
    return state


def enable(trainer: Any, *, storage_options: Optional[Dict[str, Any]] = None, **load_kw: Any) -> Any:
    """Make this ``trainer``'s checkpoints shardckpt checkpoints, saved and resumed through shardckpt.

    On a machine without GPUs (``TrainingArguments(use_cpu=True)``, several
    processes, ``fsdp=...``) Accelerate drops the FSDP plugin; ``enable``
    turns FSDP on as Accelerate does on GPUs (gloo), for tests and CI.

    Args:
        trainer: a ``transformers.Trainer`` (or a subclass: SFTTrainer...), before ``train``.
        storage_options: fsspec options (reserved: the Trainer's folders are local paths).
        **load_kw: passed to :func:`shardckpt.load` on resume (``atomic=True``...).

    Returns:
        the same ``trainer``.

    Raises:
        UsageError: not a Trainer, or a transformers without the methods this seam replaces
            (their names in the message); FSDP asked for but impossible (see
            :func:`shardckpt.integrations.accelerate.enable`).

    Example:
        >>> trainer = shardckpt.integrations.transformers.enable(Trainer(model=model, args=args))  # doctest: +SKIP

    Limits: rebinding instance methods; ``disable`` restores the Trainer's
    own. DeepSpeed, XLA/TPU and SageMaker model parallel keep the Trainer's
    own checkpoints (refused). ``trainer_state.json`` is the Trainer's file,
    written after the commit: a checkpoint without it (the process died in
    between) is refused on resume.
    """
    missing = [m for m in _REQUIRED if not hasattr(trainer, m)]
    if missing or not hasattr(trainer, "accelerator"):
        import transformers

        raise UsageError(
            f"enable: expected a transformers.Trainer with {', '.join(_REQUIRED)} (transformers "
            f"{transformers.__version__}); {type(trainer).__name__} lacks {missing or ['accelerator']}"
        )
    if getattr(trainer, "is_deepspeed_enabled", False):
        raise UsageError("enable: DeepSpeed checkpoints stay the Trainer's own (shardckpt covers FSDP, DDP and one process)")
    _fsdp_on_cpu(trainer)
    originals = {m: getattr(type(trainer), m) for m in _REQUIRED + _OPTIONAL if hasattr(type(trainer), m)}
    trainer.__dict__[_ATTR] = {"storage_options": storage_options, "load_kw": load_kw, "originals": originals}
    for name in originals:
        setattr(trainer, name, types.MethodType(_REPLACEMENTS[name], trainer))
    return trainer


def disable(trainer: Any) -> Any:
    """Give ``trainer`` back its own checkpoint methods."""
    if is_enabled(trainer):
        for name in trainer.__dict__.pop(_ATTR)["originals"]:
            trainer.__dict__.pop(name, None)
    return trainer


def is_enabled(trainer: Any) -> bool:
    """True when :func:`enable` switched this trainer."""
    return _ATTR in getattr(trainer, "__dict__", {})


def _fsdp_on_cpu(trainer: Any) -> None:
    plugin_args = getattr(trainer.args, "fsdp_plugin_args", None)
    if getattr(trainer, "is_fsdp_enabled", False) or plugin_args is None:
        return
    if trainer.model_wrapped is not trainer.model:
        raise UsageError("enable: call it before trainer.train() (the model is already wrapped)")
    from accelerate.utils import FullyShardedDataParallelPlugin

    # The plugin the Trainer built and Accelerate dropped on CPU, made again from the same arguments.
    try:
        switched = fsdp_on_cpu(trainer.accelerator, FullyShardedDataParallelPlugin(**plugin_args))
    except UsageError as e:
        raise UsageError(f"{e}. With the Trainer: TrainingArguments(..., use_cpu=True), then enable(trainer)") from None
    if switched:
        trainer.is_fsdp_enabled = True


def _original(trainer: Any, name: str) -> Any:
    return types.MethodType(trainer.__dict__[_ATTR]["originals"][name], trainer)


def _opts(trainer: Any) -> Dict[str, Any]:
    return trainer.__dict__[_ATTR]


# -- save: one checkpoint where the Trainer wrote its optimizer; the rest folded into it -------------


def _save_optimizer_and_scheduler(self: Any, output_dir: str) -> None:
    # The Trainer's model save for resuming (save_fsdp_model) lives in this method too; save_model
    # before it writes only an export (FULL_STATE_DICT), left as is.
    save(trainer_state(self), output_dir, overwrite=True, storage_options=_opts(self)["storage_options"])


def _save_rng_state(self: Any, output_dir: str) -> None:
    """In the checkpoint already (``rng``, per rank)."""


def _save_scaler(self: Any, output_dir: str) -> None:
    """In the checkpoint already (``scaler``)."""


# -- resume: each piece at the moment the Trainer asks for it -----------------------------------------


def _check_resumable(self: Any, checkpoint: str) -> None:
    if not os.path.isfile(os.path.join(checkpoint, TRAINER_STATE_FILE)):
        raise CorruptCheckpointError(
            f"{checkpoint!r} is a committed shardckpt checkpoint without the Trainer's {TRAINER_STATE_FILE} (the "
            f"process died between the two): the Trainer would restart at step 0 with these weights. Resume from "
            f"the previous checkpoint (train(resume_from_checkpoint=<its path>)) or delete this one"
        )


def _load_from_checkpoint(self: Any, resume_from_checkpoint: str, model: Any = None) -> None:
    if not is_shardckpt_checkpoint(resume_from_checkpoint):
        return _original(self, "_load_from_checkpoint")(resume_from_checkpoint, model)
    # Loaded with the optimizer (saved by parameter name, it needs its model beside it), which
    # the Trainer asks for next: one validated load, nothing half-loaded.
    _check_resumable(self, resume_from_checkpoint)
    return None


def _load_optimizer_and_scheduler(self: Any, checkpoint: Optional[str]) -> None:
    if checkpoint is None or not is_shardckpt_checkpoint(checkpoint):
        return _original(self, "_load_optimizer_and_scheduler")(checkpoint)
    _check_resumable(self, checkpoint)
    live = trainer_state(self)
    live.pop("rng")  # restored when the Trainer asks, at the resumed epoch's start
    live.pop(STATE_KEY)  # the Trainer's position comes from its trainer_state.json
    load(live, checkpoint, storage_options=_opts(self)["storage_options"], **_opts(self)["load_kw"])
    return None


def _load_scaler(self: Any, checkpoint: Optional[str]) -> None:
    if not is_shardckpt_checkpoint(checkpoint):
        return _original(self, "_load_scaler")(checkpoint)
    return None  # with the optimizer


def _load_rng_state(self: Any, checkpoint: Optional[str]) -> None:
    if checkpoint is None or not is_shardckpt_checkpoint(checkpoint):
        return _original(self, "_load_rng_state")(checkpoint)
    load({"rng": RNGState(on_resize="skip")}, checkpoint, storage_options=_opts(self)["storage_options"])
    return None


def _load_best_model(self: Any) -> None:
    best = self.state.best_model_checkpoint
    if best is None or not is_shardckpt_checkpoint(best):
        return _original(self, "_load_best_model")()
    load({"model": self.model}, best, storage_options=_opts(self)["storage_options"])
    return None


_REPLACEMENTS: Dict[str, Callable[..., Any]] = {
    "_save_optimizer_and_scheduler": _save_optimizer_and_scheduler,
    "_save_rng_state": _save_rng_state,
    "_save_scaler": _save_scaler,
    "_load_from_checkpoint": _load_from_checkpoint,
    "_load_optimizer_and_scheduler": _load_optimizer_and_scheduler,
    "_load_scaler": _load_scaler,
    "_load_rng_state": _load_rng_state,
    "_load_best_model": _load_best_model,
}
