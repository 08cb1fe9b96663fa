"""Issue 37: three load edges of docs/guarantees.md, with real files and the real load API.

1. A stateful user object whose ``load_state_dict`` raises, next to a model: our error, naming the tensors already
   loaded, with the object's exception as ``__cause__`` (before: its ``ValueError`` escaped as is).
2. A symlinked ``model.safetensors.index.json`` leading outside the checkpoint is refused like any path leaving it.
3. An untied checkpoint (two different tensors) loaded into a tied model: refused under ``strict=True``, a warning
   naming both under ``strict=False`` (before: one copy was dropped without a word).
"""

from __future__ import annotations

import json
import logging
import os

import pytest
import torch

import shardckpt
from shardckpt.errors import CheckpointError, StateMismatchError, UnreadableFileError


class Loader:
    """A data loader's resumable state, with the version check real loaders do."""

    def __init__(self, version: int):
        self.version, self.pos = version, 0

    def state_dict(self):
        return {"version": self.version, "pos": self.pos}

    def load_state_dict(self, sd):
        if sd["version"] != self.version:
            raise ValueError(f"data loader state version {sd['version']} != {self.version}")
        self.pos = sd["pos"]


def test_a_user_object_that_raises_names_the_tensors_already_loaded(tmp_path):
    torch.manual_seed(0)
    saved = torch.nn.Linear(4, 3)
    loader = Loader(1)
    loader.pos = 7
    url = str(tmp_path / "ck")
    shardckpt.save({"model": saved, "loader": loader}, url)
    live = torch.nn.Linear(4, 3)
    with pytest.raises(CheckpointError) as e:
        shardckpt.load({"model": live, "loader": Loader(2)}, url)
    err = e.value
    assert isinstance(err, StateMismatchError)
    msg = str(err)
    assert "loader" in msg and "Loader.load_state_dict" in msg and "version 1 != 2" in msg
    assert "model.weight" in msg and "model.bias" in msg  # what the failed load already changed
    assert isinstance(err.__cause__, ValueError) and "version 1 != 2" in str(err.__cause__)
    assert torch.equal(live.weight, saved.weight)  # the message is right: the model was loaded


# --------------------------------------------------------------------------
# 2. the HF index through a symlink


def _hf_dir(path, tensors):
    from safetensors.torch import save_file

    os.makedirs(path)
    save_file(tensors, os.path.join(path, "model.safetensors"))
    return {"metadata": {"total_size": sum(t.numel() * t.element_size() for t in tensors.values())},
            "weight_map": {k: "model.safetensors" for k in tensors}}


def test_a_symlinked_hf_index_outside_the_checkpoint_is_refused(tmp_path):
    tensors = {"w": torch.arange(6.0).reshape(2, 3)}
    ck = str(tmp_path / "hf")
    index = _hf_dir(ck, tensors)
    outside = tmp_path / "elsewhere.json"
    outside.write_text(json.dumps(index))  # the same bytes: only the path is wrong
    os.symlink(outside, os.path.join(ck, "model.safetensors.index.json"))
    # Every way to name the directory: a path, and fsspec's local filesystem directly or under a cache.
    for url in (ck, "local://" + ck, "simplecache::file://" + ck):
        for call in (lambda u=url: shardckpt.load({"model": {"w": torch.zeros(2, 3)}}, u),
                     lambda u=url: shardckpt.load(None, u),
                     lambda u=url: shardckpt.inspect(u),
                     lambda u=url: shardckpt.verify(u)):
            with pytest.raises(UnreadableFileError) as e:
                call()
            assert "model.safetensors.index.json" in str(e.value) and "leading out of the checkpoint" in str(e.value), url
    # The other readers of a Hugging Face directory: read(), the converters, the command line (issue 47 item 17).
    from shardckpt import converters
    from shardckpt._cli import main

    for call in (lambda: shardckpt.read(ck, keys="w"),
                 lambda: converters.from_safetensors(ck, str(tmp_path / "o1")),
                 lambda: converters.to_safetensors(ck, str(tmp_path / "o2")),
                 lambda: converters.to_full(ck, str(tmp_path / "o3.safetensors")),
                 lambda: converters.reshard(ck, str(tmp_path / "o4"), world_size=2)):
        with pytest.raises(UnreadableFileError, match="model.safetensors.index.json is a symlink leading out of the checkpoint"):
            call()
    for argv in (["import", ck, str(tmp_path / "o5")], ["export", ck, str(tmp_path / "o6")], ["inspect", ck], ["verify", ck]):
        assert main([*argv, "-q"]) != 0, argv
    assert not any(os.path.exists(tmp_path / o) for o in ("o1", "o2", "o3.safetensors", "o4", "o5", "o6"))
    # The same index as a regular file loads.
    os.remove(os.path.join(ck, "model.safetensors.index.json"))
    with open(os.path.join(ck, "model.safetensors.index.json"), "w") as f:
        json.dump(index, f)
    for url in (ck, "local://" + ck):
        out = {"model": {"w": torch.zeros(2, 3)}}
        shardckpt.load(out, url)
        assert torch.equal(out["model"]["w"], tensors["w"])


