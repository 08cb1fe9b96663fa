"""Restore after losing a node: memory tier (survivors' shared memory + peer copies) vs storage vs DCP.

CPU, gloo, ``--world`` processes as 2 "nodes" (each node's shared memory a
directory under ``--shm``, default ``/dev/shm``). Every rank builds an
FSDP2-sharded MLP stack with AdamW state (one step taken), then:

1. ``save_to_memory`` (own node + peer copy), ``mgr.save`` to storage under
   ``--dir``, and DCP's ``save`` of the same state under ``--dir``;
2. node 1's memory directory is wiped (its processes died with it);
3. the state is zeroed and restored three ways, each timed on every rank
   (the slowest rank counts): the manager with the memory tier (node 1's
   ranks get their files from node 0 over the process group), the manager
   without it (storage; page cache dropped first), and DCP's ``load``
   (page cache dropped first). Values are checked after each.

Reported in the same run: the three restore times (slowest rank), the
measured link bandwidth (rank 0 -> its peer on the other node), and per rank
the bytes it received over the group during the memory restore (tensor
ranges + manifest/index files) against the bytes its load needs.

Usage:
  python benchmarks/bench_memory_restore.py --world 4 --dim 1024 --layers 8
  python benchmarks/bench_memory_restore.py --world 2 --backend nccl --dim 8192 --layers 40   # 2 GPUs (benchmarks/device/memtier2gpu.sh)
Prints one JSON line per case and a markdown table.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import sys
import tempfile
import time

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

from _common import drop_page_cache, machine_info, markdown_table, run_isolated_ranks  # noqa: E402


def _build(dim: int, layers: int, device: str):
    import torch
    from torch.distributed.fsdp import fully_shard

    torch.manual_seed(0)
    with torch.device(device):
        model = torch.nn.Sequential(*[torch.nn.Linear(dim, dim) for _ in range(layers)])
    for m in model:
        fully_shard(m)
    fully_shard(model)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    model(torch.randn(2, dim, device=device)).sum().backward()
    opt.step()
    opt.zero_grad()
    return model, opt


def _snapshot(model, opt):
    from torch.distributed.checkpoint.state_dict import get_state_dict

    msd, osd = get_state_dict(model, opt)
    out = {}
    for k, v in msd.items():
        out["m." + k] = v.to_local().clone()
    for fqn, st in osd["state"].items():
        for k, v in st.items():
            if hasattr(v, "to_local"):
                out[f"o.{fqn}.{k}"] = v.to_local().clone()
    return out


def _zero(model, opt):
    import torch

    with torch.no_grad():
        for p in model.parameters():
            p.to_local().zero_()
        for st in opt.state.values():
            for v in st.values():
                if hasattr(v, "to_local"):
                    v.to_local().zero_()


def _link_gbps(rank: int, peer: int, device: str, nbytes: int = 256 << 20) -> float:
    """Rank 0 -> its peer on the other node: measured bytes/s of one send (after a warm-up)."""
    import torch
    import torch.distributed as dist

    buf = torch.empty(nbytes, dtype=torch.uint8, device=device)
    rate = 0.0
    for _ in range(2):
        dist.barrier()
        t = time.perf_counter()
        if rank == 0:
            dist.send(buf, dst=peer)
        elif rank == peer:
            dist.recv(buf, src=0)
        if device != "cpu":
            torch.cuda.synchronize()
        rate = nbytes / (time.perf_counter() - t) / 1e9
    return rate if rank == peer else 0.0  # the receiver's clock: the others took no part


def _h2d_gbps(device: str, nbytes: int = 1 << 30) -> float:
    """Pinned host-to-device copy bandwidth of this rank's GPU (0.0 on CPU): the floor of a restore into CUDA tensors."""
    import torch

    if device == "cpu":
        return 0.0
    src = torch.empty(nbytes, dtype=torch.uint8, pin_memory=True)
    dst = torch.empty(nbytes, dtype=torch.uint8, device=device)
    rate = 0.0
    for _ in range(2):
        torch.cuda.synchronize()
        t = time.perf_counter()
        dst.copy_(src, non_blocking=True)
        torch.cuda.synchronize()
        rate = nbytes / (time.perf_counter() - t) / 1e9
    del src, dst
    return rate


