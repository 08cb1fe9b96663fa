"""The I/O fast paths: CRC32C combining, blocked reads checksummed per block, write-behind.

Block sizes are shrunk so small tensors take the same code paths as
gigabyte checkpoints: chunks spanning many read blocks (and blocks spanning
several chunks), per-block checksums combined per chunk, pinned streaming of
GPU chunks.
"""

from __future__ import annotations

import os
import random

import crc32c as _crc
import pytest
import torch

import shardckpt
from shardckpt import _io, _knobs, _storage
from shardckpt._format.chunk import Chunk
from shardckpt._readers import Want, read_verified
from shardckpt._storage import Storage
from shardckpt.errors import ChecksumMismatchError, CorruptCheckpointError


@pytest.fixture
def small_blocks(monkeypatch):
    monkeypatch.setattr(_knobs, "READ_BLOCK_BYTES", 4099)
    monkeypatch.setattr(_knobs, "LOAD_RANGE_BYTES", 8192)
    monkeypatch.setattr(_knobs, "WRITE_BLOCK_BYTES", 3000)
    monkeypatch.setattr(_storage, "WRITEBACK_BYTES", 5000)


def test_crc32c_combine_matches_whole_crc():
    rng = random.Random(0)
    for _ in range(300):
        a = rng.randbytes(rng.choice([0, 1, 7, 100, 4096, rng.randint(0, 20000)]))
        b = rng.randbytes(rng.choice([0, 1, 3, 64, rng.randint(0, 20000)]))
        assert _io.crc32c_combine(_crc.crc32c(a), _crc.crc32c(b), len(b)) == _crc.crc32c(a + b)
    # many pieces folded left, as the reader does
    data = rng.randbytes(100_003)
    cuts = sorted(rng.sample(range(1, len(data)), 20))
    acc = 0
    for lo, hi in zip([0] + cuts, cuts + [len(data)]):
        acc = _io.crc32c_combine(acc, _crc.crc32c(data[lo:hi]), hi - lo)
    assert acc == _crc.crc32c(data)


def _state(seed: int):
    g = torch.Generator().manual_seed(seed)
    return {
        # byte lengths that are not multiples of the blocks
        "big": torch.randn(37, 301, generator=g),
        "f64": torch.randn(1234, generator=g, dtype=torch.float64),
        "half": torch.randn(3001, generator=g).to(torch.bfloat16),
        "u8": torch.randint(0, 255, (9999,), generator=g, dtype=torch.uint8),
        "flags": torch.rand(77, generator=g) > 0.5,
        "scalar": torch.tensor(3.5),
        "empty": torch.empty(0, 5),
        "step": 4,
    }


@pytest.mark.parametrize("where", ["local", "memory"])
def test_roundtrip_through_blocked_reads(tmp_path, small_blocks, where):
    # memory:// takes the remote path: one batched request per file, then the
    # per-block checksums.
    url = str(tmp_path / "c") if where == "local" else f"memory://io-fastpaths/{tmp_path.name}"
    src = _state(1)
    shardckpt.save(src, url)
    dst = {k: (torch.zeros_like(v) if isinstance(v, torch.Tensor) else 0) for k, v in src.items()}
    keep = {k: v.data_ptr() for k, v in dst.items() if isinstance(v, torch.Tensor)}
    shardckpt.load(dst, url)
    for k, v in src.items():
        if isinstance(v, torch.Tensor):
            assert torch.equal(dst[k], v), k
            assert dst[k].data_ptr() == keep[k], f"{k} was replaced, not filled in place"
        else:
            assert dst[k] == v


class _Bag:
    """A Stateful object whose tensors exist only after loading (like lazy optimizer state)."""

    def __init__(self, sd=None):
        self.sd = dict(sd or {})

    def state_dict(self):
        return dict(self.sd)

    def load_state_dict(self, sd):
        self.sd = dict(sd)


