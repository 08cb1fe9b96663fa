"""Run a function on N gloo ranks (separate processes) and collect the results.

Spawning a process and importing torch costs seconds, so ranks are kept in a
pool per world size and reused across tests: each worker joins a gloo group
once, then runs the functions it is sent. A failure or time-out on any rank
kills that pool (a half-finished collective cannot be trusted) and the next
call starts a fresh one. ``SHARDCKPT_TEST_FRESH=1`` forces fresh processes
for every call.

Functions must be importable (module level) and their arguments and results
picklable; results travel by value.
"""

from __future__ import annotations

import atexit
import multiprocessing as mp
import os
import pickle
import socket
import time
import traceback
from datetime import timedelta
from typing import Any, Callable, Dict, List

#: Collective timeout inside the workers: a rank stuck in a collective fails
#: the test within this time instead of hanging CI.
PG_TIMEOUT_S = 60


#: Ports handed to processes that bind them seconds later (a rank's store, a
#: server): below the kernel's ephemeral range (ip_local_port_range, 32768 up
#: by default), so no outgoing connection of this or another test process
#: (an S3 client, a gloo link) can take one in between, which happened.
PORT_RANGE = (20000, 32767)


def free_port() -> int:
    """A loopback TCP port free now, outside the ephemeral range (see ``PORT_RANGE``)."""
    import random

    lo, hi = PORT_RANGE
    pick = random.SystemRandom()  # not the seeded module state: two test processes must not draw alike
    for _ in range(200):
        port = pick.randint(lo, hi)
        with socket.socket() as s:
            try:
                s.bind(("127.0.0.1", port))
            except OSError:
                continue
            return port
    with socket.socket() as s:  # everything tried was taken: let the kernel choose
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def give_back_freed_memory() -> None:
    """Return the C heap's free pages to the kernel (glibc ``malloc_trim``): a rank's or a test process's RSS drops back.

    A test's tensors freed in the middle of glibc's arenas stay counted in
    the process's RSS until reused: a rank process grew from 0.26 GB (the
    fork server's imports) to 0.53 GB over a run and kept it while idle
    (issue 47). A no-op where glibc is not the C library. Cheap (1-15 ms).
    """
    global _TRIM
    if _TRIM is None:
        try:
            import ctypes

            _TRIM = ctypes.CDLL("libc.so.6").malloc_trim
        except (OSError, AttributeError):
            _TRIM = False
    if _TRIM:
        _TRIM(0)


_TRIM: Any = None


def _worker(rank: int, world: int, port: int, conn) -> None:
    os.environ.update(
        MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), RANK=str(rank), WORLD_SIZE=str(world), LOCAL_RANK=str(rank)
    )
    # These are gloo/CPU tests: on a GPU machine, hide the GPUs so that
    # FSDP2's default mesh stays on CPU instead of wanting one GPU per rank.
    if os.environ.get("SHARDCKPT_TEST_CUDA") != "1":
        os.environ["CUDA_VISIBLE_DEVICES"] = ""
    import torch
    import torch.distributed as dist

    torch.set_num_threads(1)
    dist.init_process_group("gloo", rank=rank, world_size=world, timeout=timedelta(seconds=PG_TIMEOUT_S))
    while True:
        try:
            msg = conn.recv()
        except EOFError:
            break
        if msg is None:
            break
        fn, args = pickle.loads(msg)
        try:
            out = fn(rank, world, *args)
            reply = (True, pickle.dumps(out))
        except BaseException as e:  # noqa: BLE001 - report everything to the parent
            reply = (False, f"{type(e).__name__}: {e}\n{traceback.format_exc()}")
        del fn, args
        out = None
        give_back_freed_memory()
        conn.send(reply)
    try:
        dist.destroy_process_group()
    except Exception:
        pass


def process_context():
    """Rank (and fault-test child) processes forked from one server process that imported torch once.

    A spawned rank spends ~2 s of CPU importing torch: at 16 ranks on a 2-core
    box that was most of a test. The fork server is a fresh interpreter that
    only imported torch (no process group, no thread pool ran in it), so a
    fork of it is as clean as a spawn. ``SHARDCKPT_TEST_SPAWN=1`` spawns.
    """
    global _FORKSERVER_USED
    if os.environ.get("SHARDCKPT_TEST_SPAWN") == "1" or "forkserver" not in mp.get_all_start_methods():
        return mp.get_context("spawn")
    _FORKSERVER_USED = time.monotonic()
    ctx = mp.get_context("forkserver")
    ctx.set_forkserver_preload(list(FORKSERVER_PRELOAD))
    return ctx


