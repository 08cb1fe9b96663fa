"""Lightning: ``ModelParallelStrategy`` (Trainer and Fabric) with shardckpt sharded checkpoints.

One line changes, the strategy's import::

    from shardckpt.integrations.lightning import ModelParallelStrategy     # was: from lightning.pytorch.strategies import ...
    trainer = Trainer(strategy=ModelParallelStrategy(), ...)
    trainer.fit(model, ckpt_path="ckpt/last.ckpt")  # resumes at any world size

    from shardckpt.integrations.lightning import FabricModelParallelStrategy
    fabric = Fabric(strategy=FabricModelParallelStrategy(), ...)
    fabric.save(path, {"model": model, "optimizer": optimizer, "step": step})
    fabric.load(path, {"model": model, "optimizer": optimizer, "step": 0})

Why a strategy subclass, not a ``CheckpointIO`` plugin: Lightning's
``ModelParallelStrategy`` refuses ``CheckpointIO`` for its sharded path (its
``save_checkpoint`` writes DCP itself and raises on ``storage_options``), so
the strategy's own ``save_checkpoint`` / ``load_checkpoint`` are the seam.

Lightning's conventions stay: the checkpoint is the directory Lightning names
(``ModelCheckpoint``'s ``epoch=0-step=4.ckpt``, ``last.ckpt``), its entries
are Lightning's (``state_dict`` = the module, ``optimizer_0``...), the rest of
Lightning's checkpoint dict (``epoch``, ``global_step``, ``loops``,
``callbacks``, ``lr_schedulers``, ``hyper_parameters``) is kept as checksummed
values in the manifest instead of a pickled ``meta.pt``. A directory Lightning
wrote itself (DCP + ``meta.pt``) or a single-file checkpoint still loads through
Lightning's own code. ``save_distributed_checkpoint=False`` is Lightning's own path.

:func:`consolidate` is the equivalent of Lightning's
``python -m lightning.fabric.utilities.consolidate_checkpoint``: a sharded
checkpoint to one Lightning ``.ckpt`` file (full weights and the metadata),
which ``LightningModule.load_from_checkpoint`` takes.
"""

from __future__ import annotations

import os
from typing import Any, Dict, Optional

from lightning.fabric.strategies import ModelParallelStrategy as _FabricMPS
from lightning.pytorch.strategies import ModelParallelStrategy as _TrainerMPS

from .._format import MANIFEST_NAME, open_manifest
from .._format.refs import follow
from .._load import load, new_tensors
from .._save import save
from .._storage import Storage
from ..errors import CheckpointNotFoundError, UsageError
from ._common import values_template

__all__ = ["ModelParallelStrategy", "FabricModelParallelStrategy", "consolidate", "is_shardckpt_checkpoint", "META_KEY"]

#: The value entry holding Lightning's checkpoint dict minus weights and optimizer states.
META_KEY = "lightning"
MODEL_KEY = "state_dict"


def is_shardckpt_checkpoint(path: Any, *, storage_options: Optional[Dict[str, Any]] = None) -> bool:
    """True when ``path`` holds a committed shardckpt checkpoint (its manifest)."""
    return bool(Storage(os.fspath(path), storage_options=storage_options).exists(MANIFEST_NAME))


def _optimizers(optimizers: Any) -> Dict[str, Any]:
    # LightningOptimizer wraps the torch optimizer; shardckpt saves the torch one by FQN.
    return {f"optimizer_{i}": getattr(o, "_optimizer", o) for i, o in enumerate(optimizers)}


