"""CheckpointManager.restore never resumes silently older (or from scratch), and the manager's first-hour traps.

Issue 20: a newest step written by a newer shardckpt, every step damaged with
``initial_load_path`` set, a step directory holding another step, a root that
does not exist, a manifest naming a path through a file or a 300-character
name, two managers of one process on one root, a step too big for a name, and
the torchrun hint.
"""

from __future__ import annotations

import json
import logging
import os

import pytest
import torch

import shardckpt
from shardckpt._format.checksum import crc32c
from shardckpt._format.manifest import FORMAT_VERSION, MANIFEST_CRC_FIELD, canonical_json
from shardckpt.errors import ConcurrentUseError, CorruptCheckpointError, NewerFormatError, UsageError


def _resign(path, edit) -> None:
    """Edit a manifest's JSON and sign it again (a crafted, not a damaged, manifest)."""
    raw = json.loads(open(path, "rb").read())
    edit(raw)
    raw.pop(MANIFEST_CRC_FIELD, None)
    raw[MANIFEST_CRC_FIELD] = crc32c(canonical_json(raw))
    with open(path, "wb") as f:
        f.write(canonical_json(raw))


def _run(tmp_path, steps=(1, 2)):
    root = str(tmp_path / "run")
    mgr = shardckpt.CheckpointManager(root)
    for s in steps:
        mgr.save(s, {"w": torch.full((4,), float(s)), "step": s})
    mgr.close()
    return root


def _manifest(root, step):
    return os.path.join(root, f"step-{step:08d}", "manifest.json")


def test_newest_step_of_a_newer_shardckpt_says_upgrade_not_older(tmp_path):
    root = _run(tmp_path)
    _resign(_manifest(root, 2), lambda raw: raw.update(format_version=FORMAT_VERSION + 1))
    live = {"w": torch.zeros(4), "step": 0}
    with pytest.raises(NewerFormatError, match="upgrade shardckpt") as ei:
        shardckpt.CheckpointManager(root).restore(live)
    assert "step 2" in str(ei.value) and "step=N" in str(ei.value)
    assert isinstance(ei.value, CorruptCheckpointError)  # callers catching the old type still do
    assert torch.equal(live["w"], torch.zeros(4)) and live["step"] == 0
    # Resuming older on purpose still works.
    assert shardckpt.CheckpointManager(root).restore(live, step=1) == 1


def test_every_step_damaged_with_initial_load_path_does_not_start_over(tmp_path):
    init = str(tmp_path / "init")
    shardckpt.save({"model": {"w": torch.full((4,), 9.0)}}, init)
    root = _run(tmp_path)
    for s in (1, 2):
        with open(_manifest(root, s), "ab") as f:
            f.write(b"x")  # damaged
    live = {"model": {"w": torch.zeros(4)}, "step": 0}
    mgr = shardckpt.CheckpointManager(root, initial_load_path=init)
    with pytest.raises(CorruptCheckpointError, match="initial_load_path") as ei:
        mgr.restore(live)
    assert "step 1" in str(ei.value) and "step 2" in str(ei.value)
    assert torch.equal(live["model"]["w"], torch.zeros(4)) and mgr.restored_from is None
    # A fresh run (no step at all) still starts from initial_load_path.
    fresh = shardckpt.CheckpointManager(str(tmp_path / "fresh"), initial_load_path=init)
    assert fresh.restore(live) is None and torch.equal(live["model"]["w"], torch.full((4,), 9.0))


def test_a_step_directory_holding_another_step_is_skipped(tmp_path, caplog):
    root = _run(tmp_path, steps=(1, 2))
    # A hand copy: step-00000005 holds step 2's checkpoint.
    import shutil

    shutil.copytree(os.path.join(root, "step-00000002"), os.path.join(root, "step-00000005"))
    live = {"w": torch.zeros(4), "step": 0}
    with caplog.at_level(logging.WARNING, logger="shardckpt"):
        assert shardckpt.CheckpointManager(root).restore(live) == 2
    assert "holds the checkpoint of step 2" in caplog.text and live["step"] == 2


def test_a_root_that_does_not_exist_warns(tmp_path, caplog):
    _run(tmp_path)
    typo = str(tmp_path / "rnu")
    with caplog.at_level(logging.WARNING, logger="shardckpt"):
        assert shardckpt.CheckpointManager(typo).restore({"w": torch.zeros(4), "step": 0}) is None
    assert "does not exist" in caplog.text and "nearby" in caplog.text and "run" in caplog.text


