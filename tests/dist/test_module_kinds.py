"""Module kinds across ranks (issue 19): extra state at any world size, odd names.

(Subclasses in DTensors: tests/dist/test_subclass_fsdp2.py.)

Every ``get_extra_state`` kind (dict, int, ``io.BytesIO``, tensor, dict
holding a tensor) saved by FSDP2 on 2 ranks comes back through
``set_extra_state`` on 3 ranks and into one process, as
``nn.Module.load_state_dict`` (and DCP) give it back.
"""

from __future__ import annotations

import io
import os

import pytest
import torch

import shardckpt
from _dist import run_ranks
from shardckpt.errors import UnsupportedStateError


class WithExtra(torch.nn.Module):
    """A linear layer keeping extra state (as TransformerEngine keeps its FP8 scaling state)."""

    def __init__(self, value):
        super().__init__()
        self.lin = torch.nn.Linear(8, 8)
        self.value = value

    def forward(self, x):
        return self.lin(x)

    def get_extra_state(self):
        return self.value

    def set_extra_state(self, value):
        self.value = value


def extra_kinds(seed: int):
    g = torch.Generator().manual_seed(seed)
    return {
        "as_dict": {"amax_history": [1.5, 2.5], "step": seed},
        "as_int": 100 + seed,
        "as_bytes": io.BytesIO(bytes([seed, 1, 2, 3])),
        "as_tensor": torch.randn(5, generator=g),
        "as_dict_tensor": {"scale": torch.randn(3, generator=g), "n": seed},
    }


class Stack(torch.nn.ModuleDict):
    def forward(self, x):
        for m in self.values():
            x = m(x)
        return x


def _model(seed: int) -> torch.nn.Module:
    torch.manual_seed(seed)
    return Stack({k: WithExtra(v) for k, v in extra_kinds(seed).items()})


def _plain(v):
    if isinstance(v, io.BytesIO):
        return ("bytesio", v.getvalue())
    if isinstance(v, torch.Tensor):
        return ("tensor", v.tolist())
    if isinstance(v, dict):
        return {k: _plain(x) for k, x in v.items()}
    return v


def _shard(model):
    from torch.distributed.fsdp import fully_shard

    for m in model.values():
        fully_shard(m)
    fully_shard(model)
    return model


def _save_extra(rank, world, root):
    model = _shard(_model(1))
    shardckpt.save({"model": model}, f"{root}/ck")
    return {k: _plain(m.value) for k, m in model.items()}


def _load_extra(rank, world, root):
    model = _shard(_model(7))
    res = shardckpt.load({"model": model}, f"{root}/ck")
    assert res.missing_keys == [] and res.unexpected_keys == [], res
    return {k: _plain(m.value) for k, m in model.items()}


def test_extra_state_every_kind_fsdp2_2_to_3_and_one_process(tmp_path):
    saved = run_ranks(2, _save_extra, str(tmp_path))
    assert saved[0] == saved[1] == {k: _plain(v) for k, v in extra_kinds(1).items()}
    got = run_ranks(3, _load_extra, str(tmp_path))
    assert got == [saved[0]] * 3
    # Into one process, no process group, the plain model.
    plain = _model(9)
    shardckpt.load({"model": plain}, str(tmp_path / "ck"), no_dist=True)
    assert {k: _plain(m.value) for k, m in plain.items()} == saved[0]
    # nn.Module.load_state_dict of the model's own state dict gives the same.
    ref = _model(9)
    ref.load_state_dict(_model(1).state_dict())
    assert {k: _plain(m.value) for k, m in ref.items()} == saved[0]


def _save_names(rank, world, root):
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import Shard, distribute_tensor

    mesh = init_device_mesh("cpu", (world,))
    w = distribute_tensor(torch.arange(16.0).reshape(4, 4), mesh, [Shard(0)])
    out = {}
    for name, state in {
        "clash": {"w": w, "w@0,0": torch.ones(2)},
        "clash_reshard": {"w": torch.ones(4, 4), "w@2,0": torch.ones(2)},
        "surrogate": {"\ud800": torch.ones(2)},
    }.items():
        try:
            shardckpt.save(state, f"{root}/{name}")
            out[name] = None
        except UnsupportedStateError as e:
            out[name] = str(e)
    return out, sorted(os.listdir(root))


def test_odd_names_refused_on_every_rank_before_any_byte(tmp_path):
    out = run_ranks(2, _save_names, str(tmp_path))
    assert out[0] == out[1]
    errs, files = out[0]
    assert files == []
    assert "w@0,0" in errs["clash"] and "w@2,0" in errs["clash_reshard"], errs
    assert "surrogate" in errs["surrogate"], errs


def _zero_size_2d(rank, world, root, shape):
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import Shard, distribute_tensor

    mesh = init_device_mesh("cpu", tuple(shape))
    t = distribute_tensor(torch.empty(0, 4), mesh, [Shard(0), Shard(1)])
    shardckpt.save({"t": t, "v": torch.ones(3)}, f"{root}/ck")
    back = {"t": distribute_tensor(torch.empty(0, 4), mesh, [Shard(0), Shard(1)]), "v": torch.zeros(3)}
    shardckpt.load(back, f"{root}/ck")
    return back["v"].tolist(), list(back["t"].shape)


@pytest.mark.parametrize("shape", [(2, 1), (1, 2)])
def test_zero_size_dtensor_shard0_shard1(tmp_path, shape):
    """Saves and loads on every rank alike (it raised a raw RuntimeError on rank 0 outside the agreement)."""
    assert run_ranks(2, _zero_size_2d, str(tmp_path), list(shape)) == [([1.0, 1.0, 1.0], [0, 4])] * 2


def _fsdp1(model):
    from torch.distributed.fsdp import FullyShardedDataParallel as FSDP
    from torch.distributed.fsdp.wrap import ModuleWrapPolicy

    return FSDP(model, auto_wrap_policy=ModuleWrapPolicy({torch.nn.Linear}), device_id=torch.device("cpu"))


def _save_extra_fsdp1(rank, world, root):
    model = _fsdp1(_model(1))
    shardckpt.save({"model": model}, f"{root}/ck")
    return {k: _plain(m.value) for k, m in model.module.items()}


def _load_extra_fsdp1(rank, world, root):
    model = _fsdp1(_model(7))
    res = shardckpt.load({"model": model}, f"{root}/ck")
    assert res.missing_keys == [] and res.unexpected_keys == [], res
    return {k: _plain(m.value) for k, m in model.module.items()}


def test_extra_state_every_kind_fsdp1_2_to_2_and_one_process(tmp_path):
    """FSDP1 modules' extra state comes back through set_extra_state, as for FSDP2 and plain modules."""
    saved = run_ranks(2, _save_extra_fsdp1, str(tmp_path))
    assert saved[0] == saved[1] == {k: _plain(v) for k, v in extra_kinds(1).items()}
    assert run_ranks(2, _load_extra_fsdp1, str(tmp_path)) == [saved[0]] * 2
    plain = _model(9)
    shardckpt.load({"model": plain}, str(tmp_path / "ck"), no_dist=True)
    assert {k: _plain(m.value) for k, m in plain.items()} == saved[0]
