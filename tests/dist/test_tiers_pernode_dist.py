"""Per-node local disks: ``CheckpointManager(s3_root, local=DIR)`` where DIR is each node's own directory.

4 gloo ranks, two "nodes" of two ranks each: ranks 0-1 get ``<tmp>/node0``,
ranks 2-3 ``<tmp>/node1`` (in a real job every node passes the same path,
which names a different disk on each node). The manager probes the
directory at its first save, finds it per node, commits on rank 0 without
the other node's files, writes the manifest on node 1 too, flushes every
rank's own files from its node's disk to S3 (moto on loopback), and
applies local retention on each node's lead.
"""

from __future__ import annotations

import os
import shutil

import torch
from _damage import data_file, flip_last_byte
from _dist import run_ranks
from _moto import s3_endpoint, s3_url  # noqa: F401  (pytest fixtures)
from models import build, full_state, shard_fsdp2

import shardckpt
from shardckpt._storage import Storage

IDX = torch.tensor([[1, 5, 36, 0], [7, 7, 2, 30]])
RANKS_PER_NODE = 2


def _node_dir(base: str, rank: int, per_node: int = RANKS_PER_NODE) -> str:
    return os.path.join(base, f"node{rank // per_node}")


def _bump(model, by: float) -> None:
    with torch.no_grad():
        for p in model.parameters():
            p.add_(by)


def _save_run(rank, world, remote, base, opts, steps, async_save, per_node=RANKS_PER_NODE):
    model = shard_fsdp2(build(seed=1))
    mgr = shardckpt.CheckpointManager(remote, local=_node_dir(base, rank, per_node), keep_last=2, keep_local=2, storage_options=opts,
                                      async_save=async_save, collective_timeout_s=60)
    snaps, local_max = {}, 0
    for step in steps:
        snaps[step] = full_state(model)
        mgr.save(step, {"model": model, "step": step})
        local_max = max(local_max, len(mgr.steps()))
        _bump(model, 1.0)
    mgr.wait()
    out = {"local": mgr.steps(), "remote": mgr.remote_steps(), "durable": mgr.durable_step, "local_max": local_max,
           "snap": snaps[steps[-1]], "shared": mgr._layout[0], "lead": mgr._layout[1]}
    mgr.close()
    return out


def _restore_run(rank, world, remote, base, opts, per_node=RANKS_PER_NODE):
    import logging

    fresh = shard_fsdp2(build(seed=9))
    fresh(IDX).sum().backward()
    state = {"model": fresh, "step": 0}
    said = []
    handler = logging.Handler(logging.WARNING)
    handler.emit = lambda rec: said.append(rec.getMessage())
    logging.getLogger("shardckpt").addHandler(handler)
    try:
        mgr = shardckpt.CheckpointManager(remote, local=_node_dir(base, rank, per_node), keep_last=2, storage_options=opts,
                                          collective_timeout_s=60)
        got = mgr.restore(state)
    finally:
        logging.getLogger("shardckpt").removeHandler(handler)
    out = {"step": got, "state_step": state["step"], "from": mgr.restored_from, "full": full_state(fresh),
           "stats": mgr._tiers.last_restore, "said": said}
    mgr.close()
    return out


def _files(d: str):
    return sorted(os.path.relpath(os.path.join(p, f), d) for p, _, fs in os.walk(d) for f in fs)


