"""``restore()`` skips a damaged newest step whatever form the damage takes, and restores the older good one.

Regression tests of issue 11: damage that surfaces as an OS error (manifest is
a directory, an over-long name in ``files``, a path through a regular file, a
FIFO, a link to ``/dev/zero``, a symlink loop) used to raise instead of
falling back as docs/manager.md promises.
"""

from __future__ import annotations

import logging
import os
import shutil

import pytest
import torch

import shardckpt
from shardckpt._format import manifest_from_bytes, manifest_to_bytes
from shardckpt._manager import step_dir_name


def _state(step: int):
    g = torch.Generator().manual_seed(step)
    return {"w": torch.randn(4, 6, generator=g), "step": step, "lr": 1e-3 * step}


def _blank():
    return {"w": torch.zeros(4, 6), "step": -1, "lr": 0.0}


def _first_data_file(step_dir):
    """The first data file the committed manifest names (v3 lists them in its file table)."""
    return sorted(manifest_from_bytes((step_dir / "manifest.json").read_bytes()).data_files)[0]


def _rename_data_file(step_dir, new_rel_of):
    """Rewrite the manifest (checksum included) so its first data file is named ``new_rel_of(old_rel)``."""
    man = step_dir / "manifest.json"
    m = manifest_from_bytes(man.read_bytes())
    old = sorted(m.data_files)[0]
    m.files[new_rel_of(old)] = m.files.pop(old)
    man.write_bytes(manifest_to_bytes(m))


def _manifest_is_a_directory(d):
    (d / "manifest.json").unlink()
    (d / "manifest.json").mkdir()
    (d / "manifest.json" / "x").write_text("{}")


def _manifest_is_a_fifo(d):
    (d / "manifest.json").unlink()
    os.mkfifo(d / "manifest.json")


def _manifest_links_to_dev_zero(d):
    (d / "manifest.json").unlink()
    os.symlink("/dev/zero", d / "manifest.json")


def _manifest_links_out_of_the_checkpoint(d):
    # A valid manifest, but outside this step: never followed out.
    outside = d.parent.parent / "elsewhere.json"
    shutil.copy(d / "manifest.json", outside)
    (d / "manifest.json").unlink()
    os.symlink(outside, d / "manifest.json")


def _manifest_is_a_symlink_loop(d):
    (d / "manifest.json").unlink()
    os.symlink("manifest.json", d / "manifest.json")


def _over_long_file_name(d):
    _rename_data_file(d, lambda old: "data/" + "x" * 300 + ".safetensors")


def _path_through_a_regular_file(d):
    _rename_data_file(d, lambda old: old + "/inner.safetensors")


def _data_file_is_a_directory(d):
    rel = _first_data_file(d)
    (d / rel).unlink()
    (d / rel).mkdir()


def _data_file_links_out_of_the_checkpoint(d):
    rel = _first_data_file(d)
    outside = d.parent.parent / "stolen.safetensors"
    shutil.move(d / rel, outside)
    os.symlink(outside, d / rel)


def _manifest_deeply_nested(d):
    (d / "manifest.json").write_text('{"values":' + "[" * 5000 + "]" * 5000 + "}")


DAMAGE = [
    _manifest_is_a_directory,
    _manifest_is_a_fifo,
    _manifest_links_to_dev_zero,
    _manifest_links_out_of_the_checkpoint,
    _manifest_is_a_symlink_loop,
    _over_long_file_name,
    _path_through_a_regular_file,
    _data_file_is_a_directory,
    _data_file_links_out_of_the_checkpoint,
    _manifest_deeply_nested,
]


@pytest.mark.timeout(60)
@pytest.mark.parametrize("damage", DAMAGE, ids=lambda f: f.__name__.strip("_"))
def test_restore_skips_a_damaged_newest_step(tmp_path, damage, caplog):
    root = tmp_path / "run"
    mgr = shardckpt.CheckpointManager(str(root))
    mgr.save(1, _state(1))
    mgr.save(2, _state(2))
    damage(root / step_dir_name(2))
    got = _blank()
    with caplog.at_level(logging.WARNING, logger="shardckpt"):
        assert mgr.restore(got) == 1
    assert torch.equal(got["w"], _state(1)["w"]) and got["step"] == 1 and got["lr"] == _state(1)["lr"]
    if mgr.steps() == [1, 2]:
        assert "skipping step 2" in caplog.text
        # Asked for by number, the damaged step raises our type, naming the problem.
        with pytest.raises(shardckpt.CorruptCheckpointError):
            mgr.restore(_blank(), step=2)
    else:  # a manifest that resolves to nothing (a symlink loop) is no commit at all
        assert mgr.steps() == [1]
        with pytest.raises(shardckpt.CheckpointNotFoundError):
            mgr.restore(_blank(), step=2)
    # cleanup() leaves a step it cannot read alone, and raises nothing.
    mgr.cleanup()


def test_restore_returns_none_when_every_step_is_damaged(tmp_path, caplog):
    root = tmp_path / "run"
    mgr = shardckpt.CheckpointManager(str(root))
    mgr.save(1, _state(1))
    _manifest_is_a_fifo(root / step_dir_name(1))
    got = _blank()
    with caplog.at_level(logging.WARNING, logger="shardckpt"):
        assert mgr.restore(got) is None
    assert got["step"] == -1 and not got["w"].any()


def test_symlink_inside_the_checkpoint_that_stays_inside_is_followed(tmp_path):
    url = tmp_path / "ck"
    shardckpt.save(_state(5), str(url))
    rel = _first_data_file(url)
    os.rename(url / rel, url / "data" / "real.bin")
    os.symlink("real.bin", url / rel)
    got = _blank()
    shardckpt.load(got, str(url))
    assert torch.equal(got["w"], _state(5)["w"])


def test_checkpoint_reached_through_a_symlinked_root_loads(tmp_path):
    shardckpt.save(_state(6), str(tmp_path / "step-6"))
    os.symlink(tmp_path / "step-6", tmp_path / "latest")
    got = _blank()
    shardckpt.load(got, str(tmp_path / "latest"))
    assert torch.equal(got["w"], _state(6)["w"]) and got["step"] == 6
