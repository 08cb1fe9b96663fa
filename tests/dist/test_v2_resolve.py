"""Format v2 on real ranks: a loading rank reads only the index files of the ranks that wrote what it needs."""

from __future__ import annotations

import os

import pytest
import torch
from _dist import run_ranks

import shardckpt
from shardckpt import _geometry
from shardckpt._format import MetaCache, open_manifest, resolve_chunks
from shardckpt._storage import Storage

SHAPES = {"fsdp": (37, 6), "grid": (8, 10), "rep": (5, 3), "hsdp": (12, 4)}


def _full(name):
    n = 1
    for s in SHAPES[name]:
        n *= s
    return (torch.arange(n, dtype=torch.float32) * 0.5 - 3).reshape(SHAPES[name])


def _save_4(rank, world, path):
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import Replicate, Shard, distribute_tensor

    flat = init_device_mesh("cpu", (4,))
    grid = init_device_mesh("cpu", (2, 2), mesh_dim_names=("rep", "shard"))
    state = {
        "fsdp": distribute_tensor(_full("fsdp"), flat, [Shard(0)]),
        "grid": distribute_tensor(_full("grid"), grid, [Shard(0), Shard(1)]),
        "rep": _full("rep"),  # plain: replicated over the world, written once
        "hsdp": distribute_tensor(_full("hsdp"), grid, [Replicate(), Shard(0)]),
    }
    shardckpt.save(state, path)
    return True


def _load_n(rank, world, path):
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import Shard, distribute_tensor

    mesh = init_device_mesh("cpu", (world,))
    state = {n: distribute_tensor(torch.zeros(SHAPES[n]), mesh, [Shard(0)]) for n in SHAPES}
    shardckpt.load(state, path)
    return {n: v.full_tensor() for n, v in state.items()}


@pytest.fixture(scope="module")
def saved(tmp_path_factory):
    path = str(tmp_path_factory.mktemp("v2") / "ck")
    run_ranks(4, _save_4, path)
    return path


def test_manifest_has_layout_records_not_chunks(saved):
    m = open_manifest(Storage(saved), chunks=False)
    assert m.version == 5 and m.world_size == 4
    assert all(t.regular is not None and not t.chunks for t in m.tensors.values())
    assert m.tensors["hsdp"].regular["placements"] == ["R", "S(0)"]
    assert sorted(im.rank for im in m.indexes.values()) == [0, 1, 2, 3]
    assert shardckpt.verify(saved).version == 5


@pytest.mark.parametrize("rank", [0, 1, 2, 3])
def test_each_rank_reads_only_the_indexes_it_needs(saved, rank):
    st = Storage(saved)
    m = open_manifest(st, chunks=False)
    cache = MetaCache()
    # Rank `rank` of a load at the save's layout wants its own fsdp rows: written by itself.
    lay = _geometry.regular_layout(SHAPES["fsdp"], (4,), (_geometry.Shard(0),))
    (lb,) = _geometry.local_boxes(lay.shape, lay.mesh_shape, lay.placements, (rank,))
    got = resolve_chunks(m, st, "fsdp", [(lb.box.offsets, lb.box.sizes)], cache=cache)
    assert [(c.offsets, c.sizes) for c in got] == [(lb.box.offsets, lb.box.sizes)]
    assert f"-r{rank:05d}-" in got[0].file
    own_index = next(rel for rel, im in m.indexes.items() if im.rank == rank)
    assert cache.bytes_read == m.indexes[own_index].size  # one index file, its own
    data = open(os.path.join(saved, got[0].file), "rb").read()[got[0].byte_offset : got[0].byte_offset + got[0].nbytes]
    assert torch.equal(torch.frombuffer(bytearray(data), dtype=torch.float32).reshape(lb.box.sizes), _full("fsdp")[lb.box.offsets[0] : lb.box.offsets[0] + lb.box.sizes[0]])


def test_replicated_boxes_are_written_once_and_spread(saved):
    m = shardckpt.inspect(saved)
    assert sum(c.nbytes for t in m.tensors.values() for c in t.chunks) == m.total_bytes
    writers = {int(c.file.split("-r")[1][:5]) for n in ("rep", "hsdp") for c in m.tensors[n].chunks}
    assert len(writers) >= 2, writers


@pytest.mark.parametrize("world", [1, 2, 3])
def test_loads_at_other_world_sizes(saved, world):
    want = {n: _full(n) for n in SHAPES}
    if world == 1:
        state = {n: torch.zeros(SHAPES[n]) for n in SHAPES}
        shardckpt.load(state, saved)
        results = [state]
    else:
        results = run_ranks(world, _load_n, saved)
    for got in results:
        for n in SHAPES:
            assert torch.equal(got[n], want[n]), n
