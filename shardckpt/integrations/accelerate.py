"""Hugging Face Accelerate: ``Accelerator.save_state`` / ``load_state`` through shardckpt.

One line after the ``Accelerator`` is built::

    plugin = FullyShardedDataParallelPlugin(fsdp_version=2)
    accelerator = Accelerator(fsdp_plugin=plugin)              # without GPUs: cpu=True
    shardckpt.integrations.accelerate.enable(accelerator, fsdp_plugin=plugin)   # the one added line
    ...
    accelerator.save_state("ckpt/step-100")    # a shardckpt checkpoint (manifest.json + data/)
    accelerator.load_state("ckpt/step-100")    # at any world size; DCP checkpoints of Accelerate still load

Why this seam: Accelerate's FSDP branch of ``save_state`` calls its DCP
writers directly, and its ``register_save_state_pre_hook`` runs only after
they have written, so no hook can replace them. ``enable`` rebinds
``save_state`` / ``load_state`` on this one ``Accelerator`` object (nothing
global is patched) to :func:`save_state` / :func:`load_state`, which keep
Accelerate's conventions: ``ProjectConfiguration(automatic_checkpoint_naming=True)``
names ``<project_dir>/checkpoints/checkpoint_<i>`` (an existing one is
refused, as Accelerate does) and ``total_limit`` applies Accelerate's rule to
the ``checkpoint_<i>`` folders holding a checkpoint, never another folder
(deleting once the new one is committed, where Accelerate deletes first);
the registered save/load pre-hooks run with the same arguments;
``accelerator.step`` and the project iteration are restored (malformed saved
counters refused before anything loads).

On CPU, Accelerate drops its FSDP plugin: ``enable(accelerator,
fsdp_plugin=plugin)`` turns FSDP on as it does on GPUs, or refuses where it
cannot (:func:`fsdp_on_cpu`).

One checkpoint holds every prepared model (``model``, ``model_1``, ...),
optimizer (its FQN-keyed state, resharded on load), LR scheduler, stateful
dataloader (``DataLoaderConfiguration(use_stateful_dataloader=True)``; per
rank), the GradScaler, objects registered with ``register_for_checkpointing``,
and each rank's random generators (kept live when the world size changes).
"""

from __future__ import annotations

import os
import re
from typing import Any, Dict, List, Optional

from .._async import AsyncSaveHandle, async_save
from .._format import MANIFEST_NAME, open_manifest
from .._load import load
from .._rng import RNGState
from .._save import save
from .._state import PerRank
from .._storage import Storage
from ..errors import CheckpointExistsError, CheckpointNotFoundError, CorruptCheckpointError, UsageError

__all__ = ["enable", "disable", "fsdp_on_cpu", "save_state", "load_state", "accelerate_state", "is_enabled", "STATE_KEY"]

#: The value entry that holds Accelerate's own counters (``step``, ``iteration``).
STATE_KEY = "accelerate"
#: The attribute ``enable`` stores its options under, on the Accelerator.
_ATTR = "_shardckpt_options"
#: Files and folders an Accelerate checkpoint of its own (DCP or torch.save) holds.
ACCELERATE_MARKERS = ("pytorch_model_fsdp_0", "optimizer_0", "model.safetensors", "pytorch_model.bin", "random_states_0.pkl")
#: The folders automatic naming writes (``checkpoint_<i>``): the only ones ``total_limit`` counts and deletes.
_CHECKPOINT_FOLDER = re.compile(r"^checkpoint_([0-9]+)$")


