"""The memory tier keeps its promises (issue 42, cases 3, 4, 6, 7), played by real processes.

* ``replicas=`` of the manager reaches ``save_to_memory``: a one-bit
  divergence across two gloo ranks is refused under ``"check"`` (nothing
  held, the next run restores nothing from memory) and logged under
  ``"warn"``, as ``save`` does.
* A shared-memory filesystem that fills between the tier's free-space check
  and its copy (another tenant: DataLoader workers, another job) is an
  exception that turns the tier off with one warning; storage saves go on.
  A child process on a small tmpfs (8 MiB, mounted for the test) plays it:
  the "tenant" fills the tmpfs right after the tier measured its free space.
  Before the fix the copy into the mapped slot died of SIGBUS (exit -7).
  With two ranks as two nodes, only node 1's tmpfs fills: both ranks turn
  the tier off at the same step (before the fix rank 1 died, rank 0 hung).
  A node whose directory is full when the background part writes the
  manifest there fails the step on every rank at once, with that cause
  (before, rank 0 waited in the peer copy until the collective time-out).
* The step in flight at a normal end of the script, or at an uncaught
  exception right after ``save_to_memory``, is held: two ranks launched as
  ``python script`` (forks of the test fork server, tests/_zygote.py) raise,
  then (resumed) end; each next launch restores that step from memory. Before the fix the
  at-exit wait ran after ``concurrent.futures`` had shut its executors and
  the step's checksum tasks were refused.
* Two managers of different roots given the same ``MemoryTier(dir=)`` in
  one process: the second turns its tier off, and its ``close()`` leaves the
  first one's slots (and so its step in flight, and its next step) alone.
"""

from __future__ import annotations

import json
import logging
import os
import subprocess
import textwrap

import _zygote
import pytest
import torch
from _dist import free_port, run_ranks

import shardckpt

TESTS = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
REPO = os.path.dirname(TESTS)


class _Logs(logging.Handler):
    def __init__(self):
        super().__init__(logging.WARNING)
        self.lines = []

    def emit(self, record):
        self.lines.append(record.getMessage())


def _logged():
    h = _Logs()
    logging.getLogger("shardckpt").addHandler(h)
    return h


# --------------------------------------------------------------------------
# case 3: replicas= reaches save_to_memory


def _diverged(rank, world, base, mode):
    root, shm = f"{base}/root", f"{base}/shm"
    state = {"w": torch.full((256,), 1.5), "step": 5}
    if rank == 1:
        state["w"].view(torch.int32)[7] ^= 1  # one bit of one replica
    h = _logged()
    try:
        mgr = shardckpt.CheckpointManager(root, memory=shardckpt.MemoryTier(dir=shm), replicas=mode)
        try:
            mgr.save(5, state)
            saved = "saved"
        except shardckpt.CheckpointError as e:
            saved = type(e).__name__
        try:
            held = mgr.save_to_memory(5, state)
            mgr.wait()
            memory = "held" if held else "off"
        except shardckpt.CheckpointError as e:
            memory = type(e).__name__
        # The next run: what does restore resume from?
        again = shardckpt.CheckpointManager(root, memory=shardckpt.MemoryTier(dir=shm), replicas=mode)
        back = {"w": torch.zeros(256), "step": 0}
        got = again.restore(back)
        out = {"save": saved, "memory": memory, "restored": got, "from": again.restored_from,
               "said": [m for m in h.lines if "replicas differ" in m]}
        again.close()
        mgr.close()
        return out
    finally:
        logging.getLogger("shardckpt").removeHandler(h)


@pytest.mark.parametrize("mode", ["check", "warn"])
def test_replicas_mode_applies_to_save_to_memory(tmp_path, mode):
    out = run_ranks(2, _diverged, str(tmp_path), mode)
    if mode == "check":
        for r in out:  # refused on every rank, as save is; nothing held, nothing resumed from memory
            assert r["save"] == "ReplicaDivergenceError" and r["memory"] == "ReplicaDivergenceError", r
            assert r["restored"] is None and not (r["from"] or "").startswith("memory"), r
    else:
        for r in out:  # saved and held, with the divergence logged on rank 0 for each
            assert r["save"] == "saved" and r["memory"] == "held", r
            assert r["restored"] == 5 and r["from"] == "memory:5", r
        assert len(out[0]["said"]) == 2 and out[1]["said"] == [], out  # one line per save, rank 0


