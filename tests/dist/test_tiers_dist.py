"""Local first, then remote (``CheckpointManager(s3_root, local=DIR)``) on 2 gloo ranks with FSDP2 and a real S3 server on loopback.

Every save commits under the local directory; the background flusher copies
each step to S3 and commits it there (manifest last). A remote that stalls
does not block ``save()``; a new node (no local directory) restores from S3.
The SIGKILL-during-upload case is tests/faults/test_tiers_sigkill.py.
"""

from __future__ import annotations

import shutil
import threading
import time

import pytest
import torch
from _dist import run_ranks
from _faultproxy import FaultProxy
from _moto import s3_endpoint, s3_url  # noqa: F401  (pytest fixtures)
from models import build, full_state, shard_fsdp2

import shardckpt

IDX = torch.tensor([[1, 5, 36, 0], [7, 7, 2, 30]])


def _bump(model, by: float) -> None:
    with torch.no_grad():
        for p in model.parameters():
            p.add_(by)


def _save_run(rank, world, remote, local, opts, steps, async_save):
    """Save ``steps`` with local=; return local/remote steps, durable step, on_durable calls, the snapshots."""
    model = shard_fsdp2(build(seed=1))
    durable = []
    mgr = shardckpt.CheckpointManager(remote, local=local, keep_last=2, keep_every=4, keep_local=2, storage_options=opts,
                                      async_save=async_save, on_durable=durable.append, collective_timeout_s=60)
    snaps = {}
    local_max = 0
    for step in steps:
        snaps[step] = full_state(model)
        mgr.save(step, {"model": model, "step": step})
        local_max = max(local_max, len(mgr.steps()))
        _bump(model, 1.0)
    mgr.wait()
    out = {"local": mgr.steps(), "remote": mgr.remote_steps(), "durable": mgr.durable_step, "calls": durable,
           "local_max": local_max, "snaps": {s: snaps[s] for s in (steps[-1],)}, "root_url": mgr.root_url,
           "remote_url": mgr.remote_url}
    mgr.close()
    return out


def _restore_run(rank, world, remote, local, opts):
    fresh = shard_fsdp2(build(seed=9))
    fresh(IDX).sum().backward()
    state = {"model": fresh, "step": 0}
    mgr = shardckpt.CheckpointManager(remote, local=local, keep_last=2, storage_options=opts, collective_timeout_s=60)
    got = mgr.restore(state)
    out = {"step": got, "state_step": state["step"], "from": mgr.restored_from, "durable": mgr.durable_step,
           "full": full_state(fresh)}
    mgr.close()
    return out


@pytest.mark.parametrize("async_save", [False, True], ids=["sync", "async"])
def test_local_first_then_s3(tmp_path, s3_url, async_save):  # noqa: F811
    remote, opts = s3_url
    local = str(tmp_path / "local")
    res = run_ranks(2, _save_run, remote, local, opts, list(range(1, 8)), async_save)
    for r, out in enumerate(res):
        # keep_local=2, plus the steps in flight or pending at the last save's retention (at most 2 more).
        assert out["local"][-2:] == [6, 7] and len(out["local"]) <= 4, (r, out)
        assert out["local_max"] <= 2 + 2, (r, out)
        assert out["durable"] == 7, (r, out)
        assert out["calls"] and out["calls"][-1] == 7 and out["calls"] == sorted(out["calls"]), (r, out)
        assert out["remote_url"] == remote and out["root_url"] != remote
    # Remote retention: the newest keep_last=2 flushed steps plus flushed multiples of keep_every=4
    # (coalescing may skip steps: only those flushed are candidates).
    remote_steps, calls = res[0]["remote"], res[0]["calls"]
    assert remote_steps == sorted(set(calls[-2:]) | {s for s in calls if s % 4 == 0}), (remote_steps, calls)
    assert res[1]["calls"] == calls
    listed = shardckpt.CheckpointManager(remote, storage_options=opts, load_only=True).steps()
    assert listed == remote_steps
    for s in listed:
        m = shardckpt.verify(f"{remote}/step-{s:08d}", storage_options=opts)  # every byte, every checksum
        assert m.world_size == 2 and m.extra["step"] == s
    # The local copy of step 7 is the same checkpoint, byte for byte in its manifest.
    loc = shardckpt._storage.Storage(f"{local}/step-00000007")
    rem = shardckpt._storage.Storage(f"{remote}/step-00000007", storage_options=opts)
    assert loc.read_bytes("manifest.json") == rem.read_bytes("manifest.json")

    # The same node: restore takes the local step (newest, readable by every rank).
    back = run_ranks(2, _restore_run, remote, local, opts)
    for out in back:
        assert out["step"] == 7 and out["state_step"] == 7 and out["from"].startswith(local), out
        assert out["durable"] == 7
    # A new node: the local directory is gone, restore takes the remote's newest step.
    shutil.rmtree(local)
    back = run_ranks(2, _restore_run, remote, local, opts)
    for r, out in enumerate(back):
        assert out["step"] == 7 and out["from"] == f"{remote}/step-00000007", out
        assert all(torch.equal(v, res[r]["snaps"][7][k]) for k, v in out["full"].items())


