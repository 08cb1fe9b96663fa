"""torchtitan: a drop-in for its ``CheckpointManager``, writing shardckpt checkpoints.

torchtitan (0.3+) builds its checkpointer from the trainer config's
``checkpoint`` entry (``config.checkpoint.build(...)``, any
``BaseCheckpointManager.Config``). The switch is that one setting::

    from shardckpt.integrations.torchtitan import CheckpointManager
    config.checkpoint = CheckpointManager.Config(enable=True, folder="checkpoint", interval=500)

or, calling it by hand as torchtitan's trainer does, the same ``build(...)``
keywords (``dataloader``, ``model_parts``, ``optimizers``, ``lr_schedulers``,
``states``, ``sd_adapter``, ``base_folder``).

Every torchtitan option keeps its name and meaning (``interval``,
``keep_latest_k``, ``load_step``, ``exclude_from_loading``,
``initial_load_path`` / ``initial_load_model_only``, ``last_save_model_only``,
``export_dtype``, ``last_save_in_hf`` through the run's ``sd_adapter.to_hf``,
``enable_first_step_checkpoint``, ``load_only``, ``async_mode``); shardckpt
adds ``incremental``. Entries are torchtitan's: ``model`` (all model parts,
pipeline stages included, by their canonical FQNs), ``optimizer`` (the
container's flat FQN-keyed state), ``lr_scheduler``, ``dataloader`` (per rank;
kept live at another data-parallel size, as torchtitan does), and the
trainer's other ``states`` (``train_state``...).

Layout: under ``<base_folder>/<folder>`` as torchtitan, each step a shardckpt
checkpoint ``step-<8 digits>`` (a committed ``manifest.json``; the final HF
export beside it as ``step-<8 digits>-hf``). torchtitan's own DCP steps
(``step-N/.metadata``) keep loading: as ``initial_load_path`` (read through
DCP directly), or converted with ``shardckpt.converters.from_dcp``. A folder
that already holds DCP steps is refused rather than shared, since its
retention would take them for unfinished saves.
"""

from __future__ import annotations

import os
import re
from dataclasses import dataclass
from typing import Any, Dict, List, Literal, Optional

import torch
from torchtitan.components.checkpointer.base import (
    DATALOADER,
    LR_SCHEDULER,
    MODEL,
    OPTIMIZER,
    BaseCheckpointManager,
    ModelWrapper,
)
from torchtitan.tools import filesystem

from .._load import load
from .._manager import CheckpointManager as _Manager
from .._state import PerRank
from ..errors import CheckpointNotFoundError, UsageError

__all__ = ["CheckpointManager", "ASYNC_MODES", "dcp_steps"]

#: torchtitan's ``checkpoint.async_mode`` values; both async ones are shardckpt's async save
#: (staging into reused pinned buffers; the write in the background).
ASYNC_MODES = ("disabled", "async", "async_with_pinned_mem")
_DCP_STEP = re.compile(r"^step-(\d+)$")
#: torchtitan's export dtype names.
_DTYPES = {"float16": torch.float16, "bfloat16": torch.bfloat16, "float32": torch.float32}


def dcp_steps(folder: str) -> List[int]:
    """Steps of torchtitan DCP checkpoints (``step-N/.metadata``) in ``folder`` (local), sorted."""
    out = []
    for name in os.listdir(folder) if os.path.isdir(folder) else []:
        m = _DCP_STEP.match(name)
        if m and os.path.isfile(os.path.join(folder, name, ".metadata")):
            out.append(int(m.group(1)))
    return sorted(out)


class _Flat:
    """A Stateful seen as such (torchtitan's OptimizersContainer is also an ``Optimizer``; its state is the flat dict)."""

    def __init__(self, obj: Any):
        self.obj = obj

    def state_dict(self) -> Dict[str, Any]:
        return self.obj.state_dict()

    def load_state_dict(self, sd: Dict[str, Any]) -> None:
        self.obj.load_state_dict(sd)


