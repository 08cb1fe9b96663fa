"""CheckpointManager and async_save in one process: commits, retention, restore, leftovers, async errors."""

from __future__ import annotations

import copy
import logging
import os
import time
import uuid

import pytest
import torch

import shardckpt
from shardckpt import _async
from shardckpt import _save as _api
from shardckpt._managed import retention
from shardckpt._manager import parse_step_dir, stale_leftovers, step_dir_name, steps_to_delete
from shardckpt._storage import Storage
from shardckpt.errors import (
    CheckpointError,
    CheckpointExistsError,
    CheckpointNotFoundError,
    CorruptCheckpointError,
    SaveFailedError,
)


def _state(step: int):
    """Values that differ per step, with awkward parts: a strided view, bf16, ints, a module."""
    g = torch.Generator().manual_seed(step)
    lin = torch.nn.Linear(5, 3)
    with torch.no_grad():
        lin.weight.copy_(torch.randn(3, 5, generator=g))
        lin.bias.fill_(step)
    base = torch.randn(6, 4, generator=g)
    return {
        "model": lin,
        "t": base.t(),  # non-contiguous
        "half": torch.randn(9, generator=g).to(torch.bfloat16),
        "ids": torch.arange(5) * step,
        "step": step,
        "meta": {"lr": 0.5 / (step + 1), "tags": ["a", str(step)]},
    }


def _blank():
    s = _state(0)
    with torch.no_grad():
        for v in (s["model"].weight, s["model"].bias, s["t"], s["half"], s["ids"]):
            v.zero_()
    s["step"] = -1
    s["meta"] = {"lr": 0.0, "tags": []}
    return s


def _snapshot(s):
    out = {k: v.detach().clone() for k, v in s["model"].state_dict().items()}
    out.update(t=s["t"].clone(), half=s["half"].clone(), ids=s["ids"].clone(), step=s["step"], meta=copy.deepcopy(s["meta"]))
    return out


def _assert_state(s, snap):
    for k, v in s["model"].state_dict().items():
        assert torch.equal(v, snap[k]), k
    for k in ("t", "half", "ids"):
        assert s[k].dtype == snap[k].dtype and torch.equal(s[k], snap[k]), k
    assert s["step"] == snap["step"] and s["meta"] == snap["meta"]


def _mutate(s):
    with torch.no_grad():
        s["model"].weight.add_(100)
        s["model"].bias.mul_(-3)
        s["t"].add_(7)
        s["half"].fill_(1.5)
        s["ids"].add_(1000)
    s["step"] = 10**6
    s["meta"]["tags"].append("changed")


@pytest.fixture(params=["local", "memory"])
def root(request, tmp_path):
    if request.param == "local":
        yield str(tmp_path / "run")
    else:
        url = f"memory://mgr-{uuid.uuid4().hex}"
        yield url
        Storage(url).remove_tree("")


@pytest.fixture(autouse=True)
def _no_pending():
    yield
    _async.wait_pending(raise_unobserved=False)


def test_step_names_sort_and_parse():
    assert step_dir_name(1000) == "step-00001000"
    assert step_dir_name(123456789) == "step-123456789"
    names = [step_dir_name(s) for s in (3, 20, 100, 7)]
    assert sorted(names) == [step_dir_name(s) for s in (3, 7, 20, 100)]
    assert parse_step_dir("step-00000042") == 42 and parse_step_dir("step-00000042/") == 42
    assert parse_step_dir("step-x") is None and parse_step_dir("xstep-1") is None and parse_step_dir("step-1.tmp") is None


def test_retention_rule():
    assert steps_to_delete([1, 2, 3], keep_last=None, keep_every=None) == []
    assert steps_to_delete([1, 2, 3, 4], keep_last=2, keep_every=None) == [1, 2]
    assert steps_to_delete(range(1, 11), keep_last=2, keep_every=4) == [1, 2, 3, 5, 6, 7]
    # The step just saved is kept even if older steps exist above it.
    assert steps_to_delete([5, 10, 20], keep_last=1, keep_every=None, protect=[5]) == [10]
    assert steps_to_delete([7], keep_last=1, keep_every=None) == []


