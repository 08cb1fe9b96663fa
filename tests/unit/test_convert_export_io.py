"""The HF export's I/O: large writes (small tensors packed) and reads of the next tensors overlapping the writes.

Shown by what the writer sees (the size of each ``write`` call) and by the
order of events (a write waits for a later tensor's read to start), never by time.
"""

import threading

import crc32c
import pytest
import torch
from safetensors.torch import load_file
from shardckpt.converters import _common
from shardckpt.converters._source import OutEntry, Source, SrcTensor, whole_entry

import shardckpt
from shardckpt import _knobs, converters
from shardckpt._format.chunk import Chunk
from shardckpt._storage import Storage

#: Generous: the bound of a wait that the code under test must end by an event.
EVENT_WAIT_S = 30.0


def _record_writes(monkeypatch, calls, at=None):
    """Wrap every storage writer: ``calls`` gets ``(file name, bytes)`` per ``write`` call (and ``at``, if given,
    ``(file name, offset, bytes, thread name)`` per ``write_at``); returns the hook list."""
    real = Storage.open_write
    hooks = []

    def open_write(self, rel):
        w = real(self, rel)
        inner, inner_at = w.write, w.write_at

        def write(data):
            calls.append((rel, len(data)))
            for h in hooks:
                h(rel, sum(1 for r, _ in calls if r == rel))
            return inner(data)

        def write_at(data, offset):
            if at is None:
                raise AssertionError(f"{rel}: an unexpected positional write")
            at.append((rel, offset, len(data), threading.current_thread().name))
            return inner_at(data, offset)

        w.write = write
        w.write_at = write_at
        return w

    monkeypatch.setattr(Storage, "open_write", open_write)
    return hooks


@pytest.mark.parametrize("placed", [True, False])
def test_export_of_many_small_tensors_makes_few_large_writes(tmp_path, monkeypatch, placed):
    """256 tensors of 4 KiB: one data write (packed, or gathered by the placed writer), not one per tensor."""
    monkeypatch.setattr(_knobs, "EXPORT_PLACED", placed)
    g = torch.Generator().manual_seed(0)
    state = {f"w{i:03d}": torch.randn(1024, generator=g) for i in range(256)}
    shardckpt.save({"model": state}, str(tmp_path / "ck"))
    calls, at = [], []
    _record_writes(monkeypatch, calls, at)
    converters.to_safetensors(str(tmp_path / "ck"), str(tmp_path / "hf"))
    data = [(rel, n) for rel, n in calls if rel.endswith(".safetensors")]
    # The first write is the header; the data (1 MiB) fits one piece.
    if placed:
        assert len(data) == 1 and [(rel, n) for rel, _, n, _ in at] == [("model.safetensors", 256 * 4096)], (data, at[:10])
    else:
        assert len(data) == 2 and not at, (data[:10], at[:10])
        assert data[1][1] == 256 * 4096
    got = load_file(str(tmp_path / "hf" / "model.safetensors"))
    assert got.keys() == state.keys()
    for k, v in state.items():
        assert torch.equal(got[k], v), k


