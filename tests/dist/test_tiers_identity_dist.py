"""Whose step is this (issue 42, case 1): a tier never restores, publishes or deletes another run's step.

Node-local scratch is reused across jobs, so a ``local=`` directory (shared,
or each node's own disk) and a memory tier's directory may hold the steps of
another run. Run B must ignore run A's steps there (logged, naming A's root),
never flush them to its remote nor count them durable, never delete them by
its retention; run A, restarted, still resumes from them. 2 gloo ranks with
FSDP2 on CPU; the remotes are on a real S3 server (moto) on loopback, or
local directories where only the memory tier matters.
"""

from __future__ import annotations

import logging
import os

import torch
from _dist import run_ranks
from _moto import s3_endpoint, s3_url  # noqa: F401  (pytest fixtures)
from torch import nn

import shardckpt


def _model(fill: float):
    from torch.distributed.fsdp import fully_shard

    torch.manual_seed(0)
    model = fully_shard(nn.Sequential(nn.Linear(8, 8), nn.Linear(8, 4)))
    with torch.no_grad():
        for p in model.parameters():
            p.fill_(fill)
    return model


def _value(model) -> float:
    """The one value every parameter holds (the tests fill them so)."""
    vals = {float(v) for p in model.state_dict().values() for v in (p.full_tensor() if hasattr(p, "full_tensor") else p).flatten()}
    assert len(vals) == 1, vals
    return vals.pop()


class _Said(logging.Handler):
    def __init__(self):
        super().__init__(logging.WARNING)
        self.lines = []

    def emit(self, rec):
        self.lines.append(rec.getMessage())


def _run(rank, world, remote, local, opts, steps, fill, *, memory=None, close=True, saves_to_memory=()):
    """One run: restore, then save ``steps`` (parameters filled with ``fill + step``); what it saw and did."""
    model = _model(-1.0)
    said = _Said()
    logging.getLogger("shardckpt").addHandler(said)
    try:
        mgr = shardckpt.CheckpointManager(remote, local=local, keep_last=2, keep_local=1, storage_options=opts,
                                          memory=memory, collective_timeout_s=60)
        state = {"model": model, "step": 0}
        got = mgr.restore(state)
        out = {"step": got, "from": mgr.restored_from, "value": _value(model), "state_step": state["step"]}
        for step in steps:
            with torch.no_grad():
                for p in model.parameters():
                    p.fill_(fill + step)
            if step in saves_to_memory:
                assert mgr.save_to_memory(step, {"model": model, "step": step})
            else:
                mgr.save(step, {"model": model, "step": step})
        mgr.wait()
        out.update(durable=mgr.durable_step, remote=mgr.remote_steps(), local=mgr.steps())
        if close:
            mgr.close()
        else:
            mgr._tiers.flusher.close(0)  # dies without closing: its memory copy stays
    finally:
        logging.getLogger("shardckpt").removeHandler(said)
    out["said"] = said.lines
    return out


def _committed(local: str, step: int) -> bool:
    return os.path.exists(os.path.join(local, f"step-{step:08d}", "manifest.json"))


def test_another_runs_local_step_is_not_restored_flushed_or_deleted(tmp_path, s3_url):  # noqa: F811
    remote, opts = s3_url
    ra, rb, local = f"{remote}/run-a", f"{remote}/run-b", str(tmp_path / "nvme")
    a = run_ranks(2, _run, ra, local, opts, [5], 100.0)
    assert a[0]["step"] is None and a[0]["durable"] == 5
    # Run B, another root, the same node-local directory: A's step 5 is not B's state.
    b = run_ranks(2, _run, rb, local, opts, [1, 2, 3], 200.0)
    for r, out in enumerate(b):
        assert out["step"] is None and out["from"] is None and out["value"] == -1.0 and out["state_step"] == 0, (r, out)
        assert out["durable"] == 3 and 5 not in out["remote"], (r, out)
    assert any("step 5" in line and "run-a" in line for line in b[0]["said"]), b[0]["said"]
    assert shardckpt.CheckpointManager(rb, storage_options=opts, load_only=True).steps()[-1] == 3
    # B's local retention (keep_local=1) kept A's step: it is not B's to delete.
    assert _committed(local, 5) and _committed(local, 3)
    # Both restart on the shared directory: each resumes from its own step.
    b2 = run_ranks(2, _run, rb, local, opts, [], 0.0)
    assert [(o["step"], o["value"]) for o in b2] == [(3, 203.0)] * 2, b2
    a2 = run_ranks(2, _run, ra, local, opts, [], 0.0)
    assert [(o["step"], o["value"]) for o in a2] == [(5, 105.0)] * 2, a2
    assert a2[0]["from"] == os.path.join(local, "step-00000005")


