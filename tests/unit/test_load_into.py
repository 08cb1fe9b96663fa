"""Pieces of files in memory read straight into the live tensors (``SHARDCKPT_LOAD_INTO``, issue 43).

A load into contiguous CPU tensors of the saved dtype ``preadv``-s each
checksum block of a piece of a tmpfs file into the tensor's memory and checks
its CRC-32C there; a block that fails is put back as it was. Real files in a
private directory of ``/dev/shm`` (tmpfs), real tensors (fp32, bf16, int64);
files on a disk are mapped as before.
"""

from __future__ import annotations

import os

import pytest
import torch

import shardckpt
from shardckpt import _knobs, _readers
from shardckpt._format import crc32c
from shardckpt._format.checksum import CHECK_COPIES, COPY_FUSED
from shardckpt._format.chunk import Chunk
from shardckpt._readers import Want, read_verified
from shardckpt._storage import Storage, _local
from shardckpt.errors import ChecksumMismatchError, CorruptCheckpointError

MIB = 1 << 20


@pytest.fixture(autouse=True)
def _into_on(monkeypatch):
    # The knob under test (off by default since wave 12); a disk file's pieces mapped (LOAD_LANES has its own tests).
    monkeypatch.setattr(_knobs, "LOAD_INTO", True)
    monkeypatch.setattr(_knobs, "LOAD_LANES", "map")


@pytest.fixture
def shm():
    """A private directory in /dev/shm (tmpfs), removed after the test."""
    import pathlib
    import shutil
    import tempfile

    if not os.path.isdir("/dev/shm") or _local.fs_type(os.stat("/dev/shm").st_dev) not in _local.MEMORY_FILESYSTEMS:
        pytest.skip("no tmpfs at /dev/shm")
    d = tempfile.mkdtemp(prefix="shardckpt-into-", dir="/dev/shm")
    os.chmod(d, 0o700)
    try:
        yield pathlib.Path(d)
    finally:
        shutil.rmtree(d, ignore_errors=True)


def _count_hot(monkeypatch):
    """File bytes read from files ``open_hot`` opened (cached pieces read straight into their destinations or the scratch)."""
    got = []
    real = _local.HotFile.readv

    def readv(self, offset, views):
        got.append(sum(len(v) for v in views))
        return real(self, offset, views)

    monkeypatch.setattr(_local.HotFile, "readv", readv)
    return got


def _state():
    g = torch.Generator().manual_seed(4)
    return {
        "w": torch.randn(512, 2048, generator=g),  # 4 MiB: 4 checksum blocks
        "h": torch.randn(300, 1000, generator=g).to(torch.bfloat16),
        "i": torch.randint(-(1 << 40), 1 << 40, (70_000,), generator=g),
        "n": torch.randn(7, generator=g),
    }


def _flip(d, name, at):
    c = shardckpt.inspect(d).tensors[name].chunks[0]
    f = os.path.join(d, c.file)
    raw = bytearray(open(f, "rb").read())
    raw[c.byte_offset + at] ^= 0x20
    open(f, "wb").write(bytes(raw))
    return c


def test_cached_pieces_are_read_straight_into_fp32_bf16_and_int_tensors(shm, monkeypatch):
    d = str(shm / "c")
    src = _state()
    shardckpt.save(src, d)
    hot = _count_hot(monkeypatch)
    maps = []
    real_map = _local.LocalStorage.map_range
    monkeypatch.setattr(_local.LocalStorage, "map_range", lambda self, *a: maps.append(a) or real_map(self, *a))
    live = {k: torch.zeros_like(v) for k, v in src.items()}
    ptrs = {k: v.data_ptr() for k, v in live.items()}
    shardckpt.load(live, d)
    assert all(torch.equal(live[k], src[k]) and live[k].data_ptr() == ptrs[k] for k in src)
    assert sum(hot) >= sum(v.numel() * v.element_size() for v in src.values()) and not maps, (hot, maps)
    # Checksums off: the same path, unchecked steps of at most INTO_STEP_BYTES.
    monkeypatch.setattr(_knobs, "CHECKSUMS", False)
    hot.clear()
    live = {k: torch.zeros_like(v) for k, v in src.items()}
    shardckpt.load(live, d)
    assert all(torch.equal(live[k], src[k]) for k in src) and hot and not maps
    monkeypatch.setattr(_knobs, "CHECKSUMS", True)
    # LOAD_INTO=0: the same bytes mapped, the same values.
    monkeypatch.setattr(_knobs, "LOAD_INTO", False)
    hot.clear()
    live = {k: torch.zeros_like(v) for k, v in src.items()}
    shardckpt.load(live, d)
    assert all(torch.equal(live[k], src[k]) for k in src)
    assert not hot and maps


