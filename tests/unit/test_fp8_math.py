"""Block FP8 pieces (issue 46): the geometry in ints, the exact dequantize of any box, the quantizer, which weights quantize."""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest
import torch

import shardckpt
from shardckpt._format.hf import fp8_block_size, scale_shape
from shardckpt._fp8 import band_rows, block_amax, dequantize_into, quantize_into, scales_from_amax
from shardckpt.errors import CorruptCheckpointError, UnsupportedStateError

B = (128, 128)


def expand(scale, shape):
    return scale.repeat_interleave(B[0], 0)[: shape[0]].repeat_interleave(B[1], 1)[:, : shape[1]]


def test_geometry_in_ints():
    assert scale_shape([300, 128], B) == [3, 1] and scale_shape([1, 129], B) == [1, 2] and scale_shape([128, 256], B) == [1, 2]
    assert list(band_rows(100, 200, 128)) == [(0, 28, 0), (28, 156, 1), (156, 200, 2)]
    assert list(band_rows(256, 128, 128)) == [(0, 128, 2)]
    assert list(band_rows(5, 0, 128)) == []
    assert fp8_block_size(None, where="c") is None
    assert fp8_block_size({"quant_method": "fp8", "weight_block_size": [64, 32]}, where="c") == (64, 32)
    for bad in ({"quant_method": "fp8", "weight_block_size": [0, 128]}, {"quant_method": "fp8", "weight_block_size": [True, 1]},
                {"quant_method": "fp8", "weight_block_size": "128"}, {"quant_method": "awq"}):
        with pytest.raises(UnsupportedStateError):
            fp8_block_size(bad, where="c")
    with pytest.raises(CorruptCheckpointError):
        fp8_block_size(["fp8"], where="c")


def test_dequantize_every_code_into_every_float_dtype_and_any_box_exactly():
    torch.manual_seed(0)
    codes = torch.arange(256, dtype=torch.uint8).view(torch.float8_e4m3fn)  # subnormals, 448, both NaNs
    q = codes.repeat(300, 3)[:, :700].contiguous()
    scale = torch.rand(3, 6) * 2.0 ** torch.randint(-30, 30, (3, 6)).float()
    scale[1, 2] = 2.0**125  # the folded scale would overflow: the two-step path
    ref = q.float() * expand(scale, q.shape)
    for dt in (torch.float32, torch.bfloat16, torch.float16, torch.float64):
        out = torch.empty(q.shape, dtype=dt)
        dequantize_into(out, q, scale, row0=0, col0=0, block=B)
        want = ref.to(dt)
        assert torch.equal(out.isnan(), want.isnan()) and torch.equal(out.nan_to_num(), want.nan_to_num()), dt
    # boxes cut inside blocks, non-contiguous source and destination, scale rows from k0
    for r0, c0, n, m in [(100, 200, 50, 300), (127, 1, 3, 699), (130, 0, 170, 700), (0, 383, 300, 1)]:
        k0 = r0 // 128
        big = torch.empty(n, m + 5)
        out = big[:, 2 : 2 + m]
        dequantize_into(out, q[r0 : r0 + n, c0 : c0 + m], scale[k0:], row0=r0, col0=c0, block=B, scale_row0=k0)
        want = ref[r0 : r0 + n, c0 : c0 + m]
        assert torch.equal(out.nan_to_num(), want.nan_to_num()), (r0, c0, n, m)


