"""Streaming loads: the verified ranged reader, its buffer pool, and load's order of checks.

Real files on local disk; block checksums (format v2) are computed here from
the saved bytes where a test needs them, through the same seam the v2
resolver plugs into (``_load.saved_chunks``).
"""

from __future__ import annotations

import os
import subprocess
import sys
import textwrap

import pytest
import torch

import shardckpt
from shardckpt import _load
from shardckpt._format import crc32c, open_manifest
from shardckpt._format.chunk import Chunk
from shardckpt._readers import BufferPool, ReadStats, Want, plan_ranges, read_verified
from shardckpt._storage import Storage
from shardckpt.errors import ChecksumMismatchError, CorruptCheckpointError, StateMismatchError


def _file(tmp_path, n=1 << 16, name="f.bin"):
    data = bytes((i * 7 + 3) % 251 for i in range(n))
    (tmp_path / name).write_bytes(data)
    return data


def _blocked(rel, data, start, nbytes, block, name="c"):
    body = data[start : start + nbytes]
    crcs = tuple(crc32c(body[i : i + block]) for i in range(0, nbytes, block))
    return Chunk(rel, start, nbytes, block_bytes=block, block_crcs=crcs, tensor=name)


# -- planning (pure) ------------------------------------------------------------------


def test_plan_rounds_to_blocks_and_coalesces_neighbours():
    c = Chunk("a", 100, 1000, block_bytes=64, block_crcs=tuple(range(16)))
    rs = plan_ranges([Want(c, 70, 80), Want(c, 130, 140)], range_bytes=1 << 20, gap_bytes=0)
    assert [(r.start, r.stop) for r in rs] == [(164, 292)]  # blocks 1 and 2, adjacent
    assert [u[:2] for u in rs[0].units] == [(164, 228), (228, 292)]
    # Two wants in one block check it once.
    rs = plan_ranges([Want(c, 0, 4), Want(c, 10, 20)], range_bytes=1 << 20)
    assert len(rs) == 1 and len(rs[0].units) == 1


def test_plan_v1_reads_whole_chunks_and_unchecked_reads_exact_bytes():
    v1 = Chunk("a", 8, 4096, crc32c=5, tensor="w")
    (r,) = plan_ranges([Want(v1, 100, 200)])
    assert (r.start, r.stop, [(u.start, u.stop, u.crc, u.label) for u in r.units]) == (8, 8 + 4096, [(8, 4104, 5, "w")])
    raw = Chunk("a", 8, 4096)
    (r,) = plan_ranges([Want(raw, 100, 200)])
    assert (r.start, r.stop, r.units) == (108, 208, [])


def test_plan_never_exceeds_the_range_size_unless_one_unit_does():
    c = Chunk("a", 0, 1 << 20, block_bytes=1 << 12, block_crcs=tuple(range(256)))
    wants = [Want(c, s, s + 1000) for s in range(0, 1 << 20, 1 << 12)]
    rs = plan_ranges(wants, range_bytes=64 << 10)
    assert all(r.nbytes <= 64 << 10 for r in rs) and sum(len(r.wants) for r in rs) == len(wants)
    big = Chunk("a", 0, 1 << 20, crc32c=1)
    assert [r.nbytes for r in plan_ranges([Want(big, 0, 1)], range_bytes=1 << 10)] == [1 << 20]


def test_plan_refuses_wants_outside_the_chunk_and_short_block_lists():
    c = Chunk("a", 0, 100, block_bytes=10, block_crcs=(1,) * 10, tensor="x")
    with pytest.raises(CorruptCheckpointError, match="outside x of 100 bytes"):
        plan_ranges([Want(c, 90, 101)])
    short = Chunk("a", 0, 100, block_bytes=10, block_crcs=(1,) * 9, tensor="x")
    with pytest.raises(CorruptCheckpointError, match="9 block checksums, 10 needed"):
        plan_ranges([Want(short, 0, 1)])


