"""bitsandbytes 4-bit weights (``Params4bit``): saved and loaded exactly, quantization state included.

``Linear4bit.state_dict()`` writes each weight's ``QuantState`` as new
tensors beside it; the load fills them and installs them back as the
parameter's ``quant_state`` (before this, the save succeeded and every load
was refused: a checkpoint that could not be loaded).
"""

from __future__ import annotations

import warnings

import pytest
import torch

import shardckpt
from shardckpt.errors import UnsupportedStateError

with warnings.catch_warnings():
    warnings.simplefilter("ignore")
    bnb = pytest.importorskip("bitsandbytes", reason="bitsandbytes is in the test extra")


def _model(seed: int, quant_type: str, quantize: bool = True) -> torch.nn.Module:
    torch.manual_seed(seed)
    layers = []
    for _ in range(2):
        lin = bnb.nn.Linear4bit(128, 128, bias=True, quant_type=quant_type, compute_dtype=torch.float32)
        lin.weight = bnb.nn.Params4bit(torch.randn(128, 128), requires_grad=False, quant_type=quant_type)
        layers.append(lin)
    m = torch.nn.Sequential(*layers)
    return m.to("cpu") if quantize else m


def _qs(p):
    q = p.quant_state
    out = {"absmax": q.absmax, "code": q.code, "shape": q.shape, "blocksize": q.blocksize, "dtype": q.dtype, "quant_type": q.quant_type}
    if q.nested:
        out.update(offset=q.offset, state2_absmax=q.state2.absmax, state2_code=q.state2.code, state2_blocksize=q.state2.blocksize)
    return out


@pytest.mark.parametrize("quant_type", ["nf4", "fp4"])
def test_params4bit_round_trip_exact(tmp_path, quant_type):
    a = _model(0, quant_type)
    shardckpt.save({"model": a}, str(tmp_path / "ck"))
    b = _model(1, quant_type)
    res = shardckpt.load({"model": b}, str(tmp_path / "ck"))
    assert res.missing_keys == [] and res.unexpected_keys == []
    x = torch.randn(3, 128)
    assert torch.equal(a(x), b(x))
    for pa, pb in zip(a.parameters(), b.parameters()):
        assert type(pa) is type(pb) and torch.equal(pa.data, pb.data)
        if hasattr(pa, "quant_state"):
            qa, qb = _qs(pa), _qs(pb)
            assert qa.keys() == qb.keys()
            for k in qa:
                assert (torch.equal(qa[k], qb[k]) if isinstance(qa[k], torch.Tensor) else qa[k] == qb[k]), k


def test_params4bit_not_yet_quantized_is_refused_before_anything_changes(tmp_path):
    a = _model(0, "nf4")
    shardckpt.save({"model": a}, str(tmp_path / "ck"))
    b = _model(1, "nf4", quantize=False)  # .to(device) quantizes; not done yet
    before = {k: v.clone() for k, v in b.state_dict().items()}
    with pytest.raises((UnsupportedStateError, shardckpt.StateMismatchError)) as e:
        shardckpt.load({"model": b}, str(tmp_path / "ck"))
    assert "0.weight" in str(e.value)
    after = b.state_dict()
    assert before.keys() == after.keys() and all(torch.equal(before[k], after[k]) for k in before)