def test_retention_over_many_saves(root):
    mgr = shardckpt.CheckpointManager(root, keep_last=3, keep_every=4)
    snaps = {}
    for step in range(1, 13):
        s = _state(step)
        snaps[step] = _snapshot(s)
        mgr.save(step, s)
        expect = sorted({x for x in range(1, step + 1) if x % 4 == 0} | set(range(max(1, step - 2), step + 1)))
        assert mgr.steps() == expect, step
    assert mgr.latest_step() == 12
    # Only committed step directories are left on storage.
    assert sorted(Storage(root).listdir("")) == [step_dir_name(s) for s in (4, 8, 10, 11, 12)]
    s = _blank()
    assert shardckpt.CheckpointManager(root).restore(s) == 12
    _assert_state(s, snaps[12])
    s = _blank()
    assert mgr.restore(s, step=4) == 4
    _assert_state(s, snaps[4])
    with pytest.raises(CheckpointNotFoundError, match="step-00000005"):
        mgr.restore(_blank(), step=5)
    # Each checkpoint is an ordinary one: the step rides along in the manifest.
    assert shardckpt.inspect(mgr.step_url(8)).extra["step"] == 8


def test_restore_skips_broken_newest(tmp_path, caplog):
    root = str(tmp_path / "run")
    mgr = shardckpt.CheckpointManager(root)
    snaps = {}
    for step in (10, 20, 30, 40):
        s = _state(step)
        snaps[step] = _snapshot(s)
        mgr.save(step, s)
    st = Storage(root)
    # 40: manifest deleted -> not committed at all.
    st.remove(f"{step_dir_name(40)}/{MANIFEST}")
    assert mgr.steps() == [10, 20, 30]
    # 30: manifest garbage; 20: a data file truncated. Both are skipped with a warning.
    with open(os.path.join(root, step_dir_name(30), MANIFEST), "wb") as f:
        f.write(b'{"format": "shardckpt", "version": 1, "tens')
    data20 = [r for r in st.walk_files(step_dir_name(20)) if r.endswith(".safetensors")][0]
    with open(os.path.join(root, data20), "r+b") as f:
        f.truncate(os.path.getsize(os.path.join(root, data20)) - 3)
    s = _blank()
    with caplog.at_level(logging.WARNING, logger="shardckpt"):
        assert mgr.restore(s) == 10
    _assert_state(s, snaps[10])
    warned = " ".join(r.getMessage() for r in caplog.records)
    assert "skipping step 30" in warned and "skipping step 20" in warned and "truncated" in warned
    # Asked for explicitly, a broken step raises instead of falling back.
    before = _snapshot(s)
    with pytest.raises(CorruptCheckpointError, match="truncated"):
        mgr.restore(s, step=20)
    with pytest.raises(CheckpointNotFoundError):
        mgr.restore(s, step=40)
    _assert_state(s, before)


def test_restore_with_nothing_committed(root):
    mgr = shardckpt.CheckpointManager(root)
    s = _blank()
    before = _snapshot(s)
    assert mgr.restore(s) is None and mgr.steps() == [] and mgr.latest_step() is None
    _assert_state(s, before)


def test_second_save_refused_unless_forced(tmp_path):
    root = str(tmp_path / "run")
    mgr = shardckpt.CheckpointManager(root)
    mgr.save(5, _state(5))
    with pytest.raises(CheckpointExistsError, match="step-00000005"):
        mgr.save(5, _state(6))
    s = _blank()
    mgr.restore(s)
    _assert_state(s, _snapshot(_state(5)))
    old_files = set(Storage(mgr.step_url(5)).walk_files("data"))
    mgr.save(5, _state(6), force=True)
    s = _blank()
    assert mgr.restore(s) == 5
    _assert_state(s, _snapshot(_state(6)))
    assert not old_files & set(Storage(mgr.step_url(5)).walk_files("data"))