def rank_main(dim: int, layers: int, base: str, shm: str, world: int, backend: str = "gloo") -> dict:
    import torch
    import torch.distributed as dist
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.state_dict import get_state_dict, set_state_dict

    import shardckpt

    torch.set_num_threads(1)
    dist.init_process_group(backend)
    rank = dist.get_rank()
    device = "cpu"
    if backend == "nccl":
        torch.cuda.set_device(int(os.environ.get("LOCAL_RANK", rank)))
        device = f"cuda:{torch.cuda.current_device()}"
    rpn = world // 2
    node = os.path.join(shm, f"node{rank // rpn}")
    model, opt = _build(dim, layers, device)
    want = _snapshot(model, opt)
    state = {"model": model, "optim": opt, "step": 1}
    tier = shardckpt.MemoryTier(dir=node, ranks_per_node=rpn)
    out = {"link_gbps": _link_gbps(rank, rpn, device), "h2d_gbps": _h2d_gbps(device)}
    mgr = shardckpt.CheckpointManager(os.path.join(base, "root"), memory=tier)
    dist.barrier()
    t = time.perf_counter()
    mgr.save_to_memory(1, state)
    out["memory_save_s"] = time.perf_counter() - t  # what training waits for
    mgr._memory.snapshots.wait()  # the step held: both copies complete and verified (background)
    out["memory_held_s"] = time.perf_counter() - t
    mgr.save(1, state)
    msd, osd = get_state_dict(model, opt)
    dcp.save({"model": msd, "optim": osd}, checkpoint_id=os.path.join(base, "dcp"))
    out["bytes"] = sum(v.numel() * v.element_size() for v in want.values())
    dist.barrier()
    if rank == 0:
        shutil.rmtree(os.path.join(shm, "node1"), ignore_errors=True)  # node 1 lost
    dist.barrier()

    def check():
        got = _snapshot(model, opt)
        assert all(torch.equal(got[k], want[k]) for k in want), "restored values differ"

    def timed(name, fn, drop=None):
        _zero(model, opt)
        if drop and rank == 0:
            out[name.replace("_s", "_cache")] = drop_page_cache([drop])
        dist.barrier()
        t = time.perf_counter()
        fn()
        out[name] = time.perf_counter() - t
        check()

    restorer = shardckpt.CheckpointManager(os.path.join(base, "root"), memory=tier)
    if os.environ.get("BENCH_PROFILE") == str(rank):  # where the memory restore's time goes, on one rank
        import cProfile
        import pstats

        prof = cProfile.Profile()
        timed("memory_restore_s", lambda: prof.runcall(restorer.restore, state))
        with open(os.environ.get("BENCH_PROFILE_OUT", "memory_restore.prof.txt"), "w") as f:
            pstats.Stats(prof, stream=f).sort_stats("cumulative").print_stats(30)
    else:
        timed("memory_restore_s", lambda: restorer.restore(state))
    last = restorer._memory.last_restore
    out["memory_phases"] = last.get("seconds", {})
    # Bytes this rank received over the group (tensor ranges + manifest/index files) against what its load needs.
    out["received_bytes"] = last.get("peer_bytes", 0) + last.get("meta_bytes", 0)
    out["needed_bytes"] = last.get("needed_bytes", 0)
    out["sent_bytes"] = last.get("sent_bytes", 0)
    assert restorer.restored_from == "memory:1", restorer.restored_from
    timed("storage_restore_s", lambda: shardckpt.CheckpointManager(os.path.join(base, "root")).restore(state), os.path.join(base, "root"))

    def dcp_load():
        msd, osd = get_state_dict(model, opt)
        sd = {"model": msd, "optim": osd}
        dcp.load(sd, checkpoint_id=os.path.join(base, "dcp"))
        set_state_dict(model, opt, model_state_dict=sd["model"], optim_state_dict=sd["optim"])

    timed("dcp_load_s", dcp_load, os.path.join(base, "dcp"))
    dist.barrier()
    dist.destroy_process_group()
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--world", type=int, default=4)
    ap.add_argument("--dim", type=int, default=1024)
    ap.add_argument("--layers", type=int, default=8)
    ap.add_argument("--dir", default=None, help="storage and DCP checkpoints (default: a temporary directory)")
    ap.add_argument("--shm", default="/dev/shm", help="where the two nodes' memory directories go")
    ap.add_argument("--repeat", type=int, default=1)
    ap.add_argument("--backend", default="gloo", help="gloo (CPU) or nccl (one GPU per rank)")
    a = ap.parse_args()
    if a.world < 2 or a.world % 2:
        raise SystemExit("--world must be even (2 nodes)")
    base = a.dir or tempfile.mkdtemp(prefix="bench-memrestore-")
    rows = []
    for i in range(a.repeat):
        shm = tempfile.mkdtemp(prefix="bench-memtier-", dir=a.shm)
        run_base = os.path.join(base, f"run{i}")
        try:
            res = run_isolated_ranks(__file__, "rank_main", {"dim": a.dim, "layers": a.layers, "base": run_base, "shm": shm, "world": a.world, "backend": a.backend}, a.world, timeout=1800)
        finally:
            shutil.rmtree(shm, ignore_errors=True)
            shutil.rmtree(run_base, ignore_errors=True)
        agg = {k: max(r[k] for r in res) for k in ("memory_save_s", "memory_restore_s", "storage_restore_s", "dcp_load_s")}
        agg["state_bytes"] = sum(r["bytes"] for r in res)
        agg["link_gbps"] = max(r["link_gbps"] for r in res)
        agg["memory_phases_slowest_rank"] = max((r["memory_phases"] for r in res), key=lambda p: sum(p.values()))
        agg["received_vs_needed"] = [[r["received_bytes"], r["needed_bytes"]] for r in res]
        agg["sent_bytes"] = [r["sent_bytes"] for r in res]
        agg["storage_cache"] = res[0].get("storage_restore_cache", "?")
        most = max(res, key=lambda r: r["received_bytes"])
        agg["max_received_ratio"] = most["received_bytes"] / max(1, most["needed_bytes"])
        # The aim for the memory path: max(1 s, 1.25 x bytes the most-receiving rank needs / link
        # bandwidth) + the pinned host-to-device copy of that rank's shard (CUDA only).
        agg["h2d_gbps"] = min((r["h2d_gbps"] for r in res), default=0.0)
        h2d_s = most["needed_bytes"] / (agg["h2d_gbps"] * 1e9) if agg["h2d_gbps"] else 0.0
        agg["aim_s"] = max(1.0, 1.25 * most["needed_bytes"] / (agg["link_gbps"] * 1e9)) + h2d_s
        agg["memory_vs_storage"] = agg["storage_restore_s"] / agg["memory_restore_s"]
        agg.update(world=a.world, dim=a.dim, layers=a.layers, run=i)
        print(json.dumps(agg), flush=True)
        rows.append(agg)
    print(markdown_table(
        ["run", "state MiB", "link GB/s", "memory save s", "memory restore s", "aim s", "storage restore s", "DCP load s",
         "storage / memory", "max received / needed"],
        [[r["run"], f"{r['state_bytes'] / 2**20:.0f}", f"{r['link_gbps']:.2f}", f"{r['memory_save_s']:.2f}",
          f"{r['memory_restore_s']:.2f}", f"{r['aim_s']:.2f}",
          f"{r['storage_restore_s']:.2f}", f"{r['dcp_load_s']:.2f}", f"{r['memory_vs_storage']:.2f}x",
          f"{r['max_received_ratio']:.4f}"] for r in rows],
    ))
    print(json.dumps(machine_info(base)))
    if a.dir is None:
        shutil.rmtree(base, ignore_errors=True)


if __name__ == "__main__":
    main()
