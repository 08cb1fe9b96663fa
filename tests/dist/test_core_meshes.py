"""DTensors on 1-D and 2-D meshes (and FSDP2 + TP) saved on 4 ranks, loaded on 1, 2, 3 ranks.

One 4-rank save covers every placement; each load world uses other
placements than the save, and everything must come back bit-exactly
(compared with ``full_tensor()`` of what was saved).
"""

from __future__ import annotations

import os
import re

import pytest
import torch

import shardckpt
from _dist import run_ranks

# name -> (global shape, placements on the 1-D or 2-D save mesh)
SHAPES = {
    "s0": (37, 5),
    "s1": (6, 11),
    "rep": (9, 3),
    "tiny": (2, 3),  # dim 0 smaller than the world: two ranks hold zero rows
    "narrow": (4, 3),  # Shard(1) of 3 columns over 4 ranks
    "rs": (7, 10),
    "ss": (9, 7),
    "ss00": (13, 2),
    "r2": (5,),
    "r3": (6,),
}


def _full(name, shape):
    g = torch.Generator().manual_seed(sum(map(ord, name)))
    return torch.randn(shape, generator=g)


def _tp_model(seed=0):
    torch.manual_seed(seed)
    return torch.nn.Sequential(torch.nn.Linear(8, 37), torch.nn.ReLU(), torch.nn.Linear(37, 8))


def _state_4(mesh1, mesh2):
    from torch.distributed.tensor import Replicate as R
    from torch.distributed.tensor import Shard as S
    from torch.distributed.tensor import distribute_tensor

    placements = {
        "s0": (mesh1, [S(0)]),
        "s1": (mesh1, [S(1)]),
        "rep": (mesh1, [R()]),
        "tiny": (mesh1, [S(0)]),
        "narrow": (mesh1, [S(1)]),
        "rs": (mesh2, [R(), S(1)]),
        "ss": (mesh2, [S(0), S(1)]),
        "ss00": (mesh2, [S(0), S(0)]),
        "r2": (mesh1, [R()]),
        "r3": (mesh1, [R()]),
    }
    out = {n: distribute_tensor(_full(n, SHAPES[n]), m, p) for n, (m, p) in placements.items()}
    return out


def _save_4(rank, world, path, overwrite=False):
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard
    from torch.distributed.tensor.parallel import ColwiseParallel, RowwiseParallel, parallelize_module
    from torch.distributed.tensor.placement_types import _StridedShard

    mesh1 = init_device_mesh("cpu", (4,))
    mesh2 = init_device_mesh("cpu", (2, 2), mesh_dim_names=("dp", "tp"))
    model = _tp_model(seed=1)
    parallelize_module(model, mesh2["tp"], {"0": ColwiseParallel(), "2": RowwiseParallel()})
    fully_shard(model, mesh=mesh2["dp"])
    pl = {k: tuple(v.placements) for k, v in model.state_dict().items()}
    # the layouts DESIGN.md describes, so this test really covers them
    assert isinstance(pl["0.weight"][0], _StridedShard) and pl["0.weight"][0].dim == 0
    assert pl["2.weight"][0].dim == 0 and pl["2.weight"][1].dim == 1
    tensors = _state_4(mesh1, mesh2)
    plain = _full("plain", (3, 4))  # identical on every rank, as with DDP
    state = {"t": tensors, "model": model, "plain": plain, "step": 4}
    shardckpt.save(state, path, overwrite=overwrite)
    full = {f"t.{k}": v.full_tensor() for k, v in tensors.items()}
    full.update({f"model.{k}": v.full_tensor() for k, v in model.state_dict().items()})
    full["plain"] = plain
    local_shapes = {k: tuple(v._local_tensor.shape) for k, v in model.state_dict().items()}
    return full, {k: [_placement_desc(p) for p in v] for k, v in pl.items()}, local_shapes


def _placement_desc(p):
    sf = p._split_factor_int() if hasattr(p, "_split_factor_int") else getattr(p, "split_factor", None)
    return (type(p).__name__, getattr(p, "dim", None), sf)


def _load_n(rank, world, path):
    """Load with other placements than the save used, on this world size."""
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard
    from torch.distributed.tensor import Replicate as R
    from torch.distributed.tensor import Shard as S
    from torch.distributed.tensor import distribute_tensor

    mesh = init_device_mesh("cpu", (world,))
    swap = {"s0": [S(1)], "s1": [S(0)], "rep": [S(0)], "tiny": [S(1)], "narrow": [S(0)], "rs": [S(0)], "ss": [R()], "ss00": [S(1)], "r2": [S(0)], "r3": [R()]}
    tensors = {n: distribute_tensor(torch.zeros(SHAPES[n]), mesh, swap[n]) for n in SHAPES}
    # FSDP + TP saved, plain FSDP2 on a different world size loaded
    model = _tp_model(seed=2)
    fully_shard(model, mesh=mesh)
    params = [(p, p._local_tensor.data_ptr()) for p in model.parameters()]
    state = {"t": tensors, "model": model, "plain": torch.zeros(3, 4), "step": 0}
    shardckpt.load(state, path)
    # same Parameter objects, same local storage (never swapped)
    assert all(a is b and a._local_tensor.data_ptr() == ptr for a, (b, ptr) in zip(model.parameters(), params))
    full = {f"t.{k}": v.full_tensor() for k, v in tensors.items()}
    full.update({f"model.{k}": v.full_tensor() for k, v in model.state_dict().items()})
    full["plain"] = state["plain"]
    return full, state["step"]


