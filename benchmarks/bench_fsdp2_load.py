"""Cold load of an FSDP2 model + AdamW on one GPU: shardckpt against DCP, same state, one run.

Builds a ~3.2 B-parameter MLP stack on the GPU (fp32), ``fully_shard``-ed
(world size 1), takes one AdamW step so that the optimizer state exists
(params + exp_avg + exp_avg_sq: ~38 GB), then for each of shardckpt and DCP:
save, fsync, drop the files from the page cache (``posix_fadvise``), zero the
model and optimizer state, load cold, check the values, and report wall time,
host RSS growth at peak (``VmHWM`` reset before the load) and the pinned host
memory left after the load returns. Checkpoints are deleted between cases
(the disk holds one).

Usage (one GPU):
  python benchmarks/bench_fsdp2_load.py --dir /tmp/bench --blocks 23
  python benchmarks/bench_fsdp2_load.py --blocks 2 --dim 1024   # a small smoke run
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


def _status(key: str) -> int:
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith(key + ":"):
                return int(line.split()[1]) * 1024
    return 0


def _reset_peak() -> None:
    with open("/proc/self/clear_refs", "w") as f:
        f.write("5")  # resets VmHWM to the current RSS


def _drop_cache(root: str) -> None:
    for d, _, files in os.walk(root):
        for n in files:
            fd = os.open(os.path.join(d, n), os.O_RDONLY)
            try:
                os.fsync(fd)
                os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
            finally:
                os.close(fd)


def _build(blocks: int, dim: int, ff: int):
    from torch.distributed.fsdp import fully_shard

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
        fully_shard(block)
    fully_shard(model)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-4)
    for p in model.parameters():
        p.grad = torch.randn_like(p) * 1e-3
    opt.step()
    opt.zero_grad(set_to_none=True)
    return model, opt


def _fingerprint(model, opt) -> float:
    tot = torch.zeros((), dtype=torch.float64, device="cuda")
    for p in model.parameters():
        tot += p.to_local().double().sum()
    for st in opt.state.values():
        for v in st.values():
            if isinstance(v, torch.Tensor) and v.is_floating_point():
                t = v.to_local() if hasattr(v, "to_local") else v
                tot += t.double().sum()
    return float(tot)


def _zero(model, opt) -> None:
    with torch.no_grad():
        for p in model.parameters():
            p.to_local().zero_()
        for st in opt.state.values():
            for v in st.values():
                if isinstance(v, torch.Tensor):
                    (v.to_local() if hasattr(v, "to_local") else v).zero_()


def _host_pinned() -> int:
    try:
        return int(torch.cuda.host_memory_stats().get("allocated_bytes.current", 0))
    except Exception:  # older torch
        return -1


def _disk_device(path):
    """The block device under ``path`` (sysfs name), or "" (tmpfs, unknown)."""
    from shardckpt._storage._local import queue_info

    return queue_info(path).get("device", "")


def _case(name, model, opt, path, want, reuse=False):
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.state_dict import get_state_dict, set_state_dict

    import shardckpt
    from shardckpt import _knobs
    from shardckpt._load import load_settings

    # "shardckpt:T:B:R": T I/O threads, B MiB of read buffers, R MiB per read;
    # plain "shardckpt": the defaults for CUDA targets; a trailing ":nocrc"
    # skips the CRC checks (SHARDCKPT_CHECKSUMS=0: the checksum's cost);
    # "...@KNOB=value" loads with ``_knobs.KNOB`` set (wave 12:
    # "shardckpt@LOAD_LANES=0", the scheduling before the lanes; with --reuse).
    label = name
    name, _, setting = name.partition("@")
    knob = setting.partition("=")[0] if setting else None
    knob_was = getattr(_knobs, knob) if knob else None
    kind, *opts = name.split(":")
    nocrc = bool(opts) and opts[-1] == "nocrc"
    opts = [o for o in opts if o != "nocrc"]
    _knobs.CHECKSUMS = not nocrc
    kw = {}
    if opts:
        kw = {"io_threads": int(opts[0]), "buffer_bytes": int(opts[1]) << 20}
        _knobs.LOAD_RANGE_BYTES = int(opts[2]) << 20
    knobs = {}
    if kind == "shardckpt":
        threads, buf = load_settings(True, threads=kw.get("io_threads"), buffer_bytes=kw.get("buffer_bytes"))
        knobs = {"io_threads": threads, "buffer_MiB": buf >> 20, "range_MiB": _knobs.LOAD_RANGE_BYTES >> 20,
                 "block_KiB": _knobs.BLOCK_BYTES >> 10, "defaults": not opts}
        print(f"{name}: load with io_threads={threads} buffer_bytes={buf >> 20}MiB "
              f"range_bytes={_knobs.LOAD_RANGE_BYTES >> 20}MiB ({'defaults' if not opts else 'given'})", flush=True)
    t0 = time.perf_counter()
    if reuse and os.path.exists(path):
        pass  # --reuse: load the checkpoint the previous case of this kind saved
    elif kind == "shardckpt":
        shutil.rmtree(path, ignore_errors=True)
        _knobs.CHECKSUMS = True
        shardckpt.save({"model": model, "optim": opt}, path)
        _knobs.CHECKSUMS = not nocrc
    else:
        shutil.rmtree(path, ignore_errors=True)
        msd, osd = get_state_dict(model, opt)
        dcp.save({"model": msd, "optim": osd}, checkpoint_id=path)
    torch.cuda.synchronize()
    save_s = time.perf_counter() - t0
    nbytes = sum(os.path.getsize(os.path.join(d, f)) for d, _, fs in os.walk(path) for f in fs)
    _drop_cache(path)
    _zero(model, opt)
    torch.cuda.synchronize()
    rss0 = _status("VmRSS")
    pinned0 = _host_pinned()
    _reset_peak()
    if knob:
        setattr(_knobs, knob, setting.partition("=")[2])
    from bench_cold_profile import _disk_delta, _diskstats  # (benchmarks/ is this script's directory)

    dev = _disk_device(path)
    disk0 = _diskstats(dev) if dev else None
    t0 = time.perf_counter()
    if kind == "shardckpt":
        try:
            shardckpt.load({"model": model, "optim": opt}, path, **kw)
        finally:
            if knob:
                setattr(_knobs, knob, knob_was)
    else:
        msd, osd = get_state_dict(model, opt)
        sd = {"model": msd, "optim": osd}
        dcp.load(sd, checkpoint_id=path)
        set_state_dict(model, opt, model_state_dict=sd["model"], optim_state_dict=sd["optim"])
    torch.cuda.synchronize()
    load_s = time.perf_counter() - t0
    disk = _disk_delta(dev, disk0, load_s) if disk0 else {}
    peak = _status("VmHWM")
    got = _fingerprint(model, opt)
    out = {
        "case": label,
        **{"disk_" + k: v for k, v in disk.items()},
        "bytes": nbytes,
        "save_s": round(save_s, 2),
        "load_s": round(load_s, 2),
        "load_GBps": round(nbytes / load_s / 1e9, 3),
        "rss_growth_GiB": round((peak - rss0) / 2**30, 2),
        "rss_after_minus_before_GiB": round((_status("VmRSS") - rss0) / 2**30, 2),
        "pinned_before_load_bytes": pinned0,
        "pinned_after_load_bytes": _host_pinned(),
        "values_ok": abs(got - want) <= 1e-6 * max(1.0, abs(want)),
        **knobs,
        "checksums": not nocrc,
    }
    _knobs.CHECKSUMS = True
    if not reuse:
        shutil.rmtree(path, ignore_errors=True)
    print(json.dumps(out), flush=True)
    return out


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--dir", default="/tmp/bench-fsdp2")
    p.add_argument("--blocks", type=int, default=23)
    p.add_argument("--dim", type=int, default=4096)
    p.add_argument("--ff", type=int, default=16384)
    p.add_argument("--cases", default="shardckpt,dcp")
    p.add_argument("--json")
    p.add_argument("--reuse", action="store_true", help="save once per library, load it for every case of that library")
    a = p.parse_args(argv)
    os.environ.setdefault("MASTER_ADDR", "127.0.0.1")
    os.environ.setdefault("MASTER_PORT", "29533")
    dist.init_process_group("cpu:gloo,cuda:nccl", rank=0, world_size=1)
    torch.cuda.set_device(0)
    model, opt = _build(a.blocks, a.dim, a.ff)
    nparams = sum(p.numel() for p in model.parameters())
    print(f"params={nparams / 1e9:.2f}B state={nparams * 12 / 1e9:.1f}GB torch={torch.__version__}", flush=True)
    want = _fingerprint(model, opt)
    res = [_case(c, model, opt, os.path.join(a.dir, c.split(":")[0].split("@")[0]), want, a.reuse) for c in a.cases.split(",")]
    shutil.rmtree(a.dir, ignore_errors=True)
    if a.json:
        with open(a.json, "w") as f:
            json.dump(res, f, indent=1)
    dist.destroy_process_group()
    return 0 if all(r["values_ok"] for r in res) else 1


if __name__ == "__main__":
    sys.exit(main())