#: What the rank fork server imports once for every process it forks: torch
#: and the modules nearly every rank and fault child imports next (FSDP2,
#: DTensor, DCP: ~0.8 s of CPU each time otherwise; a child's start with its
#: imports took 1.8 s instead of 12 s at a load average of 30, 2026-12-06).
#: Never shardckpt: its knobs read the environment at import, and fault
#: children get theirs after the fork (tests/_faultkids.py).
FORKSERVER_PRELOAD = ("torch", "torch.distributed", "torch.distributed.fsdp", "torch.distributed.tensor",
                      "torch.distributed.checkpoint", "_dist")


#: When ``process_context`` last handed out the fork server (0: never).
_FORKSERVER_USED = 0.0
#: The rank fork server (0.26 GB: torch and the preloads) stops once no pool
#: and no child of it has been alive for this long (``stop_idle_forkserver``);
#: the next use starts a new one (~3 s of CPU). Kept to the end, the two test
#: processes' servers were 0.5 GB of a run's peak (issue 47).
FORKSERVER_IDLE_S = 60.0


def trace(what: str, detail: str = "-") -> None:
    """Append ``<time> <pid> <what> <detail>`` to this test process's log under ``$SHARDCKPT_SUITE_TRACE``, if set.

    benchmarks/suite_memory.py sets it: tests/conftest.py logs each test's
    start and end, this module each pool started and each fork server stopped.
    """
    folder = os.environ.get("SHARDCKPT_SUITE_TRACE")
    if folder:
        name = os.environ.get("PYTEST_XDIST_WORKER", "main")
        with open(os.path.join(folder, f"{name}.log"), "a") as f:
            f.write(f"{time.time():.2f} {os.getpid()} {what} {detail}\n")


class _Pool:
    def __init__(self, world: int):
        trace("pool-start", f"world={world}")
        ctx = process_context()
        port = free_port()
        self.world = world
        self.last_used = time.monotonic()
        self.test = _TEST  # the test that last used it (``close_pools_of_other_tests``)
        self.conns = []
        self.procs = []
        for r in range(world):
            parent, child = ctx.Pipe()
            p = ctx.Process(target=_worker, args=(r, world, port, child), daemon=True)
            p.start()
            self.conns.append(parent)
            self.procs.append(p)

    def run(self, fn, args, timeout: float) -> List[Any]:
        self.last_used = time.monotonic()
        self.test = _TEST
        msg = pickle.dumps((fn, args))
        for c in self.conns:
            c.send(msg)
        results: Dict[int, Any] = {}
        errors = []
        for r, c in enumerate(self.conns):
            # Once a rank failed, its peers may sit in a collective until the
            # group times out; give them a short grace, then give up on them.
            if not c.poll(5 if errors else timeout):
                if errors:
                    errors.append((r, "(still running when the other ranks failed; killed)"))
                    continue
                raise TimeoutError(f"rank {r} did not finish within {timeout}s")
            ok, out = c.recv()
            if ok:
                results[r] = pickle.loads(out)
            else:
                errors.append((r, out))
        if errors:
            raise RuntimeError("\n".join(f"--- rank {r} failed:\n{m}" for r, m in errors))
        return [results[r] for r in range(self.world)]

    def close(self, kill: bool = False) -> None:
        for c in self.conns:
            try:
                if not kill:
                    c.send(None)
                c.close()
            except Exception:
                pass
        for p in self.procs:
            if kill:
                p.kill()
            p.join(timeout=5)
            if p.is_alive():
                p.kill()


