"""docs/format.md is enough to read a checkpoint: a third-party reader written from the spec alone.

The reader below uses only ``json``, ``struct``, ``base64`` and a CRC-32C
written from the spec (the Castagnoli polynomial, reflected: 0x82F63B78),
never the package's code. It opens a real checkpoint written by
``shardckpt.save`` as the spec says: the manifest and its checksum, the v3
file table, each per-rank index file (size and CRC from the manifest), the
positional index rows, one tensor's bytes in its safetensors data file, and
its block CRCs and chunk CRC. The row's column order is taken from
docs/format.md's "Index row columns" table, so the doc and the code cannot
drift apart unnoticed.
"""

from __future__ import annotations

import base64
import json
import math
import re
import struct
from pathlib import Path

import pytest
import torch

import shardckpt

SPEC = Path(__file__).resolve().parents[2] / "docs" / "format.md"

# --------------------------------------------------------------------------
# the spec's CRC-32C (Castagnoli, reflected polynomial 0x82F63B78, init and
# final xor 0xFFFFFFFF): one table of 256 entries, one step per byte.

_TABLE = []
for _i in range(256):
    _c = _i
    for _ in range(8):
        _c = (_c >> 1) ^ 0x82F63B78 if _c & 1 else _c >> 1
    _TABLE.append(_c)


def spec_crc32c(data: bytes) -> int:
    crc = 0xFFFFFFFF
    for b in data:
        crc = _TABLE[(crc ^ b) & 0xFF] ^ (crc >> 8)
    return crc ^ 0xFFFFFFFF


def test_the_spec_crc_is_crc32c():
    # The standard check value of CRC-32C (RFC 3720, B.4).
    assert spec_crc32c(b"123456789") == 0xE3069283


# --------------------------------------------------------------------------
# what the reader takes from the doc's text


def doc_table(title: str) -> list:
    """The first column (names in backquotes) of the table right after the line starting with ``title``."""
    text = SPEC.read_text(encoding="utf-8")
    at = text.index(title)
    rows = re.findall(r"^\| `(\w+)` \|", text[at:].split("\n\n", 2)[1], re.M)
    assert rows, f"no table after {title!r} in {SPEC}"
    return rows


INDEX_COLUMNS = doc_table("Index row columns")
#: bytes per element of the manifest's dtype names (docs/format.md, "Tensor entry").
ITEMSIZE = {"BOOL": 1, "U8": 1, "I8": 1, "I16": 2, "U16": 2, "I32": 4, "U32": 4, "I64": 8, "U64": 8,
            "F16": 2, "BF16": 2, "F32": 4, "F64": 8, "C64": 8}


def read_manifest(ckpt: Path) -> dict:
    raw = (ckpt / "manifest.json").read_bytes()
    m = json.loads(raw)
    assert m["format"] == "shardckpt" and m["format_version"] >= 3
    # manifest_crc32c: the CRC of the bytes without the field, canonical
    # except the key order inside `values` and `extra`.
    body = {k: v for k, v in m.items() if k != "manifest_crc32c"}
    enc = "{" + ",".join(
        json.dumps(k) + ":" + json.dumps(body[k], sort_keys=k not in ("values", "extra"), separators=(",", ":"))
        for k in sorted(body)
    ) + "}\n"
    assert spec_crc32c(enc.encode()) == m["manifest_crc32c"]
    return m


def index_files(m: dict) -> dict:
    """rank -> (path, size, crc32c): the v3 file table's index files plus ``indexes``."""
    table = m["file_table"]
    out = {}
    for rank, entry in enumerate(table["index_files"]):
        if entry is not None:
            out[rank] = (table["index"].replace("{rank}", f"{rank:05d}"), entry[0], entry[1])
    for path, meta in m["indexes"].items():
        out[meta["rank"]] = (path, meta["size"], meta["crc32c"])
    return out


