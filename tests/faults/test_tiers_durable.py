"""Durable means loadable: ``CheckpointManager(s3_root, local=DIR)`` never calls a step durable that ``verify`` refuses.

Real processes (gloo ranks forked from the test fork server), SIGKILL where
a process dies, a real S3 server on loopback (moto) for the remote:

* a world-size shrink (issue 42, case 2): 2 ranks save incremental step 1
  and are SIGKILLed before its flush; 1 rank restores it and saves step 2,
  whose references name files rank 1 wrote. Nobody is rank 1 any more: the
  live rank that holds them uploads them, and step 2 is durable only once
  ``verify`` accepts it on the remote;
* a ``force=True`` re-save of an older step while a newer step waits for the
  remote (case 5): it is flushed too (its own queue), so the remote copy of
  the older step holds the bytes the user saved last.
"""

from __future__ import annotations

import json

import pytest
from _dist import free_port
from _faultkids import die, finish, join_group, result, start
from _moto import s3_endpoint, s3_url  # noqa: F401  (pytest fixtures)

import shardckpt
from shardckpt._storage import Storage

#: Plain (replicated) tensors: a save spreads them over the ranks, so rank 1 writes some of step 1's files.
NAMES = [f"t{i}" for i in range(6)]


def _state(value: float):
    import torch

    return {n: torch.full((64,), value + i) for i, n in enumerate(NAMES)} | {"step": 0}


def _shrink_child(phase: str, rank: int, world: int, port: int, remote: str, local: str, opts: dict) -> None:
    join_group(rank, world, port)
    import shardckpt._flush as flush

    calls = []
    mgr = shardckpt.CheckpointManager(remote, local=local, incremental=True, keep_last=3, keep_local=3,
                                      storage_options=opts, collective_timeout_s=60, on_durable=calls.append)
    if phase == "save":
        flush.upload_step = lambda *a, **k: die()  # the job dies before step 1 reaches the remote
        mgr.save(1, _state(1.0) | {"step": 1})
        print("SAVED 1", flush=True)
        mgr.wait()
        print("RESULT " + json.dumps({"error": "survived"}), flush=True)
        return
    st = _state(0.0)
    got = mgr.restore(st)
    mgr.save(2, st | {"step": 2})  # the same tensors: step 2 references step 1's files, rank 1's included
    mgr.wait()
    done = True
    print("RESULT " + json.dumps({"restored": got, "done": done, "durable": mgr.durable_step, "on_durable": calls,
                                  "remote": mgr.remote_steps()}), flush=True)
    mgr.close(flush_timeout_s=5)


def _refused_child(rank: int, world: int, port: int, remote: str, local: str, opts: dict) -> None:
    join_group(rank, world, port)
    import logging
    import threading

    import shardckpt._flush as flush

    # Per-node disks of nodes that are gone: no live rank holds the files rank 1 wrote for step 1.
    flush.held_refs = lambda local, refs: []
    said: list = []
    handler = logging.Handler(logging.WARNING)
    handler.emit = lambda rec: said.append(rec.getMessage())  # type: ignore[method-assign]
    logging.getLogger("shardckpt").addHandler(handler)
    calls: list = []
    mgr = shardckpt.CheckpointManager(remote, local=local, incremental=True, keep_last=3, keep_local=3,
                                      storage_options=opts, collective_timeout_s=60, on_durable=calls.append)
    st = _state(0.0)
    got = mgr.restore(st)
    mgr.save(2, st | {"step": 2})  # references rank 1's files of step 1
    waiter = threading.Thread(target=mgr.wait, daemon=True)
    waiter.start()
    waiter.join(60)  # the refusal is final: wait() returns (before: it retried forever)
    refused = [line for line in said if "flush of step 2" in line]
    print("RESULT " + json.dumps({"restored": got, "returned": not waiter.is_alive(), "durable": mgr.durable_step,
                                  "on_durable": calls, "remote": mgr.remote_steps(), "busy": mgr._tiers.flusher.busy(),
                                  "refused": refused}), flush=True)
    mgr.close(flush_timeout_s=1)


