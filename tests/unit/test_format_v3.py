"""Format v3: the manifest's compact per-rank file table (docs/format.md, "Format v3").

Round trips (table, plain ``files`` and a mix), the bytes a 16,384-rank
manifest takes against v2, v2 checkpoints still loading, and hostile tables:
refused with our types, bounds checked before a single name is built.
"""

from __future__ import annotations

import json
import os

import pytest
import torch

import shardckpt
from shardckpt._format import (
    FORMAT_VERSION,
    FileMeta,
    IndexMeta,
    Manifest,
    _v2,
    data_file_name,
    index_file_name,
    manifest_from_bytes,
    manifest_to_bytes,
)
from shardckpt._format.checksum import crc32c
from shardckpt._format.manifest import MANIFEST_CRC_FIELD, manifest_json_v2
from shardckpt.errors import CorruptCheckpointError, UnsafeMetadataError

SID = "0123456789abcdef0123456789abcdef"


def _manifest(ranks: int, files_per_rank: int = 1, *, version: int = FORMAT_VERSION, extra_files=(), skip=()) -> Manifest:
    files, idx = {}, {}
    for r in range(ranks):
        if r in skip:
            continue
        for i in range(files_per_rank):
            files[data_file_name(SID, f"r{r:05d}-{i:02d}")] = FileMeta(1 << 20 | r << 4 | i)
        rel = index_file_name(SID, r)
        files[rel] = FileMeta(1000 + r)
        idx[rel] = IndexMeta(r, 1000 + r, (r * 2654435761) % 2**32)
    for rel in extra_files:
        files[rel] = FileMeta(7)
    return Manifest(world_size=ranks, tensors={}, files=files, save_id=SID, version=version, block_bytes=1 << 20,
                    meshes=["iota"], indexes=idx, values={"step": 3})


def _raw(m: Manifest) -> dict:
    return json.loads(manifest_to_bytes(m))


def _bytes(raw: dict) -> bytes:
    """``raw`` re-encoded with a valid ``manifest_crc32c`` (so checks after the checksum are reached)."""
    raw = dict(raw)
    raw.pop(MANIFEST_CRC_FIELD, None)
    raw[MANIFEST_CRC_FIELD] = crc32c(manifest_json_v2(raw))
    return manifest_json_v2(raw)


def test_table_round_trip_and_layout():
    m = _manifest(3, 2)
    raw = _raw(m)
    assert raw["format_version"] == 5 and raw["files"] == {} and raw["indexes"] == {}
    t = raw["file_table"]
    assert t["data"] == "data/0123456789ab-r{rank}-{i}.safetensors" and t["index"] == "data/0123456789ab-index-r{rank}.json"
    assert t["data_sizes"] == [[1 << 20 | r << 4, 1 << 20 | r << 4 | 1] for r in range(3)]
    assert t["index_files"] == [[1000 + r, (r * 2654435761) % 2**32] for r in range(3)]
    back = manifest_from_bytes(manifest_to_bytes(m))
    assert back.files == m.files and back.indexes == m.indexes and back.version == 5
    assert manifest_to_bytes(back) == manifest_to_bytes(m)  # deterministic


def test_files_outside_the_rule_stay_listed():
    cut = data_file_name(SID, "r00001-00-h001")  # a data file cut for its header
    conv = data_file_name(SID, "00")  # a converter's tag
    other = data_file_name("f" * 32, "r00000-00")  # another save prefix
    wide = data_file_name(SID, "r000001-00")  # not the canonical rank width
    beyond = data_file_name(SID, "r00009-00")  # rank >= world_size
    m = _manifest(3, 1, extra_files=[cut, conv, other, wide, beyond], skip=[1])
    raw = _raw(m)
    assert sorted(raw["files"]) == sorted([cut, conv, other, wide, beyond])
    assert raw["file_table"]["data_sizes"][1] == [] and raw["file_table"]["index_files"][1] is None
    back = manifest_from_bytes(manifest_to_bytes(m))
    assert back.files == m.files and back.indexes == m.indexes


def test_gaps_in_file_numbers_are_null():
    m = _manifest(2, 0)
    m.files[data_file_name(SID, "r00001-02")] = FileMeta(5)
    raw = _raw(m)
    assert raw["file_table"]["data_sizes"] == [[], [None, None, 5]]
    assert manifest_from_bytes(manifest_to_bytes(m)).files == m.files


def test_16384_ranks_manifest_is_small():
    v2 = manifest_to_bytes(_manifest(16384, version=2))
    v3 = manifest_to_bytes(_manifest(16384))
    assert len(v3) * 5 < len(v2), (len(v2), len(v3))
    a, b = manifest_from_bytes(v2), manifest_from_bytes(v3)
    assert a.files == b.files and a.indexes == b.indexes