# --------------------------------------------------------------------------
# case 4: a full /dev/shm is an exception, never SIGBUS


@pytest.fixture
def small_tmpfs(tmp_path):
    mnt = tmp_path / "shm"
    mnt.mkdir()
    r = subprocess.run(["mount", "-t", "tmpfs", "-o", "size=8m,mode=0700", "tmpfs", str(mnt)], capture_output=True, text=True)
    if r.returncode != 0:
        pytest.skip(f"cannot mount an 8 MiB tmpfs (needs root with CAP_SYS_ADMIN): {(r.stderr or r.stdout).strip()}")
    try:
        yield str(mnt)
    finally:
        if subprocess.run(["umount", str(mnt)], capture_output=True).returncode != 0:
            subprocess.run(["umount", "-l", str(mnt)], capture_output=True)


_FULL_SHM = textwrap.dedent(
    """
    import json, logging, os, sys
    import torch
    import shardckpt
    from shardckpt._memory import store

    mnt, root = sys.argv[1], sys.argv[2]
    said = []
    class H(logging.Handler):
        def emit(self, record):
            said.append(record.getMessage())
    logging.getLogger("shardckpt").addHandler(H(logging.WARNING))

    measured = store.free_bytes
    def then_filled(path):
        free = measured(path)
        # Another tenant of the tmpfs takes all of it right after the tier looked.
        fd = os.open(os.path.join(mnt, "tenant.bin"), os.O_WRONLY | os.O_CREAT, 0o600)
        try:
            while True:
                os.write(fd, bytes(1 << 16))
        except OSError:
            pass
        finally:
            os.close(fd)
        return free
    store.free_bytes = then_filled

    mgr = shardckpt.CheckpointManager(root, memory=shardckpt.MemoryTier(dir=os.path.join(mnt, "tier")))
    state = {"w": torch.arange(512 * 1024, dtype=torch.float32)}  # 2 MiB: two steps fit the 8 MiB tmpfs
    kept = [mgr.save_to_memory(1, state)]
    mgr.save(1, state)  # storage saves go on
    kept.append(mgr.save_to_memory(2, state))
    back = {"w": torch.zeros(512 * 1024)}
    got = shardckpt.CheckpointManager(root).restore(back)
    print(json.dumps({"kept": kept, "restored": got, "same": torch.equal(back["w"], state["w"]),
                      "off": [m for m in said if "memory tier off" in m]}))
    mgr.close()
    """
)


def test_full_shm_after_the_check_turns_the_tier_off_not_sigbus(small_tmpfs, tmp_path):
    env = dict(os.environ, CUDA_VISIBLE_DEVICES="", OMP_NUM_THREADS="1")
    code, out, err = _zygote.run(["-c", _FULL_SHM, small_tmpfs, str(tmp_path / "root")], cwd=REPO, env=env, timeout=120)
    assert code == 0, f"exit {code} (-7: SIGBUS)\n{out}\n{err[-3000:]}"
    res = json.loads(out.strip().splitlines()[-1])
    assert res["kept"] == [False, False] and res["restored"] == 1 and res["same"], res
    (off,) = res["off"]  # one warning, naming the directory and the cause
    assert "No space left on device" in off and os.path.join(small_tmpfs, "tier") in off, off


