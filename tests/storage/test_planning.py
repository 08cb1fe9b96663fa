"""The storage layer's pure parts: range planning, path checks, backend choice; and no torch."""

from __future__ import annotations

import subprocess
import sys

import pytest

from shardckpt._storage import FsspecStorage, LocalStorage, S3Storage, backend_for, plan_range_fetches
from shardckpt._storage._base import check_rel
from shardckpt.errors import StorageError, UnsafeMetadataError


def test_plan_range_fetches():
    assert plan_range_fetches([]) == []
    assert plan_range_fetches([(0, 4), (6, 2), (100, 1)], max_gap=2) == [(0, 8, [0, 1]), (100, 101, [2])]
    # unordered, overlapping, contained, empty
    assert plan_range_fetches([(50, 10), (0, 10), (5, 2), (55, 20), (30, 0)], max_gap=0) == [(0, 10, [1, 2]), (50, 75, [0, 3])]
    # a gap one byte too wide splits
    assert plan_range_fetches([(0, 10), (13, 1)], max_gap=2) == [(0, 10, [0]), (13, 14, [1])]
    assert plan_range_fetches([(0, 10), (12, 1)], max_gap=2) == [(0, 13, [0, 1])]


@pytest.mark.parametrize("rel", ["data/x.safetensors", "", "a/b/c", ".hidden", "a..b"])
def test_check_rel_accepts(rel):
    assert check_rel(rel, where="s3://b/r") == rel


@pytest.mark.parametrize("rel", ["..", "../x", "a/../..", "a\\..\\x", "x\x00"])
def test_check_rel_refuses(rel):
    with pytest.raises(UnsafeMetadataError, match="s3://b/r: path .* escapes the checkpoint root"):
        check_rel(rel, where="s3://b/r")


def test_backend_for():
    assert backend_for("/tmp/x") is LocalStorage and backend_for("rel/dir") is LocalStorage
    assert backend_for("file:///tmp/x", {"auto_mkdir": True}) is LocalStorage
    for url in ("memory://x", "local:///tmp/x", "gs://b/x", "az://c/x"):
        assert backend_for(url) is FsspecStorage
    for url in ("s3://b/x", "s3a://b/x"):
        assert backend_for(url) is S3Storage and issubclass(S3Storage, FsspecStorage)
    with pytest.raises(StorageError, match="non-empty str"):
        backend_for("")


def test_storage_imports_no_torch():
    code = "import sys; sys.modules['torch'] = None; import shardckpt._storage as s; s.Storage('memory://x/y').write_atomic('a', b'1')"
    subprocess.run([sys.executable, "-c", code], check=True)
