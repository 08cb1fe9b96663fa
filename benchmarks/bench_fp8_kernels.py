"""The host FP8 dequantize kernels alone: CPU ns per element in 1 thread and in N threads at once, vs torch's own path.

Issue 46's CPU load spends its time in ``_fp8._dequantize_host`` run by the
reader threads; this separates the kernel's per-element cost from the
load around it, and from how it scales over threads (cores, hyperthreads,
memory bandwidth).

    python benchmarks/bench_fp8_kernels.py --threads 1,4,16

Limits: random codes (no NaN), one band shape; CPU time, not wall, per thread.
"""

from __future__ import annotations

import argparse
import os
import sys
import threading
import time

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


def main() -> None:
    import torch

    from shardckpt import _fp8

    p = argparse.ArgumentParser()
    p.add_argument("--rows", type=int, default=512)
    p.add_argument("--cols", type=int, default=7168)
    p.add_argument("--threads", default="1,4,16")
    p.add_argument("--repeat", type=int, default=20)
    a = p.parse_args()
    n, m = a.rows, a.cols

    def make():
        codes = torch.randint(0, 256, (n, m), dtype=torch.uint8)
        codes[(codes & 0x7F) == 0x7F] = 0
        return codes.view(torch.float8_e4m3fn), torch.rand(n // 128, m // 128) * 1e-2 + 1e-4

    def host(q, scale, dst):
        with _fp8._serial() as limit:
            _fp8._dequantize_host(dst, q.view(torch.int8).numpy(), scale, row0=0, col0=0, block=(128, 128),
                                  scale_row0=0, nan=False, limit=limit)

    def native(q, scale, dst):
        with _fp8._serial():
            _fp8.dequantize_native(dst, q, scale, row0=0, col0=0, block=(128, 128))

    print(f"torch {torch.__version__}, {torch.get_num_threads()} torch threads, omp {bool(_fp8._omp_threads())}, "
          f"usable cpus {len(os.sched_getaffinity(0))}")
    for name, fn in (("host kernels", host), ("torch float()*scale", native)):
        for k in [int(x) for x in a.threads.split(",")]:
            cpu = [0.0] * k
            work = [(*make(), torch.empty(n, m, dtype=torch.bfloat16)) for _ in range(k)]
            go = threading.Barrier(k + 1)

            def run(i, go=go, fn=fn, work=work, cpu=cpu):
                go.wait()
                t = time.thread_time()
                for _ in range(a.repeat):
                    fn(*work[i])
                cpu[i] = time.thread_time() - t

            ts = [threading.Thread(target=run, args=(i,)) for i in range(k)]
            for t in ts:
                t.start()
            go.wait()
            w = time.perf_counter()
            for t in ts:
                t.join()
            wall = time.perf_counter() - w
            elems = n * m * a.repeat
            print(f"{name:22s} threads {k:3d}: CPU {sum(cpu) / (elems * k) * 1e9:6.2f} ns/elem, "
                  f"wall {wall / (elems * k) * 1e9:6.3f} ns/elem over all threads ({elems * k / wall / 1e9:.2f} G elem/s)")


if __name__ == "__main__":
    main()
