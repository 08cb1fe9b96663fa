"""CheckpointManager options torchtitan users look for (issue 10 part 7), with real files."""

from __future__ import annotations

import json
import os

import pytest
import torch
from _dist import run_ranks
from safetensors import safe_open
from test_transformers import assert_bits_equal, full_state, logits, make_model, reference, shard

import shardckpt
from shardckpt.errors import UsageError


def _train_state(family="qwen2", seed=0):
    model = make_model(family, seed)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    return {"model": model, "optim": opt, "step": 0}


def test_initial_load_path_model_only_then_ignored_once_the_run_has_steps(tmp_path):
    src = make_model("qwen2", seed=1)
    hf = str(tmp_path / "hf")
    src.save_pretrained(hf)  # bf16-free, tied head omitted
    _, want = reference("qwen2", full_state(src))
    mgr = shardckpt.CheckpointManager(str(tmp_path / "run"), initial_load_path=hf)
    state = _train_state(seed=2)
    assert mgr.restore(state) is None and mgr.restored_from == hf
    assert_bits_equal(logits(state["model"]), want, "initial load")
    assert state["model"].lm_head.weight is state["model"].model.embed_tokens.weight
    # The run now has its own checkpoint: the initial path is no longer read.
    with torch.no_grad():
        state["model"].model.norm.weight.add_(1.0)
    state["step"] = 5
    mgr.save(5, state)
    again = _train_state(seed=3)
    assert mgr.restore(again) == 5 and again["step"] == 5
    assert mgr.restored_from == mgr.step_url(5)
    assert_bits_equal(logits(again["model"]), logits(state["model"]), "own step wins")


def test_initial_load_full_state_and_model_only_needs_a_model_entry(tmp_path):
    first = _train_state(seed=4)
    first["step"] = 9
    shardckpt.save(first, str(tmp_path / "pre"))
    full = _train_state(seed=5)
    mgr = shardckpt.CheckpointManager(str(tmp_path / "run"), initial_load_path=str(tmp_path / "pre"),
                                      initial_load_model_only=False)
    assert mgr.restore(full) is None and full["step"] == 9
    assert full["optim"].state_dict()["param_groups"] == first["optim"].state_dict()["param_groups"]
    mgr = shardckpt.CheckpointManager(str(tmp_path / "run2"), initial_load_path=str(tmp_path / "pre"))
    with pytest.raises(UsageError, match=r"has no 'model' entry \(it has net\)"):
        mgr.restore({"net": make_model("qwen2", 6)})
    bare = {"model": make_model("qwen2", 7), "step": 0}
    assert mgr.restore(bare) is None and bare["step"] == 0  # model only: the step stays the live one
    assert_bits_equal(logits(bare["model"]), logits(first["model"]), "model only")


def test_last_save_model_only_with_export_dtype_and_in_hf(tmp_path):
    from test_transformers import IDS, make_config
    from transformers import AutoModelForCausalLM

    state = _train_state(seed=8)
    state["model"](input_ids=IDS, labels=IDS).loss.backward()
    state["optim"].step()
    root = str(tmp_path / "run")
    mgr = shardckpt.CheckpointManager(root, last_save_model_only=True, export_dtype="bfloat16", last_save_in_hf=True)
    mgr.save(1, state)  # not the last step: the full state
    names = set(json.load(open(os.path.join(mgr.step_url(1), "manifest.json")))["tensors"])
    assert any(n.startswith("optim.") for n in names)
    assert not os.path.exists(mgr.hf_url(1))
    mgr.save(2, state, last_step=True)
    m = json.load(open(os.path.join(mgr.step_url(2), "manifest.json")))
    assert all(n.startswith("model.") for n in m["tensors"]), sorted(m["tensors"])[:5]
    assert "model.lm_head.weight" not in m["tensors"]  # still one tensor for the tie
    assert {t["dtype"] for t in m["tensors"].values()} == {"BF16"}
    bf16 = {k: v.detach().bfloat16() for k, v in full_state(state["model"]).items()}
    with safe_open(os.path.join(mgr.hf_url(2), "model.safetensors"), "pt") as f:
        assert set(f.keys()) == set(bf16) - {"lm_head.weight"}
        for k in f.keys():
            assert_bits_equal(f.get_tensor(k), bf16[k], k)
    # The native step loads back into an fp32 model (cast on load), the HF dir into from_pretrained.
    fresh = make_model("qwen2", 9)
    assert mgr.restore({"model": fresh}) == 2
    assert_bits_equal(fresh.model.norm.weight.detach(), bf16["model.norm.weight"].float(), "restore")
    make_config("qwen2").save_pretrained(mgr.hf_url(2))
    hf_model = AutoModelForCausalLM.from_pretrained(mgr.hf_url(2), dtype=torch.float32)
    assert_bits_equal(hf_model.model.norm.weight.detach(), bf16["model.norm.weight"].float(), "from_pretrained")
    assert mgr.steps() == [1, 2]  # the HF directory is not a step


def test_first_step_checkpoint_and_load_only(tmp_path):
    mgr = shardckpt.CheckpointManager(str(tmp_path / "a"), save_interval=10, enable_first_step_checkpoint=True)
    assert [s for s in range(0, 25) if mgr.should_save(s)] == [0, 1, 10, 20]
    plain = shardckpt.CheckpointManager(str(tmp_path / "a"), save_interval=10)
    assert [s for s in range(1, 25) if plain.should_save(s)] == [10, 20]
    state = _train_state(seed=10)
    mgr.save(1, state)
    ro = shardckpt.CheckpointManager(str(tmp_path / "a"), load_only=True, save_interval=1)
    assert not any(ro.should_save(s) for s in range(5))
    assert ro.save(2, state) is None and ro.save(3, state, last_step=True) is None
    assert ro.steps() == [1]
    fresh = _train_state(seed=11)
    assert ro.restore(fresh) == 1
    assert_bits_equal(logits(fresh["model"]), logits(state["model"]), "load_only restore")


def _initial_fsdp2(rank, world, hf, root):
    model = shard(make_model("qwen2", seed=12))
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    mgr = shardckpt.CheckpointManager(root, initial_load_path=hf)
    got = mgr.restore({"model": model, "optim": opt, "step": 0})
    return got, mgr.restored_from, logits(model), full_state(model)


def test_initial_load_path_from_hf_dir_into_fsdp2(tmp_path):
    src = make_model("qwen2", seed=13)
    hf = str(tmp_path / "hf")
    src.save_pretrained(hf, max_shard_size="20KB")
    state = full_state(src)
    _, want = reference("qwen2", state)
    for got, restored_from, out, full in run_ranks(2, _initial_fsdp2, hf, str(tmp_path / "run")):
        assert got is None and restored_from == hf
        assert_bits_equal(out, want, "fsdp2 initial load")
        for k, v in state.items():
            assert_bits_equal(full[k], v, k)
