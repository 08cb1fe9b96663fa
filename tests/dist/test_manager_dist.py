"""CheckpointManager on 2 gloo ranks with FSDP2: sync and async saves, retention, restore, one rank failing."""

from __future__ import annotations

import time

import torch

import shardckpt
from _dist import run_ranks
from models import build, full_state, shard_fsdp2

IDX = torch.tensor([[1, 5, 36, 0], [7, 7, 2, 30]])


def _bump(model, by: float) -> None:
    with torch.no_grad():
        for p in model.parameters():
            p.add_(by)


def _fail_rank_writes(rank_to_fail: int, rank: int, where: str):
    """On ``rank_to_fail``, writes under URLs containing ``where`` raise."""
    from shardckpt import _save as _api

    real = _api.write_files

    def maybe_boom(storage, files, **kw):
        if rank == rank_to_fail and where in storage.url:
            raise OSError(5, f"injected I/O error on rank {rank}")
        return real(storage, files, **kw)

    _api.write_files = maybe_boom
    return lambda: setattr(_api, "write_files", real)


def _scenario(rank, world, root):
    import torch.distributed as dist

    from shardckpt.errors import SaveFailedError

    out = {}
    model = shard_fsdp2(build(seed=1))
    mgr = shardckpt.CheckpointManager(root, keep_last=2, keep_every=2, collective_timeout_s=60)
    snaps = {}
    for step in range(1, 6):
        snaps[step] = full_state(model)
        mgr.save(step, {"model": model, "step": step})
        _bump(model, 1.0)
    out["steps_sync"] = mgr.steps()

    # Async: the snapshot is taken at the call; training (params, collectives
    # on the training group) goes on while the background thread writes.
    amgr = shardckpt.CheckpointManager(root, keep_last=2, keep_every=2, async_save=True, collective_timeout_s=60)
    snaps[6] = full_state(model)
    h = amgr.save(6, {"model": model, "step": 6})
    _bump(model, 5.0)
    x = torch.ones(3)
    for _ in range(20):
        dist.all_reduce(x)  # the training group, concurrently with the save's own gloo group
    out["allreduce"] = x[0].item()
    h.result(timeout=120)
    out["steps_async"] = amgr.steps()

    # One rank's writes fail: both ranks raise, nothing is committed.
    undo = _fail_rank_writes(1, rank, "step-00000007")
    try:
        t0 = time.perf_counter()
        h = amgr.save(7, {"model": model, "step": 7})
        try:
            h.result(timeout=120)
            out["async_fail"] = None
        except SaveFailedError as e:
            out["async_fail"] = str(e)
        out["fail_seconds"] = time.perf_counter() - t0
        # One manager per root in a process: the sync case takes the root over
        # with a new manager (amgr, which saved last, owns it until then).
        smgr = shardckpt.CheckpointManager(root, keep_last=2, keep_every=2, collective_timeout_s=60)
        try:
            smgr.save(7, {"model": model, "step": 7})
            out["sync_fail"] = None
        except SaveFailedError as e:
            out["sync_fail"] = str(e)
        smgr.close()
    finally:
        undo()
    out["steps_after_fail"] = amgr.steps()

    fresh = shard_fsdp2(build(seed=9))
    fresh(IDX).sum().backward()  # FSDP2 buffers exist before the load
    state = {"model": fresh, "step": 0}
    out["restored"] = amgr.restore(state)
    out["restored_step_value"] = state["step"]
    out["restored_ok"] = all(torch.equal(v, snaps[6][k]) for k, v in full_state(fresh).items())
    state = {"model": fresh, "step": 0}
    out["restored4"] = mgr.restore(state, step=4)
    out["restored4_ok"] = all(torch.equal(v, snaps[4][k]) for k, v in full_state(fresh).items())
    amgr.close()
    return out


def test_manager_two_ranks(tmp_path):
    root = str(tmp_path / "run")
    res = run_ranks(2, _scenario, root)
    for r, out in enumerate(res):
        assert out["steps_sync"] == [2, 4, 5], (r, out)
        assert out["steps_async"] == [2, 4, 5, 6], (r, out)
        assert out["allreduce"] == 2.0**20
        assert out["sync_fail"] and "injected I/O error on rank 1" in out["sync_fail"], (r, out)
        assert out["async_fail"] and "injected I/O error on rank 1" in out["async_fail"], (r, out)
        assert out["fail_seconds"] < 30
        assert out["steps_after_fail"] == [2, 4, 5, 6]
        assert out["restored"] == 6 and out["restored_step_value"] == 6 and out["restored_ok"], (r, out)
        assert out["restored4"] == 4 and out["restored4_ok"], (r, out)
    # The checkpoints load in one process too (2 -> 1 ranks).
    model = build(seed=3)
    assert shardckpt.CheckpointManager(root).restore({"model": model, "step": 0}) == 6
    ref = build(seed=1)
    for _ in range(5):  # bumped by 1 after each of steps 1..5 (same float rounding)
        _bump(ref, 1.0)
    for k, v in model.state_dict().items():
        assert torch.equal(v, ref.state_dict()[k]), k
