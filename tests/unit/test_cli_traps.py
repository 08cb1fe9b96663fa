"""The CLI and converters never destroy their input, and refuse a non-empty destination unasked (issue 20)."""

from __future__ import annotations

import os

import pytest
import torch

import shardckpt
from shardckpt import converters
from shardckpt._cli import main
from shardckpt.errors import CheckpointExistsError, UsageError


def _ckpt(tmp_path):
    src = str(tmp_path / "src")
    shardckpt.save({"model": {"w": torch.arange(12.0).reshape(3, 4), "b": torch.ones(3)}, "step": 3}, src)
    return src


def _intact(src):
    shardckpt.verify(src)
    live = {"model": {"w": torch.zeros(3, 4), "b": torch.zeros(3)}, "step": 0}
    shardckpt.load(live, src)
    assert torch.equal(live["model"]["w"], torch.arange(12.0).reshape(3, 4)) and live["step"] == 3


@pytest.mark.parametrize("where", ["data", ".", "sub/out"])
def test_export_into_the_input_is_refused_even_with_overwrite(tmp_path, capsys, where):
    src = _ckpt(tmp_path)
    dst = os.path.normpath(os.path.join(src, where))
    assert main(["export", src, dst, "--overwrite", "-q"]) == 2
    err = capsys.readouterr().err
    assert "is inside the input" in err or "is the input" in err, err
    _intact(src)


def test_output_holding_the_input_is_refused(tmp_path):
    src = str(tmp_path / "runs" / "a")
    shardckpt.save({"w": torch.ones(3)}, src)
    with pytest.raises(UsageError, match="holds the input"):
        converters.to_safetensors(src, str(tmp_path / "runs"), overwrite=True)
    with pytest.raises(UsageError, match="holds the input"):
        converters.reshard(src, str(tmp_path), world_size=2, overwrite=True)
    # Through a symlink too.
    os.symlink(src, str(tmp_path / "link"))
    with pytest.raises(UsageError, match="is the input"):
        converters.reshard(str(tmp_path / "link"), src, world_size=2, overwrite=True)
    shardckpt.verify(src)


def test_reshard_into_a_non_empty_directory_needs_overwrite(tmp_path, capsys):
    src = _ckpt(tmp_path)
    dst = tmp_path / "dst"
    dst.mkdir()
    (dst / "notes.txt").write_text("mine")
    assert main(["reshard", src, str(dst), "--world-size", "2", "-q"]) == 2
    err = capsys.readouterr().err
    assert "not empty" in err and "notes.txt" in err and "--overwrite" in err, err
    assert sorted(os.listdir(dst)) == ["notes.txt"]
    with pytest.raises(CheckpointExistsError, match="not empty"):
        converters.reshard(src, str(dst), world_size=2)
    # An empty directory is fine, and --overwrite writes into a non-empty one (keeping other files).
    (tmp_path / "empty").mkdir()
    assert main(["reshard", src, str(tmp_path / "empty"), "--world-size", "2", "-q"]) == 0
    assert main(["reshard", src, str(dst), "--world-size", "2", "--overwrite", "-q"]) == 0
    assert (dst / "notes.txt").read_text() == "mine"
    shardckpt.verify(str(dst))


def test_export_to_pt_skips_per_rank_values_and_says_so(tmp_path, capsys, caplog):
    src = str(tmp_path / "ck")
    m = torch.nn.Linear(3, 2)
    shardckpt.save({"model": m, "rng": shardckpt.RNGState(), "extra": shardckpt.PerRank({"seed": 1}), "step": 3}, src)
    out = str(tmp_path / "x.pt")
    with caplog.at_level("WARNING", logger="shardckpt"):
        assert main(["export", src, out, "-q"]) == 0, capsys.readouterr().err
    assert "skipped extra, rng" in caplog.text
    got = torch.load(out, weights_only=True)
    assert sorted(got) == ["model", "step"] and got["step"] == 3
    assert torch.equal(got["model"]["weight"], m.weight.detach())


def test_export_prefix_matching_nothing_is_refused_listing_the_prefixes(tmp_path, capsys):
    src = str(tmp_path / "ck")
    model = torch.nn.Linear(3, 2)
    opt = torch.optim.AdamW(model.parameters())
    model(torch.ones(1, 3)).sum().backward()
    opt.step()
    shardckpt.save({"model": model, "optim": opt, "step": 1}, src)
    dst = str(tmp_path / "hf")
    # A typo exported every tensor, optimizer moments included, under its full name.
    assert main(["export", src, dst, "--prefix", "modle.", "-q"]) != 0
    err = capsys.readouterr().err
    assert "modle." in err and "model." in err and "optim." in err and "--no-prefix" in err, err
    assert not os.path.exists(dst)
    with pytest.raises(shardckpt.errors.StateMismatchError, match="prefixes that exist: model., optim., optim.state."):
        converters.to_safetensors(src, dst, prefix="modle.")
    # The default and an existing prefix export the model; --no-prefix everything.
    assert main(["export", src, dst, "-q"]) == 0
    assert sorted(shardckpt.inspect(dst).tensors) == ["bias", "weight"]
    assert main(["export", src, str(tmp_path / "hf2"), "--prefix", "model.", "-q"]) == 0
    assert main(["export", src, str(tmp_path / "hf3"), "--no-prefix", "-q"]) == 0
    assert len(shardckpt.inspect(str(tmp_path / "hf3")).tensors) > 2
