"""Crash safety with real processes: SIGKILL a saving process (or one rank) mid-save, fill the disk.

Each scenario runs a child process (tests/_faultkids.py, the fault tests'
one harness) that commits step 1, then arms a fault and saves step 2. The
fault is injected by patching the engine inside the child (no test hooks in
the library) and is a SIGKILL of the child itself at a precise moment:

  before_data      as the rank starts writing data files
  mid_data         after the header and one block of a data file
  before_manifest  data durable on every rank, manifest not written
  mid_manifest     temporary manifest written and fsynced, not renamed
  async_mid_data   mid_data in the background thread of an async save
  replica_check    (one rank of two) while fingerprinting its replicated
                   state, before the save's replica agreement
  stall_data       (one rank of two) the rank hangs instead of dying: its
                   peer must give up after the manager's collective timeout

Afterwards ``restore`` must return step 1 with its exact bytes, step 2 must
not be listed, and the next save must clean up what the crash left.
"""

from __future__ import annotations

import os
import signal
import subprocess
import time

import pytest
import torch
from _dist import free_port
from _faultkids import die, die_at_manifest_rename, die_mid_data_file, finish, join_group, start

SINGLE_FAULTS = ["before_data", "mid_data", "before_manifest", "mid_manifest", "async_mid_data"]
STALL_S = 20.0  # longest the stuck rank stalls in stall_data (it is released as soon as its peer gave up)
STALL_TIMEOUT_S = 4.0  # the manager's collective timeout in that case
#: Prefix of a fault run with the default collective timeout (1800 s): a dead
#: peer must still be noticed in seconds, through its stopped heartbeat.
DEFAULT_TIMEOUT = "default_timeout:"
#: How long a survivor may take to give up on a SIGKILLed peer with the
#: default timeout: the liveness timeout (10 s) plus polling and CPU
#: contention slack. Far below 1800 s, which is what it guards against.
DEAD_PEER_NOTICED_S = 60.0
#: Bound of one child: a hang fails the test instead of the suite.
CHILD_TIMEOUT_S = 180


# --------------------------------------------------------------------------
# the child (started by tests/_faultkids.py)


def _arm(fault: str, release: str = "") -> None:
    """Patch the engine so this process SIGKILLs itself at ``fault`` (``stall_data``: stalls until file ``release`` exists)."""
    from shardckpt import _save as _api
    from shardckpt import _storage

    if fault == "before_data":
        _api.write_files = lambda *a, **kw: die()
    elif fault == "replica_check":  # while fingerprinting its replicas, before the replica agreement
        from shardckpt import _fingerprint

        _fingerprint.local_fingerprints = lambda *a, **kw: die()
    elif fault == "stall_data":  # a stuck (not dead) rank: the peers must time out
        real_write_files = _api.write_files

        def stalled(*a, **kw):
            # Stuck until the test saw its peer give up (at most STALL_S): then it
            # goes on to find the peer gone. No fixed sleep to sit through.
            deadline = time.monotonic() + STALL_S
            while not os.path.exists(release) and time.monotonic() < deadline:
                time.sleep(0.05)
            return real_write_files(*a, **kw)

        _api.write_files = stalled
    elif fault in ("mid_data", "async_mid_data"):
        die_mid_data_file()
    elif fault == "before_manifest":
        real_atomic = _storage.Storage.write_atomic

        def write_atomic(self, rel, data, **kw):
            if rel == "manifest.json":
                die()
            return real_atomic(self, rel, data, **kw)

        _storage.Storage.write_atomic = write_atomic
    elif fault == "mid_manifest":
        die_at_manifest_rename()
    else:
        raise ValueError(fault)


def _single_state(step: int):
    g = torch.Generator().manual_seed(step)
    return {"w": torch.randn(64, 33, generator=g), "ids": torch.arange(100) * step, "step": step}


def _child_single(root: str, fault: str) -> None:
    import shardckpt

    mgr = shardckpt.CheckpointManager(root, keep_last=2, async_save=fault.startswith("async"))
    mgr.save(1, _single_state(1))
    mgr.wait()
    _arm(fault)
    state = _single_state(2)
    mgr.save(2, state)
    state["w"].zero_()  # training goes on while the background write runs
    mgr.wait()
    print("NOT KILLED", flush=True)
    os._exit(5)