def test_quantize_is_deepseeks_and_boxes_may_split_blocks():
    torch.manual_seed(1)
    x = torch.randn(300, 700) * 3
    x[:128, :128] = 0  # an all-zero block: scale 1, codes 0
    amax = torch.zeros(3, 6)
    for a, b in [(0, 77), (77, 128), (128, 300)]:  # rows arriving in pieces that split blocks
        block_amax(amax, x[a:b], row0=a, col0=0, block=B)
    block_amax(amax, x[5:6, 650:], row0=5, col0=650, block=B)  # repeats change nothing
    scale = scales_from_amax(amax)
    pad = torch.zeros(384, 768)
    pad[:300, :700] = x
    ref_amax = pad.view(3, 128, 6, 128).abs().amax(dim=(1, 3))
    assert torch.equal(amax, ref_amax) and scale[0, 0] == 1.0
    assert torch.equal(scale[1:], ref_amax[1:] / 448.0)
    out = torch.empty(300, 700, dtype=torch.float8_e4m3fn)
    quantize_into(out[:150], x[:150], scale, row0=0, col0=0, block=B)
    quantize_into(out[150:], x[150:], scale, row0=150, col0=0, block=B)
    ref = (x / expand(scale, x.shape)).clamp(-448, 448).to(torch.float8_e4m3fn)
    assert torch.equal(out.view(torch.uint8), ref.view(torch.uint8))
    assert not out[:128, :128].float().any()


def test_which_weights_quantize_and_the_config_merge():
    from shardckpt.converters._quantize import fp8_config, quantized

    yes = ["model.layers.0.mlp.down_proj.weight", "model.layers.3.self_attn.q_a_proj.weight", "x.mlp.gate_proj.weight"]
    no = ["lm_head.weight", "model.embed_tokens.weight", "model.layers.0.input_layernorm.weight", "model.layers.1.mlp.gate.weight",
          "model.layers.0.self_attn.o_proj.bias"]
    assert all(quantized(n, "BF16", [256, 256]) for n in yes)
    assert not any(quantized(n, "BF16", [256, 256]) for n in no)
    assert not quantized(yes[0], "BF16", [256]) and not quantized(yes[0], "I64", [2, 2]) and not quantized(yes[0], "F32", [4, 4, 4])
    assert not quantized(yes[0], "F32", [256, 256], ["model.layers.0.mlp"]) and quantized(yes[1], "F32", [256, 256], ["layers.0.mlp"])
    src = json.dumps({"model_type": "x", "quantization_config": {"quant_method": "fp8", "modules_to_not_convert": ["a"],
                                                                  "activation_scheme": "static"}}).encode()
    cfg = json.loads(fp8_config(src, ["b"], where="w"))
    assert cfg["model_type"] == "x" and cfg["quantization_config"] == {
        "quant_method": "fp8", "fmt": "e4m3", "activation_scheme": "static", "weight_block_size": [128, 128],
        "modules_to_not_convert": ["a", "b"]}
    other = json.loads(fp8_config(json.dumps({"quantization_config": {"quant_method": "awq", "bits": 4}}).encode(), [], where="w"))
    assert other["quantization_config"]["quant_method"] == "fp8" and "bits" not in other["quantization_config"]
    with pytest.raises(CorruptCheckpointError, match="not valid JSON"):
        fp8_config(b"{", [], where="w")


def test_cli_export_quantize(tmp_path):
    ck, out, cfg = str(tmp_path / "ck"), str(tmp_path / "hf"), str(tmp_path / "cfg")
    torch.manual_seed(0)
    w = torch.randn(200, 130)
    shardckpt.save({"model": {"model.layers.0.mlp.up_proj.weight": w, "model.norm.weight": torch.ones(130)}}, ck, no_dist=True)
    os.makedirs(cfg)
    with open(os.path.join(cfg, "config.json"), "w") as f:
        json.dump({"model_type": "llama"}, f)
    run = [sys.executable, "-m", "shardckpt", "export", ck, out, "--quantize", "fp8-block", "--copy-from", cfg, "-q"]
    assert subprocess.run(run, capture_output=True, text=True).returncode == 0
    assert json.load(open(os.path.join(out, "config.json")))["quantization_config"]["weight_block_size"] == [128, 128]
    got = shardckpt.read(out)
    assert (got["model.layers.0.mlp.up_proj.weight"] - w).abs().max() <= w.abs().max() / 16
    bad = subprocess.run(run[:5] + [str(tmp_path / "x.safetensors"), "--quantize", "fp8-block"], capture_output=True, text=True)
    assert bad.returncode == 2 and "--quantize writes a Hugging Face directory" in bad.stderr