def test_leftovers_ignored_then_cleaned(root):
    mgr = shardckpt.CheckpointManager(root, keep_last=5)
    mgr.save(1, _state(1))
    st = Storage(root)
    # A crashed save of step 9 (data, no manifest) and of step 2.
    for step in (9, 2):
        w = st.open_write(f"{step_dir_name(step)}/data/abc-r00000-00.safetensors")
        w.write(b"partial")
        w.close()
    # Debris inside the committed step: a temp manifest and an orphan data file.
    st.write_atomic(f"{step_dir_name(1)}/.manifest.json.0123.tmp", b"{}")
    st.write_atomic(f"{step_dir_name(1)}/data/deadbeef0000-r00000-00.safetensors", b"orphan")
    assert mgr.steps() == [1]
    s = _blank()
    assert mgr.restore(s) == 1
    _assert_state(s, _snapshot(_state(1)))
    # Saving step 2 first clears step 2's own leftovers. Step 9, newer than
    # every committed step, may be a save in flight elsewhere: it stays
    # (stale_leftovers) until a step past it commits.
    mgr.save(2, _state(2))
    assert sorted(st.listdir("")) == [step_dir_name(1), step_dir_name(2), step_dir_name(9)]
    assert mgr.cleanup() == sorted(
        [f"{step_dir_name(1)}/.manifest.json.0123.tmp", f"{step_dir_name(1)}/data/deadbeef0000-r00000-00.safetensors"]
    )
    assert mgr.cleanup() == []
    mgr.save(10, _state(10))
    assert sorted(st.listdir("")) == [step_dir_name(1), step_dir_name(2), step_dir_name(10)]
    s = _blank()
    assert mgr.restore(s, step=1) == 1
    shardckpt.verify(mgr.step_url(1))


def test_stale_leftovers_are_only_those_below_the_newest_committed_step():
    assert stale_leftovers([], [1, 2]) == []  # nothing committed: every leftover may be in flight
    assert stale_leftovers([3, 5], [4, 6, 2]) == [2, 4]
    assert stale_leftovers([5], [5, 7]) == []


def test_manager_arguments_and_lifecycle(tmp_path):
    for bad in (dict(keep_last=0), dict(keep_every=-2), dict(save_interval=0), dict(keep_last=1.5), dict(collective_timeout_s=0)):
        with pytest.raises(ValueError):
            shardckpt.CheckpointManager(str(tmp_path), **bad)
    mgr = shardckpt.CheckpointManager(str(tmp_path), save_interval=50)
    assert [s for s in range(0, 201) if mgr.should_save(s)] == [0, 50, 100, 150, 200]
    for bad_step in (-1, "3", 2.0, True):
        with pytest.raises(ValueError, match="step must be a non-negative int"):
            mgr.save(bad_step, _state(1))
    mgr.save(torch.tensor(3), _state(3))  # 0-d int tensors (and numpy ints) are steps too
    assert mgr.steps() == [3]
    with pytest.raises(TypeError, match="process_group"):
        mgr.restore(_blank(), process_group=None)
    mgr.delete(3)
    assert mgr.steps() == [] and Storage(str(tmp_path)).listdir("") == []
    with shardckpt.CheckpointManager(str(tmp_path)) as m2:
        m2.save(4, _state(4))
    with pytest.raises(CheckpointError, match="closed"):
        m2.save(5, _state(5))


# --------------------------------------------------------------------------
# async


def test_async_snapshot_isolated_from_updates(root):
    s = _state(3)
    snap = _snapshot(s)
    h = shardckpt.async_save(s, f"{root}/a")
    _mutate(s)  # training goes on right away
    assert h.result(timeout=60) is None and h.done() and h.exception() is None
    got = _blank()
    shardckpt.load(got, f"{root}/a")
    _assert_state(got, snap)
    # The reused staging buffers take the next snapshot; the first checkpoint is untouched.
    snap2 = _snapshot(s)
    h2 = shardckpt.async_save(s, f"{root}/b")
    _mutate(s)
    h2.result()
    for url, want in ((f"{root}/a", snap), (f"{root}/b", snap2)):
        got = _blank()
        shardckpt.load(got, url)
        _assert_state(got, want)
    shardckpt.verify(f"{root}/b")
    with pytest.raises(CheckpointExistsError):
        shardckpt.async_save(s, f"{root}/b")


