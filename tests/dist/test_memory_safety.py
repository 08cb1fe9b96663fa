"""The memory tier is scoped to its root and safe on a shared host (issue 28, "Scoped and safe").

Each case is an attack or a launch found to go wrong, played by real gloo
ranks (2 processes, one "node") through the public manager: two runs on one
host (no job id; one job id) with different roots; a relaunch under a new
``TORCHELASTIC_RUN_ID``; a directory of another user, a world-writable one,
a symlink; planted ``step-*`` links; a copy of another root; modes of what
the tier writes; the one-node warning.

Default directories live in ``/dev/shm`` (the tier's real place): each
test's root is a fresh ``tmp_path``, so its directory is its own, and every
test removes what it made.
"""

import logging
import os
import shutil
import stat

import pytest
import torch

import shardckpt
from _dist import run_ranks
from shardckpt._memory import default_dir

WORLD = 2
OTHER_UID = 65534  # nobody


class _Logs(logging.Handler):
    def __init__(self):
        super().__init__(logging.INFO)
        self.lines = []

    def emit(self, record):
        self.lines.append((record.levelname, record.getMessage()))


def _state(rank, value, step=0):
    return {"w": torch.full((256,), float(value)), f"r{rank}": torch.full((64,), float(value + rank)), "step": step}


