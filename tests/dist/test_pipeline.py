"""Rank-union saves on real gloo ranks: names that differ between ranks (pipeline stages), sub-group saves."""

from __future__ import annotations

import os

import torch
from _dist import run_ranks
from torch import nn

import shardckpt


def _stages(rank, world, root):
    """The issue's repro: each rank holds its own module (a pipeline stage keeping global FQNs)."""
    torch.manual_seed(rank)
    m = nn.ModuleDict({"a" if rank == 0 else "b": nn.Linear(2, 2)})
    opt = torch.optim.AdamW(m.parameters(), lr=0.1)
    next(iter(m.values()))(torch.ones(1, 2)).sum().backward()
    opt.step()
    shardckpt.save({"model": m, "optim": opt, "step": 5}, os.path.join(root, "pp"))
    return {k: v.clone() for k, v in m.state_dict().items()}, {
        k: {n: t.clone() if torch.is_tensor(t) else t for n, t in s.items()} for k, s in opt.state_dict()["state"].items()
    }


def test_stages_with_different_names_save_together_and_load_in_one_process(tmp_path):
    res = run_ranks(2, _stages, str(tmp_path))
    m = nn.ModuleDict({"a": nn.Linear(2, 2), "b": nn.Linear(2, 2)})
    opt = torch.optim.AdamW(m.parameters(), lr=0.1)
    state = {"model": m, "optim": opt, "step": 0}
    shardckpt.load(state, str(tmp_path / "pp"))
    assert state["step"] == 5
    for sd, _ in res:
        for k, v in sd.items():
            assert torch.equal(m.state_dict()[k], v), k
    # AdamW state of both stages, bit-exact.
    got = opt.state_dict()["state"]
    assert len(got) == 4, got.keys()
    flat = [s["exp_avg"] for s in got.values()]
    saved = [s["exp_avg"] for _, st in res for s in st.values()]
    assert sorted(x.sum().item() for x in flat) == sorted(x.sum().item() for x in saved)


def _subgroup(rank, world, root):
    import torch.distributed as dist
    from torch.distributed.device_mesh import DeviceMesh
    from torch.distributed.fsdp import fully_shard

    groups = [dist.new_group([r]) for r in range(world)]
    mesh = DeviceMesh.from_group(groups[rank], "cpu")
    torch.manual_seed(rank)
    m = nn.Sequential(nn.Linear(4, 4), nn.Linear(4, 2))
    fully_shard(m, mesh=mesh)
    url = os.path.join(root, f"part{rank}")
    shardckpt.save({"model": m}, url, process_group=groups[rank])
    want = {k: v.full_tensor().clone() for k, v in m.state_dict().items()}
    return url, want


def test_a_save_over_a_sub_group_loads(tmp_path):
    res = run_ranks(2, _subgroup, str(tmp_path))
    for url, want in res:
        shardckpt.verify(url)
        m = nn.Sequential(nn.Linear(4, 4), nn.Linear(4, 2))
        shardckpt.load({"model": m}, url)
        for k, v in want.items():
            assert torch.equal(m.state_dict()[k], v), (url, k)
