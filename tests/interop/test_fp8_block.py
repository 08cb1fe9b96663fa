"""Block-FP8 Hugging Face weights (DeepSeek-V3's layout), issue 46: dequantized on load, written by the export.

The model is transformers' own ``DeepseekV3ForCausalLM`` from a tiny config
built here (MLA attention, a dense layer, a MoE layer; nothing downloaded),
its dims over 128 and not multiples of it, so that blocks are cut at the
edges and FSDP2's shards (2 and 4 ranks) split blocks. transformers v5 fuses
the MoE experts into 3-D parameters (``experts.gate_up_proj``): those stay
unquantized here (block FP8 is per 2-D Linear weight; the Hub's per-expert
2-D tensors are fused by transformers' own loader), every 2-D Linear weight
of the attention, the dense MLP and the shared experts is FP8.

The FP8 checkpoint is made by :func:`reference_quantize`, a direct
implementation of DeepSeek's quantizer written independently of
``shardckpt._fp8`` (padded 4-D blocks, amax / 448).
"""

from __future__ import annotations

import json
import os

import pytest
import torch
from _dist import run_ranks
from safetensors import safe_open
from safetensors.torch import save_file

import shardckpt
from shardckpt import converters
from shardckpt.errors import CorruptCheckpointError, StateMismatchError, UnsupportedStateError

BLOCK = 128
QC = {"quant_method": "fp8", "fmt": "e4m3", "activation_scheme": "dynamic", "weight_block_size": [BLOCK, BLOCK]}
IDS = torch.tensor([[5, 17, 99, 3, 250, 7, 64, 8], [1, 2, 3, 4, 5, 6, 7, 300]])


def tiny_config(**quant):
    from transformers import DeepseekV3Config

    cfg = DeepseekV3Config(
        vocab_size=320, hidden_size=160, intermediate_size=320, moe_intermediate_size=96, num_hidden_layers=2,
        num_attention_heads=2, num_key_value_heads=2, n_routed_experts=4, num_experts_per_tok=2, n_shared_experts=1,
        first_k_dense_replace=1, kv_lora_rank=64, q_lora_rank=136, qk_rope_head_dim=16, qk_nope_head_dim=32, v_head_dim=32,
        n_group=1, topk_group=1, max_position_embeddings=64, tie_word_embeddings=False, **quant,
    )
    return cfg


def make_model(seed: int):
    from transformers import AutoModelForCausalLM

    torch.manual_seed(seed)
    model = AutoModelForCausalLM.from_config(tiny_config())
    model.eval()
    return model


def linear_weight(name: str, t: torch.Tensor) -> bool:
    """What DeepSeek's FP8 checkpoints quantize: 2-D Linear weights (not embeddings, norms, the head, the router)."""
    parts = name.split(".")
    return (t.dim() == 2 and name.endswith(".weight") and "embed" not in name and "norm" not in name
            and not name.startswith("lm_head") and parts[-2] != "gate")


