"""Format v2: the manifest's own checksum, index files with block checksums, ranged resolution, strict values."""

from __future__ import annotations

import json
import os
import random
import subprocess
import sys

import pytest
import torch

import shardckpt
from shardckpt._format import (
    FORMAT_VERSION,
    MetaCache,
    manifest_from_bytes,
    manifest_to_bytes,
    open_manifest,
    resolve_chunks,
)
from shardckpt._format.checksum import BlockCrcs, crc32c
from shardckpt._format.values import decode_value
from shardckpt._storage import Storage
from shardckpt.errors import CheckpointError, ChecksumMismatchError, CorruptCheckpointError

DATA = os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "data")
GOLDEN_DIR = os.path.join(DATA, "v1_golden")


def _state(seed: int = 0):
    g = torch.Generator().manual_seed(seed)
    return {
        # 3 MiB: several 1 MiB blocks, the last one short
        "big": torch.randn(3 * 262144 + 77, generator=g),
        "w": torch.randn(4, 5, generator=g).to(torch.bfloat16),
        "scalar": torch.tensor(2.5),
        "empty": torch.zeros(0, 3),
        "step": 1000,
        "lr": 0.001,
        "name": "r\u00e9sum\u00e9",
        "inf": float("-inf"),
    }


@pytest.fixture(scope="module")
def saved(tmp_path_factory):
    path = str(tmp_path_factory.mktemp("v2") / "ck")
    state = _state()
    shardckpt.save(state, path)
    return path, state


def test_save_writes_v2_with_a_checksummed_manifest(saved):
    path, _ = saved
    raw = json.loads(open(os.path.join(path, "manifest.json"), "rb").read())
    assert raw["format_version"] == FORMAT_VERSION == 5
    # v3: the rank's files are in the compact table, none listed one by one.
    assert raw["files"] == {} and raw["indexes"] == {} and len(raw["file_table"]["data_sizes"]) == raw["world_size"]
    want = raw.pop("manifest_crc32c")
    # Canonical except that the user's values keep their order (docs/format.md, "Key order").
    top = {k: raw[k] if k in ("values", "extra") else json.loads(json.dumps(raw[k], sort_keys=True)) for k in sorted(raw)}
    body = (json.dumps(top, separators=(",", ":"), allow_nan=False) + "\n").encode()
    assert crc32c(body) == want
    # No per-chunk records in the manifest: regular tensors carry a layout record.
    assert all("chunks" not in t and "regular" in t for t in raw["tensors"].values())
    m = shardckpt.inspect(path)
    assert m.version == 5 and m.block_bytes == 1 << 20 and len(m.indexes) == 1
    assert set(m.indexes) <= set(m.files)
    big = m.tensors["big"].chunks[0]
    assert len(big.blocks) == 4
    # the chunk CRC is the combine of its blocks, and each block checks against the bytes
    data = open(os.path.join(path, big.file), "rb").read()[big.byte_offset : big.byte_offset + big.nbytes]
    assert big.crc32c == crc32c(data)
    assert big.blocks == [crc32c(data[i : i + (1 << 20)]) for i in range(0, len(data), 1 << 20)]
    assert manifest_from_bytes(manifest_to_bytes(m)).save_id == m.save_id  # round trip keeps the checksum valid


def test_round_trip_bit_exact(saved):
    path, state = saved
    live = {k: (torch.zeros_like(v) if isinstance(v, torch.Tensor) else type(v)()) for k, v in state.items()}
    shardckpt.load(live, path)
    for k, v in state.items():
        if isinstance(v, torch.Tensor):
            assert v.dtype == live[k].dtype and torch.equal(v, live[k]), k
        else:
            assert live[k] == v, k
    assert shardckpt.verify(path).version == FORMAT_VERSION


