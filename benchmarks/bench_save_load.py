"""Save/load throughput of shardckpt against DCP, safetensors and the raw disk, on one state dict.

Every case saves the SAME fp32 state dict (a transformer-like mix of matrices
and vectors, ``--size-gb`` in total, random values), fsync'ed, then the page
cache is dropped and the case loads it back cold and checks the values.
Each save and each load runs in a fresh process, so its peak RSS is its own.

Cases:
  raw            one file, sequential ``os.write`` of every tensor's bytes + fsync;
                 read back with ``readinto`` straight into preallocated tensors (the floor)
  shardckpt      ``shardckpt.save`` / ``shardckpt.load`` (in place, checksums verified)
  shardckpt-nocrc  the same with crc32c switched off (benchmark-only switch) -> checksum cost
  dcp-t1, dcp-t2 ``dcp.save`` with ``FileSystemWriter(path, thread_count=1|2)`` (fsyncs by
                 default) / ``dcp.load`` with ``FileSystemReader`` (in place)
  safetensors    ``safetensors.torch.save_file`` + an explicit fsync of the file (save_file
                 does not fsync) / ``load_file`` + ``copy_`` into the live tensors (what
                 ``load_state_dict`` does; ``load_file`` alone maps the file and reads lazily)

Usage:
  python benchmarks/bench_save_load.py --size-gb 2 --repeat 2 --dir bench-out
  python benchmarks/bench_save_load.py --size-gb 0.25 --cases shardckpt,raw
  python benchmarks/bench_save_load.py --ranks 2            # gloo ranks, DTensor Shard(0), per-rank writes
  python benchmarks/bench_save_load.py --device cuda        # tensors on GPU: D2H / H2D included

GB here is 10^9 bytes. Peak RSS includes the interpreter, torch and the state
dict itself; "extra" is the peak minus the RSS just before the measured call
(with the state, or the load destination, already resident).
"""

from __future__ import annotations

import argparse
import contextlib
import json
import math
import os
import shutil
import statistics
import sys
import time
import warnings
from typing import Any, Dict, List, Optional, Tuple

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from _common import (  # noqa: E402
    GB,
    Stopwatch,
    cached_fraction,
    drop_page_cache,
    files_under,
    gbps,
    machine_info,
    markdown_table,
    peak_rss_bytes,
    rss_bytes,
    run_isolated,
    run_isolated_ranks,
)

CASES = ["raw", "shardckpt", "shardckpt-nocrc", "dcp-t1", "dcp-t2", "safetensors"]
DESCRIPTIONS = {
    "raw": "raw sequential write+fsync / read (floor)",
    "shardckpt": "shardckpt save / load (checksums on)",
    "shardckpt-nocrc": "shardckpt, crc32c off (benchmark switch)",
    "dcp-t1": "DCP FileSystemWriter thread_count=1 / FileSystemReader",
    "dcp-t2": "DCP FileSystemWriter thread_count=2 / FileSystemReader",
    "safetensors": "safetensors save_file + fsync / load_file + copy_",
}


# --------------------------------------------------------------------------
# the state dict


