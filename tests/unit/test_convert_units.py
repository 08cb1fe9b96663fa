"""Converter building blocks: CRC joining, sizes, dtypes, block planning, key selection, DCP unpickler."""

import io
import os
import pickle
import random
import zlib

import crc32c
import pytest
import torch
from shardckpt.converters import parse_size
from shardckpt.converters._common import Reader
from shardckpt.converters._dcp import DCPUnpickler
from shardckpt.converters._options import parse_dtype
from shardckpt.converters._source import Source, SrcTensor, plan_blocks

from shardckpt._format import ChunkMeta, TensorMeta
from shardckpt._format.checksum import checksum, combine
from shardckpt._format.chunk import Chunk
from shardckpt._geometry import Box
from shardckpt._hf import map_names, narrow_unchecked, select_names
from shardckpt._storage import Storage
from shardckpt.errors import StateMismatchError, UnsupportedStateError


@pytest.mark.parametrize("algo,ref", [("crc32c", crc32c.crc32c), ("crc32", zlib.crc32)])
def test_crc_combine_matches_whole(algo, ref):
    rng = random.Random(0)
    for n in [0, 1, 7, 4096, 1 << 20]:
        a = os.urandom(rng.randint(0, 300))
        b = os.urandom(n)
        assert combine(algo, ref(a), ref(b), len(b)) == ref(a + b)
    # Many pieces joined in order equal the CRC of the concatenation.
    data = os.urandom(100_000)
    cuts = sorted(rng.sample(range(1, len(data)), 20))
    crc, prev = 0, 0
    for c in cuts + [len(data)]:
        crc = combine(algo, crc, checksum(algo, data[prev:c]), c - prev)
        prev = c
    assert crc == ref(data)


def test_parse_size_decimal_and_binary():
    assert parse_size("5GB") == 5 * 10**9
    assert parse_size("500MB") == 500 * 10**6
    assert parse_size("1GiB") == 2**30
    assert parse_size("2.5kb") == 2500
    assert parse_size(1234) == 1234
    for bad in ["5XB", "", "GB", -1, 0, True, 1.5]:
        with pytest.raises(ValueError):
            parse_size(bad)


def test_parse_dtype_floats_only():
    assert parse_dtype("bf16") == "BF16"
    assert parse_dtype(torch.float16) == "F16"
    assert parse_dtype("bfloat16") == "BF16"
    assert parse_dtype("float8_e4m3fn") == "F8_E4M3"
    assert parse_dtype(None) is None
    with pytest.raises(UnsupportedStateError, match="floating-point"):
        parse_dtype("int8")


def _tensor_files(tmp_path, full: torch.Tensor, boxes):
    """Write each box of ``full`` as raw bytes to its own file; a SrcTensor over them."""
    storage = Storage(str(tmp_path))
    chunks = []
    for i, (offs, sizes) in enumerate(boxes):
        view = full
        for d, (o, n) in enumerate(zip(offs, sizes)):
            view = view.narrow(d, o, n)
        data = view.contiguous().view(torch.uint8).numpy().tobytes()
        (tmp_path / f"c{i}").write_bytes(b"xx" + data)  # 2 junk bytes: offsets are honoured
        chunks.append(Chunk(file=f"c{i}", byte_offset=2, nbytes=len(data), offsets=offs, sizes=sizes, key=f"c{i}",
                            crc32c=crc32c.crc32c(data)))
    dt = {torch.float32: "F32", torch.int16: "I16"}[full.dtype]
    t = SrcTensor(name="t", dtype=dt, shape=tuple(full.shape), chunks=chunks)
    return Source(url=str(tmp_path), storage=storage, tensors={"t": t}), t


