"""Metadata read from storage is hostile until checked.

Each case damages a copy of the committed golden checkpoint (it has a 2-chunk
tensor, so overlaps and gaps can be staged), loads it into a live state and
checks: our exception type, a message naming the file/key, and a state left
exactly as it was.
"""

from __future__ import annotations

import copy
import importlib.util
import json
import os
import re
import shutil
import struct

import pytest
import torch

import shardckpt
from shardckpt import _format
from shardckpt._format import header as _format_header
from shardckpt._format import manifest as _format_manifest
from shardckpt.errors import (
    CheckpointError,
    CheckpointNotFoundError,
    ChecksumMismatchError,
    CorruptCheckpointError,
    StateMismatchError,
    UnsafeMetadataError,
)

DATA = os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "data")
GOLDEN_DIR = os.path.join(DATA, "v1_golden")
_spec = importlib.util.spec_from_file_location("make_golden", os.path.join(DATA, "make_golden.py"))
golden = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(golden)


def _live_state():
    """A live state shaped like the golden checkpoint, holding other values."""
    state = {}
    for k, v in golden.golden_tensors().items():
        state[k] = torch.ones_like(v) if v.dtype != torch.bool else torch.zeros_like(v)
    state.update({"step": -1, "meta": {"name": "live", "lr": 0.5, "nan": 0.0, "inf": 0.0, "pair": (0, 0), "none": 1}, "items": [0, "", False]})
    return state


def _snapshot(state):
    return {k: (v.clone() if isinstance(v, torch.Tensor) else copy.deepcopy(v)) for k, v in state.items()}


def _assert_untouched(state, snap):
    for k, v in snap.items():
        if isinstance(v, torch.Tensor):
            assert torch.equal(state[k], v), f"{k} changed by a failed load"
        else:
            assert state[k] == v, f"{k} changed by a failed load"


@pytest.fixture
def ckpt(tmp_path):
    d = tmp_path / "ck"
    shutil.copytree(GOLDEN_DIR, d)
    return d


def _manifest(d):
    with open(d / "manifest.json") as f:
        return json.load(f)


def _write_manifest(d, raw):
    data = raw if isinstance(raw, bytes) else json.dumps(raw).encode()
    with open(d / "manifest.json", "wb") as f:
        f.write(data)


def _rename_file(raw, new):
    """Point the manifest's first data file (and its chunks) at path ``new``."""
    old = sorted(raw["files"])[0]
    raw["files"][new] = raw["files"].pop(old)
    for t in raw["tensors"].values():
        for c in t["chunks"]:
            if c["file"] == old:
                c["file"] = new
    return raw


def _chunk(raw, name, i=0):
    return raw["tensors"][name]["chunks"][i]


def _sharded_chunks(raw):
    return sorted(raw["tensors"]["sharded"]["chunks"], key=lambda c: c["offsets"])


def _edit(fn):
    def apply(raw):
        fn(raw)
        return raw

    return apply


