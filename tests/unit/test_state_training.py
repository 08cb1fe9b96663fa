"""Full training state in one process: optimizers, schedulers, scalers, RNG, per-rank values, meta init."""

import random

import numpy as np
import pytest
import torch
import torch.nn.functional as F
from _training import VOCAB, batch
from models import build

import shardckpt
from shardckpt.errors import StateMismatchError, UnsupportedStateError


def _run(model, opt, sched, scaler, start, steps, noise=0.1):
    """Steps with data from ``batch`` plus noise from all three global RNGs."""
    losses = []
    for s in range(start, start + steps):
        x, y = batch(s)
        logits = model(x) + noise * torch.randn(1) + noise * random.random() + noise * float(np.random.rand())
        loss = F.cross_entropy(logits.reshape(-1, VOCAB), y.reshape(-1))
        scaler.scale(loss).backward()
        scaler.step(opt)
        scaler.update()
        sched.step()
        opt.zero_grad()
        losses.append(loss.item())
    return losses, sched.get_last_lr()


def _make(seed, optim="adamw"):
    model = build(seed)
    if optim == "adamw":
        opt = torch.optim.AdamW(model.parameters(), lr=2e-2, weight_decay=0.1)
    else:
        opt = torch.optim.SGD(model.parameters(), lr=5e-2, momentum=0.9)
    sched = torch.optim.lr_scheduler.OneCycleLR(opt, max_lr=5e-2, total_steps=20)
    scaler = torch.amp.GradScaler("cpu", init_scale=2.0**8, growth_interval=2)
    return model, opt, sched, scaler


def _state(model, opt, sched, scaler, loader):
    return {"model": model, "optim": opt, "sched": sched, "scaler": scaler, "rng": shardckpt.RNGState(), "loader": shardckpt.PerRank(loader), "step": 0}


@pytest.mark.parametrize("optim", ["adamw", "sgd"])
def test_plain_module_resume_is_bit_exact(tmp_path, optim):
    torch.manual_seed(1), random.seed(1), np.random.seed(1)
    ref = _make(0, optim)
    straight, lr_straight = _run(*ref, 0, 6)
    ref_params = {k: v.clone() for k, v in ref[0].state_dict().items()}

    torch.manual_seed(1), random.seed(1), np.random.seed(1)
    run = _make(0, optim)
    first, _ = _run(*run, 0, 3)
    loader = {"epoch": 0, "position": 3, "order": torch.arange(5)}
    st = _state(*run, loader)
    st["step"] = 3
    shardckpt.save(st, str(tmp_path / "c"))

    # Everything different afterwards: seeds, init, hyperparameters, scaler.
    torch.manual_seed(99), random.seed(99), np.random.seed(99)
    fresh = _make(5, optim)
    for g in fresh[1].param_groups:
        g["lr"] = 123.0
    loader2 = {"epoch": 7, "position": 0, "order": torch.zeros(5, dtype=torch.long)}
    st2 = _state(*fresh, loader2)
    assert shardckpt.load(st2, str(tmp_path / "c")) == ([], [])
    assert st2["step"] == 3
    assert loader2["position"] == 3 and loader2["epoch"] == 0 and torch.equal(loader2["order"], torch.arange(5))
    assert fresh[3].get_scale() == run[3].get_scale()
    second, lr_resumed = _run(*fresh, 3, 3)
    assert first + second == straight
    assert lr_resumed == lr_straight
    for k, v in fresh[0].state_dict().items():
        assert torch.equal(v, ref_params[k]), k


def test_unstepped_optimizer_saved_as_is_and_loads_empty(tmp_path):
    # torch's get_optimizer_state_dict would run a zero-lr step here (step=1,
    # zero moments): the save must not change the live optimizer.
    model, opt, sched, scaler = _make(0)
    shardckpt.save({"model": model, "optim": opt}, str(tmp_path / "c"))
    assert not opt.state
    m = shardckpt.inspect(str(tmp_path / "c"))
    assert not [n for n in m.tensors if n.startswith("optim.")]
    assert m.values["optim"]["param_groups"][0]["params"][:2] == ["tiny", "emb.weight"]

    # into a stepped optimizer: it becomes the unstepped one again
    model2, opt2, _, _ = _make(1)
    model2(batch(0)[0]).sum().backward()
    opt2.step()
    shardckpt.load({"model": model2, "optim": opt2}, str(tmp_path / "c"))
    assert not opt2.state
    assert opt2.param_groups[0]["lr"] == opt.param_groups[0]["lr"]


