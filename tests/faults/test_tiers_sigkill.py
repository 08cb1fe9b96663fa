"""SIGKILL during a flush to S3 (``CheckpointManager(s3_root, local=DIR)``), then a restart on the same node.

Two gloo ranks (separate processes) save steps 1 and 2 and wait until both
are durable on S3; then step 3 commits locally and its flush starts: rank 0
is SIGKILLed by itself right after its first file of step 3 reached S3 (a
real kill in the middle of the upload, at a known point), and the parent
kills rank 1. Then: S3 lists only steps 1 and 2 as committed (step 3's
uploaded files are there, its manifest is not), and every listed step
verifies. A restarted job restores step 3 from the local directory (newer
than anything durable), reports step 2 as durable, and flushes step 3 in the
background: it is then committed on S3 and verifies.
"""

from __future__ import annotations

import json
import os
import signal

import pytest
from _dist import free_port
from _faultkids import finish, result, start
from _moto import s3_endpoint, s3_url  # noqa: F401  (pytest fixtures)

import shardckpt
from shardckpt._storage import Storage


def _child(phase: str, remote: str, local: str, opts: dict) -> None:
    import torch.distributed as dist
    from models import build, full_state, shard_fsdp2

    dist.init_process_group("gloo")
    rank = dist.get_rank()
    model = shard_fsdp2(build(seed=1))
    calls = []
    mgr = shardckpt.CheckpointManager(remote, local=local, keep_last=5, storage_options=opts, collective_timeout_s=60,
                                      on_durable=calls.append)
    if phase == "save":
        for step in (1, 2):
            mgr.save(step, {"model": model, "step": step})
            mgr.wait()  # durable on S3
        if rank == 0:
            import shardckpt._flush as flush

            copy = flush._copy

            def copy_then_die(src, dst, rel, src_rel, size, **kw):
                copy(src, dst, rel, src_rel, size, **kw)
                if "step-00000003" in dst.url:
                    print("KILLING", dst.url_of(rel), flush=True)
                    os.kill(os.getpid(), signal.SIGKILL)

            flush._copy = copy_then_die
        mgr.save(3, {"model": model, "step": 3})
        print("SAVED 3", flush=True)
        mgr.wait()  # rank 0 dies in here; rank 1 waits for it until the parent kills it
        print("RESULT " + json.dumps({"error": "survived"}), flush=True)
        return
    state = {"model": shard_fsdp2(build(seed=9)), "step": 0}
    got = mgr.restore(state)
    durable_after_restore = mgr.durable_step
    mgr.wait()
    same = all(v.equal(w) for (k, v), w in zip(full_state(state["model"]).items(), full_state(model).values()))
    print("RESULT " + json.dumps({"step": got, "from": mgr.restored_from, "durable_after_restore": durable_after_restore,
                                  "durable": mgr.durable_step, "remote": mgr.remote_steps(), "state_step": state["step"],
                                  "same_as_seed1": same, "on_durable": calls}), flush=True)
    mgr.close()
    dist.destroy_process_group()


def _spawn(phase, remote, local, opts, port):
    env = dict(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), WORLD_SIZE="2")
    return [start(_child, phase, remote, local, opts, env=dict(env, RANK=str(r), LOCAL_RANK=str(r))) for r in range(2)]


@pytest.mark.slow
def test_sigkill_during_flush_then_restart(tmp_path, s3_url):  # noqa: F811
    remote, opts = s3_url
    local = str(tmp_path / "local")
    r0, r1 = _spawn("save", remote, local, opts, free_port())
    try:
        rc0, out0 = finish(r0, 240, "rank 0")
    finally:
        r1.kill()
        _, out1 = finish(r1, 60, "rank 1")
    assert rc0 == -signal.SIGKILL and "KILLING" in out0, out0
    assert os.path.exists(os.path.join(local, "step-00000003", "manifest.json")), out1  # committed locally

    listed = shardckpt.CheckpointManager(remote, storage_options=opts, load_only=True).steps()
    assert listed == [1, 2], listed  # step 3 is half uploaded: never listed as committed
    half = Storage(f"{remote}/step-00000003", storage_options=opts)
    assert half.walk_files("") and not half.exists("manifest.json")
    for s in listed:
        shardckpt.verify(f"{remote}/step-{s:08d}", storage_options=opts)

    procs = _spawn("restore", remote, local, opts, free_port())
    try:
        done = [finish(p, 240, f"rank {r} of the restarted job") for r, p in enumerate(procs)]
    finally:
        for p in procs:
            p.kill()
    for rc, out in done:
        assert rc == 0, out
        res = result(out)
        assert res["step"] == 3 and res["state_step"] == 3, out
        assert res["from"].startswith(local), res  # the newest step is only local
        # Step 3 is not durable until flushed: 2 right after restore, unless the background flush of step 3
        # (started by restore, running while the state loads) already committed it.
        assert res["durable_after_restore"] in (2, 3), res
        assert res["on_durable"] == [3], res  # durable through its flush, never assumed
        assert res["durable"] == 3 and res["remote"] == [1, 2, 3], res  # caught up
        assert res["same_as_seed1"], res
    shardckpt.verify(f"{remote}/step-00000003", storage_options=opts)