# -- the reader -----------------------------------------------------------------------


def test_reader_reads_only_the_blocks_wanted_and_delivers_exact_bytes(tmp_path):
    data = _file(tmp_path, 1 << 20)
    c = _blocked("f.bin", data, 4096, 900_000, 4096)
    wants = [Want(c, s, s + 10_000, s) for s in (0, 300_000, 600_123)]
    got = {}
    stats = read_verified(Storage(str(tmp_path)), wants, lambda w, b, o, off: got.__setitem__(w.tag, bytes(b)), threads=3)
    for w in wants:
        assert got[w.tag] == data[4096 + w.start : 4096 + w.stop]
    assert stats.wanted_bytes == 30_000
    assert stats.read_bytes <= 30_000 + 3 * 2 * 4096  # at most one partial block each side
    assert stats.ranges == 3


def test_reader_refuses_a_damaged_block_and_delivers_nothing_of_its_range(tmp_path):
    data = bytearray(_file(tmp_path, 1 << 16))
    c = _blocked("f.bin", bytes(data), 0, 1 << 16, 1024, name="layer.w chunk 'k'")
    data[5000] ^= 1
    (tmp_path / "f.bin").write_bytes(bytes(data))
    got = []
    deliver = lambda w, b, o, off: got.append(w.tag)  # noqa: E731
    # Blocks other than 4 still read and verify alone.
    read_verified(Storage(str(tmp_path)), [Want(c, 0, 4096, "ok")], deliver)
    with pytest.raises(ChecksumMismatchError, match=r"layer.w chunk 'k' block 4 \(bytes 4096..5120\)"):
        read_verified(Storage(str(tmp_path)), [Want(c, 4000, 4200, "bad")], deliver, range_bytes=1 << 20)
    assert got == ["ok"]


def test_reader_with_on_mismatch_lists_every_damaged_unit_and_delivers_the_rest(tmp_path):
    # How verify lists all damage in one pass: no raise, bad units reported, good wants delivered.
    data = bytearray(_file(tmp_path, 1 << 16))
    c = _blocked("f.bin", bytes(data), 0, 1 << 16, 1024, name="w")
    whole = Chunk("f.bin", 0, 1024, crc32c=crc32c(bytes(data[:1024])) ^ 1, tensor="v1")  # a wrong whole-chunk CRC
    for i in (5000, 40_000):
        data[i] ^= 1
    (tmp_path / "f.bin").write_bytes(bytes(data))
    bad, got = [], []
    wants = [Want(c, s, s + 8192, s) for s in range(0, 1 << 16, 8192)] + [Want(whole, 0, 1024, "v1")]
    read_verified(Storage(str(tmp_path)), wants, lambda w, b, o, off: got.append(w.tag),
                  on_mismatch=lambda u, crc: bad.append((u.label, crc is not None)), range_bytes=16384)
    assert sorted(bad) == [("v1", True), ("w block 39", True), ("w block 4", True)]
    assert sorted(got) == [s for s in range(0, 1 << 16, 8192) if s not in (0, 32768)]  # "v1" not delivered either


