"""The checkpoint's file grammar (``_format.naming``), each name with its inverse, and the version table's capabilities.

Pure: names and ints, no storage. The writers format names with these
functions and the readers (the flusher deciding what each rank uploads, the
memory tier listing its steps) parse them with the inverses, so a change of
the grammar is one change.
"""

from __future__ import annotations

import pytest

from shardckpt._format import naming, versions
from shardckpt._format.naming import step_dir_name
from shardckpt._memory.plan import files_by_writer, writer_of
from shardckpt._save import RankResult


def test_step_names_round_trip_and_sort():
    names = [step_dir_name(s) for s in (0, 7, 1000, 99_999_999, 123_456_789_012)]
    assert names[:3] == ["step-00000000", "step-00000007", "step-00001000"]
    assert [naming.parse_step_dir(n) for n in names] == [0, 7, 1000, 99_999_999, 123_456_789_012]
    assert naming.parse_step_dir("step-00000007/") == 7
    assert [naming.parse_step_dir(n) for n in ("step-", "step-x1", "stepp-01", ".removing-step-00000001-ab", "step-1-hf")] == [None] * 5


def test_rank_file_names_round_trip():
    sid = "0123456789abcdef0123456789abcdef"
    for rank, part in [(0, 0), (1, 3), (99_999, 99), (123_456, 7)]:
        rel = naming.rank_file_name(sid, rank, part)
        assert rel.startswith("data/0123456789ab-") and rel.endswith(".safetensors")
        assert naming.parse_data_file_name(rel) == naming.DataFileName("0123456789ab", rank, part)
    for other in ("model.safetensors", "data/0123456789ab-index-r00001.json", "manifest.json",
                  "data/0123456789ab-r00001-00.safetensors.tmp", "@step-00000002/data/ab-r00001-00.safetensors",
                  "data/XYZ-r00001-00.safetensors"):
        assert naming.parse_data_file_name(other) is None, other


def test_index_and_staging_names_round_trip():
    sid = "0123456789abcdef"
    for rank in (0, 5, 100_000):
        assert naming.parse_index_file_name(naming.index_file_name(sid, rank)) == rank
    assert naming.parse_index_file_name(naming.rank_file_name(sid, 1, 0)) is None
    assert naming.parse_staging_dir(naming.staging_dir_name(3, 4242)) == 4242
    assert naming.parse_staging_dir("step-00000001") is None and naming.parse_staging_dir(".restore-r3-") is None


def test_the_flusher_finds_writers_through_the_grammar():
    sid = "0123456789abcdef"
    files = [naming.rank_file_name(sid, 2, 0), naming.rank_file_name(sid, 2, 1), naming.index_file_name(sid, 1), "manifest.json"]
    index_ranks = {naming.index_file_name(sid, 1): 1}
    assert writer_of(files[0], index_ranks) == 2 and writer_of("manifest.json", index_ranks) == 0
    assert files_by_writer(files, index_ranks) == {0: ["manifest.json"], 1: [files[2]], 2: sorted(files[:2])}


def test_version_capabilities_come_from_the_table():
    for n, s in versions.VERSIONS.items():
        assert versions.supports(n, "content_hash") is s.content_hash
        assert versions.supports(n, "tensor_table") is s.tensor_table
    assert versions.first_with("file_table") == 3 and versions.first_with("content_hash") == 4
    assert not versions.is_newer(versions.NEWEST) and versions.is_newer(versions.NEWEST + 1)
    with pytest.raises(ValueError, match="not a format capability"):
        versions.supports(4, "content_hashes")  # a typo is an error, never False
    with pytest.raises(ValueError, match="not one this shardckpt knows"):
        versions.supports(versions.NEWEST + 1, "content_hash")


def test_a_rank_result_round_trips_through_its_wire_tuple():
    res = RankResult(chunks=[{"name": "w", "file": "data/x.safetensors"}], file_sizes={"data/x.safetensors": 8},
                     per_rank={"seed": 1}, index=("data/x-index-r00000.json", 10, 7), regular_bytes=8,
                     per_rank_specs={"r": ("F32", [2])})
    wire = res.to_wire()
    assert isinstance(wire, tuple) and len(wire) == 7
    assert RankResult.from_wire(wire) == res
    assert RankResult.from_wire(list(wire[:4]) + [list(wire[4])] + list(wire[5:])) == res  # a list index (a pickled wire) too
    with pytest.raises(Exception):
        res.regular_bytes = 0  # type: ignore[misc]  # frozen