@pytest.fixture(scope="module")
def saved4(tmp_path_factory):
    path = str(tmp_path_factory.mktemp("meshes") / "ck")
    # A whole (HF-style) checkpoint is there first; the sharded save replaces it.
    shardckpt.save({"old": torch.ones(3)}, path)
    assert os.path.exists(os.path.join(path, "model.safetensors.index.json"))
    full, placements, local_shapes = run_ranks(4, _save_4, path, True)[0]
    return path, full, placements, local_shapes


def _assert_bit_exact(want, got):
    assert want.keys() == got.keys()
    bad = [k for k in want if not (want[k].dtype == got[k].dtype and torch.equal(want[k], got[k]))]
    assert not bad, f"not bit-exact: {bad}"


def test_design_layouts_seen(saved4):
    _, _, pl, local_shapes = saved4
    assert pl["0.weight"] == [("_StridedShard", 0, 2), ("Shard", 0, None)]
    assert pl["2.weight"] == [("Shard", 0, None), ("Shard", 1, None)]
    assert local_shapes["0.weight"] in {(10, 8), (9, 8)}
    m = shardckpt.inspect(saved4[0])
    assert m.tensors["model.0.weight"].layout["placements"] == ["S(0,sf=2)", "S(0)"]
    assert m.tensors["model.0.weight"].layout["mesh_dim_names"] == ["dp", "tp"]
    # 37 rows: TP 19 + 18, then FSDP 10 + 9 and 9 + 9
    rows = sorted((c.offsets[0], c.sizes[0]) for c in m.tensors["model.0.weight"].chunks)
    assert rows == [(0, 10), (10, 9), (19, 9), (28, 9)]


def test_replicated_data_written_once_and_balanced(saved4):
    path = saved4[0]
    m = shardckpt.verify(path)
    assert m.world_size == 4
    # No chunk twice: stored bytes equal the tensors' bytes exactly.
    assert sum(c.nbytes for t in m.tensors.values() for c in t.chunks) == m.total_bytes
    on_disk = sum(os.path.getsize(os.path.join(path, rel)) for rel in m.files)
    # the replaced whole checkpoint left nothing behind: no old data, no HF index naming it
    assert sorted(os.listdir(path)) == ["data", "manifest.json"]
    assert sorted(os.listdir(os.path.join(path, "data"))) == sorted(rel.split("/", 1)[1] for rel in m.files)
    assert m.total_bytes < on_disk < m.total_bytes + 4096 * len(m.files)
    for name in ("t.rep", "t.r2", "t.r3", "plain"):
        assert len(m.tensors[name].chunks) == 1, name
    assert len(m.tensors["t.rs"].chunks) == 2  # (Replicate, Shard(1)) on 2x2: two distinct boxes
    # Every rank writes, and the replicated boxes are spread over their replicas.
    written = {}
    writer_of = {}
    for name, t in m.tensors.items():
        for c in t.chunks:
            r = int(re.search(r"-r(\d{5})-", c.file).group(1))
            written[r] = written.get(r, 0) + c.nbytes
            writer_of.setdefault(name, set()).add(r)
    assert sorted(written) == [0, 1, 2, 3]
    replicated = set().union(*(writer_of[n] for n in ("t.rep", "t.r2", "t.r3", "plain")))
    assert len(replicated) >= 3, f"replicated tensors all written by ranks {replicated}"
    assert max(written.values()) <= 2 * min(written.values()), written


def test_load_on_one_process(saved4):
    path, full = saved4[0], saved4[1]
    tensors = {n: torch.zeros(SHAPES[n]) for n in SHAPES}
    model = _tp_model(seed=3)
    state = {"t": tensors, "model": model, "plain": torch.zeros(3, 4), "step": 0}
    shardckpt.load(state, path)
    got = {f"t.{k}": v for k, v in tensors.items()}
    got.update({f"model.{k}": v for k, v in model.state_dict().items()})
    got["plain"] = state["plain"]
    _assert_bit_exact(full, got)
    assert state["step"] == 4


@pytest.mark.parametrize("world", [2, 3])
def test_load_on_other_world_sizes(saved4, world):
    path, full = saved4[0], saved4[1]
    results = run_ranks(world, _load_n, path)
    for got, step in results:
        _assert_bit_exact(full, got)
        assert step == 4
