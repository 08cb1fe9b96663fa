"""Several GPUs, one host: save, async stall, commit and cold load of FSDP2 / HSDP + AdamW, shardckpt vs DCP.

One process per GPU under torchrun. Builds an MLP stack (fp32) over a device
mesh — ``fsdp2``: sharded over every GPU; ``hsdp``: replicated over every GPU
(``RxS`` = world x 1 by default: each GPU holds the whole state, the case
where every replica used to read every byte; ``--replicate R`` for R x
world/R, e.g. HSDP 2x2 on 4 GPUs) — takes one AdamW step so the optimizer
state exists, then for shardckpt and DCP in the same run:

* sync save (fsync'ed: shardckpt commits durably; DCP's files are fsync'ed
  by the benchmark before the clock stops);
* async save: the stall (until the call returns) and the commit (until the
  result is in);
* cold load (files dropped from the page cache on the host first); for
  shardckpt with the read-once load (``SHARDCKPT_LOAD_READ_ONCE=1``, the
  default) and without it, with the bytes read from storage across all ranks.

Every load is checked against a fingerprint of the state. Prints one JSON
line per case on rank 0 (and ``--json`` the list).

    torchrun --nproc-per-node 2 benchmarks/bench_replicated_load.py --layout hsdp --blocks 18
    torchrun --nproc-per-node 2 benchmarks/bench_replicated_load.py --layout fsdp2 --blocks 2 --dim 1024   # smoke
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import sys
import time

import torch
import torch.distributed as dist

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, HERE)
sys.path.insert(0, os.path.dirname(HERE))

from bench_fsdp2_load import _drop_cache, _fingerprint, _status, _zero  # noqa: E402


def _build(layout: str, blocks: int, dim: int, ff: int, replicate: int = 0):
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard

    world = dist.get_world_size()
    rep = replicate or world
    mesh = init_device_mesh("cuda", (world,)) if layout == "fsdp2" else init_device_mesh(
        "cuda", (rep, world // rep), mesh_dim_names=("replicate", "shard")
    )
    torch.manual_seed(0)
    model = torch.nn.Sequential(
        *[
            torch.nn.Sequential(
                torch.nn.Linear(dim, ff, bias=False, device="cuda"), torch.nn.Linear(ff, dim, bias=False, device="cuda")
            )
            for _ in range(blocks)
        ]
    )
    for block in model:
        fully_shard(block, mesh=mesh)
    fully_shard(model, mesh=mesh)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-4)
    for p in model.parameters():
        p.grad = torch.randn_like(p) * 1e-3
    opt.step()
    opt.zero_grad(set_to_none=True)
    return model, opt


def _sync():
    torch.cuda.synchronize()
    dist.barrier()


def _fsync_tree(root: str) -> None:
    for d, _, files in os.walk(root):
        for n in files:
            fd = os.open(os.path.join(d, n), os.O_RDONLY)
            try:
                os.fsync(fd)
            finally:
                os.close(fd)


def _dir_bytes(path: str) -> int:
    return sum(os.path.getsize(os.path.join(d, f)) for d, _, fs in os.walk(path) for f in fs)


def _fp_all(model, opt) -> float:
    t = torch.tensor([_fingerprint(model, opt)], dtype=torch.float64, device="cuda")
    dist.all_reduce(t)
    return float(t.item())


class _Count:
    """Bytes of data files read from storage by this process (``Storage.read_into``)."""

    def __enter__(self):
        from shardckpt import _storage

        self.n, self.orig = 0, _storage.Storage.read_into

        def read_into(s, rel, ranges):
            if rel.startswith("data/"):
                self.n += sum(len(b) for _, b in ranges)
            return self.orig(s, rel, ranges)

        _storage.Storage.read_into = read_into
        return self

    def __exit__(self, *exc):
        from shardckpt import _storage

        _storage.Storage.read_into = self.orig


def run(args) -> list:
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.state_dict import get_state_dict, set_state_dict

    import shardckpt
    from shardckpt import _knobs

    rank, world = dist.get_rank(), dist.get_world_size()
    model, opt = _build(args.layout, args.blocks, args.dim, args.ff, args.replicate)
    nparams = sum(p.numel() for p in model.parameters())  # global
    want = _fp_all(model, opt)
    out = []

    def emit(rec):
        rep = args.replicate or world
        name = f"{rep}x{world // rep}" if args.layout == "hsdp" else f"x{world}"
        rec = {"layout": f"{args.layout} {name}", "world": world, **rec}
        out.append(rec)
        if rank == 0:
            print(json.dumps(rec), flush=True)

    if rank == 0:
        print(f"params={nparams / 1e9:.2f}B state={nparams * 12 / 1e9:.1f}GB world={world} layout={args.layout} "
              f"torch={torch.__version__} gpu={torch.cuda.get_device_name()}", flush=True)

    def cold(path):
        _sync()
        if rank == 0:
            _drop_cache(path)
        _zero(model, opt)
        _sync()

    def timed(fn):
        _sync()
        t0 = time.perf_counter()
        r = fn()
        _sync()
        return time.perf_counter() - t0, r

    for lib in args.libs.split(","):
        path = os.path.join(args.dir, lib)
        if rank == 0:
            shutil.rmtree(path, ignore_errors=True)
        _sync()
        if lib == "shardckpt":
            def save(path=path):
                shardckpt.save({"model": model, "optim": opt}, path)
        else:
            def save(path=path):
                msd, osd = get_state_dict(model, opt)
                dcp.save({"model": msd, "optim": osd}, checkpoint_id=path)
                _sync()
                if rank == 0:
                    _fsync_tree(path)  # durable, as shardckpt's commit is
        save_s, _ = timed(save)
        nbytes = _dir_bytes(path)
        emit({"lib": lib, "op": "save", "s": round(save_s, 2), "GBps": round(nbytes / save_s / 1e9, 3), "bytes": nbytes})
        modes = [("read_once", True), ("each_replica_reads", False)] if lib == "shardckpt" else [("", None)]
        for label, once in modes:
            cold(path)
            rss0 = _status("VmRSS")
            with _Count() as c:
                if lib == "shardckpt":
                    _knobs.LOAD_READ_ONCE = once
                    load_s, _ = timed(lambda path=path: shardckpt.load({"model": model, "optim": opt}, path))
                    _knobs.LOAD_READ_ONCE = True
                else:
                    def dload(path=path):
                        msd, osd = get_state_dict(model, opt)
                        sd = {"model": msd, "optim": osd}
                        dcp.load(sd, checkpoint_id=path)
                        set_state_dict(model, opt, model_state_dict=sd["model"], optim_state_dict=sd["optim"])
                    load_s, _ = timed(dload)
            got = _fp_all(model, opt)
            n = torch.tensor([c.n], dtype=torch.float64, device="cuda")
            dist.all_reduce(n)
            rec = {"lib": lib, "op": "cold_load" + (f" ({label})" if label else ""), "s": round(load_s, 2),
                   "GBps": round(nbytes / load_s / 1e9, 3), "values_ok": abs(got - want) <= 1e-6 * max(1.0, abs(want)),
                   "rss_growth_GiB_rank0": round((_status("VmHWM") - rss0) / 2**30, 2)}
            if lib == "shardckpt":
                rec["storage_read_x"] = round(n.item() / nbytes, 3)
            emit(rec)
        if rank == 0:
            shutil.rmtree(path, ignore_errors=True)
        _sync()
        # async: stall until the call returns, commit until the result is in
        t0 = time.perf_counter()
        if lib == "shardckpt":
            h = shardckpt.async_save({"model": model, "optim": opt}, path + "-async")
            stall = time.perf_counter() - t0
            h.result()
        else:
            msd, osd = get_state_dict(model, opt)
            fut = dcp.async_save({"model": msd, "optim": osd}, checkpoint_id=path + "-async")
            stall = time.perf_counter() - t0
            fut.result()
        commit = time.perf_counter() - t0
        _sync()
        emit({"lib": lib, "op": "async_save", "stall_s": round(stall, 2), "commit_s": round(commit, 2),
              "host_rss_GiB_rank0": round(_status("VmRSS") / 2**30, 1)})
        if rank == 0:
            shutil.rmtree(path + "-async", ignore_errors=True)
        _sync()
    return out


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--dir", default="/tmp/bench-replicated")
    p.add_argument("--layout", choices=["fsdp2", "hsdp"], default="hsdp")
    p.add_argument("--blocks", type=int, default=18)
    p.add_argument("--dim", type=int, default=4096)
    p.add_argument("--ff", type=int, default=16384)
    p.add_argument("--libs", default="shardckpt,dcp", help="libraries in the order they run (dcp,shardckpt for the other order)")
    p.add_argument("--replicate", type=int, default=0, help="hsdp: size of the replicate mesh dim (default: every GPU, world x 1)")
    p.add_argument("--json")
    a = p.parse_args(argv)
    local = int(os.environ.get("LOCAL_RANK", "0"))
    torch.cuda.set_device(local)
    dist.init_process_group("cpu:gloo,cuda:nccl")
    res = run(a)
    if a.json and dist.get_rank() == 0:
        with open(a.json, "w") as f:
            json.dump(res, f, indent=1)
    dist.destroy_process_group()
    return 0 if all(r.get("values_ok", True) for r in res) else 1


if __name__ == "__main__":
    sys.exit(main())
