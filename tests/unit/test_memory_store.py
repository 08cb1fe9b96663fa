"""The memory tier's directory rules (``_memory/store.py``), one process: naming, claiming, refusing, removing without following links."""

import json
import logging
import os
import stat

import pytest

from shardckpt._memory import MemoryTier, default_dir, normalize_root, store


def test_default_directory_is_per_user_and_root_never_per_launch(monkeypatch, tmp_path):
    monkeypatch.chdir(tmp_path)
    monkeypatch.setenv("TORCHELASTIC_RUN_ID", "first")
    d = MemoryTier().resolved_dir("runs/a")
    assert d == default_dir(str(tmp_path / "runs" / "a")) == default_dir(f"file://{tmp_path}/runs/a/")
    assert os.path.basename(d).startswith(f"shardckpt-{os.geteuid()}-") and os.path.dirname(d) == "/dev/shm"
    monkeypatch.setenv("TORCHELASTIC_RUN_ID", "second")  # torchrun --standalone relaunch
    monkeypatch.setenv("SLURM_JOB_ID", "77")
    assert MemoryTier().resolved_dir("runs/a") == d
    assert MemoryTier().resolved_dir("runs/b") != d and MemoryTier(dir="/x").resolved_dir("runs/a") == "/x"
    assert normalize_root("S3://bucket/run//") == "s3://bucket/run" != normalize_root("s3://bucket/run2")


def test_open_dir_creates_private_claims_once_and_refuses_other_roots(tmp_path, caplog):
    d = str(tmp_path / "p" / "q" / "tier")
    assert store.open_dir(d, "s3://b/a") is None
    for p in (tmp_path / "p", tmp_path / "p" / "q", d):
        assert stat.S_IMODE(os.stat(p).st_mode) == 0o700
    ident = os.path.join(d, store.IDENTITY_NAME)
    assert stat.S_IMODE(os.stat(ident).st_mode) == 0o600 and json.load(open(ident))["root"] == "s3://b/a"
    assert store.open_dir(d, "s3://b/a/") is None  # same root, other spelling
    with caplog.at_level(logging.WARNING, logger="shardckpt"):
        why = store.open_dir(d, "s3://b/other")
    assert "holds the memory copy of root 's3://b/a'" in why and why in caplog.text
    assert json.load(open(ident))["root"] == "s3://b/a"  # never replaced
    assert store.check_dir(d, "s3://b/other") is not None and store.check_dir(str(tmp_path / "none"), "s3://b/a") is not None
    assert not (tmp_path / "none").exists()  # check_dir creates nothing


def test_directory_with_steps_but_no_identity_is_left_alone(tmp_path):
    d = tmp_path / "tier"
    (d / "step-00000005").mkdir(parents=True, mode=0o700)
    os.chmod(d, 0o700)
    assert "no identity.json" in store.open_dir(str(d), "s3://b/a")
    assert store.close_dir(str(d), root="s3://b/a") == [] and (d / "step-00000005").is_dir()


def test_unsafe_parent_or_directory_is_refused(tmp_path, caplog):
    shared = tmp_path / "shared"
    shared.mkdir()
    os.chmod(shared, 0o777)  # writable by all, not sticky: anyone can rename our directory away
    with caplog.at_level(logging.ERROR, logger="shardckpt"):
        why = store.open_dir(str(shared / "tier"), "s3://b/a")
    assert "writable by other users" in why and "not sticky" in why and "refusing" in caplog.text
    os.chmod(shared, 0o1777)  # sticky, like /tmp and /dev/shm: fine
    assert store.open_dir(str(shared / "tier"), "s3://b/a") is None
    os.chmod(shared / "tier", 0o770)
    assert "writable by other users (mode 0770)" in store.open_dir(str(shared / "tier"), "s3://b/a")
    os.chmod(shared / "tier", 0o755)  # ours, only readable: closed to 0700
    assert store.open_dir(str(shared / "tier"), "s3://b/a") is None
    assert stat.S_IMODE(os.stat(shared / "tier").st_mode) == 0o700


def test_removal_and_staging_never_follow_links(tmp_path):
    d = str(tmp_path / "tier")
    assert store.open_dir(d, "s3://b/a") is None
    outside = tmp_path / "outside"
    (outside / "sub").mkdir(parents=True)
    (outside / "sub" / ".x.part").write_bytes(b"1")
    (outside / "f").write_bytes(b"2")
    os.symlink(outside, os.path.join(d, "step-00000004"))
    real = store.step_dir(d, 3)
    os.makedirs(os.path.join(real, "data"))
    os.symlink(outside / "sub", os.path.join(real, "data", "link"))
    open(os.path.join(real, "data", ".y.tmp"), "wb").close()
    assert store.clean_stale(d, root="s3://b/a") == [os.path.join(real, "data", ".y.tmp")]
    assert store.remove_steps_except(d, 9, root="s3://b/a") == [3, 4]
    assert sorted(os.listdir(d)) == [store.IDENTITY_NAME]
    assert (outside / "sub" / ".x.part").read_bytes() == b"1" and (outside / "f").read_bytes() == b"2"
    os.symlink(outside, os.path.join(d, ".restore-r0-1"))
    with pytest.raises(OSError, match="not a directory of this user"):
        store.make_private_dir(os.path.join(d, ".restore-r0-1"))
    assert stat.S_IMODE(os.stat(store.make_private_dir(os.path.join(d, "s"))).st_mode) == 0o700


def test_close_dir_removes_only_its_own_root(tmp_path):
    d = str(tmp_path / "tier")
    assert store.open_dir(d, "s3://b/a") is None
    os.makedirs(store.step_dir(d, 1))
    assert store.close_dir(d, root="s3://b/other") == [] and os.path.isdir(store.step_dir(d, 1))
    assert store.remove_steps_except(d, 0, root="s3://b/other") == [] and store.clean_stale(d, root="s3://b/other") == []
    open(os.path.join(d, ".slot-r00001-p1-own0-0"), "wb").close()  # a live node-mate's file: the directory stays
    store.close_dir(d, root="s3://b/a")
    assert sorted(os.listdir(d)) == [".slot-r00001-p1-own0-0", store.IDENTITY_NAME]
    os.remove(os.path.join(d, ".slot-r00001-p1-own0-0"))
    assert store.open_dir(d, "s3://b/a") is None
    assert store.close_dir(d, root="s3://b/a") == [d] and not os.path.exists(d)


def test_staging_dir_is_private_and_always_given(tmp_path):
    d = str(tmp_path / "new-node")  # a replacement node: no directory yet
    s = store.staging_dir(d, "s3://b/a", 3)
    assert s == os.path.join(d, f".restore-r3-{os.getpid()}") and stat.S_IMODE(os.stat(s).st_mode) == 0o700
    os.rmdir(s)
    (tmp_path / "victim").mkdir()
    os.symlink(tmp_path / "victim", s)  # a link at the name: unlinked (not followed), a real directory made
    assert store.staging_dir(d, "s3://b/a", 3) == s and not os.path.islink(s)
    assert stat.S_IMODE(os.lstat(s).st_mode) == 0o700 and (tmp_path / "victim").is_dir()
    os.rmdir(s)
    os.chmod(d, 0o777)  # refused directory: the staging goes elsewhere
    u = store.staging_dir(d, "s3://b/a", 3)
    assert not u.startswith(d) and stat.S_IMODE(os.stat(u).st_mode) == 0o700
    os.rmdir(u)
