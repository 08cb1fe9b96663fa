"""What each sharding runtime needs from the state layer.

Runtimes differ in two ways that matter to a checkpoint:

* names: DDP prefixes every key with ``module.``, ``torch.compile`` with
  ``_orig_mod.`` (also in the middle, for a block compiled alone),
  activation checkpointing with ``_checkpoint_wrapped_module.``, FSDP1 hides
  parameters inside ``FlatParameter``\\ s. Names in a checkpoint are the
  plain fully qualified names (FQNs) of the unwrapped model, wrapper
  segments removed at every depth (:func:`wrapper_renamer`), so a
  checkpoint moves between runtimes and wrappings.
* how tensors are reached: plain modules, FSDP2, TP and HSDP expose their
  parameters (tensors or DTensors) directly and are filled in place; FSDP1
  exposes ``ShardedTensor`` copies through torch's sharded state dict and must
  be loaded back through it.

torch's ``torch.distributed.checkpoint.state_dict`` functions do the FSDP1
work and give the FQN of every parameter; this module wraps the few pieces
used, so the private ones are named in one place.
"""

from __future__ import annotations

from typing import Any, Callable, Dict, List

import torch
import torch.nn as nn

from ._layout import is_dtensor

__all__ = ["unwrap", "wrapper_renamer", "is_fsdp1", "param_fqns", "fsdp1_model_state", "fsdp1_load_model_state", "materialize_device", "empty_like_meta"]


def unwrap(module: nn.Module) -> nn.Module:
    """Peel DDP and ``torch.compile`` wrappers: both share the inner module's parameters."""
    while True:
        inner = None
        if isinstance(module, nn.parallel.DistributedDataParallel):
            inner = module.module
        elif type(module).__name__ == "OptimizedModule" and isinstance(getattr(module, "_orig_mod", None), nn.Module):
            inner = module._orig_mod
        if inner is None:
            return module
        module = inner


#: The attribute through which each wrapper holds the module it wraps:
#: ``torch.compile``'s OptimizedModule, activation checkpointing's
#: CheckpointWrapper (also offload wrappers), FSDP1, DDP.
_WRAPPER_ATTRS = {
    "OptimizedModule": "_orig_mod",
    "CheckpointWrapper": "_checkpoint_wrapped_module",
    "OffloadWrapper": "_checkpoint_wrapped_module",
    "FullyShardedDataParallel": "_fsdp_wrapped_module",
    "DistributedDataParallel": "module",
}


def wrapper_renamer(model: nn.Module) -> Callable[[str], str]:
    """A function removing wrapper segments, at any depth, from ``model``'s state-dict keys.

    ``torch.compile(block)`` inside a model adds ``_orig_mod.`` in the middle
    of names (``layers.0._orig_mod.w1.weight``), ``checkpoint_wrapper`` adds
    ``_checkpoint_wrapped_module.``, FSDP1 ``_fsdp_wrapped_module.``, DDP
    ``module.``. A segment is removed only where a module of that wrapper
    type holds its inner module under that attribute, so a user's own
    submodule named ``module`` keeps its name. Names are then the plain
    model's FQNs, as torch's optimizer state dict (and DCP) names them: one
    checkpoint loads into the model however it is wrapped.

    Example:
        >>> m = torch.nn.Sequential(torch.compile(torch.nn.Linear(2, 2)))   # doctest: +SKIP
        >>> wrapper_renamer(m)("0._orig_mod.weight")                         # doctest: +SKIP
        '0.weight'
    """
    wrapped = set()
    for name, sub in model.named_modules(remove_duplicate=False):
        attr = _WRAPPER_ATTRS.get(type(sub).__name__)
        if attr is not None and isinstance(getattr(sub, attr, None), nn.Module):
            wrapped.add(f"{name}.{attr}" if name else attr)
    if not wrapped:
        return lambda k: k

    def rename(key: str) -> str:
        parts = key.split(".")
        kept = []
        raw = ""
        for p in parts:
            raw = f"{raw}.{p}" if raw else p
            if raw not in wrapped:
                kept.append(p)
        return ".".join(kept)

    return rename


def is_fsdp1(module: nn.Module) -> bool:
    """Whether any submodule is wrapped by FSDP1 (``FullyShardedDataParallel``)."""
    try:
        from torch.distributed.fsdp import FullyShardedDataParallel
    except ImportError:  # pragma: no cover - torch without distributed
        return False
    return any(isinstance(m, FullyShardedDataParallel) for m in module.modules())


def param_fqns(model: nn.Module) -> Dict[int, List[str]]:
    """``id(parameter) -> FQNs`` of every parameter reachable from ``model``.

    A plain parameter has one FQN; an FSDP1 ``FlatParameter`` has the FQNs of
    every original parameter it holds. Wrapper prefixes (DDP ``module.``,
    FSDP1, activation checkpointing, ``torch.compile``) are removed, exactly as
    torch's ``get_optimizer_state_dict`` names them.
    """
    # _get_fqns is private but has kept its signature since torch 2.2; it is
    # the one place that knows every wrapper's naming rules.
    from torch.distributed.checkpoint.state_dict import _get_fqns

    out: Dict[int, List[str]] = {}
    for name, p in model.named_parameters():
        if id(p) not in out:
            out[id(p)] = sorted(_get_fqns(model, name))
    return out


