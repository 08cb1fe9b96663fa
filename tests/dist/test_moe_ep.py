"""Expert-parallel states as users build them, saved and loaded at other expert-parallel sizes on gloo ranks.

* torchtitan-style grouped experts: ``[E, d, h]`` parameters as DTensors
  sharded on the expert dim over an ``ep`` mesh dim, FSDP2 over the rest
  (``dp_shard_mod_ep``, on dim 1), dense layers FSDP2 over every rank;
  saved at EP=2 on 4 ranks, loaded at EP=4, EP=1 and in one process;
* per-expert modules (Megatron-style): each rank holds only its own experts,
  under their global names; a rank-union save of thousands of distinct names
  per rank (the manifest's tensor table and columnar index files of format
  v5), loaded at another EP size;
* AdamW state of both, bit-exact after each load.
"""

from __future__ import annotations

import os

import pytest
import torch
from _dist import run_ranks
from torch import nn

import shardckpt

E, D, H = 8, 4, 6  # experts, model dim, expert hidden dim


def _full(name, shape):
    g = torch.Generator().manual_seed(sum(map(ord, name)) * 7919)
    return torch.randn(shape, generator=g)


class GroupedExperts(nn.Module):
    """torchtitan's ``GroupedExperts``: one ``[E, ...]`` parameter per matrix."""

    def __init__(self):
        super().__init__()
        self.w1 = nn.Parameter(torch.empty(E, D, H))
        self.w2 = nn.Parameter(torch.empty(E, H, D))
        self.w3 = nn.Parameter(torch.empty(E, D, H))

    def forward(self, x):  # unused: [E, tokens, D] -> [E, tokens, D]
        return torch.bmm(torch.nn.functional.silu(torch.bmm(x, self.w1)) * torch.bmm(x, self.w3), self.w2)


class MoEBlock(nn.Module):
    def __init__(self):
        super().__init__()
        self.norm = nn.LayerNorm(D)
        self.router = nn.Linear(D, E, bias=False)
        self.experts = GroupedExperts()

    def forward(self, x):  # unused
        return self.router(self.norm(x))


class MoEModel(nn.Module):
    def __init__(self):
        super().__init__()
        self.embed = nn.Embedding(10, D)
        self.layers = nn.ModuleList([MoEBlock(), MoEBlock()])
        self.out = nn.Linear(D, 10)

    def forward(self, x):  # unused: gradients are set directly (_step)
        return self.out(self.embed(x))

    def __getitem__(self, key):
        return getattr(self, key)


def _grouped_model():
    model = MoEModel()
    with torch.no_grad():
        for name, p in model.named_parameters():
            p.copy_(_full(name, p.shape))
    return model


