"""The flusher's pure decisions (shardckpt/_flush.py) with ints, and local='s argument checks."""

from __future__ import annotations

import pytest

import shardckpt
from shardckpt._flush import (
    assign_orphans,
    commit_save_id,
    files_of_rank,
    local_protected,
    next_flush,
    orphan_refs,
    restore_source,
)
from shardckpt.errors import CorruptCheckpointError, UsageError


def test_next_flush_takes_the_newest_pending_once():
    assert next_flush(None, None) is None
    assert next_flush(3, None) == 3
    assert next_flush(9, 5) == 9
    assert next_flush(5, 5) is None  # flushed already (a late submission on another rank)
    assert next_flush(4, 5) is None


def test_local_protected_is_in_flight_and_pending_only():
    assert local_protected(None, None) == []
    assert local_protected(5, None) == [5]
    assert local_protected(None, 7) == [7]
    assert local_protected(5, 9) == [5, 9]
    assert local_protected(5, 5) == [5]


@pytest.mark.parametrize(
    "local, readable, remote, want",
    [
        (9, True, 7, ("local", 9)),
        (7, True, 7, ("local", 7)),  # a tie: the local disk is faster
        (9, False, 7, ("remote", 7)),  # some rank cannot read the local step
        (5, True, 7, ("remote", 7)),  # the remote is newer (another node went on)
        (None, False, 7, ("remote", 7)),  # a new node
        (4, True, None, ("local", 4)),
        (4, False, None, ("none", None)),
        (None, False, None, ("none", None)),
    ],
)
def test_restore_source(local, readable, remote, want):
    assert restore_source(local, readable, remote) == want


def test_commit_save_id_refuses_a_mix_of_saves():
    assert commit_save_id(["a1", "a1", "a1"], 3) == "a1"
    with pytest.raises(shardckpt.errors.CorruptCheckpointError, match="saved again while it was flushed"):
        commit_save_id(["a1", "b2"], 3)


def test_files_of_rank_sends_each_reference_with_the_rank_that_wrote_it():
    files = ["data/ab-r00000-00.safetensors", "data/ab-r00001-00.safetensors", "data/ab-index-r1.json",
             "@step-00000002/data/cd-r00001-00.safetensors", "@step-00000001/data/ef-r00000-00.safetensors"]
    ranks = {"data/ab-index-r1.json": 1}
    assert files_of_rank(files, ranks, 0) == ["@step-00000001/data/ef-r00000-00.safetensors", "data/ab-r00000-00.safetensors"]
    assert files_of_rank(files, ranks, 1) == ["@step-00000002/data/cd-r00001-00.safetensors", "data/ab-index-r1.json",
                                              "data/ab-r00001-00.safetensors"]


def test_local_argument_checks(tmp_path):
    with pytest.raises(UsageError, match="remote root itself"):
        shardckpt.CheckpointManager(str(tmp_path / "r"), local=str(tmp_path / "r"))
    with pytest.raises(UsageError, match="directory path"):
        shardckpt.CheckpointManager(str(tmp_path / "r"), local="  ")
    with pytest.raises(ValueError, match="keep_local"):
        shardckpt.CheckpointManager(str(tmp_path / "r"), local=str(tmp_path / "l"), keep_local=0)