def test_world_shrink_references_no_live_rank_holds_are_refused_once(tmp_path, s3_url):  # noqa: F811
    """No live rank holds a reference of a rank that is gone: the flush is refused once, final; ``wait()`` returns."""
    remote, opts = s3_url
    local = str(tmp_path / "local")
    port = free_port()
    kids = [start(_shrink_child, "save", r, 2, port, remote, local, opts) for r in range(2)]
    try:
        rc, out = finish(kids[0], 120, "rank 0")
    finally:
        for k in kids:
            k.kill()
    finish(kids[1], 60, "rank 1")
    assert rc == -9 and "SAVED 1" in out, out
    kid = start(_refused_child, 0, 1, free_port(), remote, local, opts)
    rc, out = finish(kid, 120, "the 1-rank job")
    assert rc == 0, out
    res = result(out)
    assert res["restored"] == 1 and res["returned"] and not res["busy"], out
    assert res["durable"] is None and res["on_durable"] == [] and res["remote"] == [], out
    assert len(res["refused"]) == 1 and "refused, not retried" in res["refused"][0] and "-r00001-" in res["refused"][0], out


def test_world_shrink_references_of_a_gone_rank_are_uploaded(tmp_path, s3_url):  # noqa: F811
    remote, opts = s3_url
    local = str(tmp_path / "local")
    port = free_port()
    kids = [start(_shrink_child, "save", r, 2, port, remote, local, opts) for r in range(2)]
    try:
        rc, out = finish(kids[0], 120, "rank 0")
    finally:
        for k in kids:
            k.kill()  # rank 1 dies with the job
    finish(kids[1], 60, "rank 1")
    assert rc == -9 and "SAVED 1" in out, out  # died in the flush of step 1
    assert shardckpt.CheckpointManager(remote, storage_options=opts, load_only=True).steps() == []
    step1 = shardckpt.inspect(f"{local}/step-00000001")
    assert any("-r00001-" in f for f in step1.files), step1.files  # rank 1 wrote part of step 1

    kid = start(_shrink_child, "restore", 0, 1, free_port(), remote, local, opts)
    rc, out = finish(kid, 120, "the 1-rank job")
    assert rc == 0, out
    res = result(out)
    assert res["restored"] == 1, out
    m2 = shardckpt.inspect(f"{local}/step-00000002")
    gone = [f for f in m2.files if f.startswith("@step-00000001/") and "-r00001-" in f]
    assert gone, m2.files  # step 2 references a file of a rank this job does not have
    # The API's word: step 2 is durable. It must load: verify accepts it on the remote, references included.
    assert res["done"] and res["durable"] == 2 and res["on_durable"] == [2] and res["remote"] == [2], out
    shardckpt.verify(f"{remote}/step-00000002", storage_options=opts)
    root = Storage(remote, storage_options=opts)
    assert all(root.exists(f[1:]) for f in gone), gone


def _resave_child(rank: int, world: int, port: int, remote: str, local: str, opts: dict) -> None:
    join_group(rank, world, port)
    import threading

    import shardckpt._flush as flush

    gate = threading.Event()
    real = flush.upload_step

    def slow(*a, **k):  # the remote is slow: step 3 stays in flight while step 4 and the re-save of 2 come
        gate.wait(60)
        return real(*a, **k)

    flush.upload_step = slow
    mgr = shardckpt.CheckpointManager(remote, local=local, keep_last=5, storage_options=opts, collective_timeout_s=60)
    gate.set()
    for step in (1, 2):
        mgr.save(step, _state(float(step)) | {"step": step})
        mgr.wait()  # durable
    gate.clear()
    mgr.save(3, _state(3.0) | {"step": 3})  # in flight (held at the gate)
    mgr.save(4, _state(4.0) | {"step": 4})  # waits for the remote
    mgr.save(2, _state(20.0) | {"step": 2}, force=True)  # the user replaces step 2 on purpose
    gate.set()
    mgr.wait()
    done = True
    print("RESULT " + json.dumps({"done": done, "durable": mgr.durable_step, "remote": mgr.remote_steps()}), flush=True)
    mgr.close(flush_timeout_s=5)


@pytest.mark.parametrize("world", [2])
def test_resave_of_an_older_step_is_flushed_while_a_newer_step_waits(tmp_path, s3_url, world):  # noqa: F811
    remote, opts = s3_url
    local = str(tmp_path / "local")
    port = free_port()
    kids = [start(_resave_child, r, world, port, remote, local, opts) for r in range(world)]
    try:
        outs = [finish(k, 120, f"rank {r}") for r, k in enumerate(kids)]
    finally:
        for k in kids:
            k.kill()
    for rc, out in outs:
        assert rc == 0, out
        res = result(out)
        assert res["done"] and res["durable"] == 4 and res["remote"] == [1, 2, 3, 4], out
    import torch

    shardckpt.verify(f"{remote}/step-00000002", storage_options=opts)
    st = _state(0.0)
    shardckpt.load(st, f"{remote}/step-00000002", storage_options=opts)
    assert torch.equal(st["t0"], torch.full((64,), 20.0)), st["t0"][:2]  # the re-saved bytes, not the replaced ones
    assert Storage(remote, storage_options=opts).read_bytes("step-00000002/manifest.json") == \
        Storage(f"{local}/step-00000002").read_bytes("manifest.json")