def enable(
    accelerator: Any,
    *,
    fsdp_plugin: Any = None,
    async_save: bool = False,
    storage_options: Optional[Dict[str, Any]] = None,
    **load_kw: Any,
) -> Any:
    """Make this ``accelerator``'s ``save_state`` / ``load_state`` write and read shardckpt checkpoints.

    Args:
        accelerator: an ``accelerate.Accelerator`` (before or after ``prepare``;
            before it when ``fsdp_plugin`` turns FSDP on, see below).
        fsdp_plugin: the ``FullyShardedDataParallelPlugin`` the Accelerator was
            built with. Needed on CPU only: Accelerate turns FSDP on only with
            GPUs and drops the plugin of an ``Accelerator(cpu=True)``
            (``DistributedType.MULTI_CPU``); ``enable`` then turns FSDP on as
            Accelerate does on GPUs (gloo; for tests and CI).
        async_save: ``save_state`` returns once the state is staged in host
            memory; the write finishes in the background (waited for by the
            next ``save_state`` / ``load_state`` and by ``wait``).
        storage_options: passed to fsspec (``output_dir`` may be any fsspec URL).
        **load_kw: passed to :func:`shardckpt.load` by ``load_state`` (``atomic=True``, ``strict=False``...).

    Returns:
        the same ``accelerator``.

    Raises:
        UsageError: ``accelerator`` is not an Accelerator; FSDP was asked for
            (a plugin, or ``ACCELERATE_USE_FSDP``) but this Accelerator runs
            without it: on a machine without GPUs and without ``cpu=True``
            each process runs alone (``DistributedType.NO``), and on CPU
            without ``fsdp_plugin=`` the plugin is gone; or FSDP would be
            turned on after ``prepare``.

    Example:
        >>> accelerator = shardckpt.integrations.accelerate.enable(Accelerator())   # doctest: +SKIP
        >>> plugin = FullyShardedDataParallelPlugin(fsdp_version=2)                 # doctest: +SKIP
        >>> accelerator = Accelerator(fsdp_plugin=plugin, cpu=True)                 # doctest: +SKIP
        >>> enable(accelerator, fsdp_plugin=plugin)   # FSDP2 on CPU (gloo)          # doctest: +SKIP

    Limits: rebinding instance methods; ``disable`` restores Accelerate's own
    (FSDP stays on). The Hugging Face ``Trainer`` saves through Accelerate's
    ``save_fsdp_model`` directly, not ``save_state``: see
    :mod:`shardckpt.integrations.transformers`.
    """
    if not (hasattr(accelerator, "save_state") and hasattr(accelerator, "_models")):
        raise UsageError(f"enable: expected an accelerate.Accelerator, got {type(accelerator).__name__}")
    fsdp_on_cpu(accelerator, fsdp_plugin)
    setattr(
        accelerator, _ATTR,
        {"async_save": bool(async_save), "storage_options": storage_options, "load_kw": load_kw, "handle": None, "victims": []},
    )
    accelerator.save_state = lambda output_dir=None, *a, **kw: save_state(accelerator, output_dir)
    accelerator.load_state = lambda input_dir=None, *a, **kw: load_state(accelerator, input_dir)
    accelerator.wait_for_checkpoint = lambda: wait(accelerator)
    return accelerator


def _world_size() -> int:
    import torch.distributed as dist

    if dist.is_available() and dist.is_initialized():
        return dist.get_world_size()
    try:
        return int(os.environ.get("WORLD_SIZE", "1"))
    except ValueError:
        return 1


def fsdp_on_cpu(accelerator: Any, fsdp_plugin: Any = None) -> bool:
    """Turn FSDP on for an ``Accelerator(cpu=True)`` of several processes, as Accelerate does on GPUs.

    Accelerate enables its FSDP plugin only for GPU-like devices; on CPU it
    keeps ``DistributedType.MULTI_CPU`` (gloo) and drops the plugin, so
    ``prepare`` wraps models without FSDP and nothing says so. This sets
    the plugin and ``DistributedType.FSDP`` on the shared Accelerate state
    (``PartialState`` too, as ``AcceleratorState`` does on GPUs, so a state
    made again later keeps it). :func:`enable` calls it.

    Args:
        accelerator: an ``accelerate.Accelerator``, before ``prepare``.
        fsdp_plugin: the plugin the Accelerator was built with.

    Returns:
        True when FSDP was turned on here; False when there was nothing to do
        (FSDP already on, or not asked for: no plugin and no ``ACCELERATE_USE_FSDP``).

    Raises:
        UsageError: FSDP asked for but impossible here (see :func:`enable`), naming the fix.
    """
    from accelerate.state import PartialState
    from accelerate.utils import DistributedType

    state = accelerator.state
    kind = state.distributed_type
    asked = fsdp_plugin is not None or os.environ.get("ACCELERATE_USE_FSDP", "false").lower() in ("1", "true")
    if kind == DistributedType.FSDP or not asked:
        return False
    fix = (
        "on a machine without GPUs build it as Accelerator(fsdp_plugin=plugin, cpu=True) and call "
        "shardckpt.integrations.accelerate.enable(accelerator, fsdp_plugin=plugin) before prepare"
    )
    if kind == DistributedType.MULTI_CPU:
        if fsdp_plugin is None:
            raise UsageError(f"enable: this Accelerator runs on CPU (MULTI_CPU), where Accelerate drops its FSDP plugin; {fix}")
        if accelerator._models:
            raise UsageError(f"enable: FSDP cannot be turned on after prepare (its models are already wrapped); {fix}")
        if state.mixed_precision != "no":
            fsdp_plugin.set_mixed_precision(state.mixed_precision)
        state.fsdp_plugin = fsdp_plugin
        state.distributed_type = DistributedType.FSDP
        # AcceleratorState copies PartialState's type each time it is made again.
        PartialState._shared_state["distributed_type"] = DistributedType.FSDP
        return True
    world = _world_size()
    if world > 1:
        raise UsageError(
            f"enable: FSDP was asked for, but Accelerate runs each of the {world} processes alone "
            f"(DistributedType.{kind.name}: no GPU found and cpu=True not passed), without FSDP; {fix}"
        )
    return False