def state_spec(size_bytes: int) -> List[Tuple[str, Tuple[int, ...]]]:
    """Names and shapes of an fp32 transformer-like state dict of about ``size_bytes``.

    Per layer: 4 square attention matrices, 3 MLP matrices (hidden = 2.75 x
    width, not a power of two), 2 norm vectors; an embedding takes the rest.
    """
    widths = [2048, 1024, 512, 256, 128, 64, 16]

    def layer(d: int) -> List[Tuple[str, Tuple[int, ...]]]:
        f = int(d * 2.75)
        return [("q", (d, d)), ("k", (d, d)), ("v", (d, d)), ("o", (d, d)), ("up", (f, d)), ("gate", (f, d)),
                ("down", (d, f)), ("norm1", (d,)), ("norm2", (d,))]

    def nbytes(shapes) -> int:
        return sum(4 * math.prod(s) for _, s in shapes)

    d = next((w for w in widths if nbytes(layer(w)) <= size_bytes), widths[-1])
    per_layer = nbytes(layer(d))
    layers = max(1, size_bytes // per_layer)
    spec = [(f"layers.{i}.{n}", s) for i in range(layers) for n, s in layer(d)]
    rows = (size_bytes - layers * per_layer) // (4 * d)
    if rows > 0:
        spec.insert(0, ("embed", (int(rows), d)))
    return spec


def _dist():
    import torch.distributed as dist

    return dist if dist.is_available() and dist.is_initialized() else None


def _device(device: str):
    import torch

    if device == "cuda":
        d = _dist()
        idx = (d.get_rank() if d else 0) % max(1, torch.cuda.device_count())
        torch.cuda.set_device(idx)
        return torch.device("cuda", idx)
    return torch.device("cpu")


def make_state(size_bytes: int, device: str, *, fill: bool, seed: int = 0) -> Dict[str, Any]:
    """The benchmark state: random values (``fill``) or zeros already resident (a load target).

    With a process group, every tensor is a DTensor sharded on dim 0 over all ranks.
    """
    import torch

    dev = _device(device)
    d = _dist()
    mesh = None
    if d is not None:
        from torch.distributed.device_mesh import init_device_mesh

        mesh = init_device_mesh(dev.type, (d.get_world_size(),))
    state: Dict[str, Any] = {}
    for i, (name, shape) in enumerate(state_spec(size_bytes)):
        if mesh is not None:
            from torch.distributed.tensor import Shard
            from torch.distributed.tensor._utils import compute_local_shape_and_global_offset

            local_shape, _ = compute_local_shape_and_global_offset(shape, mesh, [Shard(0)])
        else:
            local_shape = shape
        t = torch.empty(local_shape, dtype=torch.float32, device=dev)
        if fill:
            g = torch.Generator(device=dev).manual_seed(seed * 1_000_003 + i * 7919 + (d.get_rank() if d else 0))
            t.uniform_(-1, 1, generator=g)
        else:
            t.fill_(0)  # resident, like a live model's memory
        if mesh is not None:
            from torch.distributed.tensor import DTensor, Shard

            t = DTensor.from_local(t, mesh, [Shard(0)], run_check=False, shape=torch.Size(shape),
                                   stride=torch.empty(shape, device="meta").stride())
        state[name] = t
    if dev.type == "cuda":
        torch.cuda.synchronize()
    return state


def _local(t):
    return t.to_local() if hasattr(t, "to_local") else t


def fingerprint(state: Dict[str, Any]) -> Dict[str, List[float]]:
    """Per tensor: the sum and a strided sample's sum (position-sensitive), of this rank's data."""
    out = {}
    for name, t in sorted(state.items()):
        flat = _local(t).detach().reshape(-1)
        out[name] = [float(flat.sum()), float(flat[::1009].sum())]
    return out


def _check(name: str, got: Dict[str, List[float]], want: Dict[str, List[float]]) -> None:
    bad = sorted(k for k in want if k not in got or any(
        not math.isclose(a, b, rel_tol=1e-9, abs_tol=1e-6) for a, b in zip(got[k], want[k])))
    if bad or set(got) != set(want):
        raise AssertionError(f"{name}: loaded values differ from the saved ones: {bad[:5]} keys {len(got)} vs {len(want)}")


def nbytes_of(state: Dict[str, Any]) -> int:
    return sum(_local(t).numel() * _local(t).element_size() for t in state.values())


# --------------------------------------------------------------------------
# the cases (each call runs in its own process)


def _fsync_file(path: str) -> None:
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)
    dfd = os.open(os.path.dirname(os.path.abspath(path)), os.O_RDONLY)
    try:
        os.fsync(dfd)
    finally:
        os.close(dfd)


def _rank() -> Tuple[int, int]:
    d = _dist()
    return (d.get_rank(), d.get_world_size()) if d else (0, 1)


def _cpu_tensors(state):
    return {k: _local(v).detach().cpu().contiguous() for k, v in state.items()}


@contextlib.contextmanager
def _quiet_dcp():
    """DCP warns on every single-process call, even with ``no_dist=True``."""
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", message=".*assuming the intent is to (save|load) in a single process.*")
        yield


def do_save(case: str, path: str, state: Dict[str, Any]) -> None:
    import torch

    rank, world = _rank()
    if case == "raw":
        os.makedirs(path, exist_ok=True)
        f = os.path.join(path, f"raw-r{rank}.bin")
        fd = os.open(f, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o644)
        try:
            for _, t in sorted(state.items()):
                mv = memoryview(_local(t).detach().cpu().contiguous().reshape(-1).view(torch.uint8).numpy())
                while len(mv):
                    mv = mv[os.write(fd, mv):]
            os.fsync(fd)
        finally:
            os.close(fd)
        _fsync_file(f)
    elif case.startswith("shardckpt"):
        import shardckpt

        shardckpt.save(state, path)
    elif case.startswith("dcp-t"):
        import torch.distributed.checkpoint as dcp

        writer = dcp.FileSystemWriter(path, thread_count=int(case[len("dcp-t"):]))
        with _quiet_dcp():
            dcp.save(state, storage_writer=writer, no_dist=_dist() is None)
    elif case == "safetensors":
        from safetensors.torch import save_file

        os.makedirs(path, exist_ok=True)
        f = os.path.join(path, f"model-r{rank}.safetensors")
        save_file(_cpu_tensors(state) if world > 1 or any(_local(t).is_cuda for t in state.values()) else state, f)
        _fsync_file(f)  # save_file does not fsync; the other cases do
    else:
        raise ValueError(case)


