"""The commit's file bookkeeping at many ranks: manifest file table (v2 vs v3) and the size check (listing vs one stat per file).

Simulates the files of a save of N ranks (one data file and one index file per
rank, named as ``save`` names them) and measures, per N:

- the manifest: bytes, serialize and parse (``manifest_from_bytes``) time, for
  format v2 (every file listed) and v3 (the compact file table);
- ``check_files`` on local disk: one directory listing (``caps.consistent_listing``)
  vs one stat per file (the listing switched off), and the whole ``commit()``;
- with ``--s3 moto`` or ``--s3 seaweed``, the same on an S3 server on loopback
  started here (``moto[server]``, or SeaweedFS's ``weed`` as tests/_weed.py
  finds it): seconds and the requests by kind (ListObjectsV2, HeadObject).

Usage::

    .venv/bin/python benchmarks/bench_commit_files.py --ranks 1024 4096 16384
    .venv/bin/python benchmarks/bench_commit_files.py --ranks 1024 4096 --s3 seaweed --skip-local

Prints a markdown table; ``--json`` writes the numbers. Timings are best of
``--repeat``; results are in docs/scaling.md ("Manifest file table and bulk
size checks").
"""

from __future__ import annotations

import argparse
import collections
import dataclasses
import json
import os
import platform
import shutil
import socket
import subprocess
import sys
import tempfile
import time
import urllib.request
import uuid
from concurrent.futures import ThreadPoolExecutor

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from shardckpt._format import FileMeta, IndexMeta, Manifest, commit, manifest_from_bytes, manifest_to_bytes  # noqa: E402
from shardckpt._format.files import check_files  # noqa: E402
from shardckpt._format.naming import data_file_name, index_file_name  # noqa: E402
from shardckpt._storage import S3Storage, Storage  # noqa: E402
from shardckpt._storage._obstore import ObstoreData  # noqa: E402

SAVE_ID = uuid.UUID(int=0x0123456789ABCDEF0123456789ABCDEF).hex


def rank_files(ranks: int):
    """``({rel: size}, {index rel: IndexMeta})`` of a save of ``ranks`` ranks."""
    files, idx = {}, {}
    for r in range(ranks):
        files[data_file_name(SAVE_ID, f"r{r:05d}-00")] = 1000 + r % 97
        rel = index_file_name(SAVE_ID, r)
        files[rel] = 10 + r % 13
        idx[rel] = IndexMeta(r, files[rel], (r * 2654435761) % 2**32)
    return files, idx


def manifest(ranks: int, version: int) -> Manifest:
    files, idx = rank_files(ranks)
    return Manifest(world_size=ranks, tensors={}, files={k: FileMeta(v) for k, v in files.items()}, save_id=SAVE_ID,
                    version=version, block_bytes=1 << 20, meshes=["iota"], indexes=idx, values={"step": 1})


def best(fn, repeat: int) -> float:
    out = float("inf")
    for _ in range(repeat):
        t = time.perf_counter()
        fn()
        out = min(out, time.perf_counter() - t)
    return out


def bench_manifest(ranks: int, repeat: int) -> dict:
    res = {}
    for version in (2, 3):
        m = manifest(ranks, version)
        data = manifest_to_bytes(m)
        res[f"v{version}"] = {
            "bytes": len(data),
            "serialize_s": best(lambda m=m: manifest_to_bytes(m), repeat),
            "parse_s": best(lambda data=data: manifest_from_bytes(data), repeat),
        }
    return res


def _write_all(st, files) -> None:
    with ThreadPoolExecutor(16) as ex:
        list(ex.map(lambda kv: st.write_atomic(kv[0], b"x" * kv[1]), files.items()))


class Requests:
    """Counts S3 requests by kind on both data clients."""

    def __init__(self):
        self.seen = collections.Counter()
        real_request, real_ob = S3Storage._request, ObstoreData.call
        seen = self.seen

        async def request(self, what, method, **kw):
            seen[method] += 1
            return await real_request(self, what, method, **kw)

        def ob_call(self, what, fn, *a, **kw):
            seen[{"head": "head_object", "put": "put_object"}.get(fn, fn)] += 1
            return real_ob(self, what, fn, *a, **kw)

        S3Storage._request, ObstoreData.call = request, ob_call