def _parallelize(model, world, ep):
    """torchtitan's layout: experts Shard(0) over ``ep``, FSDP2 over ``dp_shard_mod_ep`` (dim 1); dense FSDP2 over all."""
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard
    from torch.distributed.tensor import Shard, distribute_tensor

    mesh = init_device_mesh("cpu", (world // ep, ep), mesh_dim_names=("dp_shard_mod_ep", "ep"))
    dense = mesh["dp_shard_mod_ep", "ep"]._flatten("dp_shard")
    for block in model["layers"]:
        ex = block.experts
        if ep > 1:
            for n, p in list(ex.named_parameters()):
                setattr(ex, n, nn.Parameter(distribute_tensor(p.data, mesh["ep"], [Shard(0)])))
            fully_shard(ex, mesh=mesh["dp_shard_mod_ep"], shard_placement_fn=lambda p: Shard(1))
        else:
            fully_shard(ex, mesh=dense)
        fully_shard(block, mesh=dense)
    fully_shard(model, mesh=dense)
    return model


def _step(model, opt):
    """One AdamW step from known gradients (the same global gradient whatever the layout)."""
    from torch.distributed.tensor import DTensor, distribute_tensor

    for name, p in model.named_parameters():
        g = _full("grad." + name, p.shape)
        p.grad = distribute_tensor(g, p.device_mesh, p.placements) if isinstance(p, DTensor) else g
    opt.step()
    opt.zero_grad()


def _full_of(t):
    from torch.distributed.tensor import DTensor

    return (t.full_tensor() if isinstance(t, DTensor) else t).detach().clone()


def _snapshot(model, opt):
    """Parameters and AdamW state by parameter name, as full tensors."""
    names = {p: n for n, p in model.named_parameters()}
    out = {f"param.{n}": _full_of(p) for n, p in model.named_parameters()}
    for p, st in opt.state.items():
        for k, v in st.items():
            out[f"{k}.{names[p]}"] = _full_of(v) if torch.is_tensor(v) else torch.tensor(v)
    return out


def _placements(model):
    return {n: [repr(pl) for pl in p.placements] for n, p in model.named_parameters()}


def _grouped_save(rank, world, path):
    model = _parallelize(_grouped_model(), world, ep=2)
    opt = torch.optim.AdamW(model.parameters(), lr=0.01)
    _step(model, opt)
    shardckpt.save({"model": model, "optim": opt, "step": 3}, path)
    return _snapshot(model, opt), _placements(model)


def _grouped_load(rank, world, path, ep):
    torch.manual_seed(100 + rank)
    model = _grouped_model()
    with torch.no_grad():
        for p in model.parameters():
            p.zero_()
    model = _parallelize(model, world, ep=ep)
    opt = torch.optim.AdamW(model.parameters(), lr=0.01)
    _step(model, opt)  # a state to overwrite: every value must come from the checkpoint
    state = {"model": model, "optim": opt, "step": 0}
    shardckpt.load(state, path)
    return _snapshot(model, opt), _placements(model), state["step"]


def _assert_same(want, got):
    assert sorted(want) == sorted(got)
    bad = [k for k in want if not (want[k].dtype == got[k].dtype and torch.equal(want[k], got[k]))]
    assert not bad, f"not bit-exact: {bad[:8]}"


@pytest.fixture(scope="module")
def grouped(tmp_path_factory):
    path = str(tmp_path_factory.mktemp("moe") / "grouped")
    (want, placements), *_ = run_ranks(4, _grouped_save, path)
    return path, want, placements


def test_grouped_experts_are_ep_sharded_as_torchtitan_does(grouped):
    _, _, pl = grouped
    # experts: FSDP on dim 1 over dp_shard_mod_ep, the expert dim over ep
    assert pl["layers.0.experts.w1"] == ["Shard(dim=1)", "Shard(dim=0)"], pl["layers.0.experts.w1"]
    assert pl["layers.0.router.weight"] == ["Shard(dim=0)"]
    m = shardckpt.inspect(grouped[0])
    t = m.tensors["model.layers.0.experts.w1"]
    assert t.shape == [E, D, H] and t.layout["mesh_dim_names"] == ["dp_shard_mod_ep", "ep"]
    assert len(t.chunks) == 4  # 2 expert groups x 2 FSDP halves of d


@pytest.mark.parametrize("ep", [4, 1])
def test_grouped_experts_load_at_another_ep_size(grouped, ep):
    path, want, _ = grouped
    for got, pl, step in run_ranks(4, _grouped_load, path, ep):
        _assert_same(want, got)
        assert step == 3
        assert pl["layers.1.experts.w2"] == (["Shard(dim=1)", "Shard(dim=0)"] if ep > 1 else ["Shard(dim=0)"])


def test_grouped_experts_load_in_one_process(grouped):
    path, want, _ = grouped
    model = _grouped_model()
    with torch.no_grad():
        for p in model.parameters():
            p.zero_()
    opt = torch.optim.AdamW(model.parameters(), lr=0.01)
    _step(model, opt)
    state = {"model": model, "optim": opt, "step": 0}
    shardckpt.load(state, path)
    _assert_same(want, _snapshot(model, opt))
    assert state["step"] == 3


# --------------------------------------------------------------------------
# per-expert modules: each rank holds its own experts under global names

LAYERS, EXPERTS = 16, 64  # at EP=4: 16 x 16 x 2 expert params a rank, x 4 with AdamW's state


class Expert(nn.Module):
    def __init__(self):
        super().__init__()
        self.w1 = nn.Linear(D, 3, bias=False)
        self.w2 = nn.Linear(3, D, bias=False)


class LocalExperts(nn.Module):
    """A block holding experts ``own`` only, under their global numbers (``experts.<e>.w1.weight``)."""

    def __init__(self, own):
        super().__init__()
        self.router = nn.Linear(D, EXPERTS, bias=False)  # dense: every rank holds it
        self.experts = nn.ModuleDict({str(e): Expert() for e in own})


def _expert_model(rank, ep):
    per = EXPERTS // ep
    own = range(rank * per, (rank + 1) * per)
    model = nn.ModuleDict({"layers": nn.ModuleList([LocalExperts(own) for _ in range(LAYERS)])})
    with torch.no_grad():
        for name, p in model.named_parameters():
            p.copy_(_full(name, p.shape))
    return model


def _experts_save(rank, world, path):
    model = _expert_model(rank, ep=world)
    opt = torch.optim.AdamW(model.parameters(), lr=0.01)
    _step(model, opt)
    shardckpt.save({"model": model, "optim": opt, "step": 7}, path)
    return _snapshot(model, opt), len(opt.state) * 3 + len(list(model.parameters()))


def _experts_load(rank, world, path):
    model = _expert_model(rank, ep=world)
    with torch.no_grad():
        for p in model.parameters():
            p.zero_()
    opt = torch.optim.AdamW(model.parameters(), lr=0.01)
    _step(model, opt)
    state = {"model": model, "optim": opt, "step": 0}
    shardckpt.load(state, path)
    return _snapshot(model, opt), state["step"]


@pytest.mark.slow
def test_per_expert_modules_rank_union_save_loads_at_another_ep_size(tmp_path):
    path = str(tmp_path / "experts")
    saved = run_ranks(4, _experts_save, path, timeout=600)
    want = {}
    for snap, held in saved:
        assert held > 2000  # thousands of distinct names on each rank
        want.update(snap)
    # the union: every rank's experts, the dense routers once, AdamW's state of each
    assert len(shardckpt.verify(path).tensors) == LAYERS * (EXPERTS * 2 + 1) * 4
    with open(os.path.join(path, "manifest.json")) as f:
        assert '"tensor_table"' in f.read()  # format v5's compact records at this size
    for got, step in run_ranks(2, _experts_load, path, timeout=600):
        assert step == 7
        assert all(k in want for k in got)
        _assert_same({k: want[k] for k in got}, got)
    # and into one process holding every expert
    model = _expert_model(0, ep=1)
    opt = torch.optim.AdamW(model.parameters(), lr=0.01)
    _step(model, opt)
    state = {"model": model, "optim": opt, "step": 0}
    shardckpt.load(state, path)
    _assert_same(want, _snapshot(model, opt))
