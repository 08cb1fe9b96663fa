"""Saving the part that trains: ``trainable(model)`` / ``select(model, names)`` with the optimizer of those parameters.

A ~210 MB frozen base with real peft LoRA adapters: the base is loaded once
from its own checkpoint, the adapter + AdamW checkpoint holds only the
adapters (< 1.05x their bytes plus the optimizer's), and a resume from it
gives the uninterrupted run's next losses exactly.
"""

from __future__ import annotations

import os

import pytest
import torch

import shardckpt
from shardckpt.errors import StateMismatchError, UnsupportedStateError

peft = pytest.importorskip("peft", reason="peft is in the test extra")

DIM, LAYERS, RANK = 2560, 8, 64  # 8 x 2560 x 2560 fp32 = 210 MB of base


def _base(seed: int = 0) -> torch.nn.Module:
    torch.manual_seed(seed)
    layers = []
    for _ in range(LAYERS):
        layers += [torch.nn.Linear(DIM, DIM, bias=False), torch.nn.Tanh()]
    return torch.nn.Sequential(*layers)


def _lora(base: torch.nn.Module, seed: int):
    torch.manual_seed(seed)
    cfg = peft.LoraConfig(r=RANK, lora_alpha=RANK, target_modules=[str(2 * i) for i in range(LAYERS)], init_lora_weights=False)
    model = peft.get_peft_model(base, cfg)
    opt = torch.optim.AdamW([p for p in model.parameters() if p.requires_grad], lr=1e-3)
    return model, opt


def _train(model, opt, start: int, steps: int):
    losses = []
    for s in range(start, start + steps):
        g = torch.Generator().manual_seed(s)
        x = torch.randn(4, DIM, generator=g)
        loss = model(x).pow(2).mean()
        opt.zero_grad()
        loss.backward()
        opt.step()
        losses.append(loss.item())
    return losses


def _bytes(root) -> int:
    return sum(os.path.getsize(os.path.join(d, f)) for d, _, fs in os.walk(root) for f in fs)


@pytest.mark.slow
def test_adapter_only_checkpoint_is_small_and_resumes_exactly(tmp_path):
    base_ck, ad_ck = str(tmp_path / "base"), str(tmp_path / "adapter")
    shardckpt.save({"model": _base()}, base_ck)  # the frozen base, written once (an HF directory works the same)
    model, opt = _lora(_base(), seed=1)
    _train(model, opt, 0, 2)
    shardckpt.save({"model": shardckpt.trainable(model), "optim": opt, "step": 2}, ad_ck)
    adapters = {n: p.detach().clone() for n, p in model.named_parameters() if p.requires_grad}
    losses = _train(model, opt, 2, 2)

    # Only the adapters and their optimizer state were written.
    m = shardckpt.inspect(ad_ck)
    assert {n[len("model."):] for n in m.tensors if n.startswith("model.")} == set(adapters)
    trained = sum(t.numel() * t.element_size() for t in adapters.values())
    optim_bytes = sum(v.numel() * v.element_size() for st in opt.state.values() for v in st.values())
    assert trained > 10_000_000 and _bytes(ad_ck) < 1.05 * (trained + optim_bytes), (_bytes(ad_ck), trained, optim_bytes)
    print(f"adapter checkpoint {_bytes(ad_ck)} B = {_bytes(ad_ck) / (trained + optim_bytes):.4f}x adapters {trained} B + optimizer {optim_bytes} B; base {_bytes(base_ck)} B")
    assert _bytes(base_ck) > 200_000_000

    # A fresh process's way: the base from its own checkpoint, then the adapter step.
    base = _base(seed=5)
    shardckpt.load({"model": base}, base_ck)
    model2, opt2 = _lora(base, seed=9)
    state = {"model": shardckpt.trainable(model2), "optim": opt2, "step": 0}
    res = shardckpt.load(state, ad_ck)
    assert state["step"] == 2 and res.missing_keys == [] and res.unexpected_keys == [], res
    for n, p in model2.named_parameters():
        if p.requires_grad:
            assert torch.equal(p, adapters[n]), n
    assert _train(model2, opt2, 2, 2) == losses