def test_export_reads_the_next_tensors_while_a_piece_is_written(tmp_path, monkeypatch):
    """The write of the first piece (tensors a, b) waits until the read of c has started: it must, or it waits in vain."""
    monkeypatch.setattr(_common, "BLOCK_BYTES", _common.WANT_BYTES)  # pieces of 4 MiB: a + b, then c
    g = torch.Generator().manual_seed(1)
    n = _common.WANT_BYTES // 4  # 4 MiB of fp32, 2 MiB once cast to bf16
    state = {k: torch.randn(n, generator=g) for k in "abc"}
    shardckpt.save({"model": state}, str(tmp_path / "ck"))
    c_read = threading.Event()
    real_read = _common.read_verified

    def read_verified(storage, wants, *args, **kw):
        if any(w.chunk.tensor == "model.c" for w in wants):
            c_read.set()
        return real_read(storage, wants, *args, **kw)

    monkeypatch.setattr(_common, "read_verified", read_verified)
    calls = []
    hooks = _record_writes(monkeypatch, calls)
    seen = []

    def first_data_write_waits(rel, k):
        if rel.endswith(".safetensors") and k == 2:  # after the header
            seen.append(c_read.wait(EVENT_WAIT_S))

    hooks.append(first_data_write_waits)
    converters.to_safetensors(str(tmp_path / "ck"), str(tmp_path / "hf"), dtype="bf16")
    assert seen == [True], "the writer waited for a read of the next tensor that never started: reads do not overlap writes"
    data = [nb for rel, nb in calls if rel.endswith(".safetensors")][1:]
    assert data == [2 * n * 2, n * 2]  # a + b (cast to bf16) in one write, then c
    got = load_file(str(tmp_path / "hf" / "model.safetensors"))
    for k, v in state.items():
        assert torch.equal(got[k], v.to(torch.bfloat16)), k


def _column_shards(tmp_path, full):
    """``full`` (7 x 8 fp32) saved as two column shards (tensor parallel), each chunk raw in its own file."""
    storage = Storage(str(tmp_path))
    chunks = []
    for i, (offs, sizes) in enumerate([((0, 0), (7, 3)), ((0, 3), (7, 5))]):
        data = full[:, offs[1] : offs[1] + sizes[1]].contiguous().view(torch.uint8).numpy().tobytes()
        (tmp_path / f"c{i}").write_bytes(data)
        chunks.append(Chunk(file=f"c{i}", byte_offset=0, nbytes=len(data), offsets=offs, sizes=sizes, key=f"c{i}",
                            crc32c=crc32c.crc32c(data)))
    t = SrcTensor(name="t", dtype="F32", shape=tuple(full.shape), chunks=chunks)
    return Source(url=str(tmp_path), storage=storage, tensors={"t": t}), t


@pytest.mark.parametrize("piece", [4, 12, 40, 100, 1 << 20])
@pytest.mark.parametrize("dtype", ["F32", "BF16"])
def test_packer_yields_every_entry_in_order_whatever_the_piece_size(tmp_path, piece, dtype):
    """Rows (32 bytes) wider than a piece get pieces of their own; entries pack across their boundaries; casts too."""
    full = torch.arange(56, dtype=torch.float32).reshape(7, 8)
    source, t = _column_shards(tmp_path, full)
    ents = [whole_entry(t, "a", dtype), OutEntry("b", t, 2 * 8, 5 * 8, (3, 8), dtype)]
    p = _common.Packer(_common.Reader(source), piece_bytes=piece)
    try:
        got = [bytes(x) for x in p.pieces(ents)]
    finally:
        p.close()
    want = full.to(torch.bfloat16) if dtype == "BF16" else full
    expect = torch.cat([want.reshape(-1), want[2:5].reshape(-1)]).view(torch.uint8).numpy().tobytes()
    assert b"".join(got) == expect
    rows = 8 * (2 if dtype == "BF16" else 4)
    assert all(len(x) <= max(piece, rows) for x in got), [len(x) for x in got]
    if piece >= len(expect):
        assert len(got) == 1  # both entries in one piece