class ModelParallelStrategy(_TrainerMPS):
    """Lightning Trainer's ``ModelParallelStrategy`` (FSDP2 / TP) saving and loading shardckpt checkpoints.

    Args:
        *args, **kwargs: Lightning's ``ModelParallelStrategy`` arguments.
        shardckpt_options: passed to :func:`shardckpt.save` (``io_threads``, ``incremental``...).
        shardckpt_load_options: passed to :func:`shardckpt.load` (``atomic=True``...).

    Raises:
        SaveFailedError / StateMismatchError / LoadFailedError: as :func:`shardckpt.save` / :func:`shardckpt.load`.
        UnsupportedStateError: a value of Lightning's checkpoint dict (``hyper_parameters``...) that is not JSON,
            a tensor, a dtype or bytes (named, with its path).

    Example:
        >>> trainer = Trainer(strategy=ModelParallelStrategy(), accelerator="cpu", devices=2)   # doctest: +SKIP

    Limits: ``storage_options`` of ``trainer.save_checkpoint`` is refused as
    by Lightning; pass fsspec options as ``shardckpt_options={"storage_options": ...}``.
    """

    def __init__(self, *args: Any, shardckpt_options: Optional[Dict[str, Any]] = None,
                 shardckpt_load_options: Optional[Dict[str, Any]] = None, **kwargs: Any):
        super().__init__(*args, **kwargs)
        self._sc_save = dict(shardckpt_options or {})
        self._sc_load = dict(shardckpt_load_options or {})

    def save_checkpoint(self, checkpoint: Dict[str, Any], filepath: Any, storage_options: Optional[Any] = None) -> None:
        if not self._save_distributed_checkpoint:
            return super().save_checkpoint(checkpoint, filepath, storage_options=storage_options)
        if storage_options is not None:
            raise UsageError(f"{type(self).__name__}.save_checkpoint: pass storage options as shardckpt_options={{'storage_options': ...}}")
        path = os.fspath(self.broadcast(filepath))
        meta = {k: v for k, v in checkpoint.items() if k not in (MODEL_KEY, "optimizer_states")}
        state = {MODEL_KEY: self.model, **_optimizers(self.optimizers), META_KEY: meta}
        if os.path.isfile(path) and self.global_rank == 0:
            os.remove(path)  # Lightning replaces a single-file checkpoint of the same name too
        self.barrier("shardckpt_save")
        save(state, path, overwrite=True, **self._sc_save)

    def load_checkpoint(self, checkpoint_path: Any, weights_only: Optional[bool] = None) -> Dict[str, Any]:
        path = os.fspath(self.broadcast(checkpoint_path))
        so = self._sc_save.get("storage_options")
        if not is_shardckpt_checkpoint(path, storage_options=so):
            return super().load_checkpoint(path, weights_only=weights_only)
        assert self.lightning_module is not None
        storage = follow(Storage(path, storage_options=so))
        meta = values_template(open_manifest(path, storage_options=so, chunks=False), META_KEY, storage=storage)
        state = {MODEL_KEY: self.model, **_optimizers(self.optimizers), META_KEY: meta}
        kw = dict(self._sc_load)
        if not self.lightning_module.strict_loading:
            kw.setdefault("strict", False)
        load(state, path, storage_options=so, **kw)
        return dict(state[META_KEY])