def bench_check(st, ranks: int, repeat: int, counter=None) -> dict:
    files, idx = rank_files(ranks)
    _write_all(st, files)
    m = Manifest(world_size=ranks, tensors={}, files={k: FileMeta(v) for k, v in files.items()}, save_id=SAVE_ID,
                 version=3, block_bytes=1 << 20, meshes=["iota"], indexes=idx)
    res = {}
    listing = st.caps
    for mode, caps in (("listing", listing), ("per-file", dataclasses.replace(listing, consistent_listing=False))):
        st.caps = caps
        if counter is not None:
            counter.seen.clear()
        res[mode] = {"check_s": best(lambda: check_files(st, files), repeat)}
        if counter is not None:
            res[mode]["requests_per_check"] = {k: v // repeat for k, v in counter.seen.items()}
        res[mode]["commit_s"] = best(lambda: commit(st, m), repeat)
    st.caps = listing
    return res


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def start_moto():
    exe = os.path.join(os.path.dirname(sys.executable), "moto_server")
    exe = exe if os.path.exists(exe) else shutil.which("moto_server")
    if not exe:
        raise SystemExit("moto_server not found: pip install 'moto[server]'")
    port = _free_port()
    endpoint = f"http://127.0.0.1:{port}"
    os.environ["NO_PROXY"] = "127.0.0.1,localhost"
    proc = subprocess.Popen([exe, "-H", "127.0.0.1", "-p", str(port)], stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    opener = urllib.request.build_opener(urllib.request.ProxyHandler({}))
    deadline = time.monotonic() + 30
    while True:
        try:
            opener.open(endpoint + "/", timeout=1).read()
            break
        except Exception:
            if time.monotonic() > deadline or proc.poll() is not None:
                proc.kill()
                raise SystemExit("moto_server did not start") from None
            time.sleep(0.1)
    opener.open(urllib.request.Request(f"{endpoint}/bench", method="PUT"), timeout=10).read()
    options = {"key": "testing", "secret": "testing", "endpoint_url": endpoint, "client_kwargs": {"region_name": "us-east-1"}}
    return proc, options


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--ranks", type=int, nargs="+", default=[1024, 4096, 16384])
    p.add_argument("--repeat", type=int, default=3)
    p.add_argument("--dir", default=None, help="scratch directory for the local-disk case (default: a temp dir)")
    p.add_argument("--s3", choices=["moto", "seaweed"], default=None,
                   help="also measure on an S3 server on loopback: moto, or SeaweedFS (tests/_weed.py)")
    p.add_argument("--s3-ranks", type=int, nargs="+", default=None, help="ranks for the S3 case (default: --ranks)")
    p.add_argument("--skip-local", action="store_true")
    p.add_argument("--json", default=None)
    args = p.parse_args(argv)
    out = {"machine": {"nproc": os.cpu_count(), "python": platform.python_version(), "date": time.strftime("%Y-%m-%d")}, "results": {}}
    print("| ranks | manifest v2 bytes | v3 bytes | parse v2 s | parse v3 s | serialize v2 s | v3 s |")
    print("|---|---|---|---|---|---|---|")
    for n in args.ranks:
        r = bench_manifest(n, args.repeat)
        out["results"].setdefault(str(n), {})["manifest"] = r
        print(f"| {n:,} | {r['v2']['bytes']:,} | {r['v3']['bytes']:,} | {r['v2']['parse_s']:.3f} | {r['v3']['parse_s']:.3f} "
              f"| {r['v2']['serialize_s']:.3f} | {r['v3']['serialize_s']:.3f} |", flush=True)
    if not args.skip_local:
        print("\n| ranks (files) | local check_files: listing s | per-file s | commit: listing s | per-file s |")
        print("|---|---|---|---|---|")
        for n in args.ranks:
            scratch = tempfile.mkdtemp(prefix="bench-commit-", dir=args.dir)
            try:
                r = bench_check(Storage(os.path.join(scratch, "ck")), n, args.repeat)
            finally:
                shutil.rmtree(scratch, ignore_errors=True)
            out["results"][str(n)]["local"] = r
            print(f"| {n:,} ({2 * n:,}) | {r['listing']['check_s']:.3f} | {r['per-file']['check_s']:.3f} "
                  f"| {r['listing']['commit_s']:.3f} | {r['per-file']['commit_s']:.3f} |", flush=True)
    if args.s3:
        if args.s3 == "moto":
            proc, options = start_moto()
            bucket, stop = "bench", proc.terminate
        else:
            sys.path.insert(0, os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "tests"))
            from _weed import SEAWEED_BUCKET, SeaweedServer, seaweed_options

            server = SeaweedServer()
            options, bucket, stop = seaweed_options(server.endpoint), SEAWEED_BUCKET, server.stop
        counter = Requests()
        try:
            print(f"\n| ranks (objects) | S3 ({args.s3}) check_files: listing s | requests | per-file s | requests |")
            print("|---|---|---|---|---|")
            for n in args.s3_ranks or args.ranks:
                st = Storage(f"s3://{bucket}/ck-{uuid.uuid4().hex[:8]}", storage_options=options)
                r = bench_check(st, n, args.repeat, counter)
                out["results"].setdefault(str(n), {})["s3"] = r
                req = {k: dict(v["requests_per_check"]) for k, v in r.items()}
                print(f"| {n:,} ({2 * n:,}) | {r['listing']['check_s']:.3f} | {req['listing']} "
                      f"| {r['per-file']['check_s']:.3f} | {req['per-file']} |", flush=True)
                st.remove_tree()
        finally:
            stop()
    if args.json:
        with open(args.json, "w") as f:
            json.dump(out, f, indent=2)
    return 0


if __name__ == "__main__":
    sys.exit(main())
