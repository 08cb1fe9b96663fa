"""Bad input to the trainer integrations: our exception types, naming what and the fix; nothing written or half-loaded."""

import pytest
import torch

import shardckpt
from shardckpt._storage import Storage
from shardckpt.errors import CheckpointNotFoundError, CorruptCheckpointError, UsageError
from shardckpt.integrations._common import values_template


def test_values_template_rebuilds_values_and_empty_tensors(tmp_path):
    url = str(tmp_path / "ck")
    meta = {"epoch": 3, "loops": {"a": [1, (2, 3)]}, "score": torch.tensor([1.5, 2.5]), "name": "x"}
    shardckpt.save({"lightning": meta}, url)
    tpl = values_template(shardckpt.inspect(url), "lightning", storage=Storage(url))
    assert tpl["epoch"] == 3 and tpl["loops"] == {"a": [1, (2, 3)]} and tpl["name"] == "x"
    assert tpl["score"].shape == (2,) and tpl["score"].dtype == torch.float32
    shardckpt.load({"lightning": tpl}, url)
    assert torch.equal(tpl["score"], torch.tensor([1.5, 2.5]))
    with pytest.raises(CorruptCheckpointError, match="no entry 'nope'"):
        values_template(shardckpt.inspect(url), "nope", storage=Storage(url))


def test_a_claimed_shape_is_checked_against_the_files_before_anything_is_allocated(tmp_path):
    from _damage import claim_shape

    url = str(tmp_path / "ck")
    shardckpt.save({"state_dict": {"w": torch.ones(2, 3)}, "lightning": {"epoch": 3, "score": torch.ones(2)}}, url)
    claim_shape(url, "lightning.score", [2**35])  # 128 GiB of F32 over a few hundred bytes
    # Was: RuntimeError: DefaultCPUAllocator: can't allocate memory.
    with pytest.raises(CorruptCheckpointError, match="truncated"):
        values_template(shardckpt.inspect(url), "lightning", storage=Storage(url))
    pytest.importorskip("lightning")
    from shardckpt.integrations.lightning import consolidate

    with pytest.raises(CorruptCheckpointError, match="truncated"):
        consolidate(url, str(tmp_path / "out.ckpt"))
    url2 = str(tmp_path / "ck2")
    shardckpt.save({"state_dict": {"w": torch.ones(2, 3)}, "lightning": {"epoch": 3}}, url2)
    claim_shape(url2, "state_dict.w", [2**34, 2])  # the weights consolidate puts in the file
    with pytest.raises(CorruptCheckpointError, match="truncated"):
        consolidate(url2, str(tmp_path / "out.ckpt"))
    assert not (tmp_path / "out.ckpt").exists()


def test_accelerate_enable_refuses_other_objects():
    pytest.importorskip("accelerate")
    from shardckpt.integrations.accelerate import enable

    with pytest.raises(UsageError, match="expected an accelerate.Accelerator, got object"):
        enable(object())


def test_lightning_consolidate_refuses_a_non_checkpoint(tmp_path):
    pytest.importorskip("lightning")
    from shardckpt.integrations.lightning import consolidate

    (tmp_path / "ck").mkdir()
    with pytest.raises(CheckpointNotFoundError, match="not a shardckpt checkpoint"):
        consolidate(str(tmp_path / "ck"), str(tmp_path / "out.ckpt"))
    assert not (tmp_path / "out.ckpt").exists()


def test_torchtitan_config_keeps_torchtitan_validation():
    pytest.importorskip("torchtitan.components.checkpointer")
    from shardckpt.integrations.torchtitan import CheckpointManager

    with pytest.raises(ValueError, match="async_mode"):
        CheckpointManager.Config(enable=True, async_mode="sometimes")
    with pytest.raises(ValueError, match="at least 2"):
        CheckpointManager.Config(enable=True, keep_latest_k=1)
    assert CheckpointManager.Config(enable=True, async_mode="ASYNC").async_mode == "async"
    # What torchtitan's Trainer.Config.checkpoint takes, and what its build() constructs.
    from torchtitan.components.checkpointer import BaseCheckpointManager

    assert isinstance(CheckpointManager.Config(enable=True), BaseCheckpointManager.Config)
    assert CheckpointManager.Config._owner is CheckpointManager
    # A disabled manager builds nothing and saves nothing, as torchtitan's.
    off = CheckpointManager.Config(enable=False).build(dataloader=None, model_parts=[torch.nn.Linear(2, 2)], optimizers=None,
                                                       lr_schedulers=None, states={}, sd_adapter=None)
    assert off.save(10) is False and off.load() is False