def _one_node_fills(rank, world, base, mnt):
    """Two ranks as two nodes: node 1's directory is on the small tmpfs, which another tenant fills after the check."""
    from shardckpt._memory import store

    measured = store.free_bytes

    def then_filled(path):
        free = measured(path)
        fd = os.open(os.path.join(mnt, "tenant.bin"), os.O_WRONLY | os.O_CREAT, 0o600)
        try:
            while True:
                os.write(fd, bytes(1 << 16))
        except OSError:
            pass
        finally:
            os.close(fd)
        return free

    if rank == 1:
        store.free_bytes = then_filled
    h = _logged()
    try:
        tier = shardckpt.MemoryTier(dir=f"{base}/node0" if rank == 0 else f"{mnt}/node1", ranks_per_node=1)
        mgr = shardckpt.CheckpointManager(f"{base}/root", memory=tier)
        state = {"w": torch.arange(256 * 1024, dtype=torch.float32) + rank, "step": 1}  # 1 MiB per rank
        kept = [mgr.save_to_memory(1, state)]
        mgr.save(1, state)  # storage saves go on, on every rank
        kept.append(mgr.save_to_memory(2, state))
        back = {"w": torch.zeros(256 * 1024), "step": 0}
        got = shardckpt.CheckpointManager(f"{base}/root").restore(back)
        out = {"kept": kept, "got": got, "off": [m for m in h.lines if "memory tier off" in m]}
        mgr.close()
        return out
    finally:
        store.free_bytes = measured
        logging.getLogger("shardckpt").removeHandler(h)


def test_one_node_full_turns_the_tier_off_on_every_rank(small_tmpfs, tmp_path):
    out = run_ranks(2, _one_node_fills, str(tmp_path), small_tmpfs)
    for r in out:
        assert r["kept"] == [False, False] and r["got"] == 1, r
        (off,) = r["off"]  # every rank turns off at the same step, with one warning naming the rank and the cause
        assert "rank 1" in off and "No space left on device" in off, off


def _manifest_write_fails(rank, world, base):
    """Two ranks as two nodes; node 1's tmpfs is full when the manifest is written there (after the slots were reserved)."""
    from shardckpt._storage import Storage

    node_dir = f"{base}/node{rank}"
    kind = type(Storage(base))
    real, own = kind.write_atomic, "write_atomic" in kind.__dict__

    def full(self, rel, data, *a, **kw):
        if rank == 1 and rel == "manifest.json" and self.path(rel).startswith(node_dir):
            raise OSError(28, "No space left on device")
        return real(self, rel, data, *a, **kw)

    tier = shardckpt.MemoryTier(dir=node_dir, ranks_per_node=1)
    mgr = shardckpt.CheckpointManager(f"{base}/root", memory=tier, collective_timeout_s=60)
    state = {"w": torch.arange(4096, dtype=torch.float32) + rank, "step": 1}
    kind.write_atomic = full
    try:
        assert mgr.save_to_memory(1, state)
        try:
            mgr.wait()
            said = None
        except shardckpt.CheckpointError as e:
            said = f"{type(e).__name__}: {e}"
    finally:
        if own:
            kind.write_atomic = real
        else:
            del kind.write_atomic
    assert mgr.save_to_memory(2, state)  # room again: the tier goes on
    mgr.wait()
    mgr.close()
    return said


def test_a_full_node_in_the_background_fails_every_rank_at_once(tmp_path):
    said = run_ranks(2, _manifest_write_fails, str(tmp_path))
    for s in said:  # the same cause on every rank, not a peer that waited for rank 1 until its time-out
        assert s and s.startswith("SaveFailedError") and "step 1 was not kept" in s, said
        assert "rank 1" in s and "No space left on device" in s, said


# --------------------------------------------------------------------------
# case 6: the step in flight at exit is held


_EXIT = textwrap.dedent(
    """
    import json, os, sys
    import torch
    import torch.distributed as dist
    import shardckpt

    root, shm, how = sys.argv[1], sys.argv[2], sys.argv[3]
    dist.init_process_group("gloo")
    mgr = shardckpt.CheckpointManager(root, memory=shardckpt.MemoryTier(dir=shm))

    def state(v):
        # Many small tensors: the background checksums of a step are many tasks.
        return {f"t{i}": torch.full((1024,), float(v + i)) for i in range(64)} | {"step": v}

    back = state(0)
    got = mgr.restore(back)  # what the previous launch left
    print(json.dumps({"got": got, "from": mgr.restored_from, "step": back["step"],
                      "same": all(torch.equal(back[k], v) for k, v in state(got or 0).items() if k != "step")}), flush=True)
    if how == "stop":
        mgr.close()
        sys.exit(0)
    assert mgr.save_to_memory((got or 0) + 1, state((got or 0) + 1))
    mgr.wait()  # held
    assert mgr.save_to_memory((got or 0) + 2, state((got or 0) + 2))
    if how == "raise":
        raise RuntimeError("training failed right after save_to_memory")
    # how == "end": the script ends with the step in flight
    """
)