def disable(accelerator: Any) -> Any:
    """Give ``accelerator`` back Accelerate's own ``save_state`` / ``load_state`` (after waiting for an async save)."""
    if is_enabled(accelerator):
        wait(accelerator)
        for name in ("save_state", "load_state", "wait_for_checkpoint", _ATTR):
            accelerator.__dict__.pop(name, None)
    return accelerator


def is_enabled(accelerator: Any) -> bool:
    """True when :func:`enable` switched this accelerator."""
    return _ATTR in getattr(accelerator, "__dict__", {})


def wait(accelerator: Any) -> None:
    """Wait for this accelerator's async save in flight, if any (raises its failure); then apply ``total_limit``.

    Collective when a save is in flight (every process calls it, as ``save_state``).
    """
    opts = getattr(accelerator, _ATTR, None)
    if opts and opts["handle"] is not None:
        handle: AsyncSaveHandle = opts["handle"]
        opts["handle"] = None
        victims, opts["victims"] = opts.get("victims", []), []
        handle.result()
        # Retention of an async save runs once it is committed, never before.
        _retain(accelerator, victims)


def _unwrap(obj: Any, attr: str) -> Any:
    # AcceleratedOptimizer.optimizer / AcceleratedScheduler.scheduler: the
    # torch objects, whose state shardckpt knows (FQN-keyed, resharded).
    return getattr(obj, attr, obj)


def _name(kind: str, i: int) -> str:
    return kind if i == 0 else f"{kind}_{i}"


def accelerate_state(accelerator: Any, models: Optional[List[Any]] = None) -> Dict[str, Any]:
    """The shardckpt state of an Accelerator: what ``save_state`` saves and ``load_state`` fills.

    Args:
        accelerator: a prepared ``accelerate.Accelerator``.
        models: the models to include (default all of ``accelerator._models``;
            load pre-hooks may remove some, as with Accelerate).

    Returns:
        ``{"model": ..., "optimizer": ..., "scheduler": ..., "dataloader": PerRank, "scaler": ...,
        "custom_0": ..., "rng": RNGState, "accelerate": {"step", "iteration"}}``, with ``_1``... suffixes
        for further models, optimizers, schedulers and dataloaders.
    """
    state: Dict[str, Any] = {}
    for i, m in enumerate(accelerator._models if models is None else models):
        state[_name("model", i)] = m
    for i, o in enumerate(accelerator._optimizers):
        state[_name("optimizer", i)] = _unwrap(o, "optimizer")
    for i, s in enumerate(accelerator._schedulers):
        state[_name("scheduler", i)] = _unwrap(s, "scheduler")
    for i, dl in enumerate(accelerator._dataloaders):
        if getattr(dl, "use_stateful_dataloader", False) and hasattr(dl, "state_dict"):
            # Each rank reads its own part of the data: its position is its own.
            state[_name("dataloader", i)] = PerRank(dl, on_resize="skip")
    if getattr(accelerator, "scaler", None) is not None:
        state["scaler"] = accelerator.scaler
    for i, obj in enumerate(accelerator._custom_objects):
        state[f"custom_{i}"] = obj
    state["rng"] = RNGState(on_resize="skip")
    state[STATE_KEY] = {"step": int(accelerator.step), "iteration": int(accelerator.project_configuration.iteration)}
    return state


def _automatic_dir(accelerator: Any) -> str:
    return os.path.join(accelerator.project_dir, "checkpoints")


def _numbered(root: str) -> List[str]:
    """The ``checkpoint_<i>`` folders under ``root``, oldest number first (no other name counts)."""
    out = []
    for name in os.listdir(root) if os.path.isdir(root) else []:
        m = _CHECKPOINT_FOLDER.match(name)
        path = os.path.join(root, name)
        if m and os.path.isdir(path) and not os.path.islink(path):
            out.append((int(m.group(1)), path))
    return [p for _, p in sorted(out)]