def test_memory_under_local_belongs_to_the_remote_root(tmp_path):
    base = str(tmp_path)
    local = os.path.join(base, "nvme")
    a = run_ranks(2, _run_memory, os.path.join(base, "run-a"), local, base, [3, 4], 100.0, (4,), False)
    assert a[0]["local"] == [3] and a[0]["durable"] == 3
    # Run B: another remote, the same local directory and the same memory directories.
    b = run_ranks(2, _run_memory, os.path.join(base, "run-b"), local, base, [], 0.0, (), True)
    for r, out in enumerate(b):
        assert out["step"] is None and out["value"] == -1.0, (r, out)
    # A restarts: its memory copy is still there (B's close removed nothing of it).
    a2 = run_ranks(2, _run_memory, os.path.join(base, "run-a"), local, base, [], 0.0, (), False)
    assert [(o["step"], o["from"], o["value"]) for o in a2] == [(4, "memory:4", 104.0)] * 2, a2


def _run_memory(rank, world, remote, local, base, steps, fill, to_memory, close):
    tier = shardckpt.MemoryTier(dir=os.path.join(base, f"shm{rank}"), ranks_per_node=1)
    return _run(rank, world, remote, local, None, steps, fill, memory=tier, close=close, saves_to_memory=to_memory)


def _node(base, rank):
    return os.path.join(base, f"node{rank}")


def _run_node(rank, world, remote, base, opts, steps, fill, shared_node=None):
    """A run on per-node local directories (one per rank), or with ``shared_node`` every rank on that node's directory."""
    local = _node(base, rank if shared_node is None else shared_node)
    return _run(rank, world, remote, local, opts, steps, fill)


def test_per_node_local_ignores_a_step_of_another_run_on_one_node(tmp_path, s3_url):  # noqa: F811
    remote, opts = s3_url
    ra, rb, base = f"{remote}/pn-a", f"{remote}/pn-b", str(tmp_path)
    b = run_ranks(2, _run_node, rb, base, opts, [1, 2, 3], 200.0)
    assert b[0]["durable"] == 3
    # Another run (both of its ranks on node 0's disk) leaves a newer step 9 there.
    a = run_ranks(2, _run_node, ra, base, opts, [9], 100.0, 0)
    assert a[0]["durable"] == 9 and _committed(_node(base, 0), 3)  # A's retention left B's steps alone
    b2 = run_ranks(2, _run_node, rb, base, opts, [4], 200.0)
    for r, out in enumerate(b2):
        assert (out["step"], out["value"]) == (3, 203.0), (r, out)
        assert out["from"] == os.path.join(_node(base, r), "step-00000003"), (r, out)
        assert out["durable"] == 4 and 9 not in out["remote"], (r, out)
    assert any("step 9" in line and "pn-a" in line for line in b2[0]["said"]), b2[0]["said"]
    assert _committed(_node(base, 0), 9)  # B's retention (keep_local=1) did not delete it
    assert not _committed(_node(base, 0), 3) and not _committed(_node(base, 1), 3)


def _memory_step(base: str, rank: int, step: int) -> str:
    """Rank ``rank``'s memory directory's step ``step`` (``MemoryTier(dir=...)`` as :func:`_run_memory` makes it)."""
    return os.path.join(base, f"shm{rank}", f"step-{step:08d}", "manifest.json")


def test_memory_step_of_another_run_of_the_root_is_not_restored(tmp_path):
    """Memory steps record the run: a new run of the same root never resumes from an earlier run's memory copy.

    Run A (remote R) saves step 3 and memory step 4, and dies without closing
    (its memory copy stays, as after a crash). R and the local directory are
    emptied and run B starts over on R without the memory tier: a new run
    (nothing of R left to inherit), whose steps 1 and 2 are durable. B
    relaunches with the memory tier on the same nodes: A's memory step 4 is
    newer than B's step 2 and of the same root, but of another run: B
    resumes from its own step 2 (logged, naming A's run), and A's memory
    copy is left in place.

    Not distinguishable (so not tested): a new run that starts from an
    empty R with the memory tier on. Nothing durable names its run yet, so
    A's memory step is taken as the newest step of R, as a restart of A
    (whose remote was lost) would take it.
    """
    import shutil

    base = str(tmp_path)
    remote, local = os.path.join(base, "run"), os.path.join(base, "nvme")
    a = run_ranks(2, _run_memory, remote, local, base, [3, 4], 100.0, (4,), False)
    assert a[0]["durable"] == 3
    assert all(os.path.exists(_memory_step(base, r, 4)) for r in range(2))
    shutil.rmtree(remote)
    shutil.rmtree(local)
    b = run_ranks(2, _run, remote, local, None, [1, 2], 200.0)
    assert b[0]["step"] is None and b[0]["durable"] == 2
    b2 = run_ranks(2, _run_memory, remote, local, base, [], 0.0, (), False)
    for r, out in enumerate(b2):
        assert (out["step"], out["from"], out["value"]) == (2, os.path.join(local, "step-00000002"), 202.0), (r, out)
    assert any("step 4" in line and "run" in line and "not a memory step of this run" in line
               for out in b2 for line in out["said"]), [o["said"] for o in b2]
    assert all(os.path.exists(_memory_step(base, r, 4)) for r in range(2))  # not ours: never deleted