def fsdp1_model_state(model: nn.Module) -> Dict[str, Any]:
    """FSDP1 model state as ``ShardedTensor``\\ s keyed by FQN (torch's sharded state dict)."""
    from torch.distributed.checkpoint.state_dict import get_model_state_dict

    return dict(get_model_state_dict(model))


def fsdp1_load_model_state(model: nn.Module, sd: Dict[str, Any]) -> None:
    """Push a filled sharded state dict back into an FSDP1 model (collective)."""
    from torch.distributed.checkpoint.state_dict import StateDictOptions, set_model_state_dict

    set_model_state_dict(model, sd, options=StateDictOptions(strict=False))


def _fsdp2_params(module: nn.Module) -> Dict[int, Any]:
    """``id(sharded parameter) -> FSDPParam`` for every FSDP2 parameter under ``module``.

    FSDP2 keeps its per-parameter bookkeeping (offload, device, padding)
    private; this is the one place that reads it. Empty when the layout of
    that state is not recognised (a future torch): callers then fall back to
    the mesh, and FSDP2's own lazy-init checks name anything left wrong.
    """
    out: Dict[int, Any] = {}
    try:
        from torch.distributed.fsdp import FSDPModule
    except ImportError:  # pragma: no cover - torch without distributed
        return out
    for m in module.modules():
        if not isinstance(m, FSDPModule):
            continue
        try:
            state = m._get_fsdp_state()
        except Exception:  # pragma: no cover - private API moved
            continue
        # torch >= 2.12 keeps a list of groups; 2.11 has a single (optional) one.
        groups = getattr(state, "_fsdp_param_groups", None)
        if groups is None:
            one = getattr(state, "_fsdp_param_group", None)
            groups = [one] if one is not None else []
        for g in groups:
            for fp in getattr(g, "fsdp_params", ()):
                sharded = getattr(fp, "sharded_param", None)
                if sharded is not None:
                    out[id(sharded)] = fp
    return out


def _mesh_device(t) -> torch.device:
    """The device a DTensor on ``t``'s mesh computes on (the current one for accelerators)."""
    kind = t.device_mesh.device_type
    if kind == "cpu":
        return torch.device("cpu")
    return torch.device(kind, torch.get_device_module(kind).current_device())


def materialize_device(module: nn.Module) -> Callable[[torch.Tensor], torch.device]:
    """A function giving the device a meta tensor of ``module`` is materialized on.

    The devices are the ones FSDP2 itself gives a model that was not built on
    meta: an FSDP2 parameter goes to CPU under ``CPUOffloadPolicy`` and to
    FSDP2's device otherwise; any other DTensor (TP) to its mesh's device;
    plain tensors (buffers) to the device of the first DTensor's mesh (FSDP2
    moves buffers there, offload or not), else CPU.

    Args:
        module: the unwrapped model, already sharded.

    Example:
        >>> device_of = materialize_device(model)          # doctest: +SKIP
        >>> new = empty_like_meta(p, device_of(p))         # doctest: +SKIP

    Limits: reads FSDP2's private per-parameter state (torch 2.11-2.13); if
    that is not found, FSDP2 parameters follow their mesh, and FSDP2's lazy
    init then refuses an offloaded one with its own message.
    """
    fsdp = _fsdp2_params(module)
    default = torch.device("cpu")
    for t in module.state_dict(keep_vars=True).values():
        if is_dtensor(t):
            default = _mesh_device(t)
            break

    def device_of(t) -> torch.device:
        fp = fsdp.get(id(t))
        if fp is not None:
            if getattr(fp, "offload_to_cpu", False):
                return torch.device("cpu")
            dev = getattr(fp, "device", None)
            if isinstance(dev, torch.device):
                return dev
        if is_dtensor(t):
            return _mesh_device(t)
        return default

    return device_of


def empty_like_meta(t: torch.Tensor, device: torch.device) -> torch.Tensor:
    """An uninitialized tensor on ``device`` replacing meta ``t``: same dtype, shape and sharding.

    A DTensor keeps ``t``'s mesh, placements, global shape and stride; its
    local tensor is allocated on ``device`` and stays there, so the DTensor
    reports ``device`` — also when that differs from the mesh's device type,
    as for FSDP2's CPU-offloaded parameters on a CUDA mesh.

    Args:
        t: a tensor or DTensor on the meta device.
        device: where the new (local) data lives.

    Example:
        >>> empty_like_meta(meta_param, torch.device("cpu"))   # doctest: +SKIP

    Limits: the data is uninitialized; pinning and FSDP2's padding are left to
    FSDP2's post-load hook (``reset_sharded_param``), which runs when the
    tensor is installed with ``load_state_dict(assign=True)``.
    """
    if not is_dtensor(t):
        return torch.empty(t.shape, dtype=t.dtype, device=device)
    from torch.distributed.tensor import DTensor

    local = torch.empty(t._local_tensor.shape, dtype=t.dtype, device=device)  # type: ignore[attr-defined]  # a DTensor
    # Not DTensor.from_local: it moves the local tensor to the mesh's device
    # type, which put CPU-offloaded shards on the GPU; FSDP2's post-load hook
    # then moved the data back to pinned CPU under a DTensor still reporting
    # cuda:0 (issue 12, item 9). The private constructor with the meta
    # DTensor's spec is how FSDP2 itself builds its offloaded parameters
    # (``_from_local_no_grad``); its signature is the same in torch 2.11-2.13.
    return DTensor(local, t._spec, requires_grad=False)  # type: ignore[attr-defined]