def test_a_damaged_block_changes_nothing_of_a_live_tensors_piece_and_is_named_alone(shm, monkeypatch):
    # One piece of 4 blocks of w; block 2 damaged. A live tensor's piece is
    # read into the reader's scratch and checked whole before a byte is
    # copied out: w keeps every byte it had, only block 2 is named. Staged
    # (atomic=True), the piece goes straight into the staging tensor, the
    # same block alone is named, and nothing changes either.
    monkeypatch.setattr(_knobs, "LOAD_CPU_IO_THREADS", 1)
    d = str(shm / "c")
    w = torch.randn(512, 2048)
    shardckpt.save({"w": w}, d)
    _flip(d, "w", 2 * MIB + 12345)
    for atomic in (False, True):
        hot = _count_hot(monkeypatch)
        live = {"w": torch.full((512, 2048), 3.0)}
        with pytest.raises(ChecksumMismatchError) as ei:
            shardckpt.load(live, d, atomic=atomic)
        msg = str(ei.value)
        assert "w chunk" in msg and "block 2 " in msg and "block 3 " not in msg and "block 1 " not in msg, msg
        assert "already overwritten" not in msg, msg
        assert hot, "the piece was not read with preadv: the test does not exercise that path"
        assert torch.all(live["w"] == 3.0)


def test_one_pass_mapped_pieces_put_back_a_damaged_piece(tmp_path, monkeypatch):
    # LOAD_INTO=0 (mapped pieces, the default on many cores): verified and
    # copied in one pass (the C kernel), w's old bytes kept aside and put
    # back when block 3 fails; only block 3 is named.
    if not COPY_FUSED:
        pytest.skip("the one-pass kernel is not built here")
    monkeypatch.setattr(_knobs, "LOAD_INTO", False)
    monkeypatch.setattr(_knobs, "LOAD_FUSED", True)
    monkeypatch.setattr(_knobs, "LOAD_CPU_IO_THREADS", 1)
    calls = []
    real = _readers.copy_crc32c
    monkeypatch.setattr(_readers, "copy_crc32c", lambda *a: calls.append(len(a[1])) or real(*a))
    d = str(tmp_path / "c")
    src = {"w": torch.randn(512, 2048), "b": torch.randn(100)}
    shardckpt.save(src, d)
    live = {k: torch.zeros_like(v) for k, v in src.items()}
    shardckpt.load(live, d)
    assert all(torch.equal(live[k], src[k]) for k in src) and calls
    _flip(d, "w", 3 * MIB + 7)
    live = {k: torch.full_like(v, 5.0) for k, v in src.items()}
    with pytest.raises(ChecksumMismatchError, match="block 3 ") as ei:
        shardckpt.load(live, d)
    assert "block 2 " not in str(ei.value) and "already overwritten" not in str(ei.value), str(ei.value)
    assert torch.all(live["w"] == 5.0)


