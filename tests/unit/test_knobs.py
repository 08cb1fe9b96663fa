"""Every knob is read at use: assigning ``shardckpt._knobs.X`` in-process changes the next call (docs/knobs.md).

Each case sets one knob on the module (as the benchmarks do, and as
docs/knobs.md promises) after shardckpt was imported, and observes the effect
where the engine uses it. Knobs whose effect needs several ranks or a GPU are
covered where those run (listed in ``ELSEWHERE``); the last test checks that
the list and the cases here cover every knob ``_knobs`` defines.
"""

from __future__ import annotations

import os
import random

import pytest
import torch

import shardckpt
from shardckpt import _collective, _io, _knobs, _load, _readers, _save
from shardckpt._format import open_manifest
from shardckpt._storage import Storage, backoff_delay

#: Knobs observed by other tests (they need ranks, a GPU or an S3 server).
ELSEWHERE = {
    "LIVENESS_TIMEOUT_S": "tests/dist (a killed rank is named after it; read at each wait)",
    "LOAD_READ_ONCE": "tests/dist/test_replicated_load*.py (read at each load)",
    "EXPORT_PLACED": "tests/unit/test_convert_export_io.py (placed and packed exports, the same files; read at each export)",
    "LOAD_DIRECT": "tests/unit/test_cold_read.py (O_DIRECT, WILLNEED and page-cache reads of the same bytes; read at each read)",
    "LOAD_LANES": "tests/unit/test_read_lanes.py (lane sizes from the queue, off with the knob; read at each load)",
    "REGISTER_MIN_BYTES": "CUDA staging only (read at each staging)",
    "ASYNC_WRITER": "tests/unit/test_async_writer_process.py (monkeypatches it)",
    "MEMORY_PEER_BACKEND": "tests/dist/test_memory_save.py (gloo, the CPU group's own); nccl, the GPU default: benchmarks/device/every_step_2gpu.sh, benchmarks/device/p2p_race.py",
    "S3_PART_BYTES": "tests/s3 (PART: multipart paths)",
    "S3_WRITER_INFLIGHT_PARTS": "tests/s3 (read when a writer is made)",
    "S3_READ_PART_BYTES": "tests/s3 (read at each read)",
    "S3_MAX_REQUESTS": "tests/s3 (read when a client is made)",
    "S3_CONNECT_TIMEOUT_S": "tests/s3 (read when a client is made)",
    "S3_STALL_TIMEOUT_S": "tests/s3 (read at each request)",
    "S3_MIN_BYTES_PER_S": "tests/s3 (read at each request)",
}


def _saved(tmp_path, name, state=None):
    path = str(tmp_path / name)
    shardckpt.save(state or {"w": torch.arange(4096, dtype=torch.float32)}, path)
    return path


def test_io_threads_and_min_bytes_per_file(tmp_path, monkeypatch):
    """IO_THREADS and MIN_BYTES_PER_FILE: how many data files one rank's save writes."""
    state = {f"t{i}": torch.ones(16 << 10) for i in range(4)}  # 4 x 64 KiB
    one = open_manifest(_saved(tmp_path, "a", state))
    monkeypatch.setattr(_knobs, "MIN_BYTES_PER_FILE", 64 << 10)
    monkeypatch.setattr(_knobs, "IO_THREADS", 3)
    three = open_manifest(_saved(tmp_path, "b", state))
    data = lambda m: [f for f in m.files if f not in m.indexes]  # noqa: E731
    assert len(data(one)) == 1 and len(data(three)) == 3


def test_write_block_bytes(tmp_path, monkeypatch):
    """WRITE_BLOCK_BYTES: the size of each write (and CRC update) of a chunk."""
    from shardckpt._storage import _local

    sizes = []
    real = _local._LocalWriter.write

    def write(self, data):
        sizes.append(len(memoryview(data).cast("B")))
        return real(self, data)

    monkeypatch.setattr(_local._LocalWriter, "write", write)
    monkeypatch.setattr(_knobs, "WRITE_BLOCK_BYTES", 1024)
    _saved(tmp_path, "a")  # 16 KiB of tensor bytes
    assert max(sizes) <= 1024 and len(sizes) >= 16


def test_block_bytes_and_checksums(tmp_path, monkeypatch):
    """BLOCK_BYTES: the manifest's block size; CHECKSUMS off: CRCs recorded as 0."""
    monkeypatch.setattr(_knobs, "BLOCK_BYTES", 4096)
    m = open_manifest(_saved(tmp_path, "a"))
    assert m.block_bytes == 4096
    monkeypatch.setattr(_knobs, "CHECKSUMS", False)
    m = open_manifest(_saved(tmp_path, "b"))
    assert {c.crc32c for t in m.tensors.values() for c in t.chunks} == {0}


