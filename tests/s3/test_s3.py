"""Object storage end to end: save/load/verify/inspect against a local S3 (moto)."""

from __future__ import annotations

import pytest
import torch
from _dist import run_ranks

import shardckpt
from shardckpt._storage import Storage
from shardckpt.errors import CheckpointExistsError, CheckpointNotFoundError, ChecksumMismatchError, StorageError

pytestmark = pytest.mark.s3


def _state(seed):
    torch.manual_seed(seed)
    return {
        "model": torch.nn.Sequential(torch.nn.Linear(9, 5), torch.nn.LayerNorm(5)),
        "big": torch.randn(300, 17),
        "step": seed,
        "meta": {"name": f"run-{seed}", "pair": (1, 2)},
    }


def _equal(a, b):
    sa, sb = a["model"].state_dict(), b["model"].state_dict()
    return all(torch.equal(sa[k], sb[k]) for k in sa) and torch.equal(a["big"], b["big"]) and a["step"] == b["step"]


def test_save_load_inspect_verify(s3_url):
    url, opts = s3_url
    shardckpt.save(_state(1), url, storage_options=opts)
    live = _state(2)
    shardckpt.load(live, url, storage_options=opts)
    assert _equal(live, _state(1)) and live["meta"] == {"name": "run-1", "pair": (1, 2)}
    m = shardckpt.inspect(url, storage_options=opts)
    assert m.world_size == 1 and m.tensors["big"].shape == [300, 17]
    assert shardckpt.verify(url, storage_options=opts).save_id == m.save_id
    st = Storage(url, storage_options=opts)
    assert set(st.walk_files()) == {"manifest.json", "model.safetensors.index.json"} | set(m.files)


def test_overwrite_and_damage(s3_url):
    url, opts = s3_url
    shardckpt.save(_state(1), url, storage_options=opts)
    with pytest.raises(CheckpointExistsError):
        shardckpt.save(_state(3), url, storage_options=opts)
    old = set(shardckpt.inspect(url, storage_options=opts).files)
    shardckpt.save(_state(3), url, storage_options=opts, overwrite=True)
    m = shardckpt.inspect(url, storage_options=opts)
    st = Storage(url, storage_options=opts)
    data = set(st.walk_files("data"))
    assert data == set(m.files) and not (data & old), "stale files of the replaced checkpoint remain"
    # one flipped bit in the object store is caught by load and verify
    rel = sorted(m.files)[0]
    raw = bytearray(st.read_bytes(rel))
    raw[-3] ^= 0x10
    st.write_atomic(rel, bytes(raw))
    live = _state(4)
    before = {k: v.clone() for k, v in live["model"].state_dict().items()}
    with pytest.raises(ChecksumMismatchError, match=rel):
        shardckpt.load(live, url, storage_options=opts)
    assert all(torch.equal(v, before[k]) for k, v in live["model"].state_dict().items())
    with pytest.raises(ChecksumMismatchError, match="crc32c"):
        shardckpt.verify(url, storage_options=opts)
    st.remove("manifest.json")
    with pytest.raises(CheckpointNotFoundError):
        shardckpt.load(_state(4), url, storage_options=opts)


def _save_2(rank, world, url, opts):
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import Replicate, Shard, distribute_tensor

    mesh = init_device_mesh("cpu", (world,))
    g = torch.Generator().manual_seed(7)
    full = torch.randn(37, 6, generator=g)
    rep = torch.randn(5, generator=g)
    state = {
        "w": distribute_tensor(full, mesh, [Shard(0)]),
        "cols": distribute_tensor(full.t().contiguous(), mesh, [Shard(1)]),
        "r": distribute_tensor(rep, mesh, [Replicate()]),
        "plain": rep * 2,
        "step": 5,
    }
    shardckpt.save(state, url, storage_options=opts)
    return len([f for f in Storage(url, storage_options=opts).walk_files("data") if f.endswith(".safetensors")])


def test_two_rank_save_one_rank_load(s3_url):
    url, opts = s3_url
    counts = run_ranks(2, _save_2, url, opts)
    assert counts[0] == counts[1] == 2  # one file per rank
    g = torch.Generator().manual_seed(7)
    full = torch.randn(37, 6, generator=g)
    rep = torch.randn(5, generator=g)
    live = {"w": torch.zeros(37, 6), "cols": torch.zeros(6, 37), "r": torch.zeros(5), "plain": torch.zeros(5), "step": 0}
    shardckpt.load(live, url, storage_options=opts)
    assert torch.equal(live["w"], full) and torch.equal(live["cols"], full.t())
    assert torch.equal(live["r"], rep) and torch.equal(live["plain"], rep * 2) and live["step"] == 5
    m = shardckpt.verify(url, storage_options=opts)
    assert m.world_size == 2 and len(m.tensors["w"].chunks) == 2 and len(m.tensors["r"].chunks) == 1


def test_missing_backend_hint():
    with pytest.raises(StorageError, match="cannot open 'nosuchfs://bucket/x'.*No fsspec backend handles 'nosuchfs': pip install"):
        shardckpt.save({"x": torch.ones(1)}, "nosuchfs://bucket/x")
