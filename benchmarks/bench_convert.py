"""Conversions side by side: shardckpt's converters vs DCP's, on the same data in one run.

Data: a model state of ``--gb`` GB (fp32 matrices, 16 tensors) saved on 2
gloo ranks as FSDP2 would shard it (``Shard(0)`` DTensors), three times:
with ``shardckpt.save``, with ``dcp.save`` (FileSystemWriter), and with
``dcp.save`` through ``HuggingFaceStorageWriter(save_distributed=True)``
(DCP's sharded safetensors). Then, each in its own fresh process (so peak
RSS is its own), from warm page cache:

* ``shardckpt.converters.to_safetensors``  native -> HF ``model.safetensors``
* ``shardckpt.converters.to_full``         native -> one ``.safetensors``
* ``shardckpt.converters.to_full``         native -> one ``.pt``
* ``shardckpt.converters.reshard``         native (2 ranks) -> native for 4 ranks
* ``shardckpt.converters.from_safetensors`` the HF export above -> native
* ``dcp_to_torch_save``                    DCP -> one ``.pt``
* ``consolidate_safetensors_files``        DCP HF shards -> ``model-00001-of-00001.safetensors``

Reported per route: seconds until the call returns, seconds until the output
is durable (shardckpt fsyncs before returning; DCP's routes do not, so their
files are fsync'ed after the call and that time added), GB/s on the durable
time, and the growth of peak RSS during the call (VmHWM after minus before,
imports excluded). Only floating-point tensors: DCP's HF consolidation fails
on int/bool tensors.

    python benchmarks/bench_convert.py --gb 2 --out /tmp/bench_convert.json
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
from _common import fsync_tree, machine_info, markdown_table, run_isolated, run_isolated_ranks  # noqa: E402

NTENSORS = 16
COLS = 1024


def _hwm() -> int:
    with open("/proc/self/status") as f:
        return int(next(l for l in f if l.startswith("VmHWM")).split()[1]) * 1024


def make_data(root: str, gb: float) -> dict:
    """Rank function: build the sharded state and save it three ways (run under run_isolated_ranks)."""
    import torch
    import torch.distributed as dist
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.hf_storage import HuggingFaceStorageWriter
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import Shard, distribute_tensor

    import shardckpt

    dist.init_process_group("gloo")
    world = dist.get_world_size()
    torch.set_num_threads(1)
    mesh = init_device_mesh("cpu", (world,))
    rows = max(world, int(gb * 1e9 / NTENSORS / (COLS * 4)))
    sd = {}
    for i in range(NTENSORS):
        g = torch.Generator().manual_seed(i)
        full = torch.rand(rows, COLS, generator=g)  # same on every rank; each keeps its rows
        sd[f"layers.{i}.weight"] = distribute_tensor(full, mesh, [Shard(0)], src_data_rank=None)
        del full
    t0 = time.perf_counter()
    shardckpt.save({"model": sd}, f"{root}/native")
    t_native = time.perf_counter() - t0
    dcp.save({"model": sd}, checkpoint_id=f"{root}/dcp")
    dcp.save({f"model.{k}": v for k, v in sd.items()},
             storage_writer=HuggingFaceStorageWriter(path=f"{root}/dcp_hf", save_distributed=True))
    dist.barrier()
    dist.destroy_process_group()
    return {"rows": rows, "native_save_s": t_native}


def convert(route: str, src: str, dst: str) -> dict:
    """Child: one conversion in a fresh process; time and peak-RSS growth."""
    import torch  # noqa: F401  (imports before the baseline)

    from shardckpt import converters

    if route == "dcp_to_torch_save":
        from torch.distributed.checkpoint.format_utils import dcp_to_torch_save
    if route == "dcp_consolidate_hf":
        from torch.distributed.checkpoint import FileSystemReader
        from torch.distributed.checkpoint._consolidate_hf_safetensors import consolidate_safetensors_files

        fqns = list(FileSystemReader(src).read_metadata().state_dict_metadata) if os.path.exists(f"{src}/.metadata") else None
        os.makedirs(dst, exist_ok=True)  # it does not create its output directory
    base = _hwm()
    t0 = time.perf_counter()
    if route == "to_safetensors":
        converters.to_safetensors(src, dst, max_shard_size="100GB")
    elif route in ("to_full_safetensors", "to_full_pt"):
        converters.to_full(src, dst)
    elif route == "reshard":
        converters.reshard(src, dst, world_size=4)
    elif route == "from_safetensors":
        converters.from_safetensors(src, dst)
    elif route == "dcp_to_torch_save":
        dcp_to_torch_save(src, dst)
    elif route == "dcp_consolidate_hf":
        if fqns is None:
            from safetensors import safe_open

            fqns = set()
            for n in os.listdir(src):
                if n.endswith(".safetensors"):
                    with safe_open(os.path.join(src, n), "pt") as f:
                        fqns.update(f.keys())
        consolidate_safetensors_files(src, dst, fqn_to_index_mapping=dict.fromkeys(sorted(fqns), 1), num_threads=4)
    else:
        raise ValueError(route)
    returned = time.perf_counter() - t0
    if route.startswith("dcp_"):
        fsync_tree(dst)  # shardckpt already fsynced; make DCP's output as durable
    durable = time.perf_counter() - t0
    return {"returned_s": returned, "durable_s": durable, "rss_growth": _hwm() - base}


def check_outputs(out: str) -> dict:
    """Child: the converted files hold the same tensor values (spot check of every tensor)."""
    import torch
    from safetensors import safe_open

    ref = {}
    with safe_open(f"{out}/hf/model.safetensors", "pt") as f:
        for k in f.keys():
            ref["model." + k] = f.get_slice(k)[:4]
    ok = {}
    with safe_open(f"{out}/full.safetensors", "pt") as f:
        ok["to_full_safetensors"] = all(torch.equal(f.get_slice(k)[:4], ref[k]) for k in ref)
    dcp_hf = [n for n in os.listdir(f"{out}/dcp_hf") if n.endswith(".safetensors")]
    with safe_open(f"{out}/dcp_hf/{dcp_hf[0]}", "pt") as f:
        ok["dcp_consolidate_hf"] = all(torch.equal(f.get_slice(k)[:4], ref[k]) for k in ref)
    for name in ("full.pt", "dcp.pt"):
        pt = torch.load(f"{out}/{name}", mmap=True, weights_only=True)
        flat = pt["model"] if "model" in pt else pt
        ok[name] = all(torch.equal(flat[k[len("model."):]][:4], ref[k]) for k in ref)
    return ok


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--gb", type=float, default=2.0, help="checkpoint size in GB (default 2)")
    ap.add_argument("--dir", default=None, help="work directory (default: a temp dir, removed after)")
    ap.add_argument("--out", default=None, help="write results as JSON here")
    ap.add_argument("--repeat", type=int, default=1, help="runs per route (the best is kept)")
    args = ap.parse_args()
    root = args.dir or tempfile.mkdtemp(prefix="bench-convert-")
    data, out = os.path.join(root, "data"), os.path.join(root, "out")
    try:
        shutil.rmtree(data, ignore_errors=True)
        os.makedirs(data)
        made = run_isolated_ranks(__file__, "make_data", {"root": data, "gb": args.gb}, 2, timeout=3600)
        nbytes = made[0]["rows"] * COLS * 4 * NTENSORS
        routes = [
            ("shardckpt to_safetensors", "to_safetensors", f"{data}/native", "hf"),
            ("shardckpt to_full (.safetensors)", "to_full_safetensors", f"{data}/native", "full.safetensors"),
            ("shardckpt to_full (.pt)", "to_full_pt", f"{data}/native", "full.pt"),
            ("shardckpt reshard (2 -> 4 ranks)", "reshard", f"{data}/native", "rs4"),
            ("shardckpt from_safetensors (HF -> native)", "from_safetensors", f"{out}/hf", "from_hf"),
            ("DCP dcp_to_torch_save (.pt)", "dcp_to_torch_save", f"{data}/dcp", "dcp.pt"),
            ("DCP consolidate_safetensors_files", "dcp_consolidate_hf", f"{data}/dcp_hf", "dcp_hf"),
        ]
        results = {}
        for label, route, src, dst in routes:
            best = None
            for _ in range(args.repeat):
                path = os.path.join(out, dst)
                shutil.rmtree(path, ignore_errors=True) if os.path.isdir(path) else (os.path.exists(path) and os.remove(path))
                os.makedirs(out, exist_ok=True)
                os.sync()  # earlier routes' dirty pages must not be flushed on this one's clock
                r = run_isolated(__file__, "convert", {"route": route, "src": src, "dst": path}, timeout=3600)
                if best is None or r["durable_s"] < best["durable_s"]:
                    best = r
            results[label] = best
            print(f"{label}: {best}", flush=True)
        checks = run_isolated(__file__, "check_outputs", {"out": out}, timeout=600)
        rows = []
        for label, r in results.items():
            rows.append([label, r["returned_s"], r["durable_s"], nbytes / 1e9 / r["durable_s"], r["rss_growth"] / 2**20])
        print()
        print(f"{nbytes / 1e9:.2f} GB, {NTENSORS} fp32 tensors, saved on 2 ranks (Shard(0)); warm page cache")
        print(markdown_table(["route", "returned (s)", "durable (s)", "GB/s (durable)", "peak RSS growth (MiB)"], rows))
        print("outputs agree:", checks)
        info = machine_info(root)
        print("machine:", json.dumps(info))
        if args.out:
            with open(args.out, "w") as f:
                json.dump({"nbytes": nbytes, "results": results, "checks": checks, "machine": info, "made": made}, f, indent=1)
    finally:
        if args.dir is None:
            shutil.rmtree(root, ignore_errors=True)


if __name__ == "__main__":
    main()
