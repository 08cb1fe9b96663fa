"""Format v5: large states' compact tables (docs/format.md, "Format v5").

The manifest's ``tensor_table`` (kinds listed once, front-coded names, a kind
and a rotation per tensor) and columnar index files: round trips, the
threshold, a real save and load through them, and hostile tables refused with
our types and messages naming what and where.
"""

from __future__ import annotations

import json
import os

import pytest
import torch

import shardckpt
from shardckpt._format import (
    FORMAT_VERSION,
    ChunkMeta,
    FileMeta,
    IndexMeta,
    Manifest,
    TensorMeta,
    _v2,
    index_file_name,
    manifest_from_bytes,
    manifest_to_bytes,
    table,
)
from shardckpt._format.checksum import crc32c
from shardckpt._format.manifest import MANIFEST_CRC_FIELD, manifest_json_v2
from shardckpt.errors import CorruptCheckpointError

SID = "0123456789abcdef0123456789abcdef"
N = table.TABLE_MIN_ENTRIES + 5


def _reg(ms, pl, rot=0):
    return {"mesh_shape": ms, "placements": pl, "mesh": 0, "rotation": rot}


def _manifest(n=N) -> Manifest:
    tensors = {}
    for i in range(n):
        k = i % 3
        shape = [[8, 4], [16], [4, 4, 2]][k]
        reg = _reg([4], ["S(0)"]) if k != 1 else _reg([2, 2], ["R", "S(0)"], rot=i % 2)
        tensors[f"layers.{i // 3}.w{k}"] = TensorMeta("F32" if k else "BF16", shape, layout={"placements": reg["placements"]}, regular=reg)
    tensors["odd"] = TensorMeta("F32", [5], writers=[0, 2])
    idx = {index_file_name(SID, r): IndexMeta(r, 100 + r, r) for r in range(4)}
    files = {p: FileMeta(m.size) for p, m in idx.items()}
    return Manifest(world_size=4, tensors=tensors, files=files, save_id=SID, version=FORMAT_VERSION, block_bytes=1 << 20,
                    meshes=["iota"], indexes=idx, values={"step": 1})


def _bytes(raw: dict) -> bytes:
    raw = dict(raw)
    raw.pop(MANIFEST_CRC_FIELD, None)
    raw[MANIFEST_CRC_FIELD] = crc32c(manifest_json_v2(raw))
    return manifest_json_v2(raw)


def test_tensor_table_round_trip():
    m = _manifest()
    body = manifest_to_bytes(m)
    raw = json.loads(body)
    tt = raw["tensor_table"]
    assert len(tt["kinds"]) == 3  # 3 layouts; the replicated one's 2 rotations share its kind
    assert len(tt["prefix"]) == len(tt["suffix"]) == len(tt["kind"]) == len(tt["rotation"]) == N
    assert list(raw["tensors"]) == ["odd"]  # irregular tensors keep their objects
    back = manifest_from_bytes(body)
    assert sorted(back.tensors) == sorted(m.tensors)
    for name, t in m.tensors.items():
        b = back.tensors[name]
        assert (b.dtype, b.shape, b.regular, b.writers, b.layout) == (t.dtype, t.shape, t.regular, t.writers, t.layout), name
    # front coding pays: a name costs its new suffix, not the whole of it
    assert sum(map(len, tt["suffix"])) * 3 < sum(map(len, m.tensors))


def test_small_states_keep_per_tensor_records():
    raw = json.loads(manifest_to_bytes(_manifest(table.TABLE_MIN_ENTRIES - 1)))
    assert "tensor_table" not in raw and len(raw["tensors"]) == table.TABLE_MIN_ENTRIES


def test_front_code_round_trip():
    names = sorted(["a", "ab", "abc", "b", "layers.10.w1", "layers.1.w1", "layers.1.w2", "x" * 300])
    prefix, suffix = table.front_code(names)
    assert table.front_decode(prefix, suffix, strict=True, where="t") == names
    p2, s2 = table.front_code(["w", "w", "w2"])
    assert table.front_decode(p2, s2, strict=False, where="t") == ["w", "w", "w2"]
    with pytest.raises(CorruptCheckpointError, match="listed twice"):
        table.front_decode(p2, s2, strict=True, where="t")


