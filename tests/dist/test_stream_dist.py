"""Streaming loads across processes: bytes read per rank, resharding, damage part-way.

Real gloo ranks on CPU, real files. Bytes are counted where they leave
storage (``Storage.read_into``, patched in each worker for data files only).
"""

from __future__ import annotations

import os

import torch
from _dist import run_ranks
from models import build, full_state, shard_fsdp2

import shardckpt

ROWS, COLS = 512, 4096  # 8 MiB of fp32: 8 blocks of 1 MiB when saved whole


def _full(seed=0):
    g = torch.Generator().manual_seed(seed)
    return {"w": torch.randn(ROWS, COLS, generator=g), "b": torch.randn(ROWS * 8, generator=g)}


def _count_data_reads():
    from shardckpt import _storage

    seen = []
    orig = _storage.Storage.read_into

    def read_into(self, rel, ranges):
        if rel.startswith("data/"):
            seen.append(sum(len(b) for _, b in ranges))
        return orig(self, rel, ranges)

    # A load into CPU tensors maps local files' pieces instead (LOAD_MAP): bytes mapped are bytes read.
    local = type(_storage.Storage("."))
    orig_map = local.map_range

    def map_range(self, rel, start, stop):
        if rel.startswith("data/"):
            seen.append(stop - start)
        return orig_map(self, rel, start, stop)

    # ... or reads its cached pieces with preadv (LOAD_INTO): bytes read from files open_hot opened.
    from shardckpt._storage import _local

    orig_readv = _local.HotFile.readv

    def readv(self, offset, views):
        if "/data/" in self.url:
            seen.append(sum(len(v) for v in views))
        return orig_readv(self, offset, views)

    def undo():
        _storage.Storage.read_into = orig
        local.map_range = orig_map
        _local.HotFile.readv = orig_readv

    _storage.Storage.read_into = read_into
    local.map_range = map_range
    _local.HotFile.readv = readv
    return seen, undo


def _load_sharded(rank, world, path):
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import Shard, distribute_tensor

    mesh = init_device_mesh("cpu", (world,))
    live = {k: distribute_tensor(torch.zeros_like(v), mesh, [Shard(0)]) for k, v in _full().items()}
    seen, undo = _count_data_reads()
    try:
        shardckpt.load(live, path)
    finally:
        undo()
    needed = sum(v.to_local().numel() * 4 for v in live.values())
    ok = all(torch.equal(live[k].full_tensor(), v) for k, v in _full().items())
    return ok, sum(seen), needed


def test_saved_whole_by_one_process_loaded_on_4_ranks_reads_what_each_needs(tmp_path):
    path = str(tmp_path / "c")
    shardckpt.save(_full(), path, no_dist=True)
    assert shardckpt.inspect(path).version >= 2  # block checksums: ranged reads verify alone
    for ok, read, needed in run_ranks(4, _load_sharded, path):
        assert ok
        assert needed == (ROWS * COLS + ROWS * 8) * 4 // 4
        assert read <= 1.1 * needed, f"read {read} bytes for {needed} needed ({read / needed:.2f}x)"


def _save_fsdp(rank, world, path):
    shardckpt.save({"model": shard_fsdp2(build(seed=11)), "step": 3}, path)
    return full_state(build(seed=11)) if rank == 0 else None


def _load_fsdp(rank, world, path, buffer_bytes):
    model = shard_fsdp2(build(seed=12))
    model(torch.tensor([[1, 5, 36, 0]])).sum().backward()  # FSDP2 buffers in use, as in training
    state = {"model": model, "step": -1}
    shardckpt.load(state, path, buffer_bytes=buffer_bytes)
    return full_state(model), state["step"]


def _reshard(tmp_path, save_world, load_world):
    path = str(tmp_path / f"c{save_world}")
    want = run_ranks(save_world, _save_fsdp, path)[0]
    for got, step in run_ranks(load_world, _load_fsdp, path, 1024):  # tiny buffers: many pieces, reuse
        assert step == 3 and got.keys() == want.keys()
        for k in want:
            assert torch.equal(got[k], want[k]), k


def test_fsdp2_2_to_3_bit_exact_through_small_buffers(tmp_path):
    _reshard(tmp_path, 2, 3)


def test_fsdp2_4_to_2_bit_exact_through_small_buffers(tmp_path):
    _reshard(tmp_path, 4, 2)


def _load_damaged(rank, world, path, atomic, read_once=False):
    from shardckpt import _knobs

    # Plain tensors on 2 ranks are replicated: with read-once, each rank reads
    # half and the damaged block may be the first one read (nothing changed
    # yet); without it, each rank reads in file order and fails part-way.
    _knobs.LOAD_READ_ONCE = read_once
    live = {f"t{i}": torch.zeros(256, 64) for i in range(6)}
    try:
        shardckpt.load(live, path, buffer_bytes=64 << 10, io_threads=1, atomic=atomic)
    except shardckpt.CorruptCheckpointError as e:
        return type(e).__name__, str(e), sorted(k for k, v in live.items() if torch.count_nonzero(v))
    finally:
        _knobs.LOAD_READ_ONCE = True
    return None, "", []


def test_damage_part_way_fails_every_rank_and_names_what_changed(tmp_path):
    path = str(tmp_path / "c")
    g = torch.Generator().manual_seed(5)
    shardckpt.save({f"t{i}": torch.randn(256, 64, generator=g) for i in range(6)}, path, no_dist=True)
    c = shardckpt.inspect(path).tensors["t4"].chunks[0]
    f = os.path.join(path, c.file)
    raw = bytearray(open(f, "rb").read())
    raw[c.byte_offset + 10] ^= 0x01
    open(f, "wb").write(bytes(raw))
    for etype, msg, changed in run_ranks(2, _load_damaged, path, False):
        assert etype == "ChecksumMismatchError" and "t4 chunk" in msg, msg
        assert changed, "nothing was overwritten: the test no longer exercises a part-way failure"
        assert "Tensors already overwritten" in msg
        for k in changed:
            assert k in msg, (k, msg)
    for etype, _msg, changed in run_ranks(2, _load_damaged, path, True):
        assert etype == "ChecksumMismatchError" and changed == [], (etype, changed)
    got = run_ranks(2, _load_damaged, path, False, True)
    for etype, msg, changed in got:
        assert etype == "ChecksumMismatchError" and "t4 chunk" in msg, msg
        assert msg == got[0][1]  # one message on every rank
        for k in changed:
            assert k in msg, (k, msg)
