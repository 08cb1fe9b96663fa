"""torchtitan's shapes of state (issue 10 part 6), with minimal lookalikes (no torchtitan dependency).

``OptimizersContainer``: one ``torch.optim.Optimizer`` object spanning a
list of model parts (one optimizer each), whose ``state_dict()`` is flat by
FQN (``state.<fqn>.exp_avg``, ``param_groups.<fqn>.lr``), as torchtitan's
``flatten_optimizer_state_dict=True``. ``LRSchedulersContainer``: a
Stateful holding one scheduler per part. ``ModelWrapper``: model parts
merged into one FQN dict. ``TrainState``: ints plus an ``io.BytesIO``.
"""

from __future__ import annotations

import io

import pytest
import torch
from safetensors.torch import save_file
from torch.distributed.checkpoint.state_dict import (
    StateDictOptions,
    get_model_state_dict,
    get_optimizer_state_dict,
    set_model_state_dict,
    set_optimizer_state_dict,
)

import shardckpt
from shardckpt.errors import StateMismatchError

FLAT = StateDictOptions(flatten_optimizer_state_dict=True)


class Part(torch.nn.Module):
    """One pipeline stage: its layers keep their global FQNs (``layers.<i>``), as torchtitan's parts."""

    def __init__(self, seed, idx):
        super().__init__()
        torch.manual_seed(seed)
        self.layers = torch.nn.ModuleDict({str(i): torch.nn.Linear(4, 4) for i in idx})

    def forward(self, x):
        for m in self.layers.values():
            x = torch.relu(m(x))
        return x


class OptimizersContainer(torch.optim.Optimizer):
    """torchtitan's: an Optimizer whose state_dict is every part's, flattened by FQN."""

    def __init__(self, parts, lr):
        self.parts = parts
        self.optimizers = [torch.optim.AdamW(p.parameters(), lr=lr) for p in parts]
        all_params = [q for p in parts for q in p.parameters()]
        torch.optim.Optimizer.__init__(self, all_params, {"lr": lr})

    def step(self, closure=None):
        for o in self.optimizers:
            o.step()

    def zero_grad(self, set_to_none=True):
        for o in self.optimizers:
            o.zero_grad(set_to_none=set_to_none)

    def state_dict(self):
        out = {}
        for m, o in zip(self.parts, self.optimizers):
            out.update(get_optimizer_state_dict(m, o, options=FLAT))
        return out

    def load_state_dict(self, sd):
        for m, o in zip(self.parts, self.optimizers):
            set_optimizer_state_dict(m, o, optim_state_dict=sd, options=FLAT)


class ModelWrapper:
    """torchtitan's: model parts as one Stateful, one FQN dict."""

    def __init__(self, parts):
        self.parts = parts

    def state_dict(self):
        return {k: v for p in self.parts for k, v in get_model_state_dict(p).items()}

    def load_state_dict(self, sd):
        for p in self.parts:
            set_model_state_dict(p, sd, options=StateDictOptions(strict=False))


class LRSchedulersContainer:
    def __init__(self, optimizers):
        self.schedulers = [torch.optim.lr_scheduler.LambdaLR(o, lambda s: 1.0 / (1 + s)) for o in optimizers.optimizers]

    def step(self):
        for s in self.schedulers:
            s.step()

    def state_dict(self):
        return {f"lr_scheduler_{i}": s.state_dict() for i, s in enumerate(self.schedulers)}

    def load_state_dict(self, sd):
        for i, s in enumerate(self.schedulers):
            s.load_state_dict(sd[f"lr_scheduler_{i}"])


class TrainState:
    def __init__(self):
        self.step = 0
        self.log_steps = io.BytesIO()

    def state_dict(self):
        return {"step": self.step, "log_steps": self.log_steps, "raw": b"\x00\x01\xfe"}

    def load_state_dict(self, sd):
        self.step = sd["step"]
        self.log_steps = sd["log_steps"]
        self.raw = sd["raw"]


def _titan(seed, steps):
    parts = [Part(seed, [0, 1]), Part(seed + 1, [2])]
    opt = OptimizersContainer(parts, lr=0.1)
    sched = LRSchedulersContainer(opt)
    ts = TrainState()
    for _ in range(steps):
        for p in parts:
            p(torch.ones(3, 4)).sum().backward()
        opt.step()
        opt.zero_grad()
        sched.step()
        ts.step += 1
        ts.log_steps.write(f"{ts.step}\n".encode())
    return parts, opt, sched, ts