def test_one_process_flushes_and_restores_from_a_new_node(tmp_path):
    import torch

    model = torch.nn.Linear(3, 2)
    remote, local = str(tmp_path / "remote"), str(tmp_path / "local")
    seen = []
    with shardckpt.CheckpointManager(remote, local=local, keep_last=2, on_durable=seen.append) as mgr:
        for step in range(1, 5):
            mgr.save(step, {"model": model, "step": step})
            # Each flush done before the next save: no step is coalesced away and local retention finds
            # nothing in flight, so both sides are exact (test_a_slow_flush_... covers the backlog).
            mgr.wait()
        assert mgr.durable_step == 4 and seen == [1, 2, 3, 4]
        assert mgr.steps() == [3, 4] and mgr.remote_steps() == [3, 4]
        assert mgr.remote_url == shardckpt._storage.Storage(remote).url
    for s in (3, 4):
        shardckpt.verify(f"{remote}/step-{s:08d}")
    want = {k: v.clone() for k, v in model.state_dict().items()}
    with torch.no_grad():
        model.weight.zero_()
    import shutil

    shutil.rmtree(local)
    with shardckpt.CheckpointManager(remote, local=local) as mgr:
        assert mgr.restore({"model": model, "step": 0}) == 4
        assert mgr.restored_from == f"{mgr.remote_url}/step-00000004"
        assert mgr.restore({"model": model, "step": 0}, step=3) == 3  # only on the remote
        assert mgr.restored_from == f"{mgr.remote_url}/step-00000003"
        with pytest.raises(shardckpt.errors.CheckpointNotFoundError, match="step 2 is not committed"):
            mgr.restore({"model": model, "step": 0}, step=2)
        mgr.save(5, {"model": model, "step": 5})
        assert mgr.restore({"model": model, "step": 0}, step=5) == 5  # local
        assert mgr.restored_from == f"{mgr.root_url}/step-00000005"
        mgr.restore({"model": model, "step": 0}, step=4)
    assert all(torch.equal(v, want[k]) for k, v in model.state_dict().items())


def test_a_slow_flush_coalesces_the_backlog_and_protects_its_steps(tmp_path, monkeypatch):
    """Step 1's upload hangs: saves go on; 2 is skipped (3 supersedes it), 1 and 3 stay local until flushed."""
    import threading

    import torch

    import shardckpt._flush as flush

    release, started = threading.Event(), threading.Event()
    copy = flush._copy

    def slow_copy(src, dst, rel, src_rel, size, **kw):
        if "step-00000001" in dst.url:
            started.set()
            assert release.wait(60)
        copy(src, dst, rel, src_rel, size, **kw)

    monkeypatch.setattr(flush, "_copy", slow_copy)
    model = torch.nn.Linear(3, 2)
    remote = str(tmp_path / "remote")
    mgr = shardckpt.CheckpointManager(remote, local=str(tmp_path / "local"), keep_local=1)
    try:
        mgr.save(1, {"model": model})
        assert started.wait(60)
        for step in (2, 3):
            mgr.save(step, {"model": model})
        assert mgr._tiers.flusher.protected() == [1, 3]
        assert mgr.steps() == [1, 3]  # keep_local=1 plus the step in flight; the skipped step 2 is gone
        assert mgr.durable_step is None and mgr.remote_steps() == []
        release.set()
        mgr.wait()
        assert mgr.remote_steps() == [1, 3] and mgr.durable_step == 3
        assert mgr._tiers.flusher.skipped == [2]
        mgr.save(4, {"model": model})
        mgr.wait()
        assert mgr.steps() == [4]  # everything flushed: keep_local only
    finally:
        release.set()
        mgr.close()


def test_a_rank_that_cannot_see_the_manifest_is_told_why(tmp_path):
    from shardckpt._flush import upload_step
    from shardckpt._storage import Storage
    from shardckpt.errors import CheckpointNotFoundError

    (tmp_path / "step" / "data").mkdir(parents=True)  # a node-local directory: data files, no manifest
    with pytest.raises(CheckpointNotFoundError, match="rank 1 cannot see .*per node and the commit's copy"):
        upload_step(Storage(str(tmp_path / "step")), Storage(str(tmp_path / "remote")), 1)


def test_a_step_of_another_world_size_is_never_uploaded(tmp_path):
    import torch

    from shardckpt._flush import check_world
    from shardckpt._storage import Storage
    from shardckpt.errors import CorruptCheckpointError

    shardckpt.save({"w": torch.arange(4.0)}, str(tmp_path / "step"))  # one writer
    check_world(Storage(str(tmp_path / "step")), 1)
    with pytest.raises(CorruptCheckpointError, match="saved by 1 ranks, this job has 2: .*not flushed"):
        check_world(Storage(str(tmp_path / "step")), 2)


def test_node_groups_tell_shared_from_per_node():
    from shardckpt._flush import node_groups

    assert node_groups([[0, 1, 2, 3]] * 4) == (True, [0, 0, 0, 0])
    assert node_groups([[0, 1], [0, 1], [2, 3], [2, 3]]) == (False, [0, 0, 2, 2])
    assert node_groups([[0], [1]]) == (False, [0, 1])  # one directory per rank: one node each


