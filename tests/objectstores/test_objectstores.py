"""GCS (gcsfs) and Azure Blob (adlfs) by the generic fsspec path, against emulator servers on loopback.

Same user flow as tests/s3: save on 2 ranks, load on 1, verify, inspect,
a damaged object caught, overwrite; through ``gs://`` / ``az://`` URLs and
``storage_options`` only.
"""

from __future__ import annotations

import pytest
import torch
from _dist import run_ranks

import shardckpt
from shardckpt._storage import Storage
from shardckpt.errors import CheckpointExistsError, ChecksumMismatchError


@pytest.fixture(params=["gcs", "azure"])
def store_url(request):
    """A fresh checkpoint URL and storage options on each emulated object store."""
    request.applymarker(getattr(pytest.mark, request.param))
    return request.getfixturevalue(f"{request.param}_url")


def _save_2(rank, world, url, opts):
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import Replicate, Shard, distribute_tensor

    mesh = init_device_mesh("cpu", (world,))
    g = torch.Generator().manual_seed(11)
    full = torch.randn(41, 6, generator=g)
    rep = torch.randn(5, generator=g)
    state = {
        "w": distribute_tensor(full, mesh, [Shard(0)]),
        "cols": distribute_tensor(full.t().contiguous(), mesh, [Shard(1)]),
        "r": distribute_tensor(rep, mesh, [Replicate()]),
        "plain": rep * 2,
        "step": 9,
    }
    shardckpt.save(state, url, storage_options=opts)
    return sorted(f for f in Storage(url, storage_options=opts).walk_files("data") if f.endswith(".safetensors"))


def test_two_rank_save_one_rank_load_verify_inspect(store_url):
    url, opts = store_url
    files = run_ranks(2, _save_2, url, opts)
    assert files[0] == files[1] and len(files[0]) == 2  # one file per rank, both seen by both ranks
    g = torch.Generator().manual_seed(11)
    full = torch.randn(41, 6, generator=g)
    rep = torch.randn(5, generator=g)
    live = {"w": torch.zeros(41, 6), "cols": torch.zeros(6, 41), "r": torch.zeros(5), "plain": torch.zeros(5), "step": 0}
    shardckpt.load(live, url, storage_options=opts)
    assert torch.equal(live["w"], full) and torch.equal(live["cols"], full.t())
    assert torch.equal(live["r"], rep) and torch.equal(live["plain"], rep * 2) and live["step"] == 9
    m = shardckpt.verify(url, storage_options=opts)
    assert m.world_size == 2 and len(m.tensors["w"].chunks) == 2 and len(m.tensors["r"].chunks) == 1
    info = shardckpt.inspect(url, storage_options=opts)
    assert info.save_id == m.save_id and info.tensors["cols"].shape == [6, 41]
    assert sorted(f for f in info.files if f.endswith(".safetensors")) == files[0]


def test_damage_caught_and_overwrite(store_url):
    url, opts = store_url
    torch.manual_seed(0)
    first = {"a": torch.randn(64, 33), "b": torch.arange(100)}
    shardckpt.save(first, url, storage_options=opts)
    with pytest.raises(CheckpointExistsError):
        shardckpt.save(first, url, storage_options=opts)
    st = Storage(url, storage_options=opts)
    rel = sorted(shardckpt.inspect(url, storage_options=opts).files)[0]
    raw = bytearray(st.read_bytes(rel))
    raw[-5] ^= 0x01
    st.write_atomic(rel, bytes(raw))
    live = {"a": torch.zeros(64, 33), "b": torch.zeros(100, dtype=torch.int64)}
    with pytest.raises(ChecksumMismatchError, match=rel):
        shardckpt.load(live, url, storage_options=opts)
    assert not live["a"].any() and not live["b"].any(), "a failed load left the model half-loaded"
    with pytest.raises(ChecksumMismatchError):
        shardckpt.verify(url, storage_options=opts)
    second = {"a": torch.randn(64, 33), "b": torch.arange(100) * 3}
    shardckpt.save(second, url, storage_options=opts, overwrite=True)
    shardckpt.load(live, url, storage_options=opts)
    assert torch.equal(live["a"], second["a"]) and torch.equal(live["b"], second["b"])
    assert set(st.walk_files("data")) == set(shardckpt.inspect(url, storage_options=opts).files)
