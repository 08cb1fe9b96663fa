"""Names (issue 19 items 3 and 5): wrapper prefixes removed at every depth; key_map carries the optimizer.

A model whose blocks are compiled one by one (``torch.compile(block)``) and/or
wrapped by ``checkpoint_wrapper`` is saved under the plain model's names, for
the model, its optimizer and the Hugging Face export alike, and loads into
the model however it is wrapped. A renamed model resumes exactly, optimizer
included, with ``key_map``.
"""

from __future__ import annotations

import os

import pytest
import torch
from torch.distributed.algorithms._checkpoint.checkpoint_wrapper import checkpoint_wrapper

import shardckpt
from shardckpt import converters
from shardckpt.errors import StateMismatchError


class Block(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.w1 = torch.nn.Linear(4, 4)
        self.w2 = torch.nn.Linear(4, 4)

    def forward(self, x):
        return self.w2(torch.relu(self.w1(x)))


class Net(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.layers = torch.nn.ModuleList([Block() for _ in range(2)])
        self.head = torch.nn.Linear(4, 2)

    def forward(self, x):
        for layer in self.layers:
            x = layer(x)
        return self.head(x)


PLAIN = sorted(
    [f"layers.{i}.{w}.{p}" for i in range(2) for w in ("w1", "w2") for p in ("weight", "bias")] + ["head.weight", "head.bias"]
)


def _wrapped(how: str, seed: int) -> Net:
    torch.manual_seed(seed)
    m = Net()
    for i, layer in enumerate(m.layers):
        if "ac" in how:
            layer = checkpoint_wrapper(layer)
        if "compile" in how:
            layer = torch.compile(layer, backend="eager")  # eager backend: cheap on CPU
        m.layers[i] = layer
    if how == "whole":
        m = torch.compile(m, backend="eager")
    return m


def _step(m, opt, x):
    m(x).sum().backward()
    opt.step()
    opt.zero_grad()


@pytest.mark.parametrize("saved_as", ["ac+compile", "compile"])
def test_per_block_compile_and_ac_load_into_any_wrapping(tmp_path, saved_as):
    src = _wrapped(saved_as, 0)
    assert any("_orig_mod" in k for k in src.state_dict())  # the wrapper really is in torch's names
    opt = torch.optim.AdamW(src.parameters())
    _step(src, opt, torch.randn(2, 4))
    ck = str(tmp_path / "ck")
    shardckpt.save({"model": src, "optim": opt}, ck)
    names = sorted(shardckpt.inspect(ck).tensors)
    assert sorted(n[len("model."):] for n in names if n.startswith("model.")) == PLAIN
    assert all("_orig_mod" not in n and "_checkpoint_wrapped" not in n for n in names), names
    x = torch.randn(3, 4)
    for how in ("plain", "compile", "ac", "ac+compile", "whole"):
        dst = _wrapped(how, 1)
        o2 = torch.optim.AdamW(dst.parameters())
        res = shardckpt.load({"model": dst, "optim": o2}, ck)
        assert res.missing_keys == [] and res.unexpected_keys == [], (how, res)
        for a, b in zip(src.parameters(), dst.parameters()):
            assert torch.equal(a, b), how
        _step(dst, o2, x)
    _step(src, opt, x)
    for a, b in zip(src.parameters(), dst.parameters()):
        assert torch.equal(a, b)  # the optimizer state came back too
    converters.to_safetensors(ck, str(tmp_path / "hf"))
    from safetensors import safe_open

    hf = tmp_path / "hf"
    keys = sorted(k for f in os.listdir(hf) if f.endswith(".safetensors") for k in safe_open(str(hf / f), "pt").keys())
    assert keys == PLAIN


def test_own_submodule_named_module_keeps_its_name(tmp_path):
    m = torch.nn.Module()
    m.module = torch.nn.Linear(2, 2)
    shardckpt.save({"model": m}, str(tmp_path / "ck"))
    assert sorted(shardckpt.inspect(str(tmp_path / "ck")).tensors) == ["model.module.bias", "model.module.weight"]


class Old(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.enc = torch.nn.Linear(3, 3)
        self.head = torch.nn.Linear(3, 1)

    def forward(self, x):
        return self.head(self.enc(x))


class New(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.encoder = torch.nn.Linear(3, 3)
        self.head = torch.nn.Linear(3, 1)

    def forward(self, x):
        return self.head(self.encoder(x))


@pytest.mark.parametrize(
    "key_map",
    [
        lambda n: n.replace("model.enc.", "model.encoder."),  # names the model only
        lambda n: n.replace("enc.", "encoder."),  # names the optimizer's tensors too
        {"model.enc.weight": "model.encoder.weight", "model.enc.bias": "model.encoder.bias"},
    ],
    ids=["model-callable", "both-callable", "dict"],
)
def test_renamed_model_and_adamw_resume_exactly_with_key_map(tmp_path, key_map):
    torch.manual_seed(0)
    a = Old()
    oa = torch.optim.AdamW(a.parameters(), lr=0.01)
    for _ in range(2):
        _step(a, oa, torch.randn(2, 3))
    ck = str(tmp_path / "ck")
    shardckpt.save({"model": a, "optim": oa}, ck)
    b = New()
    ob = torch.optim.AdamW(b.parameters(), lr=0.5)
    with pytest.raises(StateMismatchError) as e:
        shardckpt.load({"model": b, "optim": ob}, ck)
    msg = str(e.value)
    missing = msg.split("missing from the checkpoint:")[1].split(";")[0]
    unexpected = msg.split("not in the state:")[1]
    assert not {x.strip(" .") for x in missing.split(",")} & {x.strip(" .") for x in unexpected.split(",")}, msg
    res = shardckpt.load({"model": b, "optim": ob}, ck, key_map=key_map)
    assert res.missing_keys == [] and res.unexpected_keys == []
    assert ob.param_groups[0]["lr"] == 0.01
    x = torch.randn(2, 3)
    _step(a, oa, x)
    _step(b, ob, x)
    assert torch.equal(a.enc.weight, b.encoder.weight) and torch.equal(a.head.bias, b.head.bias)


def test_keys_carry_the_optimizer_entries_of_the_selected_parameters(tmp_path):
    torch.manual_seed(0)
    a = Old()
    oa = torch.optim.AdamW(a.parameters())
    _step(a, oa, torch.randn(2, 3))
    ck = str(tmp_path / "ck")
    shardckpt.save({"model": a, "optim": oa}, ck)
    b = Old()
    ob = torch.optim.AdamW(b.parameters())
    _step(b, ob, torch.randn(2, 3))
    head_state = {k: v.clone() for k, v in ob.state[b.head.weight].items()}
    res = shardckpt.load({"model": b, "optim": ob}, ck, keys=["model.enc.*"], strict=False)
    assert res.missing_keys == ["model.head.bias", "model.head.weight", "optim.state.head.bias", "optim.state.head.weight"]
    assert torch.equal(a.enc.weight, b.enc.weight)
    assert torch.equal(oa.state[a.enc.weight]["exp_avg"], ob.state[b.enc.weight]["exp_avg"])  # followed the model
    assert all(torch.equal(ob.state[b.head.weight][k], v) for k, v in head_state.items())  # left as it was
