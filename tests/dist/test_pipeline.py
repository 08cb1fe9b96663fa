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


# --------------------------------------------------------------------------
# a real torch.distributed.pipelining run (gloo, CPU)


class _Net(nn.Module):
    """Four blocks and a head; stages keep global FQNs (torchtitan's way: delete what the stage does not run)."""

    def __init__(self):
        super().__init__()
        torch.manual_seed(0)
        self.layers = nn.ModuleDict({str(i): nn.Linear(8, 8) for i in range(4)})
        self.out = nn.Linear(8, 3)

    def forward(self, x):
        for layer in self.layers.values():
            x = torch.tanh(layer(x))
        return self.out(x) if self.out is not None else x


def _stage_of(split, stage):
    m = _Net()
    keep = {str(i) for i in split[stage]}
    for k in list(m.layers):
        if k not in keep:
            del m.layers[k]
    if stage != len(split) - 1:
        m.out = None
    return m


def _batch(i):
    g = torch.Generator().manual_seed(100 + i)
    return torch.randn(4, 8, generator=g), torch.randint(0, 3, (4,), generator=g)


def _loss(out, y):
    return nn.functional.cross_entropy(out, y)


def _pp_run(rank, world, root, split, dp):
    """PP=len(split) (x FSDP2=dp) with ScheduleGPipe: one step, one collective save (shardckpt and DCP), the next losses."""
    import torch.distributed as dist
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.state_dict import get_model_state_dict
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.pipelining import PipelineStage, ScheduleGPipe

    pp = len(split)
    mesh = init_device_mesh("cpu", (pp, dp), mesh_dim_names=("pp", "dp"))
    stage = mesh.get_local_rank("pp")
    m = _stage_of(split, stage)
    if dp > 1:
        from torch.distributed.fsdp import fully_shard

        for layer in m.layers.values():
            fully_shard(layer, mesh=mesh["dp"])
        fully_shard(m, mesh=mesh["dp"])
    opt = torch.optim.AdamW(m.parameters(), lr=0.01)

    def step(i):
        s = PipelineStage(m, stage, pp, torch.device("cpu"), group=mesh.get_group("pp"))
        sched = ScheduleGPipe(s, n_microbatches=2, loss_fn=_loss)
        x, y = _batch(i)
        losses = []
        if stage == 0:
            sched.step(x)
        elif stage == pp - 1:
            sched.step(target=y, losses=losses)
        else:
            sched.step()
        return [v.detach().clone() for v in losses]

    step(0)
    opt.step()
    opt.zero_grad()
    url = os.path.join(root, "pp")
    shardckpt.save({"model": m, "optim": opt, "step": 1}, url)
    dcp.save({"model": get_model_state_dict(m)}, checkpoint_id=os.path.join(root, "dcp"))
    def full(t):
        return t.full_tensor() if hasattr(t, "full_tensor") else t.clone()

    sd = {k: full(v) for k, v in m.state_dict().items()}
    st = {n: {k: full(t) for k, t in opt.state[p].items()} for n, p in m.named_parameters()}
    after = step(1)  # the next losses, to compare with a resumed run
    dist.barrier()
    return stage, after, sd, st


def _full_losses(model, i):
    x, y = _batch(i)
    return [_loss(model(xm), ym).detach() for xm, ym in zip(x.chunk(2), y.chunk(2))]


def _check_one_process(root, got):
    """Load the PP save into one process (PP=1): model + AdamW bit-exact against what the stages held, same next losses."""
    m = _Net()
    opt = torch.optim.AdamW(m.parameters(), lr=0.01)
    state = {"model": m, "optim": opt, "step": 0}
    shardckpt.load(state, os.path.join(root, "pp"))
    assert state["step"] == 1
    names = dict(m.named_parameters())
    seen = set()
    for _, _, sd, st in got:
        for k, v in sd.items():
            assert torch.equal(m.state_dict()[k], v), k
            seen.add(k)
        for n, s in st.items():
            for k, t in s.items():
                assert torch.equal(opt.state[names[n]][k], t), (n, k)
    assert seen == set(m.state_dict())  # the stages' union is the whole model
    # The next losses of the PP run, from the loaded one-process model.
    last = [g[1] for g in got if g[0] == max(g[0] for g in got)][0]
    for a, b in zip(_full_losses(m, 1), last):
        assert torch.equal(a, b), (a, b)
    # DCP (reference): the same PP save loads into one process too.
    import torch.distributed.checkpoint as dcp

    d = _Net()
    sd = {"model": d.state_dict()}
    dcp.load(sd, checkpoint_id=os.path.join(root, "dcp"))
    for k, v in sd["model"].items():
        assert torch.equal(v, m.state_dict()[k]), k
    return m, opt


def test_pipeline_pp2_saves_once_and_loads_in_one_process(tmp_path):
    got = run_ranks(2, _pp_run, str(tmp_path), [[0, 1], [2, 3]], 1, timeout=300)
    _check_one_process(str(tmp_path), got)