def _child_rank(root: str, fault: str, victim: int, rank: int, world: int, port: int, release: str) -> None:
    from models import build, shard_fsdp2

    import shardckpt

    join_group(rank, world, port, 60)
    model = shard_fsdp2(build(seed=1))
    if fault.startswith(DEFAULT_TIMEOUT):  # the library's default collective timeout (1800 s)
        fault = fault[len(DEFAULT_TIMEOUT):]
        mgr = shardckpt.CheckpointManager(root, keep_last=2)
    else:
        mgr = shardckpt.CheckpointManager(root, keep_last=2, collective_timeout_s=STALL_TIMEOUT_S if fault == "stall_data" else 30)
    mgr.save(1, {"model": model, "step": 1})
    with torch.no_grad():
        for p in model.parameters():
            p.add_(1.0)
    if rank == victim:
        _arm(fault, release)
    t0 = time.perf_counter()
    try:
        mgr.save(2, {"model": model, "step": 2})
        print("SAVED", flush=True)
        os._exit(0)
    except Exception as e:  # the survivor must get here, not hang
        print(f"RAISED after {time.perf_counter() - t0:.1f}s: {type(e).__name__}: {e}", flush=True)
        os._exit(3)


# --------------------------------------------------------------------------
# the tests


def _finish(p):
    return finish(p, CHILD_TIMEOUT_S)


def _files(root: str, step_dir: str):
    top = os.path.join(root, step_dir)
    found = []
    for d, _, fs in os.walk(top):
        found += [os.path.relpath(os.path.join(d, f), top) for f in fs]
    return sorted(found)


def test_sigkill_single_process_at_each_moment(tmp_path):
    import shardckpt

    roots = {f: str(tmp_path / f) for f in SINGLE_FAULTS}
    # All children at once (forked with torch already imported).
    procs = {f: start(_child_single, roots[f], f) for f in SINGLE_FAULTS}
    results = {f: _finish(p) for f, p in procs.items()}
    for fault, (rc, out) in results.items():
        assert rc == -signal.SIGKILL, f"{fault}: exit {rc}\n{out}"
        root = roots[fault]
        left = _files(root, "step-00000002")
        assert "manifest.json" not in left, fault
        data = [f for f in left if f.startswith("data/")]
        if fault == "before_data":
            assert data == [], left
        elif fault == "mid_manifest":
            assert data and any(f.startswith(".manifest.json.") and f.endswith(".tmp") for f in left), left
        else:
            assert data, (fault, left)
        mgr = shardckpt.CheckpointManager(root, keep_last=2)
        assert mgr.steps() == [1], fault
        state = {"w": torch.zeros(64, 33), "ids": torch.zeros(100, dtype=torch.int64), "step": 0}
        assert mgr.restore(state) == 1, fault
        want = _single_state(1)
        assert torch.equal(state["w"], want["w"]) and torch.equal(state["ids"], want["ids"]) and state["step"] == 1
        shardckpt.verify(mgr.step_url(1))
        # The next successful save removes the crashed step's leftovers.
        mgr.save(3, _single_state(3))
        assert mgr.steps() == [1, 3] and not os.path.exists(os.path.join(root, "step-00000002")), fault


def _multi_rank(tmp_path, cases):
    from models import build

    import shardckpt

    runs = []
    for victim, fault in cases:
        root = str(tmp_path / f"{fault}-r{victim}")
        port = free_port()
        release = root + ".release"  # a file, not a semaphore: nothing of the test's in /dev/shm
        runs.append((victim, fault, root, release, [start(_child_rank, root, fault, victim, r, 2, port, release) for r in range(2)]))
    for victim, fault, root, release, procs in runs:
        results = [None, None]
        # The survivor first: a stalled victim is released only once its peer gave up.
        results[1 - victim] = _finish(procs[1 - victim])
        open(release, "w").close()
        results[victim] = _finish(procs[victim])
        where = f"{fault} on rank {victim}"
        rc, out = results[victim]
        if fault == "stall_data":  # wakes up to find its peer gone, and raises too
            assert rc == 3 and "SaveFailedError" in out, f"{where}: stuck rank exit {rc}\n{out}"
        else:
            assert rc == -signal.SIGKILL, f"{where}: victim exit {rc}\n{out}"
        rc, out = results[1 - victim]
        assert rc == 3 and "RAISED" in out and "SaveFailedError" in out, f"{where}: survivor exit {rc}\n{out}"
        took = float(out.split("RAISED after ", 1)[1].split("s:", 1)[0])
        if fault == "stall_data":
            assert took < STALL_S, f"{where}: the survivor waited {took}s for a stuck peer (timeout {STALL_TIMEOUT_S}s)"
        if fault.startswith(DEFAULT_TIMEOUT):
            assert took < DEAD_PEER_NOTICED_S, f"{where}: the survivor took {took}s to notice its dead peer"
            assert f"rank {victim} of 2 stopped" in out, f"{where}: the dead rank is not named\n{out}"
        assert not os.path.exists(os.path.join(root, "step-00000002", "manifest.json")), where
        mgr = shardckpt.CheckpointManager(root)
        assert mgr.steps() == [1], where
        model = build(seed=7)
        assert mgr.restore({"model": model, "step": 0}) == 1, where
        ref = build(seed=1).state_dict()
        for k, v in model.state_dict().items():
            assert torch.equal(v, ref[k]), (where, k)