def test_select_by_name_and_refusals(tmp_path):
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(4, 4), torch.nn.Linear(4, 2))
    model[0].requires_grad_(False)
    opt = torch.optim.SGD([p for p in model.parameters() if p.requires_grad], lr=0.1, momentum=0.9)
    model(torch.ones(1, 4)).sum().backward()
    opt.step()
    shardckpt.save({"model": shardckpt.select(model, ["1.*"]), "optim": opt}, str(tmp_path / "a"))
    assert sorted(n for n in shardckpt.inspect(str(tmp_path / "a")).tensors if n.startswith("model.")) == ["model.1.bias", "model.1.weight"]
    # trainable() names the same entries
    shardckpt.save({"model": shardckpt.trainable(model), "optim": opt}, str(tmp_path / "b"))
    assert sorted(shardckpt.inspect(str(tmp_path / "b")).tensors) == sorted(shardckpt.inspect(str(tmp_path / "a")).tensors)
    # into another model: only the selection changes, the frozen layer stays its own
    torch.manual_seed(3)
    other = torch.nn.Sequential(torch.nn.Linear(4, 4), torch.nn.Linear(4, 2))
    frozen = other[0].weight.detach().clone()
    opt2 = torch.optim.SGD(other[1].parameters(), lr=0.1, momentum=0.9)
    shardckpt.load({"model": shardckpt.select(other, lambda n: n.startswith("1.")), "optim": opt2}, str(tmp_path / "a"))
    assert torch.equal(other[0].weight, frozen) and torch.equal(other[1].weight, model[1].weight)
    assert torch.equal(opt2.state[other[1].weight]["momentum_buffer"], opt.state[model[1].weight]["momentum_buffer"])
    # an empty selection is refused, before any byte
    with pytest.raises(StateMismatchError, match=r"select\(\) pattern\(s\) match no tensor: nope\*"):
        shardckpt.save({"model": shardckpt.select(model, ["nope*"])}, str(tmp_path / "c"))
    with pytest.raises(UnsupportedStateError, match="keeps none"):
        shardckpt.save({"model": shardckpt.select(model, lambda n: False)}, str(tmp_path / "c"))
    assert not (tmp_path / "c").exists()


class _Adapted(torch.nn.Module):
    """A frozen base with LoRA-named adapters beside it."""

    def __init__(self, seed: int):
        super().__init__()
        torch.manual_seed(seed)
        self.base = torch.nn.Linear(4, 4)
        self.lora_A = torch.nn.Linear(4, 2, bias=False)
        self.lora_B = torch.nn.Linear(2, 4, bias=False)
        self.base.requires_grad_(False)

    def forward(self, x):
        return self.base(x) + self.lora_B(self.lora_A(x))


def test_select_takes_one_string_as_one_pattern_and_refuses_a_pattern_matching_nothing(tmp_path):
    model = _Adapted(0)
    ck = str(tmp_path / "a")
    # One string is one pattern, as for keys=: not its characters ("*" alone would keep the base).
    shardckpt.save({"model": shardckpt.select(model, "*lora_*")}, ck)
    assert sorted(shardckpt.inspect(ck).tensors) == ["model.lora_A.weight", "model.lora_B.weight"]
    other = _Adapted(1)
    base = other.base.weight.detach().clone()
    shardckpt.load({"model": shardckpt.select(other, "*lora_*")}, ck)
    assert torch.equal(other.base.weight, base) and torch.equal(other.lora_B.weight, model.lora_B.weight)

    # A typo among the patterns is refused on save (nothing written) and on load (nothing changed).
    with pytest.raises(StateMismatchError, match=r"lroa_B") as e:
        shardckpt.save({"model": shardckpt.select(model, ["*lora_A*", "*lroa_B*"])}, str(tmp_path / "b"))
    assert "lora_A*" not in str(e.value).split("match no tensor")[1].split(";")[0], e.value
    assert not (tmp_path / "b").exists()
    fresh = _Adapted(2)
    before = {k: v.clone() for k, v in fresh.state_dict().items()}
    with pytest.raises(StateMismatchError, match=r"lroa_B"):
        shardckpt.load({"model": shardckpt.select(fresh, ["*lora_A*", "*lroa_B*"])}, ck)
    with pytest.raises(StateMismatchError, match=r"lroa_B"):
        shardckpt.load({"model": shardckpt.select(fresh, "*lroa_B*")}, ck)
    assert all(torch.equal(v, before[k]) for k, v in fresh.state_dict().items())


def test_a_dict_of_the_trainable_parameters_beside_their_optimizer_is_refused_naming_trainable(tmp_path):
    model = _Adapted(0)
    opt = torch.optim.AdamW([p for p in model.parameters() if p.requires_grad], lr=1e-3)
    state = {"adapters": {n: p for n, p in model.named_parameters() if p.requires_grad}, "optim": opt}
    with pytest.raises(UnsupportedStateError) as e:
        shardckpt.save(state, str(tmp_path / "a"))
    msg = str(e.value)
    # The advice saves only the adapters (the model beside it would save the whole frozen base).
    assert "shardckpt.trainable(model)" in msg and "adapters.lora_A.weight" in msg and "Put the model next to it" not in msg, msg
    assert not (tmp_path / "a").exists()
    shardckpt.save({"adapters": shardckpt.trainable(model), "optim": opt}, str(tmp_path / "a"))
    assert sorted(n for n in shardckpt.inspect(str(tmp_path / "a")).tensors if n.startswith("adapters.")) == [
        "adapters.lora_A.weight", "adapters.lora_B.weight"]