def test_placed_export_writes_each_verified_piece_from_the_reader_threads_while_others_read(tmp_path, monkeypatch):
    """Uncast tensors to a local disk: reader threads pwrite pieces of >= 1 MiB at their offsets, every data byte once;
    the first piece's write waits until a later piece's read has started (reads overlap writes); same file as packed."""
    from shardckpt._storage import LocalStorage

    monkeypatch.setattr(_knobs, "EXPORT_PLACED", True)
    g = torch.Generator().manual_seed(2)
    mib = 1 << 20
    state = {"a": torch.randn(3 * mib, generator=g), "b": torch.randn(2 * mib, generator=g), "c": torch.randn(1000, generator=g)}
    shardckpt.save({"model": state}, str(tmp_path / "ck"))
    monkeypatch.setattr(_knobs, "EXPORT_PLACED", False)
    converters.to_safetensors(str(tmp_path / "ck"), str(tmp_path / "packed"))
    monkeypatch.setattr(_knobs, "EXPORT_PLACED", True)
    later_read = threading.Event()
    # A piece is mapped, or read with preadv (open_hot: a cold lane, or any
    # lane on a few cores); either way its read starts there.
    for name in ("map_range", "open_hot"):
        real = getattr(LocalStorage, name)

        def started(self, rel, start, stop, real=real):
            if start >= 8 * mib:  # beyond the first two pieces of "a" (4 MiB each)
                later_read.set()
            return real(self, rel, start, stop)

        monkeypatch.setattr(LocalStorage, name, started)
    calls, at = [], []
    _record_writes(monkeypatch, calls, at)
    seen = []
    first = threading.Lock()
    real_open = Storage.open_write

    def open_write(self, rel):
        w = real_open(self, rel)
        inner = w.write_at

        def write_at(data, offset):
            with first:
                mine = not seen
                if mine:
                    seen.append(None)
            if mine:  # the first positional write, whichever thread makes it
                seen[0] = later_read.wait(EVENT_WAIT_S)
            return inner(data, offset)

        w.write_at = write_at
        return w

    monkeypatch.setattr(Storage, "open_write", open_write)
    converters.to_safetensors(str(tmp_path / "ck"), str(tmp_path / "hf"), io_threads=3)
    assert seen == [True], "the first placed write waited for a later read that never started: reads do not overlap writes"
    data = [x for x in at if x[0] == "model.safetensors"]
    total = sum(v.numel() * 4 for v in state.values())
    spans = sorted((off, n) for _, off, n, _ in data)
    assert sum(n for _, n in spans) == total and all(a[0] + a[1] == b[0] for a, b in zip(spans, spans[1:])), spans
    assert all(n >= mib for _, n in spans[:-1]), spans  # the small tensor goes out with its neighbour or alone, last
    # Pieces go out from the threads that read them; gathered small tensors at the end, from the caller.
    assert all(name.startswith("shardckpt-r") for _, _, n, name in data if n >= mib), data
    assert len({name for *_, name in data}) > 1  # several threads wrote
    assert (tmp_path / "hf" / "model.safetensors").read_bytes() == (tmp_path / "packed" / "model.safetensors").read_bytes()
    got = load_file(str(tmp_path / "hf" / "model.safetensors"))
    for k, v in state.items():
        assert torch.equal(got[k], v), k


def test_placed_export_of_a_damaged_source_publishes_nothing(tmp_path, monkeypatch):
    """A flipped byte in the source: ChecksumMismatchError, and neither the data file nor the index is left."""
    from shardckpt.errors import ChecksumMismatchError

    monkeypatch.setattr(_knobs, "EXPORT_PLACED", True)
    g = torch.Generator().manual_seed(3)
    state = {"a": torch.randn(3 << 20, generator=g), "b": torch.randn(1 << 20, generator=g)}
    shardckpt.save({"model": state}, str(tmp_path / "ck"))
    data = max((tmp_path / "ck").rglob("*.safetensors"), key=lambda p: p.stat().st_size)
    raw = bytearray(data.read_bytes())
    raw[len(raw) - 100] ^= 0xFF  # in the last tensor's last block
    data.write_bytes(bytes(raw))
    with pytest.raises(ChecksumMismatchError):
        converters.to_safetensors(str(tmp_path / "ck"), str(tmp_path / "hf"), io_threads=3)
    left = [p.name for p in (tmp_path / "hf").rglob("*")] if (tmp_path / "hf").exists() else []
    assert not [n for n in left if n.endswith(".safetensors") or n.endswith(".json")], left
