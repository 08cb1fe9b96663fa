"""The memory tier's save path (issue 28): one copy into mapped slots, the rest in the background.

4 gloo ranks as 2 "nodes" (each node's shared memory a directory): the
overlapped save holds the values from before the next optimizer step (its
pre-hook waits for a deliberately slow copy), a damaged peer copy fails the
step in the background and leaves the previous held step restorable, and
the host bytes stay within the stated bound. One process: BatchNorm buffers
(changed by forward) are copied before an overlapped save returns.
"""

import os
import threading
import time

import pytest
import torch

import _training as T
import shardckpt
from _dist import run_ranks
from shardckpt._memory import snapshot
from shardckpt.errors import SaveFailedError, UsageError

KIND = "fsdp2"


def _mgr(base, rank, rpn=2):
    return shardckpt.CheckpointManager(
        os.path.join(base, "root"), memory=shardckpt.MemoryTier(dir=os.path.join(base, f"node{rank // rpn}"), ranks_per_node=rpn)
    )


def _state(model, opt, sched, step):
    return {"model": model, "optim": opt, "sched": sched, "step": step}


class _SlowBackgroundCopy:
    """The background thread's copies start ``delay`` seconds late: a pre-hook that does not wait shows."""

    def __init__(self, delay):
        self.delay, self.slept, self.real = delay, 0, snapshot._bytes_of

    def __enter__(self):
        def slow(t):
            if threading.current_thread() is not threading.main_thread() and not self.slept:
                self.slept += 1
                time.sleep(self.delay)
            return self.real(t)

        snapshot._bytes_of = slow
        return self

    def __exit__(self, *exc):
        snapshot._bytes_of = self.real


def _node_bytes(node_dir):
    """``(data bytes, other bytes)`` of the distinct files under a node's directory (hard links counted once).

    Data: slots and data files; other: index files and manifests.
    """
    seen, data, other = set(), 0, 0
    for root, _dirs, files in os.walk(node_dir):
        for f in files:
            st = os.lstat(os.path.join(root, f))
            if st.st_ino in seen:
                continue
            seen.add(st.st_ino)
            if f.startswith(snapshot.SLOT_PREFIX) or f.endswith(".safetensors"):
                data += st.st_size
            else:
                other += st.st_size
    return data, other


def _overlap_run(rank, world, base):
    model, opt, sched = T.make(KIND, rank, world)
    mgr = _mgr(base, rank)
    T.train(model, opt, sched, 0, 1, KIND, rank, world)
    assert mgr.save_to_memory(1, _state(model, opt, sched, 1))  # blocking
    T.train(model, opt, sched, 1, 1, KIND, rank, world)
    want = {"params": T.full_params(model), "optim": T.full_optim(model, opt)}
    with _SlowBackgroundCopy(0.5) as slow:
        t0 = time.perf_counter()
        assert mgr.save_to_memory(2, _state(model, opt, sched, 2), overlap=True)
        returned_s = time.perf_counter() - t0
        hooks_armed = len(opt._optimizer_step_pre_hooks)
        # The next step: forward and backward overlap the copy; its optimizer step waits for it.
        T.train(model, opt, sched, 2, 1, KIND, rank, world)
        hooks_after = len(opt._optimizer_step_pre_hooks)
        with torch.no_grad():
            for p in model.parameters():
                p.to_local().add_(1.0)  # later changes never reach the held step either
        mgr._memory.snapshots.wait()
    snaps = mgr._memory.snapshots
    last = dict(mgr._memory.last_save)
    return {
        "want": want, "returned_s": returned_s, "slept": slow.slept, "hooks_armed": hooks_armed, "hooks_after": hooks_after,
        "last": last, "host_bytes": snaps.host_bytes(),
        "bound": snapshot.host_bytes_bound(last["own_bytes"], last["peer_bytes_received"]),
    }


def _restart(rank, world, base):
    model, opt, sched = T.make(KIND, rank, world, seed=7)
    T.train(model, opt, sched, 0, 1, KIND, rank, world)
    mgr = _mgr(base, rank)
    step = mgr.restore(_state(model, opt, sched, 0))
    return {"step": step, "from": mgr.restored_from, "params": T.full_params(model), "optim": T.full_optim(model, opt)}


def _same(a, b):
    return sorted(a) == sorted(b) and all(torch.equal(a[k], b[k]) if isinstance(a[k], torch.Tensor) else a[k] == b[k] for k in a)