def test_resolve_reads_only_the_index_and_gives_blocks(saved):
    path, state = saved
    st = Storage(path)
    m = open_manifest(st, chunks=False)
    assert all(not t.chunks for t in m.tensors.values())  # nothing materialized
    cache = MetaCache()
    got = resolve_chunks(m, st, "big", [((300000,), (10,))], cache=cache)
    assert len(got) == 1 and got[0].block_bytes == 1 << 20 and len(got[0].block_crcs) == 4
    assert 0 < cache.bytes_read == m.indexes[next(iter(m.indexes))].size
    c = got[0]
    lo, hi = 300000 * 4, 300010 * 4
    start, stop = c.unit_bounds(lo, hi)
    first = start // c.block_bytes
    assert (start, stop, first) == (1 << 20, 2 << 20, 1)
    raw = open(os.path.join(path, c.file), "rb").read()[c.byte_offset + start : c.byte_offset + stop]
    assert crc32c(raw) == c.block_crcs[first]
    # again from the cache: no more metadata read
    resolve_chunks(m, st, "w", [((0, 0), (4, 5))], cache=cache)
    assert cache.bytes_read == m.indexes[next(iter(m.indexes))].size
    assert resolve_chunks(m, st, "big", [((10**7,), (1,))], cache=cache) == []


def test_v1_golden_resolves_with_whole_chunk_checksums():
    st = Storage(GOLDEN_DIR)
    m = open_manifest(st, chunks=False)
    assert m.version == 1
    got = resolve_chunks(m, st, "sharded", [((0, 0), (5, 3))])
    assert [c.offsets for c in got] == [(0, 0), (3, 0)]
    assert all(c.block_bytes == 0 and c.block_crcs == () and c.crc32c is not None and not c.blocked for c in got)
    assert shardckpt.verify(GOLDEN_DIR).version == 1