def test_sinks_take_verified_pieces_in_the_reader_threads_and_never_a_damaged_block(tmp_path):
    # One pass (issue 43): a want with a sink gets its bytes from the reader
    # thread that read and checked them, piece by piece (pieces cut at block
    # ends); a damaged block's bytes never reach a sink, nor do later pieces.
    import threading

    data = bytearray(_file(tmp_path, 1 << 18))
    c = _blocked("f.bin", bytes(data), 1000, 200_000, 4096, name="w")
    got = bytearray(200_000)
    calls = []

    def sink_for(base):
        def put(pos, piece):
            calls.append((threading.current_thread().name, base + pos, len(piece)))
            got[base + pos : base + pos + len(piece)] = piece
        return put

    wants = [Want(c, a, min(a + 50_000, 200_000), a, sink=sink_for(a)) for a in range(0, 200_000, 50_000)]
    main = []
    read_verified(Storage(str(tmp_path)), wants, lambda *a: main.append(a), threads=3, piece_bytes=3 * 4096,
                  range_bytes=1 << 20)
    assert bytes(got) == bytes(data[1000:201_000]) and not main
    assert all(name.startswith("shardckpt-r") for name, _, _ in calls)
    assert len(calls) > len(wants)  # delivered in pieces, not whole wants
    assert sum(n for _, _, n in calls) == 200_000  # every byte once

    # Damage in block 20 (chunk bytes 81920..86016): none of it reaches a sink, and
    # the read stops delivering: the damaged range raises.
    data[1000 + 83_000] ^= 1
    (tmp_path / "f.bin").write_bytes(bytes(data))
    got[:] = bytes(200_000)
    calls.clear()
    with pytest.raises(ChecksumMismatchError, match=r"w block 20 \(bytes 82920..87016\)") as ei:
        read_verified(Storage(str(tmp_path)), wants, lambda *a: main.append(a), threads=1, piece_bytes=3 * 4096,
                      range_bytes=1 << 20)
    assert "block 21" not in str(ei.value)  # only the damage is named, not the pieces left unread after it
    assert calls and not main
    assert all(pos + n <= 81_920 for _, pos, n in calls), calls  # only the pieces before the damaged one, in order
    assert not any(got[81_920:])


def test_each_piece_job_gets_only_the_units_and_sinks_it_overlaps():
    from shardckpt._readers import _by_piece

    spans = [(30, 40), (0, 10), (10, 20), (20, 30)]  # a range's units need not be sorted
    assert _by_piece(spans, [(0, 20), (20, 25), (25, 40)]) == [[1, 2], [3], [3, 0]]
    assert _by_piece([(5, 6), (0, 50)], [(0, 10), (10, 20), (40, 60)]) == [[1, 0], [1], [1]]  # one long want spans all
    assert _by_piece([], [(0, 10)]) == [[]]


@pytest.mark.parametrize("threads", [1, 3])
def test_mapped_pieces_checked_by_their_threads_never_deliver_a_damaged_unit(tmp_path, threads):
    # The reader threads check their own pieces' units (the calling thread only
    # joins parts when one did not come back whole and good): damage in the
    # middle piece of a range raises, names that block alone, and no byte of
    # the damaged piece reaches the sink, whichever thread read it.
    data = bytearray(_file(tmp_path, 1 << 17))
    c = _blocked("f.bin", bytes(data), 0, 96 << 10, 8 << 10, name="w")  # 12 blocks of 8 KiB, one range
    got = bytearray(96 << 10)

    def put(pos, piece):
        got[pos : pos + len(piece)] = piece

    wants = [Want(c, 0, 96 << 10, "w", sink=put)]
    stats = read_verified(Storage(str(tmp_path)), wants, lambda *a: None, threads=threads, piece_bytes=32 << 10, range_bytes=1 << 20)
    assert bytes(got) == bytes(data[: 96 << 10]) and stats.ranges == 1
    data[(40 << 10) + 5] ^= 0x40  # block 5, in the second piece (32..64 KiB)
    (tmp_path / "f.bin").write_bytes(bytes(data))
    got[:] = bytes(96 << 10)
    with pytest.raises(ChecksumMismatchError, match=r"w block 5 \(bytes 40960..49152\)") as ei:
        read_verified(Storage(str(tmp_path)), wants, lambda *a: None, threads=threads, piece_bytes=32 << 10, range_bytes=1 << 20)
    assert "block 4 " not in str(ei.value) and "block 6 " not in str(ei.value)
    assert not any(got[32 << 10 : 64 << 10])  # the damaged piece: nothing of it delivered


