"""Real SIGKILLs of an incremental run with retention: every committed step stays whole.

A child process saves steps (frozen base, changing adapter) under
``keep_last=1`` in a loop, logging each step whose save returned; the parent
kills it with SIGKILL once the log shows it has saved a step or more (so the
kill lands during a save or its retention cleanup, wherever it happens to
be), then starts the next child on the same root. After every kill: each
committed step's files, referenced ones included, exist with their sizes
and it verifies; the newest logged step is committed (keep_last=1 keeps it
until a newer one commits).
"""

from __future__ import annotations

import signal
import time

import pytest
from _faultkids import finish, start

import shardckpt
from shardckpt._format import open_manifest
from shardckpt._format.files import check_files
from shardckpt._format.refs import follow
from shardckpt._storage import Storage


def _saver(root: str, log: str, first: int) -> None:
    """The child: saves step after step from ``first``, logging each whose save returned, until killed."""
    import torch

    base = torch.randn(256, 256, generator=torch.Generator().manual_seed(0))
    mgr = shardckpt.CheckpointManager(root, keep_last=1, incremental=True)
    for step in range(first, first + 10_000):
        mgr.save(step, {"base": base, "adapter": torch.full((64,), float(step)), "step": step})
        with open(log, "a") as f:
            f.write(f"{step}\n")


def _logged(log: str):
    try:
        with open(log) as f:
            return [int(x) for x in f.read().split()]
    except FileNotFoundError:
        return []


@pytest.mark.slow
def test_sigkill_during_incremental_saves_and_cleanup(tmp_path):
    root, log = str(tmp_path / "run"), str(tmp_path / "log")
    first = 1
    for kill in range(4):
        before = len(_logged(log))
        p = start(_saver, root, log, first)
        deadline = time.monotonic() + 120
        # Wait for kill + 1 more steps (so kills land at different points), then kill.
        while len(_logged(log)) < before + 1 + kill and p.poll() is None and time.monotonic() < deadline:
            time.sleep(0.01)
        p.kill()
        rc, out = finish(p, 60, "the killed saver")
        assert rc == -signal.SIGKILL, f"the saver ended by itself: exit {rc}\n{out}"
        done = _logged(log)
        assert len(done) > before, "the child saved nothing"
        mgr = shardckpt.CheckpointManager(root)
        steps = mgr.steps()
        assert max(done) in steps or any(s > max(done) for s in steps), (done[-3:], steps)
        for s in steps:
            st = follow(Storage(mgr.step_url(s)))
            m = open_manifest(st)
            check_files(st, {rel: f.size for rel, f in m.files.items()})
            shardckpt.verify(mgr.step_url(s))
        first = max(steps + done) + 1