def test_sigkill_one_rank_of_two(tmp_path):
    _multi_rank(tmp_path, [(1, "mid_data"), (0, "before_manifest")])


def test_sigkill_during_the_replica_check(tmp_path):
    _multi_rank(tmp_path, [(1, DEFAULT_TIMEOUT + "replica_check")])


def test_dead_rank_noticed_in_seconds_with_default_timeout(tmp_path):
    """Regression: over the c10d store a killed peer was named only after collective_timeout_s (1800 s)."""
    _multi_rank(tmp_path, [(1, DEFAULT_TIMEOUT + "mid_data")])


@pytest.mark.slow
def test_dead_store_host_noticed_in_seconds_with_default_timeout(tmp_path):
    # Rank 0 hosts the store: its death ends the peer's wait through the store itself.
    _multi_rank(tmp_path, [(0, DEFAULT_TIMEOUT + "before_manifest")])


@pytest.mark.slow
def test_sigkill_one_rank_of_two_more_moments(tmp_path):
    _multi_rank(tmp_path, [(1, "before_data"), (0, "mid_data"), (0, "mid_manifest")])
    # The stuck-rank case runs alone: its short collective timeout must not be
    # tripped by the CPU contention of six other ranks starting at once.
    _multi_rank(tmp_path, [(1, "stall_data")])


# --------------------------------------------------------------------------
# a disk that fills up


@pytest.fixture
def small_disk(tmp_path):
    mnt = tmp_path / "small"
    mnt.mkdir()
    r = subprocess.run(["mount", "-t", "tmpfs", "-o", "size=1m", "tmpfs", str(mnt)], capture_output=True, text=True)
    if r.returncode != 0:
        pytest.skip(f"cannot mount a 1 MiB tmpfs (needs root with CAP_SYS_ADMIN): {(r.stderr or r.stdout).strip()}")
    try:
        yield str(mnt)
    finally:
        if subprocess.run(["umount", str(mnt)], capture_output=True).returncode != 0:
            subprocess.run(["umount", "-l", str(mnt)], capture_output=True)


@pytest.mark.parametrize("async_save", [False, True], ids=["sync", "async"])
def test_disk_full_mid_save(small_disk, async_save):
    import shardckpt
    from shardckpt.errors import SaveFailedError

    mgr = shardckpt.CheckpointManager(small_disk + "/run", keep_last=1, async_save=async_save)
    first = {"w": torch.randn(100, 1000), "step": 1}  # 400 KB
    mgr.save(1, first)
    mgr.wait()
    with pytest.raises(SaveFailedError, match="No space left on device") as ei:
        mgr.save(2, {"w": torch.randn(200, 1000), "step": 2})  # 800 KB: does not fit beside step 1
        mgr.wait()
    assert "step-00000002" in str(ei.value)
    assert mgr.steps() == [1]
    state = {"w": torch.zeros(100, 1000), "step": 0}
    assert mgr.restore(state) == 1 and torch.equal(state["w"], first["w"])
    shardckpt.verify(mgr.step_url(1))
    # Space came back (the failed save removed its files): a save that fits works.
    mgr.save(3, {"w": torch.ones(10, 10), "step": 3})
    mgr.close()
    assert mgr.steps() == [3]
