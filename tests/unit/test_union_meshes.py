"""A rank's share of the save's first exchange holds each mesh once (issue 29, item 6), for sub-meshes too.

DTensors on the ``dp`` sub-mesh of a ``dp x tp`` mesh (the ranks of one
``dp`` row are strided: 0, 8, 16, ...; the copies of the sub-mesh are the
other ``tp`` columns): rank 0's and rank 1's records, made by the save's
own code on torch's fake process group, and rank 0's decision over both.
"""

from __future__ import annotations

import pickle

import pytest
import torch
import torch.distributed as dist

from shardckpt import _union
from shardckpt._collective import Group
from shardckpt._save import _layouts, _rotations

TP = 8
N_TENSORS = 100


def _records(world: int, rank: int):
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import DTensor, Shard
    from torch.testing._internal.distributed.fake_pg import FakeStore

    assert not dist.is_initialized()
    dist.init_process_group("fake", store=FakeStore(), rank=rank, world_size=world)
    try:
        mesh = init_device_mesh("cpu", (world // TP, TP), mesh_dim_names=("dp", "tp"))
        dp = mesh["dp"]
        size = -(-64 // (world // TP))  # Shard(0) of 64 rows over world/TP ranks (torch.chunk's split)
        rows = max(0, min(size, 64 - dp.get_local_rank() * size))
        tensors = {
            f"w{i:03d}": DTensor.from_local(torch.zeros(rows, 4), dp, [Shard(0)], run_check=False, shape=(64, 4), stride=(4, 1))
            for i in range(N_TENSORS)
        }
        layouts = _union.normalize(_layouts(tensors, rank, world), tuple(range(world)))
        return _union.records(layouts, _rotations(layouts))
    finally:
        dist.destroy_process_group()


@pytest.mark.parametrize("world", [64, 16384])
def test_sub_mesh_records_hold_each_mesh_once_and_decide_finds_the_copies(world):
    r0, r1 = _records(world, 0), _records(world, 1)
    one_mesh = len(pickle.dumps(tuple(range(1, world, TP))))
    small = len(pickle.dumps(_records(64, 1)))
    # Each mesh once: what 16,384 ranks add is that one longer tuple, not 100 of them.
    assert len(pickle.dumps(r1)) <= small + one_mesh + 2048, (len(pickle.dumps(r1)), small, one_mesh)
    # rank 1's dp row is strided (1, 9, 17, ...): a rank tuple, shared by its 100 records
    assert r1["w000"][3] == tuple(range(1, world, TP)) and r1["w000"][3] is r1["w099"][3]
    assert r0["w000"][3] == ("iota", 0, world // TP) or r0["w000"][3] == tuple(range(0, world, TP))

    keep: dict = {}
    _, pieces = _union.decide([Group(ranks=(0,), value=(r0, {})), Group(ranks=(1,), value=(r1, {}))], tuple(range(world)), "t://", keep)
    dtype, shape, place, mesh, reg, rot = keep["truth"]["w000"]
    # Both copies held (rows sorted), rank 0's copy first: the mesh is their ranks in that order.
    assert mesh == tuple(range(0, world, TP)) + tuple(range(1, world, TP))
    assert reg.mesh_shape == (2, world // TP) and shape == (64, 4)
    # Each group is told its row among the copies.
    rows = {gi: {p["fix"]["w000"][3] for p in [pieces[gi]] if p} for gi in (0, 1)}
    assert rows == {0: {0}, 1: {1}}, rows
