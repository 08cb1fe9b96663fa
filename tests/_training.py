"""Tiny training runs on every runtime, shared by the runtime/optimizer/resume tests.

Importable inside rank processes (``tests/`` is on their path). The global
batch is a function of the step alone and is split over the data-parallel
ranks, so a run at any world size sees the same data: losses at different
world sizes agree up to reduction order.
"""

from __future__ import annotations

import torch
import torch.distributed as dist
import torch.nn as nn
import torch.nn.functional as F
from models import Block, build

ROWS = 12  # global batch: divisible by 1, 2, 3, 4
SEQ = 5
VOCAB = 37

def dp_coords(kind: str, rank: int, world: int):
    """``(dp_rank, dp_world)``: which slice of the global batch this rank trains on."""
    if kind == "plain" or world == 1:
        return 0, 1
    if kind == "tp":
        return 0, 1
    if kind == "fsdp2_tp":
        return rank // 2, world // 2  # mesh (dp, tp) with tp = 2
    return rank, world


def batch(step: int, dp_rank: int = 0, dp_world: int = 1):
    g = torch.Generator().manual_seed(10_000 + step)
    idx = torch.randint(0, VOCAB, (ROWS, SEQ + 1), generator=g)
    per = ROWS // dp_world
    mine = idx[dp_rank * per : (dp_rank + 1) * per]
    return mine[:, :-1], mine[:, 1:]


def _tp_plan():
    from torch.distributed.tensor import Replicate
    from torch.distributed.tensor.parallel import ColwiseParallel, RowwiseParallel

    # The 37-row head is sharded unevenly; the MLP's hidden size (14) is even
    # because an uneven column shard feeding a row shard is not supported by
    # DTensor's matmul on this layout.
    plan = {"head": ColwiseParallel(output_layouts=Replicate())}
    for i in range(2):
        plan[f"blocks.{i}.up"] = ColwiseParallel()
        plan[f"blocks.{i}.down"] = RowwiseParallel()
    return plan