def test_a_mapped_file_swapped_for_a_link_out_of_the_checkpoint_is_refused_at_the_next_load(tmp_path):
    # Mapped pieces check the path in full once per file, then only that the
    # opened file is the same one: a file replaced by a symlink leading out of
    # the checkpoint is a different file, checked in full again, and refused.
    from shardckpt.errors import UnreadableFileError

    d = tmp_path / "c"
    src = {"w": torch.randn(64, 1024)}
    shardckpt.save(src, str(d))
    st = Storage(str(d))
    c = shardckpt.inspect(str(d)).tensors["w"].chunks[0]
    live = {"w": torch.zeros(64, 1024)}
    shardckpt.load(live, st)
    assert torch.equal(live["w"], src["w"])
    f = d / c.file
    outside = tmp_path / "outside.bin"
    outside.write_bytes(f.read_bytes())  # the same bytes: only where they lie differs
    f.unlink()
    f.symlink_to(outside)
    with pytest.raises(UnreadableFileError, match="leading out of the checkpoint"):
        st.map_range(c.file, c.byte_offset, c.byte_offset + 4096)  # this file's identity was remembered by the load
    with pytest.raises(CorruptCheckpointError, match="leading out of the checkpoint"):
        shardckpt.load({"w": torch.zeros(64, 1024)}, st)  # (the load's file check refuses it first)
    f.unlink()
    f.write_bytes(outside.read_bytes())  # a new regular file inside (another inode): loads
    live = {"w": torch.zeros(64, 1024)}
    shardckpt.load(live, st)
    assert torch.equal(live["w"], src["w"])


def test_reader_names_missing_and_short_files(tmp_path):
    _file(tmp_path, 100)
    st = Storage(str(tmp_path))
    with pytest.raises(CorruptCheckpointError, match="is missing"):
        read_verified(st, [Want(Chunk("nope.bin", 0, 10), 0, 10)], lambda *a: None)
    with pytest.raises(CorruptCheckpointError, match="truncated"):
        read_verified(st, [Want(Chunk("f.bin", 50, 80), 0, 80)], lambda *a: None)


def test_pool_is_bounded_reused_and_empty_after_close(tmp_path):
    data = _file(tmp_path, 1 << 20)
    c = _blocked("f.bin", data, 0, 1 << 20, 1 << 12)
    allocs, frees = [], []

    def alloc(n):
        allocs.append(n)
        b = bytearray(n)
        return memoryview(b), b

    pool = BufferPool(64 << 10, slot_bytes=16 << 10, alloc=alloc, free=frees.append)
    wants = [Want(c, s, s + (16 << 10)) for s in range(0, 1 << 20, 16 << 10)]
    out = bytearray(1 << 20)

    def deliver(w, b, owner, off):
        out[w.start : w.stop] = b

    stats = read_verified(Storage(str(tmp_path)), wants, deliver, pool=pool, threads=4, range_bytes=16 << 10)
    assert bytes(out) == data
    assert pool.peak_bytes <= 64 << 10 and stats.peak_buffer_bytes <= 64 << 10
    assert set(allocs) == {16 << 10} and len(allocs) <= 4  # exact sizes, reused
    pool.close()
    assert pool.held_bytes == 0 and len(frees) == len(allocs)


def _gated_storage(path, gate):
    """Local files whose reads wait until ``gate`` opens: reads that lag behind the reader."""
    from shardckpt._storage import LocalStorage

    class Gated(LocalStorage):
        def read_into(self, rel, ranges):
            assert gate.wait(30), "the reader never opened the gate"
            return super().read_into(rel, ranges)

    return Gated(path)


def _pool_counting(capacity, slot):
    allocs = []

    def alloc(n):
        allocs.append(n)
        b = bytearray(n)
        return memoryview(b), b

    return BufferPool(capacity, slot_bytes=slot, alloc=alloc), allocs


