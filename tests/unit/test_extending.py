"""The public extension points (docs/extending.md): backends by URL scheme, Storage objects where URLs go, shard rules and context types.

A backend written on the public API alone (tests/_dirstore.py) saves, loads,
inspects and verifies checkpoints through ``dir2://`` URLs and as an object;
duplicate registrations are refused naming the one already there.
"""

from __future__ import annotations

import os

import pytest
import torch
from _dirstore import PREFIX, DirStorage, register

import shardckpt
from shardckpt.errors import UsageError


def _state():
    return {"model": {"w": torch.arange(12.0).reshape(3, 4), "b": torch.ones(5, dtype=torch.bfloat16)}, "step": 7}


def _zeros():
    return {"model": {"w": torch.zeros(3, 4), "b": torch.zeros(5, dtype=torch.bfloat16)}, "step": 0}


def test_a_registered_backend_serves_its_urls_for_save_load_inspect_verify(tmp_path):
    register()
    register()  # the same class again: a no-op
    url = PREFIX + str(tmp_path / "run" / "step-7")
    assert type(shardckpt.Storage(url)) is DirStorage
    before = DirStorage.calls.copy()
    shardckpt.save(_state(), url, no_dist=True)
    wrote = DirStorage.calls - before
    assert wrote["_open_writer"] >= 2 and wrote["_put"] >= 1, wrote  # data files and the manifest went through it
    assert os.path.isfile(tmp_path / "run" / "step-7" / "manifest.json")

    m = shardckpt.inspect(url)
    assert m.tensors["model.w"].shape == [3, 4] and m.world_size == 1
    before = DirStorage.calls.copy()
    shardckpt.verify(url)
    assert (DirStorage.calls - before)["_read_ranges"] >= 1
    live = _zeros()
    shardckpt.load(live, url, no_dist=True)
    assert torch.equal(live["model"]["w"], _state()["model"]["w"]) and live["step"] == 7
    assert torch.equal(live["model"]["b"], torch.ones(5, dtype=torch.bfloat16))
    assert shardckpt.read(url, keys=["step"]) == {"step": 7}

    # Damage found through the backend too: verify reads every byte it holds.
    data = sorted((tmp_path / "run" / "step-7" / "data").iterdir())[0]
    raw = bytearray(data.read_bytes())
    raw[-1] ^= 0xFF
    data.write_bytes(bytes(raw))
    with pytest.raises(shardckpt.CorruptCheckpointError):
        shardckpt.verify(url)


def test_an_async_save_through_a_user_backend_writes_in_this_process(tmp_path, monkeypatch):
    # A writer child (SHARDCKPT_ASYNC_WRITER=process) would open the URL without the registration:
    # the save must stay in this process.
    from shardckpt import _knobs

    monkeypatch.setattr(_knobs, "ASYNC_WRITER", "process")
    register()
    url = PREFIX + str(tmp_path / "a")
    before = DirStorage.calls.copy()
    shardckpt.async_save(_state(), url, no_dist=True).result()
    assert (DirStorage.calls - before)["_open_writer"] >= 2
    live = _zeros()
    shardckpt.load(live, url, no_dist=True)
    assert live["step"] == 7 and torch.equal(live["model"]["w"], _state()["model"]["w"])


def test_a_storage_object_goes_where_a_url_goes(tmp_path):
    # No registration needed: the object is used as it is (as DCP takes a StorageWriter).
    st = DirStorage(PREFIX + str(tmp_path / "obj"))
    shardckpt.save(_state(), st, no_dist=True)
    assert os.path.isfile(tmp_path / "obj" / "manifest.json")
    assert shardckpt.inspect(st).tensors["model.b"].dtype == "BF16"
    shardckpt.verify(st)
    live = _zeros()
    shardckpt.load(live, st, no_dist=True)
    assert live["step"] == 7 and torch.equal(live["model"]["w"], _state()["model"]["w"])
    # A local Storage built by the factory works the same.
    local = shardckpt.Storage(str(tmp_path / "plain"))
    shardckpt.save(_state(), local, no_dist=True)
    assert shardckpt.read(local, keys=["step"]) == {"step": 7}
    # The object holds its options: options beside it are refused, not silently dropped.
    with pytest.raises(UsageError, match="already holds its options"):
        shardckpt.save(_state(), DirStorage(PREFIX + str(tmp_path / "o2")), storage_options={"anon": True}, no_dist=True)
    assert not (tmp_path / "o2").exists()


def test_duplicate_backend_registrations_are_refused_naming_the_existing_one():
    register()

    class Other(DirStorage):
        pass

    with pytest.raises(UsageError, match=r"dir2:// is already served by _dirstore\.DirStorage; pass override=True"):
        shardckpt.register_backend("dir2", Other)
    with pytest.raises(UsageError, match=r"s3:// is already served by shardckpt\._storage\._s3\.S3Storage"):
        shardckpt.register_backend("s3", Other)
    with pytest.raises(UsageError, match="URL scheme"):
        shardckpt.register_backend("dir2://", Other)
    with pytest.raises(UsageError, match="subclass of shardckpt.Storage"):
        shardckpt.register_backend("dir3", object)  # type: ignore[arg-type]
    shardckpt.register_backend("dir2", Other, override=True)
    try:
        assert type(shardckpt.Storage(PREFIX + "/x")) is Other
    finally:
        shardckpt.register_backend("dir2", DirStorage, override=True)
    assert type(shardckpt.Storage(PREFIX + "/x")) is DirStorage


def test_shard_rules_and_context_types_are_public_and_refuse_duplicates():
    name = "tests.unit.test_extending.Blockwise"
    rule = shardckpt.ShardRule(flat=frozenset({"scale"}))
    shardckpt.register_shard_rule(name, rule)
    shardckpt.register_shard_rule(name, shardckpt.ShardRule(flat=frozenset({"scale"})))  # an equal rule: a no-op
    with pytest.raises(UsageError, match=r"already has the rule ShardRule\(flat=frozenset\(\{'scale'\}\)"):
        shardckpt.register_shard_rule(name, shardckpt.ShardRule(replicated=frozenset({"qmap"})))
    # shardckpt's own rules are protected the same way.
    with pytest.raises(UsageError, match="OptimState8bit already has the rule"):
        shardckpt.register_shard_rule("torchao.optim.subclass_8bit.OptimState8bit", rule)
    with pytest.raises(UsageError, match="must be a shardckpt.ShardRule"):
        shardckpt.register_shard_rule(name, {"flat": ["scale"]})  # type: ignore[arg-type]
    shardckpt.register_shard_rule(name, shardckpt.ShardRule(replicated=frozenset({"qmap"})), override=True)

    ctx = "tests.unit.test_extending.Wrapper"
    shardckpt.register_ctx_types(ctx, ["my.Config"])
    shardckpt.register_ctx_types(ctx, ("my.Config",))  # the same set: a no-op
    with pytest.raises(UsageError, match=r"already has the context types \['my.Config'\]"):
        shardckpt.register_ctx_types(ctx, ["my.Other"])
    shardckpt.register_ctx_types(ctx, ["my.Config", "my.Other"], override=True)


def test_only_shardckpts_own_backends_go_to_a_writer_child(tmp_path):
    # A writer child builds its storage from the URL alone: shardckpt's backends (fsspec's included) only.
    from shardckpt._storage import rebuildable

    register()
    assert rebuildable(shardckpt.Storage(str(tmp_path))) and rebuildable(shardckpt.Storage("memory://x"))
    assert not rebuildable(shardckpt.Storage(PREFIX + str(tmp_path)))
    assert not rebuildable(DirStorage(PREFIX + str(tmp_path)))