class FabricModelParallelStrategy(_FabricMPS):
    """Lightning Fabric's ``ModelParallelStrategy`` saving and loading shardckpt checkpoints.

    ``fabric.save(path, state)``: modules and optimizers in ``state`` are saved
    sharded, every other entry as checksummed values. ``fabric.load(path, state)``
    loads modules and optimizers in place at any world size, puts the saved
    values back into ``state`` and returns the saved entries ``state`` did not
    ask for (Fabric's convention). A Lightning DCP directory or a single file
    goes through Lightning's own code.

    Args:
        *args, **kwargs: Lightning's Fabric ``ModelParallelStrategy`` arguments.
        shardckpt_options / shardckpt_load_options: as for :class:`ModelParallelStrategy`.

    Raises:
        UsageError: ``filter=`` (Fabric's per-key filter) given; shardckpt saves whole entries.

    Example:
        >>> fabric = Fabric(strategy=FabricModelParallelStrategy(), accelerator="cpu", devices=2)   # doctest: +SKIP
    """

    def __init__(self, *args: Any, shardckpt_options: Optional[Dict[str, Any]] = None,
                 shardckpt_load_options: Optional[Dict[str, Any]] = None, **kwargs: Any):
        super().__init__(*args, **kwargs)
        self._sc_save = dict(shardckpt_options or {})
        self._sc_load = dict(shardckpt_load_options or {})

    def save_checkpoint(self, path: Any, state: Dict[str, Any], storage_options: Optional[Any] = None,
                        filter: Optional[Dict[str, Any]] = None) -> None:
        if not self._save_distributed_checkpoint:
            return super().save_checkpoint(path, state, storage_options=storage_options, filter=filter)
        if storage_options is not None or filter is not None:
            raise UsageError(f"{type(self).__name__}.save_checkpoint: storage_options/filter are not supported; "
                             "pass shardckpt_options={'storage_options': ...} to the strategy")
        path = os.fspath(self.broadcast(path))
        save(dict(state), path, overwrite=True, **self._sc_save)

    def load_checkpoint(self, path: Any, state: Any = None, strict: bool = True, weights_only: Optional[bool] = None) -> Dict[str, Any]:
        path = os.fspath(self.broadcast(path))
        so = self._sc_save.get("storage_options")
        if not is_shardckpt_checkpoint(path, storage_options=so):
            return super().load_checkpoint(path, state, strict=strict, weights_only=weights_only)
        if not isinstance(state, dict) or not state:
            raise UsageError(f"{type(self).__name__}.load_checkpoint: pass the state to load into, e.g. "
                             "fabric.load(path, {'model': model, 'optimizer': optimizer})")
        manifest = open_manifest(path, storage_options=so, chunks=False)
        storage = follow(Storage(path, storage_options=so))
        rest = {k: values_template(manifest, k, storage=storage) for k in manifest.values if k not in state}
        target = {**state, **rest}
        kw = dict(self._sc_load)
        kw.setdefault("strict", strict)
        load(target, path, storage_options=so, **kw)
        for k in state:
            if k in target:
                state[k] = target[k]
        return {k: target[k] for k in rest}


def consolidate(src: str, dst: str, *, storage_options: Optional[Dict[str, Any]] = None) -> str:
    """A sharded Lightning checkpoint (shardckpt) to one Lightning ``.ckpt`` file, as Lightning's consolidation does.

    The file holds ``state_dict`` (full tensors, the module's names) and
    Lightning's metadata (``epoch``, ``global_step``, ``hyper_parameters``,
    ``loops``...), so ``LightningModule.load_from_checkpoint(dst)`` and
    ``torch.load`` read it. Runs in one process, no process group, with memory
    of about the model's weights (as Lightning's own consolidation).

    Args:
        src: the checkpoint directory :class:`ModelParallelStrategy` wrote.
        dst: the file to write (torch.save format, Lightning's single-file format).
        storage_options: fsspec options for ``src``.

    Returns:
        ``dst``.

    Raises:
        CheckpointNotFoundError: ``src`` is not a shardckpt checkpoint.

    Example:
        >>> consolidate("lightning_logs/version_0/checkpoints/last.ckpt", "last-full.ckpt")   # doctest: +SKIP

    Limits: optimizer states are left out (Lightning's consolidated files are
    for inference and fine-tuning); resume from ``src`` itself. For Hugging
    Face safetensors, ``shardckpt.converters.to_safetensors(src, dst, keys=...)``.
    """
    import torch

    if not is_shardckpt_checkpoint(src, storage_options=storage_options):
        raise CheckpointNotFoundError(f"consolidate: {src!r} is not a shardckpt checkpoint (no {MANIFEST_NAME}); "
                                      "for Lightning's DCP directories use lightning.fabric.utilities.consolidate_checkpoint")
    manifest = open_manifest(src, storage_options=storage_options, chunks=False)
    storage = follow(Storage(src, storage_options=storage_options))
    prefix = MODEL_KEY + "."
    # Allocated once the files are checked to hold them (a crafted manifest can claim any shape).
    full = new_tensors(storage, manifest, [n for n in manifest.tensors if n.startswith(prefix)])
    weights = {n[len(prefix):]: t for n, t in full.items()}
    meta = values_template(manifest, META_KEY, storage=storage)
    target = {MODEL_KEY: weights, META_KEY: meta}
    load(target, src, storage_options=storage_options, strict=False, no_dist=True)
    out = dict(target[META_KEY])
    out[MODEL_KEY] = target[MODEL_KEY]
    parent = os.path.dirname(os.path.abspath(dst))
    os.makedirs(parent, exist_ok=True)
    torch.save(out, dst)
    return dst