def _run(rank, world, root, tier, env, script):
    """One launch on one rank: ``script`` is a list of (op, arg) run through a manager; returns what each op gave, and the log."""
    old = {k: os.environ.get(k) for k in env}
    os.environ.update({k: v for k, v in env.items() if v is not None})
    for k, v in env.items():
        if v is None:
            os.environ.pop(k, None)
    logs = _Logs()
    logging.getLogger("shardckpt").addHandler(logs)
    out = []
    try:
        if tier is None:
            memory = True
        elif "{node}" in tier:  # several simulated nodes on this host: 2 ranks each, a directory each
            memory = shardckpt.MemoryTier(dir=tier.format(node=rank // 2), ranks_per_node=2)
        else:
            memory = shardckpt.MemoryTier(dir=tier)
        mgr = shardckpt.CheckpointManager(root, memory=memory)
        for op, arg in script:
            if op == "mem":
                out.append(mgr.save_to_memory(arg, _state(rank, arg, arg)))
            elif op == "save":
                mgr.save(arg, _state(rank, arg, arg))
                out.append(arg)
            elif op == "restore":
                st = _state(rank, -1)
                got = mgr.restore(st)
                out.append((got, mgr.restored_from, float(st["w"][0]), st["step"]))
            elif op == "close":
                mgr.close()
                out.append(None)
            elif op == "dir":
                out.append(mgr._memory.dir)
        if not mgr._closed:  # a run that dies: it dies once its last memory step is held (no background left)
            mgr._memory.snapshots.wait(raise_error=False)
    finally:
        logging.getLogger("shardckpt").removeHandler(logs)
        for k, v in old.items():
            if v is None:
                os.environ.pop(k, None)
            else:
                os.environ[k] = v
    return {"out": out, "logs": logs.lines}


def _launch(root, script, *, tier=None, env=None, world=WORLD):
    return run_ranks(world, _run, str(root), None if tier is None else str(tier), dict(env or {}), script)


def _listing(d):
    """A tier directory's entries but the slot files (the mapped memory of the processes that saved there)."""
    return sorted(n for n in os.listdir(d) if not n.startswith(".slot-"))


def _said(res, text, level=None):
    return [m for r in res for lv, m in r["logs"] if text in m and (level is None or lv == level)]


@pytest.fixture
def shm_dirs():
    """Default directories made by the test (removed at the end: /dev/shm outlives the test)."""
    made = []
    yield made
    for d in made:
        shutil.rmtree(d, ignore_errors=True)


NO_JOB = {"TORCHELASTIC_RUN_ID": None, "SLURM_JOB_ID": None}


@pytest.mark.parametrize("env", [NO_JOB, {"TORCHELASTIC_RUN_ID": "job-7", "SLURM_JOB_ID": None}], ids=["no-job-id", "same-job-id"])
def test_two_runs_on_one_host_never_see_each_others_steps(tmp_path, shm_dirs, env):
    a, b = tmp_path / "a", tmp_path / "b"
    shm_dirs += [default_dir(str(a)), default_dir(str(b))]
    ra = _launch(a, [("dir", None), ("mem", 100)], env=env)  # run A: step 100 in memory, then it dies
    assert ra[0]["out"] == [default_dir(str(a)), True]
    # Run B, another root, same host and user (same job id or none): starts fresh, never from A's memory.
    rb = _launch(b, [("dir", None), ("restore", None), ("mem", 3), ("close", None)], env=env)
    for r in rb:
        d, restored = r["out"][0], r["out"][1]
        assert d == default_dir(str(b)) != default_dir(str(a))
        assert restored == (None, None, -1.0, 0)
    # B's saves and its close() left A's copy alone: A's relaunch still restores it.
    ra2 = _launch(a, [("restore", None), ("close", None)], env=env)
    assert [r["out"][0] for r in ra2] == [(100, "memory:100", 100.0, 100)] * WORLD
    assert not os.path.exists(default_dir(str(a))) and not os.path.exists(default_dir(str(b)))


def test_relaunch_with_a_new_torchelastic_run_id_restores_from_memory(tmp_path, shm_dirs):
    root = tmp_path / "root"
    shm_dirs.append(default_dir(str(root)))
    # torchrun --standalone: every launch draws a new TORCHELASTIC_RUN_ID.
    _launch(root, [("save", 2), ("mem", 2), ("mem", 3)], env={"TORCHELASTIC_RUN_ID": "8a1f"})
    out = _launch(root, [("restore", None)], env={"TORCHELASTIC_RUN_ID": "c0d4"})
    assert [r["out"][0] for r in out] == [(3, "memory:3", 3.0, 3)] * WORLD


def _planted_step(tmp_path, root_of_copy):
    """A real memory copy of ``root_of_copy`` (step 9), made by a run of it in its own directory; returns that directory."""
    src = tmp_path / "planted-src"
    _launch(root_of_copy, [("mem", 9)], tier=src)
    return src


@pytest.mark.parametrize("how", ["other-uid", "mode-0777", "symlink"])
def test_unsafe_directory_is_refused_tier_off_storage_used(tmp_path, how):
    if how == "other-uid" and os.geteuid() != 0:
        pytest.skip("needs root to create a directory of another user")
    root = tmp_path / "root"
    tier = tmp_path / "tier"
    # Another user prepared the directory with a step of their choice (a valid copy of *this* root, step 9).
    src = _planted_step(tmp_path, root)
    if how == "symlink":
        os.symlink(src, tier)
    else:
        shutil.copytree(src, tier)
        if how == "other-uid":
            for d, dirs, files in os.walk(tier):
                for n in dirs + files:
                    os.chown(os.path.join(d, n), OTHER_UID, OTHER_UID)
            os.chown(tier, OTHER_UID, OTHER_UID)
        else:
            os.chmod(tier, 0o777)
    out = _launch(root, [("save", 1), ("restore", None), ("mem", 2), ("save", 3), ("restore", None), ("close", None)], tier=tier)
    for r in out:
        _, first, mem, _, second, _ = r["out"]
        assert first == (1, str(root / "step-00000001"), 1.0, 1)  # storage, not the planted step 9
        assert mem is False  # tier off
        assert second == (3, str(root / "step-00000003"), 3.0, 3)  # storage saves go on
    refused = _said(out, "refusing", "ERROR")
    assert refused and str(tier) in refused[0]
    assert _said(out, "memory tier off, storage only", "WARNING")
    # Nothing of ours went there, and nothing there was removed (close() included).
    assert _listing(src) == ["identity.json", "step-00000009"]
    if how != "symlink":
        assert _listing(tier) == ["identity.json", "step-00000009"]


def test_files_are_0600_and_directories_0700(tmp_path):
    # 4 ranks as 2 nodes: each node's directory holds its own ranks' files and the peer copies it received.
    root = tmp_path / "root"
    out = _launch(root, [("mem", 1), ("mem", 2)], tier=tmp_path / "shm" / "node{node}", world=4)
    assert [r["out"] for r in out] == [[True, True]] * 4
    seen = 0
    assert stat.S_IMODE(os.lstat(tmp_path / "shm").st_mode) == 0o700  # the parent we created too
    for d, dirs, files in os.walk(tmp_path / "shm"):
        for n in dirs:
            assert stat.S_IMODE(os.lstat(os.path.join(d, n)).st_mode) == 0o700, os.path.join(d, n)
        for n in files:
            assert stat.S_IMODE(os.lstat(os.path.join(d, n)).st_mode) == 0o600, os.path.join(d, n)
            seen += 1
    # Per node: identity, manifest, 4 index files, 4 data files (2 own ranks' + 2 received).
    assert seen >= 2 * (2 + 4 + 4)


def test_planted_step_symlinks_are_never_followed(tmp_path):
    root, tier = tmp_path / "root", tmp_path / "tier"
    _launch(root, [("mem", 1)], tier=tier)
    # A dead run's leftovers: links at a step's name, to directories outside holding "temporary" files and a checkpoint.
    outside = tmp_path / "outside"
    shutil.copytree(tier / "step-00000001", outside / "ckpt")
    (outside / "ckpt" / ".victim.tmp").write_bytes(b"keep me")
    (outside / "empty").mkdir()
    before = sorted(str(p.relative_to(outside)) for p in outside.rglob("*"))
    os.symlink(outside / "ckpt", tier / "step-00000007")  # newer than anything held: would be restored, cleaned
    os.symlink(outside / "empty", tier / "step-00000002")  # the next step's name: would be written through
    out = _launch(root, [("restore", None), ("mem", 2), ("mem", 3), ("close", None)], tier=tier)
    for r in out:
        assert r["out"][0] == (1, "memory:1", 1.0, 1)  # the real step 1, not the link's 7
        assert r["out"][1:3] == [True, True]
    assert sorted(str(p.relative_to(outside)) for p in outside.rglob("*")) == before  # outside intact
    assert (outside / "ckpt" / ".victim.tmp").read_bytes() == b"keep me"
    assert not os.path.lexists(tier)  # the links were unlinked (not followed), then the tier closed


def test_memory_copy_of_another_root_is_ignored_with_a_warning(tmp_path):
    a, b, tier = tmp_path / "a", tmp_path / "b", tmp_path / "tier"
    _launch(a, [("mem", 100)], tier=tier)  # root a's copy in this directory
    out = _launch(b, [("save", 1), ("restore", None), ("mem", 2), ("close", None)], tier=tier)
    for r in out:
        assert r["out"][1] == (1, str(b / "step-00000001"), 1.0, 1)
        assert r["out"][2] is False
    assert _said(out, f"holds the memory copy of root '{a}'", "WARNING")
    assert _listing(tier) == ["identity.json", "step-00000100"]  # b's saves and close() left it alone
    # A step of root a copied into root b's own directory (its manifest names a): ignored too, logged.
    tier_b = tmp_path / "tier-b"
    _launch(b, [("mem", 1)], tier=tier_b)
    shutil.copytree(tier / "step-00000100", tier_b / "step-00000100")
    out = _launch(b, [("restore", None)], tier=tier_b)
    assert [r["out"][0] for r in out] == [(1, "memory:1", 1.0, 1)] * WORLD
    assert _said(out, f"is the memory copy of root '{a}'", "WARNING")


def test_one_node_warns_once_that_there_is_no_second_copy(tmp_path):
    out = _launch(tmp_path / "root", [("mem", 1), ("mem", 2), ("mem", 3)], tier=tmp_path / "tier")
    assert [r["out"] for r in out] == [[True, True, True]] * WORLD  # still a fast local copy
    said = _said(out, "no second copy", "WARNING")
    assert len(said) == 1 and "rank(s) 0, 1" in said[0]
    # Simulated nodes: the hint shows how (issue 47 item 11), a directory per node computed from the rank.
    assert "MemoryTier(dir=f'/dev/shm/run1-node{rank // 2}', ranks_per_node=2)" in said[0], said[0]
