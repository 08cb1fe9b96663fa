"""One contract, every backend: the same tests on local paths, ``file://`` with
options, fsspec's own local filesystem (a backend with real directories),
``memory://`` and S3 (moto server on loopback, ``-m s3``).

Each ``Test*`` class below only says how to make a fresh, empty root; the
tests themselves are in :class:`StorageContract`. A new backend gets its
class here and must pass all of it.
"""

from __future__ import annotations

import threading
import uuid

import pytest

from shardckpt._storage import FsspecStorage, LocalStorage, S3Storage, Storage
from shardckpt.errors import StorageError, UnsafeMetadataError

ESCAPES = ["../x", "data/../../x", "a/..", "..", "data/\x00x"]


class StorageContract:
    """Every backend must pass these. Subclasses provide ``st`` (an empty root) and ``other`` (a second handle on it)."""

    expect_type: type = Storage

    # -- basics -----------------------------------------------------------------

    def test_factory_and_urls(self, st):
        assert isinstance(st, self.expect_type) and isinstance(st, Storage)
        assert not st.url.endswith("/")
        assert st.url_of("data/a.bin") == st.url + "/data/a.bin"
        assert st.url_of("") == st.url
        c = st.child("step-1")
        assert type(c) is type(st) and c.url == st.url + "/step-1" and c.storage_options == st.storage_options
        c.write_atomic("f", b"x")
        assert st.read_bytes("step-1/f") == b"x"
        sib = st.sibling(".tmp-" + uuid.uuid4().hex[:6])
        assert type(sib) is type(st) and sib.url.rsplit("/", 1)[0] == st.url.rsplit("/", 1)[0]

    def test_missing_files(self, st):
        assert not st.exists("nope") and not st.is_file("nope")
        for call in (
            lambda: st.size("nope"),
            lambda: st.read_bytes("nope"),
            lambda: st.read_bytes("nope", limit=10),
            lambda: st.read_range("nope", 0, 4),
            lambda: st.read_into("nope", [(0, memoryview(bytearray(4)))]),
        ):
            with pytest.raises(FileNotFoundError):
                call()
        assert st.listdir("nope") == [] and st.walk_files("nope") == [] and st.listdir() == []
        st.remove("nope")
        st.remove_tree("nope")
        st.remove_tree()

    def test_write_read(self, st):
        w = st.open_write("data/a.bin")
        w.write(b"hello ")
        w.write(memoryview(bytearray(b"world")))
        w.write(b"")
        w.close()
        assert st.exists("data/a.bin") and st.is_file("data/a.bin") and not st.is_file("data")
        assert st.size("data/a.bin") == 11
        assert st.read_bytes("data/a.bin") == b"hello world"
        assert st.read_bytes("data/a.bin", limit=11) == b"hello world"
        with pytest.raises(UnsafeMetadataError, match="11 bytes exceeds the 10-byte limit"):
            st.read_bytes("data/a.bin", limit=10)
        assert st.read_range("data/a.bin", 6, 5) == b"world"
        assert st.read_range("data/a.bin", 0, 0) == b""
        assert st.read_range("data/a.bin", 9, 10) == b"ld"  # short at end of file, as a plain read
        with pytest.raises(ValueError):
            st.read_range("data/a.bin", -1, 2)

    def test_read_into(self, st):
        payload = bytes(range(256)) * 40
        st.write_atomic("f.bin", payload)
        spans = [(5000, 100), (0, 10), (10, 7), (4000, 1), (300, 0), (5100, 140), (20, 30)]  # unordered, adjacent, overlapping, empty
        bufs = [bytearray(n) for _, n in spans]
        st.read_into("f.bin", [(o, memoryview(b)) for (o, _), b in zip(spans, bufs)])
        for (o, n), b in zip(spans, bufs):
            assert bytes(b) == payload[o : o + n], (o, n)
        st.read_into("f.bin", [])
        with pytest.raises(EOFError, match=f"ends before byte {len(payload) + 6}"):
            st.read_into("f.bin", [(0, memoryview(bytearray(4))), (len(payload) - 2, memoryview(bytearray(8)))])

    def test_abort_leaves_nothing(self, st):
        w = st.open_write("data/part.bin")
        w.write(b"x" * 100)
        w.abort()
        assert not st.exists("data/part.bin")
        assert "part.bin" not in st.listdir("data")

    def test_write_atomic_replaces_and_leaves_no_temp(self, st):
        for i in range(3):
            st.write_atomic("manifest.json", str(i).encode() * (3 - i))
        assert st.read_bytes("manifest.json") == b"2"
        st.write_atomic("sub/dir/x.json", b"{}")
        assert st.walk_files() == ["manifest.json", "sub/dir/x.json"]
        assert st.listdir() == ["manifest.json", "sub"]

    def test_list_walk_remove(self, st):
        for rel in ("a/1", "a/2", "a/b/3", "c", "d/4"):
            st.write_atomic(rel, rel.encode())
        assert st.listdir() == ["a", "c", "d"]
        assert st.listdir("a") == ["1", "2", "b"]
        assert st.listdir("a/b") == ["3"]
        assert st.walk_files() == ["a/1", "a/2", "a/b/3", "c", "d/4"]
        assert st.walk_files("a") == ["a/1", "a/2", "a/b/3"]
        st.remove("a/1")
        st.remove("a/1")  # missing is fine
        st.remove_tree("a/b")
        assert st.walk_files() == ["a/2", "c", "d/4"]
        st.remove_tree("a")
        assert "a" not in st.listdir() and st.walk_files() == ["c", "d/4"]
        st.remove_tree()
        assert st.walk_files() == [] and not st.exists("c")

    def test_list_sizes(self, st, other):
        """One listing: regular files of one directory with a name prefix, sizes fresh after writes and deletes."""
        if not st.caps.consistent_listing:
            with pytest.raises(StorageError):
                st.list_sizes("data/ab-")
            return
        for rel, n in (("data/ab-r0", 3), ("data/ab-r1", 0), ("data/ab-r2/x", 1), ("data/zz-r0", 2), ("ab-top", 5)):
            st.write_atomic(rel, b"x" * n)
        assert st.list_sizes("data/ab-") == {"data/ab-r0": 3, "data/ab-r1": 0}
        assert st.list_sizes("data/") == {"data/ab-r0": 3, "data/ab-r1": 0, "data/zz-r0": 2}
        assert st.list_sizes("ab-") == {"ab-top": 5}
        assert st.list_sizes("nodir/ab-") == {} and st.list_sizes("data/none-") == {}
        # Another client's changes show at once: no cached listing answers.
        other.write_atomic("data/ab-r0", b"y" * 7)
        other.remove("data/ab-r1")
        other.write_atomic("data/ab-r3", b"")
        assert st.list_sizes("data/ab-") == {"data/ab-r0": 7, "data/ab-r3": 0}
        for bad in ESCAPES:
            with pytest.raises(UnsafeMetadataError):
                st.list_sizes(bad)

    def test_makedirs_then_write(self, st):
        st.makedirs("x/y")
        st.makedirs("x/y")  # twice is fine
        st.write_atomic("x/y/z", b"1")
        assert st.listdir("x/y") == ["z"]

    def test_relative_path_escapes_refused(self, st):
        for rel in ESCAPES:
            for call in (
                lambda r: st.exists(r),
                lambda r: st.size(r),
                lambda r: st.read_bytes(r),
                lambda r: st.read_range(r, 0, 1),
                lambda r: st.read_into(r, [(0, memoryview(bytearray(1)))]),
                lambda r: st.open_write(r),
                lambda r: st.write_atomic(r, b"x"),
                lambda r: st.remove(r),
                lambda r: st.remove_tree(r),
                lambda r: st.listdir(r),
                lambda r: st.makedirs(r),
                lambda r: st.child(r),
                lambda r: st.url_of(r),
                lambda r: st.open_staged(r),
                lambda r: st.is_file(r),
                lambda r: st.walk_files(r),
                lambda r: st.rename("a", r),
            ):
                with pytest.raises(UnsafeMetadataError, match="escapes the checkpoint root"):
                    call(rel)
        with pytest.raises(UnsafeMetadataError, match="one path component"):
            st.sibling("../x")
        assert st.walk_files() == []

    def test_staged_file(self, st):
        with st.open_staged("out.pt") as sf:
            with open(sf.path, "wb") as f:
                f.write(b"\0" * 16)
            threads = [threading.Thread(target=sf.write_at, args=(bytes([i]) * 4, 4 * i)) for i in range(4)]
            for t in threads:
                t.start()
            for t in threads:
                t.join()
            assert not st.exists("out.pt")  # nothing published before commit
            sf.commit()
        assert st.read_bytes("out.pt") == b"".join(bytes([i]) * 4 for i in range(4))
        assert st.walk_files() == ["out.pt"], "staging leftovers"
        with pytest.raises(RuntimeError):
            with st.open_staged("never.pt") as sf:
                sf.write_at(b"abc", 0)
                raise RuntimeError("boom")
        sf = st.open_staged("dropped.pt")
        sf.write_at(b"abc", 0)
        sf.abort()
        assert st.walk_files() == ["out.pt"]

    def test_invalidate_cache_sees_other_writers(self, st, other):
        assert st.listdir() == []
        other.write_atomic("step-1/manifest.json", b"{}")
        st.invalidate_cache()
        assert st.listdir() == ["step-1"] and st.exists("step-1/manifest.json")

    # -- capabilities say the truth --------------------------------------------

    def test_caps_atomic_rename(self, st):
        st.write_atomic("a", b"new")
        st.write_atomic("b", b"old")
        if st.caps.atomic_rename:
            st.rename("a", "b")
            assert st.read_bytes("b") == b"new" and not st.exists("a")
            st.rename("b", "moved/c")  # into a directory that did not exist
            assert st.read_bytes("moved/c") == b"new"
            # a whole tree swapped in place, the old one gone
            dst = st.child("out")
            dst.write_atomic("old.bin", b"o")
            tmp = dst.sibling(".out.staging")
            tmp.write_atomic("new.bin", b"n")
            dst.replace_with(tmp)
            assert dst.walk_files() == ["new.bin"] and not tmp.exists("")
            assert st.listdir() == ["moved", "out"], "the replaced tree was not deleted"
        else:
            with pytest.raises(StorageError, match="atomic_rename is False"):
                st.rename("a", "b")
            with pytest.raises(StorageError, match="atomic_rename is False"):
                st.replace_with(st.sibling(".x"))
            assert st.read_bytes("a") == b"new" and st.read_bytes("b") == b"old"

    def test_caps_positional_write(self, st):
        w = st.open_write("p.bin")
        if st.caps.positional_write:
            blocks = [(i * 1000, bytes([i]) * 1000) for i in range(8)]
            threads = [threading.Thread(target=w.write_at, args=(d, o)) for o, d in reversed(blocks)]
            for t in threads:
                t.start()
            for t in threads:
                t.join()
            w.close()
            assert st.read_bytes("p.bin") == b"".join(d for _, d in blocks)
        else:
            with pytest.raises(StorageError, match="positional_write is False"):
                w.write_at(b"x", 0)
            w.abort()

    def test_caps_has_dirs(self, st):
        """``has_dirs``: the backend itself refuses a file whose directory is missing (so we must create it)."""
        st.makedirs("")
        ok = _raw_write_nested(st)
        assert ok is (not st.caps.has_dirs)
        st.makedirs("empty")
        if st.caps.has_dirs:
            assert "empty" in st.listdir()  # a real, empty directory

    def test_caps_batched_reads(self, st, monkeypatch):
        """``batched_reads``: one read_into call reaches the backend as one batched request."""
        st.write_atomic("f", bytes(5000))
        if not st.caps.batched_reads:
            return
        calls = []
        # The backend's batched entry: S3Storage's concurrent fetch (its obstore data path), else fsspec's cat_ranges.
        owner, name = (st._data, "fill") if isinstance(st, S3Storage) else (st.fs, "cat_ranges")
        real = getattr(owner, name)

        def counting(*a, **kw):
            calls.append(1)
            return real(*a, **kw)

        # monkeypatch puts back exactly what was there (fsspec's async
        # backends keep their sync wrappers on the instance, which is shared).
        monkeypatch.setattr(owner, name, counting)
        st.read_into("f", [(o, memoryview(bytearray(10))) for o in range(0, 5000, 1000)])
        assert len(calls) == 1


