"""SHARDCKPT_ASYNC_WRITER=process on 2 gloo ranks with FSDP2: each rank's writer child writes its shard."""

from __future__ import annotations

import os
import uuid

import torch

import shardckpt
from _dist import run_ranks
from models import build, full_state, shard_fsdp2

IDX = torch.tensor([[1, 5, 36, 0], [7, 7, 2, 30]])
FIXED_ID = uuid.UUID("0123456789abcdef0123456789abcdef")


def _bump(model, by: float) -> None:
    with torch.no_grad():
        for p in model.parameters():
            p.add_(by)


def _scenario(rank, world, root):
    from shardckpt import _knobs, _writerproc

    out = {}
    knob, uuid4 = _knobs.ASYNC_WRITER, uuid.uuid4
    model = shard_fsdp2(build(seed=1))
    opt = torch.optim.AdamW(model.parameters(), lr=0.1)
    model(IDX).sum().backward()
    opt.step()
    try:
        # The same state, the same save id, written by each writer.
        uuid.uuid4 = lambda: FIXED_ID
        for mode in ("thread", "process"):
            _knobs.ASYNC_WRITER = mode
            shardckpt.async_save({"model": model, "optim": opt}, os.path.join(root, mode)).result(timeout=120)
        uuid.uuid4 = uuid4

        # Training goes on while the writer child writes; the checkpoint keeps the staged values.
        snap = full_state(model)
        h = shardckpt.async_save({"model": model, "step": 3}, os.path.join(root, "live"))
        _bump(model, 5.0)
        h.result(timeout=120)
        w = _writerproc.current_writer()
        out["child"] = w is not None and w.alive() and w.pid != os.getpid()

        fresh = shard_fsdp2(build(seed=9))
        state = {"model": fresh, "step": 0}
        shardckpt.load(state, os.path.join(root, "live"))
        out["loaded_ok"] = state["step"] == 3 and all(torch.equal(v, snap[k]) for k, v in full_state(fresh).items())

        # The manager's async saves go through the same writer.
        mgr = shardckpt.CheckpointManager(os.path.join(root, "run"), keep_last=2, async_save=True, collective_timeout_s=60)
        for step in (1, 2, 3):
            mgr.save(step, {"model": model, "step": step})
            _bump(model, 1.0)
        mgr.wait()
        out["steps"] = mgr.steps()
        want = full_state(model)
        state = {"model": fresh, "step": 0}
        out["restored"] = mgr.restore(state)
        out["restored_ok"] = all(torch.equal(v + 1.0, want[k]) for k, v in full_state(fresh).items() if v.is_floating_point())
        mgr.close()
        out["same_child"] = _writerproc.current_writer().pid == w.pid
    finally:
        uuid.uuid4 = uuid4
        _knobs.ASYNC_WRITER = knob
        shardckpt.release_buffers()
    out["stopped"] = not _writerproc.current_writer().alive()
    return out


def _tree(root) -> dict:
    got = {}
    for dirpath, _, names in os.walk(root):
        for n in names:
            with open(os.path.join(dirpath, n), "rb") as f:
                got[os.path.relpath(os.path.join(dirpath, n), root)] = f.read()
    return got


def test_process_writer_two_ranks(tmp_path):
    root = str(tmp_path)
    res = run_ranks(2, _scenario, root)
    for r, out in enumerate(res):
        assert out == {
            "child": True,
            "loaded_ok": True,
            "steps": [2, 3],
            "restored": 3,
            "restored_ok": True,
            "same_child": True,
            "stopped": True,
        }, (r, out)
    a, b = _tree(os.path.join(root, "thread")), _tree(os.path.join(root, "process"))
    assert sorted(a) == sorted(b)
    # Both ranks wrote data and index files; every byte is the same.
    assert {k.split("-r")[1][:5] for k in a if k.startswith("data")} == {"00000", "00001"}
    for k in a:
        assert a[k] == b[k], k