def test_pool_reuses_a_read_buffer_before_growing_and_grows_where_reads_lag(tmp_path):
    # 64 ranges of 16 KiB through a pool of up to 16 buffers. Reads done by
    # the time the next range is taken (a warm file, one thread: each read
    # runs as it is submitted): the pool never holds more than one buffer (a
    # warm load into CUDA page-locks only that). Reads that lag (held until
    # the pool is full): the pool grows to its capacity, a deep queue.
    import threading

    data = _file(tmp_path, 1 << 20)
    c = _blocked("f.bin", data, 0, 1 << 20, 1 << 12)
    wants = [Want(c, s, s + (16 << 10)) for s in range(0, 1 << 20, 16 << 10)]
    out = bytearray(1 << 20)

    def deliver(w, b, owner, off):
        out[w.start : w.stop] = b

    pool, allocs = _pool_counting(256 << 10, 16 << 10)
    read_verified(Storage(str(tmp_path)), wants, deliver, pool=pool, threads=1, range_bytes=16 << 10)
    assert bytes(out) == data and len(allocs) == 1 and pool.peak_bytes == 16 << 10
    gate = threading.Event()
    pool, allocs = _pool_counting(256 << 10, 16 << 10)
    real_take = pool.take

    def take(n):
        if pool.out_bytes + (16 << 10) >= pool.capacity:
            gate.set()  # the reader filled the pool before any read finished
        return real_take(n)

    pool.take = take
    out[:] = bytes(1 << 20)
    read_verified(_gated_storage(str(tmp_path), gate), wants, deliver, pool=pool, threads=4, range_bytes=16 << 10)
    assert bytes(out) == data and len(allocs) == 16 and pool.peak_bytes == 256 << 10


def test_pool_gives_oversized_requests_an_exact_buffer_and_drops_it():
    frees = []
    pool = BufferPool(100, slot_bytes=10, free=frees.append)
    b = pool.take(1000)
    assert b.size == 1000 and not pool.fits(5)
    pool.give(b)
    assert pool.held_bytes == 0 and len(frees) == 1 and pool.fits(5)


def test_reader_module_imports_no_torch():
    code = "import sys, shardckpt._readers; assert 'torch' not in sys.modules, 'torch imported'"
    subprocess.run([sys.executable, "-c", code], check=True)


# -- load ------------------------------------------------------------------------------


def _state(seed=0, n=6):
    g = torch.Generator().manual_seed(seed)
    return {f"t{i}": torch.randn(64, 33, generator=g) for i in range(n)}


def _flip_last_file_byte_of(path, name):
    c = shardckpt.inspect(path).tensors[name].chunks[0]
    f = os.path.join(path, c.file)
    raw = bytearray(open(f, "rb").read())
    raw[c.byte_offset + c.nbytes - 1] ^= 0x10
    open(f, "wb").write(bytes(raw))


def test_stream_load_is_bit_exact_through_small_buffers(tmp_path):
    d = str(tmp_path / "c")
    src = _state(1)
    shardckpt.save(src, d)
    live = {k: torch.zeros_like(v) for k, v in src.items()}
    ids = {k: v.data_ptr() for k, v in live.items()}
    shardckpt.load(live, d, buffer_bytes=4096)  # many pieces, buffers reused
    assert all(torch.equal(live[k], src[k]) and live[k].data_ptr() == ids[k] for k in src)


def test_damage_mid_load_names_the_tensors_already_overwritten(tmp_path):
    d = str(tmp_path / "c")
    src = _state(2)
    shardckpt.save(src, d)
    _flip_last_file_byte_of(d, "t4")
    live = {k: torch.zeros_like(v) for k, v in src.items()}
    with pytest.raises(ChecksumMismatchError) as ei:
        shardckpt.load(live, d, buffer_bytes=9000, io_threads=1)  # one chunk per read
    msg = str(ei.value)
    assert "t4 chunk" in msg and "Tensors already overwritten" in msg, msg
    changed = sorted(k for k, v in live.items() if torch.count_nonzero(v))
    assert changed, "nothing was overwritten: the test no longer exercises a mid-load failure"
    for k in changed:
        assert k in msg.split("Tensors already overwritten")[1], (k, msg)
    assert not torch.count_nonzero(live["t4"]) or "t4" in msg