def test_overlapped_save_holds_the_values_from_before_the_optimizer_step(tmp_path):
    base = str(tmp_path)
    out = run_ranks(4, _overlap_run, base)
    for o in out:
        assert o["slept"] == 1  # the copy really ran late, in the background
        assert o["hooks_armed"] == 1 and o["hooks_after"] == 0  # one-shot: gone after the optimizer step
        assert o["last"]["step"] == 2 and o["last"]["peer_bytes_received"] > 0
        # Memory bound: both slots of own and peer files, never more.
        assert 0 < o["host_bytes"] <= o["bound"]
    for node in ("node0", "node1"):  # what the node's directory holds, hard links once: its ranks' bounds
        bound = sum(o["bound"] for r, o in enumerate(out) if r // 2 == int(node[-1]))
        data, other = _node_bytes(os.path.join(base, node))
        assert data <= bound and other < 64 << 10  # besides the data: one step's index files and manifest
    # Node 1 lost: its replacement restores the overlapped snapshot from node 0's copies.
    import shutil

    shutil.rmtree(os.path.join(base, "node1"))
    back = run_ranks(4, _restart, base)
    for o in back:
        assert o["step"] == 2 and o["from"] == "memory:2"
        assert _same(o["params"], out[0]["want"]["params"])  # before the optimizer step and the edit
        assert _same(o["optim"], out[0]["want"]["optim"])


def _failing_run(rank, world, base):
    model, opt, sched = T.make(KIND, rank, world)
    mgr = _mgr(base, rank)
    T.train(model, opt, sched, 0, 1, KIND, rank, world)
    assert mgr.save_to_memory(1, _state(model, opt, sched, 1))
    mgr._memory.snapshots.wait()
    want = T.full_params(model)
    real = snapshot._move

    def damaging(outgoing, incoming, group, ranks, device, comm=None):
        real(outgoing, incoming, group, ranks, device, comm)
        if rank == 2 and incoming and incoming[-1][1].numel() > 1000:  # rank 2 receives a data file with a flipped byte
            incoming[-1][1][-1] ^= 0xFF

    snapshot._move = damaging
    try:
        T.train(model, opt, sched, 1, 1, KIND, rank, world)
        assert mgr.save_to_memory(2, _state(model, opt, sched, 2))  # the copy is done; the failure comes later
        T.train(model, opt, sched, 2, 1, KIND, rank, world)
        try:
            mgr.save_to_memory(3, _state(model, opt, sched, 3))
            said = None
        except SaveFailedError as e:
            said = str(e)
    finally:
        snapshot._move = real
    return {"want": want, "said": said}


def test_a_failed_peer_copy_leaves_the_held_step(tmp_path):
    base = str(tmp_path)
    out = run_ranks(4, _failing_run, base)
    for o in out:
        assert o["said"] and "step 2 was not kept" in o["said"] and "step 1 is still held" in o["said"]
        assert "damaged" in o["said"]
    back = run_ranks(4, _restart, base)  # every node alive: step 2 is not held anywhere, step 1 is
    for o in back:
        assert o["step"] == 1 and o["from"] == "memory:1"
        assert _same(o["params"], out[0]["want"])


def test_buffers_changed_in_forward_are_copied_before_an_overlapped_save_returns(tmp_path):
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(4, 4), torch.nn.BatchNorm1d(4))
    opt = torch.optim.AdamW(model.parameters(), lr=0.1)
    mgr = shardckpt.CheckpointManager(str(tmp_path / "root"), memory=str(tmp_path / "shm"))
    model(torch.randn(8, 4)).sum().backward()
    opt.step()
    want = {k: v.clone() for k, v in model.state_dict().items()}
    with _SlowBackgroundCopy(0.3):
        assert mgr.save_to_memory(1, {"model": model, "optim": opt}, overlap=True)
        model(torch.randn(8, 4) + 3).sum().backward()  # forward moves the running statistics now
        opt.step()
        mgr._memory.snapshots.wait()
    assert not torch.equal(model[1].running_mean, want["1.running_mean"])
    fresh = torch.nn.Sequential(torch.nn.Linear(4, 4), torch.nn.BatchNorm1d(4))
    again = shardckpt.CheckpointManager(str(tmp_path / "root"), memory=str(tmp_path / "shm"))
    assert again.restore({"model": fresh, "optim": torch.optim.AdamW(fresh.parameters(), lr=0.1)}) == 1
    got = fresh.state_dict()
    assert all(torch.equal(got[k], v) for k, v in want.items())
    with pytest.raises(UsageError, match="no torch.optim.Optimizer"):
        mgr.save_to_memory(2, {"model": model}, overlap=True)
    with pytest.raises(UsageError, match="not after step 1"):
        mgr.save_to_memory(1, {"model": model, "optim": opt})
    mgr.close()