# --------------------------------------------------------------------------
# 3. untied checkpoint, tied live model


class Tiny(torch.nn.Module):
    def __init__(self, tied: bool):
        super().__init__()
        self.emb = torch.nn.Embedding(8, 4)
        self.lm_head = torch.nn.Linear(4, 8, bias=False)
        if tied:
            self.lm_head.weight = self.emb.weight


def _untied_checkpoint(tmp_path, equal: bool):
    torch.manual_seed(1)
    m = Tiny(tied=False)
    if equal:
        with torch.no_grad():
            m.lm_head.weight.copy_(m.emb.weight)
    url = str(tmp_path / ("equal" if equal else "differ"))
    shardckpt.save({"model": m}, url)
    return m, url


def test_untied_checkpoint_into_a_tied_model_is_refused_when_strict(tmp_path):
    saved, url = _untied_checkpoint(tmp_path, equal=False)
    live = Tiny(tied=True)
    before = live.emb.weight.detach().clone()
    with pytest.raises(StateMismatchError) as e:
        shardckpt.load({"model": live}, url)
    assert "model.emb.weight" in str(e.value) and "model.lm_head.weight" in str(e.value)
    assert torch.equal(live.emb.weight, before)  # refused before anything changed


def test_untied_checkpoint_into_a_tied_model_warns_when_not_strict(tmp_path, caplog):
    saved, url = _untied_checkpoint(tmp_path, equal=False)
    live = Tiny(tied=True)
    with caplog.at_level(logging.WARNING, logger="shardckpt"):
        shardckpt.load({"model": live}, url, strict=False)
    warned = [r.getMessage() for r in caplog.records if "tie" in r.getMessage()]
    assert warned and "model.emb.weight" in warned[0] and "model.lm_head.weight" in warned[0]
    assert live.lm_head.weight is live.emb.weight  # still tied, holding the first name's tensor
    assert torch.equal(live.emb.weight, saved.emb.weight)


def test_equal_copies_into_a_tied_model_load_quietly(tmp_path, caplog):
    saved, url = _untied_checkpoint(tmp_path, equal=True)
    live = Tiny(tied=True)
    with caplog.at_level(logging.WARNING, logger="shardckpt"):
        shardckpt.load({"model": live}, url)
    assert not [r for r in caplog.records if "tie" in r.getMessage()]
    assert torch.equal(live.emb.weight, saved.emb.weight)


def test_tied_checkpoint_into_a_tied_model_loads_quietly(tmp_path, caplog):
    torch.manual_seed(2)
    m = Tiny(tied=True)
    url = str(tmp_path / "tied")
    shardckpt.save({"model": m}, url)
    live = Tiny(tied=True)
    with caplog.at_level(logging.WARNING, logger="shardckpt"):
        shardckpt.load({"model": live}, url)
    assert not [r for r in caplog.records if "tie" in r.getMessage()]
    assert torch.equal(live.emb.weight, m.emb.weight)