def test_atomic_load_leaves_the_state_untouched_on_the_same_damage(tmp_path):
    d = str(tmp_path / "c")
    src = _state(3)
    shardckpt.save({**src, "step": 7}, d)
    _flip_last_file_byte_of(d, "t4")
    live = {**{k: torch.zeros_like(v) for k, v in src.items()}, "step": -1}
    with pytest.raises(ChecksumMismatchError) as ei:
        shardckpt.load(live, d, buffer_bytes=64 << 10, atomic=True)
    assert "already overwritten" not in str(ei.value)
    assert all(torch.count_nonzero(live[k]) == 0 for k in src) and live["step"] == -1
    # the intact tensors still load atomically once the damage is gone
    shardckpt.save({**src, "step": 7}, str(tmp_path / "good"))
    shardckpt.load(live, str(tmp_path / "good"), atomic=True)
    assert all(torch.equal(live[k], src[k]) for k in src) and live["step"] == 7


def test_self_overlapping_targets_are_refused_before_anything_changes(tmp_path):
    d = str(tmp_path / "c")
    shardckpt.save({"a": torch.arange(4.0), "b": torch.ones(3)}, d)
    b = torch.zeros(3)
    live = {"a": torch.zeros(1).expand(4), "b": b}
    with pytest.raises(StateMismatchError, match=r"a: the live tensor overlaps itself.*\.clone\(\)"):
        shardckpt.load(live, d)
    assert torch.count_nonzero(b) == 0
    strided = torch.zeros(8)[::2]  # gaps, but no overlap: fine
    shardckpt.load({"a": strided, "b": b}, d)
    assert strided.tolist() == [0.0, 1.0, 2.0, 3.0]


def test_missing_keys_and_shape_mismatches_in_one_error(tmp_path):
    d = str(tmp_path / "c")
    shardckpt.save({"a": torch.ones(2), "b": torch.ones(3), "c": torch.ones(1, dtype=torch.int64)}, d)
    live = {"a": torch.zeros(5), "b": torch.zeros(3), "c": torch.zeros(1, dtype=torch.int32), "z": torch.zeros(1)}
    with pytest.raises(StateMismatchError) as ei:
        shardckpt.load(live, d)
    msg = str(ei.value)
    for frag in ("missing from the checkpoint: z", "a: checkpoint shape [2], live shape [5]", "c: checkpoint dtype I64"):
        assert frag in msg, (frag, msg)
    assert torch.count_nonzero(live["b"]) == 0


def test_pieces_cast_when_the_dtype_rule_allows_it(tmp_path, monkeypatch):
    d = str(tmp_path / "c")
    src = torch.randn(40, 7).to(torch.bfloat16)
    shardckpt.save({"w": src}, d)
    # bf16 -> fp32 is allowed by the real casting rule (docs/interop.md): no patching needed.
    live = {"w": torch.zeros(40, 7)}
    shardckpt.load(live, d, buffer_bytes=256)
    assert torch.equal(live["w"], src.float())


def _rows_plan(d, live_rows, rows, cols):
    """A load plan for rows ``live_rows`` of a saved ``rows x cols`` tensor, as a rank holding them makes it."""
    from shardckpt import _geometry

    man = open_manifest(d, chunks=False)
    plan = _load.plan.plan_for_manifest({"w": torch.zeros(rows, cols)}, man, strict=True, rank=0, world=1, storage=Storage(d))
    t = plan.targets[0]
    lo, hi = live_rows
    box = _geometry.Box((lo, 0), (hi - lo, cols))
    dst = torch.zeros(hi - lo, cols)
    pieces = tuple(_geometry.plan_reads([_geometry.Box(c.offsets, c.sizes) for c in t.chunks], [_geometry.LocalBox(box, (0, 0))]))
    part = t.__class__(t.name, t.meta, ((box, dst),), (pieces,), t.chunks)
    return plan.__class__(**{**plan.__dict__, "targets": (part,)}), dst