def read_index(ckpt: Path, m: dict, path: str, size: int, crc: int, rank: int) -> list:
    """The index's chunks as dicts, the columns named from the doc's table."""
    data = (ckpt / path).read_bytes()
    assert len(data) == size and spec_crc32c(data) == crc
    idx = json.loads(data)
    assert idx["format"] == "shardckpt-index" and idx["rank"] == rank
    assert idx["save_id"] == m["save_id"] and idx["block_bytes"] == m["block_bytes"]
    # The doc's columns, in order; a column added at the end of a later
    # version would be one more row of the doc's table.
    assert idx["rows"] == INDEX_COLUMNS
    return [dict(zip(INDEX_COLUMNS, row), file=idx["files"][row[INDEX_COLUMNS.index("file")]]) for row in idx["chunks"]]


def read_chunk(ckpt: Path, m: dict, chunk: dict) -> bytes:
    """A chunk's bytes, each block and the whole checked against the index's CRCs."""
    t = m["tensors"][chunk["tensor"]]
    nbytes = math.prod(chunk["sizes"]) * ITEMSIZE[t["dtype"]]
    data_path = ckpt / chunk["file"]
    with open(data_path, "rb") as f:
        # The entry in the safetensors header sits where the index says.
        (n,) = struct.unpack("<Q", f.read(8))
        header = json.loads(f.read(n))
        whole = chunk["sizes"] == t["shape"]
        key = chunk["tensor"] if whole else chunk["tensor"] + "@" + ",".join(map(str, chunk["offsets"]))
        start, stop = header[key]["data_offsets"]
        assert (8 + n + start, stop - start) == (chunk["byte_offset"], nbytes)
        f.seek(chunk["byte_offset"])
        data = f.read(nbytes)
    bb = m["block_bytes"]
    raw = base64.b64decode(chunk["blocks"])
    blocks = list(struct.unpack(f"<{len(raw) // 4}I", raw))
    assert len(blocks) == -(-nbytes // bb)
    assert blocks == [spec_crc32c(data[i : i + bb]) for i in range(0, nbytes, bb)]
    assert spec_crc32c(data) == chunk["crc32c"]
    return data


@pytest.fixture
def small_blocks(monkeypatch):
    # Several blocks in a small tensor: the smallest block size the format allows.
    from shardckpt import _knobs

    monkeypatch.setenv("SHARDCKPT_BLOCK_BYTES", "4096")
    if hasattr(_knobs, "BLOCK_BYTES"):
        monkeypatch.setattr(_knobs, "BLOCK_BYTES", 4096)


def test_a_reader_written_from_the_spec_reads_a_real_checkpoint(tmp_path, small_blocks):
    w = torch.arange(3000, dtype=torch.float32).reshape(30, 100) / 7
    state = {"w": w, "b": torch.arange(5, dtype=torch.int64), "step": 3}
    shardckpt.save(state, str(tmp_path / "ck"), content_hash=True)  # every column of the table
    ckpt = tmp_path / "ck"

    m = read_manifest(ckpt)
    assert m["tensors"]["w"]["dtype"] == "F32" and m["tensors"]["w"]["shape"] == [30, 100]
    assert m["values"]["step"] == 3
    # Every data file of the table is there with its size (names: rank 5 digits, file 2).
    table = m["file_table"]
    for rank, sizes in enumerate(table["data_sizes"]):
        for i, size in enumerate(sizes):
            name = table["data"].replace("{rank}", f"{rank:05d}").replace("{i}", f"{i:02d}")
            assert size is None or (ckpt / name).stat().st_size == size
    indexes = index_files(m)
    assert sorted(indexes) == [0]
    chunks = read_index(ckpt, m, *indexes[0], rank=0)
    assert sorted(c["tensor"] for c in chunks) == ["b", "w"]
    (cw,) = [c for c in chunks if c["tensor"] == "w"]
    assert (cw["offsets"], cw["sizes"]) == ([0, 0], [30, 100])
    data = read_chunk(ckpt, m, cw)
    # Little-endian, row-major, no gaps: the tensor's own bytes.
    assert data == w.numpy().tobytes()
    if m["block_bytes"] == 4096:
        assert len(base64.b64decode(cw["blocks"])) == 4 * 3
