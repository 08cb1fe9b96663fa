"""Memory -> local -> remote on restore: ``CheckpointManager(remote, local=DIR, memory=...)`` on 2 gloo ranks (FSDP2, CPU).

The two ranks are two "nodes" (``ranks_per_node=1``), each node's shared
memory a directory. The first run saves step 3 (local, flushed to the
remote) and keeps step 4 in memory, then dies without closing. Restarts:
memory held -> ``memory:4`` (with or without the
local disk: memory beats the remote's older step); memory gone -> the local step 3; the local disk
gone too (a new node) -> the remote's step 3; each agreed by both ranks,
``restored_from`` saying where from.
"""

from __future__ import annotations

import os
import shutil

import torch
from _dist import run_ranks
from torch import nn

import shardckpt


def _model():
    from torch.distributed.fsdp import fully_shard

    torch.manual_seed(0)
    return fully_shard(nn.Sequential(nn.Linear(16, 16), nn.Linear(16, 8)))


def _full(model):
    return {k: (v.full_tensor() if hasattr(v, "full_tensor") else v).detach().clone() for k, v in model.state_dict().items()}


def _mgr(base, rank):
    node = os.path.join(base, f"node{rank}")
    return shardckpt.CheckpointManager(os.path.join(base, "remote"), local=os.path.join(base, "local"),
                                       memory=shardckpt.MemoryTier(dir=node, ranks_per_node=1), collective_timeout_s=60)


def _first(rank, world, base):
    model = _model()
    mgr = _mgr(base, rank)
    snaps = {}
    for step in range(1, 5):
        with torch.no_grad():
            for p in model.parameters():
                p.add_(1.0)
        state = {"model": model, "step": step}
        if step == 3:
            mgr.save(step, state)
        if step in (2, 4):
            assert mgr.save_to_memory(step, state)
        snaps[step] = _full(model)
    mgr.wait()  # step 3 flushed to the remote
    mgr._memory.snapshots.wait()  # step 4 held in memory
    out = {"snaps": snaps, "remote": mgr.remote_steps(), "local": mgr.steps()}
    # No close(): the run dies here, its memory directories stay.
    return out


def _restart(rank, world, base):
    model = _model()
    with torch.no_grad():
        for p in model.parameters():
            p.zero_()
    state = {"model": model, "step": 0}
    mgr = _mgr(base, rank)
    got = mgr.restore(state)
    out = {"step": got, "state_step": state["step"], "from": mgr.restored_from, "full": _full(model)}
    mgr._tiers.flusher.close(0)  # keep the memory directories (no manager close) for the next restart
    return out


def test_restore_takes_memory_then_local_then_remote(tmp_path):
    base = str(tmp_path)
    first = run_ranks(2, _first, base)
    assert first[0]["remote"] == [3] and first[0]["local"] == [3]
    snaps = [r["snaps"] for r in first]

    def check(want_step, want_from):
        for r, out in enumerate(run_ranks(2, _restart, base)):
            assert out["step"] == want_step and out["state_step"] == want_step, out
            assert out["from"] == want_from, (r, out["from"])
            assert all(torch.equal(v, snaps[r][want_step][k]) for k, v in out["full"].items()), r

    check(4, "memory:4")  # the newest step is held in memory (both nodes' copies verified)
    local = os.path.join(base, "local")
    shutil.move(local, local + ".aside")
    check(4, "memory:4")  # no local disk: memory still beats the remote's older step
    shutil.move(local + ".aside", local)
    for n in ("node0", "node1"):
        shutil.rmtree(os.path.join(base, n))
    check(3, shardckpt.CheckpointManager(local).step_url(3))  # memory gone: the local disk
    shutil.rmtree(local)
    check(3, shardckpt.CheckpointManager(os.path.join(base, "remote")).step_url(3))  # a new node: the remote