@pytest.mark.parametrize(
    "boxes,flat",
    [
        ([((0, 0), (3, 8)), ((3, 0), (4, 8)), ((7, 0), (0, 8))], True),  # dim-0 shards, one empty
        ([((0, 0), (7, 3)), ((0, 3), (7, 5))], False),  # column shards (tensor parallel)
        ([((0, 0), (4, 4)), ((0, 4), (4, 4)), ((4, 0), (3, 8))], False),  # mixed boxes
    ],
)
@pytest.mark.parametrize("block", [4, 12, 40, 1 << 20])
def test_blocks_stream_the_exact_tensor(tmp_path, boxes, flat, block):
    full = torch.arange(56, dtype=torch.float32).reshape(7, 8)
    source, t = _tensor_files(tmp_path, full, boxes)
    assert t.flat is flat
    reader = Reader(source)
    blocks = plan_blocks(t, 0, t.numel, block)
    row_bytes = 8 * 4
    for b in blocks:
        assert b.count * 4 <= max(block, row_bytes if not flat else 4)
    got = torch.cat([reader.read(t, b) for b in blocks]).view(torch.float32).reshape(7, 8)
    assert torch.equal(got, full)
    reader.finish()  # every chunk read whole: checksums verified
    # A sub-range of whole rows (what reshard asks for).
    part = torch.cat([reader.read(t, b) for b in plan_blocks(t, 2 * 8, 5 * 8, block)]).view(torch.float32)
    assert torch.equal(part, full[2:5].reshape(-1))


def test_damaged_chunk_is_reported_with_file_and_key(tmp_path):
    full = torch.arange(56, dtype=torch.float32).reshape(7, 8)
    source, t = _tensor_files(tmp_path, full, [((0, 0), (3, 8)), ((3, 0), (4, 8))])
    raw = bytearray((tmp_path / "c1").read_bytes())
    raw[10] ^= 0xFF
    (tmp_path / "c1").write_bytes(bytes(raw))
    reader = Reader(source)
    for b in plan_blocks(t, 0, t.numel, 16):
        reader.read(t, b)
    with pytest.raises(Exception, match=r"c1: chunk 'c1' of tensor 't'.*crc32c"):
        reader.finish()


def test_select_and_map_names():
    names = ["a.w", "a.b", "b.w"]
    assert select_names(names, None) == names
    assert select_names(names, ["a.*"]) == ["a.w", "a.b"]
    assert select_names(names, "b.w") == ["b.w"]
    with pytest.raises(StateMismatchError, match="c.*"):
        select_names(names, ["a.*", "c.*"])
    assert map_names(names, {"a.w": "x"}) == {"a.w": "x", "a.b": "a.b", "b.w": "b.w"}
    assert map_names(names, lambda n: None if n.startswith("b") else n.upper()) == {"a.w": "A.W", "a.b": "A.B"}
    with pytest.raises(StateMismatchError, match="several tensors to one name"):
        map_names(names, lambda n: "same")


def test_narrow_unchecked_cuts_rows_only_where_there_is_no_checksum():
    c = ChunkMeta(file="f", key="w", offsets=[0, 0], sizes=[10, 4], byte_offset=100, nbytes=160, crc32c=None)
    meta = TensorMeta(dtype="F32", shape=[10, 4], chunks=[c])
    out = narrow_unchecked(meta, [Box((3, 0), (4, 4))])
    assert [(x.offsets, x.sizes, x.byte_offset, x.nbytes) for x in out.chunks] == [
        ([0, 0], [3, 4], 100, 48),
        ([3, 0], [4, 4], 148, 64),
        ([7, 0], [3, 4], 212, 48),
    ]
    checked = TensorMeta(dtype="F32", shape=[10, 4], chunks=[ChunkMeta("f", "w", [0, 0], [10, 4], 100, 160, 123)])
    assert narrow_unchecked(checked, [Box((3, 0), (4, 4))]) is checked


class _Evil:
    def __reduce__(self):
        return (os.system, ("touch /nonexistent-shardckpt-marker",))