_POOLS: Dict[int, _Pool] = {}
#: A pool unused for this long is closed at the next call or the next test's
#: start (``close_idle_pools``): its ranks hold a few hundred MB each; a suite
#: run's test files use one or two world sizes at a time, and kept to the end,
#: every size's pool added up (issue 47).
POOL_IDLE_S = 30.0
#: The test running now, as counted by ``test_started`` (tests/conftest.py).
_TEST = 0
#: Rank processes kept in pools at once, the pool being started included: the
#: least recently used pools of other world sizes close first. Each rank holds
#: 0.3-0.45 GB of RSS; a 16-rank pool started while the 8-rank one of the test
#: before it was still within POOL_IDLE_S made 24 of them (issue 47). With 8 a
#: worker, two workers' pools made the run's peak 8.8 GiB of summed RSS; with
#: 4, 7.2 GiB but 14.4 min instead of 10.9 (the 2- and 4-rank pools of
#: neighbouring tests closed and restarted each other); 6 keeps those two.
MAX_POOLED_RANKS = 6


def run_ranks(world: int, fn: Callable[..., Any], *args: Any, timeout: float = 180, fresh: bool = False) -> List[Any]:
    """Run ``fn(rank, world, *args)`` on ``world`` gloo ranks; return the results by rank.

    Raises ``RuntimeError`` with every failing rank's traceback (or
    ``TimeoutError``). ``fresh=True`` uses new processes, e.g. for tests that
    kill ranks or change process-wide settings.
    """
    fresh = fresh or os.environ.get("SHARDCKPT_TEST_FRESH") == "1"
    close_idle_pools()
    pool = None if fresh else _POOLS.get(world)
    if pool is None:
        # Room for the new pool's ranks: the least recently used others go first.
        for w in sorted((w for w in _POOLS if w != world), key=lambda w: _POOLS[w].last_used):
            if sum(_POOLS) + world <= MAX_POOLED_RANKS:
                break
            _POOLS.pop(w).close()
        pool = _Pool(world)
        if not fresh:
            _POOLS[world] = pool
    try:
        return pool.run(fn, args, timeout)
    except BaseException:
        _POOLS.pop(world, None)
        pool.close(kill=True)
        raise
    finally:
        pool.last_used = time.monotonic()
        if fresh:
            pool.close()


def close_idle_pools() -> None:
    """Close the pools unused for ``POOL_IDLE_S``, of any world size."""
    now = time.monotonic()
    for w, pool in list(_POOLS.items()):
        if now - pool.last_used > POOL_IDLE_S:
            _POOLS.pop(w).close()


def close_pools_of_other_tests() -> None:
    """Close the pools no call of the running test used: another harness is about to start processes.

    tests/_faultkids.py and tests/_zygote.py call it before they start
    theirs: a pool the test before left (2-3 ranks, 0.4-0.55 GB each) sat
    idle beside a fault test's eight children or a launched script's ranks,
    1.8 GB of one test process's 4.3 GB at a suite run's peak (issue 47).
    """
    for w, pool in list(_POOLS.items()):
        if pool.test != _TEST:
            _POOLS.pop(w).close()


def stop_idle_forkserver() -> bool:
    """Stop the rank fork server once nothing it forked is alive and it went unused for ``FORKSERVER_IDLE_S``.

    Returns whether it stopped one. Never while a pool or a child of this
    process lives: a forkserver child's exit code travels through the server.
    """
    from multiprocessing import forkserver

    server = getattr(forkserver, "_forkserver", None)
    if server is None or getattr(server, "_forkserver_pid", None) is None or not hasattr(server, "_stop"):
        return False
    if _POOLS or mp.active_children() or time.monotonic() - _FORKSERVER_USED < FORKSERVER_IDLE_S:
        return False
    server._stop()
    trace("forkserver-stop")
    return True


def on_test_start(*, uses_pools: bool = True) -> None:
    """At each test's start (tests/conftest.py): count it, close the pools it will not use, stop an idle fork server.

    ``uses_pools=False`` (its file never calls ``run_ranks``) closes every
    pool: they would sit idle through the test, beside whatever processes it
    starts (a torchrun, a launched script's ranks: issue 47).
    """
    global _TEST
    _TEST += 1
    if uses_pools:
        close_idle_pools()
    else:
        _shutdown()
    stop_idle_forkserver()


@atexit.register
def _shutdown() -> None:
    for pool in list(_POOLS.values()):
        pool.close()
    _POOLS.clear()
