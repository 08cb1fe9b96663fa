"""What each sharding runtime needs from the state layer.

Runtimes differ in two ways that matter to a checkpoint:

* names: DDP prefixes every key with ``module.``, ``torch.compile`` with
  ``_orig_mod.``, FSDP1 hides parameters inside ``FlatParameter``\\ s. Names in
  a checkpoint are the plain fully qualified names (FQNs) of the unwrapped
  model, so a checkpoint moves between runtimes.
* how tensors are reached: plain modules, FSDP2, TP and HSDP expose their
  parameters (tensors or DTensors) directly and are filled in place; FSDP1
  exposes ``ShardedTensor`` copies through torch's sharded state dict and must
  be loaded back through it.

torch's ``torch.distributed.checkpoint.state_dict`` functions do the FSDP1
work and give the FQN of every parameter; this module wraps the few pieces
used, so the private ones are named in one place.
"""

from __future__ import annotations

from typing import Any, Dict, List

import torch
import torch.nn as nn

__all__ = ["unwrap", "is_fsdp1", "param_fqns", "fsdp1_model_state", "fsdp1_load_model_state", "materialize_device"]


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


def _offloaded(module: nn.Module) -> set:
    """ids of FSDP2 sharded parameters under ``CPUOffloadPolicy`` (they live on CPU)."""
    ids = set()
    try:
        from torch.distributed.fsdp import FSDPModule
    except ImportError:  # pragma: no cover
        return ids
    for m in module.modules():
        if not isinstance(m, FSDPModule):
            continue
        # FSDP2 keeps its per-parameter bookkeeping private; without it the
        # mesh's device is used, which is right unless CPU offload is on.
        try:
            state = m._get_fsdp_state()
        except Exception:
            continue
        # torch >= 2.12 keeps a list of groups; 2.11 has a single (optional) one.
        groups = getattr(state, "_fsdp_param_groups", None)
        if groups is None:
            one = getattr(state, "_fsdp_param_group", None)
            groups = [one] if one is not None else []
        for g in groups:
            for fp in getattr(g, "fsdp_params", ()):
                if getattr(fp, "offload_to_cpu", False):
                    ids.add(id(fp.sharded_param))
    return ids


def materialize_device(module: nn.Module):
    """A function giving the device a meta tensor of ``module`` is materialized on.

    DTensors go to their mesh's device (the current one for accelerators),
    except FSDP2 parameters under ``CPUOffloadPolicy``, which go to CPU. Plain
    tensors follow the first DTensor's mesh, else CPU.
    """
    from ._layout import is_dtensor

    offloaded = _offloaded(module)

    def mesh_device(t) -> torch.device:
        kind = t.device_mesh.device_type
        if kind == "cpu":
            return torch.device("cpu")
        mod = torch.get_device_module(kind)
        return torch.device(kind, mod.current_device())

    default = torch.device("cpu")
    for t in module.state_dict(keep_vars=True).values():
        if is_dtensor(t):
            default = mesh_device(t)
            break

    # FSDP2 requires offload to be all-or-nothing in practice, and the root
    # module's param group is not always reachable before lazy init (torch
    # 2.11): once any parameter is offloaded, every DTensor goes to CPU.
    any_offloaded = bool(offloaded)

    def device_of(t) -> torch.device:
        if is_dtensor(t):
            return torch.device("cpu") if any_offloaded or id(t) in offloaded else mesh_device(t)
        return torch.device("cpu") if any_offloaded else default

    return device_of
