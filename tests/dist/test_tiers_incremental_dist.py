"""``CheckpointManager(s3_root, local=DIR, incremental=True)`` on 2 gloo ranks (FSDP2) with a real S3 server on loopback.

References resolve on each side: a flushed step whose references name a
step the flusher skipped (the backlog bound) carries those files to the
remote, remote retention keeps referenced files of dropped steps, every
committed remote step verifies and loads bit-exact, and a ``force=True``
re-save replaces the remote copy (its new manifest last, the replaced files
removed once no step names them).
"""

from __future__ import annotations

import shutil
import threading

import torch
from _dist import run_ranks
from _moto import s3_endpoint, s3_url  # noqa: F401  (pytest fixtures)
from torch import nn

import shardckpt
from shardckpt import _flush
from shardckpt._format import open_manifest
from shardckpt._storage import Storage

D, R, LAYERS = 64, 4, 2


class Lora(nn.Module):
    def __init__(self):
        super().__init__()
        g = torch.Generator().manual_seed(0)
        self.base = nn.ModuleList(nn.Linear(D, D) for _ in range(LAYERS))
        for p in self.base.parameters():
            p.requires_grad_(False)
        self.a = nn.ParameterList(nn.Parameter(torch.randn(R, D, generator=g)) for _ in range(LAYERS))
        self.b = nn.ParameterList(nn.Parameter(torch.zeros(D, R)) for _ in range(LAYERS))


def _full(model):
    return {k: (v.full_tensor() if hasattr(v, "full_tensor") else v).detach().clone() for k, v in model.state_dict().items()}


def _train(model, by: float) -> None:
    with torch.no_grad():
        for n, p in model.named_parameters():
            if not n.startswith("base"):
                p.add_(by)


def _save_run(rank, world, remote, local, opts):
    from torch.distributed.fsdp import fully_shard

    torch.manual_seed(0)
    model = fully_shard(Lora())
    # The remote is slow: the first flush waits until steps 2..8 are saved, so
    # the flusher skips 2..7 and flushes 8 next (the backlog bound).
    gate = threading.Event()
    real = _flush.upload_step

    def slow_upload(*a, **k):
        gate.wait(120)
        return real(*a, **k)

    _flush.upload_step = slow_upload
    snaps = {}
    try:
        mgr = shardckpt.CheckpointManager(remote, local=local, incremental=True, keep_last=2, keep_local=2,
                                          storage_options=opts, collective_timeout_s=120)
        for step in range(1, 9):
            mgr.save(step, {"model": model, "step": step})
            snaps[step] = _full(model)
            if step <= 2:
                _train(model, 1.0)  # the adapter trains until step 3, then stays: later steps reference it
        gate.set()
        mgr.wait()
        skipped = list(mgr._tiers.flusher.skipped)
        mid_remote = mgr.remote_steps()
        mgr.save(9, {"model": model, "step": 9})  # flushed at once: step 1 is dropped on the remote
        snaps[9] = _full(model)
        mgr.wait()
        before_resave = mgr.remote_steps()
        _train(model, 5.0)
        mgr.save(9, {"model": model, "step": 9}, force=True)  # a re-save: its remote copy is replaced
        resaved = _full(model)
        mgr.wait()
        out = {"skipped": skipped, "mid_remote": mid_remote, "before_resave": before_resave, "remote": mgr.remote_steps(),
               "local": mgr.steps(), "durable": mgr.durable_step, "snaps": snaps, "resaved": resaved}
        mgr.close()
    finally:
        _flush.upload_step = real
        gate.set()
    return out


def _restore_run(rank, world, remote, local, opts):
    from torch.distributed.fsdp import fully_shard

    model = fully_shard(Lora())
    with torch.no_grad():
        for p in model.parameters():
            p.zero_()
    state = {"model": model, "step": 0}
    mgr = shardckpt.CheckpointManager(remote, local=local, incremental=True, keep_last=2, storage_options=opts,
                                      collective_timeout_s=60)
    got = mgr.restore(state)
    out = {"step": got, "state_step": state["step"], "from": mgr.restored_from, "full": _full(model)}
    mgr.close()
    return out


def _refs(step: Storage):
    return {rel.split("/", 1)[0][1:] for rel in open_manifest(step).files if rel.startswith("@")}


def test_incremental_local_first_flushes_references_of_skipped_steps(tmp_path, s3_url):  # noqa: F811
    remote, opts = s3_url
    local = str(tmp_path / "local")
    res = run_ranks(2, _save_run, remote, local, opts)
    out = res[0]
    assert res[1]["remote"] == out["remote"]
    assert set(range(2, 8)) <= set(out["skipped"]), out["skipped"]  # the backlog bound skipped 2..7
    assert out["mid_remote"] == [1, 8], out["mid_remote"]
    assert out["before_resave"] == [8, 9] and out["remote"] == [8, 9] and out["durable"] == 9, out
    root = Storage(remote, storage_options=opts)
    # Step 8 references a step the flusher skipped (the adapter's bytes) and
    # step 1 (the frozen base): both were carried to the remote.
    refs8 = _refs(root.child("step-00000008"))
    skipped_refs = {d for d in refs8 if int(d.split("-")[1]) in out["skipped"]}
    assert skipped_refs and "step-00000001" in refs8, refs8
    for d in skipped_refs | {"step-00000001"}:
        # Not committed on the remote (skipped, or dropped by retention), yet its referenced files are kept.
        assert not root.exists(f"{d}/manifest.json") and root.child(d).walk_files(""), d
    # Every committed remote step verifies (following its references) and loads bit-exact.
    for s in (8, 9):
        m = shardckpt.verify(f"{remote}/step-{s:08d}", storage_options=opts)
        assert m.extra["step"] == s
    one = Lora()
    st = {"model": one, "step": 0}
    shardckpt.load(st, f"{remote}/step-00000008", storage_options=opts)
    assert st["step"] == 8 and all(torch.equal(v, out["snaps"][8][k]) for k, v in one.state_dict().items())
    # The re-save replaced the remote copy of step 9: the same manifest as the local one, and none of the
    # replaced copy's own data files left (nothing references them).
    loc9 = Storage(f"{local}/step-00000009")
    assert root.read_bytes("step-00000009/manifest.json") == loc9.read_bytes("manifest.json")
    named = set(open_manifest(loc9).files)
    left = {rel for rel in root.child("step-00000009").walk_files("") if rel.endswith(".safetensors")}
    assert left and left <= named, (left, named)
    # A new node: no local directory, restore takes the remote's step 9 (the re-saved values).
    shutil.rmtree(local)
    for r, back in enumerate(run_ranks(2, _restore_run, remote, local, opts)):
        assert back["step"] == 9 and back["from"] == f"{remote}/step-00000009", back["from"]
        assert all(torch.equal(v, res[r]["resaved"][k]) for k, v in back["full"].items())