def shard(model: nn.Module, kind: str, world: int) -> nn.Module:
    """Wrap/shard ``model`` for runtime ``kind`` on the current process group.

    Kinds: plain, fsdp2, fsdp2_bf16 (MixedPrecisionPolicy), fsdp2_offload
    (CPUOffloadPolicy), fsdp2_keep (reshard_after_forward=False), fsdp2_raf2
    (reshard_after_forward=2, world 4), ddp, fsdp1, fsdp1_orig
    (use_orig_params=True), tp, hsdp (2 x world/2: replicate x shard),
    fsdp2_tp (world/2 x 2: dp x tp).
    """
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import CPUOffloadPolicy, MixedPrecisionPolicy, fully_shard

    if kind == "plain":
        return model

    def fsdp2(mesh=None, **kw):
        for b in model.blocks:
            fully_shard(b, mesh=mesh, **kw)
        fully_shard(model, mesh=mesh, **kw)
        return model

    if kind == "fsdp2":
        return fsdp2()
    if kind == "fsdp2_bf16":
        return fsdp2(mp_policy=MixedPrecisionPolicy(param_dtype=torch.bfloat16, reduce_dtype=torch.float32))
    if kind == "fsdp2_offload":
        return fsdp2(offload_policy=CPUOffloadPolicy(pin_memory=torch.cuda.is_available()))
    if kind == "fsdp2_keep":
        return fsdp2(reshard_after_forward=False)
    if kind == "fsdp2_raf2":
        return fsdp2(reshard_after_forward=2)
    if kind == "ddp":
        return nn.parallel.DistributedDataParallel(model)
    if kind in ("fsdp1", "fsdp1_orig"):
        from torch.distributed.fsdp import FullyShardedDataParallel as FSDP
        from torch.distributed.fsdp.wrap import ModuleWrapPolicy

        return FSDP(
            model,
            auto_wrap_policy=ModuleWrapPolicy({Block}),
            device_id=torch.device("cpu"),
            use_orig_params=kind == "fsdp1_orig",
        )
    if kind == "tp":
        from torch.distributed.tensor.parallel import parallelize_module

        mesh = init_device_mesh("cpu", (world,), mesh_dim_names=("tp",))
        return parallelize_module(model, mesh, _tp_plan())
    if kind == "hsdp":
        mesh = init_device_mesh("cpu", (2, world // 2), mesh_dim_names=("replicate", "shard"))
        return fsdp2(mesh=mesh)
    if kind == "fsdp2_tp":
        from torch.distributed.tensor.parallel import parallelize_module

        mesh = init_device_mesh("cpu", (world // 2, 2), mesh_dim_names=("dp", "tp"))
        parallelize_module(model, mesh["tp"], _tp_plan())
        return fsdp2(mesh=mesh["dp"])
    raise ValueError(kind)


def make(kind: str, rank: int, world: int, *, seed: int = 0, optim: str = "adamw", meta: bool = False, hidden=None):
    """``(model, optimizer, scheduler)`` for ``kind``; ``meta`` builds on the meta device then ``to_empty``.

    ``hidden`` defaults to 13, or 14 for the TP runtimes (see ``_tp_plan``).
    """
    if hidden is None:
        hidden = 14 if kind in ("tp", "fsdp2_tp") else 13
    if meta:
        with torch.device("meta"):
            model = build(seed, hidden=hidden)
        model = shard(model, kind, world)
        model.to_empty(device="cpu")
    else:
        model = shard(build(seed, hidden=hidden), kind, world)
    opt = make_optimizer(model, optim)
    sched = torch.optim.lr_scheduler.LambdaLR(opt, lambda s: min(1.0, (s + 1) / 3) * 0.95**s)
    return model, opt, sched


def make_optimizer(model: nn.Module, kind: str = "adamw"):
    if kind == "adamw":
        return torch.optim.AdamW(model.parameters(), lr=2e-2, weight_decay=0.1)
    if kind == "adam_foreach":
        return torch.optim.Adam(model.parameters(), lr=2e-2, foreach=True)
    if kind == "adam_fused":
        return torch.optim.Adam(model.parameters(), lr=2e-2, fused=True)
    if kind == "sgd":
        return torch.optim.SGD(model.parameters(), lr=5e-2, momentum=0.9, nesterov=True)
    if kind == "groups":
        decay = [p for n, p in model.named_parameters() if p.ndim >= 2]
        rest = [p for n, p in model.named_parameters() if p.ndim < 2]
        return torch.optim.AdamW([{"params": decay, "weight_decay": 0.1}, {"params": rest, "weight_decay": 0.0, "lr": 1e-2}], lr=2e-2)
    raise ValueError(kind)


def train(model, opt, sched, start: int, steps: int, kind: str, rank: int, world: int, *, noise: float = 0.0):
    """Run ``steps`` steps from ``start``; return (global mean losses, learning rates).

    ``noise`` adds per-rank random noise to the logits from torch's global
    generator, so the losses depend on every rank's RNG stream.
    """
    dp_rank, dp_world = dp_coords(kind, rank, world)
    losses, lrs = [], []
    for s in range(start, start + steps):
        x, y = batch(s, dp_rank, dp_world)
        logits = model(x).float()
        if noise:
            logits = logits + noise * torch.randn_like(logits)
        loss = F.cross_entropy(logits.reshape(-1, VOCAB), y.reshape(-1))
        loss.backward()
        opt.step()
        sched.step()
        opt.zero_grad(set_to_none=True)
        val = loss.detach().clone()
        if world > 1 and dist.is_initialized():
            dist.all_reduce(val)
            val /= world
        losses.append(val.item())
        lrs.append(sched.get_last_lr()[0])
    return losses, lrs


def full_params(model: nn.Module) -> dict:
    """Full CPU fp32 copies of every state-dict entry by FQN, whatever the runtime."""
    from torch.distributed.checkpoint.state_dict import StateDictOptions, get_model_state_dict

    sd = get_model_state_dict(model, options=StateDictOptions(full_state_dict=True))
    return {k: v.detach().cpu().clone() for k, v in sd.items()}


def full_optim(model: nn.Module, opt) -> dict:
    """Full optimizer state ``{fqn.key: tensor}`` plus param-group values, whatever the runtime."""
    from torch.distributed.checkpoint.state_dict import StateDictOptions, get_optimizer_state_dict

    osd = get_optimizer_state_dict(model, opt, options=StateDictOptions(full_state_dict=True))
    out = {}
    for fqn, st in osd["state"].items():
        for k, v in st.items():
            out[f"{fqn}.{k}"] = v.detach().cpu().clone() if isinstance(v, torch.Tensor) else v
    for i, g in enumerate(osd["param_groups"]):
        for k, v in g.items():
            out[f"group{i}.{k}"] = sorted(v) if k == "params" else v
    return out