MANIFEST_CASES = [
    # (id, edit, exception type, fragments that must appear in the message)
    ("dotdot", lambda r: _rename_file(r, "../x"), UnsafeMetadataError, ["'../x'", "manifest.json"]),
    ("absolute", lambda r: _rename_file(r, "/etc/passwd"), UnsafeMetadataError, ["'/etc/passwd'"]),
    ("scheme", lambda r: _rename_file(r, "s3://x"), UnsafeMetadataError, ["'s3://x'"]),
    ("file-scheme", lambda r: _rename_file(r, "file:///etc/passwd"), UnsafeMetadataError, ["file:///etc/passwd"]),
    ("inner-dotdot", lambda r: _rename_file(r, "a/../../b"), UnsafeMetadataError, ["'a/../../b'"]),
    ("backslash", lambda r: _rename_file(r, "data\\..\\..\\x"), UnsafeMetadataError, ["backslash"]),
    ("dot-segment", lambda r: _rename_file(r, "./data/x.safetensors"), UnsafeMetadataError, ["'./data/x.safetensors'"]),
    ("double-slash", lambda r: _rename_file(r, "data//x.safetensors"), UnsafeMetadataError, ["'data//x.safetensors'"]),
    ("empty-path", lambda r: _rename_file(r, ""), UnsafeMetadataError, ["non-empty string"]),
    ("nul", lambda r: _rename_file(r, "data/x\x00.safetensors"), UnsafeMetadataError, ["plain relative path"]),
    (
        "chunk-file-unlisted",
        _edit(lambda r: _chunk(r, "bf16").update(file="data/other.safetensors")),
        CorruptCheckpointError,
        ["'bf16'", "'data/other.safetensors' is not listed"],
    ),
    (
        "offset-past-end",
        _edit(lambda r: _chunk(r, "i64").update(byte_offset=10**6)),
        CorruptCheckpointError,
        ["'i64'", "lie outside"],
    ),
    (
        "negative-offset",
        _edit(lambda r: _chunk(r, "i64").update(byte_offset=-8)),
        CorruptCheckpointError,
        ["'i64'", "lie outside"],
    ),
    (
        "nbytes-vs-shape",
        _edit(lambda r: _chunk(r, "bf16").update(nbytes=16)),
        CorruptCheckpointError,
        ["'bf16'", "nbytes 16 does not match sizes [3, 5]"],
    ),
    (
        "sizes-vs-nbytes",
        _edit(lambda r: _chunk(r, "bf16").update(sizes=[3, 6])),
        CorruptCheckpointError,
        ["'bf16'", "nbytes 30 does not match"],
    ),
    (
        "overlap",
        _edit(lambda r: _sharded_chunks(r)[1].update(offsets=[2, 0])),
        CorruptCheckpointError,
        ["'sharded'", "overlap"],
    ),
    (
        "gap",
        _edit(lambda r: r["tensors"]["sharded"].update(shape=[6, 3])),
        CorruptCheckpointError,
        ["'sharded'", "hold 15 elements"],
    ),
    (
        "chunk-outside-shape",
        _edit(lambda r: _sharded_chunks(r)[1].update(offsets=[4, 0])),
        CorruptCheckpointError,
        ["'sharded'", "outside shape"],
    ),
    (
        "missing-chunk",
        _edit(lambda r: r["tensors"]["sharded"]["chunks"].pop()),
        CorruptCheckpointError,
        ["'sharded'", "do not tile"],
    ),
    ("future-version", _edit(lambda r: r.update(format_version=6)), CorruptCheckpointError, ["format_version 6", "upgrade shardckpt"]),
    ("version-zero", _edit(lambda r: r.update(format_version=0)), CorruptCheckpointError, ["format_version 0"]),
    ("version-str", _edit(lambda r: r.update(format_version="1")), CorruptCheckpointError, ["'format_version' must be int"]),
    ("not-ours", _edit(lambda r: r.update(format="dcp")), CorruptCheckpointError, ["not a shardckpt manifest", "'dcp'"]),
    ("world-zero", _edit(lambda r: r.update(world_size=0)), CorruptCheckpointError, ["world_size"]),
    ("no-tensors", _edit(lambda r: r.pop("tensors")), CorruptCheckpointError, ["missing field 'tensors'"]),
    ("bad-dtype", _edit(lambda r: r["tensors"]["i64"].update(dtype="I128")), CorruptCheckpointError, ["'i64'", "unknown dtype 'I128'"]),
    ("neg-shape", _edit(lambda r: r["tensors"]["i64"].update(shape=[-6])), CorruptCheckpointError, ["'i64'", "non-negative ints"]),
    ("bool-shape", _edit(lambda r: r["tensors"]["i64"].update(shape=[True])), CorruptCheckpointError, ["'i64'", "non-negative ints"]),
    ("huge-ndim", _edit(lambda r: r["tensors"]["i64"].update(shape=[1] * 65)), CorruptCheckpointError, ["'i64'", "non-negative ints"]),
    (
        "offsets-ndim",
        _edit(lambda r: _chunk(r, "i64").update(offsets=[0, 0])),
        CorruptCheckpointError,
        ["'i64'", "'offsets' has 2 entries, expected 1"],
    ),
    ("crc-range", _edit(lambda r: _chunk(r, "i64").update(crc32c=2**32)), CorruptCheckpointError, ["'i64'", "32-bit"]),
    ("crc-float", _edit(lambda r: _chunk(r, "i64").update(crc32c=1.5)), CorruptCheckpointError, ["'i64'", "'crc32c' must be int"]),
    ("file-size-neg", _edit(lambda r: [f.update(size=-1) for f in r["files"].values()]), CorruptCheckpointError, ["size is negative"]),
]