def test_created_tensors_come_from_staging(tmp_path, small_blocks):
    # Tensors the live state lacks are created from the checkpoint; saved whole,
    # they are views of the verified staging bytes, aligned for their dtype.
    src = {k: v for k, v in _state(2).items() if isinstance(v, torch.Tensor)}
    shardckpt.save({"bag": _Bag(src)}, str(tmp_path / "o"))
    bag = _Bag()
    shardckpt.load({"bag": bag}, str(tmp_path / "o"))
    assert sorted(bag.sd) == sorted(src)
    for k, v in src.items():
        t = bag.sd[k]
        assert t.dtype == v.dtype and t.shape == v.shape and torch.equal(t, v), k
        assert t.data_ptr() % t.element_size() == 0


def test_bit_flip_inside_a_multi_block_chunk_is_caught(tmp_path, small_blocks):
    src = _state(3)
    path = str(tmp_path / "c")
    shardckpt.save(src, path)
    m = shardckpt.inspect(path)
    c = m.tensors["big"].chunks[0]
    assert c.nbytes > 4 * _knobs.READ_BLOCK_BYTES  # spans several blocks
    f = os.path.join(path, c.file)
    with open(f, "r+b") as fh:
        pos = c.byte_offset + c.nbytes * 2 // 3
        fh.seek(pos)
        byte = fh.read(1)
        fh.seek(pos)
        fh.write(bytes([byte[0] ^ 0x10]))
    dst = {k: (torch.zeros_like(v) if isinstance(v, torch.Tensor) else 0) for k, v in src.items()}
    # atomic=True: all-or-nothing staging
    with pytest.raises(ChecksumMismatchError, match=r"chunk 'big'.*crc32c"):
        shardckpt.load(dst, path, atomic=True)
    assert all(not v.any() for v in dst.values() if isinstance(v, torch.Tensor)), "a failed load touched a tensor"
    # streaming (the default): whatever changed before the damaged block is named
    with pytest.raises(ChecksumMismatchError, match=r"chunk 'big'.*crc32c") as ei:
        shardckpt.load(dst, path)
    changed = [k for k, v in dst.items() if isinstance(v, torch.Tensor) and v.any()]
    assert all(k in str(ei.value) for k in changed), (changed, str(ei.value))


def test_file_ending_mid_chunk_is_truncated(tmp_path, small_blocks):
    src = _state(5)
    path = str(tmp_path / "c")
    shardckpt.save(src, path)
    c = shardckpt.inspect(path).tensors["big"].chunks[0]
    # the reader on its own (load checks sizes first): the file ends mid-chunk
    os.truncate(os.path.join(path, c.file), c.byte_offset + c.nbytes // 2 + 5)
    chunk = Chunk(c.file, c.byte_offset, c.nbytes, crc32c=c.crc32c, tensor="big", key="big")
    with pytest.raises(CorruptCheckpointError, match="truncated"):
        read_verified(Storage(path), [Want(chunk, 0, c.nbytes)], lambda *a: None)


def test_write_behind_keeps_bytes_and_reads_back(tmp_path, small_blocks):
    st = Storage(str(tmp_path))
    data = os.urandom(50_000)
    w = st.open_write("data/x.bin")
    for i in range(0, len(data), 1234):
        w.write(data[i : i + 1234])
    w.close()
    assert (tmp_path / "data" / "x.bin").read_bytes() == data


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a GPU")
def test_cuda_chunks_stream_through_pinned_buffers(tmp_path, small_blocks):
    src = {k: (v.cuda() if isinstance(v, torch.Tensor) else v) for k, v in _state(6).items()}
    shardckpt.save(src, str(tmp_path / "c"))
    shardckpt.verify(str(tmp_path / "c"))
    dst = {k: (torch.zeros_like(v) if isinstance(v, torch.Tensor) else 0) for k, v in src.items()}
    shardckpt.load(dst, str(tmp_path / "c"))
    for k, v in src.items():
        if isinstance(v, torch.Tensor):
            assert dst[k].is_cuda and torch.equal(dst[k], v), k