def test_v2_checkpoint_still_loads(tmp_path, monkeypatch):
    """A checkpoint whose manifest is v2 (every file listed) loads, verifies and inspects as before."""
    path = str(tmp_path / "ck")
    state = {"w": torch.randn(33, 5), "b": torch.arange(7), "step": 4}
    shardckpt.save(state, path)
    man = os.path.join(path, "manifest.json")
    m = manifest_from_bytes(open(man, "rb").read())
    m.version = 2
    open(man, "wb").write(manifest_to_bytes(m))
    raw = json.loads(open(man, "rb").read())
    assert raw["format_version"] == 2 and "file_table" not in raw and len(raw["files"]) == 2
    live = {"w": torch.zeros(33, 5), "b": torch.zeros(7, dtype=torch.int64), "step": 0}
    shardckpt.load(live, path)
    assert torch.equal(live["w"], state["w"]) and torch.equal(live["b"], state["b"]) and live["step"] == 4
    assert shardckpt.verify(path).version == 2


# -- hostile tables ---------------------------------------------------------------


def _table(**changes):
    def edit(raw):
        raw["file_table"].update(changes)

    return edit


UNSAFE_PATTERNS = [
    ("dotdot", _table(data="../x-r{rank}-{i}.safetensors"), "'../x-r00000-00.safetensors'"),
    ("absolute", _table(index="/etc/r{rank}"), "'/etc/r00000'"),
    ("scheme", _table(data="s3://b/r{rank}-{i}"), "s3://b/r00000-00"),
    ("slash-run", _table(data="data//r{rank}-{i}"), "data//r00000-00"),
    ("other-brace", _table(data="data/{rank}-{i}-{x}"), "braces"),
    ("format-spec", _table(data="data/{rank:>99999}-{i}"), "once each"),
    ("no-i", _table(data="data/r{rank}.safetensors"), "once each"),
    ("two-ranks", _table(index="data/{rank}-{rank}.json"), "once each"),
    ("i-in-index", _table(index="data/{rank}-{i}.json"), "once each"),
    ("not-a-string", _table(data=7), "non-empty string"),
    ("no-table", lambda raw: raw.pop("file_table"), "missing field 'file_table'"),
]


@pytest.mark.parametrize("case", UNSAFE_PATTERNS, ids=[c[0] for c in UNSAFE_PATTERNS])
def test_unsafe_patterns_refused_before_the_checksum(case):
    _, edit, fragment = case
    raw = _raw(_manifest(2))
    edit(raw)
    data = manifest_json_v2(raw)  # the checksum is now wrong too: paths are checked first
    with pytest.raises((UnsafeMetadataError, CorruptCheckpointError)) as e:
        manifest_from_bytes(data)
    assert fragment in str(e.value)
    if case[0] != "no-table":
        assert isinstance(e.value, UnsafeMetadataError)


DAMAGED = [
    ("short-sizes", _table(data_sizes=[[1]]), "one entry per rank"),
    ("short-indexes", _table(index_files=[None]), "one entry per rank"),
    ("size-bool", _table(data_sizes=[[True], [1]]), "non-negative int or null"),
    ("size-negative", _table(data_sizes=[[-1], [1]]), "non-negative int or null"),
    ("size-str", _table(data_sizes=[["1"], [1]]), "non-negative int or null"),
    ("row-not-list", _table(data_sizes=[5, [1]]), "must be a list"),
    ("index-shape", _table(index_files=[[1], None]), "[size, crc32c] or null"),
    ("index-crc-range", _table(index_files=[[1, 2**32], None]), "out of range"),
    ("index-too-big", _table(index_files=[[1 << 31, 0], None]), "out of range"),
]


@pytest.mark.parametrize("case", DAMAGED, ids=[c[0] for c in DAMAGED])
def test_damaged_tables_refused(case):
    _, edit, fragment = case
    raw = _raw(_manifest(2))
    edit(raw)
    with pytest.raises(CorruptCheckpointError) as e:
        manifest_from_bytes(_bytes(raw))
    assert fragment in str(e.value)


def test_name_listed_twice_refused():
    raw = _raw(_manifest(2))
    raw["files"][data_file_name(SID, "r00001-00")] = {"size": 3}
    with pytest.raises(CorruptCheckpointError, match="listed twice"):
        manifest_from_bytes(_bytes(raw))
    raw = _raw(_manifest(2))
    raw["file_table"]["index"] = "data/0123456789ab-r{rank}-00.safetensors"  # index names = data names
    with pytest.raises(CorruptCheckpointError, match="listed twice"):
        manifest_from_bytes(_bytes(raw))


def test_checksum_covers_the_table():
    raw = _raw(_manifest(2))
    raw["file_table"]["data_sizes"][1][0] += 1
    with pytest.raises(CorruptCheckpointError, match="checksum mismatch"):
        manifest_from_bytes(manifest_json_v2(raw))


def test_v2_manifest_with_a_table_refused():
    raw = _raw(_manifest(2))
    raw["format_version"] = 2
    with pytest.raises(CorruptCheckpointError, match="carries 'file_table'"):
        manifest_from_bytes(_bytes(raw))