def do_load(case: str, path: str, state: Dict[str, Any], device: str) -> Dict[str, Any]:
    """Load into ``state`` in place; returns it."""
    import torch

    rank, _ = _rank()
    if case == "raw":
        dev = _device(device)
        with open(os.path.join(path, f"raw-r{rank}.bin"), "rb", buffering=0) as f:
            for _, t in sorted(state.items()):
                loc = _local(t)
                dst = loc if dev.type == "cpu" else torch.empty(loc.shape, dtype=loc.dtype, pin_memory=True)
                mv = memoryview(dst.reshape(-1).view(torch.uint8).numpy())
                while len(mv):
                    n = f.readinto(mv)
                    if not n:
                        raise EOFError(path)
                    mv = mv[n:]
                if dst is not loc:
                    loc.copy_(dst, non_blocking=True)
        return state
    if case.startswith("shardckpt"):
        import shardckpt

        shardckpt.load(state, path)
        return state
    if case.startswith("dcp-t"):
        import torch.distributed.checkpoint as dcp

        with _quiet_dcp():
            dcp.load(state, storage_reader=dcp.FileSystemReader(path), no_dist=_dist() is None)
        return state
    if case == "safetensors":
        from safetensors.torch import load_file

        loaded = load_file(os.path.join(path, f"model-r{rank}.safetensors"), device=str(_device(device)))
        # load_file maps the file and pages come in on first touch: copy into
        # the live tensors, as load_state_dict would, so every byte is read.
        for name, t in state.items():
            _local(t).copy_(loaded[name])
        return state
    raise ValueError(case)


def _sync(device: str) -> None:
    import torch

    if device == "cuda":
        torch.cuda.synchronize()
    d = _dist()
    if d is not None:
        d.barrier()


def _setup(case: str, device: str, threads: Optional[int]) -> None:
    import torch

    if threads:
        torch.set_num_threads(threads)
    if "WORLD_SIZE" in os.environ and int(os.environ["WORLD_SIZE"]) > 1:
        import torch.distributed as dist

        dist.init_process_group("cpu:gloo,cuda:nccl" if device == "cuda" else "gloo")
    if case == "shardckpt-nocrc":
        from shardckpt import _knobs

        _knobs.CHECKSUMS = False  # the SHARDCKPT_CHECKSUMS knob, set in-process


def _teardown() -> None:
    from shardckpt import _knobs

    _knobs.CHECKSUMS = True  # in-process runs (tests) must not leak it to later saves
    d = _dist()
    if d is not None:
        d.destroy_process_group()


def _warmup(case: str, path: str, device: str) -> None:
    """A tiny save and load first, so imports and first-call set-up stay out of the timing.

    After a system-wide cache drop, a lazy import inside the timed call would
    otherwise read Python and shared libraries from disk.
    """
    tmp = path.rstrip("/") + ".warmup"
    tiny = make_state(1 << 16, device, fill=True, seed=1)
    try:
        do_save(case, tmp, tiny)
        do_load(case, tmp, make_state(1 << 16, device, fill=False), device)
        _sync(device)
    finally:
        if _rank()[0] == 0:
            shutil.rmtree(tmp, ignore_errors=True)
        _sync(device)


def child(case: str, phase: str, path: str, size_bytes: int, device: str = "cpu", seed: int = 0,
          want: Optional[List[Dict[str, List[float]]]] = None, threads: Optional[int] = None) -> Dict[str, Any]:
    """One measurement (``phase`` "save" or "load") of one case; returns seconds, bytes, memory."""
    _setup(case, device, threads)
    try:
        rank, _ = _rank()
        _warmup(case, path, device)
        if phase == "save":
            state = make_state(size_bytes, device, fill=True, seed=seed)
            _sync(device)
            before = rss_bytes()
            with Stopwatch() as sw:
                do_save(case, path, state)
                _sync(device)
            return {"seconds": sw.seconds, "nbytes": nbytes_of(state), "rss_before": before,
                    "peak_rss": peak_rss_bytes(), "fingerprint": fingerprint(state)}
        state = make_state(size_bytes, device, fill=False)
        _sync(device)
        before = rss_bytes()
        with Stopwatch() as sw:
            loaded = do_load(case, path, state, device)
            _sync(device)
        peak = peak_rss_bytes()
        if want is not None:
            _check(case, fingerprint(loaded), want[rank])
        return {"seconds": sw.seconds, "nbytes": nbytes_of(loaded), "rss_before": before, "peak_rss": peak}
    finally:
        _teardown()


