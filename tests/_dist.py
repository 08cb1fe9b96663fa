"""Run a function on N gloo ranks (separate processes) and collect the results.

Starting a process and importing torch costs seconds, so a test process keeps
one pool of rank processes (forks of a server that imported torch once) and
reuses it across tests and world sizes: a call on N ranks runs on the first N,
which join a new gloo group of N when the last call's group had another size.
A failure or time-out on any rank kills the pool (a half-finished collective
cannot be trusted) and the next call starts a fresh one; rank processes left
idle exit by themselves. ``SHARDCKPT_TEST_FRESH=1`` forces fresh processes
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
from typing import Any, Callable, Dict, List, Optional

#: Collective timeout inside the workers: a rank stuck in a collective fails
#: the test within this time instead of hanging CI.
PG_TIMEOUT_S = 60


#: Ports handed to processes that bind them seconds later (the S3 and
#: emulator servers): below the kernel's ephemeral range
#: (ip_local_port_range, 32768 up by default), so no outgoing connection of
#: this or another test process (an S3 client, a gloo link) can take one in
#: between, which happened. A rank 0 picks its store's port as it binds it (_join).
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


#: The store server this process hosts (under "server"), started the first
#: time it is rank 0 of a group and kept to its end (see ``_join``).
_HOSTED: Dict[str, Any] = {}


def _join(rank: int, world: int, port: int, gid: int, conn) -> None:
    """Leave this process's gloo group (if any), then join group ``gid`` of ``world`` ranks (none if 0).

    Rank 0 hosts the store, one server for its whole life, each group's keys
    under a prefix of its own: a process that started a second store server
    after the first was closed sometimes could not connect to it (both ranks
    timed out; torch 2.13, 2 of 12 forks of 20 servers each on a loaded box).
    It answers with the port, which the test process hands to the others.
    """
    import torch.distributed as dist

    if dist.is_initialized():
        dist.destroy_process_group()
    if not world:
        return
    timeout = timedelta(seconds=PG_TIMEOUT_S)
    if rank == 0:
        taken = 0
        while "server" not in _HOSTED:
            try:
                _HOSTED["server"] = dist.TCPStore(
                    "127.0.0.1", free_port(), None, is_master=True, timeout=timeout, wait_for_workers=False
                )
            except Exception as e:  # taken in between (EADDRINUSE): another one
                taken += 1
                if "in use" not in str(e) or taken == 5:
                    raise
        base = _HOSTED["server"]
        port = base.port
        conn.send((True, port))
    else:
        base = dist.TCPStore("127.0.0.1", port, None, is_master=False, timeout=timeout)
    os.environ.update(
        MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), RANK=str(rank), WORLD_SIZE=str(world), LOCAL_RANK=str(rank)
    )
    store = dist.PrefixStore(f"shardckpt-test-group-{gid}", base)
    dist.init_process_group("gloo", store=store, rank=rank, world_size=world, timeout=timeout)


def _worker(rank: int, conn, idle_exit_s: float) -> None:
    # These are gloo/CPU tests: on a GPU machine, hide the GPUs so that
    # FSDP2's default mesh stays on CPU instead of wanting one GPU per rank.
    if os.environ.get("SHARDCKPT_TEST_CUDA") != "1":
        os.environ["CUDA_VISIBLE_DEVICES"] = ""
    import torch
    import torch.distributed as dist

    torch.set_num_threads(1)
    while True:
        # Idle that long: the tests that used this process are over (the
        # test process never sends to one idle for more than half of it).
        if not conn.poll(idle_exit_s):
            break
        try:
            msg = conn.recv()
        except EOFError:
            break
        if msg is None:
            break
        kind, payload = msg
        try:
            if kind == "join":
                _join(rank, *payload, conn)
                conn.send((True, None))
                continue
            fn, args = pickle.loads(payload)
            out = fn(rank, int(os.environ["WORLD_SIZE"]), *args)
            conn.send((True, pickle.dumps(out)))
        except BaseException as e:  # noqa: BLE001 - report everything to the parent
            conn.send((False, f"{type(e).__name__}: {e}\n{traceback.format_exc()}"))
    try:
        dist.destroy_process_group()
    except Exception:
        pass


def process_context():
    """Rank (and fault-test child) processes forked from one server process that imported torch once.

    A spawned rank spends ~2 s of CPU importing torch: at 16 ranks on a 2-core
    box that was most of a test. The fork server is a fresh interpreter that
    only imported torch and its distributed modules (``FORKSERVER_PRELOAD``;
    no process group, no thread pool ran in it), so a fork of it is as clean
    as a spawn. ``SHARDCKPT_TEST_SPAWN=1`` spawns.
    """
    if os.environ.get("SHARDCKPT_TEST_SPAWN") == "1" or "forkserver" not in mp.get_all_start_methods():
        return mp.get_context("spawn")
    ctx = mp.get_context("forkserver")
    ctx.set_forkserver_preload(list(FORKSERVER_PRELOAD))
    return ctx


#: What the rank fork server imports once for every process it forks: torch
#: and the modules nearly every rank and fault child imports next (FSDP2, DTensor,
#: DCP: ~0.8 s of CPU each time otherwise; a child's start with its imports
#: took 1.8 s instead of 12 s at a load average of 30, 2026-12-06). Never
#: shardckpt: its knobs read the environment at import, and fault children
#: get theirs after the fork (tests/_faultkids.py).
FORKSERVER_PRELOAD = ("torch", "torch.distributed", "torch.distributed.fsdp", "torch.distributed.tensor",
                      "torch.distributed.checkpoint", "_dist")


#: Rank processes kept between calls: a call on more ranks starts the extra
#: ones, closed at the next call on fewer. Each holds 0.3-0.45 GB of RSS
#: (torch, what the tests imported); with a pool per world size, capped at 6
#: ranks a test process, the run's peak was 8.6 GiB of summed RSS, and at 4
#: it took 14.4 min instead of 11.6 (the 2- and 4-rank pools of neighbouring
#: tests closed and restarted each other): issue 47. One pool whose first
#: ranks regroup keeps both sizes in 4 processes.
MAX_POOLED_RANKS = 4
#: A rank process holding more RSS than this is closed when a test of another
#: module calls (a new one takes its place): what every test file before
#: imported stays in it (transformers, torchao, bitsandbytes...: 0.72 GB
#: after five minutes, where a rank of FSDP2 tests holds ~0.3 GB).
RANK_RSS_LIMIT = 512 << 20
#: A rank process with no call for this long exits by itself (the test
#: process is running tests of another kind); the next call starts new ones.
RANK_IDLE_EXIT_S = 60.0


class _Pool:
    """Rank processes reused across tests and world sizes: a call on ``w`` ranks runs on the first ``w``.

    They join a gloo group of ``w`` when the last call's group was of another
    size (a new group on a new port; the others leave theirs), which costs
    milliseconds, where a pool per world size kept the processes of every
    size alive or restarted them (issue 47).
    """

    def __init__(self, idle_exit_s: Optional[float] = None):
        self.idle_exit_s = RANK_IDLE_EXIT_S if idle_exit_s is None else idle_exit_s
        self.procs: List[Any] = []
        self.conns: List[Any] = []
        self.sent: List[float] = []  # when each process last answered (its idle clock starts then) or was sent a message
        self.world = 0  # the size of the group procs[:world] are in (0: none)
        self.module = ""  # the module of the last call's function (the test file, near enough)
        self.groups = 0  # groups made: each one's number prefixes its keys in rank 0's store
        self.last_used = time.monotonic()

    def usable(self) -> bool:
        """Every process alive once those idle for half ``idle_exit_s`` (maybe exiting on their own) are closed.

        Every call reaches the first ranks, so the idle ones are the last.
        """
        now = time.monotonic()
        for i, t in enumerate(self.sent):
            if now - t >= self.idle_exit_s / 2:
                self.trim(i)
                break
        return all(p.is_alive() for p in self.procs)

    def retire_heavy(self, limit: int) -> None:
        """Close the processes holding more than ``limit`` bytes of RSS (Linux; elsewhere none)."""
        heavy = [r for r, p in enumerate(self.procs) if _rss(p.pid) > limit]
        if not heavy:
            return
        gone = _Pool(self.idle_exit_s)
        for r in reversed(heavy):
            gone.procs.append(self.procs.pop(r))
            gone.conns.append(self.conns.pop(r))
            del self.sent[r]
        self.world = 0  # the group lost members: the next call makes a new one
        gone.close()

    def _send(self, r: int, msg: Any) -> None:
        self.sent[r] = time.monotonic()
        self.conns[r].send(msg)

    def _start(self, n: int) -> None:
        ctx = process_context()
        while len(self.procs) < n:
            parent, child = ctx.Pipe()
            p = ctx.Process(target=_worker, args=(len(self.procs), child, self.idle_exit_s), daemon=True)
            p.start()
            child.close()
            self.conns.append(parent)
            self.procs.append(p)
            self.sent.append(time.monotonic())

    def _join(self, world: int, timeout: float) -> None:
        """procs[:world] in a new gloo group of ``world``; the others in none."""
        self.world = 0
        self.groups += 1
        self._send(0, ("join", (world, 0, self.groups)))  # rank 0 first: it answers with its store's port
        if not self.conns[0].poll(timeout):
            raise TimeoutError(f"rank 0 did not start a group of {world} within {timeout}s")
        ok, port = self.conns[0].recv()
        if not ok:
            raise RuntimeError(f"--- rank 0 failed to start a group of {world}:\n{port}")
        for r in range(1, len(self.conns)):
            self._send(r, ("join", (world, port, self.groups) if r < world else (0, 0, 0)))
        errors = []
        for r, c in enumerate(self.conns):
            if not c.poll(timeout):
                raise TimeoutError(f"rank {r} did not join a gloo group of {world} (port {port}) within {timeout}s")
            ok, out = c.recv()
            self.sent[r] = time.monotonic()  # its idle clock starts after its answer
            if not ok:
                errors.append((r, out))
        if errors:
            raise RuntimeError("\n".join(f"--- rank {r} failed to join a group of {world}:\n{m}" for r, m in errors))
        self.world = world

    def run(self, world: int, fn, args, timeout: float) -> List[Any]:
        self.last_used = time.monotonic()
        self._start(world)
        if self.world != world:
            self._join(world, min(timeout, PG_TIMEOUT_S + 30))
        msg = ("run", pickle.dumps((fn, args)))
        conns = self.conns[:world]
        for r in range(world):
            self._send(r, msg)
        results: Dict[int, Any] = {}
        errors = []
        for r, c in enumerate(conns):
            # Once a rank failed, its peers may sit in a collective until the
            # group times out; give them a short grace, then give up on them.
            if not c.poll(5 if errors else timeout):
                if errors:
                    errors.append((r, "(still running when the other ranks failed; killed)"))
                    continue
                raise TimeoutError(f"rank {r} did not finish within {timeout}s")
            ok, out = c.recv()
            self.sent[r] = time.monotonic()
            if ok:
                results[r] = pickle.loads(out)
            else:
                errors.append((r, out))
        if errors:
            raise RuntimeError("\n".join(f"--- rank {r} failed:\n{m}" for r, m in errors))
        return [results[r] for r in range(world)]

    def trim(self, keep: int) -> None:
        """Close the processes past the first ``keep`` (not in the group then)."""
        if len(self.procs) <= keep:
            return
        extra = _Pool(self.idle_exit_s)
        extra.procs, extra.conns = self.procs[keep:], self.conns[keep:]
        del self.procs[keep:], self.conns[keep:], self.sent[keep:]
        if self.world > keep:
            self.world = 0  # its group lost members: the next call makes a new one
        extra.close()

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
        self.procs, self.conns, self.sent, self.world = [], [], [], 0


#: This test process's rank processes (see ``_Pool``), under "pool" once started.
_POOL: Dict[str, _Pool] = {}


def run_ranks(world: int, fn: Callable[..., Any], *args: Any, timeout: float = 180, fresh: bool = False) -> List[Any]:
    """Run ``fn(rank, world, *args)`` on ``world`` gloo ranks; return the results by rank.

    Raises ``RuntimeError`` with every failing rank's traceback (or
    ``TimeoutError``). ``fresh=True`` uses new processes, e.g. for tests that
    kill ranks or change process-wide settings.
    """
    fresh = fresh or os.environ.get("SHARDCKPT_TEST_FRESH") == "1"
    if fresh:
        pool = _Pool()
        try:
            return pool.run(world, fn, args, timeout)
        except BaseException:
            pool.close(kill=True)
            raise
        finally:
            pool.close()
    pool = _POOL.get("pool")
    if pool is not None and not pool.usable():
        _POOL.pop("pool").close(kill=True)
        pool = None
    if pool is None:
        pool = _POOL["pool"] = _Pool()
    pool.trim(max(world, MAX_POOLED_RANKS))
    module = getattr(fn, "__module__", "") or ""
    if module != pool.module:
        pool.retire_heavy(RANK_RSS_LIMIT)
        pool.module = module
    try:
        return pool.run(world, fn, args, timeout)
    except BaseException:
        # A half-finished collective cannot be trusted: the next call starts afresh.
        _POOL.pop("pool", None)
        pool.close(kill=True)
        raise
    finally:
        pool.last_used = time.monotonic()


def _rss(pid: int) -> int:
    """Resident bytes of process ``pid`` (0 where ``/proc`` cannot tell)."""
    try:
        with open(f"/proc/{pid}/statm") as f:
            return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")
    except (OSError, IndexError, ValueError):
        return 0


@atexit.register
def _shutdown() -> None:
    for pool in list(_POOL.values()):
        pool.close()
    _POOL.clear()
