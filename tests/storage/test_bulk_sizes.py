"""The commit's size check in bulk: one listing per directory, not one stat (HEAD) per file.

``check_files`` (run by ``commit``, ``load``, ``verify``, ``restore``) asks
``Storage.list_sizes`` where ``caps.consistent_listing`` holds and stats only
what the listing does not confirm. These tests count the storage calls (and,
on S3, the HTTP requests by kind) for many files, and check that every kind
of damage is still named, file by file.
"""

from __future__ import annotations

import collections
import dataclasses
import os
import uuid
from concurrent.futures import ThreadPoolExecutor

import pytest

from shardckpt._format import FORMAT_VERSION, FileMeta, IndexMeta, Manifest, commit, save_id_prefix
from shardckpt._format.files import LIST_MIN_FILES, RECHECK_REMOTE, check_files, listing_prefixes
from shardckpt._storage import S3Storage, Storage
from shardckpt._storage._obstore import ObstoreData
from shardckpt.errors import CorruptCheckpointError

SAVE_ID = uuid.UUID(int=0x0123456789ABCDEF0123456789ABCDEF).hex


def _rank_files(ranks: int, files_per_rank: int = 1):
    """``{rel: size}`` as a save of ``ranks`` ranks names them: data files and one index file per rank."""
    pre = save_id_prefix(SAVE_ID)
    out = {}
    for r in range(ranks):
        for i in range(files_per_rank):
            out[f"data/{pre}r{r:05d}-{i:02d}.safetensors"] = 16 + r % 7 + i
        out[f"data/{pre}index-r{r:05d}.json"] = 3 + r % 5
    return out


def _write_all(st, files):
    with ThreadPoolExecutor(16) as ex:
        list(ex.map(lambda kv: st.write_atomic(kv[0], b"x" * kv[1]), files.items()))


class _Count:
    """Counts the storage calls ``check_files`` makes: listings and single-file stats."""

    def __init__(self, st, monkeypatch):
        self.calls = collections.Counter()
        for name in ("list_sizes", "stat_sizes"):
            real = getattr(st, name)

            def counting(*a, _real=real, _name=name, **kw):
                self.calls[_name] += 1
                return _real(*a, **kw)

            monkeypatch.setattr(st, name, counting)


def test_listing_prefixes_split_into_one_page_each():
    files = _rank_files(16384)
    plan = listing_prefixes(files, per_listing=1000)
    assert len(plan) == 34 and max(len(v) for v in plan.values()) == 1000
    assert sorted(p for v in plan.values() for p in v) == sorted(files)  # every file once
    assert all(p.startswith(prefix) for prefix, v in plan.items() for p in v)
    # A name that is itself a prefix of the others cannot be split off.
    assert listing_prefixes(["d/a", "d/ab", "d/ac"], per_listing=1) == {"d/a": ["d/a", "d/ab", "d/ac"]}


def test_listing_prefixes_pure():
    files = _rank_files(3)
    groups = listing_prefixes(files)
    assert list(groups) == [f"data/{save_id_prefix(SAVE_ID)}"] and sorted(groups[f"data/{save_id_prefix(SAVE_ID)}"]) == sorted(files)
    assert listing_prefixes(["a/x1", "a/x2", "b/y", "z"]) == {"a/x": ["a/x1", "a/x2"], "b/y": ["b/y"], "z": ["z"]}
    assert listing_prefixes([]) == {}


@pytest.fixture(params=["local", "memory"])
def st(request, tmp_path):
    if request.param == "local":
        yield Storage(str(tmp_path / "ck"))
    else:
        s = Storage(f"memory://shardckpt-bulk/{uuid.uuid4().hex}")
        yield s
        s.remove_tree()


def test_one_listing_for_many_files(st, monkeypatch):
    files = _rank_files(200, 2)
    _write_all(st, files)
    st.write_atomic(f"data/{save_id_prefix('f' * 32)}r00000-00.safetensors", b"other save: not listed, not asked")
    count = _Count(st, monkeypatch)
    check_files(st, files)
    assert count.calls == {"list_sizes": 1}, count.calls


def test_damage_named_file_by_file(st, monkeypatch):
    files = _rank_files(50)
    _write_all(st, files)
    rels = sorted(files)
    st.remove(rels[0])
    st.write_atomic(rels[1], b"x" * (files[rels[1]] - 1))
    st.write_atomic(rels[2], b"x" * (files[rels[2]] + 2))
    count = _Count(st, monkeypatch)
    with pytest.raises(CorruptCheckpointError) as e:
        check_files(st, files)
    msg = str(e.value)
    assert f"{rels[0]} is missing" in msg and f"{rels[1]} truncated" in msg and f"{rels[2]} has extra bytes" in msg
    # One listing, then one stat for each file it did not confirm.
    assert count.calls == {"list_sizes": 1, "stat_sizes": 3}, count.calls


def test_many_missing_capped_message(st):
    files = _rank_files(100)
    _write_all(st, dict(list(files.items())[:10]))
    with pytest.raises(CorruptCheckpointError) as e:
        check_files(st, files)
    assert "is missing" in str(e.value) and "(170 more)" in str(e.value)


