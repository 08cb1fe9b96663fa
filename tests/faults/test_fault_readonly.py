"""Fault matrix, read-only storage mid-save: 1 and 2 ranks, sync and async, real processes and a real EROFS.

The checkpoint root is a bind mount of its own; the saving process remounts it read-only while its save
runs, so every later write gets the kernel's ``EROFS`` (as root, ``chmod`` would not stop a write). When
not root, the directories are made read-only with ``chmod`` instead (``EACCES``). Two points:

  data     planned (async: staged), nothing written yet: the step directory cannot be made
  commit   every rank's data and index files written and closed, the manifest not yet

Every cell asserts: the save raises ``SaveFailedError`` caused by our ``StorageError`` naming the path and
the reason; nothing is committed; the previous step is listed alone and restores bit-exact while the
root is still read-only; once writable again the next save commits and the leftovers go. The table of
results is in docs/reliability.md ("Fault matrix").
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess

import pytest
import torch
from _faultkids import finish, join_group, result, start

POINTS = ["data", "commit"]
#: Bound of one child: a hang fails the cell instead of the suite.
CHILD_TIMEOUT_S = 240


def _mount_works(d: str) -> bool:
    if os.geteuid() != 0 or shutil.which("mount") is None:
        return False
    r = subprocess.run(["mount", "--bind", d, d], capture_output=True)
    if r.returncode != 0:
        return False
    subprocess.run(["umount", d], capture_output=True)
    return True


def _set_readonly(mode: str, root: str, readonly: bool) -> None:
    """Make the whole mount (``mount``) or every directory under ``root`` (``chmod``) read-only, or writable again."""
    if mode == "mount":
        subprocess.run(["mount", "-o", f"remount,bind,{'ro' if readonly else 'rw'}", root], check=True, capture_output=True)
    else:
        for dirpath, _, _ in os.walk(root):
            os.chmod(dirpath, 0o555 if readonly else 0o755)


def _arm(point: str, mode: str, root: str, async_save: bool) -> None:
    """Patch the engine so that this process makes the root read-only at ``point``, once."""
    from shardckpt import _manager, _save

    def once(real):
        done = []

        def wrapped(*a, **kw):
            if not done:
                done.append(1)
                _set_readonly(mode, root, True)
            return real(*a, **kw)

        return wrapped

    if point == "data":
        # Rank 0, after planning (and staging): no rank writes before rank 0's go.
        if async_save:
            from shardckpt import _async

            _async.stage_save = _after(_async.stage_save, lambda: _set_readonly(mode, root, True))
        else:
            _manager.execute_save = once(_manager.execute_save)
    elif point == "commit":
        _save._commit = once(_save._commit)  # rank 0, every rank's files closed
    else:
        raise ValueError(point)


def _after(real, then):
    def wrapped(*a, **kw):
        out = real(*a, **kw)
        then()
        return out

    return wrapped


def _state(step: int):
    g = torch.Generator().manual_seed(step)
    return {"w": torch.randn(64, 33, generator=g), "ids": torch.arange(100) * step, "step": step, "cfg": {"b": step, "a": 1}}


def _report(e: BaseException) -> dict:
    from shardckpt.errors import StorageError

    chain, c = [], e
    while c is not None:
        chain.append(type(c).__name__)
        c = c.__cause__
    return {"type": type(e).__name__, "msg": str(e), "chain": chain, "storage_cause": isinstance(e.__cause__, StorageError)}


def _child_single(root: str, point: str, mode: str, async_save: bool) -> None:
    import shardckpt

    run = os.path.join(root, "run")
    mgr = shardckpt.CheckpointManager(run, keep_last=1, async_save=async_save)
    mgr.save(1, _state(1))
    mgr.wait()
    _arm(point, mode, root, async_save)
    state = _state(2)
    try:
        mgr.save(2, state)
        state["w"].zero_()  # training goes on while an async write runs
        mgr.wait()
    except Exception as e:
        print("RESULT " + json.dumps(_report(e)), flush=True)
        os._exit(3)
    print("RESULT " + json.dumps({"type": None}), flush=True)
    os._exit(0)


def _child_rank(root: str, point: str, mode: str, async_save: bool, rank: int, world: int, port: int) -> None:
    import torch.distributed as dist
    from models import build, shard_fsdp2

    import shardckpt

    join_group(rank, world, port, 120)
    model = shard_fsdp2(build(seed=1))
    run = os.path.join(root, "run")
    mgr = shardckpt.CheckpointManager(run, keep_last=1, async_save=async_save)
    mgr.save(1, {"model": model, "step": 1})
    mgr.wait()
    with torch.no_grad():
        for p in model.parameters():
            p.add_(1.0)
    if rank == 0:
        _arm(point, mode, root, async_save)
    try:
        mgr.save(2, {"model": model, "step": 2})
        mgr.wait()
        res, rc = {"type": None}, 0
    except Exception as e:
        res, rc = _report(e), 3
    print("RESULT " + json.dumps(res), flush=True)
    # Rank 0 hosts the store: it must not exit before its peer has read the verdict.
    dist.barrier()
    os._exit(rc)


def _finish(p):
    rc, out = finish(p, CHILD_TIMEOUT_S)
    return rc, result(out), out


@pytest.fixture
def readonly_roots(tmp_path):
    """``make(name) -> (root, mode)``: a directory the children may turn read-only; unmounted at the end."""
    mounted = []
    probe = tmp_path / "probe"
    probe.mkdir()
    mode = "mount" if _mount_works(str(probe)) else ("chmod" if os.geteuid() != 0 else None)
    if mode is None:
        pytest.skip("as root, a read-only root needs mount (bind remount); not permitted here")

    def make(name: str):
        d = tmp_path / name
        d.mkdir()
        if mode == "mount":
            subprocess.run(["mount", "--bind", str(d), str(d)], check=True, capture_output=True)
            mounted.append(str(d))
        return str(d), mode

    yield make
    for d in mounted:
        subprocess.run(["mount", "-o", "remount,bind,rw", d], capture_output=True)
        subprocess.run(["umount", d], capture_output=True)


def _check_failure(where: str, rc: int, res, out: str, root: str, mode: str) -> None:
    assert rc == 3 and res is not None, f"{where}: exit {rc}\n{out}"
    reason = "Read-only file system" if mode == "mount" else "Permission denied"
    assert res["type"] == "SaveFailedError", (where, res)
    msg = res["msg"]
    assert "StorageError" in msg and reason in msg and os.path.join(root, "run") in msg, (where, msg)
    assert "nothing was committed" in msg, (where, msg)


def _check_after(where: str, root: str, mode: str, restore_and_compare) -> None:
    import shardckpt

    run = os.path.join(root, "run")
    # Still read-only: the previous step is the only one listed and restores exactly.
    mgr = shardckpt.CheckpointManager(run, keep_last=1)
    assert mgr.steps() == [1], (where, mgr.steps())
    restore_and_compare(mgr)
    shardckpt.verify(mgr.step_url(1))
    # Writable again: the next save commits; the leftovers of the failed one go.
    _set_readonly(mode, root, False)
    mgr.save(3, _state(3))
    assert mgr.steps() == [3], (where, mgr.steps())
    assert sorted(d for d in os.listdir(run) if d.startswith("step-")) == ["step-00000003"], (where, os.listdir(run))
    shardckpt.verify(mgr.step_url(3))


@pytest.mark.parametrize("async_save", [False, True], ids=["sync", "async"])
def test_read_only_mid_save_single_process(readonly_roots, async_save):
    mode_name = "async" if async_save else "sync"
    cells = {pt: readonly_roots(pt) for pt in POINTS}
    procs = {pt: start(_child_single, root, pt, mode, async_save) for pt, (root, mode) in cells.items()}
    for pt, p in procs.items():
        root, mode = cells[pt]
        where = f"1 rank, {mode_name}, read-only at {pt} ({mode})"
        rc, res, out = _finish(p)
        _check_failure(where, rc, res, out, root, mode)

        def compare(mgr, where=where):
            state = {"w": torch.zeros(64, 33), "ids": torch.zeros(100, dtype=torch.int64), "step": 0, "cfg": {}}
            assert mgr.restore(state) == 1, where
            want = _state(1)
            assert torch.equal(state["w"], want["w"]) and torch.equal(state["ids"], want["ids"]), where
            assert state["step"] == 1 and list(state["cfg"].items()) == [("b", 1), ("a", 1)], where

        _check_after(where, root, mode, compare)


@pytest.mark.parametrize("async_save", [False, True], ids=["sync", "async"])
def test_read_only_mid_save_two_ranks(readonly_roots, async_save):
    from _dist import free_port
    from models import build

    mode_name = "async" if async_save else "sync"
    runs = []
    for pt in POINTS:
        root, mode = readonly_roots(pt)
        port = free_port()
        runs.append((pt, root, mode, [start(_child_rank, root, pt, mode, async_save, r, 2, port) for r in range(2)]))
    for pt, root, mode, procs in runs:
        where = f"2 ranks, {mode_name}, read-only at {pt} ({mode})"
        for r, p in enumerate(procs):
            rc, res, out = _finish(p)
            _check_failure(f"{where}, rank {r}", rc, res, out, root, mode)

        def compare(mgr, where=where):
            model = build(seed=7)
            assert mgr.restore({"model": model, "step": 0}) == 1, where
            ref = build(seed=1).state_dict()
            for k, v in model.state_dict().items():
                assert torch.equal(v, ref[k]), (where, k)

        _check_after(where, root, mode, compare)