# --------------------------------------------------------------------------
# driver


def _run(args, case: str, phase: str, path: str, want=None) -> List[Dict[str, Any]]:
    kwargs = dict(case=case, phase=phase, path=path, size_bytes=int(args.size_gb * GB), device=args.device,
                  want=want, threads=args.torch_threads)
    if not args.isolate:
        if args.ranks > 1:
            raise SystemExit("--no-isolate runs one process: use --ranks 1")
        r = child(**kwargs)
        r["peak_rss"] = None  # shared with the other cases: not meaningful
        return [r]
    if args.ranks > 1:
        return run_isolated_ranks(__file__, "child", kwargs, args.ranks, timeout=args.timeout)
    return [run_isolated(__file__, "child", kwargs, timeout=args.timeout)]


def _agg(per_rank: List[Dict[str, Any]]) -> Dict[str, Any]:
    peaks = [r["peak_rss"] for r in per_rank if r.get("peak_rss") is not None]
    return {
        "seconds": max(r["seconds"] for r in per_rank),  # wall time of the collective
        "nbytes": sum(r["nbytes"] for r in per_rank),
        "peak_rss": max(peaks) if peaks else None,
        "extra_rss": max((r["peak_rss"] - r["rss_before"]) for r in per_rank) if peaks else None,
    }


def run_cases(args) -> Dict[str, Any]:
    root = os.path.abspath(args.dir)
    os.makedirs(root, exist_ok=True)
    results: Dict[str, Dict[str, List[Dict[str, Any]]]] = {c: {"save": [], "load": []} for c in args.cases}
    drops: List[Tuple[str, Optional[float]]] = []
    for rep in range(args.repeat):
        for case in args.cases:
            path = os.path.join(root, f"{case}-{rep}")
            shutil.rmtree(path, ignore_errors=True)
            try:
                saved = _run(args, case, "save", path)
                method = drop_page_cache([path], how=args.drop_cache) if args.drop_cache != "none" else "none"
                left = cached_fraction([path])
                drops.append((method, left))
                loaded = _run(args, case, "load", path, want=[r["fingerprint"] for r in saved])
            finally:
                if not args.keep:
                    shutil.rmtree(path, ignore_errors=True)
            s, l = _agg(saved), _agg(loaded)
            results[case]["save"].append(s)
            results[case]["load"].append(l)
            ckpt_files = len(files_under(path)) if args.keep else None
            print(f"[{rep + 1}/{args.repeat}] {case:16s} save {gbps(s['nbytes'], s['seconds']):6.2f} GB/s  "
                  f"load {gbps(l['nbytes'], l['seconds']):6.2f} GB/s  (cache: {method}, "
                  f"{'?' if left is None else f'{left:.0%}'} resident before load)"
                  + (f" files={ckpt_files}" if ckpt_files else ""), flush=True)
    return {"results": results, "drops": drops}


def _median_gbps(runs: List[Dict[str, Any]]) -> float:
    return statistics.median(gbps(r["nbytes"], r["seconds"]) for r in runs)


def _fmt_gib(v: Optional[int]) -> Optional[str]:
    return None if v is None else f"{v / 2**30:.2f}"


