"""``shardckpt.read``: whole CPU tensors and values without a live state; ``plan_load``'s plan knows its files and chunks."""

from __future__ import annotations

import os

import pytest
import torch

import shardckpt
from shardckpt import _load
from shardckpt._collective import open_comm
from shardckpt._format import open_manifest
from shardckpt._format.refs import follow
from shardckpt._storage import Storage
from shardckpt.errors import ChecksumMismatchError, CorruptCheckpointError, StateMismatchError


def _saved(tmp_path):
    state = {
        "model": {"w": torch.arange(24.0).reshape(4, 6), "b": torch.arange(4, dtype=torch.int64)},
        "train": {"step": 12, "cfg": (1, "x"), "dt": torch.bfloat16},
    }
    path = str(tmp_path / "ckpt")
    shardckpt.save(state, path, no_dist=True)
    return path, state


def test_read_returns_whole_tensors_and_values(tmp_path):
    path, state = _saved(tmp_path)
    got = shardckpt.read(path, keys=["model.w", "train.step", "train.cfg"])
    assert sorted(got) == ["model.w", "train.cfg", "train.step"]
    assert type(got["model.w"]) is torch.Tensor and got["model.w"].device.type == "cpu"
    assert torch.equal(got["model.w"], state["model"]["w"])
    assert got["train.step"] == 12 and got["train.cfg"] == (1, "x")
    whole = shardckpt.read(path)  # default: the top-level entries
    assert sorted(whole) == ["model", "train"]
    assert torch.equal(whole["model"]["b"], state["model"]["b"]) and whole["train"]["dt"] is torch.bfloat16


def test_load_none_is_read(tmp_path):
    path, _ = _saved(tmp_path)
    for keys in (["model.*"], ["train.step"], None):
        a, b = shardckpt.read(path, keys=keys), shardckpt.load(None, path, keys=keys)
        c = shardckpt.load({}, path, keys=keys)
        assert list(a) == list(b) == list(c)
        for k in a:
            if isinstance(a[k], dict):
                assert a[k].keys() == b[k].keys() == c[k].keys()


def test_read_refuses_a_key_matching_nothing_and_damage(tmp_path):
    path, _ = _saved(tmp_path)
    with pytest.raises(StateMismatchError, match="nope"):
        shardckpt.read(path, keys=["nope"])
    data = [os.path.join(r, f) for r, _, fs in os.walk(path) for f in fs if f.endswith(".safetensors")]
    with open(data[0], "r+b") as f:
        f.seek(-1, os.SEEK_END)
        last = f.read(1)
        f.seek(-1, os.SEEK_END)
        f.write(bytes([last[0] ^ 0xFF]))
    with pytest.raises(ChecksumMismatchError):
        shardckpt.read(path, keys=["model.*"])


def test_plan_knows_its_files_and_chunks(tmp_path):
    path, state = _saved(tmp_path)
    storage = follow(Storage(path))
    live = {"model": {"w": torch.zeros(4, 6), "b": torch.zeros(4, dtype=torch.int64)}}
    plan = _load.plan_load(live, storage, rank=0, world=1, strict=False)
    m = open_manifest(storage)
    assert plan.files == {rel: m.files[rel].size for rel in m.data_files}
    assert sorted(t.name for t in plan.targets) == ["model.b", "model.w"]
    keys = [(c.file, c.byte_offset) for c in plan.chunks]
    assert len(keys) == len(set(keys)) == sum(len(t.chunks) for t in plan.targets)
    # Planning changed nothing; the one load streams the plan's bytes in.
    assert not live["model"]["w"].any()
    comm = open_comm(None, no_dist=True, op="test")
    _load.load_into(live, storage, comm=comm, process_group=None, strict=False)
    assert torch.equal(live["model"]["w"], state["model"]["w"])


def test_a_stream_hook_gets_the_plan_it_streams(tmp_path):
    path, state = _saved(tmp_path)
    storage = follow(Storage(path))
    seen = []

    def hook(plan, run):
        seen.append(plan)
        return run()

    live = {"model": {"w": torch.zeros(4, 6), "b": torch.zeros(4, dtype=torch.int64)}}
    comm = open_comm(None, no_dist=True, op="test")
    _load.load_into(live, storage, comm=comm, process_group=None, strict=False, stream=hook)
    assert len(seen) == 1 and isinstance(seen[0], _load.LoadPlan)
    assert torch.equal(live["model"]["b"], state["model"]["b"])


def _resign_values(d, edit):
    import json

    from shardckpt._format.checksum import crc32c
    from shardckpt._format.manifest import MANIFEST_CRC_FIELD, canonical_json

    path = os.path.join(d, "manifest.json")
    raw = json.loads(open(path, "rb").read())
    edit(raw)
    raw.pop(MANIFEST_CRC_FIELD, None)
    raw[MANIFEST_CRC_FIELD] = crc32c(canonical_json(raw))
    with open(path, "wb") as f:
        f.write(canonical_json(raw))


def test_read_checks_the_files_hold_a_claimed_shape_before_allocating_it(tmp_path):
    from _damage import claim_shape

    d = str(tmp_path / "ck")
    shardckpt.save({"model": {"w": torch.ones(2, 3), "b": torch.ones(2)}, "step": 1}, d)
    claim_shape(d, "model.w", [2**34, 2])  # 128 GiB of F32 over a file of a few hundred bytes
    # Was: RuntimeError: DefaultCPUAllocator: can't allocate memory (load and plan_load refused it).
    for call in (lambda: shardckpt.read(d), lambda: shardckpt.load(None, d), lambda: shardckpt.read(d, keys="model.w")):
        with pytest.raises(CorruptCheckpointError, match=r"truncated: \d+ bytes, manifest says \d+"):
            call()
    assert shardckpt.read(d, keys=["step"]) == {"step": 1}  # what does not touch the claim still reads


def test_read_refuses_a_reference_to_a_tensor_the_checkpoint_lacks(tmp_path):
    d = str(tmp_path / "ck")
    shardckpt.save({"model": {"w": torch.ones(2, 3)}, "step": 1}, d)
    _resign_values(d, lambda raw: raw["values"]["model"].update(ghost={"__shardckpt__": "tensor", "name": "model.ghost"}))
    # Was: {"model": {"w": ..., "ghost": None}}.
    with pytest.raises(CorruptCheckpointError, match="reference tensors the checkpoint lacks: model.ghost"):
        shardckpt.read(d)
    with pytest.raises(CorruptCheckpointError, match="model.ghost"):
        shardckpt.read(d, keys="model")