def _slow_writes(monkeypatch, delay: float):
    real = _api.write_files

    def slow(*a, **kw):
        time.sleep(delay)
        return real(*a, **kw)

    monkeypatch.setattr(_api, "write_files", slow)


def test_async_one_save_in_flight(tmp_path, monkeypatch):
    _slow_writes(monkeypatch, 0.5)
    s = {"w": torch.ones(1000)}
    t0 = time.perf_counter()
    h1 = shardckpt.async_save(s, str(tmp_path / "one"))
    assert time.perf_counter() - t0 < 0.4 and not h1.done()
    s["w"].fill_(2)
    h2 = shardckpt.async_save(s, str(tmp_path / "two"))  # waits for h1
    assert h1.done()
    assert h2.staging_seconds >= 0 and not h2.done()
    h2.result()
    for name, v in (("one", 1.0), ("two", 2.0)):
        got = {"w": torch.zeros(1000)}
        shardckpt.load(got, str(tmp_path / name))
        assert torch.all(got["w"] == v)


def _fail_writes(monkeypatch, where: str = ""):
    """Writes under URLs containing ``where`` fail (for as long as the test runs:
    the background thread may reach them after the save call returned)."""
    real = _api.write_files

    def maybe_boom(storage, files, **kw):
        if where in storage.url:
            raise OSError(28, "No space left on device (injected)")
        return real(storage, files, **kw)

    monkeypatch.setattr(_api, "write_files", maybe_boom)


def test_async_failure_surfaces_from_result_and_next_save(tmp_path, monkeypatch):
    s = {"w": torch.ones(4)}
    # A file where a directory should be: the background write fails.
    (tmp_path / "file").write_text("x")
    bad = str(tmp_path / "file" / "ckpt")
    h = shardckpt.async_save(s, bad)
    with pytest.raises(SaveFailedError, match="nothing was committed") as ei:
        h.result()
    assert "ckpt" in str(ei.value) and h.done()
    assert isinstance(h.exception(), SaveFailedError)
    # Seen through result(): the next save goes ahead.
    shardckpt.async_save(s, str(tmp_path / "ok1")).result()

    # Not looked at: the next save raises it (once) and does not start.
    _fail_writes(monkeypatch, "lost")
    h = shardckpt.async_save(s, str(tmp_path / "lost"))
    with pytest.raises(SaveFailedError, match=r"previous async save to .*lost failed.*injected"):
        shardckpt.async_save(s, str(tmp_path / "ok2"))
    assert not os.path.exists(tmp_path / "ok2" / MANIFEST)
    assert not os.path.exists(tmp_path / "lost" / MANIFEST)
    shardckpt.async_save(s, str(tmp_path / "ok2")).result()
    assert os.path.exists(tmp_path / "ok2" / MANIFEST)


def test_manager_async(root, monkeypatch):
    mgr = shardckpt.CheckpointManager(root, keep_last=2, async_save=True)
    snaps = {}
    s = _state(1)
    for step in range(1, 6):
        snaps[step] = _snapshot(s)
        h = mgr.save(step, s)
        assert isinstance(h, shardckpt.AsyncSaveHandle)
        _mutate(s)
    mgr.wait()
    assert mgr.steps() == [4, 5]
    got = _blank()
    assert mgr.restore(got) == 5
    _assert_state(got, snaps[5])
    # A committed step is refused at once, before anything runs in the background.
    with pytest.raises(CheckpointExistsError, match="already committed"):
        mgr.save(5, s)
    # A background failure: restore still works (the error stays pending),
    # wait() raises it, and the next save goes ahead afterwards.
    _fail_writes(monkeypatch, step_dir_name(6))
    mgr.save(6, s)
    got = _blank()
    assert mgr.restore(got) == 5
    with pytest.raises(SaveFailedError, match="injected"):
        mgr.wait()
    mgr.wait()
    assert mgr.steps() == [4, 5]
    mgr.save(6, s)
    with pytest.raises(SaveFailedError, match="previous async save"):
        mgr.save(7, s)
    mgr.save(7, s)
    mgr.close()
    assert mgr.steps() == [5, 7]


