"""Lanes (issue 43, wave 12): a load's reads of a block-device file go in in-order stretches, one thread and one descriptor each.

``LocalStorage.lane_bytes`` decides from the device's queue (sysfs
``read_ahead_kb``); the reader then hands each mapped range, or each run of
neighbouring buffered ranges, to one thread that reads it in file order
through one kept descriptor (``Storage.open_lane``). Which thread and which
descriptor served each read is observed by wrapping the storage's own
methods, never by time. The lanes are forced on (``lane_bytes`` patched)
where the test directory may not be on a block device (tmpfs /tmp on some
CI machines); the same values, and the same errors, come back either way.
"""

from __future__ import annotations

import os
import threading

import pytest
import torch

import shardckpt
from shardckpt import _knobs, _readers
from shardckpt._storage import LocalStorage, _local
from shardckpt.errors import ChecksumMismatchError

MIB = 1 << 20


def _state():
    g = torch.Generator().manual_seed(7)
    out = {f"w{i}": torch.randn(3 * MIB // 4 + 1000 * i, generator=g) for i in range(12)}  # ~3 MiB each, 36 MiB
    out["b"] = torch.randn(9, generator=g)
    return out


def test_lane_bytes_follow_the_device_readahead_window(tmp_path, monkeypatch):
    st = LocalStorage(str(tmp_path))
    (tmp_path / "f").write_bytes(b"x")
    windows = {None: 0, 8192: 32 * MIB, 128: _local.LANE_MIN_BYTES, 65536: _local.LANE_MAX_BYTES}
    for kb, want in windows.items():
        q = {} if kb is None else {"device": "vdx", "read_ahead_kb": kb}
        monkeypatch.setattr(_local, "queue_info", lambda path, q=q: q)
        assert st.lane_bytes("f") == want, (kb, want)
        monkeypatch.setattr(_knobs, "LOAD_LANES", "0")
        assert st.lane_bytes("f") == 0  # the knob turns them off whatever the device
        monkeypatch.setattr(_knobs, "LOAD_LANES", "map")
        assert st.lane_bytes("f") == want
        for on in ("read", "all"):
            monkeypatch.setattr(_knobs, "LOAD_LANES", on)
            assert st.lane_bytes("f") == want
    monkeypatch.undo()
    if os.path.isdir("/dev/shm") and _local.fs_type(os.stat("/dev/shm").st_dev) in _local.MEMORY_FILESYSTEMS:
        # A memory filesystem has no queue: no lanes (its reads are copies, no readahead).
        assert LocalStorage("/dev/shm").lane_bytes("") == 0


def _record(monkeypatch, name):
    """Wrap ``LocalStorage.<name>``: (thread, file, first byte, end, the lane's descriptor or -1, the lane) per read."""
    log = []
    real = getattr(LocalStorage, name)
    lock = threading.Lock()

    def wrapped(self, rel, *a):
        if name in ("map_range", "open_hot"):
            spans = [(a[0], a[1])]
        else:
            spans = [(off, off + len(buf)) for off, buf in a[0]]
        fd = _local._lane_fd(self, rel)
        lane = getattr(_local._tls, "lane", None)  # kept alive by the log: identities stay distinct
        got = real(self, rel, *a)
        if name == "open_hot" and got is None:
            return got  # (a mapping follows, not recorded)
        with lock:
            log.extend((threading.get_ident(), rel, lo, hi, fd, lane) for lo, hi in spans)
        return got

    monkeypatch.setattr(LocalStorage, name, wrapped)
    return log


def _lanes_of(log):
    """The reads of each lane, in the order read; and whether each lane's reads all came from one thread."""
    lanes, threads = {}, {}
    for t, _rel, lo, hi, _fd, lane in log:
        lanes.setdefault(id(lane), []).append((lo, hi))
        threads.setdefault(id(lane), set()).add(t)
    return list(lanes.values()), all(len(v) == 1 for v in threads.values())


def _saved_for(tmp_path, monkeypatch, how):
    """A saved :func:`_state` and the knobs of ``how``: ``read`` (LOAD_LANES=read), ``mapped`` (map), ``buffered`` (LOAD_MAP=0, all)."""
    src = _state()
    d = str(tmp_path / "c")
    shardckpt.save(src, d)
    mapped = how != "buffered"
    monkeypatch.setattr(_knobs, "LOAD_MAP", mapped)
    monkeypatch.setattr(_knobs, "LOAD_LANES", {"read": "read", "mapped": "map", "buffered": "all"}[how])
    monkeypatch.setattr(_knobs, "LOAD_DIRECT", "0")
    monkeypatch.setattr(_knobs, "LOAD_INTO", True)  # 4 MiB pieces with lanes and without, on any number of cores
    # Small buffers: several ranges (mapped: 8 MiB each, in 4 MiB pieces; buffered: 4 ranges of 8 MiB share a lane of 32 MiB).
    monkeypatch.setattr(_knobs, "LOAD_BUFFER_BYTES", (8 if mapped else 128) * MIB)
    return src, d, mapped


def _with_and_without_lanes(monkeypatch, src, d, log):
    """``{True: the reads logged with lanes of 32 MiB, False: without lanes}``, each load checked bit-exact."""
    results = {}
    for on in (True, False):
        monkeypatch.setattr(LocalStorage, "lane_bytes", lambda self, rel, on=on: 32 * MIB if on else 0)
        log.clear()
        live = {k: torch.zeros_like(v) for k, v in src.items()}
        shardckpt.load(live, d, io_threads=4)
        assert all(torch.equal(live[k], src[k]) for k in src)
        results[on] = list(log)
    return results


@pytest.mark.parametrize("how", ["read", "mapped", "buffered"])
def test_each_lane_is_read_in_order_by_one_thread_through_one_descriptor(tmp_path, monkeypatch, how):
    """``read``: CPU pieces read into the tensors (LOAD_LANES=read); ``mapped``: LOAD_LANES=map; ``buffered``: LOAD_MAP=0, LOAD_LANES=all (the default)."""
    src, d, mapped = _saved_for(tmp_path, monkeypatch, how)
    log = _record(monkeypatch, {"read": "open_hot", "mapped": "map_range", "buffered": "_read_ranges"}[how])
    results = _with_and_without_lanes(monkeypatch, src, d, log)
    lanes, spread = results[True], results[False]
    assert lanes and all(r[4] >= 0 for r in lanes), "with lanes, every read uses the lane's kept descriptor"
    assert all(r[4] == -1 for r in spread), "without lanes, every read opens the file itself"
    # Every read of a lane follows the previous one in the file, in the lane's one thread.
    grouped, one_thread = _lanes_of(lanes)
    assert one_thread
    for spans in grouped:
        assert all(b[0] == a[1] for a, b in zip(spans, spans[1:])), spans
    spans = sorted(s for g in grouped for s in g)
    assert all(a[1] <= b[0] for a, b in zip(spans, spans[1:])), "no byte read twice"
    assert sum(b - a for a, b in spans) == sum(t.numel() * t.element_size() for t in src.values())  # every tensor byte once
    if how != "read":
        assert spans == sorted((r[2], r[3]) for r in spread)  # the same pieces as without lanes
    # Lanes hold several reads: 2 pieces of a mapped range, up to 4 buffered ranges.
    assert max(len(g) for g in grouped) >= (2 if mapped else 3), [len(g) for g in grouped]
    if how == "buffered":  # map and read leave buffered ranges (CUDA loads') as they were
        monkeypatch.setattr(_knobs, "LOAD_LANES", "map")
        monkeypatch.setattr(LocalStorage, "lane_bytes", lambda self, rel: 32 * MIB)
        log.clear()
        live = {k: torch.zeros_like(v) for k, v in src.items()}
        shardckpt.load(live, d, io_threads=4)
        assert all(torch.equal(live[k], src[k]) for k in src)
        assert log and all(r[4] == -1 for r in log)
    if how == "read":  # without lanes, disk files' pieces are mapped (only tmpfs is read into the tensors)
        assert not spread or _local.fs_type(os.stat(d).st_dev) in _local.MEMORY_FILESYSTEMS


@pytest.mark.parametrize("how", ["read", "mapped", "buffered"])
def test_damage_inside_a_lane_is_named_and_never_delivered(tmp_path, monkeypatch, how):
    src, d, mapped = _saved_for(tmp_path, monkeypatch, how)
    monkeypatch.setattr(LocalStorage, "lane_bytes", lambda self, rel: 32 * MIB)
    files = sorted(f for f in os.listdir(os.path.join(d, "data")) if f.endswith(".safetensors"))
    path = os.path.join(d, "data", files[0])
    size = os.path.getsize(path)
    with open(path, "r+b") as f:  # a byte well inside the file: a later range of some lane
        f.seek(size * 3 // 4)
        b = f.read(1)
        f.seek(size * 3 // 4)
        f.write(bytes([b[0] ^ 0xFF]))
    live = {k: torch.zeros_like(v) for k, v in src.items()}
    with pytest.raises(ChecksumMismatchError, match="checksum mismatch"):
        shardckpt.load(live, d, io_threads=4, atomic=True)
    assert all(not v.any() for v in live.values()), "an atomic load that failed changed nothing"
    # Not atomic: whatever was written is verified bytes; the damaged block is nowhere in the tensors.
    live = {k: torch.zeros_like(v) for k, v in src.items()}
    with pytest.raises(ChecksumMismatchError, match="checksum mismatch"):
        shardckpt.load(live, d, io_threads=4)
    block = _knobs.BLOCK_BYTES
    whole = 0
    for k, v in src.items():
        got, want = live[k].view(torch.uint8), v.view(torch.uint8)
        whole += torch.equal(got, want)
        for a in range(0, got.numel(), block):
            g, w = got[a : a + block], want[a : a + block]
            assert torch.equal(g, w) or not g.any(), (k, a)  # verified bytes, or untouched (put back)
    assert whole < len(src)  # the damaged tensor's block is not in it


@pytest.mark.parametrize("cores", ["few", "many"])
def test_all_reads_cold_lanes_and_maps_warm_ones_on_many_cores(tmp_path, monkeypatch, cores):
    # LOAD_LANES=all (the default): a lane is read with preadv where tmpfs
    # pieces are read too (LOAD_INTO: few cores) or where its first page is
    # not cached (a cold lane, from the RWF_NOWAIT probe, patched here); a
    # warm lane on many cores is mapped. Decided once per lane; the same values.
    src = _state()
    d = str(tmp_path / "c")
    shardckpt.save(src, d)
    monkeypatch.setattr(_knobs, "LOAD_MAP", True)
    monkeypatch.setattr(_knobs, "LOAD_DIRECT", "0")
    monkeypatch.setattr(_knobs, "LOAD_LANES", "all")
    monkeypatch.setattr(_knobs, "LOAD_INTO", cores == "few")
    monkeypatch.setattr(_knobs, "LOAD_BUFFER_BYTES", 8 * MIB)
    monkeypatch.setattr(LocalStorage, "lane_bytes", lambda self, rel: 32 * MIB)
    hot = _record(monkeypatch, "open_hot")
    maps = _record(monkeypatch, "map_range")
    probes = []
    for cold in (True, False):
        monkeypatch.setattr(_local, "is_cached", lambda fd, off, cold=cold: probes.append(off) or not cold)
        hot.clear(), maps.clear(), probes.clear()
        live = {k: torch.zeros_like(v) for k, v in src.items()}
        shardckpt.load(live, d, io_threads=4)
        assert all(torch.equal(live[k], src[k]) for k in src)
        lanes_read = {id(r[5]) for r in hot if r[4] >= 0}
        if cold or cores == "few":
            assert lanes_read and not maps, (cold, cores, len(hot), len(maps))
        else:
            assert maps and not lanes_read and all(r[4] >= 0 for r in maps), "a warm lane is mapped from the lane's descriptor"
        # Probed once per lane at most (few cores: never), at the lane's first piece.
        assert len(probes) <= len(lanes_read | {id(r[5]) for r in maps}) and (cores == "many" or not probes), probes


def test_a_lanes_pieces_stay_a_few_mib_where_mapped_pieces_grow(tmp_path, monkeypatch):
    # LOAD_INTO off (the default above 4 CPUs): mapped pieces of a file
    # without lanes (tmpfs, or no readahead) are up to 8 MiB; a lane's
    # (a disk file) stay at most SCRATCH_PIECE_BYTES, since a cold lane reads
    # each piece into its thread's scratch.
    src, d, _ = _saved_for(tmp_path, monkeypatch, "mapped")
    monkeypatch.setattr(_knobs, "LOAD_INTO", False)
    monkeypatch.setattr(_knobs, "LOAD_BUFFER_BYTES", 64 * MIB)
    log = _record(monkeypatch, "map_range")
    sizes = {on: [hi - lo for _t, _rel, lo, hi, _fd, _lane in got] for on, got in _with_and_without_lanes(monkeypatch, src, d, log).items()}
    # (a piece ends at the first unit end past its size: at most one checksum block more)
    assert sizes[True] and max(sizes[True]) <= _readers.SCRATCH_PIECE_BYTES + MIB, sizes[True]
    assert max(sizes[False]) > _readers.SCRATCH_PIECE_BYTES + MIB, sizes[False]