def test_optimizer_state_matched_by_name_not_position(tmp_path):
    model, opt, *_ = _make(0)
    model(batch(0)[0]).sum().backward()
    opt.step()
    shardckpt.save({"model": model, "optim": opt}, str(tmp_path / "c"))
    names = {id(p): n for n, p in model.named_parameters()}
    saved = {names[id(p)]: opt.state[p] for p in model.parameters()}

    # Same parameters, reversed and split into two groups: each live group
    # draws from the one saved group, state follows the names.
    model2 = build(3)
    params = [p for _, p in model2.named_parameters()][::-1]
    opt2 = torch.optim.AdamW([{"params": params[:4]}, {"params": params[4:], "lr": 5.0}], lr=1.0)
    assert shardckpt.load({"model": model2, "optim": opt2}, str(tmp_path / "c")) == ([], [])
    names2 = {id(p): n for n, p in model2.named_parameters()}
    assert len(opt2.state) == len(saved)
    for p, st in opt2.state.items():
        ref = saved[names2[id(p)]]
        assert st["exp_avg"].shape == p.shape
        assert torch.equal(st["exp_avg"], ref["exp_avg"]) and torch.equal(st["step"], ref["step"])
    assert [g["lr"] for g in opt2.param_groups] == [opt.param_groups[0]["lr"]] * 2
    assert [len(g["params"]) for g in opt2.param_groups] == [4, len(params) - 4]

    # Saved with two groups, loaded into one: the groups were reorganized.
    model3 = build(0)
    opt3 = torch.optim.AdamW(
        [{"params": [p for p in model3.parameters() if p.ndim >= 2]}, {"params": [p for p in model3.parameters() if p.ndim < 2], "lr": 1e-3}],
        lr=2e-2,
    )
    model3(batch(0)[0]).sum().backward()
    opt3.step()
    shardckpt.save({"model": model3, "optim": opt3}, str(tmp_path / "g"))
    model4 = build(3)
    opt4 = torch.optim.AdamW(model4.parameters(), lr=1.0)
    with pytest.raises(StateMismatchError, match="parameter groups were reorganized"):
        shardckpt.load({"model": model4, "optim": opt4}, str(tmp_path / "g"))
    assert not opt4.state and opt4.param_groups[0]["lr"] == 1.0  # the failed load touched nothing
    shardckpt.load({"model": model4, "optim": opt4}, str(tmp_path / "g"), strict=False)
    assert len(opt4.state) == len(list(model4.parameters())) and opt4.param_groups[0]["lr"] == 2e-2