def _is_checkpoint(path: str) -> bool:
    return is_shardckpt_dir(path) or _is_accelerate_dir(path)


def _plan_retention(folders: List[str], total_limit: int) -> List[str]:
    """Which existing checkpoints a new one displaces under ``total_limit``: Accelerate's rule, on our folders only.

    Accelerate, before it writes, deletes the ``len(folders) + 1 - total_limit``
    lowest-numbered folders. Here ``folders`` are the ``checkpoint_<i>``
    folders that hold a checkpoint (ours or Accelerate's), listed before the
    new one is written, so the new one is never among them.
    """
    return list(folders[: max(0, len(folders) + 1 - total_limit)])


def save_state(accelerator: Any, output_dir: Optional[str] = None) -> str:
    """What ``accelerator.save_state(output_dir)`` does once :func:`enable` d: one shardckpt checkpoint.

    Collective: every process calls it, as with Accelerate.

    Args:
        accelerator: a prepared ``accelerate.Accelerator``.
        output_dir: the checkpoint directory or fsspec URL (replaced when it
            holds a committed checkpoint, as Accelerate overwrites); ignored
            under ``automatic_checkpoint_naming`` (``<project_dir>/checkpoints/checkpoint_<iteration>``).

    Returns:
        the checkpoint's directory.

    Raises:
        UsageError: no ``output_dir`` and automatic naming is off.
        SaveFailedError / StorageError: the save failed (a committed checkpoint at ``output_dir`` is kept).

    Example:
        >>> save_state(accelerator, "ckpt/step-100")   # doctest: +SKIP
    """
    opts = getattr(accelerator, _ATTR, None) or {"async_save": False, "storage_options": None, "handle": None, "victims": []}
    wait(accelerator)
    pc = accelerator.project_configuration
    victims: List[str] = []
    if pc.automatic_checkpoint_naming:
        output_dir = os.path.join(_automatic_dir(accelerator), f"checkpoint_{pc.iteration}")
        if os.path.lexists(output_dir):
            # As Accelerate: never write over a checkpoint of this project (a previous run's, another job's).
            raise CheckpointExistsError(
                f"save_state: {output_dir!r} already exists (iteration {pc.iteration}); set "
                f"accelerator.project_configuration.iteration to the next free number, or resume with load_state() first"
            )
        if pc.total_limit is not None and accelerator.is_main_process:
            # Chosen before the write (the new folder cannot be one), deleted after its commit.
            victims = _plan_retention([p for p in _numbered(_automatic_dir(accelerator)) if _is_checkpoint(p)], pc.total_limit)
    if output_dir is None:
        raise UsageError("save_state: pass output_dir, or use ProjectConfiguration(automatic_checkpoint_naming=True)")
    output_dir = os.fspath(output_dir)
    models = list(accelerator._models)
    for hook in accelerator._save_model_state_pre_hook.values():
        # Accelerate's signature (models, weights, output_dir): the FSDP branch hands hooks no weights either.
        hook(models, [], output_dir)
    state = accelerate_state(accelerator)
    kw = {"storage_options": opts["storage_options"], "overwrite": True}
    if opts["async_save"]:
        opts["handle"] = async_save(state, output_dir, **kw)
        opts["victims"] = victims
    else:
        save(state, output_dir, **kw)
        _retain(accelerator, victims)
    pc.iteration += 1
    return output_dir


def _retain(accelerator: Any, victims: List[str]) -> None:
    # After the commit: Accelerate deletes first, so a save that dies there
    # leaves one checkpoint fewer (with total_limit=1, none).
    if not accelerator.project_configuration.automatic_checkpoint_naming or accelerator.project_configuration.total_limit is None:
        return
    if accelerator.is_main_process:
        import shutil

        for folder in victims:
            shutil.rmtree(folder, ignore_errors=True)
    accelerator.wait_for_everyone()


def is_shardckpt_dir(input_dir: str, *, storage_options: Optional[Dict[str, Any]] = None) -> bool:
    """True when ``input_dir`` holds a committed shardckpt checkpoint (its ``manifest.json``)."""
    return bool(Storage(input_dir, storage_options=storage_options).exists(MANIFEST_NAME))