def _deleted_child(rank: int, world: int, port: int, remote: str, opts: dict) -> None:
    join_group(rank, world, port)
    from shardckpt._storage import Storage as St

    backend = type(St(remote, storage_options=opts))
    real = backend.write_atomic
    gone = []

    def delete_then_write(self, rel, data, **kw):
        # An object lifecycle rule (another tool) deletes one of step 2's data objects after the
        # commit's first check, right before its manifest PUT: the window no check before the write can close.
        if rel == "manifest.json" and self.url.endswith("step-00000002") and not gone:
            victim = sorted(f for f in self.walk_files("data") if f.endswith(".safetensors"))[0]
            self.remove(victim)
            gone.append(victim)
        return real(self, rel, data, **kw)

    mgr = shardckpt.CheckpointManager(remote, async_save=True, keep_last=5, storage_options=opts, collective_timeout_s=60)
    mgr.save(1, _state(1.0) | {"step": 1})
    mgr.wait()
    backend.write_atomic = delete_then_write
    mgr.save(2, _state(2.0) | {"step": 2})
    try:
        mgr.wait()
        err = None
    except shardckpt.CheckpointError as e:
        err = f"{type(e).__name__}: {e}"
    backend.write_atomic = real
    print("RESULT " + json.dumps({"error": err, "gone": gone, "steps": mgr.steps()}), flush=True)
    mgr.close()


def test_async_save_to_s3_while_its_objects_are_deleted_is_not_committed(s3_url):  # noqa: F811
    remote, opts = s3_url
    port = free_port()
    kids = [start(_deleted_child, r, 2, port, remote, opts) for r in range(2)]
    try:
        outs = [finish(k, 120, f"rank {r}") for r, k in enumerate(kids)]
    finally:
        for k in kids:
            k.kill()
    for rc, out in outs:
        assert rc == 0, out
    res = result(outs[0][1])
    assert len(res["gone"]) == 1, res
    # The save fails with our error naming the deleted file; step 2 is not listed; step 1 is untouched.
    assert res["error"] and res["error"].startswith("SaveFailedError") and res["gone"][0].split("/")[-1] in res["error"], res
    assert res["steps"] == [1] and result(outs[1][1])["error"], (res, outs[1][1])
    assert shardckpt.CheckpointManager(remote, storage_options=opts, load_only=True).steps() == [1]
    shardckpt.verify(f"{remote}/step-00000001", storage_options=opts)


def test_restore_announces_durable_only_a_loadable_remote_step(tmp_path, s3_url):  # noqa: F811
    """A remote step whose data object was deleted out of band (a lifecycle rule, a commit from before the check) is not durable.

    One process, ``local=`` on disk, the remote on S3 (moto): steps 1 and 2
    flushed; one of step 2's data objects is deleted on the remote. A new
    manager's ``restore()`` resumes from the local step 2, but announces
    step 1 durable (the newest one ``verify`` accepts), not step 2.
    """
    remote, opts = s3_url
    local = str(tmp_path / "local")
    with shardckpt.CheckpointManager(remote, local=local, keep_last=5, storage_options=opts) as mgr:
        for step in (1, 2):
            mgr.save(step, _state(float(step)) | {"step": step})
            mgr.wait()
        assert mgr.durable_step == 2
    root = Storage(remote, storage_options=opts)
    victim = sorted(f for f in root.walk_files("step-00000002/data") if f.endswith(".safetensors"))[0]
    root.remove(victim)
    with pytest.raises(shardckpt.CheckpointError):
        shardckpt.verify(f"{remote}/step-00000002", storage_options=opts)
    mgr = shardckpt.CheckpointManager(remote, local=local, keep_last=5, storage_options=opts)
    try:
        st = _state(0.0)
        assert mgr.restore(st) == 2 and mgr.restored_from == f"{local}/step-00000002"
        assert mgr.durable_step == 1  # never ahead of what verify accepts
        shardckpt.verify(f"{remote}/step-00000001", storage_options=opts)
    finally:
        mgr.close(flush_timeout_s=5)