class CheckpointManager(BaseCheckpointManager):
    """torchtitan's checkpointer contract (``load``/``save``/``maybe_wait_for_*``/``close``) on shardckpt.

    Args:
        config: :class:`CheckpointManager.Config` (torchtitan's options plus ``incremental``).
        dataloader, model_parts, optimizers, lr_schedulers, states, sd_adapter, base_folder:
            as torchtitan's ``CheckpointManager``.

    Raises:
        UsageError: ``last_save_in_hf`` without an ``sd_adapter``; the folder holds torchtitan DCP steps.

    Example:
        >>> ckpt = CheckpointManager.Config(enable=True, folder="ckpt", interval=10).build(   # doctest: +SKIP
        ...     dataloader=dl, model_parts=[model], optimizers=opts, lr_schedulers=scheds, states={}, sd_adapter=None)
        >>> ckpt.load(); ckpt.save(step)   # doctest: +SKIP

    Limits: local and fsspec folders (torchtitan's HF export is local-only, so is this check for DCP steps).
    """

    @dataclass(kw_only=True, slots=True)
    class Config(BaseCheckpointManager.Config):
        async_mode: Literal["disabled", "async", "async_with_pinned_mem"] = "disabled"
        """Synchronous, or shardckpt's async save (stall = the staging copy)."""

        incremental: bool = False
        """shardckpt: each step references the unchanged chunks of the previous one (docs/incremental.md)."""

        def __post_init__(self) -> None:
            BaseCheckpointManager.Config.__post_init__(self)
            self.async_mode = self.async_mode.lower()  # type: ignore[assignment]
            if self.async_mode not in ASYNC_MODES:
                raise ValueError(f"checkpoint.async_mode must be one of {ASYNC_MODES}, got {self.async_mode!r}")

    def __init__(self, config: "CheckpointManager.Config", *, dataloader: Any, model_parts: List[torch.nn.Module],
                 optimizers: Any, lr_schedulers: Any, states: Dict[str, Any], sd_adapter: Any,
                 base_folder: str = "") -> None:
        self.enable = config.enable
        if not self.enable:
            return
        self.save_future = None
        self.config = config
        self.folder = filesystem.join(base_folder, config.folder)
        self.interval = config.interval
        self.states = states
        self.states.update({MODEL: ModelWrapper(model_parts), OPTIMIZER: optimizers, DATALOADER: dataloader,
                            LR_SCHEDULER: lr_schedulers})
        self.sd_adapter = sd_adapter
        if config.last_save_in_hf and sd_adapter is None:
            raise UsageError("checkpoint.last_save_in_hf is True, but the model has no sd_adapter (torchtitan's to_hf mapping)")
        found = dcp_steps(self.folder) if not filesystem.is_remote(self.folder) else []
        if found:
            raise UsageError(
                f"checkpoint.folder {self.folder!r} holds torchtitan DCP steps {found[:8]}: shardckpt's retention would take "
                "them for unfinished saves. Use another checkpoint.folder and set checkpoint.initial_load_path="
                f"{filesystem.join(self.folder, f'step-{found[-1]}')!r} with initial_load_model_only=False to continue "
                "from it (read through DCP), or convert it with shardckpt.converters.from_dcp"
            )
        self.export_dtype = _DTYPES[config.export_dtype]
        self._mgr = _Manager(
            self.folder, keep_last=config.keep_latest_k or None, save_interval=config.interval,
            async_save=config.async_mode != "disabled", enable_first_step_checkpoint=config.enable_first_step_checkpoint,
            load_only=config.load_only, incremental=config.incremental,
            last_save_model_only=config.last_save_model_only, last_save_in_hf=config.last_save_in_hf,
            export_dtype=None if self.export_dtype == torch.float32 else self.export_dtype,
        )

    # -- what is saved -------------------------------------------------------------

    def _state(self, *, model_only: bool = False, exclude: Optional[List[str]] = None) -> Dict[str, Any]:
        model = self.states[MODEL]
        if model_only:
            return {MODEL: model}
        out: Dict[str, Any] = {}
        for k, v in self.states.items():
            if v is None or k in (exclude or []):
                continue
            if k == OPTIMIZER:
                v = _Flat(v)
            elif k == DATALOADER:
                # Each data-parallel rank reads its own shard of the data; at
                # another size torchtitan also keeps the live loaders.
                v = PerRank(v, on_resize="skip")
            out[k] = v
        return out

    # -- BaseCheckpointManager hooks -------------------------------------------------

    def _should_save(self, curr_step: int, last_step: bool) -> bool:
        if self.config.load_only:
            return False
        return (curr_step == 1 and self.config.enable_first_step_checkpoint) or last_step or curr_step % self.interval == 0

    def _save(self, curr_step: int, last_step: bool = False) -> bool:
        if not self._should_save(curr_step, last_step):
            return False
        if last_step and self.config.last_save_model_only:
            model_sd = self.states[MODEL].state_dict()
            if self.config.last_save_in_hf:
                model_sd = self.sd_adapter.to_hf(model_sd)
            self._mgr.save(curr_step, {MODEL: dict(model_sd)}, last_step=True, force=True)
            return True
        self._mgr.save(curr_step, self._state(), last_step=last_step, force=True)
        return True

    def _load(self, step: int = -1) -> bool:
        cfg = self.config
        want = None if step == -1 else step
        committed = self._mgr.steps()
        if want is not None and want not in committed:
            raise CheckpointNotFoundError(f"--checkpoint.load_step={want} not found under {self.folder} (committed: {committed[-8:]})")
        if committed:
            chosen = want if want is not None else committed[-1]
            # Step 0 is torchtitan's seed checkpoint: model only.
            state = self._state(model_only=chosen == 0, exclude=cfg.exclude_from_loading)
            self._mgr.restore(state, step=chosen)
            return True
        src = cfg.initial_load_path
        if not src:
            return False
        model_only = cfg.initial_load_model_only
        if os.path.isfile(os.path.join(src, ".metadata")):
            self._load_dcp(src, model_only=model_only)
            return True
        if cfg.initial_load_in_hf:
            # HF names through the run's adapter: fill the to_hf view, then hand it back through from_hf.
            model = self.states[MODEL]
            hf_sd = dict(self.sd_adapter.to_hf(model.state_dict()))
            load({MODEL: hf_sd}, src)
            model.load_state_dict(self.sd_adapter.from_hf(hf_sd))
            return True
        load(self._state(model_only=model_only, exclude=cfg.exclude_from_loading), src)
        return True

    def _load_dcp(self, path: str, *, model_only: bool) -> None:
        """A torchtitan DCP checkpoint read directly (torchtitan's own flattened keys)."""
        import torch.distributed.checkpoint as dcp

        model = self.states[MODEL]
        if model_only:
            sd = model.state_dict()
            dcp.load(sd, checkpoint_id=path)
            model.load_state_dict(sd)
            return
        states = {k: v for k, v in self.states.items() if k != MODEL and v is not None and k not in self.config.exclude_from_loading}
        flat = dict(states)
        flat.update(model.state_dict())
        dcp.load(flat, checkpoint_id=path)
        model.load_state_dict(flat)

    def _maybe_wait_for_staging(self) -> None:
        # shardckpt's async save returns once staged: nothing is left to wait for here.
        return None

    def _wait_for_saving(self) -> None:
        self._mgr.wait()

    def maybe_wait_for_saving(self) -> None:
        if self.enable:
            self._mgr.wait()

    def _close(self) -> None:
        if hasattr(self, "_mgr"):
            self._mgr.close()

    def __del__(self) -> None:
        try:
            self.close()
        except Exception:
            pass

    @property
    def manager(self) -> _Manager:
        """The underlying :class:`shardckpt.CheckpointManager` (steps, restored_from, cleanup)."""
        return self._mgr