def _edit_table(fn):
    raw = json.loads(manifest_to_bytes(_manifest()))
    fn(raw)
    return _bytes(raw)


HOSTILE = [
    ("kind-out-of-range", lambda r: r["tensor_table"]["kind"].__setitem__(3, 99), ["'layers.1.w0'", "kind 99", "3 kinds"]),
    ("kind-bool", lambda r: r["tensor_table"]["kind"].__setitem__(3, True), ["kind True"]),
    ("rotation-out-of-range", lambda r: r["tensor_table"]["rotation"].__setitem__(1, 4), ["'layers.0.w1'", "rotation 4 outside 0..3"]),
    ("prefix-too-long", lambda r: r["tensor_table"]["prefix"].__setitem__(2, 10**6), ["prefix 1000000"]),
    ("suffix-not-str", lambda r: r["tensor_table"]["suffix"].__setitem__(2, 7), ["suffix a string"]),
    ("short-column", lambda r: r["tensor_table"]["rotation"].pop(), ["'kind' and 'rotation' must be lists"]),
    ("name-twice", lambda r: (r["tensor_table"]["prefix"].__setitem__(1, 0), r["tensor_table"]["suffix"].__setitem__(1, "layers.0.w0")), ["listed twice"]),
    ("in-both", lambda r: r["tensors"].__setitem__("layers.0.w0", r["tensors"]["odd"]), ["'layers.0.w0'", "listed twice"]),
    ("bad-dtype", lambda r: r["tensor_table"]["kinds"][0].update(dtype="X9"), ["kinds[0]", "unknown dtype 'X9'"]),
    ("bad-placement", lambda r: r["tensor_table"]["kinds"][0].update(placements=["S(7)"]), ["kinds[0]", "invalid layout record"]),
    ("mesh-too-small", lambda r: r["tensor_table"]["kinds"][0].update(mesh_shape=[64]), ["kinds[0]", "does not have the 64 ranks"]),
    ("not-an-object", lambda r: r.__setitem__("tensor_table", [1, 2]), ["tensor_table", "must be an object"]),
]


@pytest.mark.parametrize("case", HOSTILE, ids=[c[0] for c in HOSTILE])
def test_hostile_tensor_tables_refused(case):
    _, edit, fragments = case
    with pytest.raises(CorruptCheckpointError) as e:
        manifest_from_bytes(_edit_table(edit), url="ck")
    assert all(f in str(e.value) for f in fragments), str(e.value)


def test_table_in_a_v4_manifest_refused():
    raw = json.loads(manifest_to_bytes(_manifest()))
    raw["format_version"] = 4
    with pytest.raises(CorruptCheckpointError, match="carries 'tensor_table' .new in version 5"):
        manifest_from_bytes(_bytes(raw))


# -- columnar index files -----------------------------------------------------


def _index_manifest(n=N, nbytes=8):
    tensors = {f"t{i:05d}": TensorMeta("F32", [4, 2], regular=_reg([2], ["S(0)"])) for i in range(n)}
    data = "data/0123456789ab-r00000-00.safetensors"
    return Manifest(world_size=2, tensors=tensors, files={data: FileMeta(8 + n * 2 * nbytes)}, save_id=SID, version=FORMAT_VERSION,
                    block_bytes=1 << 20, meshes=["iota"], indexes={}), data


def _chunks(m, data, hashed=False):
    out, pos = [], 8
    for name in sorted(m.tensors):
        for row in (0, 2):
            c = ChunkMeta(data, f"{name}@{row},0", [row, 0], [2, 2], pos, 16, (pos * 31) & 0xFFFFFFFF)
            c.blocks = [pos & 0xFFFF]
            c.hash = f"{pos:064x}" if hashed else None
            out.append((name, c))
            pos += 16
    return out