def test_damage_in_the_first_block_of_a_tensor_leaves_it_unchanged_and_unnamed(shm, monkeypatch):
    monkeypatch.setattr(_knobs, "LOAD_CPU_IO_THREADS", 1)
    d = str(shm / "c")
    src = _state()
    shardckpt.save(src, d)
    _flip(d, "w", 17)
    hot = _count_hot(monkeypatch)
    live = {k: torch.full_like(v, 2) for k, v in src.items()}
    with pytest.raises(ChecksumMismatchError, match="w chunk") as ei:
        shardckpt.load(live, d)
    assert hot
    named = str(ei.value).split("Tensors already overwritten:", 1)[1] if "overwritten:" in str(ei.value) else ""
    assert "w" not in named.replace(",", " ").split(), str(ei.value)
    assert torch.all(live["w"] == 2)
    for k in src:  # every other tensor: loaded whole and named, or untouched
        assert torch.equal(live[k], src[k]) and k in named or torch.all(live[k] == 2), k
    # atomic=True: the staging tensors take the bytes, nothing changes.
    live = {k: torch.full_like(v, 2) for k, v in src.items()}
    with pytest.raises(ChecksumMismatchError) as ei:
        shardckpt.load(live, d, atomic=True)
    assert "already overwritten" not in str(ei.value)
    assert all(torch.all(v == 2) for v in live.values())


def test_non_contiguous_and_cast_targets_fall_back_with_the_same_values(shm, monkeypatch):
    d = str(shm / "c")
    src = _state()
    shardckpt.save(src, d)
    hot = _count_hot(monkeypatch)
    wt = torch.zeros(2048, 512).t()  # w's shape, transposed storage: not contiguous
    live = {"w": wt, "h": torch.zeros(300, 1000), "i": torch.zeros(70_000, dtype=torch.int64), "n": torch.zeros(7)}
    shardckpt.load(live, d)  # h: bf16 saved, fp32 live (a cast)
    assert not wt.is_contiguous() and torch.equal(wt, src["w"])
    assert torch.equal(live["h"], src["h"].float()) and torch.equal(live["i"], src["i"])
    # only i and n (contiguous, the saved dtype) could go straight in; w and h never do
    assert sum(hot) < (src["w"].numel() * 4), hot


def _chunk(data, start, n, block, name="w"):
    body = data[start : start + n]
    return Chunk("f.bin", start, n, block_bytes=block, block_crcs=tuple(crc32c(body[i : i + block]) for i in range(0, n, block)),
                 tensor=name)


def test_into_pieces_are_planned_only_where_every_byte_has_one_destination():
    c = Chunk("f", 0, 64, block_bytes=16, block_crcs=(0, 0, 0, 0), tensor="w")
    units = [(k, _readers.Unit(16 * k, 16 * k + 16, 0, c, k)) for k in range(4)]
    dest = memoryview(bytearray(64))
    sink = lambda pos, data: None  # noqa: E731
    whole = Want(c, 0, 64, sink=sink, into=dest, restore=False)
    halves = [Want(c, 0, 32, sink=sink, into=dest[:32], restore=False), Want(c, 32, 64, sink=sink, into=dest[32:], restore=False)]
    assert _readers._into_ok(0, 64, units, [whole])
    assert _readers._into_ok(0, 64, units, halves)
    assert not _readers._into_ok(0, 64, units, [halves[0]])  # bytes read only to be checked
    assert not _readers._into_ok(0, 64, units, [Want(c, 0, 32, sink=sink, into=dest[:32], restore=False),
                                                Want(c, 40, 64, sink=sink, into=dest[40:], restore=False)])
    assert not _readers._into_ok(0, 64, units, [Want(c, 0, 64, sink=sink, restore=False)])  # no destination memory (a copy)
    assert not _readers._into_ok(0, 64, units, [whole, whole])  # two destinations of the same bytes: mapped, copied twice
    live = [Want(c, 0, 64, sink=sink, into=dest, restore=True)]
    assert not _readers._into_ok(0, 64, units, live)  # a live destination, checked: read into scratch, checked whole first
    assert _readers._into_ok(0, 64, [], live)  # unchecked (checksums off): nothing to wait for
    staged = [Want(c, 0, 64, sink=sink, into=dest, restore=False)]
    assert _readers._into_ok(0, 64, units, staged)