def _flip(path: str, rel: str, bit: int) -> None:
    p = os.path.join(path, rel)
    data = bytearray(open(p, "rb").read())
    data[bit // 8] ^= 1 << (bit % 8)
    open(p, "wb").write(bytes(data))


def test_manifest_bit_flips_never_load_silently(saved, tmp_path):
    path, state = saved
    good = open(os.path.join(path, "manifest.json"), "rb").read()
    want = manifest_from_bytes(good).to_json()
    rng = random.Random(11)
    bits = rng.sample(range(len(good) * 8), min(300, len(good) * 8))
    equivalent = 0
    for bit in bits:
        data = bytearray(good)
        data[bit // 8] ^= 1 << (bit % 8)
        try:
            m = manifest_from_bytes(bytes(data))
        except CheckpointError:
            continue
        # Only a flip that changes no meaning may pass (say a hex digit's case in "\u00e9").
        assert m.to_json() == want, f"bit {bit}: a damaged manifest was accepted with different content"
        equivalent += 1
    assert equivalent <= 3
    # Through the public calls too: verify and load raise, the state is untouched.
    d = str(tmp_path / "ck")
    import shutil

    for bit in bits[:12]:
        shutil.rmtree(d, ignore_errors=True)
        shutil.copytree(path, d)
        _flip(d, "manifest.json", bit)
        live = {"big": torch.zeros(state["big"].shape), "step": 0, "lr": 0.0}
        try:
            shardckpt.load(live, d, strict=False)
        except CheckpointError:
            assert live["step"] == 0 and not live["big"].any()
            with pytest.raises(CheckpointError):
                shardckpt.verify(d)
        else:
            assert live["step"] == 1000 and live["lr"] == 0.001 and torch.equal(live["big"], state["big"])


def test_index_file_bit_flip_is_caught(saved, tmp_path):
    import shutil

    path, _ = saved
    d = str(tmp_path / "ck")
    shutil.copytree(path, d)
    rel = next(iter(shardckpt.inspect(d).indexes))
    _flip(d, rel, 8 * 40 + 3)
    with pytest.raises(ChecksumMismatchError, match="index file damaged"):
        shardckpt.verify(d)
    with pytest.raises(ChecksumMismatchError):
        shardckpt.load({"w": torch.zeros(4, 5, dtype=torch.bfloat16)}, d, strict=False)


def test_data_bit_flip_names_the_block(saved, tmp_path):
    import shutil

    path, _ = saved
    d = str(tmp_path / "ck")
    shutil.copytree(path, d)
    m = shardckpt.inspect(d)
    c = m.tensors["big"].chunks[0]
    _flip(d, c.file, 8 * (c.byte_offset + (2 << 20) + 5))
    with pytest.raises(ChecksumMismatchError) as ei:
        shardckpt.verify(d)
    lo = c.byte_offset + (2 << 20)
    assert f"[{lo}, {lo + (1 << 20)})" in str(ei.value)
    with pytest.raises(ChecksumMismatchError):
        shardckpt.load({"big": torch.zeros(c.sizes)}, d, strict=False)


def test_block_crcs_do_not_depend_on_how_the_bytes_arrive():
    data = bytes(range(256)) * 41  # 10,496 bytes: two 4 KiB blocks and a short one
    whole = BlockCrcs(4096)
    whole.update(data)
    pieces = BlockCrcs(4096)
    for i in range(0, len(data), 1000):
        pieces.update(memoryview(data)[i : i + 1000])
    assert whole.finish() == pieces.finish() == [crc32c(data[i : i + 4096]) for i in range(0, len(data), 4096)]
    assert whole.crc == pieces.crc == crc32c(data)


def test_float_tag_must_be_nan_or_inf():
    assert decode_value({"__shardckpt__": "float", "value": "-inf"}) == float("-inf")
    for text in ("1e5000", "-1e999", "infinity", "NaN", " inf", 5):
        with pytest.raises(ValueError, match="not 'nan', 'inf' or '-inf'"):
            decode_value({"__shardckpt__": "float", "value": text})


def test_float_tag_1e5000_in_a_checksummed_manifest_is_refused(saved, tmp_path):
    import shutil

    path, _ = saved
    d = str(tmp_path / "ck")
    shutil.copytree(path, d)
    m = open_manifest(Storage(d), chunks=False)
    m.values["lr"] = {"__shardckpt__": "float", "value": "1e5000"}
    open(os.path.join(d, "manifest.json"), "wb").write(manifest_to_bytes(m))  # a valid checksum
    live = {"lr": 0.5}
    with pytest.raises(CheckpointError, match="1e5000"):
        shardckpt.load(live, d, strict=False)
    assert live["lr"] == 0.5


def test_shared_file_bytes_are_refused_v1():
    sys.path.insert(0, DATA)
    try:
        import make_golden
    finally:
        sys.path.remove(DATA)
    m = make_golden.golden_manifest()
    b = m.tensors["b"].chunks[0]
    w0 = next(c for c in m.tensors["w"].chunks if c.file == b.file)
    b.byte_offset = w0.byte_offset + 4  # inside w's bytes, still inside the file
    with pytest.raises(CorruptCheckpointError, match="share file bytes"):
        manifest_from_bytes(manifest_to_bytes(m))


def test_shared_file_bytes_are_refused_in_an_index(saved, tmp_path):
    import shutil

    from shardckpt._format.manifest import IndexMeta

    path, _ = saved
    d = str(tmp_path / "ck")
    shutil.copytree(path, d)
    st = Storage(d)
    m = open_manifest(st, chunks=False)
    rel = next(iter(m.indexes))
    idx = json.loads(open(os.path.join(d, rel), "rb").read())
    at = idx["rows"].index("byte_offset")
    recs = {r[0]: r for r in idx["chunks"]}
    recs["scalar"][at] = recs["big"][at]  # claims 4 of big's bytes
    body = (json.dumps(idx, sort_keys=True, separators=(",", ":")) + "\n").encode()
    open(os.path.join(d, rel), "wb").write(body)
    m.indexes[rel] = IndexMeta(rank=0, size=len(body), crc32c=crc32c(body))
    m.files[rel].size = len(body)
    open(os.path.join(d, "manifest.json"), "wb").write(manifest_to_bytes(m))
    with pytest.raises(CorruptCheckpointError, match="share file bytes"):
        shardckpt.verify(d)
    with pytest.raises(CorruptCheckpointError, match="share file bytes"):
        shardckpt.load({"scalar": torch.zeros(())}, d, strict=False)


def test_many_overlapping_chunks_are_refused():
    # 100,000 chunks claiming overlapping bytes of one file: refused (linear sweep, no blow-up).
    from shardckpt._format import ChunkMeta, TensorMeta
    from shardckpt._format.manifest import check_shared_bytes

    n = 100_000
    chunks = [ChunkMeta("data/f", f"t@{i}", [i], [1], i, 8, 0) for i in range(n)]
    with pytest.raises(CorruptCheckpointError, match="share file bytes"):
        check_shared_bytes({"t": TensorMeta("F64", [n], chunks)}, "m")


def test_verify_v2_needs_no_torch(saved):
    path, _ = saved
    code = (
        "import sys; sys.modules['torch'] = None\n"
        "from shardckpt._verify import verify\n"
        f"m = verify({path!r}); assert m.version == 5, m\n"
        "assert sys.modules['torch'] is None\n"
    )
    p = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True)
    assert p.returncode == 0, p.stderr[-3000:]