def test_per_node_local_disks(tmp_path, s3_url):  # noqa: F811
    remote, opts = s3_url
    base = str(tmp_path)
    res = run_ranks(4, _save_run, remote, base, opts, list(range(1, 6)), True)
    assert [(o["shared"], o["lead"]) for o in res] == [(False, True), (False, False), (False, True), (False, False)]
    for r, out in enumerate(res):
        assert out["durable"] == 5 and out["local"][-2:] == [4, 5] and len(out["local"]) <= 4, (r, out)
        assert out["local_max"] <= 4, (r, out)
    # Both nodes' directories hold step 5 committed (the same manifest), each with only its own ranks' data files.
    n0, n1 = (os.path.join(base, f"node{i}", "step-00000005") for i in (0, 1))
    with open(os.path.join(n0, "manifest.json"), "rb") as f0, open(os.path.join(n1, "manifest.json"), "rb") as f1:
        assert f0.read() == f1.read()
    data0 = [f for f in _files(n0) if f.startswith("data/")]
    data1 = [f for f in _files(n1) if f.startswith("data/")]
    assert data0 and data1 and not set(data0) & set(data1), (data0, data1)
    assert all("r00000" in f or "r00001" in f for f in data0), data0
    assert all("r00002" in f or "r00003" in f for f in data1), data1
    # Local retention ran on both nodes (keep_local=2 plus what was in flight).
    for n in ("node0", "node1"):
        steps = sorted(int(d[5:]) for d in os.listdir(os.path.join(base, n)) if d.startswith("step-")
                       and os.path.exists(os.path.join(base, n, d, "manifest.json")))
        assert steps[-2:] == [4, 5] and len(steps) <= 4, (n, steps)
    # Every remote step is whole: every file, every checksum.
    remote_steps = res[0]["remote"]
    assert remote_steps and remote_steps[-1] == 5
    for s in remote_steps:
        m = shardckpt.verify(f"{remote}/step-{s:08d}", storage_options=opts)
        assert m.world_size == 4 and m.extra["step"] == s

    # Both nodes keep their disks: restored from them, each file read on a node that holds it (ranks 2-3 need
    # chunks rank 0 wrote, on node 0's disk only: received from a rank there, verified as they stream).
    back = run_ranks(4, _restore_run, remote, base, opts)
    for r, out in enumerate(back):
        assert out["step"] == 5 and out["state_step"] == 5, (r, out)
        assert out["from"] == os.path.join(_node_dir(base, r), "step-00000005"), (r, out["from"])
        assert all(torch.equal(v, res[r]["snap"][k]) for k, v in out["full"].items())
    assert sum(o["stats"]["peer_bytes"] for o in back) > 0 and sum(o["stats"]["local_bytes"] for o in back) > 0
    assert not any(o["stats"]["damaged"] for o in back)
    assert not [n for n in ("node0", "node1") for f in os.listdir(os.path.join(base, n)) if f.startswith(".shardckpt-restore")]
    # Rank 0's data file (replicated values) damaged on node 0, its only holder: the remote's step, bit-exact.
    only = data_file(os.path.join(base, "node0"), 5, 0)
    with open(only, "rb") as f:
        good = f.read()
    flip_last_byte(only)
    back = run_ranks(4, _restore_run, remote, base, opts)
    for r, out in enumerate(back):
        assert out["step"] == 5 and out["from"] == f"{remote}/step-00000005", (r, out["from"])
        assert all(torch.equal(v, res[r]["snap"][k]) for k, v in out["full"].items())
    assert any("damaged" in line for o in back for line in o["said"]), [o["said"] for o in back]
    assert any("per-node directories" in line and "remote" in line for o in back for line in o["said"])
    # A good copy of that file on node 1 too: the damaged copy is skipped, node 1's is read; still local.
    other = os.path.join(base, "node1", os.path.relpath(only, os.path.join(base, "node0")))
    with open(other, "wb") as f:
        f.write(good)
    back = run_ranks(4, _restore_run, remote, base, opts)
    for r, out in enumerate(back):
        assert out["step"] == 5 and out["from"] == os.path.join(_node_dir(base, r), "step-00000005"), (r, out["from"])
        assert all(torch.equal(v, res[r]["snap"][k]) for k, v in out["full"].items())
    assert all(any(d.startswith("the node of rank 0:") and d.endswith(os.path.basename(only)) for d in o["stats"]["damaged"])
               for o in back), [o["stats"]["damaged"] for o in back]
    os.remove(other)
    with open(only, "wb") as f:
        f.write(good)
    # The remote emptied (its objects deleted; another prefix would be another run's root): the local disks alone
    # restore the step (and flush it back).
    Storage(remote, storage_options=opts).remove_tree("")
    back = run_ranks(4, _restore_run, remote, base, opts)
    for r, out in enumerate(back):
        assert out["step"] == 5 and out["from"] == os.path.join(_node_dir(base, r), "step-00000005"), (r, out["from"])
        assert all(torch.equal(v, res[r]["snap"][k]) for k, v in out["full"].items())
    # Node 1 replaced (its disk empty): the remote's step, bit-exact, on every rank.
    shutil.rmtree(os.path.join(base, "node1"))
    back = run_ranks(4, _restore_run, remote, base, opts)
    for r, out in enumerate(back):
        assert out["step"] == 5 and out["from"] == f"{remote}/step-00000005", (r, out["from"])
        assert all(torch.equal(v, res[r]["snap"][k]) for k, v in out["full"].items())


