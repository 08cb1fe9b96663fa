"""The control plane on real ranks: a rank that never calls is logged early, without torch's warning flood."""

from __future__ import annotations

import os
import time

import pytest
from _dist import run_ranks


def _only_rank0_saves(rank, world, root):
    import logging

    import torch

    import shardckpt
    from shardckpt import _collective

    done = os.path.join(root, "rank0-done")
    if rank != 0:
        # Alive (its heartbeat runs) but never calls, until rank 0's save has
        # timed out (8 s) and it has looked at its logs: no fixed sleep to sit out.
        deadline = time.monotonic() + 60
        while not os.path.exists(done) and time.monotonic() < deadline:
            time.sleep(0.05)
        return None
    _collective.WAIT_LOG_AFTER_S = 2.0
    records = []

    class Keep(logging.Handler):
        def emit(self, record):
            records.append((time.monotonic(), record.getMessage()))

    logging.getLogger("shardckpt").addHandler(Keep())
    # What torch's C++ side writes goes to fd 2: count its "timed out" lines.
    err = os.path.join(root, "stderr.txt")
    saved = os.dup(2)
    fd = os.open(err, os.O_WRONLY | os.O_CREAT | os.O_TRUNC)
    os.dup2(fd, 2)
    t0 = time.monotonic()
    try:
        shardckpt.save({"w": torch.ones(2)}, os.path.join(root, "ck"), collective_timeout_s=8)
        raised = None
    except shardckpt.errors.SaveFailedError as e:
        raised = str(e)
    finally:
        os.dup2(saved, 2)
        os.close(fd)
    with open(err) as f:
        noise = sum("timed out" in line or "likely a timeout" in line for line in f)
    open(done, "w").close()
    return raised, [(t - t0, m) for t, m in records], noise


@pytest.mark.timeout(120)
def test_a_rank_that_never_calls_is_logged_early_and_torch_stays_quiet(tmp_path):
    res = run_ranks(2, _only_rank0_saves, str(tmp_path), timeout=90, fresh=True)
    raised, logs, noise = res[0]
    assert raised and "rank 1 of 2 did not reach shardckpt.save" in raised, raised
    waited = [(t, m) for t, m in logs if "has waited" in m]
    # Logged after WAIT_LOG_AFTER_S of waiting, long before the timeout ends the wait.
    assert waited and "has waited 2 s" in waited[0][1], logs
    assert "rank 1" in waited[0][1], waited
    # 8 s of waiting: at most the one pair of lines of the helper's own timeout, not two a second.
    assert noise <= 2, noise
