"""Block FP8 pieces (issue 46): the geometry in ints, the exact dequantize of any box, the quantizer, which weights quantize."""

from __future__ import annotations

import json
import os
import random
import subprocess
import sys
import threading

import pytest
import torch

import shardckpt
from shardckpt import _fp8
from shardckpt._format.hf import fp8_block_size, scale_shape
from shardckpt._fp8 import band_rows, block_amax, box_sink, dequantize_into, dequantize_native, quantize_into, scales_from_amax
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


def _codes_and_scales(rows=300, cols=700, seed=0):
    g = torch.Generator().manual_seed(seed)
    codes = torch.arange(256, dtype=torch.uint8).repeat(rows, -(-cols // 256) + 1)[:, :cols]  # every code, NaNs too
    codes = codes[:, torch.randperm(cols, generator=g)].contiguous()
    scale = torch.rand(-(-rows // 128), -(-cols // 128), generator=g) * 2.0 ** torch.randint(-30, 7, (-(-rows // 128), -(-cols // 128)), generator=g).float()
    return codes.view(torch.float8_e4m3fn), scale


def _same(got, want, what=""):
    assert got.dtype == want.dtype and torch.equal(got.isnan(), want.isnan()), what
    assert torch.equal(got.nan_to_num().reshape(-1).view(torch.uint8), want.nan_to_num().reshape(-1).view(torch.uint8)), what


@pytest.mark.parametrize("scratch", [1 << 17, 4096, 300])  # whole bands / pieces of bands / pieces of column blocks
def test_host_kernels_in_every_step_shape_equal_the_reference(monkeypatch, scratch):
    monkeypatch.setattr(_fp8, "SCRATCH_ELEMS", scratch)
    q, scale = _codes_and_scales()
    scale[2, 1] = 2.0**9  # folding the 2^120 bias in would overflow: the two-step multiply
    ref = q.float() * expand(scale, q.shape)
    for dt in (torch.float32, torch.bfloat16):
        out = torch.empty(q.shape, dtype=dt)
        dequantize_into(out, q, scale, row0=0, col0=0, block=B)
        _same(out, ref.to(dt), (scratch, dt))
    clean = q.view(torch.uint8).clone()
    clean[(clean & 0x7F) == 0x7F] = 0  # no NaN code: the kernels alone, no mask
    q2 = clean.view(torch.float8_e4m3fn)
    out = torch.empty(q.shape[1], q.shape[0], dtype=torch.bfloat16).t()  # a transposed destination
    dequantize_into(out, q2, scale, row0=0, col0=0, block=B)
    _same(out, (q2.float() * expand(scale, q.shape)).to(torch.bfloat16), scratch)


def test_cuda_path_math_equals_the_reference_on_cpu_tensors():
    # dequantize_native is what the load runs on the device (the FP8 bytes
    # copied there); the same function on CPU tensors, every dtype and box.
    q, scale = _codes_and_scales(seed=3)
    ref = q.float() * expand(scale, q.shape)
    for dt in (torch.float32, torch.bfloat16, torch.float16):
        out = torch.empty(q.shape, dtype=dt)
        dequantize_native(out, q, scale, row0=0, col0=0, block=B)
        _same(out, ref.to(dt), dt)
    for r0, c0, n, m in [(100, 200, 50, 300), (127, 1, 3, 699), (130, 0, 170, 700), (0, 383, 300, 1)]:
        k0 = r0 // 128
        out = torch.empty(n, m + 3, dtype=torch.bfloat16)[:, 1 : 1 + m]
        dequantize_native(out, q[r0 : r0 + n, c0 : c0 + m], scale[k0:], row0=r0, col0=c0, block=B, scale_row0=k0)
        _same(out, ref[r0 : r0 + n, c0 : c0 + m].to(torch.bfloat16), (r0, c0, n, m))


def test_box_sink_takes_pieces_cut_anywhere_in_any_order_and_threads():
    # A saved chunk (300 x 700 codes) from global (128, 256); boxes of it as
    # the load asks: whole rows, and a column range (a TP-style shard); the
    # bytes arrive in pieces cut inside rows, out of order, from threads.
    q, scale = _codes_and_scales(seed=5)
    chunk = q.view(torch.uint8).numpy().tobytes()
    full_scale = torch.cat([torch.full((1, 8), 7.0), torch.cat([torch.full((3, 2), 7.0), scale], 1)])  # global grid
    ref = q.float() * expand(scale, q.shape)
    rng = random.Random(0)
    for r_s, n, c_s, m in [(0, 300, 0, 700), (37, 150, 0, 700), (5, 200, 131, 333), (299, 1, 699, 1)]:
        first, last = r_s * 700 + c_s, (r_s + n - 1) * 700 + c_s + m  # the want's elements
        data = memoryview(chunk)[first:last]
        dst = torch.full((n, m), -1.0, dtype=torch.bfloat16)
        k0 = (128 + r_s) // 128
        put = box_sink(dst, width=700, first=first, origin=(128 + r_s, 256 + c_s), block=B,
                       scales=lambda k0=k0: (full_scale[k0:], k0))
        cuts = sorted({0, len(data), *(rng.randrange(len(data)) for _ in range(9))})
        pieces = list(zip(cuts, cuts[1:]))
        rng.shuffle(pieces)
        threads = [threading.Thread(target=put, args=(a, data[a:b])) for a, b in pieces]
        for t in threads:
            t.start()
        for t in threads:
            t.join()
        _same(dst, ref[r_s : r_s + n, c_s : c_s + m].to(torch.bfloat16), (r_s, n, c_s, m))


def test_host_path_serial_in_its_thread_and_flush_denormal_falls_back():
    seen = {}

    def probe():
        before = torch.get_num_threads()
        with _fp8._serial():
            seen["inside"] = torch.get_num_threads()
        seen["after"] = (before, torch.get_num_threads())

    t = threading.Thread(target=probe)
    t.start()
    t.join()
    assert seen["after"][0] == seen["after"][1]  # restored: no thread keeps a changed count
    if seen["after"][0] > 1 and _fp8._omp_threads():
        assert seen["inside"] == 1
    main = torch.get_num_threads()
    q, scale = _codes_and_scales(rows=130, cols=140, seed=7)
    if not torch.set_flush_denormal(True):
        pytest.skip("no flush-to-zero on this CPU")
    try:
        ref = (q.float() * expand(scale, q.shape)).to(torch.bfloat16)  # the reference under the same mode
        out = torch.empty(q.shape, dtype=torch.bfloat16)
        dequantize_into(out, q, scale, row0=0, col0=0, block=B)
    finally:
        torch.set_flush_denormal(False)
    _same(out, ref)
    assert torch.get_num_threads() == main


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
