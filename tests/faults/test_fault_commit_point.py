"""The commit point: faults right after it lose nothing, and the error says what was committed.

Cells of the fault matrix (docs/reliability.md) on both sides of the commit
point, with real processes, real files and a real S3 server (moto):

  peer killed after the commit   rank 1 of 2 SIGKILLed once rank 0's manifest is in place
  interrupt after the rename     KeyboardInterrupt right after manifest.json's rename (overwrite / force)
  lost PUT answer                the manifest PUT lands, its answer never comes back (S3)
  deleted bucket (async)         the bucket is emptied and deleted while an async save writes

After the commit point the new checkpoint must load bit-exact (nothing it
names removed); before it, the previous one must.
"""

from __future__ import annotations

import os
import re
import signal
import time
import urllib.request
import uuid

import pytest
import torch
from _faultkids import die, finish, join_group, start
from _moto import s3_endpoint, s3_url  # noqa: F401  (pytest fixtures)

import shardckpt
from shardckpt.errors import CheckpointError, SaveFailedError

CHILD_TIMEOUT_S = 240


def _state(seed: int):
    g = torch.Generator().manual_seed(seed)
    return {"w": torch.randn(64, 33, generator=g), "ids": torch.arange(100) * seed, "step": seed}


def _blank():
    return {"w": torch.zeros(64, 33), "ids": torch.zeros(100, dtype=torch.int64), "step": 0}


def _assert_is(state, seed: int, where: str) -> None:
    want = _state(seed)
    assert torch.equal(state["w"], want["w"]) and torch.equal(state["ids"], want["ids"]), where
    assert state["step"] == seed, where


def _interrupt_after_manifest_rename(monkeypatch) -> None:
    real = os.replace

    def replace(src, dst, *a, **kw):
        out = real(src, dst, *a, **kw)
        if str(dst).endswith("manifest.json"):
            raise KeyboardInterrupt  # Ctrl-C in the instant after the rename
        return out

    monkeypatch.setattr(os, "replace", replace)


# -- an interrupt right after the rename ---------------------------------------------------


def test_interrupt_after_the_rename_keeps_the_new_checkpoint_overwrite(tmp_path, monkeypatch):
    url = str(tmp_path / "ck")
    shardckpt.save(_state(1), url)
    _interrupt_after_manifest_rename(monkeypatch)
    with pytest.raises(KeyboardInterrupt):
        shardckpt.save(_state(2), url, overwrite=True)
    monkeypatch.undo()
    # Committed: the new checkpoint is there, whole (its files were not removed).
    shardckpt.verify(url)
    live = _blank()
    shardckpt.load(live, url)
    _assert_is(live, 2, "overwrite, interrupt after the rename")


def test_interrupt_after_the_rename_keeps_the_new_step_force(tmp_path, monkeypatch):
    mgr = shardckpt.CheckpointManager(str(tmp_path / "run"))
    mgr.save(1, _state(1))
    _interrupt_after_manifest_rename(monkeypatch)
    with pytest.raises(KeyboardInterrupt):
        mgr.save(1, _state(3), force=True)
    monkeypatch.undo()
    assert mgr.steps() == [1]
    shardckpt.verify(mgr.step_url(1))
    live = _blank()
    assert mgr.restore(live) == 1
    _assert_is(live, 3, "force, interrupt after the rename")


def test_interrupt_before_the_rename_keeps_the_previous_checkpoint(tmp_path, monkeypatch):
    url = str(tmp_path / "ck")
    shardckpt.save(_state(1), url)
    real = os.replace

    def replace(src, dst, *a, **kw):
        if str(dst).endswith("manifest.json"):
            raise KeyboardInterrupt
        return real(src, dst, *a, **kw)

    monkeypatch.setattr(os, "replace", replace)
    with pytest.raises(KeyboardInterrupt):
        shardckpt.save(_state(2), url, overwrite=True)
    monkeypatch.undo()
    shardckpt.verify(url)
    live = _blank()
    shardckpt.load(live, url)
    _assert_is(live, 1, "interrupt before the rename")
    # The new save's files were removed: only what the manifest names is left in data/.
    m = shardckpt.inspect(url)
    data = {f"data/{n}" for n in os.listdir(tmp_path / "ck" / "data")}
    assert data == set(m.files), (data, set(m.files))


# -- a lost PUT answer (S3) ---------------------------------------------------------------


def _lose_manifest_answer(monkeypatch, *, land: bool) -> None:
    """The manifest PUT reaches the server (``land``) but its answer is lost: the client sees a reset."""
    from shardckpt._storage import S3Storage

    real = S3Storage.write_atomic

    def write_atomic(self, rel, data, **kw):
        if rel.endswith("manifest.json"):
            if land:
                real(self, rel, data, **kw)
            raise ConnectionResetError(104, "Connection reset by peer (the answer to the manifest PUT was lost)")
        return real(self, rel, data, **kw)

    monkeypatch.setattr(S3Storage, "write_atomic", write_atomic)


def test_lost_put_answer_after_the_manifest_landed_is_a_commit(s3_url, monkeypatch):  # noqa: F811
    url, opts = s3_url
    shardckpt.save(_state(1), url, storage_options=opts)
    _lose_manifest_answer(monkeypatch, land=True)
    # The manifest there is this save's: the save is done (a warning says what happened).
    shardckpt.save(_state(2), url, storage_options=opts, overwrite=True)
    monkeypatch.undo()
    shardckpt.verify(url, storage_options=opts)
    live = _blank()
    shardckpt.load(live, url, storage_options=opts)
    _assert_is(live, 2, "lost PUT answer, landed")


