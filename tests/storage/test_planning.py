"""The storage layer's pure parts: range planning, path checks, backend choice; and no torch."""

from __future__ import annotations

import subprocess
import sys

import pytest

from shardckpt._storage import FsspecStorage, LocalStorage, S3Storage, Storage, backend_for, plan_range_fetches
from shardckpt._storage._base import CORE, check_rel
from shardckpt._storage._obstore import ObstoreData, data_end, split_pieces
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


def test_a_backend_missing_part_of_the_core_fails_where_it_is_defined():
    """Storage is a plain class (so ``Storage(url)`` type-checks) that still refuses an incomplete backend."""
    with pytest.raises(TypeError, match="Half must implement the storage core: .*_read_ranges"):

        class Half(Storage):
            def path(self, rel):
                return rel

    body = {name: (lambda self, *a, **k: None) for name in CORE}
    assert issubclass(type("Whole", (Storage,), body), Storage)


def test_s3_read_pieces():
    assert split_pieces([(0, 10), (20, 21)], 4) == [(0, 4), (4, 8), (8, 10), (20, 21)]
    pieces = split_pieces([(0, 10)], 4)
    assert data_end(pieces, {0: 4, 4: 4, 8: 2}) == 10
    assert data_end(pieces, {0: 4, 4: 1, 8: 0}) == 5  # the first short piece ends the data
    assert data_end([], {}) == 0


def test_s3_data_path_is_obstore(monkeypatch):
    """S3Storage moves its bytes through obstore; without obstore, making one says how to install it."""
    opts = {"key": "k", "secret": "s", "endpoint_url": "http://127.0.0.1:9"}
    st = Storage("s3://bucket/x", storage_options=opts)
    assert type(st._data) is ObstoreData and type(st.child("y")._data) is ObstoreData
    monkeypatch.setitem(sys.modules, "obstore", None)  # import obstore -> ImportError
    with pytest.raises(StorageError, match=r"s3:// needs obstore.*pip install obstore \(or 'shardckpt\[s3\]'\)"):
        Storage("s3://bucket/x", storage_options=opts)


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


def test_backoff_is_jittered_and_capped(monkeypatch):
    import random

    from shardckpt import _knobs
    from shardckpt._storage import backoff_delay

    monkeypatch.setattr(_knobs, "RETRY_BASE_DELAY_S", 0.5)
    monkeypatch.setattr(_knobs, "RETRY_MAX_DELAY_S", 3.0)
    rng = random.Random(0)
    for attempt, cap in [(0, 0.5), (1, 1.0), (2, 2.0), (3, 3.0), (40, 3.0)]:
        ds = [backoff_delay(attempt, rng=rng) for _ in range(200)]
        assert all(0 <= d <= cap for d in ds) and max(ds) > cap * 0.8 and len(set(ds)) > 150


def _client_error(code, status):
    from botocore.exceptions import ClientError

    return ClientError({"Error": {"Code": code, "Message": "m"}, "ResponseMetadata": {"HTTPStatusCode": status}}, "GetObject")


@pytest.mark.parametrize(
    "code,status,outcome",
    [
        ("SlowDown", 503, None),
        ("InternalError", 500, None),
        ("ServiceUnavailable", 503, None),
        ("RequestTimeout", 400, None),
        ("Whatever", 502, None),
        ("TooManyRequests", 429, None),
        ("NoSuchKey", 404, FileNotFoundError),
        ("AccessDenied", 403, "credentials"),
        ("InvalidAccessKeyId", 403, "credentials"),
        ("SignatureDoesNotMatch", 403, "credentials"),
        ("NoSuchBucket", 404, "bucket does not exist"),
        ("InvalidArgument", 400, "InvalidArgument"),
    ],
)
def test_s3_error_classification(code, status, outcome):
    """Transient S3 answers are retried (None); the rest become our errors, never botocore's."""
    st = S3Storage("s3://bucket/x", storage_options={"key": "k", "secret": "s", "endpoint_url": "http://127.0.0.1:9"})
    got = st._classify(_client_error(code, status), "read s3://bucket/x/f")
    if outcome is None:
        assert got is None
    elif outcome is FileNotFoundError:
        assert isinstance(got, FileNotFoundError)
    else:
        assert isinstance(got, StorageError) and outcome in str(got) and "s3://bucket/x/f" in str(got)


def test_s3_transport_errors_are_transient_and_missing_credentials_are_ours():
    import asyncio

    import aiohttp
    from botocore.exceptions import EndpointConnectionError, NoCredentialsError, ReadTimeoutError

    st = S3Storage("s3://bucket/x", storage_options={"key": "k", "secret": "s", "endpoint_url": "http://127.0.0.1:9"})
    for e in (
        ConnectionResetError("reset"),
        asyncio.TimeoutError(),
        aiohttp.ServerDisconnectedError(),
        EndpointConnectionError(endpoint_url="http://127.0.0.1:9"),
        ReadTimeoutError(endpoint_url="http://127.0.0.1:9"),
    ):
        assert st._classify(e, "x") is None, e
    got = st._classify(NoCredentialsError(), "stat s3://bucket/x/manifest.json")
    assert isinstance(got, StorageError) and "storage_options" in str(got) and "AWS_ACCESS_KEY_ID" in str(got)
    assert isinstance(st._classify(PermissionError("denied"), "x"), StorageError)
    bug = TypeError("a bug")
    assert st._classify(bug, "x") is bug


def test_fault_proxy_fates_are_seeded():
    from _faultproxy import FaultProxy

    fates = []
    for _ in range(2):
        p = FaultProxy(("127.0.0.1", 9), seed=7)
        try:
            p.set_faults(reset=0.2, slowdown=0.2, delay=0.1, stall=0.1)
            fates.append([p._fate(n)[0] for n in range(200)])
        finally:
            p.close()
    assert fates[0] == fates[1] and {"pass", "reset", "slowdown", "delay", "stall"} == set(fates[0])