def _raw_write_nested(st) -> bool:
    """Write ``n1/n2/f`` below the root with the backend's own call, no directories made first; did it work?"""
    try:
        if isinstance(st, LocalStorage):
            with open(st.path("n1/n2/f"), "wb") as f:
                f.write(b"x")
        else:
            with st.fs.open(st.path("n1/n2/f"), "wb") as f:
                f.write(b"x")
        return True
    except (FileNotFoundError, NotADirectoryError):
        return False
    finally:
        st.remove_tree("n1")


# -- the backends -----------------------------------------------------------------


class TestLocalPath(StorageContract):
    expect_type = LocalStorage

    @pytest.fixture
    def st(self, tmp_path):
        return Storage(str(tmp_path / "root"))

    @pytest.fixture
    def other(self, st):
        return Storage(st.url)


class TestFileUrlWithOptions(StorageContract):
    expect_type = LocalStorage

    @pytest.fixture
    def st(self, tmp_path):
        return Storage("file://" + str(tmp_path / "root"), storage_options={"auto_mkdir": True})

    @pytest.fixture
    def other(self, st):
        return Storage(st.url, storage_options=st.storage_options)


class TestFsspecLocalDirs(StorageContract):
    """fsspec's local filesystem through ``local://``: an fsspec backend with real directories."""

    expect_type = FsspecStorage

    @pytest.fixture
    def st(self, tmp_path):
        st = Storage("local://" + str(tmp_path / "root"))
        assert st.caps.has_dirs
        return st

    @pytest.fixture
    def other(self, st):
        return Storage(st.url)


