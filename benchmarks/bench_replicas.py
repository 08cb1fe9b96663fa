"""What the replica check adds to a save: HSDP (replicate x shard) + AdamW, replicas="check" against "off", DCP beside.

Run under torchrun (one process per GPU, or gloo ranks on CPU)::

    torchrun --nproc-per-node 2 benchmarks/bench_replicas.py --params 2.5e9 --dir /tmp/bench   # 2 GPUs, HSDP 2x1
    torchrun --nproc-per-node 2 benchmarks/bench_replicas.py --params 2e7 --device cpu --dir /tmp/bench

The model is ``--layers`` square Linear layers (no bias) under ``fully_shard``
on a (replicate=world/shard, shard=--shard) mesh; one AdamW step creates the
optimizer state, so every tensor (weights, exp_avg, exp_avg_sq, step) has
world/shard copies. Each repeat saves the same state with ``replicas="off"``
and ``replicas="check"`` (the default), in alternating order, then DCP's
``dcp.save``; each checkpoint is removed after its save (disk space). Also
timed alone: ``_fingerprint.check_replicas`` (the fingerprints and their
exchange: what "check" adds). Rank 0 prints one JSON line: medians,
``added_pct`` = (check - off) / off and ``check_alone_pct`` = check alone / off.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import statistics
import sys
import time


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--params", type=float, default=2.5e9, help="parameters (default 2.5e9)")
    p.add_argument("--layers", type=int, default=40)
    p.add_argument("--shard", type=int, default=1, help="size of the shard mesh dim (default 1: HSDP world x 1)")
    p.add_argument("--device", choices=["cuda", "cpu"], default="cuda")
    p.add_argument("--dir", default="bench-out/replicas")
    p.add_argument("--repeat", type=int, default=2)
    p.add_argument("--no-dcp", dest="dcp", action="store_false")
    args = p.parse_args(argv)

    import torch
    import torch.distributed as dist
    import torch.nn as nn
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard

    import shardckpt
    from shardckpt import _fingerprint
    from shardckpt._collective import open_comm
    from shardckpt._save import _layouts
    from shardckpt._state import flatten_for_save

    cuda = args.device == "cuda"
    dist.init_process_group("cuda:nccl,cpu:gloo" if cuda else "gloo")
    rank, world = dist.get_rank(), dist.get_world_size()
    if cuda:
        torch.cuda.set_device(int(os.environ.get("LOCAL_RANK", rank)))
    dev = torch.device("cuda" if cuda else "cpu")
    dim = int((args.params / args.layers) ** 0.5) // 64 * 64
    torch.manual_seed(0)
    with torch.device(dev):
        model = nn.Sequential(*[nn.Linear(dim, dim, bias=False) for _ in range(args.layers)])
    mesh = init_device_mesh(dev.type, (world // args.shard, args.shard), mesh_dim_names=("replicate", "shard"))
    for layer in model:
        fully_shard(layer, mesh=mesh)
    fully_shard(model, mesh=mesh)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-4)
    model(torch.randn(8, dim, device=dev)).sum().backward()
    opt.step()
    if cuda:
        torch.cuda.synchronize()
    state = {"model": model, "optim": opt}
    n_params = sum(p.numel() for p in model.parameters())
    os.makedirs(args.dir, exist_ok=True)

    def barrier():
        if cuda:
            torch.cuda.synchronize()
        dist.barrier()

    def timed(fn):
        barrier()
        t0 = time.perf_counter()
        fn()
        barrier()
        return time.perf_counter() - t0

    def save(mode, i):
        url = os.path.join(args.dir, f"{mode}-{i}")
        took = timed(lambda: shardckpt.save(state, url, replicas=mode))
        if rank == 0:
            shutil.rmtree(url)
        dist.barrier()
        return took

    # What "check" adds, alone: the fingerprints where the tensors live, and their exchange.
    flat = flatten_for_save(state, rank=rank, world=world)
    layouts = _layouts(flat.tensors, rank, world)
    comm = open_comm(None, op="bench")
    replicated = sum(v.numel() * v.element_size() for _, v in _fingerprint.replicated_parts(layouts))

    def check_alone():
        _fingerprint.check_replicas(comm, layouts, url="bench", mode="check")

    res = {"off": [], "check": [], "dcp": [], "check_alone": []}
    timed(check_alone)  # warm-up (kernels, the exchange)
    save("off", "warm")
    for i in range(args.repeat):
        for mode in (("off", "check") if i % 2 == 0 else ("check", "off")):
            res[mode].append(save(mode, i))
        res["check_alone"].append(timed(check_alone))
        if args.dcp:
            import torch.distributed.checkpoint as dcp
            from torch.distributed.checkpoint.state_dict import get_state_dict

            url = os.path.join(args.dir, f"dcp-{i}")
            msd, osd = get_state_dict(model, opt)
            sd = {"model": msd, "optim": osd}
            res["dcp"].append(timed(lambda sd=sd, url=url: dcp.save(sd, checkpoint_id=url)))
            if rank == 0:
                shutil.rmtree(url)
            dist.barrier()
    if rank == 0:
        med = {k: (statistics.median(v) if v else None) for k, v in res.items()}
        out = {
            "world": world, "mesh": [world // args.shard, args.shard], "device": args.device,
            "params": n_params, "replicated_bytes_per_rank": replicated,
            "gpu": torch.cuda.get_device_name() if cuda else None, "torch": torch.__version__,
            "runs_s": res, "median_s": med,
            "added_pct": 100 * (med["check"] - med["off"]) / med["off"],
            "check_alone_pct": 100 * med["check_alone"] / med["off"],
            "fingerprint_gbps_per_rank": replicated / med["check_alone"] / 1e9,
        }
        print(json.dumps(out), flush=True)
    dist.destroy_process_group()
    return 0


if __name__ == "__main__":
    sys.exit(main())