def test_one_process_incremental_flush_uploads_the_skipped_base_and_retention_keeps_it(tmp_path, monkeypatch):
    """Steps 2-4 are skipped (step 1's upload is held), step 5 references 4 and 1: the remote gets their files, no manifest."""
    import threading

    import torch

    import shardckpt._flush as flush
    from shardckpt._format import open_manifest
    from shardckpt._storage import Storage

    release, started = threading.Event(), threading.Event()
    real = flush.upload_step

    def held(src, dst, rank, **kw):
        if dst.url.endswith("step-00000001"):
            started.set()
            assert release.wait(60)
        return real(src, dst, rank, **kw)

    monkeypatch.setattr(flush, "upload_step", held)
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(8, 8), torch.nn.Linear(8, 8))
    remote, local = str(tmp_path / "remote"), str(tmp_path / "local")
    mgr = shardckpt.CheckpointManager(remote, local=local, incremental=True, keep_last=1, keep_local=1)
    try:
        mgr.save(1, {"model": model})
        assert started.wait(60)
        with torch.no_grad():
            model[1].weight.add_(1.0)  # changes once: rewritten until its hash is known (step 4), then referenced
        for step in (2, 3, 4, 5):
            mgr.save(step, {"model": model})
        release.set()
        mgr.wait()
        assert mgr._tiers.flusher.skipped == [2, 3, 4] and mgr.remote_steps() == [5]
    finally:
        release.set()
        mgr.close()
    root = Storage(remote)
    live = {rel for rel in open_manifest(root.child("step-00000005")).files if rel.startswith("@")}
    refs = {rel.split("/", 1)[0][1:] for rel in live}
    # The frozen layer's bytes are step 1's; the changed one's a skipped step's (4, with today's hashing order).
    assert "step-00000001" in refs and refs & {"step-00000002", "step-00000003", "step-00000004"}, refs
    # Step 1 was dropped (keep_last=1) and step 4 never committed there: only their referenced files are.
    for d in refs:
        assert not root.exists(f"{d}/manifest.json")
        have = {f"@{d}/{rel}" for rel in root.child(d).walk_files("")}
        assert have and have <= live, (d, have, live)
    shardckpt.verify(f"{remote}/step-00000005")
    want = {k: v.clone() for k, v in model.state_dict().items()}
    fresh = torch.nn.Sequential(torch.nn.Linear(8, 8), torch.nn.Linear(8, 8))
    shardckpt.load({"model": fresh}, f"{remote}/step-00000005")
    assert all(torch.equal(v, want[k]) for k, v in fresh.state_dict().items())


def test_the_hugging_face_export_of_the_last_save_is_flushed_too(tmp_path):
    import torch

    from shardckpt._storage import Storage

    torch.manual_seed(0)
    model = torch.nn.Linear(4, 3)
    remote, local = str(tmp_path / "remote"), str(tmp_path / "local")
    with shardckpt.CheckpointManager(remote, local=local, last_save_in_hf=True) as mgr:
        mgr.save(1, {"model": model})
        mgr.save(2, {"model": model}, last_step=True)
        mgr.wait()
        assert mgr.remote_steps()[-1] == 2
    here, there = Storage(f"{local}/step-00000002-hf"), Storage(f"{remote}/step-00000002-hf")
    files = here.walk_files("")
    assert any(f.endswith(".safetensors") for f in files)
    assert sorted(there.walk_files("")) == sorted(files)
    assert all(there.read_bytes(f) == here.read_bytes(f) for f in files)
    fresh = torch.nn.Linear(4, 3)
    shardckpt.load({"model": fresh}, f"{remote}/step-00000002-hf", strict=False)
    assert torch.equal(fresh.weight, model.weight) and torch.equal(fresh.bias, model.bias)