def _no_expansion(monkeypatch):
    def boom(pattern):
        raise AssertionError("the table was expanded before its bounds were checked")

    monkeypatch.setattr(_v2, "_namer", boom)


def test_absurd_table_refused_before_expanding(monkeypatch):
    monkeypatch.setattr(_v2, "MAX_TABLE_FILES", 1000)
    raw = _raw(_manifest(2))
    raw["file_table"]["data_sizes"] = [[0] * 600, [0] * 600]
    data = _bytes(raw)
    _no_expansion(monkeypatch)
    with pytest.raises(UnsafeMetadataError, match="refused before expanding"):
        manifest_from_bytes(data)


def test_too_many_files_for_one_rank_refused(monkeypatch):
    raw = _raw(_manifest(2))
    raw["file_table"]["data_sizes"] = [[0] * (_v2.MAX_FILES_PER_RANK + 1), []]
    data = _bytes(raw)
    _no_expansion(monkeypatch)
    with pytest.raises(UnsafeMetadataError, match="per rank"):
        manifest_from_bytes(data)


def test_too_many_ranks_refused(monkeypatch):
    monkeypatch.setattr(_v2, "MAX_TABLE_RANKS", 3)
    raw = _raw(_manifest(4))
    data = _bytes(raw)
    _no_expansion(monkeypatch)
    with pytest.raises(UnsafeMetadataError, match="rank limit"):
        manifest_from_bytes(data)


def _instances(cls) -> int:
    import gc

    return sum(type(o) is cls for o in gc.get_objects())


def test_a_parse_builds_no_record_per_rank():
    """A table of one data and one index file per rank is answered from its columns: lookups build one record each."""
    ranks = 4096
    m0 = _manifest(ranks)
    body = manifest_to_bytes(m0)
    before = (_instances(FileMeta), _instances(IndexMeta))
    m = manifest_from_bytes(body)
    assert (_instances(FileMeta) - before[0], _instances(IndexMeta) - before[1]) < (16, 16)  # was 8,192 and 4,096
    assert len(m.files) == 2 * ranks and len(m.indexes) == ranks
    data, rel = data_file_name(SID, "r04095-00"), index_file_name(SID, 17)
    assert m.files[data].size == m0.files[data].size and m.files[rel].size == 1017
    assert m.indexes[rel] == IndexMeta(17, 1017, (17 * 2654435761) % 2**32) and m.files[data] is m.files[data]
    # Not the canonical name of a table rank and file: absent, as from the dict.
    for path in (data_file_name(SID, "r004095-00"), data_file_name(SID, "r04096-00"), data_file_name(SID, "r00001-01"),
                 data_file_name("f" * 32, "r00001-00"), index_file_name(SID, ranks), "data/" + "9" * 5000):
        assert path not in m.files and path not in m.indexes and m.files.get(path) is None
    assert _v2._index_of_rank(m)[ranks - 1] == index_file_name(SID, ranks - 1)
    # Iterated, it is the dict the writer listed (same order as an expanded parse), and changes stick.
    assert m.files == m0.files and m.indexes == m0.indexes
    assert list(m.indexes) == sorted(m0.indexes)
    m.files[data] = FileMeta(1)
    assert m.files[data].size == 1 and len(m.files) == 2 * ranks
    assert manifest_from_bytes(manifest_to_bytes(m)).files[data].size == 1


def test_a_table_rank_listed_again_as_a_plain_index_refused():
    raw = _raw(_manifest(2))
    other = "data/other-index.json"
    raw["files"][other] = {"size": 1001}
    raw["indexes"][other] = {"rank": 1, "size": 1001, "crc32c": 5}
    with pytest.raises(CorruptCheckpointError, match="rank 1 outside 0..1 or listed twice"):
        manifest_from_bytes(_bytes(raw))


def test_patterns_that_could_give_one_name_twice_are_expanded():
    """Adjacent placeholders (``r{rank}{i}``: rank 12345 file 7 vs rank 1234 file 57...) are not answered lazily."""
    raw = _raw(_manifest(3))
    raw["file_table"]["data"] = "data/x-r{rank}{i}.safetensors"
    m = manifest_from_bytes(_bytes(raw))
    assert type(m.files) is dict and m.files["data/x-r0000200.safetensors"].size == 1 << 20 | 2 << 4
    assert not _v2.disjoint_patterns("d/{rank}{i}.st", "d/x{rank}.json", "{rank}", "{i}")
    assert _v2.disjoint_patterns("d/r{rank}-{i}.st", "d/index-r{rank}.json", "{rank}", "{i}")
    # Heads and tails that could meet: the same file as data and as index (refused, as before).
    assert not _v2.disjoint_patterns("d/r{rank}-{i}.st", "d/r{rank}-00.st", "{rank}", "{i}")