def test_read_side_sizes(monkeypatch):
    """LOAD_BUFFER_BYTES, LOAD_RANGE_BYTES, LOAD_CUDA_*: the defaults of a load's pool, ranges and threads."""
    monkeypatch.setattr(_knobs, "LOAD_BUFFER_BYTES", 3 << 20)
    monkeypatch.setattr(_knobs, "LOAD_RANGE_BYTES", 1 << 20)
    pool = _readers.BufferPool()
    assert (pool.capacity, pool.slot_bytes) == (3 << 20, 1 << 20)
    monkeypatch.setattr(_knobs, "LOAD_CUDA_IO_THREADS", 5)
    monkeypatch.setattr(_knobs, "LOAD_CUDA_BUFFER_BYTES", 7 << 20)
    monkeypatch.setattr(_knobs, "IO_THREADS", 2)
    assert _load.load_settings(True) == (5, 7 << 20)
    assert _load.load_settings(False) == (2, 3 << 20)


def test_read_block_bytes(tmp_path, monkeypatch):
    """READ_BLOCK_BYTES: a load's reads are split into blocks of at most this size (of at least one checksum block)."""
    # Pieces that go straight into a CPU tensor are cut at checksum-block ends (each is verified alone).
    monkeypatch.setattr(_knobs, "BLOCK_BYTES", 4096)
    path = _saved(tmp_path, "a", {"w": torch.arange(64 << 10, dtype=torch.int32) % 251})
    st_type = type(Storage(path))
    sizes = []
    real = st_type.read_into

    def read_into(self, rel, ranges):
        sizes.extend(len(b) for _, b in ranges)
        return real(self, rel, ranges)

    def map_range(self, rel, start, stop):  # a load into CPU tensors maps its pieces (LOAD_MAP)
        sizes.append(stop - start)
        return real_map(self, rel, start, stop)

    def open_hot(self, rel, start, stop):  # cached pieces are read straight into the tensor (LOAD_INTO)
        f = real_hot(self, rel, start, stop)
        if f is not None:
            sizes.append(stop - start)
        return f

    real_map, real_hot = st_type.map_range, st_type.open_hot
    monkeypatch.setattr(st_type, "read_into", read_into)
    monkeypatch.setattr(st_type, "map_range", map_range)
    monkeypatch.setattr(st_type, "open_hot", open_hot)
    monkeypatch.setattr(_knobs, "READ_BLOCK_BYTES", 8 << 10)
    out = {"w": torch.zeros(64 << 10, dtype=torch.int32)}
    shardckpt.load(out, path)
    assert torch.equal(out["w"], torch.arange(64 << 10, dtype=torch.int32) % 251)
    data = [n for n in sizes if n > 4096]  # the tensor's blocks (headers and indexes are small)
    assert data and max(data) <= 8 << 10, sizes


def test_coalesce_gap_bytes(monkeypatch):
    """COALESCE_GAP_BYTES: the gap worth reading on high-latency storage (none locally)."""
    monkeypatch.setattr(_knobs, "COALESCE_GAP_BYTES", 12345)
    remote = type("Remote", (), {"caps": type("Caps", (), {"high_latency": True})()})()
    assert _readers.coalesce_gap(remote) == 12345
    assert _readers.coalesce_gap(Storage(os.getcwd())) == 0


def test_header_bytes_per_file(monkeypatch):
    """HEADER_BYTES_PER_FILE: planned files are cut so their headers stay below it."""
    from types import SimpleNamespace

    entries = [SimpleNamespace(key=f"t{i}", name=f"t{i}", dtype="F32", sizes=[1], offsets=[0]) for i in range(200)]
    monkeypatch.setattr(_io, "entry_header_bytes", lambda *a: 100)
    assert len(_io.split_files_by_header({"f": entries})) == 1
    monkeypatch.setattr(_knobs, "HEADER_BYTES_PER_FILE", 4096)
    assert len(_io.split_files_by_header({"f": entries})) > 1


def test_collective_timeout(monkeypatch):
    """COLLECTIVE_TIMEOUT_S: the bound of a call's exchanges when the call passes none."""
    monkeypatch.setattr(_knobs, "COLLECTIVE_TIMEOUT_S", 42.0)
    assert _collective.open_comm(no_dist=True).timeout_s == 42.0
    assert _collective.Comm().timeout_s == 42.0
    assert _collective.open_comm(no_dist=True, collective_timeout_s=3).timeout_s == 3.0  # arguments win
    mgr = shardckpt.CheckpointManager(os.getcwd() + "/never-written")
    assert mgr._comm("x").timeout_s == 42.0


