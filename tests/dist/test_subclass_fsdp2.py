"""Wrapper tensor subclasses inside FSDP2 DTensors, with the real torchao.

float8 training (``convert_to_float8_training``, bf16 master weights): each
FSDP2 weight is a DTensor whose local shard is a
``WeightWithDynamicFloat8CastTensor`` with one inner tensor of the local
shard's shape. Saved on 2 gloo ranks, loaded on 2, on 1 and into one plain
process: bit-exact weights and optimizer, identical next losses.
"""

from __future__ import annotations

import pytest
import torch
from _dist import run_ranks

import shardckpt

pytest.importorskip("torchao", reason="torchao is in the test extra")

STEPS_BEFORE, STEPS_AFTER = 2, 3


def _float8_model(seed: int, world: int):
    import torch.nn as nn
    from torchao.float8 import Float8LinearConfig, convert_to_float8_training

    torch.manual_seed(seed)
    m = nn.Sequential(nn.Linear(32, 64), nn.ReLU(), nn.Linear(64, 16)).to(torch.bfloat16)
    convert_to_float8_training(m, config=Float8LinearConfig(enable_fsdp_float8_all_gather=True))
    if world:
        from torch.distributed.fsdp import fully_shard

        for layer in (m[0], m[2]):
            fully_shard(layer)
        fully_shard(m)
    opt = torch.optim.AdamW(m.parameters(), lr=1e-2)
    return m, opt


def _train(m, opt, start: int, steps: int):
    losses = []
    for s in range(start, start + steps):
        g = torch.Generator().manual_seed(1000 + s)
        # Every rank sees the same full batch: the averaged gradient is the
        # one-process gradient exactly, so losses compare bit for bit.
        x = torch.randn(8, 32, generator=g).to(torch.bfloat16)
        y = torch.randn(8, 16, generator=g).to(torch.bfloat16)
        loss = (m(x).float() - y.float()).pow(2).mean()
        opt.zero_grad()
        loss.backward()
        opt.step()
        losses.append(loss.item())
    return losses


def _plain(t):
    """The whole tensor of a parameter/state as plain bf16/fp32 (gathered from the DTensor's inner shards)."""
    import torch.distributed as dist

    from shardckpt._layout import is_dtensor

    local = t._local_tensor if is_dtensor(t) else t
    local = getattr(local, "_tensor", local)  # the float8 wrapper's one inner tensor
    local = torch.Tensor.as_subclass(local.detach(), torch.Tensor).clone()
    if not is_dtensor(t):
        return local
    parts = [None] * dist.get_world_size()
    dist.all_gather_object(parts, local)
    return torch.cat(parts, 0)


def _snapshot(m, opt):
    params = {n: _plain(p) for n, p in m.named_parameters()}
    by_param = {p: n for n, p in m.named_parameters()}
    optim = {f"{by_param[p]}.{k}": (_plain(v) if isinstance(v, torch.Tensor) and v.dim() else v.item() if isinstance(v, torch.Tensor) else v)
             for p, st in opt.state.items() for k, v in st.items()}
    return params, optim


def _save(rank, world, root):
    m, opt = _float8_model(0, world)
    _train(m, opt, 0, STEPS_BEFORE)
    # A bias beside each float8 weight: FSDP2 then all-gathers bytes (uint8), which gloo carries.
    kinds = sorted({type(p._local_tensor).__name__ for n, p in m.named_parameters() if n.endswith("weight")})
    shardckpt.save({"model": m, "optim": opt, "step": STEPS_BEFORE}, root)
    snap = _snapshot(m, opt)
    return kinds, snap, _train(m, opt, STEPS_BEFORE, STEPS_AFTER)


def _load(rank, world, root):
    m, opt = _float8_model(7, world)
    state = {"model": m, "optim": opt, "step": 0}
    shardckpt.load(state, root)
    assert state["step"] == STEPS_BEFORE
    return _snapshot(m, opt), _train(m, opt, STEPS_BEFORE, STEPS_AFTER)


def _same(a, b):
    params, optim = a
    gparams, goptim = b
    assert params.keys() == gparams.keys() and optim.keys() == goptim.keys()
    for k in params:
        assert params[k].dtype == gparams[k].dtype and torch.equal(params[k], gparams[k]), k
    for k in optim:
        if isinstance(optim[k], torch.Tensor):
            assert torch.equal(optim[k], goptim[k]), k
        else:
            assert optim[k] == goptim[k], k


def test_float8_fsdp2_save2_load_2_1_and_one_process(tmp_path):
    root = str(tmp_path / "f8")
    kinds, snap, losses = run_ranks(2, _save, root)[0]
    assert kinds == ["WeightWithDynamicFloat8CastTensor"]  # the case of the regression
    m = shardckpt.inspect(root)
    w = m.tensors["model.0.weight._tensor"]
    assert list(w.shape) == [64, 32] and w.dtype == "BF16"
    for got in (run_ranks(2, _load, root)[0], run_ranks(1, _load, root)[0], _load(0, 0, root)):
        gsnap, glosses = got
        _same(snap, gsnap)
        assert glosses == losses