def _pp_load(rank, world, root, split, dp):
    """Load the PP save at another stage split / FSDP2 degree; return this stage's full state."""
    from torch.distributed.device_mesh import init_device_mesh

    pp = len(split)
    mesh = init_device_mesh("cpu", (pp, dp), mesh_dim_names=("pp", "dp"))
    stage = mesh.get_local_rank("pp")
    m = _stage_of(split, stage)
    opt = torch.optim.AdamW(m.parameters(), lr=0.01)
    # Strict: a stage holds part of the checkpoint, and an entry is unexpected
    # only if no rank's state holds it (the ranks decide together).
    shardckpt.load({"model": m, "optim": opt, "step": 0}, os.path.join(root, "pp"))
    return {k: v.clone() for k, v in m.state_dict().items()}, {
        n: {k: t.clone() for k, t in opt.state[p].items()} for n, p in m.named_parameters()
    }


def test_pipeline_pp2_x_fsdp2_saves_once_and_loads_at_other_splits(tmp_path):
    got = run_ranks(4, _pp_run, str(tmp_path), [[0, 1], [2, 3]], 2, timeout=400)
    m, opt = _check_one_process(str(tmp_path), got)
    full = m.state_dict()
    names = dict(m.named_parameters())
    # Another stage split (layer 0 | layers 1-3), and PP=2 x FSDP2=1.
    for res in run_ranks(2, _pp_load, str(tmp_path), [[0], [1, 2, 3]], 1, timeout=300):
        sd, st = res
        for k, v in sd.items():
            assert torch.equal(v, full[k]), k
        for n, s in st.items():
            for k, t in s.items():
                assert torch.equal(t, opt.state[names[n]][k]), (n, k)


def _per_stage_dirs(rank, world, root):
    """The issue's workaround: one directory per stage, saved over the stage's dp group."""
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard

    mesh = init_device_mesh("cpu", (2, 2), mesh_dim_names=("pp", "dp"))
    stage = mesh.get_local_rank("pp")
    m = _stage_of([[0, 1], [2, 3]], stage)
    fully_shard(m, mesh=mesh["dp"])
    shardckpt.save({"model": m}, os.path.join(root, f"stage{stage}"), process_group=mesh.get_group("dp"))
    return {k: v.full_tensor() for k, v in m.state_dict().items()}


def test_per_stage_directories_over_the_dp_group(tmp_path):
    got = run_ranks(4, _per_stage_dirs, str(tmp_path), timeout=300)
    m = _Net()
    for stage in (0, 1):
        url = str(tmp_path / f"stage{stage}")
        shardckpt.verify(url)
        shardckpt.load({"model": m}, url, strict=False)
    for sd in got:
        for k, v in sd.items():
            assert torch.equal(m.state_dict()[k], v), k


def _mismatch(rank, world, root):
    url = os.path.join(root, "bad")
    try:
        shardckpt.save({"w": torch.zeros(2 + rank), "opt": {"lr": 0.1}}, url)
    except shardckpt.errors.UnsupportedStateError as e:
        return str(e), os.path.exists(os.path.join(url, "manifest.json")), os.path.exists(os.path.join(url, "data"))
    return None


def test_a_name_that_differs_between_ranks_is_refused_on_every_rank_before_writing(tmp_path):
    res = run_ranks(2, _mismatch, str(tmp_path))
    assert res[0] is not None and res[0] == res[1], res
    msg, committed, data = res[0]
    assert "w: dtype F32, shape [2]" in msg and "shape [3]" in msg and "ranks 0" in msg and "ranks 1" in msg, msg
    assert not committed and not data


def _strict_stage_loads(rank, world, root):
    """Strict loads on 2 ranks of the 2-stage save: each stage its own part, then both holding only 'a'."""
    torch.manual_seed(10 + rank)
    m = nn.ModuleDict({"a" if rank == 0 else "b": nn.Linear(2, 2)})
    opt = torch.optim.AdamW(m.parameters(), lr=0.1)
    res = shardckpt.load({"model": m, "optim": opt, "step": 0}, os.path.join(root, "pp"))
    mine = {k: v.clone() for k, v in m.state_dict().items()}
    only_a = nn.ModuleDict({"a": nn.Linear(2, 2)})
    try:
        shardckpt.load({"model": only_a}, os.path.join(root, "pp"))
        refused = None
    except shardckpt.StateMismatchError as e:
        refused = str(e)
    return mine, list(res.unexpected_keys), refused


def test_strict_stage_loads_check_the_union_of_the_ranks_states(tmp_path):
    saved = run_ranks(2, _stages, str(tmp_path))
    got = run_ranks(2, _strict_stage_loads, str(tmp_path))
    for (want, _), (mine, unexpected, refused) in zip(saved, got):
        assert mine.keys() == want.keys() and all(torch.equal(mine[k], want[k]) for k in want)
        # Another stage's entries are not this rank's 'unexpected' after a strict load.
        assert unexpected == []
        # No rank holds 'b' (nor the optimizer, step): refused on every rank alike, naming it.
        assert refused is not None and "not in the state of any rank" in refused and "model.b.weight" in refused, refused
    assert got[0][2] == got[1][2]