@pytest.mark.parametrize("live_steps", [0, 1])
def test_optimizers_container_model_parts_schedulers_and_train_state_round_trip(tmp_path, live_steps):
    parts, opt, sched, ts = _titan(0, steps=3)
    url = str(tmp_path / "ck")
    shardckpt.save({"model": ModelWrapper(parts), "parts": parts, "optimizer": opt, "lr_scheduler": sched,
                    "train_state": ts}, url)
    # A fresh run (its optimizer before or after a first step) resumes exactly.
    p2, o2, s2, t2 = _titan(10, steps=live_steps)
    res = shardckpt.load({"model": ModelWrapper(p2), "parts": p2, "optimizer": o2, "lr_scheduler": s2,
                          "train_state": t2}, url)
    assert res == ([], [])
    for a, b in zip(parts, p2):
        for (k, x), y in zip(a.state_dict().items(), b.state_dict().values()):
            assert torch.equal(x, y), k
    want, got = opt.state_dict(), o2.state_dict()
    assert sorted(want) == sorted(got)
    for k in want:
        assert (torch.equal(want[k], got[k]) if isinstance(want[k], torch.Tensor) else want[k] == got[k]), k
    assert s2.state_dict() == sched.state_dict()
    assert t2.step == 3 and t2.log_steps.getvalue() == b"1\n2\n3\n" and t2.raw == b"\x00\x01\xfe"
    assert isinstance(t2.log_steps, io.BytesIO)
    # Training continues identically.
    for run in ((parts, opt), (p2, o2)):
        for p in run[0]:
            p(torch.ones(3, 4)).sum().backward()
        run[1].step()
    for a, b in zip(parts, p2):
        assert all(torch.equal(x, y) for x, y in zip(a.parameters(), b.parameters()))


def test_load_without_a_template_by_keys_and_inside_values(tmp_path):
    parts, opt, sched, ts = _titan(0, steps=2)
    url = str(tmp_path / "ck")
    shardckpt.save({"model": parts[0], "optimizer": opt, "train_state": ts, "cfg": {"lr": 0.1, "tags": ["a", "b"]}}, url)
    got = shardckpt.load(None, url, keys=["train_state.step", "model.layers.0.weight", "cfg.tags.1"])
    assert list(got) == ["cfg.tags.1", "model.layers.0.weight", "train_state.step"]
    assert got["train_state.step"] == 2 and got["cfg.tags.1"] == "b"
    w = got["model.layers.0.weight"]
    assert torch.equal(w, parts[0].layers["0"].weight) and type(w) is torch.Tensor
    whole = shardckpt.load({}, url)
    assert sorted(whole) == ["cfg", "model", "optimizer", "train_state"]
    assert whole["cfg"] == {"lr": 0.1, "tags": ["a", "b"]}
    assert whole["train_state"]["log_steps"].getvalue() == b"1\n2\n"
    key = "state.layers.2.weight.exp_avg"
    assert torch.equal(whole["optimizer"][key], opt.state_dict()[key])
    assert set(whole["model"]) == set(parts[0].state_dict())
    globbed = shardckpt.load(None, url, keys=["model.layers.1.*"])
    assert sorted(globbed) == ["model.layers.1.bias", "model.layers.1.weight"]
    with pytest.raises(StateMismatchError, match=r"nope\.step"):
        shardckpt.load(None, url, keys=["nope.step"])
    # None placeholders in a template are filled with what was saved there.
    state = {"model": None, "train_state": None}
    shardckpt.load(state, url)
    assert torch.equal(state["model"]["layers.0.bias"], parts[0].layers["0"].bias) and state["train_state"]["step"] == 2


def test_single_tensor_state_from_an_hf_file_and_strict_false_that_loads_nothing(tmp_path):
    w = torch.randn(3, 2)
    save_file({"w": w, "v": torch.ones(1)}, str(tmp_path / "t.safetensors"))
    state = {"w": torch.zeros(3, 2)}
    assert shardckpt.load(state, str(tmp_path / "t.safetensors"), strict=False) == ([], [])  # only what the state names
    assert torch.equal(state["w"], w)
    got = shardckpt.load(None, str(tmp_path / "t.safetensors"), keys=["w"])
    assert torch.equal(got["w"], w)
    model = torch.nn.Linear(2, 3)
    before = model.weight.detach().clone()
    with pytest.raises(StateMismatchError, match=r"strict=False would load nothing.*model\.bias, model\.weight.*key_map"):
        shardckpt.load({"model": model}, str(tmp_path / "t.safetensors"), strict=False)
    assert torch.equal(model.weight, before)
    # Loading some of the entries is still fine.
    res = shardckpt.load({"model": {"w": torch.zeros(3, 2), "x": torch.zeros(1)}}, str(tmp_path / "t.safetensors"), strict=False)
    assert res.missing_keys == ["model.x"]
