"""A dequantizing load of a block-FP8 Hugging Face directory vs the same load of its bf16 twin, same run.

Data: ``--gb`` GB of FP8 weights (``--rows`` x ``--cols`` ``float8_e4m3fn``
matrices, each with its float32 ``_scale_inv`` per 128 x 128 block, and
``config.json``'s ``quantization_config``), and a bf16 directory of the same
tensors (names and shapes; twice the bytes). Both are written once, read
once to warm the page cache, then loaded ``--repeats`` times each,
alternating, by ``shardckpt.load`` into the same live state of ``--dtype``
tensors (bf16 by default: the FP8 load dequantizes into it, the bf16 load
copies), on the CPU or, with ``--device cuda``, on the GPU (the FP8 bytes are
copied to the device and dequantized there; the bf16 bytes copied). Reported:
the best and median seconds of each, the median process CPU seconds (all
threads: what a noisy shared host distorts least), the target GB/s, and the
ratio FP8 / bf16 of the medians and of the bests (the issue's target: within
1.2x).

    python benchmarks/bench_fp8.py --gb 1 --json /tmp/bench_fp8.json
    python benchmarks/bench_fp8.py --gb 1 --device cuda

Limits: page cache only (a disk would make the FP8 load, half the bytes,
look faster); the live state is plain tensors in one process (the FSDP2 path
streams the same pieces per rank).
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import statistics
import sys
import tempfile
import time

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from _common import machine_info, markdown_table  # noqa: E402


def make_dirs(root: str, gb: float, rows: int, cols: int):
    import torch
    from safetensors.torch import save_file

    n = max(1, round(gb * 1e9 / (rows * cols)))
    fp8, bf16 = os.path.join(root, "fp8"), os.path.join(root, "bf16")
    os.makedirs(fp8)
    os.makedirs(bf16)
    g = torch.Generator().manual_seed(0)
    sr, sc = -(-rows // 128), -(-cols // 128)
    per_file = max(1, n // 8)
    names = [f"model.layers.{i}.mlp.down_proj.weight" for i in range(n)]
    for f0 in range(0, n, per_file):
        q8, b16 = {}, {}
        for name in names[f0 : f0 + per_file]:
            codes = torch.randint(0, 256, (rows, cols), dtype=torch.uint8, generator=g)
            codes[(codes & 0x7F) == 0x7F] = 0  # no NaN codes: a quantizer never writes them
            q = codes.view(torch.float8_e4m3fn)
            scale = torch.rand(sr, sc, generator=g) * 1e-2 + 1e-4
            q8[name], q8[name + "_scale_inv"] = q, scale
            b16[name] = torch.randn(rows, cols, generator=g).to(torch.bfloat16)
        rel = f"model-{f0 // per_file + 1:05d}.safetensors"
        save_file(q8, os.path.join(fp8, rel))
        save_file(b16, os.path.join(bf16, rel))
        del q8, b16
    with open(os.path.join(fp8, "config.json"), "w") as f:
        json.dump({"quantization_config": {"quant_method": "fp8", "fmt": "e4m3", "weight_block_size": [128, 128]}}, f)
    return fp8, bf16, names


def _size(d: str) -> int:
    return sum(os.path.getsize(os.path.join(d, f)) for f in os.listdir(d))


def _warm(d: str) -> None:
    for f in os.listdir(d):
        with open(os.path.join(d, f), "rb") as fh:
            while fh.read(64 << 20):
                pass


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--gb", type=float, default=1.0, help="GB of FP8 weights (the bf16 twin is twice that)")
    p.add_argument("--rows", type=int, default=4096)
    p.add_argument("--cols", type=int, default=4096)
    p.add_argument("--dtype", default="bfloat16", help="the live tensors' dtype (bfloat16 or float32)")
    p.add_argument("--device", default="cpu", help="where the live tensors are: cpu or cuda")
    p.add_argument("--repeats", type=int, default=3)
    p.add_argument("--threads", type=int, default=None, help="torch intra-op threads (default: torch's)")
    p.add_argument("--dir", default=None, help="scratch directory (default: a temporary one)")
    p.add_argument("--json", default=None)
    args = p.parse_args(argv)

    import torch

    import shardckpt

    if args.threads:
        torch.set_num_threads(args.threads)
    root = tempfile.mkdtemp(prefix="bench_fp8.", dir=args.dir)
    try:
        fp8, bf16, names = make_dirs(root, args.gb, args.rows, args.cols)
        dtype = getattr(torch, args.dtype)
        dev = torch.device(args.device)
        state = {n: torch.empty(args.rows, args.cols, dtype=dtype, device=dev) for n in names}
        target = sum(t.numel() * t.element_size() for t in state.values())
        sync = torch.cuda.synchronize if dev.type == "cuda" else (lambda: None)
        for d in (fp8, bf16):
            _warm(d)
        shardckpt.load(state, fp8)  # once each before timing: imports, first-touch of the live pages
        shardckpt.load(state, bf16)
        sync()
        times = {"fp8": [], "bf16": []}
        cpu = {"fp8": [], "bf16": []}
        for _ in range(args.repeats):
            for case, d in (("fp8", fp8), ("bf16", bf16)):
                c0, t0 = time.process_time(), time.perf_counter()
                shardckpt.load(state, d)
                sync()
                times[case].append(time.perf_counter() - t0)
                cpu[case].append(time.process_time() - c0)
        best = {k: min(v) for k, v in times.items()}
        med = {k: statistics.median(v) for k, v in times.items()}
        rows = [[case, f"{_size(d) / 1e9:.2f}", f"{best[case]:.3f}", f"{med[case]:.3f}", f"{statistics.median(cpu[case]):.3f}",
                 f"{target / med[case] / 1e9:.2f}"] for case, d in (("fp8", fp8), ("bf16", bf16))]
        ratio, ratio_best = med["fp8"] / med["bf16"], best["fp8"] / best["bf16"]
        md = markdown_table(["directory", "GB on disk", "best s", "median s", "median CPU s", f"GB/s into {args.dtype} ({dev.type})"], rows)
        md += (f"\nFP8 / bf16: {ratio:.2f}x (medians), {ratio_best:.2f}x (bests); torch threads {torch.get_num_threads()}, "
               f"load average {os.getloadavg()[0]:.1f}\n")
        print(md)
        if args.json:
            with open(args.json, "w") as f:
                json.dump({"times": times, "cpu": cpu, "ratio": ratio, "ratio_best": ratio_best, "device": args.device,
                           "threads": torch.get_num_threads(), "loadavg": os.getloadavg()[0], "target_bytes": target, "dtype": args.dtype,
                           "machine": machine_info(root), "date": time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime())}, f, indent=2)
        return 0
    finally:
        shutil.rmtree(root, ignore_errors=True)


if __name__ == "__main__":
    sys.exit(main())