@pytest.mark.parametrize("restore", [False, True], ids=["staged", "live"])
def test_reader_delivers_verified_units_only_and_names_the_damaged_one(shm, restore):
    # Staged destinations (restore=False) are read into unit by unit: the
    # verified units before the damage are reported delivered, the damaged
    # one is not (its bytes stay in the staging, which the load discards).
    # Live ones (restore=True) get nothing of a piece with a damaged unit:
    # it was read into scratch and checked whole first.
    tmp_path = shm
    data = bytearray(bytes((i * 13 + 5) % 251 for i in range(1 << 16)))
    (tmp_path / "f.bin").write_bytes(bytes(data))
    c = _chunk(bytes(data), 4096, 48 << 10, 8 << 10)  # 6 blocks of 8 KiB
    dest = bytearray(b"\x01" * (48 << 10))
    views = memoryview(dest)
    calls = []
    wants = [Want(c, a, a + (16 << 10), a, sink=lambda pos, d, a=a: calls.append((a + pos, d and bytes(d))),
                  into=views[a : a + (16 << 10)], restore=restore) for a in range(0, 48 << 10, 16 << 10)]
    st = Storage(str(tmp_path))
    read_verified(st, wants, lambda *a: None, threads=1, piece_bytes=1 << 20, range_bytes=1 << 20)
    if not restore:  # straight in: each verified unit reported in place
        assert bytes(dest) == bytes(data[4096 : 4096 + (48 << 10)])
        assert all(d is None for _, d in calls) and sorted(p for p, _ in calls) == [0, 8192, 16384, 24576, 32768, 40960]
    else:  # copied out of the scratch, want by want: into ``into`` by the C kernel (reported with None), or handed over
        assert sorted(p for p, _ in calls) == [0, 16384, 32768]
        got = bytearray(dest)
        for p, d in calls:
            if d is not None:
                got[p : p + len(d)] = d
        assert bytes(got) == bytes(data[4096 : 4096 + (48 << 10)])
    data[4096 + (20 << 10)] ^= 1  # block 2
    (tmp_path / "f.bin").write_bytes(bytes(data))
    dest[:] = b"\x01" * (48 << 10)
    calls.clear()
    with pytest.raises(ChecksumMismatchError, match=r"w block 2 \(bytes 20480..28672\)") as ei:
        read_verified(st, wants, lambda *a: None, threads=1, piece_bytes=1 << 20, range_bytes=1 << 20)
    assert "block 3" not in str(ei.value) and "block 1 " not in str(ei.value)
    if not restore:
        assert sorted(p for p, _ in calls) == [0, 8192]  # only the verified blocks are reported delivered
        assert bytes(dest[: 16 << 10]) == bytes(data[4096 : 4096 + (16 << 10)])
        assert dest[24 << 10 :] == b"\x01" * (24 << 10)  # blocks 3-5 never written (checked in scratch)
    else:
        assert calls == [] and dest == b"\x01" * (48 << 10)  # nothing of the piece


def test_one_pass_puts_back_every_tensor_of_a_piece_whose_later_unit_is_damaged(shm, monkeypatch):
    # A mapped piece (LOAD_INTO=0), units of 8 KiB over wants of 3 KiB
    # (small tensors): block 0 verified and copied into three tensors, block
    # 1 damaged: every destination byte the piece wrote (blocks 0 and 1,
    # seven tensors) is put back from the bytes kept aside, and no tensor is
    # reported delivered.
    if not COPY_FUSED:
        pytest.skip("the one-pass kernel is not built here")
    monkeypatch.setattr(_knobs, "LOAD_INTO", False)
    monkeypatch.setattr(_knobs, "LOAD_FUSED", True)
    calls_kernel = []
    real = _readers.copy_crc32c
    monkeypatch.setattr(_readers, "copy_crc32c", lambda *a: calls_kernel.append(1) or real(*a))
    data = bytearray(os.urandom(48 << 10))
    (shm / "f.bin").write_bytes(bytes(data))
    c = _chunk(bytes(data), 0, 48 << 10, 8 << 10)
    dest = bytearray(os.urandom(48 << 10))
    old = bytes(dest)
    views = memoryview(dest)
    step = 3 << 10
    calls = []
    wants = [Want(c, a, min(a + step, 48 << 10), a, sink=lambda pos, d, a=a: calls.append(a + pos),
                  into=views[a : min(a + step, 48 << 10)], restore=True) for a in range(0, 48 << 10, step)]
    st = Storage(str(shm))
    read_verified(st, wants, lambda *a: None, threads=1, piece_bytes=1 << 20, range_bytes=1 << 20)
    assert bytes(dest) == bytes(data) and len(calls) > 16 and calls_kernel
    dest[:] = old
    calls.clear()
    data[(8 << 10) + 5000] ^= 0x80  # block 1: bytes 8192..16384
    (shm / "f.bin").write_bytes(bytes(data))
    with pytest.raises(ChecksumMismatchError, match=r"block 1 \(bytes 8192..16384\)"):
        read_verified(st, wants, lambda *a: None, threads=1, piece_bytes=1 << 20, range_bytes=1 << 20)
    assert bytes(dest) == old and calls == []