def test_block_checksums_read_a_fraction_of_a_whole_saved_tensor(tmp_path, monkeypatch):
    """Format v2 (block CRCs): rows 16..31 of a 64-row tensor saved whole cost about their own bytes."""
    d = str(tmp_path / "c")
    w = torch.randn(64, 16384)  # 4 MiB, 4 blocks of 1 MiB
    shardckpt.save({"w": w}, d)
    assert shardckpt.inspect(d).version >= 2
    plan, dst = _rows_plan(d, (16, 32), 64, 16384)
    assert plan.targets[0].chunks[0].block_bytes > 0
    stats = _load.stream_into(Storage(d), plan, None, stats=ReadStats())
    assert torch.equal(dst, w[16:32])
    assert stats.wanted_bytes == 16 * 16384 * 4
    assert stats.read_bytes <= 1.1 * stats.wanted_bytes, (stats.read_bytes, stats.wanted_bytes)


def test_v1_checksums_make_the_same_rows_read_the_whole_chunk(tmp_path):
    """Format v1 (one CRC per chunk): the same rows read all 4 MiB (why v2 exists)."""
    d = str(tmp_path / "c")
    w = torch.randn(64, 16384)
    shardckpt.save({"w": w}, d)
    plan, dst = _rows_plan(d, (16, 32), 64, 16384)
    t = plan.targets[0]
    v1 = tuple(c._replace(block_bytes=0, block_crcs=(_whole_crc(d, c),)) for c in t.chunks)
    plan = plan.__class__(**{**plan.__dict__, "targets": (t.__class__(t.name, t.meta, t.parts, t.pieces, v1),)})
    stats = _load.stream_into(Storage(d), plan, None, stats=ReadStats())
    assert torch.equal(dst, w[16:32]) and stats.read_bytes == w.numel() * 4


def _whole_crc(d, c):
    with open(os.path.join(d, c.file), "rb") as f:
        f.seek(c.byte_offset)
        return crc32c(f.read(c.nbytes))


@pytest.mark.slow
def test_peak_rss_of_a_1gib_load_stays_within_10_percent(tmp_path):
    d = str(tmp_path / "c")
    code = textwrap.dedent(
        f"""
        import resource, sys, torch, shardckpt
        torch.set_num_threads(1)
        n = 32  # 32 x 32 MiB
        if sys.argv[1] == "save":
            g = torch.Generator().manual_seed(0)
            shardckpt.save({{f"t{{i}}": torch.randn(8 << 20, generator=g) for i in range(n)}}, {d!r})
            sys.exit(0)
        live = {{f"t{{i}}": torch.zeros(8 << 20) for i in range(n)}}
        for v in live.values():
            v.fill_(1.0)  # resident before the baseline
        # Modules a load imports are not the load's memory: import them first.
        shardckpt.save({{"w": torch.ones(4)}}, {d!r} + "-tiny")
        shardckpt.load({{"w": torch.zeros(4)}}, {d!r} + "-tiny")
        base = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
        shardckpt.load(live, {d!r})
        peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
        g = torch.Generator().manual_seed(0)
        assert all(torch.equal(live[f"t{{i}}"], torch.randn(8 << 20, generator=g)) for i in range(n))
        print((peak - base) * 1024, file=sys.stderr)
        print((peak - base) * 1024)
        """
    )
    subprocess.run([sys.executable, "-c", code, "save"], check=True)
    out = subprocess.run([sys.executable, "-c", code, "load"], check=True, capture_output=True, text=True)
    growth = int(out.stdout.strip().splitlines()[-1])
    state = 1 << 30
    assert growth <= 0.10 * state, f"peak RSS grew by {growth / 2**20:.0f} MiB loading {state >> 20} MiB"


