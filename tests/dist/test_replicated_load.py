"""Read once, then send: replicated bytes leave storage once across all ranks (HSDP 2x2, DDP 4).

Real gloo ranks on CPU, real files. Bytes are counted where they leave
storage (``Storage.read_into``, patched in each worker for data files only).
"""

from __future__ import annotations

import os
import time

import pytest
import torch
from _dist import run_ranks
from _faultkids import finish, join_group, start

import shardckpt
from shardckpt.errors import ChecksumMismatchError, LoadFailedError

ROWS, COLS = 512, 2048  # 4 MiB of fp32, saved in 64 KiB checksum blocks (block rounding stays small)
BLOCK = 64 << 10


def _full(seed=0):
    g = torch.Generator().manual_seed(seed)
    return {
        "w": torch.randn(ROWS, COLS, generator=g),
        "v": torch.randn(ROWS + 3, COLS // 2, generator=g),  # uneven shards
        "b": torch.randn(COLS * 5, generator=g).to(torch.bfloat16),
        "n": torch.arange(7, dtype=torch.int64),
    }


STATE_BYTES = sum(t.numel() * t.element_size() for t in _full().values())


def _save(path):
    from shardckpt import _knobs

    old, _knobs.BLOCK_BYTES = _knobs.BLOCK_BYTES, BLOCK
    try:
        shardckpt.save(_full(), path, no_dist=True)
    finally:
        _knobs.BLOCK_BYTES = old


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


def _live(kind, world):
    """Zeroed live state: HSDP (replicate x shard mesh) or DDP (plain tensors on every rank)."""
    if kind == "ddp":
        return {k: torch.zeros_like(v) for k, v in _full().items()}
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import Replicate, Shard, distribute_tensor

    mesh = init_device_mesh("cpu", (2, world // 2), mesh_dim_names=("replicate", "shard"))
    return {
        k: distribute_tensor(torch.zeros_like(v), mesh, [Replicate(), Shard(0) if v.dim() else Replicate()])
        for k, v in _full().items()
    }


def _whole(t):
    return t.full_tensor() if hasattr(t, "full_tensor") else t


def _load(rank, world, path, kind, read_once, buffer_bytes):
    from shardckpt import _knobs

    _knobs.LOAD_READ_ONCE = read_once
    live = _live(kind, world)
    seen, undo = _count_data_reads()
    try:
        shardckpt.load(live, path, buffer_bytes=buffer_bytes)
    finally:
        undo()
        _knobs.LOAD_READ_ONCE = True
    exact = all(torch.equal(_whole(live[k]), v) for k, v in _full().items())
    return exact, sum(seen)


@pytest.mark.parametrize("kind", ["hsdp", "ddp"])
def test_replicated_bytes_are_read_once_across_ranks(tmp_path, kind):
    path = str(tmp_path / "c")
    _save(path)
    # Small buffers: many rounds, so reads overlap the previous round's sends.
    once = run_ranks(4, _load, path, kind, True, 2 << 20)
    assert all(ok for ok, _ in once), "a tensor differs after the load"
    total = sum(n for _, n in once)
    assert total <= 1.05 * STATE_BYTES, f"{total / STATE_BYTES:.2f}x the state read from storage"
    # Spread over the replicas (a 2 MiB read is the unit here): nobody reads half.
    assert max(n for _, n in once) <= 0.5 * STATE_BYTES, [n for _, n in once]
    # The same load with read-once off reads every replica's bytes.
    each = run_ranks(4, _load, path, kind, False, 2 << 20)
    assert all(ok for ok, _ in each)
    replicas = 4 if kind == "ddp" else 2
    assert sum(n for _, n in each) >= 0.95 * replicas * STATE_BYTES


def _load_expect_error(rank, world, path, kind):
    live = _live(kind, world)
    try:
        shardckpt.load(live, path, buffer_bytes=4 << 20, collective_timeout_s=60)
    except Exception as e:  # noqa: BLE001 - the test compares type and text across ranks
        return type(e).__name__, str(e)
    return None, "loaded"


@pytest.mark.parametrize("kind", ["hsdp", "ddp"])
def test_damaged_block_on_the_reading_rank_fails_every_rank_alike(tmp_path, kind):
    path = str(tmp_path / "c")
    _save(path)
    data = os.path.join(path, "data")
    f = max((os.path.join(data, n) for n in os.listdir(data) if n.endswith(".safetensors")), key=os.path.getsize)
    with open(f, "r+b") as fh:  # a byte in the middle of the first tensor's data
        fh.seek(os.path.getsize(f) // 2)
        b = fh.read(1)
        fh.seek(-1, 1)
        fh.write(bytes([b[0] ^ 0xFF]))
    got = run_ranks(4, _load_expect_error, path, kind)
    assert got[0][0] == ChecksumMismatchError.__name__, got[0]
    assert all(g == got[0] for g in got), got
    assert "checksum mismatch" in got[0][1]


def _dying_rank_child(rank, world, port, path):
    """One rank of its own process group; rank 1 dies between posting two rounds of transfers."""
    from shardckpt import _replicas

    join_group(rank, world, port, 120)
    orig, calls = _replicas.start_ops, []

    def start(ops):
        calls.append(1)
        if rank == 1 and len(calls) == 2:
            os._exit(3)  # SIGKILL-like: no cleanup, sockets closed by the kernel
        return orig(ops)

    _replicas.start_ops = start
    live = _live("hsdp", world)
    t0 = time.monotonic()
    try:
        shardckpt.load(live, path, buffer_bytes=2 << 20, collective_timeout_s=60)
        out = (None, "loaded", time.monotonic() - t0)
    except Exception as e:  # noqa: BLE001 - the parent checks type and time
        out = (type(e).__name__, str(e), time.monotonic() - t0)
    with open(os.path.join(path, f"outcome-{rank}"), "w") as fh:
        fh.write(repr(out))
    # Rank 0 hosts the store: leaving before the others have read the verdict
    # would make them report rank 0 gone instead of the rank that was killed.
    t1 = time.monotonic()
    while time.monotonic() - t1 < 60 and not all(os.path.exists(os.path.join(path, f"outcome-{r}")) for r in (0, 2, 3)):
        time.sleep(0.1)
    os._exit(0)


def test_a_rank_killed_mid_transfer_fails_the_others_within_the_timeout(tmp_path):
    from _dist import free_port

    path = str(tmp_path / "c")
    _save(path)
    port = free_port()
    procs = [start(_dying_rank_child, r, 4, port, path) for r in range(4)]
    try:
        done = [finish(p, 150, f"rank {r} (a surviving rank hung)") for r, p in enumerate(procs)]
    finally:
        for p in procs:
            p.kill()
    assert done[1][0] == 3, done[1]
    assert [rc for rc, _ in done] == [0, 3, 0, 0], done
    for r in (0, 2, 3):
        name, msg, took = eval(open(os.path.join(path, f"outcome-{r}")).read())  # noqa: S307 - our own repr
        assert name == LoadFailedError.__name__, (r, name, msg)
        assert "rank 1" in msg or "ranks [1]" in msg or "[1]" in msg, msg
        assert took < 60, (r, took)