def test_files_on_a_disk_are_mapped_as_before_even_when_cached(tmp_path, monkeypatch):
    # Their pages are never probed here: a probe starts the kernel's readahead,
    # which would change what the cold-read rules (O_DIRECT, WILLNEED) see.
    if _local.fs_type(os.stat(tmp_path).st_dev) in _local.MEMORY_FILESYSTEMS:
        pytest.skip("the temporary directory is on tmpfs here")
    d = str(tmp_path / "c")
    src = _state()
    shardckpt.save(src, d)
    for root, _, files in os.walk(d):
        for n in files:
            open(os.path.join(root, n), "rb").read()  # cached
    hot = _count_hot(monkeypatch)
    live = {k: torch.zeros_like(v) for k, v in src.items()}
    shardckpt.load(live, d)
    assert all(torch.equal(live[k], src[k]) for k in src)
    assert not hot


@pytest.mark.parametrize("restore", [False, True], ids=["staged", "live"])
def test_a_file_truncated_under_the_read_is_refused(shm, monkeypatch, restore):
    data = bytes((i * 7 + 1) % 251 for i in range(1 << 16))
    (shm / "f.bin").write_bytes(data)
    c = _chunk(data, 0, 32 << 10, 8 << 10)
    dest = bytearray(b"\x05" * (32 << 10))
    real = _local.LocalStorage.open_hot

    def open_then_truncate(self, rel, start, stop):
        f = real(self, rel, start, stop)  # the size was checked here
        os.truncate(self.path(rel), 20 << 10)  # another process cuts the file in block 2
        return f

    monkeypatch.setattr(_local.LocalStorage, "open_hot", open_then_truncate)
    got = []
    w = Want(c, 0, 32 << 10, "w", sink=lambda pos, d: got.append(pos), into=memoryview(dest), restore=restore)
    with pytest.raises(CorruptCheckpointError, match="truncated"):
        read_verified(Storage(str(shm)), [w], lambda *a: None, threads=1, piece_bytes=1 << 20, range_bytes=1 << 20)
    if restore:  # a live destination: nothing of the piece
        assert got == [] and dest == b"\x05" * (32 << 10)
    else:  # staged: blocks 0-1 verified in place and reported, nothing after them
        assert got == [0, 8 << 10] and bytes(dest[: 16 << 10]) == data[: 16 << 10]


def test_a_block_of_more_small_tensors_than_one_preadv_takes(shm, monkeypatch):
    # An HF file of 2,000 tensors of 16 bytes: one read unit spans them all,
    # 2,000 buffers, over IOV_MAX (1,024), which one preadv refuses with
    # EINVAL (the fresh-clone gate of wave 12: test_many_keys' HF case).
    from safetensors.torch import save_file

    d = str(shm / "hf")
    os.mkdir(d)
    src = {f"t{i:04d}": torch.full((4,), float(i)) for i in range(2000)}
    save_file(src, os.path.join(d, "model.safetensors"))
    hot = _count_hot(monkeypatch)
    live = {k: torch.zeros_like(v) for k, v in src.items()}
    shardckpt.load(live, d)
    assert sum(hot) >= 2000 * 16, hot  # the pieces were read straight into the tensors
    assert all(torch.equal(live[k], src[k]) for k in src)
    assert _local.IOV_MAX < 2000  # so the test crosses the limit