def test_per_node_sync_save_and_shared_dir_detected(tmp_path, s3_url):  # noqa: F811
    remote, opts = s3_url
    res = run_ranks(4, _save_run, remote, str(tmp_path), opts, [1, 2, 3], False)
    for out in res:
        assert out["durable"] == 3 and out["local"][-1] == 3 and not out["shared"]
    # One directory every rank sees (one node): detected as shared, saved as before.
    res = run_ranks(2, _save_run, remote + "-b", str(tmp_path / "shared"), opts, [1, 2], False, 2)
    assert all(o["durable"] == 2 and o["local"] == [1, 2] for o in res), res
    assert [(o["shared"], o["lead"]) for o in res] == [(True, True), (True, False)]


def _sharded(rank, world, remote, base, opts, steps, restore, step=None):
    """A state every rank loads from its own files alone: one tensor sharded over the 4 ranks (dim 0)."""
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import Shard, distribute_tensor

    mesh = init_device_mesh("cpu", (world,))
    full = torch.arange(64, dtype=torch.float32).reshape(16, 4)
    w = distribute_tensor(full.clone() if not restore else torch.zeros(16, 4), mesh, [Shard(0)])
    mgr = shardckpt.CheckpointManager(remote, local=_node_dir(base, rank), keep_last=2, keep_local=2, storage_options=opts,
                                      collective_timeout_s=60)
    state = {"w": w, "step": 0}
    if restore:
        got = mgr.restore(state, step=step)
        out = {"step": got, "from": mgr.restored_from, "w": w.full_tensor(), "want": full + (step or steps[-1])}
    else:
        for step in steps:
            with torch.no_grad():
                w.copy_(distribute_tensor(full + step, mesh, [Shard(0)]))
            mgr.save(step, {"w": w, "step": step})
            mgr.wait()  # each step flushed before the next save (none coalesced away: the test restores step 2 from S3)
        out = {"local": mgr.steps(), "durable": mgr.durable_step}
    mgr.close()
    return out


def test_per_node_restores_locally(tmp_path, s3_url):  # noqa: F811
    remote, opts = s3_url
    base = str(tmp_path)
    res = run_ranks(4, _sharded, remote, base, opts, [1, 2, 3], False)
    assert all(o["durable"] == 3 and o["local"][-2:] == [2, 3] for o in res), res
    back = run_ranks(4, _sharded, remote, base, opts, [1, 2, 3], True)
    for r, out in enumerate(back):  # both nodes kept their disks: each rank loads from its own node's directory
        assert out["step"] == 3 and out["from"].startswith(_node_dir(base, r)), (r, out["from"])
        assert torch.equal(out["w"], out["want"])
    back = run_ranks(4, _sharded, remote, base, opts, [1, 2, 3], True, 2)  # a given step, on both nodes: local
    assert all(o["step"] == 2 and o["from"].startswith(_node_dir(base, r)) and torch.equal(o["w"], o["want"])
               for r, o in enumerate(back)), [o["from"] for o in back]
    shutil.rmtree(os.path.join(base, "node1", "step-00000002"))  # gone from node 1 only: that step from the remote
    back = run_ranks(4, _sharded, remote, base, opts, [1, 2, 3], True, 2)
    assert all(o["step"] == 2 and o["from"] == f"{remote}/step-00000002" and torch.equal(o["w"], o["want"])
               for o in back), [o["from"] for o in back]
    shutil.rmtree(os.path.join(base, "node1"))  # node 1 replaced: the remote's step, bit-exact
    back = run_ranks(4, _sharded, remote, base, opts, [1, 2, 3], True)
    for r, out in enumerate(back):
        assert out["step"] == 3 and out["from"] == f"{remote}/step-00000003", (r, out["from"])
        assert torch.equal(out["w"], out["want"])