def test_the_flush_copies_nothing_while_this_rank_saves(tmp_path, monkeypatch):
    """Step 1's flush is parked before its first piece; step 2's save is held open: no piece moves until it returns."""
    import threading
    import time

    import torch

    import shardckpt._flush as flush

    monkeypatch.setattr(flush, "COPY_PIECE_BYTES", 1024)
    parked, go = threading.Event(), threading.Event()
    pieces = []
    copy = flush._copy

    def counting_copy(src, dst, rel, src_rel, size, *, pause=None):
        if pause is None:  # the commit's small copies (the Hugging Face index): not the flush's data
            return copy(src, dst, rel, src_rel, size)

        def counted():
            if not go.is_set():
                parked.set()
                assert go.wait(60)
            pause()  # the flusher's own: waits while a save of this rank runs
            pieces.append(time.monotonic())

        copy(src, dst, rel, src_rel, size, pause=counted)

    monkeypatch.setattr(flush, "_copy", counting_copy)
    model = torch.nn.Linear(64, 64)  # 16 KiB of weights: 16 pieces
    mgr = shardckpt.CheckpointManager(str(tmp_path / "remote"), local=str(tmp_path / "local"))
    try:
        mgr.save(1, {"model": model})
        assert parked.wait(60)
        inside, release, saved_at = threading.Event(), threading.Event(), []
        real = mgr._save

        def held_save(*a, **k):
            inside.set()
            assert release.wait(60)
            out = real(*a, **k)
            saved_at.append(time.monotonic())
            return out

        mgr._save = held_save
        saver = threading.Thread(target=mgr.save, args=(2, {"model": model}))
        saver.start()
        assert inside.wait(60)
        go.set()  # the flush may go on now, but for the save in progress
        time.sleep(1.0)  # without the yield, pieces would be copied here
        assert pieces == []
        release.set()
        saver.join(60)
        mgr.wait()
        assert pieces and min(pieces) > saved_at[0]
        assert mgr.durable_step == 2 and mgr.remote_steps() == [1, 2]
    finally:
        go.set()
        mgr.close()


def test_a_dead_restores_staging_directories_go_at_that_ranks_next_restore(tmp_path):
    """Only this rank's, only directories: its hard links go, the step's files stay; a symlink is left alone."""
    import os

    from shardckpt._flush import STAGE_PREFIX, remove_stale_stages

    step = tmp_path / "step-00000003"
    step.mkdir()
    (step / "data.safetensors").write_bytes(b"x" * 10)
    mine = tmp_path / f"{STAGE_PREFIX}abc-r1"
    mine.mkdir()
    os.link(step / "data.safetensors", mine / "data.safetensors")
    other = tmp_path / f"{STAGE_PREFIX}def-r2"  # rank 2's: maybe in use
    other.mkdir()
    elsewhere = tmp_path / "elsewhere"
    elsewhere.mkdir()
    (elsewhere / "keep").write_bytes(b"k")
    os.symlink(elsewhere, tmp_path / f"{STAGE_PREFIX}ghi-r1")
    assert remove_stale_stages(str(tmp_path), 1) == [f"{STAGE_PREFIX}abc-r1"]
    assert not mine.exists() and other.is_dir() and (elsewhere / "keep").exists()
    assert (step / "data.safetensors").read_bytes() == b"x" * 10
    assert remove_stale_stages(str(tmp_path), 1) == []


def test_orphan_references_are_those_of_ranks_beyond_the_world():
    files = ["@step-00000001/data/ab-r00003-00.safetensors", "@step-00000001/data/ab-r00001-00.safetensors",
             "data/cd-r00000-00.safetensors", "data/cd-index-r00000.json", "@step-00000001/data/ab-r00000-00.safetensors"]
    assert orphan_refs(files, {"data/cd-index-r00000.json": 0}, 2) == ["@step-00000001/data/ab-r00003-00.safetensors"]
    assert orphan_refs(files, {}, 1) == ["@step-00000001/data/ab-r00001-00.safetensors",
                                         "@step-00000001/data/ab-r00003-00.safetensors"]
    assert orphan_refs(files, {}, 4) == []


def test_orphans_go_to_ranks_that_hold_them_or_the_flush_is_refused():
    refs = ["@s/a", "@s/b", "@s/c", "@s/d"]
    assert assign_orphans(refs, [refs, refs], 3) == {0: ["@s/a", "@s/c"], 1: ["@s/b", "@s/d"]}  # spread
    assert assign_orphans(refs, [[], refs], 3) == {1: refs}  # per-node disks: only rank 1's node has them
    assert assign_orphans([], [[], []], 3) == {}
    with pytest.raises(CorruptCheckpointError, match=r"step 3 .*@s/c.*not flushed"):
        assign_orphans(refs, [["@s/a"], ["@s/b", "@s/d"]], 3)