def test_async_close_raises_unseen_error(tmp_path, monkeypatch):
    _fail_writes(monkeypatch)
    with pytest.raises(SaveFailedError, match="injected"):
        with shardckpt.CheckpointManager(str(tmp_path), async_save=True) as mgr:
            mgr.save(1, {"w": torch.ones(2)})


MANIFEST = "manifest.json"


# -- messages name the right switch and what exists (issue 12) -------------------


def test_existing_step_says_force_not_overwrite(tmp_path):
    for async_save in (False, True):
        root = str(tmp_path / f"run{async_save}")
        with shardckpt.CheckpointManager(root, async_save=async_save) as mgr:
            h = mgr.save(3, {"w": torch.ones(2)})
            if h is not None:
                h.result()
            with pytest.raises(CheckpointExistsError, match="step 3 is already committed.*pass force=True") as ei:
                mgr.save(3, {"w": torch.ones(2)})
            assert "overwrite=True" not in str(ei.value)
    d = str(tmp_path / "plain")
    shardckpt.save({"w": torch.ones(2)}, d)
    with pytest.raises(CheckpointExistsError, match="pass overwrite=True") as ei:
        shardckpt.save({"w": torch.ones(2)}, d)
    assert "force=True" not in str(ei.value)


def test_restore_of_a_missing_step_lists_the_committed_ones(tmp_path):
    mgr = shardckpt.CheckpointManager(str(tmp_path / "run"))
    with pytest.raises(CheckpointNotFoundError, match=r"step 7 is not committed .*no step is committed there"):
        mgr.restore({"w": torch.ones(2)}, step=7)
    for s in (2, 4, 9):
        mgr.save(s, {"w": torch.ones(2)})
    with pytest.raises(CheckpointNotFoundError, match=r"step-00000007.*committed steps: 2, 4, 9\. Call restore\(\) without step="):
        mgr.restore({"w": torch.ones(2)}, step=7)
    many = shardckpt.CheckpointManager(str(tmp_path / "many"))
    for s in range(30):
        many.save(s, {"w": torch.ones(1)})
    with pytest.raises(CheckpointNotFoundError, match=r"\.\.\. \(10 more\)"):
        many.restore({"w": torch.ones(1)}, step=77)


@pytest.mark.parametrize("root", ["", "   ", "\t"])
def test_blank_root_is_refused(root):
    with pytest.raises(shardckpt.UsageError, match="root_url .* is blank"):
        shardckpt.CheckpointManager(root)


def test_steps_agree_when_save_returns_with_retention(tmp_path):
    # retention has finished before save (or result()) returns
    mgr = shardckpt.CheckpointManager(str(tmp_path / "r"), keep_last=1, async_save=True)
    for s in range(4):
        mgr.save(s, {"w": torch.ones(1)}).result()
        assert mgr.steps() == [s]
    mgr.close()


def test_a_second_manager_is_refused_once_its_steps_appear(tmp_path):
    from shardckpt.errors import ConcurrentUseError, SaveFailedError

    root = str(tmp_path)
    a = shardckpt.CheckpointManager(root, keep_last=2)
    a.save(1, _state(1))
    # Another writer (another job: not a manager of this process) commits step 2.
    shardckpt.save(_state(2), a.step_url(2))
    with pytest.raises(ConcurrentUseError, match=r"steps 2 were committed .* by another writer") as e:
        a.save(3, _state(3))
    assert isinstance(e.value, SaveFailedError) and "own root_url" in str(e.value)
    assert a.steps() == [1, 2]  # nothing of step 3
    # A restart (a new manager) takes the root over: what is there is its past.
    c = shardckpt.CheckpointManager(root, keep_last=1)
    c.save(4, _state(4))
    assert c.steps() == [4]
    s = _blank()
    assert c.restore(s) == 4
    _assert_state(s, _snapshot(_state(4)))