def test_a_fresh_run_with_local_names_the_local_directory_and_the_remote(tmp_path, caplog):
    local, remote = str(tmp_path / "nvme" / "run"), str(tmp_path / "remote" / "rnu")
    os.makedirs(tmp_path / "remote" / "run")  # the path meant: a typo away
    mgr = shardckpt.CheckpointManager(remote, local=local)
    with caplog.at_level(logging.WARNING, logger="shardckpt"):
        assert mgr.restore({"w": torch.zeros(4), "step": 0}) is None
    mgr.close()
    (line,) = [r.getMessage() for r in caplog.records if "starts fresh" in r.getMessage()]
    # Was: "<local> does not exist: nothing to restore ...": the remote, where a resume reads, unnamed.
    assert local in line and remote in line and "does not exist" in line and "check both paths" in line, line
    assert str(tmp_path / "remote" / "run") in line, line  # the nearby name of the remote's typo


@pytest.mark.parametrize("name", ["under", "long"])
def test_a_newest_step_naming_an_impossible_path_is_skipped(tmp_path, name):
    root = _run(tmp_path)

    def edit(raw):
        # v3 keeps the save's own data files in the compact file table: the
        # impossible name goes into the plain map beside it.
        data = [k for k in os.listdir(os.path.dirname(_manifest(root, 2)) + "/data") if k.endswith(".safetensors")][0]
        bad = "data/" + data + "/under" if name == "under" else "data/" + "x" * 300 + ".safetensors"
        raw.setdefault("files", {})[bad] = {"size": 8}

    _resign(_manifest(root, 2), edit)
    live = {"w": torch.zeros(4), "step": 0}
    assert shardckpt.CheckpointManager(root).restore(live) == 1 and live["step"] == 1


def test_two_managers_of_one_process_on_one_root_are_refused(tmp_path):
    root = str(tmp_path / "run")
    a = shardckpt.CheckpointManager(root, keep_last=1)
    b = shardckpt.CheckpointManager(root, keep_last=1)
    a.save(1, {"w": torch.ones(2)})
    b.save(2, {"w": torch.ones(2)})  # b takes over the root (a restart in the same process)
    with pytest.raises(ConcurrentUseError, match="another CheckpointManager of this process"):
        a.save(3, {"w": torch.ones(2)})
    assert b.steps() == [2]
    b.save(3, {"w": torch.ones(2)})
    assert b.steps() == [3]


def test_a_step_too_big_for_a_name_is_our_error(tmp_path):
    mgr = shardckpt.CheckpointManager(str(tmp_path / "run"))
    with pytest.raises(UsageError, match="bits"):
        mgr.save(10**5000, {"w": torch.ones(2)})
    with pytest.raises(UsageError):
        mgr.save(-1, {"w": torch.ones(2)})
    assert mgr.steps() == []


def test_torchrun_without_a_group_hint_suits_the_manager(tmp_path, monkeypatch):
    monkeypatch.setenv("WORLD_SIZE", "2")
    mgr = shardckpt.CheckpointManager(str(tmp_path / "run"))
    with pytest.raises(UsageError) as ei:
        mgr.save(1, {"w": torch.ones(2)})
    assert "no_dist" not in str(ei.value) and "init_process_group" in str(ei.value)


def test_meta_model_with_an_optimizer_built_before_load_is_a_clear_error(tmp_path):
    m = torch.nn.Linear(3, 2)
    o = torch.optim.Adam(m.parameters())
    m(torch.ones(1, 3)).sum().backward()
    o.step()
    shardckpt.save({"model": m, "optim": o}, str(tmp_path / "ck"))
    with torch.device("meta"):
        m2 = torch.nn.Linear(3, 2)
    o2 = torch.optim.Adam(m2.parameters())
    with pytest.raises(UsageError, match="Build the optimizer after load"):
        shardckpt.load({"model": m2, "optim": o2}, str(tmp_path / "ck"))
    assert m2.weight.is_meta and not o2.state  # nothing half-loaded
    # The documented order works: load the model, then build the optimizer and load it.
    shardckpt.load({"model": m2}, str(tmp_path / "ck"), strict=False)
    o3 = torch.optim.Adam(m2.parameters())
    shardckpt.load({"model": m2, "optim": o3}, str(tmp_path / "ck"))
    assert torch.equal(m2.weight, m.weight) and o3.state
