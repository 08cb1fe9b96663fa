"""Issue 37 item 3 with a real transformers model: an untied checkpoint loaded into a tied Qwen2 (tiny config).

The checkpoint holds ``model.embed_tokens.weight`` and ``lm_head.weight`` as two different tensors (saved from an
untied copy); the live model ties them. ``strict=True`` (the default) refuses before any tensor changes, naming
both; ``strict=False`` loads the embedding into the tied tensor and warns naming both. A Hugging Face file holding
both names (no checksums to compare by) loads with a warning that they may differ.
"""

from __future__ import annotations

import logging
import os

import pytest
import torch
from test_transformers import full_state, make_model

import shardckpt
from shardckpt.errors import StateMismatchError

EMB, HEAD = "model.model.embed_tokens.weight", "model.lm_head.weight"


def _untied(seed: int):
    m = make_model("qwen2", seed=seed)
    m.lm_head.weight = torch.nn.Parameter(m.lm_head.weight.detach() * 2 + 1)  # untied, different values
    assert m.lm_head.weight is not m.get_input_embeddings().weight
    return m


def _tie_warnings(caplog):
    return [r.getMessage() for r in caplog.records if "tied" in r.getMessage()]


def test_untied_checkpoint_into_a_tied_transformers_model(tmp_path, caplog):
    src = _untied(seed=1)
    url = str(tmp_path / "untied")
    shardckpt.save({"model": src}, url)

    live = make_model("qwen2", seed=2)
    assert live.lm_head.weight is live.get_input_embeddings().weight
    before = full_state(live)
    with pytest.raises(StateMismatchError) as e:
        shardckpt.load({"model": live}, url)
    assert EMB in str(e.value) and HEAD in str(e.value) and "strict=False" in str(e.value)
    for k, v in full_state(live).items():
        assert torch.equal(v, before[k]), k  # refused before any tensor changed

    with caplog.at_level(logging.WARNING, logger="shardckpt"):
        shardckpt.load({"model": live}, url, strict=False)
    (msg,) = _tie_warnings(caplog)
    assert EMB in msg and HEAD in msg
    assert live.lm_head.weight is live.get_input_embeddings().weight  # still tied
    assert torch.equal(live.get_input_embeddings().weight, src.get_input_embeddings().weight)


def test_hf_file_with_both_names_into_a_tied_model_warns(tmp_path, caplog):
    from safetensors.torch import save_file

    src = _untied(seed=3)
    d = tmp_path / "hf"
    os.makedirs(d)
    save_file({k: v.contiguous() for k, v in full_state(src).items()}, str(d / "model.safetensors"))
    live = make_model("qwen2", seed=4)
    with caplog.at_level(logging.WARNING, logger="shardckpt"):
        shardckpt.load({"model": live}, str(d))
    (msg,) = _tie_warnings(caplog)
    assert "model.embed_tokens.weight" in msg and "lm_head.weight" in msg and "may differ" in msg
    assert torch.equal(live.get_input_embeddings().weight, src.get_input_embeddings().weight)