def load_state(accelerator: Any, input_dir: Optional[str] = None) -> str:
    """What ``accelerator.load_state(input_dir)`` does once :func:`enable` d.

    A shardckpt checkpoint loads in place at any world size (FSDP2 shards
    resharded, optimizer state by FQN). A directory Accelerate wrote itself
    (DCP ``pytorch_model_fsdp_0/``, ``model.safetensors``...) is handed to
    Accelerate's own ``load_state``, so runs switched mid-way keep resuming.

    Args:
        accelerator: a prepared ``accelerate.Accelerator``.
        input_dir: the checkpoint; None under ``automatic_checkpoint_naming``
            takes the newest committed ``checkpoint_<i>``.

    Returns:
        the directory loaded.

    Raises:
        CheckpointNotFoundError: no checkpoint at ``input_dir`` (or none under the project's checkpoints).
        StateMismatchError / LoadFailedError: as :func:`shardckpt.load` (nothing half-loaded silently).

    Example:
        >>> load_state(accelerator, "ckpt/step-100")   # doctest: +SKIP
    """
    opts = getattr(accelerator, _ATTR, None) or {"storage_options": None, "load_kw": {}, "handle": None}
    wait(accelerator)
    so = opts["storage_options"]
    if input_dir is None:
        if not accelerator.project_configuration.automatic_checkpoint_naming:
            raise UsageError("load_state: pass input_dir, or use ProjectConfiguration(automatic_checkpoint_naming=True)")
        committed = [p for p in _numbered(_automatic_dir(accelerator)) if _is_checkpoint(p)]
        if not committed:
            raise CheckpointNotFoundError(f"load_state: no committed checkpoint under {_automatic_dir(accelerator)!r}")
        input_dir = committed[-1]
    input_dir = os.fspath(input_dir)
    if not is_shardckpt_dir(input_dir, storage_options=so):
        if _is_accelerate_dir(input_dir):
            from accelerate import Accelerator

            Accelerator.load_state(accelerator, input_dir)
            return input_dir
        raise CheckpointNotFoundError(
            f"load_state: {input_dir!r} holds neither a committed shardckpt checkpoint (manifest.json) nor an "
            f"Accelerate checkpoint ({', '.join(ACCELERATE_MARKERS[:2])}); pass the directory save_state wrote"
        )
    models = list(accelerator._models)
    for hook in accelerator._load_model_state_pre_hook.values():
        hook(models, input_dir)  # a hook that loads a model itself removes it from the list
    state = accelerate_state(accelerator, models)
    kw = dict(opts["load_kw"])
    if len(models) != len(accelerator._models):
        kw.setdefault("strict", False)
    # Checked before the load touches any model or optimizer.
    counters = _saved_counters(input_dir, so, required=kw.get("strict", True))
    if counters is None:
        state.pop(STATE_KEY)
    load(state, input_dir, storage_options=so, **kw)
    if counters is not None:
        accelerator.step = counters["step"]
        accelerator.project_configuration.iteration = counters["iteration"] + 1
    return input_dir


def _saved_counters(input_dir: str, storage_options: Optional[Dict[str, Any]], *, required: bool) -> Optional[Dict[str, int]]:
    """The checkpoint's ``step`` / ``iteration``, validated from its manifest alone (no tensor read)."""
    values = open_manifest(input_dir, storage_options=storage_options, chunks=False).values
    if STATE_KEY not in values and not required:
        return None
    raw = values.get(STATE_KEY)
    ok = isinstance(raw, dict) and all(
        type(raw.get(k)) is int and raw[k] >= 0 for k in ("step", "iteration")  # bool is not a counter
    )
    if not ok:
        raise CorruptCheckpointError(
            f"load_state: {input_dir!r}: entry {STATE_KEY!r} must be {{'step': int >= 0, 'iteration': int >= 0}}, "
            f"found {raw!r:.200}; nothing was loaded. Resume from another checkpoint, or load the model alone with "
            f"shardckpt.load({{'model': model}}, url, strict=False)"
        )
    return {"step": raw["step"], "iteration": raw["iteration"]}


def _is_accelerate_dir(path: str) -> bool:
    return os.path.isdir(path) and any(os.path.exists(os.path.join(path, m)) for m in ACCELERATE_MARKERS)


def read_counters(input_dir: str) -> Dict[str, Any]:
    """Accelerate's counters (``step``, ``iteration``) of a checkpoint, read from its manifest alone."""
    m = open_manifest(input_dir, chunks=False)
    return dict(m.values.get(STATE_KEY) or {})
