"""The manager's options, grouped (``retention=``, ``schedule=``, ``tiers=``, ``writes=``, ``resume=``, ``last_save=``), and every flat keyword still taken.

A manager built from groups behaves as one built from the flat keywords
(same retention, same schedule, real saves on disk); both forms mix, the
flat keyword setting its field of the group; a keyword the manager does not
take is refused as Python refuses one.
"""

from __future__ import annotations

import pytest
import torch

import shardckpt
from shardckpt._managed.options import (
    FLAT,
    FlatOptions,
    LastSaveOptions,
    ManagerOptions,
    ResumeOptions,
    RetentionOptions,
    ScheduleOptions,
    TierOptions,
    WriteOptions,
)


def _run(mgr, steps):
    model = torch.nn.Linear(3, 2)
    saved = []
    with mgr:
        for step in steps:
            if mgr.should_save(step):
                mgr.save(step, {"model": model, "step": step})
                saved.append(step)
    return saved, mgr.steps()  # closed: the async save in flight committed


def test_groups_and_flat_keywords_make_the_same_manager(tmp_path):
    flat = shardckpt.CheckpointManager(str(tmp_path / "flat"), keep_last=2, keep_every=4, save_interval=2,
                                       enable_first_step_checkpoint=True, async_save=True, check_files=False)
    grouped = shardckpt.CheckpointManager(
        str(tmp_path / "grouped"),
        retention=RetentionOptions(keep_last=2, keep_every=4),
        schedule=ScheduleOptions(save_interval=2, enable_first_step_checkpoint=True),
        writes=WriteOptions(async_save=True),
        resume=ResumeOptions(check_files=False),
    )
    assert flat.options == grouped.options
    assert _run(flat, range(1, 11)) == _run(grouped, range(1, 11)) == ([1, 2, 4, 6, 8, 10], [4, 8, 10])


def test_a_flat_keyword_sets_its_field_of_the_group_given():
    o = ManagerOptions.of({"retention": RetentionOptions(keep_every=10), "last_save": LastSaveOptions(in_hf=True)},
                          {"keep_last": 3, "export_dtype": "bf16", "local": "/nvme/run"})
    assert o.retention == RetentionOptions(keep_last=3, keep_every=10)
    assert o.last_save == LastSaveOptions(in_hf=True, export_dtype="bf16")
    assert o.tiers == TierOptions(local="/nvme/run") and o.writes == WriteOptions()


def test_every_flat_keyword_names_a_field_of_its_group():
    assert set(FLAT) == set(FlatOptions.__optional_keys__)
    groups = {f: type(getattr(ManagerOptions(), f)) for f in ("retention", "schedule", "tiers", "writes", "resume", "last_save")}
    for flat, (group, field) in FLAT.items():
        assert field in groups[group].__dataclass_fields__, (flat, group, field)


def test_bad_options_are_refused_where_they_are_given(tmp_path):
    with pytest.raises(TypeError, match="unexpected keyword argument 'keep_lst'"):
        shardckpt.CheckpointManager(str(tmp_path), keep_lst=2)
    with pytest.raises(TypeError, match="takes a RetentionOptions, got ScheduleOptions"):
        shardckpt.CheckpointManager(str(tmp_path), retention=ScheduleOptions())
    with pytest.raises(ValueError, match="keep_last must be a positive int"):
        RetentionOptions(keep_last=0)
    with pytest.raises(ValueError, match="keep_last must be a positive int"):
        shardckpt.CheckpointManager(str(tmp_path), keep_last=0)
    with pytest.raises(ValueError, match="save_interval must be a positive int"):
        shardckpt.CheckpointManager(str(tmp_path), schedule=ScheduleOptions(save_interval=1), save_interval=0)
    with pytest.raises(shardckpt.UsageError):
        WriteOptions(replicas="sometimes")
    with pytest.raises(shardckpt.UsageError, match="initial_load_path"):
        ResumeOptions(initial_load_path=" ")
    with pytest.raises(Exception):
        RetentionOptions().keep_last = 3  # type: ignore[misc]  # frozen