def _stalled_run(rank, world, remote, local, opts):
    model = shard_fsdp2(build(seed=1))
    mgr = shardckpt.CheckpointManager(remote, local=local, keep_last=3, storage_options=opts, collective_timeout_s=120)
    blocked = []
    for step in range(1, 5):
        t0 = time.perf_counter()
        mgr.save(step, {"model": model, "step": step})
        blocked.append(time.perf_counter() - t0)
        _bump(model, 1.0)
    durable_before = mgr.durable_step
    t0 = time.perf_counter()
    mgr.wait()  # the flusher catches up once the remote answers again
    out = {"blocked": blocked, "durable_before": durable_before, "waited": time.perf_counter() - t0,
           "durable": mgr.durable_step, "remote": mgr.remote_steps(), "local": mgr.steps(),
           "skipped": mgr._tiers.flusher.skipped}
    mgr.close()
    return out


@pytest.mark.slow
def test_stalled_remote_does_not_block_save(tmp_path, s3_url):  # noqa: F811
    remote, opts = s3_url
    upstream = opts["endpoint_url"].rsplit(":", 1)
    stall_s = 20.0
    proxy = FaultProxy(("127.0.0.1", int(upstream[1])), seed=7)
    # Every connection to S3 hangs (the request is read, never answered) until 12 s after the first one
    # did: timed from the first stall, not from now, since starting the ranks can take longer than that
    # on a loaded machine (the stall would then have healed before anyone connected).
    proxy.set_faults(stall=1.0, stall_s=stall_s)
    stop = threading.Event()

    def _heal_after_first_stall() -> None:
        while not stop.is_set() and not proxy.stats.get("stall", 0):
            stop.wait(0.05)
        if not stop.wait(12.0):
            proxy.set_faults()

    heal = threading.Thread(target=_heal_after_first_stall, daemon=True)
    heal.start()
    try:
        res = run_ranks(2, _stalled_run, remote, str(tmp_path / "local"), dict(opts, endpoint_url=proxy.endpoint),
                        timeout=240, fresh=True)
    finally:
        stop.set()
        heal.join()
        proxy.close()
    assert proxy.stats.get("stall", 0) >= 1, proxy.stats  # the remote did stall
    for r, out in enumerate(res):
        # Liveness: every save returned well before the stall could have ended (it is not waited for).
        assert max(out["blocked"]) < stall_s / 2, (r, out)
        assert out["durable_before"] is None, (r, out)  # nothing was durable while the remote hung
        assert out["durable"] == 4 and out["remote"][-1] == 4, (r, out)
    for s in res[0]["remote"]:
        shardckpt.verify(f"{remote}/step-{s:08d}", storage_options=opts)
