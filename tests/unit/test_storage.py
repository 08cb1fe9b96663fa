"""Storage: the local fast path and fsspec (``memory://``) behave the same."""

from __future__ import annotations

import os
import uuid

import pytest

from shardckpt._storage import Storage, join_url
from shardckpt.errors import StorageError, UnsafeMetadataError


@pytest.fixture(params=["local", "file", "memory"])
def storage(request, tmp_path):
    if request.param == "local":
        st = Storage(str(tmp_path / "root"))
    elif request.param == "file":
        st = Storage("file://" + str(tmp_path / "root"), storage_options={"auto_mkdir": True})
    else:
        st = Storage(f"memory://shardckpt-storage/{uuid.uuid4().hex}")
    yield st
    st.remove_tree()


def test_kinds():
    assert Storage("/tmp/x").is_local and Storage("file:///tmp/x").is_local
    assert Storage("file:///tmp/x", storage_options={"auto_mkdir": True}).is_local
    assert not Storage("memory://b/x").is_local
    assert Storage("memory://b/x/").url == "memory://b/x"
    assert join_url("s3://b/run/", "/data/x") == "s3://b/run/data/x"
    assert join_url("s3://b/run", "") == "s3://b/run"
    assert Storage("memory://b/x").child("step-1").url == "memory://b/x/step-1"


def test_write_read_list(storage):
    w = storage.open_write("data/a.bin")
    w.write(b"hello ")
    w.write(memoryview(bytearray(b"world")))
    w.close()
    storage.write_atomic("manifest.json", b"{}")
    storage.write_atomic("manifest.json", b'{"v": 2}')  # replaces
    assert storage.exists("data/a.bin") and not storage.exists("data/b.bin")
    assert storage.size("data/a.bin") == 11
    assert storage.read_bytes("data/a.bin") == b"hello world"
    assert storage.read_bytes("manifest.json") == b'{"v": 2}'
    assert storage.read_range("data/a.bin", 6, 5) == b"world"
    assert storage.listdir() == ["data", "manifest.json"]
    assert storage.listdir("data") == ["a.bin"]
    assert storage.listdir("nope") == []
    assert storage.walk_files() == ["data/a.bin", "manifest.json"]
    # ranged reads into caller buffers
    a, b = bytearray(5), bytearray(3)
    storage.read_into("data/a.bin", [(0, memoryview(a)), (8, memoryview(b))])
    assert bytes(a) == b"hello" and bytes(b) == b"rld"
    with pytest.raises(EOFError, match="ends before byte 14"):
        storage.read_into("data/a.bin", [(8, memoryview(bytearray(6)))])
    with pytest.raises(FileNotFoundError):
        storage.size("data/missing.bin")
    with pytest.raises(UnsafeMetadataError, match="11 bytes exceeds the 10-byte limit"):
        storage.read_bytes("data/a.bin", limit=10)
    storage.remove("data/a.bin")
    storage.remove("data/a.bin")  # missing is fine
    assert storage.walk_files() == ["manifest.json"]
    storage.remove_tree()
    assert storage.walk_files() == []
    storage.remove_tree()  # missing is fine


def test_aborted_write_leaves_nothing(storage):
    w = storage.open_write("data/part.bin")
    w.write(b"x" * 100)
    w.abort()
    assert not storage.exists("data/part.bin")


def test_local_write_atomic_leaves_no_temp_files(tmp_path):
    st = Storage(str(tmp_path))
    for i in range(3):
        st.write_atomic("manifest.json", str(i).encode())
    assert os.listdir(tmp_path) == ["manifest.json"]
    assert (tmp_path / "manifest.json").read_bytes() == b"2"


def test_unknown_protocol_gives_install_hint():
    with pytest.raises(StorageError, match="cannot open 'nosuchproto://b/x'") as ei:
        Storage("nosuchproto://b/x")
    assert "nosuchproto" in str(ei.value)


def test_missing_backend_names_the_package(monkeypatch):
    import fsspec

    def no_backend(url, **kw):
        raise ImportError("Install s3fs to access S3")

    monkeypatch.setattr(fsspec.core, "url_to_fs", no_backend)
    with pytest.raises(StorageError, match=r"Install s3fs \(e\.g\. pip install s3fs\)"):
        Storage("s3://bucket/x")


@pytest.mark.parametrize("url", ["", None, 5])
def test_bad_url(url):
    with pytest.raises(StorageError, match="non-empty str"):
        Storage(url)


def test_retries_transient_errors(monkeypatch):
    from shardckpt import _knobs

    monkeypatch.setattr(_knobs, "RETRY_BASE_DELAY_S", 0.001)
    st = Storage(f"memory://shardckpt-storage/{uuid.uuid4().hex}", retries=3)
    st.write_atomic("f", b"abc")
    real = st.fs.cat_file
    calls = {"n": 0}

    def flaky(*a, **kw):
        calls["n"] += 1
        if calls["n"] < 3:
            raise ConnectionError("503 slow down")
        return real(*a, **kw)

    monkeypatch.setattr(st.fs, "cat_file", flaky)
    assert st.read_bytes("f") == b"abc" and calls["n"] == 3
    calls["n"] = -10
    with pytest.raises(StorageError, match="failed after 3 attempts: 503 slow down"):
        st.read_bytes("f")

    # Missing files are not retried.
    def missing(*a, **kw):
        calls["n"] += 100
        raise FileNotFoundError("f")

    calls["n"] = 0
    monkeypatch.setattr(st.fs, "cat_file", missing)
    with pytest.raises(FileNotFoundError):
        st.read_bytes("f")
    assert calls["n"] == 100
    st.remove_tree()
