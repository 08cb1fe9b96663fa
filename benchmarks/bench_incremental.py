"""Incremental saves: bytes written and save time per save, incremental vs full vs DCP (issue 23).

Cases, each on ``--ranks`` gloo ranks (CPU, DTensors sharded on dim 0), a
run of ``--saves`` saves of the same state under one root:

* ``lora``: a frozen base of ``--base-mb`` MB (fp32 matrices) and an
  adapter of ``--adapter-pct`` percent of it that changes before every save;
* ``dense``: every tensor changes before every save (incremental must cost
  about what a full save costs).

For each case: shardckpt full saves (``CheckpointManager``), shardckpt
incremental saves (``incremental=True``) and DCP (``dcp.save`` into a new
directory each time). Per save: bytes of data files written (the step's own
files; references are not bytes written) and wall time (barrier to barrier,
the slowest rank). ``--hash-only``: the content hash's speed (BLAKE3, SHA-256,
CRC-32C for scale) over 256 MiB in memory, one thread.

Usage::

    python benchmarks/bench_incremental.py --hash-only
    python benchmarks/bench_incremental.py --ranks 2 --base-mb 200 --saves 4 --out /tmp/inc

Prints one JSON object. Numbers are recorded in docs/incremental.md.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import sys
import tempfile
import time
from typing import Any, Dict, List


def hash_speeds(mib: int = 256, repeat: int = 5) -> Dict[str, float]:
    """GB/s of each hash over ``mib`` MiB of random bytes (best of ``repeat``)."""
    from shardckpt._format.checksum import crc32c, new_hasher

    data = os.urandom(mib << 20)
    mv = memoryview(data)
    block = 32 << 20  # the writer's block (WRITE_BLOCK_BYTES)
    out = {}
    for algo in ("blake3", "sha256", "crc32c"):
        best = float("inf")
        for _ in range(repeat):
            t0 = time.perf_counter()
            if algo == "crc32c":
                c = 0
                for off in range(0, len(mv), block):
                    c = crc32c(mv[off : off + block], c)
            else:
                h = new_hasher(algo)
                for off in range(0, len(mv), block):
                    h.update(mv[off : off + block])
                h.hexdigest()
            best = min(best, time.perf_counter() - t0)
        out[algo] = round(len(data) / best / 1e9, 3)
    return out


def _own_bytes(path: str) -> int:
    total = 0
    for dirpath, _, names in os.walk(path):
        for n in names:
            if n.endswith((".safetensors", ".distcp")):
                total += os.path.getsize(os.path.join(dirpath, n))
    return total


def _worker(rank: int, world: int, port: int, args, q) -> None:
    import torch
    import torch.distributed as dist
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import Shard, distribute_tensor

    import shardckpt

    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    dist.init_process_group("gloo", rank=rank, world_size=world)
    mesh = init_device_mesh("cpu", (world,))
    d = 1024
    n_base = max(1, int(args.base_mb * 1e6) // (d * d * 4))
    r = max(1, int(d * args.adapter_pct / 100 / (2 * world)))  # adapter rows per rank: ~adapter_pct of the base
    g = torch.Generator().manual_seed(0)
    state: Dict[str, Any] = {}
    for i in range(n_base):
        state[f"base.{i}"] = distribute_tensor(torch.randn(d, d, generator=g), mesh, [Shard(0)])
        state[f"lora.{i}"] = distribute_tensor(torch.randn(2 * r * world, d, generator=g), mesh, [Shard(0)])
    changed = sum(v.numel() * 4 for k, v in state.items() if not k.startswith("base"))
    results: Dict[str, Any] = {"base_bytes": n_base * d * d * 4, "adapter_bytes": changed}

    def step_update(case: str, s: int) -> None:
        with torch.no_grad():
            for k, v in state.items():
                if case == "dense" or not k.startswith("base"):
                    v.to_local().add_(1.0)

    for case in args.cases.split(","):
        # full: plain saves (no content hash); incremental: CheckpointManager(incremental=True).
        for how in ("full", "incremental", "dcp"):
            root = os.path.join(args.out, f"{case}-{how}")
            if rank == 0:
                shutil.rmtree(root, ignore_errors=True)
            dist.barrier()
            mgr = shardckpt.CheckpointManager(root, incremental=how == "incremental") if how != "dcp" else None
            per: List[Dict[str, float]] = []
            for s in range(1, args.saves + 1):
                step_update(case, s)
                dist.barrier()
                t0, c0 = time.perf_counter(), time.process_time()
                if mgr is not None:
                    mgr.save(s, {"m": state})
                    path = mgr.step_url(s)
                else:
                    import torch.distributed.checkpoint as dcp

                    path = os.path.join(root, f"step-{s}")
                    dcp.save({"m": state}, storage_writer=dcp.FileSystemWriter(path, thread_count=1))
                cpu = time.process_time() - c0  # this rank's CPU (all its threads): steadier than wall time on a loaded box
                dist.barrier()
                dt = time.perf_counter() - t0
                if rank == 0:
                    per.append({"seconds": round(dt, 3), "cpu_seconds": round(cpu, 3), "bytes": _own_bytes(path)})
            if rank == 0:
                results[f"{case}/{how}"] = per
                shutil.rmtree(root, ignore_errors=True)  # disk: a few GB per case otherwise
            dist.barrier()
    if rank == 0:
        q.put(results)
    dist.destroy_process_group()


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--hash-only", action="store_true")
    p.add_argument("--ranks", type=int, default=2)
    p.add_argument("--base-mb", type=float, default=200.0)
    p.add_argument("--adapter-pct", type=float, default=1.0)
    p.add_argument("--saves", type=int, default=4)
    p.add_argument("--out", default=None)
    p.add_argument("--verbose", action="store_true", help="indent the JSON")
    p.add_argument("--cases", default="lora,dense", help="comma-separated: lora, dense")
    args = p.parse_args(argv)
    if args.hash_only:
        print(json.dumps({"hash_gbps_256MiB": hash_speeds()}, indent=1))
        return 0
    import socket

    import torch.multiprocessing as mp

    args.out = args.out or tempfile.mkdtemp(prefix="bench-inc-")
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    ctx = mp.get_context("spawn")
    q = ctx.Queue()
    procs = [ctx.Process(target=_worker, args=(r, args.ranks, port, args, q)) for r in range(args.ranks)]
    for pr in procs:
        pr.start()
    res = None
    while res is None:
        try:
            res = q.get(timeout=5)
        except Exception:
            if any(pr.exitcode not in (None, 0) for pr in procs) or all(pr.exitcode is not None for pr in procs):
                for pr in procs:
                    pr.kill()
                raise SystemExit(f"a rank failed: exit codes {[pr.exitcode for pr in procs]}") from None
    for pr in procs:
        pr.join()
    res["ranks"], res["saves"] = args.ranks, args.saves
    summary = {}
    for key, per in res.items():
        if isinstance(per, list) and len(per) > 1:
            later = per[1:]
            secs = sorted(p["seconds"] for p in later)
            cpus = sorted(p["cpu_seconds"] for p in later)
            summary[key] = {"first_save_bytes": per[0]["bytes"],
                            "later_save_bytes_mean": round(sum(p["bytes"] for p in later) / len(later)),
                            "later_save_seconds_median": secs[len(secs) // 2],
                            "later_save_cpu_seconds_median": cpus[len(cpus) // 2]}
    for case in ("lora", "dense"):
        full = summary.get(f"{case}/full")
        for other in ("incremental", "dcp"):
            got = summary.get(f"{case}/{other}")
            if got and full:
                summary[f"{case}/{other}_vs_full"] = {
                    "bytes": round(got["later_save_bytes_mean"] / full["later_save_bytes_mean"], 4),
                    "seconds": round(got["later_save_seconds_median"] / full["later_save_seconds_median"], 3),
                    "cpu_seconds": round(got["later_save_cpu_seconds_median"] / full["later_save_cpu_seconds_median"], 3)}
    if "lora/incremental" in summary:
        summary["lora/later_bytes_over_changed"] = round(summary["lora/incremental"]["later_save_bytes_mean"] / res["adapter_bytes"], 4)
    res["summary"] = summary
    print(json.dumps(res, indent=None if not args.verbose else 1).replace('], "', '],\n "'))
    shutil.rmtree(args.out, ignore_errors=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