@pytest.mark.parametrize("hashed", [False, True])
def test_columnar_index_round_trip(hashed):
    m, data = _index_manifest(nbytes=16)
    chunks = _chunks(m, data, hashed)
    body = _v2.index_bytes(SID, 0, 1 << 20, chunks)
    raw = json.loads(body)
    assert raw["format_version"] == _v2.INDEX_COLUMNAR and "chunks" not in raw and len(raw["boxes"]) == 2
    if not hashed:
        assert len(body) < 40 * len(chunks)  # ~100 bytes a chunk as rows
    got = _v2._parse_index(m, body, 0, "idx")
    assert len(got["keys"]) == len(chunks)
    for name, c in chunks:
        n2, c2 = got["keys"][c.key]
        assert n2 == name and c2 == c and c2.blocks == c.blocks and c2.hash == c.hash


def _bad_index(fn):
    m, data = _index_manifest(nbytes=16)
    raw = json.loads(_v2.index_bytes(SID, 0, 1 << 20, _chunks(m, data)))
    fn(raw, m)
    return m, json.dumps(raw).encode()


INDEX_HOSTILE = [
    ("box-outside", lambda r, m: r["boxes"][1][0].__setitem__(0, 3), ["lies outside tensor", "shape [4, 2]"]),
    ("gap-past-end", lambda r, m: r["columns"]["gap"].__setitem__(-1, 10**6), ["lie outside", "r00000-00.safetensors"]),
    ("negative-start", lambda r, m: r["columns"]["gap"].__setitem__(0, -20), ["idx chunk 0", "bytes [-20, -4) lie outside"]),
    ("crcs-short", lambda r, m: r["columns"].update(crcs=table.pack_u32([1, 2, 3])), ["column 'crcs' ends at chunk 1"]),
    ("crcs-left-over", lambda r, m: r["columns"].update(crcs=table.pack_u32([1] * (4 * N + 2))), ["holds", "the chunks need"]),
    ("crcs-not-base64", lambda r, m: r["columns"].update(crcs="!!"), ["not base64"]),
    ("same-key-twice", lambda r, m: r["columns"]["box"].__setitem__(1, 0), ["listed twice"]),
    ("file-out-of-range", lambda r, m: r["columns"]["file"].__setitem__(5, 3), ["chunk 5", "out of range"]),
    ("unknown-tensor", lambda r, m: (r["columns"]["prefix"].__setitem__(-1, 0), r["columns"]["suffix"].__setitem__(-1, "zzz")), ["'zzz' is not in the manifest"]),
    ("short-column", lambda r, m: r["columns"]["gap"].pop(), ["column 'gap' must be a list"]),
    ("hash-in-v3", lambda r, m: (r["columns"].__setitem__("hash", [None] * len(r["columns"]["file"])), setattr(m, "version", 5)), []),
]


@pytest.mark.parametrize("case", INDEX_HOSTILE, ids=[c[0] for c in INDEX_HOSTILE])
def test_hostile_columnar_indexes_refused(case):
    name, edit, fragments = case
    m, data = _bad_index(edit)
    if name == "hash-in-v3":  # a null hash column is what a v4+ writer may write: accepted
        assert len(_v2._parse_index(m, data, 0, "idx")["keys"]) == 2 * N
        return
    with pytest.raises(CorruptCheckpointError) as e:
        _v2._parse_index(m, data, 0, "idx")
    assert all(f in str(e.value) for f in fragments), str(e.value)


def test_columnar_index_refused_for_a_v4_manifest():
    m, data = _index_manifest(nbytes=16)
    body = _v2.index_bytes(SID, 0, 1 << 20, _chunks(m, data))
    m.version = 4
    with pytest.raises(CorruptCheckpointError, match="field 'rows' must be"):
        _v2._parse_index(m, body, 0, "idx")


def _two_file_chunks(m, data, hashed):
    """Rows in two files, each file's chunks in reverse name order (negative gaps: a file holds larger items first)."""
    other = data.replace("-00.", "-01.")
    m.files[other] = FileMeta(m.files[data].size)
    out, ends = [], {data: m.files[data].size, other: m.files[other].size}
    for i, name in enumerate(sorted(m.tensors)):
        for row in (0, 2):
            f = (data, other)[(i + row) % 2]
            ends[f] -= 16
            c = ChunkMeta(f, f"{name}@{row},0", [row, 0], [2, 2], ends[f], 16, (ends[f] * 7) & 0xFFFFFFFF)
            c.blocks = [ends[f] & 0xFFFF]
            c.hash = f"{ends[f]:064x}" if hashed else None
            out.append((name, c))
    return out