@pytest.mark.parametrize("case", MANIFEST_CASES, ids=[c[0] for c in MANIFEST_CASES])
def test_bad_manifest_is_refused_and_nothing_loaded(ckpt, case):
    _, edit, exc, fragments = case
    _write_manifest(ckpt, edit(_manifest(ckpt)))
    state = _live_state()
    snap = _snapshot(state)
    with pytest.raises(exc) as ei:
        shardckpt.load(state, str(ckpt))
    for frag in fragments:
        assert frag in str(ei.value), (frag, str(ei.value))
    _assert_untouched(state, snap)
    # inspect and verify refuse it the same way
    with pytest.raises(exc):
        shardckpt.inspect(str(ckpt))
    with pytest.raises(exc):
        shardckpt.verify(str(ckpt))


@pytest.mark.parametrize(
    "data, fragment",
    [
        (b"{not json", "not valid JSON"),
        (b"\xff\xfe\x00", "not valid JSON"),
        (b"[1, 2, 3]", "not a shardckpt manifest"),
        (b"", "not valid JSON"),
        (b"[" * 200_000 + b"]" * 200_000, "not valid JSON"),  # nesting past the recursion limit
        (b'{"format": "shardckpt", "format_version": 1, "world_size": 1, "files": {}, "tensors": {}, "format_version": 9}', "format_version 9"),
    ],
)
def test_garbage_manifest(ckpt, data, fragment):
    _write_manifest(ckpt, data)
    state = _live_state()
    snap = _snapshot(state)
    with pytest.raises(CorruptCheckpointError, match=fragment) as ei:
        shardckpt.load(state, str(ckpt))
    assert "manifest.json" in str(ei.value)
    _assert_untouched(state, snap)


def test_manifest_over_the_size_limit(ckpt, monkeypatch):
    size = os.path.getsize(ckpt / "manifest.json")
    # Storage refuses to read it at all (a 1 GiB limit is the default; lower it).
    monkeypatch.setattr(_format_manifest, "MAX_MANIFEST_BYTES", size - 1)
    state = _live_state()
    snap = _snapshot(state)
    with pytest.raises(UnsafeMetadataError, match=f"{size} bytes exceeds the {size - 1}-byte limit"):
        shardckpt.load(state, str(ckpt))
    _assert_untouched(state, snap)
    # The parser checks the bound too, for manifests handed over as bytes.
    monkeypatch.setattr(_format_manifest, "MAX_MANIFEST_BYTES", 10)
    with pytest.raises(UnsafeMetadataError, match="exceeds the 10-byte limit"):
        _format.manifest_from_bytes((ckpt / "manifest.json").read_bytes())


def test_hostile_tagged_values_fail_before_tensors_change(ckpt):
    # Plain values decode after validation too: a tagged value that cannot be
    # decoded must fail the load before any tensor is written.
    for bad in (
        {"__shardckpt__": "float", "value": "__import__('os')"},
        {"__shardckpt__": "dtype", "value": "no_such_dtype"},
        {"__shardckpt__": "device", "value": "nonsense:xyz"},
        {"__shardckpt__": "evil"},
        {"__shardckpt__": "tuple", "items": 5},
    ):
        with open(os.path.join(GOLDEN_DIR, "manifest.json")) as f:
            raw = json.load(f)
        raw["values"]["step"] = bad
        _write_manifest(ckpt, raw)
        state = _live_state()
        snap = _snapshot(state)
        with pytest.raises(CheckpointError) as ei:
            shardckpt.load(state, str(ckpt))
        assert "step" in str(ei.value), (bad, str(ei.value))
        _assert_untouched(state, snap)


# --------------------------------------------------------------------------
# data files


def _first_file(ckpt):
    return ckpt / sorted(_manifest(ckpt)["files"])[0]


def test_file_size_mismatch_is_refused(ckpt):
    raw = _manifest(ckpt)
    rel = sorted(raw["files"])[0]
    raw["files"][rel]["size"] += 8  # the file on disk is now "truncated"
    _write_manifest(ckpt, raw)
    state = _live_state()
    snap = _snapshot(state)
    with pytest.raises(CorruptCheckpointError, match=f"{rel} truncated"):
        shardckpt.load(state, str(ckpt))
    _assert_untouched(state, snap)


def test_missing_checkpoint(tmp_path):
    with pytest.raises(CheckpointNotFoundError, match="manifest.json is missing"):
        shardckpt.load(_live_state(), str(tmp_path / "nothing"))