def test_managers_of_one_process_take_over_not_interleave(tmp_path):
    # Two managers of one process on one root (issue 20): the second to save
    # takes the root over (as a restarted run would); the first is then refused
    # (their retentions would delete each other's steps).
    from shardckpt.errors import ConcurrentUseError

    root = str(tmp_path)
    a = shardckpt.CheckpointManager(root, keep_last=3)
    b = shardckpt.CheckpointManager(root, keep_last=3, async_save=True)
    a.save(1, _state(1))
    b.save(2, _state(2)).result()
    with pytest.raises(ConcurrentUseError, match="another CheckpointManager of this process"):
        a.save(3, _state(3))
    b.save(4, _state(4)).result()
    assert a.steps() == [1, 2, 4]
    a.close()
    c = shardckpt.CheckpointManager(root, keep_last=3)  # a restart in the same process
    c.save(5, _state(5))
    assert c.steps() == [2, 4, 5]


def test_retention_is_skipped_once_another_writer_commits(tmp_path, caplog):
    root = str(tmp_path)
    a = shardckpt.CheckpointManager(root, keep_last=1)
    a.save(1, _state(1))
    # Another writer commits step 2 while a's save of step 3 runs (after its check).
    real = a._claim

    def claim_then_other_writer(step):
        real(step)
        shardckpt.save(_state(2), a.step_url(2))

    a._claim = claim_then_other_writer
    with caplog.at_level(logging.WARNING, logger="shardckpt"):
        a.save(3, _state(3))
    assert "retention skipped" in caplog.text
    assert a.steps() == [1, 2, 3]  # keep_last=1 would have deleted 1 and 2


def test_a_leftover_committed_while_it_is_removed_is_put_back(tmp_path):
    mgr = shardckpt.CheckpointManager(str(tmp_path))
    mgr.save(9, _state(9))
    name = step_dir_name(9)
    manifest = (tmp_path / name / "manifest.json").read_bytes()
    (tmp_path / name / "manifest.json").unlink()  # a save in flight: no manifest yet
    st = mgr.root
    real_rename = st.rename
    moves = []

    def rename(src, dst):
        real_rename(src, dst)
        moves.append((src, dst))
        if len(moves) == 1:  # the other process's commit landed just before the move
            (tmp_path / dst / "manifest.json").write_bytes(manifest)

    st.rename = rename
    retention.remove_leftover(mgr.root, name)
    assert moves[0][0] == name and moves[1] == (moves[0][1], name)  # moved aside, then back
    assert mgr.steps() == [9]
    s = _blank()
    assert mgr.restore(s) == 9
    _assert_state(s, _snapshot(_state(9)))
    # Without a commit it is removed, aside name included.
    (tmp_path / name / "manifest.json").unlink()
    st.rename = real_rename
    retention.remove_leftover(mgr.root, name)
    assert sorted(os.listdir(tmp_path)) == []


def test_restore_leaves_the_load_thread_count_to_load_unless_given(tmp_path, monkeypatch):
    # A manager built without io_threads must not pin GPU restores to the CPU
    # default: load() picks SHARDCKPT_LOAD_CUDA_IO_THREADS for CUDA targets.
    import shardckpt._managed.sources as mgr_mod  # where restore's sources call load()

    seen = []
    real = mgr_mod.load

    def spy(*a, **kw):
        seen.append(kw.get("io_threads", "unset"))
        return real(*a, **kw)

    monkeypatch.setattr(mgr_mod, "load", spy)
    state = {"w": torch.arange(4.0)}
    m = shardckpt.CheckpointManager(str(tmp_path / "a"))
    m.save(1, state)
    assert m.restore({"w": torch.zeros(4)}) == 1
    m2 = shardckpt.CheckpointManager(str(tmp_path / "b"), io_threads=3)
    m2.save(1, state)
    assert m2.restore({"w": torch.zeros(4)}) == 1
    assert seen == ["unset", 3]
