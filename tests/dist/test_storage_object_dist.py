"""A Storage object where a URL goes, and a backend registered by scheme, on 2 gloo ranks (docs/extending.md)."""

from __future__ import annotations

import torch
from _dirstore import PREFIX, DirStorage, register
from _dist import run_ranks

import shardckpt


def _save_load(rank, world, root):
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import Shard, distribute_tensor

    mesh = init_device_mesh("cpu", (world,))
    full = torch.arange(32.0).reshape(8, 4)
    out = {}
    # 1. Each rank passes its own object (no registration): sharded rows, a value.
    st = DirStorage(f"{PREFIX}{root}/obj")
    before = DirStorage.calls.copy()
    shardckpt.save({"w": distribute_tensor(full, mesh, [Shard(0)]), "step": 3}, st)
    out["writers"] = (DirStorage.calls - before)["_open_writer"]
    live = {"w": distribute_tensor(torch.zeros(8, 4), mesh, [Shard(0)]), "step": 0}
    shardckpt.load(live, st)
    out["obj"] = (live["w"].full_tensor().tolist(), live["step"])
    # 2. Registered on every rank: the URL alone; loaded at another layout (replicated).
    register()
    url = f"{PREFIX}{root}/url"
    shardckpt.save({"w": distribute_tensor(full, mesh, [Shard(1)])}, url)
    live = {"w": torch.zeros(8, 4)}
    shardckpt.load(live, url)
    out["url"] = live["w"].tolist()
    out["world_size"] = shardckpt.inspect(url).world_size
    return out


def test_a_storage_object_and_a_registered_scheme_on_two_ranks(tmp_path):
    full = torch.arange(32.0).reshape(8, 4).tolist()
    results = run_ranks(2, _save_load, str(tmp_path))
    for rank, out in enumerate(results):
        assert out["writers"] >= 1, (rank, out["writers"])  # every rank wrote its shard through its own object
        assert out["obj"] == (full, 3), rank
        assert out["url"] == full, rank
        assert out["world_size"] == 2
    assert (tmp_path / "obj" / "manifest.json").is_file() and (tmp_path / "url" / "manifest.json").is_file()