def test_huge_safetensors_header_length(ckpt):
    path = _first_file(ckpt)
    data = bytearray(path.read_bytes())
    data[:8] = struct.pack("<Q", 2**63)
    path.write_bytes(bytes(data))
    # verify lists every damaged file in one CorruptCheckpointError
    with pytest.raises(CorruptCheckpointError, match=r"header length 9223372036854775808 exceeds"):
        shardckpt.verify(str(ckpt))
    with pytest.raises(UnsafeMetadataError, match="exceeds the limit"):
        _format.parse_safetensors_header(bytes(data), file_size=len(data), where="f")


def test_verify_never_reads_a_header_past_the_limit(tmp_path, monkeypatch):
    from shardckpt._storage import Storage

    path = tmp_path / "ck"
    shardckpt.save({"w": torch.zeros(600_000)}, str(path))  # a 2.4 MB file
    rel = next(r for r in shardckpt.inspect(str(path)).files if r.endswith(".safetensors"))
    f = path / rel
    data = bytearray(f.read_bytes())
    data[:8] = struct.pack("<Q", len(data) - 8)  # "the header is the whole file"
    f.write_bytes(bytes(data))
    monkeypatch.setattr(_format_header, "MAX_HEADER_BYTES", 1 << 20)
    lengths = []
    real = Storage.read_range

    def spy(self, rel, start, length):
        lengths.append(length)
        return real(self, rel, start, length)

    monkeypatch.setattr(Storage, "read_range", spy)
    with pytest.raises(CorruptCheckpointError, match="exceeds the limit"):
        shardckpt.verify(str(path))
    assert max(lengths) <= 1 << 20


@pytest.mark.parametrize(
    "header, fragment",
    [
        ({"x": {"dtype": "F32", "shape": [2], "data_offsets": [0, 16]}}, "outside the file"),
        ({"x": {"dtype": "F32", "shape": [3], "data_offsets": [0, 8]}}, "8 bytes for shape [3] of F32"),
        ({"x": {"dtype": "F32", "shape": [2], "data_offsets": [8, 0]}}, "outside the file"),
        ({"x": {"dtype": "Q9", "shape": [2], "data_offsets": [0, 8]}}, "unknown dtype 'Q9'"),
        ({"x": {"dtype": "F32", "shape": "2", "data_offsets": [0, 8]}}, "'shape' must be list"),
        ({"x": {"shape": [2], "data_offsets": [0, 8]}}, "missing field 'dtype'"),
        ([1, 2], "not a JSON object"),
    ],
)
def test_parse_safetensors_header_rejects(header, fragment):
    body = json.dumps(header).encode()
    head = struct.pack("<Q", len(body)) + body
    data = head + b"\0" * 8
    with pytest.raises(CorruptCheckpointError) as ei:
        _format.parse_safetensors_header(data, file_size=len(data), where="data/f.safetensors")
    assert fragment in str(ei.value) and "data/f.safetensors" in str(ei.value)


def test_parse_safetensors_header_short_and_truncated():
    with pytest.raises(CorruptCheckpointError, match="too short"):
        _format.parse_safetensors_header(b"abc", file_size=3, where="f")
    head = struct.pack("<Q", 100) + b"{}"
    with pytest.raises(CorruptCheckpointError, match="header truncated"):
        _format.parse_safetensors_header(head, file_size=1000, where="f")
    body = b"\xff" * 8
    with pytest.raises(CorruptCheckpointError, match="not valid JSON"):
        _format.parse_safetensors_header(struct.pack("<Q", 8) + body, file_size=16, where="f")


def test_verify_catches_header_disagreeing_with_manifest(ckpt):
    # Same length header, different key: checksums still match, the header does not.
    path = _first_file(ckpt)
    data = path.read_bytes()
    (n,) = struct.unpack("<Q", data[:8])
    header = json.loads(data[8 : 8 + n])
    key = next(k for k in header if k != "__metadata__")
    renamed = key[:-1] + ("X" if key[-1] != "X" else "Y")
    body = data[8 : 8 + n].replace(json.dumps(key).encode(), json.dumps(renamed).encode(), 1)
    assert len(body) == n
    path.write_bytes(data[:8] + body + data[8 + n :])
    with pytest.raises(CorruptCheckpointError, match=f"header entry '{key}' disagrees"):
        shardckpt.verify(str(ckpt))