def test_storage_retries_and_backoff(tmp_path, monkeypatch):
    """STORAGE_RETRIES: a Storage's attempts; RETRY_*_DELAY_S: the back-off ceilings."""
    monkeypatch.setattr(_knobs, "STORAGE_RETRIES", 2)
    assert Storage(str(tmp_path)).retries == 2 and Storage("memory://k").retries == 2
    assert Storage(str(tmp_path), retries=7).retries == 7
    monkeypatch.setattr(_knobs, "RETRY_BASE_DELAY_S", 0.001)
    monkeypatch.setattr(_knobs, "RETRY_MAX_DELAY_S", 0.002)
    rng = random.Random(0)
    assert max(backoff_delay(10, rng=rng) for _ in range(100)) <= 0.002
    assert max(backoff_delay(0, rng=rng) for _ in range(100)) <= 0.001


def test_replicas_read_at_each_save(monkeypatch):
    from shardckpt import _fingerprint

    assert _fingerprint.replicas_mode(None) == "warn"
    monkeypatch.setattr(_knobs, "REPLICAS", "off")
    assert _fingerprint.replicas_mode(None) == "off"
    assert _fingerprint.replicas_mode("check") == "check"  # the argument wins over the knob


def test_save_defaults_are_not_frozen_at_import():
    """No public signature holds a knob's value copied at import (the defaults are None, read at the call)."""
    import inspect

    from shardckpt import converters

    calls = [shardckpt.save, shardckpt.async_save, shardckpt.load, _save.write_rank, _io.write_files, _readers.read_verified]
    calls += [converters.to_full, converters.to_safetensors, converters.reshard, converters.from_safetensors]
    calls += [converters.from_dcp, converters.from_torch_save]
    for fn in calls:
        for p in inspect.signature(fn).parameters.values():
            if p.name in ("io_threads", "threads", "collective_timeout_s"):
                assert p.default is None, (fn.__qualname__, p.name, p.default)


def test_load_map(tmp_path, monkeypatch):
    """LOAD_MAP: a CPU load maps local files' pieces (on) or reads them into buffers (off); the same values."""
    from shardckpt._storage import _local

    d = str(tmp_path / "c")
    src = {"w": torch.randn(300, 1000), "b": torch.randn(7)}
    shardckpt.save(src, d)
    maps = []
    real = _local.LocalStorage.map_range
    monkeypatch.setattr(_local.LocalStorage, "map_range", lambda self, *a: maps.append(a) or real(self, *a))
    monkeypatch.setattr(_knobs, "LOAD_INTO", False)  # cached pieces are mapped too (LOAD_INTO: its own test)
    monkeypatch.setattr(_knobs, "LOAD_LANES", "map")  # a lane's pieces too (LOAD_LANES: test_read_lanes.py)
    for on in (True, False):
        monkeypatch.setattr(_knobs, "LOAD_MAP", on)
        maps.clear()
        live = {k: torch.zeros_like(v) for k, v in src.items()}
        shardckpt.load(live, d)
        assert all(torch.equal(live[k], src[k]) for k in src)
        assert bool(maps) == on, (on, maps)


@pytest.fixture
def shm_ckpt():
    """``(dir, state)``: a small checkpoint in a private directory of /dev/shm (tmpfs), removed after."""
    import shutil
    import tempfile

    from shardckpt._storage import _local

    if not os.path.isdir("/dev/shm") or _local.fs_type(os.stat("/dev/shm").st_dev) not in _local.MEMORY_FILESYSTEMS:
        pytest.skip("no tmpfs at /dev/shm")
    root = tempfile.mkdtemp(prefix="shardckpt-knob-", dir="/dev/shm")
    os.chmod(root, 0o700)
    try:
        src = {"w": torch.randn(300, 1000), "b": torch.randn(7).to(torch.bfloat16)}
        shardckpt.save(src, root + "/c")
        yield root + "/c", src
    finally:
        shutil.rmtree(root, ignore_errors=True)


def _loads_back(d, src):
    live = {k: torch.zeros_like(v) for k, v in src.items()}
    shardckpt.load(live, d)
    assert all(torch.equal(live[k], src[k]) for k in src)


