"""Read coalescing: needed ranges of a file close together are fetched in one request on object storage.

The planning is pure and checked with ints; the reader and ``load`` are
checked by counting the requests and bytes that really reach the storage
(local disk and ``memory://``, made high-latency the way object stores are).
"""

from __future__ import annotations

import dataclasses
import uuid

import pytest
import torch

import shardckpt
from shardckpt import _knobs
from shardckpt._format import crc32c
from shardckpt._format.chunk import Chunk
from shardckpt._readers import ReadStats, Want, coalesce_gap, plan_ranges, read_verified
from shardckpt._storage import Storage, _fsspec
from shardckpt.errors import ChecksumMismatchError

KIB = 1 << 10


def _chunk(rel, start, nbytes, block=4 * KIB, name="c", data=None):
    if data is None:
        crcs = tuple(range(-(-nbytes // block)))
    else:
        body = data[start : start + nbytes]
        crcs = tuple(crc32c(body[i : i + block]) for i in range(0, nbytes, block))
    return Chunk(rel, start, nbytes, block_bytes=block, block_crcs=crcs, tensor=name)


# -- planning (pure) ------------------------------------------------------------------


def test_gap_merges_only_what_is_close_enough():
    # Three 8 KiB chunks of one file with 4 KiB and 12 KiB between them.
    a, b, c = _chunk("f", 0, 8 * KIB), _chunk("f", 12 * KIB, 8 * KIB), _chunk("f", 32 * KIB, 8 * KIB)
    wants = [Want(x, 0, x.nbytes) for x in (a, b, c)]
    spans = lambda rs: [(r.start, r.stop) for r in rs]  # noqa: E731
    assert spans(plan_ranges(wants, range_bytes=1 << 20, gap_bytes=0)) == [(0, 8 * KIB), (12 * KIB, 20 * KIB), (32 * KIB, 40 * KIB)]
    assert spans(plan_ranges(wants, range_bytes=1 << 20, gap_bytes=4 * KIB)) == [(0, 20 * KIB), (32 * KIB, 40 * KIB)]
    assert spans(plan_ranges(wants, range_bytes=1 << 20, gap_bytes=12 * KIB)) == [(0, 40 * KIB)]
    # The merged range checks only the wants' blocks: none lies in a gap.
    (r,) = plan_ranges(wants, range_bytes=1 << 20, gap_bytes=12 * KIB)
    assert [u[:2] for u in r.units] == [(0, 4 * KIB), (4 * KIB, 8 * KIB), (12 * KIB, 16 * KIB), (16 * KIB, 20 * KIB),
                                        (32 * KIB, 36 * KIB), (36 * KIB, 40 * KIB)]
    assert len(r.wants) == 3


def test_gap_never_grows_a_range_past_the_cap_nor_joins_files():
    chunks = [_chunk("f", i * 12 * KIB, 8 * KIB) for i in range(10)]
    wants = [Want(x, 0, x.nbytes) for x in chunks]
    rs = plan_ranges(wants, range_bytes=32 * KIB, gap_bytes=4 * KIB)
    assert all(r.nbytes <= 32 * KIB for r in rs)
    assert sum(len(r.wants) for r in rs) == 10 and len(rs) == 4  # 3 chunks (32 KiB) fit a range
    other = [Want(_chunk("g", 8 * KIB, 8 * KIB), 0, 8 * KIB), Want(_chunk("f", 8 * KIB, 8 * KIB), 0, 8 * KIB)]
    assert sorted(r.file for r in plan_ranges(other + wants[:1], range_bytes=1 << 20, gap_bytes=1 << 20)) == ["f", "g"]


def test_gap_policy_follows_the_storage(tmp_path, monkeypatch):
    assert coalesce_gap(Storage(str(tmp_path))) == 0
    assert coalesce_gap(Storage(f"memory://coalesce/{uuid.uuid4().hex}")) == 0  # in-process: no round trip
    remote = _high_latency(Storage(f"memory://coalesce/{uuid.uuid4().hex}"))
    assert coalesce_gap(remote) == _knobs.COALESCE_GAP_BYTES
    monkeypatch.setattr(_knobs, "COALESCE_GAP_BYTES", 123)
    assert coalesce_gap(remote) == 123


# -- the reader: requests and bytes that reach the storage ------------------------------


def _high_latency(st):
    st.caps = dataclasses.replace(st.caps, high_latency=True)
    return st


def _counting(st, log):
    real = st.read_into

    def read_into(rel, ranges):
        log.extend((rel, off, len(buf)) for off, buf in ranges)
        return real(rel, ranges)

    st.read_into = read_into
    return st


def _scattered(st, n=16, size=8 * KIB, gap=8 * KIB):
    """A file of ``n`` checksummed chunks of ``size`` bytes, each followed by ``gap`` bytes of other data."""
    data = bytes((i * 31 + 7) % 253 for i in range(n * (size + gap)))
    st.write_atomic("f.bin", data)
    return data, [_chunk("f.bin", i * (size + gap), size, data=data, name=f"c{i}") for i in range(n)]


@pytest.mark.parametrize("where", ["local", "memory"])
def test_reader_saves_requests_on_high_latency_storage_only(tmp_path, where):
    def make():
        return Storage(str(tmp_path)) if where == "local" else Storage(f"memory://coalesce/{uuid.uuid4().hex}")

    results = {}
    for mode in ("plain", "remote"):
        st = make()
        data, chunks = _scattered(st)
        if mode == "remote":
            _high_latency(st)
        log, got = [], {}
        _counting(st, log)
        stats = read_verified(st, [Want(c, 0, c.nbytes, i) for i, c in enumerate(chunks)],
                              lambda w, b, o, off, got=got: got.__setitem__(w.tag, bytes(b)), threads=2, stats=ReadStats())
        assert got == {i: data[c.byte_offset : c.byte_offset + c.nbytes] for i, c in enumerate(chunks)}
        assert stats.requests == len(log)
        assert stats.read_bytes == sum(n for _, _, n in log)
        results[mode] = stats
    plain, remote = results["plain"], results["remote"]
    # Not high-latency: one request per chunk, not a byte more than needed.
    assert (plain.requests, plain.read_bytes, plain.gap_bytes) == (16, 16 * 8 * KIB, 0)
    # High-latency: the 8 KiB gaps are read through, one request for all.
    assert (remote.requests, remote.gap_bytes) == (1, 15 * 8 * KIB)
    assert remote.read_bytes == plain.read_bytes + remote.gap_bytes


def test_gap_bytes_are_never_checked_nor_delivered(tmp_path):
    st = _high_latency(Storage(f"memory://coalesce/{uuid.uuid4().hex}"))
    data, chunks = _scattered(st, n=4)
    # Damage a byte between chunks 0 and 1: not needed, so not an error.
    bad = bytearray(data)
    bad[chunks[0].nbytes + 100] ^= 0xFF
    st.write_atomic("f.bin", bytes(bad))
    got = []
    stats = read_verified(st, [Want(c, 0, c.nbytes) for c in chunks], lambda w, b, o, off: got.append(bytes(b)))
    assert stats.requests == 1 and got == [data[c.byte_offset : c.byte_offset + c.nbytes] for c in chunks]
    # Damage inside chunk 2: the merged read names it and delivers nothing of that range.
    bad[chunks[2].byte_offset + 5] ^= 0xFF
    st.write_atomic("f.bin", bytes(bad))
    got.clear()
    with pytest.raises(ChecksumMismatchError, match="c2 block 0"):
        read_verified(st, [Want(c, 0, c.nbytes) for c in chunks], lambda w, b, o, off: got.append(bytes(b)))
    assert got == []


# -- load end to end ----------------------------------------------------------------------


def test_load_of_a_subset_coalesces_on_object_storage(monkeypatch):
    # 24 tensors saved in one file; loading every other one leaves gaps the
    # size of a tensor. memory:// made high-latency: the reads of the load
    # collapse into a few requests; local-style planning issues one per tensor.
    url = f"memory://coalesce/{uuid.uuid4().hex}/ckpt"
    state = {"model": {f"w{i:02d}": torch.arange(i * 2048, (i + 1) * 2048, dtype=torch.float32) for i in range(24)}}
    shardckpt.save(state, url, no_dist=True)
    want = sorted(f"model.w{i:02d}" for i in range(0, 24, 2))

    def run(high_latency: bool):
        if high_latency:
            monkeypatch.setattr(_fsspec, "_IN_PROCESS_PROTOCOLS", _fsspec._IN_PROCESS_PROTOCOLS - {"memory"})
        else:
            monkeypatch.setattr(_fsspec, "_IN_PROCESS_PROTOCOLS", _fsspec._IN_PROCESS_PROTOCOLS | {"memory"})
        log = []
        real = _fsspec.FsspecStorage._read_ranges

        def counted(self, rel, ranges):
            if rel.endswith(".safetensors"):
                log.extend(len(b) for _, b in ranges)
            return real(self, rel, ranges)

        monkeypatch.setattr(_fsspec.FsspecStorage, "_read_ranges", counted)
        live = {"model": {f"w{i:02d}": torch.zeros(2048) for i in range(0, 24, 2)}}
        res = shardckpt.load(live, url, no_dist=True, strict=False, keys=want)
        assert res.missing_keys == []
        for i in range(0, 24, 2):
            assert torch.equal(live["model"][f"w{i:02d}"], state["model"][f"w{i:02d}"])
        monkeypatch.setattr(_fsspec.FsspecStorage, "_read_ranges", real)
        return log

    local_like, remote = run(False), run(True)
    assert len(local_like) == 12 and sum(local_like) == 12 * 8 * KIB
    assert len(remote) < len(local_like) and len(remote) <= 2
    assert sum(remote) <= sum(local_like) + 11 * 8 * KIB