def test_nonfinite_in_json_is_not_accepted_as_number(ckpt):
    # Python's json accepts NaN/Infinity literals; a manifest with them is not canonical.
    raw = (ckpt / "manifest.json").read_text().replace('"world_size":2', '"world_size":NaN')
    (ckpt / "manifest.json").write_text(raw)
    with pytest.raises(CorruptCheckpointError, match="world_size"):
        shardckpt.inspect(str(ckpt))


def test_state_mismatch_lists_everything(ckpt):
    state = _live_state()
    state["bf16"] = torch.zeros(3, 4, dtype=torch.bfloat16)
    state["i64"] = torch.zeros(6, dtype=torch.int32)
    snap = _snapshot(state)
    with pytest.raises(StateMismatchError) as ei:
        shardckpt.load(state, str(ckpt))
    msg = str(ei.value)
    assert "bf16: checkpoint shape [3, 5], live shape [3, 4]" in msg
    assert "i64: checkpoint dtype I64, live dtype I32" in msg
    _assert_untouched(state, snap)


def test_checksum_error_type(ckpt):
    path = _first_file(ckpt)
    data = bytearray(path.read_bytes())
    data[-1] ^= 0x01  # the last bytes of the first file: 'flag'
    path.write_bytes(bytes(data))
    state = _live_state()
    snap = _snapshot(state)
    with pytest.raises(ChecksumMismatchError, match="crc32c") as got:
        shardckpt.load(state, str(ckpt))
    # Not atomic: the reader threads copy verified pieces of the other file
    # while the damaged one is read (which finishes first is the threads'
    # race), so the error names every tensor already overwritten; no other
    # tensor changed, and the damaged bytes never land.
    msg = str(got.value)
    named = msg.split("Tensors already overwritten:", 1)[1] if "Tensors already overwritten:" in msg else ""
    assert not re.search(r"\bflag\b", named), msg
    _assert_untouched(state, {k: v for k, v in snap.items() if not re.search(rf"\b{k}\b", named)})
    # atomic=True stages first: nothing changes, whatever the order.
    state = _live_state()
    with pytest.raises(ChecksumMismatchError, match="crc32c") as got:
        shardckpt.load(state, str(ckpt), atomic=True)
    assert "already overwritten" not in str(got.value)
    _assert_untouched(state, snap)


# --------------------------------------------------------------------------
# format v3: the compact per-rank file table


def _table_case(edit):
    def apply(raw):
        edit(raw["file_table"])
        # A valid checksum, so that the checks after it are the ones hit.
        raw.pop(_format_manifest.MANIFEST_CRC_FIELD)
        raw[_format_manifest.MANIFEST_CRC_FIELD] = _format.crc32c(_format_manifest.manifest_json_v2(raw))
        return _format_manifest.manifest_json_v2(raw)

    return apply


TABLE_CASES = [
    ("pattern-escapes", _table_case(lambda t: t.update(data="../../x-{rank}-{i}")), UnsafeMetadataError, ["../../x-00000-00"]),
    ("pattern-brace", _table_case(lambda t: t.update(index="data/{rank}{0}")), UnsafeMetadataError, ["braces"]),
    ("absurd-expansion", _table_case(lambda t: t["data_sizes"][0].extend([0] * 5000)), UnsafeMetadataError, ["per rank"]),
    ("size-lies", _table_case(lambda t: t["data_sizes"][0].__setitem__(0, t["data_sizes"][0][0] + 8)), CorruptCheckpointError, ["truncated"]),
    ("index-crc-lies", _table_case(lambda t: t["index_files"][0].__setitem__(1, t["index_files"][0][1] ^ 1)), CorruptCheckpointError, ["index file"]),
]


@pytest.mark.parametrize("case", TABLE_CASES, ids=[c[0] for c in TABLE_CASES])
def test_bad_v3_file_table_is_refused_and_nothing_loaded(tmp_path, case):
    _, edit, exc, fragments = case
    path = tmp_path / "v3"
    saved = {"w": torch.randn(6, 4), "step": 9}
    shardckpt.save(saved, str(path))
    raw = _manifest(path)
    assert raw["format_version"] == 5 and raw["files"] == {}
    _write_manifest(path, edit(raw))
    state = {"w": torch.zeros(6, 4), "step": -1}
    snap = _snapshot(state)
    with pytest.raises(exc) as ei:
        shardckpt.load(state, str(path))
    for frag in fragments:
        assert frag in str(ei.value), (frag, str(ei.value))
    _assert_untouched(state, snap)
