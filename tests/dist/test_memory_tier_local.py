"""The memory tier in one process (no process group): lifecycle, budget, a directory that cannot be made."""

import logging
import os

import torch

import shardckpt
from shardckpt import MemoryTier
from shardckpt._memory import store


def _model(seed):
    torch.manual_seed(seed)
    return torch.nn.Linear(4, 3)


def test_newest_step_only_restore_from_memory_and_close_cleans(tmp_path, caplog):
    shm, root = str(tmp_path / "shm"), str(tmp_path / "root")
    assert store.open_dir(shm, root) is None  # this root's tier directory, left by an earlier process...
    os.makedirs(os.path.join(shm, ".restore-r0-999999999"))  # ...with a dead restore's staging directory
    model = _model(0)
    mgr = shardckpt.CheckpointManager(root, memory=MemoryTier(dir=shm))
    assert mgr.save_to_memory(1, {"model": model, "step": 1})
    with torch.no_grad():
        model.weight.add_(1)
    assert mgr.save_to_memory(2, {"model": model, "step": 2})
    mgr._memory.snapshots.wait()  # the step in flight is held
    names = sorted(os.listdir(shm))
    # The older step freed, the stale staging removed; the two slots this process maps stay.
    assert [n for n in names if not n.startswith(".slot-")] == ["identity.json", "step-00000002"]
    assert len([n for n in names if n.startswith(".slot-")]) == 2
    data = os.path.join(shm, "step-00000002", "data")
    (held,) = [f for f in os.listdir(data) if f.endswith(".safetensors")]
    assert os.stat(os.path.join(data, held)).st_nlink == 2  # the data file is a slot: no second host copy
    mgr.save(1, {"model": model, "step": 1})  # storage is older than memory
    want = {k: v.clone() for k, v in model.state_dict().items()}

    fresh = _model(1)
    state = {"model": fresh, "step": 0}
    again = shardckpt.CheckpointManager(root, memory=MemoryTier(dir=shm))  # the process restarted
    with caplog.at_level(logging.INFO, logger="shardckpt"):
        assert again.restore(state) == 2
    assert again.restored_from == "memory:2" and state["step"] == 2
    assert all(torch.equal(fresh.state_dict()[k], v) for k, v in want.items())
    assert any("restored step 2 from the memory tier" in r.getMessage() for r in caplog.records)
    mgr.close()  # the first process's slots go with it...
    again.close()
    assert not os.path.exists(shm)  # ...and close() removes the node's memory directory


def test_over_budget_turns_the_tier_off_with_one_warning(tmp_path, caplog):
    shm, root = str(tmp_path / "shm"), str(tmp_path / "root")
    model = _model(0)
    mgr = shardckpt.CheckpointManager(root, memory={"dir": shm, "max_bytes": 16})
    with caplog.at_level(logging.WARNING, logger="shardckpt"):
        assert not mgr.save_to_memory(1, {"model": model})
        assert not mgr.save_to_memory(2, {"model": model})
    said = [r.getMessage() for r in caplog.records if "memory tier off" in r.getMessage()]
    assert len(said) == 1 and "max_bytes" in said[0]
    mgr.save(2, {"model": model})  # storage saves go on
    assert shardckpt.CheckpointManager(root, memory={"dir": shm}).restore({"model": _model(1)}) == 2
    mgr.close()


def test_a_directory_that_cannot_be_made_means_storage_only(tmp_path, caplog):
    blocker = tmp_path / "file"
    blocker.write_text("x")
    mgr = shardckpt.CheckpointManager(str(tmp_path / "root"), memory=str(blocker / "shm"))
    with caplog.at_level(logging.WARNING, logger="shardckpt"):
        assert not mgr.save_to_memory(1, {"model": _model(0)})
    assert any("cannot create" in r.getMessage() for r in caplog.records)
    assert mgr.restore({"model": _model(0)}) is None
    mgr.close()
