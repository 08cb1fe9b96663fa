"""Casting on load (issue 10 part 1): floating point casts, integers and bools never do.

Real files: Hugging Face safetensors directories written with
``safetensors.torch.save_file``, native checkpoints, shardckpt's own
``to_safetensors(dtype=...)`` export loaded back for fine-tuning.
"""

from __future__ import annotations

import pytest
import torch
from safetensors.torch import save_file

import shardckpt
from shardckpt import converters
from shardckpt.errors import StateMismatchError


class Net(torch.nn.Module):
    def __init__(self, dtype=torch.float32):
        super().__init__()
        self.lin = torch.nn.Linear(8, 6, dtype=dtype)
        self.emb = torch.nn.Embedding(10, 8, dtype=dtype)
        self.register_buffer("count", torch.zeros(3, dtype=torch.int64))


def _hf_dir(path, dtype=torch.bfloat16):
    torch.manual_seed(0)
    src = Net(dtype)
    src.count.copy_(torch.tensor([1, 2, 3]))
    sd = {k: v.detach().clone() for k, v in src.state_dict().items()}
    save_file(sd, str(path / "model.safetensors"))
    return sd


def test_bf16_hf_dir_loads_into_fp32_model_exactly(tmp_path):
    sd = _hf_dir(tmp_path)
    model = Net()
    lin = model.lin.weight
    assert shardckpt.load({"model": model}, str(tmp_path)) == ([], [])
    assert model.lin.weight is lin and lin.dtype == torch.float32  # in place, the live dtype kept
    for k, v in model.state_dict().items():
        want = sd[k].float() if sd[k].is_floating_point() else sd[k]
        assert v.dtype == (torch.float32 if sd[k].is_floating_point() else torch.int64), k
        assert torch.equal(v, want), k


@pytest.mark.parametrize("saved,live", [(torch.float32, torch.bfloat16), (torch.float16, torch.float64),
                                        (torch.float64, torch.float16), (torch.bfloat16, torch.float16)])
def test_native_checkpoint_casts_between_float_precisions(tmp_path, saved, live):
    torch.manual_seed(1)
    src = Net(saved)
    shardckpt.save({"model": src, "step": 3}, str(tmp_path / "ck"))
    dst = Net(live)
    state = {"model": dst, "step": 0}
    shardckpt.load(state, str(tmp_path / "ck"))
    assert state["step"] == 3
    for (k, a), b in zip(src.state_dict().items(), dst.state_dict().values()):
        assert b.dtype == (live if a.is_floating_point() else a.dtype), k
        assert torch.equal(b, a.to(b.dtype)), k  # the same rounding as tensor.to


def test_fp8_checkpoint_casts_where_torch_can(tmp_path):
    w = torch.randn(4, 4)
    save_file({"w": w.to(torch.float8_e4m3fn)}, str(tmp_path / "model.safetensors"))
    live = {"w": torch.zeros(4, 4)}
    shardckpt.load({"model": live}, str(tmp_path))
    assert torch.equal(live["w"], w.to(torch.float8_e4m3fn).float())
    # and the other way: fp32 into an fp8 live tensor
    shardckpt.save({"model": {"w": w}}, str(tmp_path / "ck"))
    live8 = {"w": torch.zeros(4, 4, dtype=torch.float8_e5m2)}
    shardckpt.load({"model": live8}, str(tmp_path / "ck"))
    assert torch.equal(live8["w"].float(), w.to(torch.float8_e5m2).float())


def test_integer_and_bool_never_cast_and_nothing_loaded(tmp_path):
    save_file({"ids": torch.arange(5), "mask": torch.ones(5, dtype=torch.bool), "w": torch.ones(2)},
              str(tmp_path / "model.safetensors"))
    live = {"ids": torch.zeros(5), "mask": torch.zeros(5, dtype=torch.uint8), "w": torch.zeros(2)}
    with pytest.raises(StateMismatchError) as e:
        shardckpt.load({"model": live}, str(tmp_path))
    msg = str(e.value)
    assert "model.ids: checkpoint dtype I64, live dtype F32" in msg
    assert "model.mask: checkpoint dtype BOOL, live dtype U8" in msg
    assert "never cast" in msg and "model.w" not in msg
    assert torch.equal(live["w"], torch.zeros(2))  # a refused load leaves everything as it was
    # float into int is refused as well
    save_file({"ids": torch.ones(5)}, str(tmp_path / "f.safetensors"))
    with pytest.raises(StateMismatchError, match=r"model\.ids: checkpoint dtype F32, live dtype I64"):
        shardckpt.load({"model": {"ids": torch.zeros(5, dtype=torch.int64)}}, str(tmp_path / "f.safetensors"))


def test_cast_false_demands_exact_dtypes(tmp_path):
    sd = _hf_dir(tmp_path)
    model = Net()
    before = {k: v.clone() for k, v in model.state_dict().items()}
    with pytest.raises(StateMismatchError) as e:
        shardckpt.load({"model": model}, str(tmp_path), cast=False)
    msg = str(e.value)
    assert "model.lin.weight: checkpoint dtype BF16, live dtype F32 (cast=False" in msg
    assert "cast=True" in msg and "model.count" not in msg
    for k, v in model.state_dict().items():
        assert torch.equal(v, before[k]), k
    exact = Net(torch.bfloat16)
    shardckpt.load({"model": exact}, str(tmp_path), cast=False)
    assert torch.equal(exact.lin.weight, sd["lin.weight"])


def test_bf16_export_loads_back_for_fine_tuning(tmp_path):
    torch.manual_seed(2)
    model = Net()
    opt = torch.optim.AdamW(model.parameters())
    shardckpt.save({"model": model, "optim": opt}, str(tmp_path / "ck"))
    converters.to_safetensors(str(tmp_path / "ck"), str(tmp_path / "hf"), dtype="bfloat16")
    fresh = Net()
    shardckpt.load({"model": fresh}, str(tmp_path / "hf"))
    for (k, a), b in zip(model.state_dict().items(), fresh.state_dict().values()):
        want = a.bfloat16().float() if a.is_floating_point() else a
        assert b.dtype == a.dtype and torch.equal(b, want), k