def test_lost_put_that_never_landed_keeps_the_previous_checkpoint(s3_url, monkeypatch):  # noqa: F811
    url, opts = s3_url
    mgr = shardckpt.CheckpointManager(url.rsplit("/", 1)[0] + "/run", storage_options=opts)
    mgr.save(1, _state(1))
    _lose_manifest_answer(monkeypatch, land=False)
    with pytest.raises(SaveFailedError, match="nothing was committed"):
        mgr.save(1, _state(2), force=True)
    monkeypatch.undo()
    live = _blank()
    assert mgr.restore(live) == 1
    _assert_is(live, 1, "lost PUT, not landed")
    shardckpt.verify(mgr.step_url(1), storage_options=opts)


# -- a deleted bucket during an async save (S3) ----------------------------------------------


def test_async_save_into_a_deleted_bucket_fails(s3_endpoint, monkeypatch):  # noqa: F811
    from _moto import _DIRECT

    _, opts = s3_endpoint
    bucket = f"gone-{uuid.uuid4().hex[:10]}"
    endpoint = opts["endpoint_url"]
    _DIRECT.open(urllib.request.Request(f"{endpoint}/{bucket}", method="PUT"), timeout=10).read()
    mgr = shardckpt.CheckpointManager(f"s3://{bucket}/run", storage_options=opts, async_save=True)
    mgr.save(1, _state(1)).result()

    from shardckpt import _save

    real = _save.write_files

    def then_delete_bucket(storage, files, **kw):
        out = real(storage, files, **kw)
        # The operator deletes the bucket (emptied first, as S3 requires) while the save writes.
        import botocore.session

        c = botocore.session.get_session().create_client(
            "s3", endpoint_url=endpoint, aws_access_key_id="testing", aws_secret_access_key="testing", region_name="us-east-1"
        )
        for o in c.list_objects_v2(Bucket=bucket).get("Contents", []):
            c.delete_object(Bucket=bucket, Key=o["Key"])
        c.delete_bucket(Bucket=bucket)
        return out

    monkeypatch.setattr(_save, "write_files", then_delete_bucket)
    handle = mgr.save(2, _state(2))
    with pytest.raises(CheckpointError):
        handle.result()
    monkeypatch.undo()
    assert 2 not in _listed(mgr)


def _listed(mgr):
    try:
        return mgr.steps()
    except Exception:
        return []  # the bucket is gone: nothing is listed


# -- a peer SIGKILLed right after rank 0 commits -----------------------------------------------


def _child_rank(root: str, rank: int, world: int, port: int) -> None:
    from models import build, shard_fsdp2

    join_group(rank, world, port, 120)
    model = shard_fsdp2(build(seed=1))
    mgr = shardckpt.CheckpointManager(root, keep_last=1)
    mgr.save(1, {"model": model, "step": 1})
    with torch.no_grad():
        for p in model.parameters():
            p.add_(1.0)
    if rank == 1:
        from shardckpt import _save

        real = _save.agree
        manifest = os.path.join(root, "step-00000001", "manifest.json")
        before = os.stat(manifest).st_mtime_ns

        def agree(comm, fn, *, what, **kw):
            # The exchange after rank 0's commit: die once its manifest replaced the old one,
            # before this rank tells rank 0 it is there.
            if what.startswith("save to") and what.endswith("failed"):
                deadline = time.monotonic() + 120
                while time.monotonic() < deadline:
                    try:
                        if os.stat(manifest).st_mtime_ns != before:
                            break
                    except FileNotFoundError:
                        pass
                    time.sleep(0.01)
                die()
            return real(comm, fn, what=what, **kw)

        _save.agree = agree
    try:
        mgr.save(1, {"model": model, "step": 2}, force=True)
        print("SAVED", flush=True)
        os._exit(0)
    except Exception as e:
        print(f"RAISED {type(e).__name__}: {e}", flush=True)
        os._exit(3)


def test_peer_killed_after_the_commit_keeps_the_committed_checkpoint(tmp_path):
    from _dist import free_port
    from models import build

    root = str(tmp_path / "run")
    port = free_port()
    procs = [start(_child_rank, root, r, 2, port) for r in range(2)]
    (rc0, out0), (rc1, out1) = [finish(p, CHILD_TIMEOUT_S) for p in procs]
    assert rc1 == -signal.SIGKILL, f"rank 1 was not killed: exit {rc1}\n{out1}"
    # Rank 0 raises, and says the truth: committed, then rank 1 failed.
    assert rc0 == 3 and "SaveFailedError" in out0, out0
    msg = out0[out0.index("RAISED"):]
    assert re.search(r"was committed", msg) and "nothing was committed" not in msg, msg
    mgr = shardckpt.CheckpointManager(root)
    assert mgr.steps() == [1]
    shardckpt.verify(mgr.step_url(1))
    model = build(seed=7)
    assert mgr.restore({"model": model, "step": 0}) == 1
    ref = build(seed=1)
    with torch.no_grad():
        for p in ref.parameters():
            p.add_(1.0)
    ref_sd = ref.state_dict()
    for k, v in model.state_dict().items():
        assert torch.equal(v, ref_sd[k]), k