@pytest.mark.parametrize("hashed", [False, True])
def test_bulk_checks_agree_with_the_row_by_row_parse(hashed):
    """The columns checked in bulk give what the row-by-row reference gives, chunk for chunk (and the reader's Chunk)."""
    from shardckpt._format import Chunk

    m, data = _index_manifest(nbytes=16)
    chunks = _two_file_chunks(m, data, hashed)
    raw = json.loads(_v2.index_bytes(SID, 0, 1 << 20, chunks))
    assert min(raw["columns"]["gap"]) < 0  # the out-of-order case, not only the monotone one
    files = raw["files"]
    bulk = table._bulk_rows(raw["boxes"], raw["columns"], m, files, hashed=hashed)
    assert bulk is not None  # a valid index takes the bulk path
    keys, by_tensor, claims = bulk
    ref_keys, ref_tensors, _ = table._rows_one_by_one(raw, m, files, hashed=hashed, where="idx")
    assert claims == [] and sorted(keys) == sorted(ref_keys) and len(keys) == len(chunks)
    for key, (name, c) in ref_keys.items():
        n2, c2 = keys[key]
        assert n2 == name and c2 == c and c2.blocks == c.blocks and c2.hash == c.hash
        at = Chunk(file="", byte_offset=0, nbytes=0, offsets=tuple(c.offsets), sizes=tuple(c.sizes))
        from_cols = keys.chunk(key, name, at, 1 << 20)
        assert from_cols == Chunk.from_meta(name, c, 1 << 20)
        # The bulk lookup of a group's rows gives the same Chunk, or the position of a row that is not there.
        tail = key[len(name):]
        assert keys.chunks_for([name], tail, at, 1 << 20) == [from_cols]
        assert keys.chunks_for([name, name + "x"], tail, at, 1 << 20) == 1
    assert {n: [c.key for c in cs] for n, cs in by_tensor.items()} == {n: [c.key for c in cs] for n, cs in ref_tensors.items()}
    assert keys.chunk("nope", "t00000", None, 1 << 20) is False


def test_bytes_claimed_twice_out_of_order_refused():
    """Two chunks of one file on the same bytes, rows out of byte order: refused as the row form refuses it."""
    m, data = _index_manifest(nbytes=16)
    chunks = _two_file_chunks(m, data, False)
    chunks[4][1].byte_offset = chunks[1][1].byte_offset + 8  # same file as chunk 1 ((i + row) % 2 == 0)
    assert chunks[4][1].file == chunks[1][1].file
    body = _v2.index_bytes(SID, 0, 1 << 20, chunks)
    with pytest.raises(CorruptCheckpointError, match="chunks share file bytes"):
        _v2._parse_index(m, body, 0, "idx")


# -- a real save and load through the tables --------------------------------------


def test_save_and_load_through_the_tables(tmp_path, monkeypatch):
    monkeypatch.setattr(table, "TABLE_MIN_ENTRIES", 4)
    path = str(tmp_path / "ck")
    state = {f"layer{i}": {"w": torch.randn(5, 3), "b": torch.arange(i, i + 4, dtype=torch.int64)} for i in range(6)}
    state["step"] = 9
    shardckpt.save(state, path)
    raw = json.load(open(os.path.join(path, "manifest.json")))
    assert raw["format_version"] == 5 and len(raw["tensor_table"]["kinds"]) == 2 and raw["tensors"] == {}
    [index] = [f for f in os.listdir(os.path.join(path, "data")) if "index" in f]
    assert json.load(open(os.path.join(path, "data", index)))["format_version"] == _v2.INDEX_COLUMNAR
    live = {f"layer{i}": {"w": torch.zeros(5, 3), "b": torch.zeros(4, dtype=torch.int64)} for i in range(6)}
    live["step"] = 0
    shardckpt.load(live, path)
    assert live["step"] == 9 and all(torch.equal(live[k]["w"], state[k]["w"]) and torch.equal(live[k]["b"], state[k]["b"]) for k in live if k != "step")
    m = shardckpt.verify(path)
    assert len(m.tensors) == 12 and sum(len(t.chunks) for t in m.tensors.values()) == 12


