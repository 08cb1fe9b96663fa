"""A refused save ends on every rank within seconds, and the processes exit (issue 29, item 3).

Two gloo ranks, launched the way a user launches them (one process per rank,
``init_process_group("gloo")`` with rank 0 hosting the c10d store), save
``{"w": float32}`` on rank 0 and ``{"w": float64}`` on rank 1: both must raise
the same refusal and both processes must exit. Before the fix a peer that
was slow between posting its outcome and waiting for the verdict opened its
waiting connection after rank 0 had exited with the store: ``Store.clone``
retries connecting for the store's own timeout (30 min), so the process
stayed alive repeating ``TCPStore::add ... Broken pipe`` from its heartbeat.

The slow peer is made deterministic here by a store wrapper on rank 1 that
sleeps after each ``check`` that finds a key missing (a peer descheduled at
that moment on a busy host); the plain case runs in a loop as well. Each rank
dumps its stacks to its output if it is still alive after ``STACKS_AFTER_S``.
"""

from __future__ import annotations

import faulthandler
import os
import sys
import time

import pytest

#: Liveness bound: every rank must have exited this long after it started
#: saving (a refusal takes well under a second; the bound only separates
#: "ends" from "hangs for the store's 30 min timeout").
EXIT_BOUND_S = 30.0
#: Each rank dumps its threads' stacks after this long (to its output).
STACKS_AFTER_S = 20.0
#: How long the slow peer sleeps after a check that found a key missing.
SLOW_CHECK_S = 2.0


class _SlowChecks:
    """The default store, slowed after each ``check`` that finds a key missing (a descheduled peer)."""

    def __init__(self, inner):
        self._inner = inner

    def __getattr__(self, name):
        return getattr(self._inner, name)

    def check(self, keys):
        found = self._inner.check(keys)
        if not found:
            time.sleep(SLOW_CHECK_S)
        return found


def _rank(rank: int, world: int, port: int, path: str, slow_peer: bool, out) -> None:
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), RANK=str(rank), WORLD_SIZE=str(world))
    os.environ["CUDA_VISIBLE_DEVICES"] = ""
    from datetime import timedelta

    import torch
    import torch.distributed as dist
    from torch.distributed import distributed_c10d as c10d

    import shardckpt

    faulthandler.dump_traceback_later(STACKS_AFTER_S, exit=False, file=sys.stderr)
    torch.set_num_threads(1)
    dist.init_process_group("gloo", rank=rank, world_size=world, timeout=timedelta(seconds=60))
    if slow_peer and rank == 1:
        real = c10d._get_default_store
        c10d._get_default_store = lambda: _SlowChecks(real())
    state = {"w": torch.zeros(4, dtype=torch.float32 if rank == 0 else torch.float64)}
    out.send(("saving", time.monotonic()))
    try:
        shardckpt.save(state, path)
        out.send(("saved", None))
    except Exception as e:  # noqa: BLE001 - told to the test
        out.send(("raised", f"{type(e).__name__}: {e}"))
    out.close()
    # The process now ends as a user's script does: no destroy_process_group.


def _run_once(tmp_path, i: int, slow_peer: bool) -> None:
    from _dist import free_port, process_context

    ctx = process_context()  # one process per rank, forked from the server that imported torch once
    port = free_port()
    path = str(tmp_path / f"ck{i}")
    pipes, procs = [], []
    for r in range(2):
        parent, child = ctx.Pipe(duplex=False)
        p = ctx.Process(target=_rank, args=(r, 2, port, path, slow_peer, child), daemon=True)
        p.start()
        child.close()
        pipes.append(parent)
        procs.append(p)
    try:
        started = [None, None]
        said = [[], []]
        deadline = time.monotonic() + 120  # process start and init_process_group, then the bound below
        while any(p.is_alive() for p in procs):
            for r, c in enumerate(pipes):
                while c.poll(0):
                    try:
                        kind, v = c.recv()
                    except EOFError:
                        break
                    said[r].append((kind, v))
                    if kind == "saving":
                        started[r] = time.monotonic()
            now = time.monotonic()
            if all(s is not None for s in started):
                deadline = min(deadline, max(started) + EXIT_BOUND_S)
            if now > deadline:
                alive = [r for r, p in enumerate(procs) if p.is_alive()]
                pytest.fail(f"run {i} (slow_peer={slow_peer}): rank(s) {alive} still alive {EXIT_BOUND_S:g} s after "
                            f"the refused save started; what the ranks said: {said}")
            time.sleep(0.05)
        for r, c in enumerate(pipes):
            while c.poll(0):
                try:
                    said[r].append(c.recv())
                except EOFError:
                    break
        for r, p in enumerate(procs):
            assert p.exitcode == 0, f"run {i}: rank {r} exit code {p.exitcode}; said {said[r]}"
        msgs = [[v for kind, v in s if kind == "raised"] for s in said]
        assert all(len(m) == 1 for m in msgs), f"run {i}: every rank must raise once: {said}"
        # The same refusal on every rank (agree's contract), not "rank 0 stopped".
        assert msgs[0] == msgs[1], f"run {i}: the ranks raised different errors: {msgs}"
        assert msgs[0][0].startswith("UnsupportedStateError") and "dtype" in msgs[0][0], msgs
    finally:
        for p in procs:
            if p.is_alive():
                p.kill()
            p.join(5)


def test_refused_save_ends_on_every_rank_with_a_slow_peer(tmp_path):
    for i in range(2):
        _run_once(tmp_path, i, slow_peer=True)


@pytest.mark.slow
def test_refused_save_ends_on_every_rank_in_a_loop(tmp_path):
    for i in range(10):
        _run_once(tmp_path, i, slow_peer=False)