def _train_run(rank, world, remote, base, opts, per_node, restore, step=None):
    """FSDP2 model + AdamW + scheduler: train and save steps 1 and 2 (the last one also as a Hugging Face export), or restore."""
    from _training import full_optim, full_params, make, train

    model, opt, sched = make("fsdp2", rank, world, seed=3 if restore else 1)
    state = {"model": model, "optim": opt, "sched": sched, "step": 0}
    mgr = shardckpt.CheckpointManager(remote, local=_node_dir(base, rank, per_node), keep_last=3, keep_local=3,
                                      storage_options=opts, collective_timeout_s=60, last_save_in_hf=True)
    out = {}
    if restore:
        if step is None:
            train(model, opt, sched, 0, 1, "fsdp2", rank, world)  # live optimizer state to be overwritten
        out["step"] = mgr.restore(state, step=step)
        out["from"], out["stats"] = mgr.restored_from, mgr._tiers.last_restore
    else:
        for s in (1, 2):
            train(model, opt, sched, s * 2, 2, "fsdp2", rank, world)
            state["step"] = s
            mgr.save(s, state, last_step=s == 2)
            out[s] = {"params": full_params(model), "optim": full_optim(model, opt)}
        mgr.wait()
        out["remote"] = mgr.remote_steps()
    out["params"], out["optim"], out["state_step"] = full_params(model), full_optim(model, opt), state["step"]
    mgr.close()
    return out


def _same(a, b):
    return a.keys() == b.keys() and all(torch.equal(v, b[k]) if isinstance(v, torch.Tensor) else v == b[k] for k, v in a.items())


def test_per_node_fsdp2_training_state_restores_from_the_local_disks(tmp_path, s3_url):  # noqa: F811
    remote, opts = s3_url
    remote = remote + "-train"
    base = str(tmp_path)
    res = run_ranks(4, _train_run, remote, base, opts, RANKS_PER_NODE, False)
    assert res[0]["remote"][-1] == 2
    # last_save_in_hf on per-node directories: exported from the remote copy (every node's files), on the remote.
    hf = Storage(f"{remote}/step-00000002-hf", storage_options=opts)
    names = hf.walk_files("")
    assert any(n.endswith(".safetensors") for n in names), names
    assert not os.path.exists(os.path.join(base, "node0", "step-00000002-hf"))
    from safetensors.torch import load as st_load

    exported = {}
    for n in names:
        if n.endswith(".safetensors"):
            exported.update(st_load(hf.read_bytes(n)))
    want = res[0][2]["params"]
    assert exported and all(torch.equal(exported[k], want[k.removeprefix("model.")]) for k in exported), sorted(exported)
    # The remote emptied (its objects deleted; another prefix would be another run's root): model, optimizer and
    # scheduler from the local disks alone, bit-exact.
    Storage(remote, storage_options=opts).remove_tree("")
    back = run_ranks(4, _train_run, remote, base, opts, RANKS_PER_NODE, True)
    for r, out in enumerate(back):
        assert out["step"] == 2 and out["state_step"] == 2, (r, out["step"])
        assert out["from"] == os.path.join(_node_dir(base, r), "step-00000002"), (r, out["from"])
        assert _same(out["params"], res[r][2]["params"]) and _same(out["optim"], res[r][2]["optim"]), r
    assert sum(o["stats"]["peer_bytes"] for o in back) > 0
    # A given step, the same way.
    back = run_ranks(4, _train_run, remote, base, opts, RANKS_PER_NODE, True, 1)
    for r, out in enumerate(back):
        assert out["step"] == 1 and out["from"] == os.path.join(_node_dir(base, r), "step-00000001"), (r, out["from"])
        assert _same(out["params"], res[r][1]["params"]) and _same(out["optim"], res[r][1]["optim"]), r
    # Two ranks now, one per node, the remote emptied again: each node's files still cover the step, resharded as they load.
    Storage(remote, storage_options=opts).remove_tree("")
    back = run_ranks(2, _train_run, remote, base, opts, 1, True)
    for r, out in enumerate(back):
        assert out["step"] == 2 and out["from"] == os.path.join(base, f"node{r}", "step-00000002"), (r, out["from"])
        assert _same(out["params"], res[0][2]["params"]) and _same(out["optim"], res[0][2]["optim"]), r
    # Not flushed by the 2-rank job: each rank uploads the files it wrote, and ranks 2-3 are gone (never committed half).
    assert not Storage(remote, storage_options=opts).exists("step-00000002/manifest.json")