def _table_order_index(extra, block_bytes: int = 1 << 20):
    """A parsed manifest (tensor table) and an index of one chunk of each of its tensors, in table order."""
    names = [f"t{i:05d}" for i in range(N)] + ([extra] if extra else [])
    data = "data/0123456789ab-r00000-00.safetensors"
    tensors = {nm: TensorMeta("F32", [4, 2], regular=_reg([2], ["S(0)"])) for nm in names}
    m = manifest_from_bytes(manifest_to_bytes(Manifest(
        world_size=2, tensors=tensors, files={data: FileMeta(8 + 32 * len(names))}, save_id=SID, version=FORMAT_VERSION,
        block_bytes=1 << 20, meshes=["iota"], indexes={})))
    chunks, pos = [], 8
    for nm in sorted(names):
        whole = nm == extra  # the extra tensor's chunk is whole: its key is its bare name
        offs, sizes = ([0, 0], [4, 2]) if whole else ([2, 0], [2, 2])
        c = ChunkMeta(data, nm if whole else f"{nm}@2,0", offs, sizes, pos, 4 * sizes[0] * sizes[1], pos)
        c.blocks = [pos * 7 + b for b in range(-(-c.nbytes // block_bytes))]
        chunks.append((nm, c))
        pos += c.nbytes
    m.block_bytes = block_bytes  # below the format's least (4 KiB): many blocks a chunk, for the test
    return m, sorted(names), chunks, _v2.index_bytes(SID, 0, block_bytes, chunks)


def test_an_index_in_table_order_is_answered_by_position():
    m, names, chunks, body = _table_order_index("u")
    assert m.tensors.in_table_order(names) and not m.tensors.in_table_order(names[::-1])
    keys = _v2._parse_index(m, body, 0, "idx")["keys"]
    assert keys.table_order
    for name, c in chunks[:3] + chunks[-3:]:  # the key map, made on demand
        assert keys[c.key] == (name, c)
    box = _v2._geometry.Box((2, 0), (2, 2))
    rows = list(range(0, len(names) - 1, 2))
    got = keys.chunks_for([names[i] for i in rows], "@2,0", box, 1 << 20, rows)
    assert [(c.tensor, c.key, c.byte_offset) for c in got] == [(names[i], chunks[i][1].key, chunks[i][1].byte_offset) for i in rows]
    # Rows that are not those names' (a caller's mistake) are caught, as a lookup would be.
    assert keys.chunks_for([names[i] for i in rows], "@2,0", box, 1 << 20, [i + 1 for i in rows]) == 0
    # A record built since: names in order no longer mean rows by position.
    m.tensors[names[0]]
    assert not m.tensors.in_table_order(names)


def test_a_key_twice_in_a_table_order_index_refused():
    """Names holding "@" can give one key twice (``t00000@2,0`` whole, ``t00000`` at row 2): still refused."""
    m, _, _, body = _table_order_index("t00000@2,0")
    with pytest.raises(CorruptCheckpointError, match="listed twice"):
        _v2._parse_index(m, body, 0, "idx")


@pytest.mark.parametrize("extra,block_bytes", [(None, 4), (None, 3), ("u", 4), ("u", 1 << 20)])
def test_chunks_of_a_table_order_index_match_the_row_by_row_reference(extra, block_bytes):
    """Rows of as many blocks each (CRCs by position) or not (the extra whole chunk has more): the same Chunks."""
    m, names, chunks, body = _table_order_index(extra, block_bytes)
    keys = _v2._parse_index(m, body, 0, "idx")["keys"]
    assert keys._cols.stride == (0 if extra and block_bytes < 32 else 1 + -(-16 // block_bytes))
    box = _v2._geometry.Box((2, 0), (2, 2))
    rows = list(range(N))  # every tensor but the whole one
    want = [names[i] for i in rows]
    for got in (keys.chunks_for(want[:9], "@2,0", box, block_bytes, rows[:9]), keys.chunks_for(want, "@2,0", box, block_bytes, rows)):
        ref = [keys.chunk(f"{n}@2,0", n, box, block_bytes) for n in want[:len(got)]]
        assert got == ref and got[3].block_crcs == tuple(chunks[3][1].blocks) and len(got[3].block_crcs) == -(-16 // block_bytes)