def test_damaged_block_mid_load_leaves_its_bytes_unwritten(tmp_path):
    # No damaged byte is delivered, also when the verified pieces go straight into the live tensor.
    d = str(tmp_path / "c")
    w = torch.randn(256, 16384)  # 16 MiB: 16 blocks of 1 MiB, two read ranges
    shardckpt.save({"w": w}, d)
    c = shardckpt.inspect(d).tensors["w"].chunks[0]
    f = os.path.join(d, c.file)
    raw = bytearray(open(f, "rb").read())
    raw[c.byte_offset + (21 << 19)] ^= 0x10  # in block 10
    open(f, "wb").write(bytes(raw))
    live = {"w": torch.zeros(256, 16384)}
    with pytest.raises(ChecksumMismatchError, match="block 10 ") as ei:
        shardckpt.load(live, d, io_threads=1)
    assert "Tensors already overwritten: w" in str(ei.value)
    flat, mib = live["w"].view(-1), 1 << 18  # floats in a MiB
    assert torch.equal(flat[: 2 * mib], w.view(-1)[: 2 * mib])  # the first blocks: verified and delivered
    assert not torch.count_nonzero(flat[10 * mib :])  # block 10 (damaged) and after: untouched


@pytest.mark.exclusive
@pytest.mark.slow
@pytest.mark.parametrize("source", ["native", "hf"])
def test_peak_extra_rss_of_a_load_stays_bounded_whatever_the_tensor_sizes(tmp_path, source):
    """A load holds at most its buffers beside the live state (<= 256 MiB with a margin): here 1.5 GiB, one tensor of 384 MiB."""
    d = str(tmp_path / "c")
    code = textwrap.dedent(
        f"""
        import resource, shutil, sys, torch, shardckpt
        from shardckpt import converters
        torch.set_num_threads(1)
        sizes = [96 << 20] + [4 << 20] * 40 + [4096] * 200 + [64 << 20] * 2  # floats: 1.5 GiB
        def state(fill):
            g = torch.Generator().manual_seed(0)
            return {{f"t{{i}}": (torch.randn(n, generator=g) if fill is None else torch.full((n,), fill))
                     for i, n in enumerate(sizes)}}
        if sys.argv[1] == "save":
            shardckpt.save(state(None), {d!r})
            if sys.argv[2] == "hf":  # only the layout this case loads stays on disk (1.5 GiB, not 3)
                converters.to_safetensors({d!r}, {d!r} + "-hf")
                shutil.rmtree({d!r})
            sys.exit(0)
        live = state(1.0)  # resident before the baseline
        path = {d!r} + ("-hf" if sys.argv[1] == "hf" else "")
        # Modules a load imports are not the load's memory: import them first.
        shardckpt.save({{"w": torch.ones(4)}}, {d!r} + "-tiny")
        shardckpt.load({{"w": torch.zeros(4)}}, {d!r} + "-tiny")
        base = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
        shardckpt.load(live, path)
        peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
        want = state(None)
        assert all(torch.equal(live[k], want[k]) for k in want)
        print((peak - base) * 1024)
        """
    )
    for args in (["save", source], [source]):
        out = subprocess.run([sys.executable, "-c", code, *args], capture_output=True, text=True)
        # What the child printed, in the failure itself, its last line first: a log cut short still shows
        # why (a save that fails for want of disk says so there).
        last = (out.stderr.strip().splitlines() or [""])[-1]
        assert out.returncode == 0, f"{' '.join(args)} exited {out.returncode}: {last}\n{out.stderr[-3000:]}"
    growth = int(out.stdout.strip().splitlines()[-1])
    assert growth <= 192 << 20, f"peak RSS grew by {growth / 2**20:.0f} MiB loading 1.5 GiB ({source})"