def test_a_piece_of_thousands_of_tensors_costs_linear_cpu(shm):
    # Each checksum unit's destinations were found by a pass over every want
    # of its piece: quadratic in the tensors of one piece (4,000 tensors of
    # 32 bytes: 8 s of CPU where 1,000 took 0.7 s; the slow
    # test_many_keys::test_cpu_time_grows_at_most_linearly with
    # SHARDCKPT_LOAD_LANES=read never finished). A ratio, not a time.
    import time

    def cpu(n: int) -> float:
        d = str(shm / f"c{n}")
        src = {f"k{i:05d}": torch.full((8,), float(i)) for i in range(n)}
        shardckpt.save(src, d)
        best = float("inf")
        for _ in range(2):
            live = {k: torch.zeros_like(v) for k, v in src.items()}
            t = time.process_time()
            shardckpt.load(live, d, atomic=True)  # staged: straight in, unit by unit (live ones: scratch)
            best = min(best, time.process_time() - t)
        assert all(torch.equal(live[k], src[k]) for k in src)
        return best

    small, large = cpu(1000), cpu(4000)
    assert large < 7 * small, (small, large)  # 4x the tensors: linear is ~4x (2-3x measured), quadratic 16x


def test_read_pieces_are_a_few_mib_into_the_scratch_and_larger_mapped(shm, monkeypatch):
    # The reader sizes the pieces of a CPU load's sink wants by how they are
    # read: into the scratch (LOAD_INTO) SCRATCH_PIECE_BYTES (4 MiB), mapped
    # MAPPED_PIECE_BYTES (8 MiB: on 16 cores each piece's mapping and job cost
    # more than its bytes), at most READ_BLOCK_BYTES; the caller names none.
    src = {"w": torch.randn(6 << 20)}  # 24 MiB
    shardckpt.save(src, str(shm / "ck"), no_dist=True)
    real_map = _local.LocalStorage.map_range
    maps = []
    monkeypatch.setattr(_local.LocalStorage, "map_range", lambda self, rel, lo, hi: maps.append(hi - lo) or real_map(self, rel, lo, hi))
    reads = _count_hot(monkeypatch)
    for into, block, want in ((True, 32 << 20, _readers.SCRATCH_PIECE_BYTES), (False, 32 << 20, _readers.MAPPED_PIECE_BYTES),
                              (False, 2 << 20, 2 << 20)):
        monkeypatch.setattr(_knobs, "LOAD_INTO", into)
        monkeypatch.setattr(_knobs, "READ_BLOCK_BYTES", block)
        maps.clear(), reads.clear()
        live = {"w": torch.zeros(6 << 20)}
        shardckpt.load(live, str(shm / "ck"), io_threads=2)
        assert torch.equal(live["w"], src["w"])
        got = reads if into else maps
        assert not (maps if into else reads) and got and max(got) == want, (into, block, got)
    assert (_readers.SCRATCH_PIECE_BYTES, _readers.MAPPED_PIECE_BYTES) == (4 << 20, 8 << 20)


def test_check_fill_steps_partition_the_piece_and_deliver_each_step_after_its_crcs():
    # Pure: units of 16 bytes from byte 8 of a 72-byte piece (bytes 0-7 and
    # 72 lie in no unit), steps of 32 bytes. Each step's CRCs come before its
    # delivery and after the previous step's: the step is still in cache.
    import threading

    data = bytes(range(80))
    c = Chunk("f", 0, 64, block_bytes=16, block_crcs=tuple(crc32c(data[8 + 16 * k : 24 + 16 * k]) for k in range(4)), tensor="w")
    units = [(k, _readers.Unit(8 + 16 * k, 24 + 16 * k, c.block_crcs[k], c, k)) for k in range(4)]
    events = []
    real = _readers.crc32c

    def crc(v, *a):
        events.append(("crc", len(v)))
        return real(v, *a)

    got = bytearray(72)

    def sink(pos, d):
        events.append(("put", pos, len(d)))
        got[pos : pos + len(d)] = d

    want = Want(Chunk("f", 0, 72, tensor="x"), 0, 72, sink=sink)
    fetched = []
    view = memoryview(bytearray(data[:72]))
    mp = pytest.MonkeyPatch()
    mp.setattr(_readers, "crc32c", crc)
    try:
        stop = threading.Event()
        out, good = _readers._check_fill(0, view, units[::-1], [want], stop, 32, fetch=lambda a, b: fetched.append((a, b)))
    finally:
        mp.undo()
    assert good == 4 and not stop.is_set() and sorted(k for k, *_ in out) == [0, 1, 2, 3]
    assert fetched == [(0, 40), (40, 72)]  # the steps partition the piece
    assert events == [("crc", 16), ("crc", 16), ("put", 0, 40), ("crc", 16), ("crc", 16), ("put", 40, 32)]
    assert bytes(got) == data[:72]
    # One unit damaged: the steps before it delivered, its step and every later one not, every unit checked.
    units[2] = (2, units[2][1]._replace(crc=units[2][1].crc ^ 1))
    events.clear()
    got[:] = bytes(72)
    stop = threading.Event()
    out, good = _readers._check_fill(0, view, units, [want], stop, 16)
    assert stop.is_set() and good == 3 and len(out) == 4
    assert [e[1:] for e in events if e[0] == "put"] == [(0, 24), (24, 16)]
    assert bytes(got[:40]) == data[:40] and bytes(got[40:]) == bytes(32)