def report(args, out: Dict[str, Any], info: Dict[str, str]) -> str:
    res = out["results"]
    rows = []
    for case in args.cases:
        s, l = res[case]["save"], res[case]["load"]
        rows.append([
            case,
            _median_gbps(s),
            " / ".join(f"{gbps(r['nbytes'], r['seconds']):.2f}" for r in s),
            _median_gbps(l),
            " / ".join(f"{gbps(r['nbytes'], r['seconds']):.2f}" for r in l),
            _fmt_gib(max((r["peak_rss"] or 0) for r in s) or None),
            _fmt_gib(max((r["extra_rss"] or 0) for r in s) if s[0]["extra_rss"] is not None else None),
            _fmt_gib(max((r["peak_rss"] or 0) for r in l) or None),
            _fmt_gib(max((r["extra_rss"] or 0) for r in l) if l[0]["extra_rss"] is not None else None),
        ])
    nbytes = res[args.cases[0]]["save"][0]["nbytes"]
    rss_note = "per rank, " if args.ranks > 1 else ""
    lines = [
        f"state: {nbytes / GB:.3f} GB fp32 in {len(state_spec(int(args.size_gb * GB)))} tensors, "
        f"device {args.device}, {args.ranks} rank(s), repeat {args.repeat}",
        "",
        markdown_table(
            ["case", "save GB/s (median)", "save runs", "load GB/s cold (median)", "load runs",
             f"save peak RSS GiB ({rss_note}max)", "save extra GiB", f"load peak RSS GiB ({rss_note}max)", "load extra GiB"],
            rows,
        ),
        "",
    ]
    methods = sorted({m for m, _ in out["drops"]})
    lefts = [x for _, x in out["drops"] if x is not None]
    lines.append(f"page cache before each load: dropped with {', '.join(methods)}; "
                 f"resident after the drop: max {max(lefts):.1%}" if lefts else
                 f"page cache before each load: {', '.join(methods)}")
    if "shardckpt" in res and "shardckpt-nocrc" in res:
        for phase in ("save", "load"):
            on = statistics.median(r["seconds"] for r in res["shardckpt"][phase])
            off = statistics.median(r["seconds"] for r in res["shardckpt-nocrc"][phase])
            lines.append(f"checksum cost ({phase}): {100 * (on - off) / off:+.1f}% time "
                         f"(median {on:.3f} s with crc32c, {off:.3f} s without)")
    if "shardckpt" in res:
        sk_s, sk_l = _median_gbps(res["shardckpt"]["save"]), _median_gbps(res["shardckpt"]["load"])
        for ref in ("dcp-t1", "dcp-t2", "raw", "safetensors"):
            if ref in res:
                lines.append(f"shardckpt vs {ref}: save x{sk_s / _median_gbps(res[ref]['save']):.2f}, "
                             f"load x{sk_l / _median_gbps(res[ref]['load']):.2f}")
    lines.append("")
    lines.append("machine: " + "; ".join(f"{k} {v}" for k, v in info.items()))
    return "\n".join(lines)


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--size-gb", type=float, default=2.0, help="state dict size in GB (10^9 bytes), default 2")
    p.add_argument("--dir", default="bench-out", help="scratch directory on the disk to measure (default ./bench-out)")
    p.add_argument("--repeat", type=int, default=1, help="runs of every case; the table shows medians")
    p.add_argument("--cases", default=",".join(CASES), help=f"comma-separated subset of {','.join(CASES)}")
    p.add_argument("--ranks", type=int, default=1, help="processes (gloo; nccl+gloo with --device cuda)")
    p.add_argument("--device", choices=["cpu", "cuda"], default="cpu")
    p.add_argument("--torch-threads", type=int, default=None, help="torch.set_num_threads in every case")
    p.add_argument("--drop-cache", choices=["auto", "fadvise", "none"], default="auto",
                   help="how to make loads cold: auto = /proc/sys/vm/drop_caches if permitted (system-wide), "
                        "else posix_fadvise DONTNEED on the checkpoint's files; fadvise = only the latter "
                        "(kinder to a shared machine); none = warm loads")
    p.add_argument("--no-isolate", dest="isolate", action="store_false",
                   help="run every case in this process (fast smoke test; peak RSS not reported)")
    p.add_argument("--keep", action="store_true", help="keep the checkpoints under --dir")
    p.add_argument("--timeout", type=float, default=1800, help="seconds per measured process")
    p.add_argument("--json", help="also write raw results here")
    p.add_argument("--markdown", help="also write the report here")
    args = p.parse_args(argv)
    args.cases = [c.strip() for c in args.cases.split(",") if c.strip()]
    unknown = [c for c in args.cases if c not in CASES]
    if unknown or not args.cases:
        p.error(f"unknown case(s) {unknown}; choose from {CASES}")
    if args.size_gb <= 0 or args.repeat < 1 or args.ranks < 1:
        p.error("--size-gb, --repeat and --ranks must be positive")

    info = machine_info(os.path.abspath(args.dir) if os.path.exists(args.dir) else ".")
    t0 = time.perf_counter()
    out = run_cases(args)
    text = report(args, out, info)
    print()
    print(text)
    print(f"\n(total {time.perf_counter() - t0:.0f} s)")
    if args.markdown:
        with open(args.markdown, "w") as f:
            f.write(text + "\n")
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"args": vars(args), "machine": info, **out}, f, indent=1)
    return 0


if __name__ == "__main__":
    sys.exit(main())