def _launch(tmp_path, how):
    port = free_port()
    envs = [dict(os.environ, RANK=str(r), WORLD_SIZE="2", LOCAL_RANK=str(r), LOCAL_WORLD_SIZE="2", MASTER_ADDR="127.0.0.1",
                 MASTER_PORT=str(port), CUDA_VISIBLE_DEVICES="", OMP_NUM_THREADS="1") for r in range(2)]
    codes, outs = _zygote.run_many(["-c", _EXIT, str(tmp_path / "root"), str(tmp_path / "shm"), how], envs, cwd=REPO,
                                   job_vars=("RANK", "LOCAL_RANK", "MASTER_PORT"), timeout=180)
    assert codes == ([1, 1] if how == "raise" else [0, 0]), (how, codes, outs)
    if how == "raise":
        assert all("training failed right after save_to_memory" in o for o in outs), outs
    assert not any("was not kept in memory" in o for o in outs), outs
    return [json.loads(next(line for line in o.splitlines() if line.startswith('{"got"'))) for o in outs]


def test_step_in_flight_at_exit_is_held(tmp_path):
    """Launch 1 raises with step 2 in flight; launch 2 resumes from it and ends with step 4 in flight; launch 3 resumes from 4."""
    assert _launch(tmp_path, "raise") == [{"got": None, "from": None, "step": 0, "same": True}] * 2
    assert _launch(tmp_path, "end") == [{"got": 2, "from": "memory:2", "step": 2, "same": True}] * 2
    assert _launch(tmp_path, "stop") == [{"got": 4, "from": "memory:4", "step": 4, "same": True}] * 2


# --------------------------------------------------------------------------
# case 7: two roots, one MemoryTier(dir=), one process


def _two_roots(rank, world, base):
    shm = f"{base}/shm"
    h = _logged()
    try:
        a = shardckpt.CheckpointManager(f"{base}/runA", memory=shardckpt.MemoryTier(dir=shm))
        sa = {"w": torch.full((64 * 1024,), 1.0)}
        assert a.save_to_memory(1, sa)
        a.wait()
        sa["w"].fill_(2.0)
        assert a.save_to_memory(2, sa)  # in flight while run B comes and goes; both of A's slots are made
        b = shardckpt.CheckpointManager(f"{base}/runB", memory=shardckpt.MemoryTier(dir=shm))
        b_kept = b.save_to_memory(1, {"w": torch.full((64 * 1024,), 9.0)})
        b.close()
        a.wait()  # A's step in flight was held
        for step in (3, 4):  # A's slots are still A's: each is reused once
            sa["w"].fill_(float(step))
            assert a.save_to_memory(step, sa)
            a.wait()
        again = shardckpt.CheckpointManager(f"{base}/runA", memory=shardckpt.MemoryTier(dir=shm))
        back = {"w": torch.zeros(64 * 1024)}
        got = again.restore(back)
        out = {"b_kept": b_kept, "got": got, "from": again.restored_from, "w": float(back["w"][0]),
               "off": [m for m in h.lines if "memory tier off" in m]}
        again.close()
        a.close()
        return out
    finally:
        logging.getLogger("shardckpt").removeHandler(h)


def test_another_roots_close_never_removes_this_roots_slots(tmp_path):
    out = run_ranks(2, _two_roots, str(tmp_path))
    for r in out:
        assert r["b_kept"] is False and r["got"] == 4 and r["from"] == "memory:4" and r["w"] == 4.0, r
    assert len(out[0]["off"]) == 1 and "runA" in out[0]["off"][0], out[0]