@pytest.mark.parametrize("where", ["mapped", "mapped-kernel", "scratch"])
def test_a_damaged_block_leaves_its_step_and_the_rest_of_the_piece_undelivered(shm, monkeypatch, where):
    # A live tensor's piece (restore=True) of 6 blocks of 8 KiB, checked and
    # delivered in steps of two blocks: mapped (LOAD_INTO=0, two passes), in
    # Python or by the C kernel (check_copy: into the tensor's bytes, the
    # sink told once), and read into the scratch a step at a time
    # (SCRATCH_STEP_BYTES). Block 3 damaged: the first step delivered
    # (verified), the second and third never, only block 3 named; undamaged,
    # the tensor holds the saved bytes.
    kernel = where == "mapped-kernel"
    if kernel and not CHECK_COPIES:
        pytest.skip("the C kernel is not built here")
    monkeypatch.setattr(_readers, "CHECK_IN_KERNEL", int(kernel))
    monkeypatch.setattr(_knobs, "LOAD_INTO", where == "scratch")
    monkeypatch.setattr(_knobs, "LOAD_FUSED", False)
    monkeypatch.setattr(_readers, "MAPPED_STEP_BYTES", 16 << 10)
    monkeypatch.setattr(_readers, "SCRATCH_STEP_BYTES", 16 << 10 if where == "scratch" else 0)
    reads = _count_hot(monkeypatch)
    data = bytearray(os.urandom(48 << 10))
    (shm / "f.bin").write_bytes(bytes(data))
    c = _chunk(bytes(data), 0, 48 << 10, 8 << 10)
    dest = bytearray(b"\x01" * (48 << 10))
    calls = []
    w = Want(c, 0, 48 << 10, 0, sink=lambda pos, d: calls.append(pos) or d is None or dest.__setitem__(slice(pos, pos + len(d)), d),
             into=memoryview(dest), restore=True)
    st = Storage(str(shm))
    read_verified(st, [w], lambda *a: None, threads=1, piece_bytes=1 << 20, range_bytes=1 << 20)
    assert bytes(dest) == bytes(data) and calls == ([0] if kernel else [0, 16 << 10, 32 << 10])
    assert reads == ([16 << 10] * 3 if where == "scratch" else [])  # a step read at a time, or mapped
    data[(24 << 10) + 100] ^= 0x40  # block 3: bytes 24576..32768
    (shm / "f.bin").write_bytes(bytes(data))
    dest[:] = b"\x01" * (48 << 10)
    calls.clear()
    with pytest.raises(ChecksumMismatchError, match=r"w block 3 \(bytes 24576..32768\)") as ei:
        read_verified(st, [w], lambda *a: None, threads=1, piece_bytes=1 << 20, range_bytes=1 << 20)
    assert "block 2 " not in str(ei.value) and "block 4" not in str(ei.value)
    assert calls == [0] and bytes(dest[: 16 << 10]) == bytes(data[: 16 << 10])
    assert dest[16 << 10 :] == b"\x01" * (32 << 10)