def test_load_into(monkeypatch, shm_ckpt):
    """LOAD_INTO: pieces of tmpfs files are read straight into the CPU tensors (on) or mapped (off); the same values."""
    from shardckpt._storage import _local

    d, src = shm_ckpt
    hot, maps = [], []
    real_hot, real_map = _local.LocalStorage.open_hot, _local.LocalStorage.map_range

    def open_hot(self, *a):
        f = real_hot(self, *a)
        if f is not None:
            hot.append(a)
        return f

    monkeypatch.setattr(_local.LocalStorage, "open_hot", open_hot)
    monkeypatch.setattr(_local.LocalStorage, "map_range", lambda self, *a: maps.append(a) or real_map(self, *a))
    for on in (True, False):
        monkeypatch.setattr(_knobs, "LOAD_INTO", on)
        hot.clear()
        maps.clear()
        _loads_back(d, src)
        assert (bool(hot), bool(maps)) == (on, not on), (on, hot, maps)


def test_load_fused(monkeypatch, shm_ckpt):
    """LOAD_FUSED: mapped pieces for live tensors go through the one-pass kernel (on) or the CRC then the copy (off); the same values."""
    from shardckpt import _readers
    from shardckpt._format.checksum import COPY_FUSED

    if not COPY_FUSED:
        pytest.skip("the one-pass kernel is not built here")
    d, src = shm_ckpt
    calls = []
    real = _readers.copy_crc32c
    monkeypatch.setattr(_readers, "copy_crc32c", lambda *a: calls.append(len(a[1])) or real(*a))
    nbytes = sum(v.numel() * v.element_size() for v in src.values())
    # Mapped pieces take the kernel; a tmpfs piece read into the scratch (LOAD_INTO=1) never does.
    for into, on, want in ((False, True, nbytes), (False, False, 0), (True, True, 0)):
        monkeypatch.setattr(_knobs, "LOAD_INTO", into)
        monkeypatch.setattr(_knobs, "LOAD_FUSED", on)
        calls.clear()
        _loads_back(d, src)
        assert sum(calls) == want, (into, on, sum(calls), want)


def test_load_stream_copy(monkeypatch, shm_ckpt):
    """LOAD_STREAM_COPY: a reader's copies into CPU tensors bypass the cache (the kernel) or go through NumPy; the same values."""
    import importlib

    checksum = importlib.import_module("shardckpt._format.checksum")
    d, src = shm_ckpt
    calls = []
    real, real_check = checksum._STREAM, checksum._CHECK
    if real is None or real_check is None:
        pytest.skip("the streaming-copy kernel is not built here")

    def check(src_, lo, units, outs, step, streaming):  # the check-then-copy kernel: its copies stream or not
        calls.append((streaming, sum(len(dst) for _, dst in outs)))
        return real_check(src_, lo, units, outs, step, streaming)

    monkeypatch.setattr(checksum, "_STREAM", lambda dst, s: calls.append((True, len(s))) or real(dst, s))
    monkeypatch.setattr(checksum, "_CHECK", check)
    monkeypatch.setattr(_knobs, "LOAD_INTO", True)  # tmpfs pieces through the scratch, copied out by the readers
    nbytes = sum(v.numel() * v.element_size() for v in src.values())
    for on in (True, False):
        monkeypatch.setattr(_knobs, "LOAD_STREAM_COPY", on)
        calls.clear()
        _loads_back(d, src)
        assert sum(n for _, n in calls) == nbytes and {s for s, _ in calls} == {on}, (on, calls, nbytes)


def test_every_knob_is_covered():
    knobs = {n for n in _knobs.__all__ if n.isupper() and n != "ENV_PREFIX"}
    here = {
        "IO_THREADS", "MIN_BYTES_PER_FILE", "WRITE_BLOCK_BYTES", "BLOCK_BYTES", "CHECKSUMS", "LOAD_BUFFER_BYTES",
        "LOAD_RANGE_BYTES", "LOAD_CUDA_IO_THREADS", "LOAD_CUDA_BUFFER_BYTES", "READ_BLOCK_BYTES", "COALESCE_GAP_BYTES",
        "HEADER_BYTES_PER_FILE", "COLLECTIVE_TIMEOUT_S", "STORAGE_RETRIES", "RETRY_BASE_DELAY_S", "RETRY_MAX_DELAY_S",
        "REPLICAS", "LOAD_MAP", "LOAD_INTO", "LOAD_CPU_IO_THREADS", "LOAD_FUSED", "LOAD_STREAM_COPY",
    }
    assert knobs == here | set(ELSEWHERE), (knobs - here - set(ELSEWHERE), (here | set(ELSEWHERE)) - knobs)