def test_dcp_unpickler_refuses_other_globals():
    with pytest.raises(pickle.UnpicklingError, match="system"):
        DCPUnpickler(io.BytesIO(pickle.dumps(_Evil()))).load()
    with pytest.raises(pickle.UnpicklingError, match="builtins.eval"):
        DCPUnpickler(io.BytesIO(b"cbuiltins\neval\n(S'1'\ntR.")).load()
    # torch attributes pass only as plain dtype/layout values, never callables.
    assert DCPUnpickler(io.BytesIO(pickle.dumps(torch.bfloat16))).load() is torch.bfloat16
    with pytest.raises(pickle.UnpicklingError):
        DCPUnpickler(io.BytesIO(b"ctorch\nload\n.")).load()


def test_block_checksummed_chunks_are_verified_before_use(tmp_path):
    """Format v2 sources: each piece read is checked against its blocks' CRCs by the shared reader, at once."""
    from shardckpt.errors import ChecksumMismatchError

    full = torch.arange(56, dtype=torch.float32).reshape(7, 8)
    source, t = _tensor_files(tmp_path, full, [((0, 0), (3, 8)), ((3, 0), (4, 8))])
    for k, c in enumerate(t.chunks):  # 32-byte blocks instead of one CRC per chunk
        data = (tmp_path / c.file).read_bytes()[2:]
        blocks = tuple(crc32c.crc32c(data[i : i + 32]) for i in range(0, len(data), 32))
        t.chunks[k] = c._replace(crc32c=None, block_bytes=32, block_crcs=blocks)
    reader = Reader(source)
    assert torch.equal(reader.read(t, plan_blocks(t, 0, t.numel)[0]).view(torch.float32).reshape(7, 8), full)
    raw = bytearray((tmp_path / "c1").read_bytes())
    raw[2 + 70] ^= 0x01  # chunk c1, block 2 (bytes 64..96): rows 5 and 6
    (tmp_path / "c1").write_bytes(bytes(raw))
    rows_ok = plan_blocks(t, 0, 5 * 8, 1 << 20)[0]  # rows 0..4: c0 and c1's blocks 0, 1
    assert torch.equal(reader.read(t, rows_ok).view(torch.float32), full[:5].reshape(-1))
    with pytest.raises(ChecksumMismatchError, match=r"c1.*t chunk 'c1' block 2"):
        reader.read(t, plan_blocks(t, 5 * 8, 7 * 8, 1 << 20)[0])
    reader.finish()  # nothing is left to check at the end: blocks were checked as read


def test_converter_options_are_one_set_checked_once(monkeypatch, tmp_path):
    """Every converter takes the same options (ConvertOptions; SelectOptions adds keys/key_map), checked at the call."""
    import inspect

    from shardckpt.converters._options import Options

    from shardckpt import _knobs, converters

    assert converters.ConvertOptions.__optional_keys__ == {
        "storage_options", "dst_storage_options", "overwrite", "progress", "io_threads"}
    assert converters.SelectOptions.__optional_keys__ == converters.ConvertOptions.__optional_keys__ | {"keys", "key_map"}
    for fn in (converters.to_safetensors, converters.to_full, converters.reshard, converters.consolidate,
               converters.from_safetensors, converters.from_dcp, converters.from_torch_save):
        options = inspect.signature(fn).parameters["options"]
        assert options.kind is inspect.Parameter.VAR_KEYWORD, fn.__name__
    # io_threads: the knob read at each call, never a value frozen at import.
    monkeypatch.setattr(_knobs, "IO_THREADS", 7)
    assert Options.of("reshard", {}).io_threads == 7
    assert Options.of("reshard", {"io_threads": None}).io_threads == 7
    assert Options.of("reshard", {"io_threads": 2}).io_threads == 2
    # A name a converter does not take raises before anything is read or written, all such names listed.
    with pytest.raises(TypeError, match=r"reshard\(\) got unexpected keyword arguments 'bogus', 'keys'"):
        converters.reshard(str(tmp_path / "nothing"), str(tmp_path / "out"), world_size=2, keys=["x"], bogus=1)
    with pytest.raises(TypeError, match=r"to_full\(\) got unexpected keyword argument 'dst_storage_option' "):
        converters.to_full(str(tmp_path / "nothing"), str(tmp_path / "out.pt"), dst_storage_option={})
    assert not (tmp_path / "out").exists()