def reference_quantize(w: torch.Tensor):
    """DeepSeek's block quantizer, directly: pad to whole blocks, amax per block / 448, codes = w / scale."""
    r, c = w.shape
    nr, nc = -(-r // BLOCK), -(-c // BLOCK)
    padded = torch.zeros(nr * BLOCK, nc * BLOCK)
    padded[:r, :c] = w.float()
    blocks = padded.view(nr, BLOCK, nc, BLOCK)
    amax = blocks.abs().amax(dim=(1, 3))
    scale = torch.where(amax > 0, amax / 448.0, torch.ones_like(amax))
    q = (blocks / scale[:, None, :, None]).clamp(-448, 448).view(nr * BLOCK, nc * BLOCK)[:r, :c]
    return q.to(torch.float8_e4m3fn).contiguous(), scale


def block_scale(scale: torch.Tensor, shape) -> torch.Tensor:
    return scale.repeat_interleave(BLOCK, 0)[: shape[0]].repeat_interleave(BLOCK, 1)[:, : shape[1]]


def write_fp8_checkpoint(src_state: dict, d: str, *, config: dict | None = None, split: bool = True) -> dict:
    """The FP8 directory (two files + index, config.json) of ``src_state``; returns the exact dequantized state."""
    os.makedirs(d, exist_ok=True)
    tensors, want = {}, {}
    for k, v in src_state.items():
        if linear_weight(k, v):
            q, s = reference_quantize(v)
            tensors[k], tensors[k + "_scale_inv"] = q, s
            want[k] = q.float() * block_scale(s, q.shape)
        else:
            tensors[k] = v.to(torch.bfloat16).contiguous()
            want[k] = tensors[k].float()
    names = sorted(tensors)
    files = {"model-00001-of-00002.safetensors": names[::2], "model-00002-of-00002.safetensors": names[1::2]} if split else {
        "model.safetensors": names}
    for rel, ks in files.items():
        save_file({k: tensors[k] for k in ks}, os.path.join(d, rel))
    if split:
        index = {"metadata": {}, "weight_map": {k: rel for rel, ks in files.items() for k in ks}}
        with open(os.path.join(d, "model.safetensors.index.json"), "w") as f:
            json.dump(index, f)
    if config is not None:
        with open(os.path.join(d, "config.json"), "w") as f:
            json.dump(config, f)
    return want


def full_state(model) -> dict:
    out = {}
    for k, v in model.state_dict().items():
        if hasattr(v, "full_tensor"):
            v = v.full_tensor()
        out[k] = v.detach().cpu().clone()
    return out


def assert_bits_equal(a, b, what=""):
    assert a.dtype == b.dtype and a.shape == b.shape, what
    assert torch.equal(a.reshape(-1).view(torch.uint8), b.reshape(-1).view(torch.uint8)), what


def train_step(model):
    """Loss before and after one SGD step on a fixed batch."""
    opt = torch.optim.SGD(model.parameters(), lr=0.5)
    model.train()
    loss = model(input_ids=IDS, labels=IDS).loss
    loss.backward()
    opt.step()
    with torch.no_grad():
        after = model(input_ids=IDS, labels=IDS).loss
    return float(loss.detach()), float(after)


@pytest.fixture(scope="module")
def fp8_dir(tmp_path_factory):
    d = str(tmp_path_factory.mktemp("fp8") / "hf")
    src = make_model(seed=1)
    config = {**tiny_config().to_dict(), "quantization_config": QC}
    want = write_fp8_checkpoint(full_state(src), d, config=config)
    return d, want


def _load_fsdp2(rank, world, d):
    from torch.distributed.fsdp import fully_shard
    from torch.distributed.tensor import DTensor

    model = make_model(seed=2)
    for layer in model.model.layers:
        fully_shard(layer)
    fully_shard(model)
    mesh, placements = model.model.norm.weight.device_mesh, model.model.norm.weight.placements
    res = shardckpt.load({"model": model}, d)  # strict: every scale tensor consumed
    state = full_state(model)
    local_rows = {n: tuple(p.to_local().shape) for n, p in model.named_parameters()}
    losses = train_step(model)
    # resize=True never swaps a DTensor: the shape must match.
    bad = DTensor.from_local(torch.zeros(1, 160), mesh, placements)
    try:
        shardckpt.load({"model.layers.0.mlp.down_proj.weight": bad}, d, resize=True, strict=False)
        refused = None
    except StateMismatchError as e:
        refused = str(e)
    return res, state, local_rows, losses, refused


@pytest.fixture(scope="module")
def one_process(fp8_dir):
    """The one-process reference: the FP8 directory loaded into the model unsharded, then one training step."""
    d, want = fp8_dir
    ref = make_model(seed=2)
    res = shardckpt.load({"model": ref}, d)
    return res, full_state(ref), train_step(ref)


def test_fp8_dir_into_one_process_exact(fp8_dir, one_process):
    _, want = fp8_dir
    res, got, _ = one_process
    assert res == ([], [])  # strict: every scale tensor consumed, none "unexpected"
    for k, v in want.items():
        assert_bits_equal(got[k], v, k)  # fp8.float() * block_scale, exactly


def test_fp8_pieces_dequantized_by_the_reader_threads_cut_inside_rows(fp8_dir, monkeypatch):
    # The one pass: each read piece is dequantized by the reader thread that
    # read it, out of the file's mapping; pieces of 1000 bytes end inside rows
    # (160 and 320 codes) and inside blocks, three threads at once.
    from shardckpt import _fp8, _knobs

    d, want = fp8_dir
    sinks = []

    def box_sink(dst, **kw):
        put = real(dst, **kw)

        def counted(pos, data):
            sinks.append(len(data))
            put(pos, data)

        return counted

    real = _fp8.box_sink
    monkeypatch.setattr(_fp8, "box_sink", box_sink)
    monkeypatch.setattr(_knobs, "READ_BLOCK_BYTES", 1000)
    model = make_model(seed=3)
    assert shardckpt.load({"model": model}, d, io_threads=3) == ([], [])
    got = full_state(model)
    for k, v in want.items():
        assert_bits_equal(got[k], v, k)
    assert len(sinks) > 100 and max(sinks) <= 1000


@pytest.mark.parametrize("world", [2, pytest.param(4, marks=pytest.mark.slow)])
def test_fp8_dir_into_fsdp2_exact_and_next_step_loss(fp8_dir, one_process, world):
    d, want = fp8_dir
    ref_losses = one_process[2]
    for rank, (res, state, local, losses, refused) in enumerate(run_ranks(world, _load_fsdp2, d, timeout=300)):
        assert res == ([], []), world
        for k, v in want.items():
            assert_bits_equal(state[k], v, f"{k} on {world} ranks")
        # dim 0 of gate_proj (320 rows) cut at 160 (2 ranks), 80/160/240 (4): inside 128-row blocks
        assert local["model.layers.0.mlp.gate_proj.weight"][0] == 320 // world
        assert losses == ref_losses, (world, rank, losses, ref_losses)  # same bits: same math, sum of equal gradients
        assert refused is not None and "resize=True replaces only plain tensors" in refused


def test_read_dequantizes_and_keys_select_a_weight_with_its_scales(fp8_dir):
    d, want = fp8_dir
    name = "model.layers.0.self_attn.q_b_proj.weight"
    got = shardckpt.read(d, keys=[name])
    assert list(got) == [name] and got[name].dtype == torch.float32
    assert_bits_equal(got[name], want[name])
    # into bf16: the float32 product rounded once
    live = {"w": torch.zeros(want[name].shape, dtype=torch.bfloat16)}
    shardckpt.load(live, d, key_map={name: "w"}, keys=[name])
    assert_bits_equal(live["w"], want[name].to(torch.bfloat16))
    with pytest.raises(StateMismatchError, match="match no tensor"):
        shardckpt.read(d, keys=[name + "_scale_inv"])  # consumed by their weights


def test_resize_fills_placeholders_of_a_plain_dict(fp8_dir):
    d, want = fp8_dir
    state = {k: torch.zeros(1, dtype=torch.bfloat16) for k in want}
    res = shardckpt.load(state, d, resize=True)
    assert res == ([], [])
    for k, v in want.items():
        assert_bits_equal(state[k], v.to(torch.bfloat16), k)
    # without resize: refused, and nothing changed
    state = {k: torch.zeros(1) for k in want}
    with pytest.raises(StateMismatchError, match="checkpoint shape"):
        shardckpt.load(state, d)
    assert all(v.shape == (1,) for v in state.values())
    # a module's parameter is never swapped for a new object
    lin = torch.nn.Linear(2, 2)
    with pytest.raises(StateMismatchError, match="resize=True replaces only plain tensors"):
        shardckpt.load({"model": lin}, d, resize=True, strict=False,
                       key_map={"model.layers.0.mlp.down_proj.weight": "model.weight"}.get)


def test_export_quantize_roundtrip_sizes_and_transformers_config(tmp_path):
    from transformers import AutoConfig, FineGrainedFP8Config

    src = make_model(seed=3)
    state = full_state(src)
    ck, hf, cfg_dir, ref_dir = (str(tmp_path / n) for n in ("ck", "hf", "cfg", "ref"))
    shardckpt.save({"model": src}, ck, no_dist=True)
    tiny_config().save_pretrained(cfg_dir)
    res = converters.to_safetensors(ck, hf, quantize="fp8-block", copy_from=cfg_dir, max_shard_size="200KB")
    assert "config.json" in res.files and len([f for f in res.files if f.endswith(".safetensors")]) > 1
    # the codes and scales are DeepSeek's quantizer's, bit for bit; the rest as saved
    written = {}
    for f in os.listdir(hf):
        if f.endswith(".safetensors"):
            with safe_open(os.path.join(hf, f), "pt") as sf:
                written.update({k: sf.get_tensor(k) for k in sf.keys()})
    quantized = sorted(k for k in state if linear_weight(k, state[k]))
    assert quantized and set(written) == set(state) | {k + "_scale_inv" for k in quantized}
    for k in quantized:
        q, s = reference_quantize(state[k])
        assert_bits_equal(written[k], q, k)
        assert_bits_equal(written[k + "_scale_inv"], s, k)
    # reloaded by our loader: within FP8's round-trip error of the source
    back = shardckpt.read(hf)
    for k, v in state.items():
        if k in quantized:
            err = (back[k] - v).abs()
            s = block_scale(reference_quantize(v)[1], v.shape)
            assert bool((err <= torch.maximum(v.abs() * 2.0**-4, s * 2.0**-10) * 1.0001).all()), k
        else:
            assert_bits_equal(back[k], v, k)
    # config.json: the source config plus block FP8, which transformers parses
    cfg = AutoConfig.from_pretrained(hf)
    qc = cfg.quantization_config
    assert cfg.model_type == "deepseek_v3" and qc["quant_method"] == "fp8" and qc["weight_block_size"] == [128, 128]
    parsed = FineGrainedFP8Config.from_dict(qc)
    assert list(parsed.weight_block_size) == [128, 128] and parsed.activation_scheme == "dynamic"
    assert "lm_head" in parsed.modules_to_not_convert and "model.embed_tokens" in parsed.modules_to_not_convert
    # sizes: within 1.05x of a reference FP8 checkpoint of the same model (bf16 for what is not quantized)
    ref_state = {k: v.to(torch.bfloat16) for k, v in state.items()}
    write_fp8_checkpoint(ref_state, ref_dir, split=False)
    res_bf16 = converters.to_safetensors(ck, str(tmp_path / "hf16"), quantize="fp8-block", dtype="bf16")
    ours = sum(os.path.getsize(os.path.join(res_bf16.url, f)) for f in res_bf16.files if f.endswith(".safetensors"))
    theirs = os.path.getsize(os.path.join(ref_dir, "model.safetensors"))
    assert ours <= 1.05 * theirs, (ours, theirs)
    # a quantized export loads back into the model (FP8 error) through transformers' names
    model = make_model(seed=4)
    assert shardckpt.load({"model": model}, hf) == ([], [])


def test_refusals(tmp_path):
    w = torch.randn(256, 300)
    q, s = reference_quantize(w)

    def case(name, tensors, config=None):
        d = str(tmp_path / name)
        os.makedirs(d)
        save_file(tensors, os.path.join(d, "model.safetensors"))
        if config is not None:
            with open(os.path.join(d, "config.json"), "w") as f:
                json.dump({"quantization_config": config}, f)
        return d

    live = {"w": torch.zeros(256, 300)}
    with pytest.raises(UnsupportedStateError, match="quant_method is 'gptq'"):
        shardckpt.load(live, case("gptq", {"w": q, "w_scale_inv": s}, {"quant_method": "gptq"}))
    with pytest.raises(UnsupportedStateError, match="fmt is 'e5m2'"):
        shardckpt.load(live, case("e5m2", {"w": q, "w_scale_inv": s}, {**QC, "fmt": "e5m2"}))
    with pytest.raises(UnsupportedStateError, match="per-tensor or per-channel"):
        shardckpt.load(live, case("pertensor", {"w": q, "w_scale_inv": s}, {"quant_method": "fp8", "fmt": "e4m3"}))
    with pytest.raises(CorruptCheckpointError, match=r"w_scale_inv: shape \[2, 2\], but w \[256, 300\] in 128x128 blocks needs \[2, 3\]"):
        shardckpt.load(live, case("shape", {"w": q, "w_scale_inv": s[:, :2].contiguous()}, QC))
    with pytest.raises(CorruptCheckpointError, match="FP8 weights without a _scale_inv tensor: w"):
        shardckpt.read(case("missing", {"w": q, "b": torch.ones(2)}, QC))
    with pytest.raises(UnsupportedStateError, match="block FP8 weights are 2-D F8_E4M3"):
        shardckpt.read(case("e5m2w", {"w": q.float().to(torch.float8_e5m2), "w_scale_inv": s}))
    assert all(v.abs().sum() == 0 for v in live.values())  # nothing was loaded
    # no config.json: the _scale_inv naming and DeepSeek's 128 x 128 block (the example)
    d = case("noconfig", {"w": q, "w_scale_inv": s})
    assert shardckpt.load(live, d) == ([], [])
    assert_bits_equal(live["w"], q.float() * block_scale(s, q.shape))
    # cast=False: the dequantized value is float32, nothing else
    with pytest.raises(StateMismatchError, match="checkpoint dtype F32, live dtype BF16"):
        shardckpt.load({"w": torch.zeros(256, 300, dtype=torch.bfloat16)}, d, cast=False)
    with pytest.raises(ValueError, match="quantize='int4'"):
        converters.to_safetensors(d, str(tmp_path / "out"), quantize="int4")