def test_partial_load_and_strict_false_report(tmp_path):
    model, opt, sched, scaler = _make(0)
    _run(model, opt, sched, scaler, 0, 2)
    shardckpt.save({"model": model, "optim": opt, "sched": sched, "step": 2}, str(tmp_path / "c"))

    # only the model, for evaluation: strict is fine
    ev = build(4)
    assert shardckpt.load({"model": ev}, str(tmp_path / "c")) == ([], [])
    for k, v in ev.state_dict().items():
        assert torch.equal(v, model.state_dict()[k])

    # a model with a new head and an extra entry: strict lists every offender
    class Bigger(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.base = build(4)
            self.extra = torch.nn.Linear(2, 2)

    big = Bigger()
    state = {"model": big.base, "extra": big.extra, "epoch": 1}
    with pytest.raises(StateMismatchError) as e:
        shardckpt.load(state, str(tmp_path / "c"))
    assert "extra.bias" in str(e.value) and "extra.weight" in str(e.value) and "epoch" in str(e.value)
    res = shardckpt.load(state, str(tmp_path / "c"), strict=False)
    assert res.missing_keys == ["epoch", "extra.bias", "extra.weight"]
    assert res.unexpected_keys == []

    # unexpected: the live model lacks a saved parameter
    small = build(4)
    del small.tiny
    small.tiny = None
    res = shardckpt.load({"model": small, "optim": torch.optim.AdamW(small.parameters())}, str(tmp_path / "c"), strict=False)
    assert "model.tiny" in res.unexpected_keys and "optim.state.tiny" in res.unexpected_keys
    assert not any(k.startswith("optim.state.tiny.") for k in res.unexpected_keys)


def test_optimizer_pairing_errors(tmp_path):
    model, opt, *_ = _make(0)
    with pytest.raises(UnsupportedStateError, match="its model must be in the same state"):
        shardckpt.save({"optim": opt}, str(tmp_path / "a"))
    # a model and one of its submodules: the outermost names the parameters
    sub_opt = torch.optim.SGD(model.blocks[0].parameters(), lr=0.1, momentum=0.9)
    model.blocks[0].up.weight.grad = torch.ones_like(model.blocks[0].up.weight)
    sub_opt.step()
    shardckpt.save({"model": model, "block": model.blocks[0], "optim": sub_opt}, str(tmp_path / "b"))
    assert "optim.state.blocks.0.up.weight.momentum_buffer" in shardckpt.inspect(str(tmp_path / "b")).tensors
    # two unrelated modules holding the same parameters
    other = torch.nn.Module()
    other.w = model.blocks[0].up.weight
    opt2 = torch.optim.SGD([model.blocks[0].up.weight], lr=0.1)
    with pytest.raises(UnsupportedStateError, match="several unrelated modules"):
        shardckpt.save({"a": model, "b": other, "optim": opt2}, str(tmp_path / "c"))


def test_meta_model_is_filled_without_random_init(tmp_path):
    model = build(0)
    shardckpt.save({"model": model}, str(tmp_path / "c"))
    with torch.device("meta"):
        m2 = build(1)
    before = torch.get_rng_state()
    res = shardckpt.load({"model": m2}, str(tmp_path / "c"))
    assert res == ([], [])
    assert torch.equal(torch.get_rng_state(), before)  # no init ran on real tensors
    for k, v in m2.state_dict().items():
        assert v.device.type == "cpu" and torch.equal(v, model.state_dict()[k]), k
    assert isinstance(m2.tiny, torch.nn.Parameter) and m2.tiny.requires_grad
    out = m2(batch(0)[0])
    torch.testing.assert_close(out, model(batch(0)[0]), rtol=0, atol=0)
    with torch.device("meta"):
        m3 = build(1)
    with pytest.raises(UnsupportedStateError, match="meta device"):
        shardckpt.save({"model": m3}, str(tmp_path / "d"))

    # tied weights stay tied: one new Parameter for both names
    def tied():
        m = build(2, dim=7, vocab=37)
        m.head.weight = m.emb.weight
        return m

    src = tied()
    shardckpt.save({"model": src}, str(tmp_path / "t"))
    with torch.device("meta"):
        m4 = tied()
    shardckpt.load({"model": m4}, str(tmp_path / "t"))
    assert m4.head.weight is m4.emb.weight and torch.equal(m4.emb.weight, src.emb.weight)


def test_rng_state_streams(tmp_path):
    torch.manual_seed(5), random.seed(5), np.random.seed(5)
    rng = shardckpt.RNGState()
    shardckpt.save({"rng": rng}, str(tmp_path / "c"))
    want = (torch.rand(4), random.random(), np.random.rand(3), random.gauss(0, 1))
    torch.manual_seed(0), random.seed(0), np.random.seed(0)
    shardckpt.load({"rng": shardckpt.RNGState()}, str(tmp_path / "c"))
    got = (torch.rand(4), random.random(), np.random.rand(3), random.gauss(0, 1))
    assert torch.equal(want[0], got[0]) and want[1] == got[1] and (want[2] == got[2]).all() and want[3] == got[3]
    m = shardckpt.inspect(str(tmp_path / "c"))
    assert {"rng.@rank0.torch", "rng.@rank0.python.state", "rng.@rank0.numpy.keys"} <= set(m.tensors)
    assert m.values["rng"] == {"__shardckpt__": "per_rank", "world_size": 1}
    assert m.extra["per_rank"][0]["rng"]["numpy"]["kind"] == "MT19937"


def test_per_rank_values(tmp_path):
    pos = {"position": 17, "seen": [1, 2]}
    buf = torch.arange(3.0)
    shardckpt.save({"pos": shardckpt.PerRank(pos), "buf": shardckpt.PerRank(buf)}, str(tmp_path / "c"))
    pos2, buf2 = {"position": 0, "seen": []}, torch.zeros(3)
    live = {"pos": shardckpt.PerRank(pos2), "buf": shardckpt.PerRank(buf2)}
    shardckpt.load(live, str(tmp_path / "c"))
    assert pos2 == pos and live["pos"].obj is pos2 and torch.equal(buf2, buf)
    with pytest.raises(UnsupportedStateError, match="on_resize"):
        shardckpt.PerRank(pos, on_resize="merge")
    # a checkpoint holding a plain value where the live state is per-rank
    shardckpt.save({"pos": dict(pos)}, str(tmp_path / "d"))
    with pytest.raises(StateMismatchError, match="PerRank"):
        shardckpt.load({"pos": shardckpt.PerRank({})}, str(tmp_path / "d"))


def test_per_rank_walk_resize_paths():
    """The state layer alone: per-rank names, and what each on_resize does at another world size."""
    from shardckpt._state import flatten_for_load, flatten_for_save

    saved = [flatten_for_save({"pos": shardckpt.PerRank({"n": 10 * r, "buf": torch.full((2,), float(r))})}, rank=r, world=2) for r in range(2)]
    assert saved[1].per_rank_tensors == ["pos.@rank1.buf"] and list(saved[1].tensors) == ["pos.@rank1.buf"]
    assert saved[1].per_rank == {"pos": {"n": 10, "buf": {"__shardckpt__": "tensor", "name": "pos.@rank1.buf"}}}
    tree = saved[0].tree
    assert tree == {"pos": {"__shardckpt__": "per_rank", "world_size": 2}}
    metas = {"pos.@rank0.buf": None, "pos.@rank1.buf": None}
    trees = [s.per_rank for s in saved]

    # same world: this rank's entry is a target, the other rank's is skipped
    live = {"n": -1, "buf": torch.zeros(2)}
    flat, missing, unexpected = flatten_for_load({"pos": shardckpt.PerRank(live)}, tree, metas, rank=1, world=2, per_rank=trees)
    assert list(flat.tensors) == ["pos.@rank1.buf"] and flat.skip == ["pos.@rank0"]
    for f in flat.finalizers:
        f()
    assert live["n"] == 10 and missing == [] and unexpected == []

    # another world: error (default), skip, or remap
    with pytest.raises(StateMismatchError, match=r"pos: per-rank state was saved by 2 ranks but this load runs on 3.*on_resize=fn"):
        flatten_for_load({"pos": shardckpt.PerRank(live)}, tree, metas, rank=0, world=3, saved_world=2, per_rank=trees)
    flat, _, _ = flatten_for_load({"pos": shardckpt.PerRank(live, on_resize="skip")}, tree, metas, rank=0, world=3, saved_world=2, per_rank=trees)
    assert not flat.tensors and not flat.creates and not flat.finalizers and sorted(flat.skip) == ["pos.@rank0", "pos.@rank1"]

    def remap(states, rank, world):
        return {"n": sum(s["n"] for s in states) + rank, "buf": states[0]["buf"] + states[1]["buf"]}

    live = {"n": -1, "buf": torch.zeros(2)}
    flat, _, _ = flatten_for_load({"pos": shardckpt.PerRank(live, on_resize=remap)}, tree, metas, rank=2, world=3, saved_world=2, per_rank=trees)
    assert sorted(flat.creates) == ["pos.@rank0.buf", "pos.@rank1.buf"]
    for name, put in flat.creates.items():
        put(torch.full((2,), float(name[len("pos.@rank")])))
    for f in flat.finalizers:
        f()
    assert live["n"] == 12 and torch.equal(live["buf"], torch.ones(2))

    # a manifest whose per-rank list does not match its world size is damaged
    with pytest.raises(shardckpt.CorruptCheckpointError, match="per-rank state is damaged"):
        flatten_for_load({"pos": shardckpt.PerRank(live)}, tree, metas, rank=0, world=2, per_rank=trees[:1])