class TestMemory(StorageContract):
    expect_type = FsspecStorage

    @pytest.fixture
    def st(self):
        st = Storage(f"memory://shardckpt-conformance/{uuid.uuid4().hex}")
        yield st
        st.remove_tree()

    @pytest.fixture
    def other(self, st):
        return Storage(st.url)


@pytest.mark.s3
class TestS3(StorageContract):
    expect_type = S3Storage

    @pytest.fixture
    def st(self, s3_endpoint):
        prefix, options = s3_endpoint
        st = Storage(f"{prefix}/conformance-{uuid.uuid4().hex[:12]}", storage_options=options)
        yield st
        st.remove_tree()

    @pytest.fixture
    def other(self, st):
        # A second client: its own filesystem instance and listing cache.
        return FsspecStorage(st.url, storage_options=dict(st.storage_options, skip_instance_cache=True))


@pytest.mark.s3
class TestSeaweedFS(StorageContract):
    """The same contract on a real S3 server (SeaweedFS on loopback)."""

    expect_type = S3Storage

    @pytest.fixture
    def st(self, seaweed_endpoint):
        prefix, options = seaweed_endpoint
        st = Storage(f"{prefix}/conformance-{uuid.uuid4().hex[:12]}", storage_options=options)
        yield st
        st.remove_tree()

    @pytest.fixture
    def other(self, st):
        return S3Storage(st.url, storage_options=st.storage_options)

    def test_list_walk_remove(self, st):
        """As the contract, except that SeaweedFS drops an emptied "directory" from listings a moment later."""
        import time

        for rel in ("a/1", "a/b/3", "c"):
            st.write_atomic(rel, rel.encode())
        assert st.listdir() == ["a", "c"] and st.walk_files("a") == ["a/1", "a/b/3"]
        st.remove_tree("a")
        assert st.walk_files() == ["c"] and not st.exists("a/1")
        deadline = time.monotonic() + 20
        while "a" in st.listdir() and time.monotonic() < deadline:
            time.sleep(0.2)
        assert st.listdir() == ["c"]