def test_local_symlink_and_dir_get_their_own_stat(tmp_path):
    st = Storage(str(tmp_path / "ck"))
    files = _rank_files(10)
    _write_all(st, files)
    rels = sorted(files)
    outside = tmp_path / "outside"
    outside.write_bytes(b"x" * files[rels[0]])
    os.unlink(st.path(rels[0]))
    os.symlink(outside, st.path(rels[0]))
    os.unlink(st.path(rels[1]))
    os.mkdir(st.path(rels[1]))
    with pytest.raises(CorruptCheckpointError) as e:
        check_files(st, files)
    msg = str(e.value)
    # As a stat of each says: the link is refused, the directory has the wrong size.
    assert f"{rels[0]} cannot be read" in msg and "must lie inside its directory" in msg and f"{rels[1]} has extra bytes" in msg


def test_data_dir_symlinked_out_falls_back_to_stats(tmp_path):
    st = Storage(str(tmp_path / "ck"))
    files = _rank_files(8)
    elsewhere = Storage(str(tmp_path / "elsewhere"))
    _write_all(elsewhere, files)
    os.makedirs(st.root)
    os.symlink(elsewhere.path("data"), st.path("data"))
    with pytest.raises(CorruptCheckpointError, match="must lie inside its directory"):
        check_files(st, files)


@pytest.mark.parametrize("remote", [False, True])
def test_no_consistent_listing_stats_each_file(st, monkeypatch, remote):
    # More files than RECHECK_REMOTE: without a listing every one is asked
    # about, never taken as missing (that cap is for files a listing contradicts).
    files = _rank_files(RECHECK_REMOTE)
    _write_all(st, files)
    monkeypatch.setattr(st, "caps", dataclasses.replace(st.caps, consistent_listing=False, high_latency=remote))
    count = _Count(st, monkeypatch)
    check_files(st, files)
    assert count.calls == {"stat_sizes": len(files)}


@pytest.mark.parametrize("remote", [False, True])
def test_listing_refused_falls_back(st, monkeypatch, remote):
    from shardckpt.errors import StorageError

    files = _rank_files(RECHECK_REMOTE)
    _write_all(st, files)
    monkeypatch.setattr(st, "caps", dataclasses.replace(st.caps, high_latency=remote))

    def refused(prefix):
        raise StorageError("list: access refused (AccessDenied)")

    monkeypatch.setattr(st, "list_sizes", refused)
    count = _Count(st, monkeypatch)
    check_files(st, files)
    assert count.calls["stat_sizes"] == len(files)


def test_few_files_no_listing(st, monkeypatch):
    files = dict(list(_rank_files(1).items()))
    assert len(files) < LIST_MIN_FILES
    _write_all(st, files)
    count = _Count(st, monkeypatch)
    check_files(st, files)
    assert "list_sizes" not in count.calls


# -- S3: requests on the wire ---------------------------------------------------------


def _count_requests(st, monkeypatch):
    """Count S3 requests by kind: s3fs's client (listings) and obstore's calls (the data path)."""
    seen = collections.Counter()
    real_request, real_ob = S3Storage._request, ObstoreData.call

    async def request(self, what, method, **kw):
        seen[method] += 1
        return await real_request(self, what, method, **kw)

    def ob_call(self, what, fn, *a, **kw):
        seen[{"head": "head_object", "put": "put_object", "delete": "delete_object"}.get(fn, fn)] += 1
        return real_ob(self, what, fn, *a, **kw)

    monkeypatch.setattr(S3Storage, "_request", request)
    monkeypatch.setattr(ObstoreData, "call", ob_call)
    return seen


def _manifest(files):
    idx = {rel: IndexMeta(rank=int(rel[-10:-5]), size=n, crc32c=0) for rel, n in files.items() if "-index-" in rel}
    return Manifest(
        world_size=len(idx), tensors={}, files={rel: FileMeta(n) for rel, n in files.items()}, save_id=SAVE_ID,
        version=FORMAT_VERSION, block_bytes=1 << 20, meshes=["iota"], indexes=idx,
    )


@pytest.mark.s3
def test_s3_commit_lists_instead_of_heads(s3_endpoint, monkeypatch):
    """The commit of 550 ranks (1,100 objects: two listing pages) lists, never HEADs each object.

    Two LIST pages before the manifest is written and two after it lands
    (durable means loadable: a file deleted in between takes the commit
    back), and at most one HEAD: whether a previous manifest is there.
    """
    prefix, options = s3_endpoint
    st = Storage(f"{prefix}/bulk-{uuid.uuid4().hex[:12]}", storage_options=options)
    try:
        files = _rank_files(550)
        _write_all(st, files)
        seen = _count_requests(st, monkeypatch)
        commit(st, _manifest(files))
        assert seen["list_objects_v2"] == 4 and seen["head_object"] <= 1, seen
        assert seen["put_object"] == 1, seen  # manifest.json
        # Damage is named; only the unconfirmed objects get a HEAD.
        rels = sorted(files)
        st.remove(rels[5])
        st.write_atomic(rels[6], b"x")
        seen.clear()
        with pytest.raises(CorruptCheckpointError) as e:
            check_files(st, files)
        assert f"{rels[5]} is missing" in str(e.value) and f"{rels[6]} truncated" in str(e.value)
        assert seen["list_objects_v2"] == 2 and seen["head_object"] == 2, seen
        # An emptied prefix: the listing's answer stands beyond RECHECK_REMOTE objects.
        st.remove_tree("data")
        seen.clear()
        with pytest.raises(CorruptCheckpointError, match=r"is missing.*more\)"):
            check_files(st, files)
        assert seen["list_objects_v2"] == 2 and seen["head_object"] <= RECHECK_REMOTE, seen
    finally:
        st.remove_tree()
