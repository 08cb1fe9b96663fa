"""A load into a module whose state_dict() returns copies (a hook splitting a fused weight, a wrapper
re-creating tensors) must end with the right weights, or refuse before anything changes."""

from __future__ import annotations

import pytest
import torch

import shardckpt
from shardckpt.errors import UnsupportedStateError


class FusedAttention(torch.nn.Module):
    """One fused qkv weight, saved as separate q, k, v tensors (as conversion hooks do)."""

    def __init__(self, seed: int, *, inverse_hook: bool = True):
        super().__init__()
        torch.manual_seed(seed)
        self.qkv = torch.nn.Linear(4, 12, bias=False)
        self.out = torch.nn.Linear(4, 4)
        self.register_state_dict_post_hook(_split)
        if inverse_hook:
            self.register_load_state_dict_pre_hook(_fuse)


def _split(module, sd, prefix, local_metadata):
    w = sd.pop(prefix + "qkv.weight")
    for name, part in zip("qkv", w.detach().split(4, dim=0)):
        sd[prefix + name] = part.clone()  # new tensors: filling them in place does not reach qkv


def _fuse(module, sd, prefix, *args):
    sd[prefix + "qkv.weight"] = torch.cat([sd.pop(prefix + n) for n in "qkv"], dim=0)


def _weights(m: torch.nn.Module):
    return {n: p.detach().clone() for n, p in m.named_parameters()}


def test_split_fused_weight_loads_into_the_weights(tmp_path):
    src = FusedAttention(1)
    url = str(tmp_path / "ckpt")
    shardckpt.save({"model": src, "step": 4}, url)
    assert {"model.q", "model.k", "model.v"} <= set(shardckpt.inspect(url).tensors)

    dst = FusedAttention(2)
    before = _weights(dst)
    state = {"model": dst, "step": 0}
    shardckpt.load(state, url)
    want, got = _weights(src), _weights(dst)
    assert not torch.equal(before["qkv.weight"], want["qkv.weight"])
    for n in want:
        assert torch.equal(got[n], want[n]), n
    assert state["step"] == 4


def test_copies_without_a_way_back_are_refused_before_loading(tmp_path):
    url = str(tmp_path / "ckpt")
    shardckpt.save({"model": FusedAttention(1)}, url)
    dst = FusedAttention(2, inverse_hook=False)
    before = _weights(dst)
    with pytest.raises(UnsupportedStateError) as ei:
        shardckpt.load({"model": dst}, url, strict=False)
    msg = str(ei.value)
    assert "model.q" in msg and "copies" in msg and "register_load_state_dict_pre_hook" in msg, msg
    for n, v in _weights(dst).items():
        assert torch.equal(v, before[n]), n


class ModelWrapper:
    """Like torchtitan's ModelWrapper: a Stateful whose state_dict() re-creates the tensors."""

    def __init__(self, model: torch.nn.Module):
        self.model = model

    def state_dict(self):
        return {k: v.detach().clone() for k, v in self.model.state_dict().items()}

    def load_state_dict(self, sd):
        self.model.load_state_dict(sd)


class Cloning(torch.nn.Module):
    """A module whose state_dict() returns copies under its own names (no hook needed to load them back)."""

    def __init__(self, seed: int):
        super().__init__()
        torch.manual_seed(seed)
        self.lin = torch.nn.Linear(3, 5)
        self.register_buffer("scale", torch.randn(5))
        self.register_state_dict_post_hook(lambda m, sd, prefix, meta: sd.update({k: v.detach().clone() for k, v in sd.items()}))


@pytest.mark.parametrize("kind", ["wrapper", "cloning_module"])
def test_recreated_tensors_load_into_the_weights(tmp_path, kind):
    make = (lambda s: ModelWrapper(torch.nn.Sequential(torch.nn.Linear(3, 5)))) if kind == "wrapper" else Cloning
    torch.manual_seed(1)
    src = make(1)
    url = str(tmp_path / kind)
    shardckpt.save({"model": src}, url)
    torch.manual_seed(2)
    dst = make(2)
    shardckpt.load({"model": dst}, url)
    a = src.model if kind == "wrapper" else src
    b = dst.model if kind == "wrapper" else dst
    for (n, x), (_, y) in zip(a.state_dict().items(), b.state_dict().items()):
        assert torch.equal(x, y), n
