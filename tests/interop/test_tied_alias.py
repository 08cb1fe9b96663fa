"""Tied weights with real transformers models (Qwen2, GPT-2 tiny configs), issue 10 part 2.

One process and FSDP2 on 2 gloo ranks, meta-device init included; logits
compared bit for bit with a reference model holding the same weights.
"""

from __future__ import annotations

import json
import os

import pytest
import torch
from _dist import run_ranks
from test_transformers import assert_bits_equal, full_state, logits, make_config, make_model, reference, shard

import shardckpt
from shardckpt import converters

TIED_FAMILIES = ("qwen2", "gpt2")
EMBED = {"qwen2": "model.embed_tokens.weight", "gpt2": "transformer.wte.weight"}


def _meta_model(family: str):
    from transformers import AutoModelForCausalLM

    with torch.device("meta"):
        model = AutoModelForCausalLM.from_config(make_config(family))
    # Non-persistent buffers (rotary frequencies) are not in any checkpoint:
    # as with torchtitan's init_weights, the user computes them after meta init.
    for name, mod in list(model.named_modules()):
        if "Rotary" in type(mod).__name__:
            parent = model.get_submodule(name.rpartition(".")[0]) if "." in name else model
            setattr(parent, name.rpartition(".")[2], type(mod)(config=model.config))
    model.eval()
    return model


def _tensor_bytes(url: str) -> int:
    m = shardckpt.inspect(url)  # chunks resolved from the index files (format v2)
    return sum(c.nbytes for t in m.tensors.values() for c in t.chunks)


@pytest.mark.parametrize("family", TIED_FAMILIES)
def test_tied_model_saved_once_loads_under_either_name_and_stays_tied(tmp_path, family):
    model = make_model(family, seed=1)
    assert model.lm_head.weight is model.get_input_embeddings().weight
    state = full_state(model)
    _, want = reference(family, state)
    url = str(tmp_path / "tied")
    shardckpt.save({"model": model}, url)
    names = set(json.load(open(os.path.join(url, "manifest.json")))["tensors"])
    assert f"model.{EMBED[family]}" in names and "model.lm_head.weight" not in names

    # Bytes: an untied copy of the same weights stores exactly one more tensor.
    untied = make_model(family, seed=1)
    untied.lm_head.weight = torch.nn.Parameter(untied.lm_head.weight.detach().clone())
    shardckpt.save({"model": untied}, str(tmp_path / "untied"))
    head = state["lm_head.weight"]
    assert _tensor_bytes(url) == _tensor_bytes(str(tmp_path / "untied")) - head.numel() * head.element_size()

    # A live tied model (real init and meta init): strict, nothing missing, tie kept.
    for fresh in (make_model(family, seed=2), _meta_model(family)):
        res = shardckpt.load({"model": fresh}, url)
        assert res == ([], [])
        assert fresh.lm_head.weight is fresh.get_input_embeddings().weight
        assert not fresh.lm_head.weight.is_meta
        assert_bits_equal(logits(fresh), want, family)
    # A live untied model takes the head from the alias.
    fresh = make_model(family, seed=3)
    fresh.lm_head.weight = torch.nn.Parameter(torch.zeros_like(fresh.lm_head.weight))
    assert shardckpt.load({"model": fresh}, url) == ([], [])
    assert_bits_equal(fresh.lm_head.weight.detach(), head, "untied head")
    # Either name can be asked for alone.
    got = {"lm_head.weight": torch.zeros_like(head)}
    shardckpt.load({"model": got}, url, strict=False)
    assert_bits_equal(got["lm_head.weight"], head, "by alias")


@pytest.mark.parametrize("family", TIED_FAMILIES)
def test_tied_export_writes_the_name_hf_expects(tmp_path, family):
    from safetensors import safe_open
    from safetensors.torch import load_model
    from transformers import AutoModelForCausalLM

    model = make_model(family, seed=4)
    _, want = reference(family, full_state(model))
    shardckpt.save({"model": model}, str(tmp_path / "ck"))
    one = str(tmp_path / "one")
    converters.to_safetensors(str(tmp_path / "ck"), one)
    with safe_open(os.path.join(one, "model.safetensors"), "pt") as f:
        keys = set(f.keys())
    hf = str(tmp_path / "hf")
    model.save_pretrained(hf)
    with safe_open(os.path.join(hf, "model.safetensors"), "pt") as f:
        assert keys == set(f.keys())  # save_pretrained's choice of names
    assert "lm_head.weight" not in keys and EMBED[family] in keys
    strict = make_model(family, seed=5)
    missing, unexpected = load_model(strict, os.path.join(one, "model.safetensors"), strict=True)
    assert not unexpected and set(missing) <= {"lm_head.weight"}, missing  # safetensors accepts a dropped tie
    assert_bits_equal(logits(strict), want, "safetensors.torch.load_model")
    make_config(family).save_pretrained(one)
    assert_bits_equal(logits(AutoModelForCausalLM.from_pretrained(one)), want, "from_pretrained")

    both = str(tmp_path / "both")
    converters.to_safetensors(str(tmp_path / "ck"), both, tied="both")
    with safe_open(os.path.join(both, "model.safetensors"), "pt") as f:
        assert set(f.keys()) == keys | {"lm_head.weight"}
        assert_bits_equal(f.get_tensor("lm_head.weight"), f.get_tensor(EMBED[family]), "both")
    with pytest.raises(ValueError, match=r"tied='some'"):
        converters.to_safetensors(str(tmp_path / "ck"), str(tmp_path / "bad"), tied="some")


def _fsdp2_tied(rank, world, jobs):
    out = {}
    for family, url, save_to in jobs:
        model = _meta_model(family)
        shard(model)
        res = shardckpt.load({"model": model}, url)
        tied = model.lm_head.weight is model.get_input_embeddings().weight
        # An optimizer built after the load holds the live (materialized) parameters.
        opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
        meta = [n for n, p in model.named_parameters() if p.is_meta]
        got = logits(model)
        state = full_state(model)
        shardckpt.save({"model": model, "optim": opt}, save_to)
        out[family] = (res, tied, meta, got, state)
    return out


def test_fsdp2_meta_init_loads_save_pretrained_dir_strictly_and_saves_once(tmp_path):
    jobs, want, states = [], {}, {}
    for family in TIED_FAMILIES:
        model = make_model(family, seed=7)
        states[family] = full_state(model)
        _, want[family] = reference(family, states[family])
        hf = str(tmp_path / family / "hf")
        model.save_pretrained(hf)  # no lm_head.weight in the files
        jobs.append((family, hf, str(tmp_path / family / "native")))
    for rank_out in run_ranks(2, _fsdp2_tied, jobs):
        for family, (res, tied, meta, got, state) in rank_out.items():
            assert res == ([], []) and tied and meta == [], (family, res, tied, meta)
            assert_bits_equal(got, want[family], family)
            for k, v in states[family].items():
                assert_bits_equal(state[k], v, f"{family} {k}")
    for family, _, native in jobs:
        names = set(json.load(open(os.path.join(native, "manifest.json")))["tensors"])
        assert f"model.{EMBED[family]}" in names and "model.lm_head.weight" not in names
        fresh = make_model(family, seed=8)
        assert shardckpt.load({"model": fresh}, native) == ([], [])
        assert fresh.lm_head.weight is fresh.get_input_embeddings().weight
        assert_bits_equal(logits(fresh), want[family], f"{family} FSDP2 save reloaded")
