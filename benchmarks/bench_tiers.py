"""Local first, then remote: the training loop's blocking time per save, local disk only vs ``local=`` with a slow or stalled S3 remote.

One process, one state (``--size-mb`` of fp32), one training loop of
``--steps`` steps (``--step-s`` seconds of "compute", a sleep, then a save),
run once per case in the same run:

- ``local-only``: ``CheckpointManager(local_dir)``: the baseline;
- ``tiers-delayed``: ``CheckpointManager(s3, local=dir)`` with the fault
  proxy delaying every new S3 connection by ``--delay-s`` (a slow remote);
- ``tiers-stalled``: the same, every S3 connection opened in the first
  ``--stall-s`` seconds hangs (the request is read and never answered) until
  the proxy heals;
- ``direct-delayed``: ``CheckpointManager(s3)`` through the delaying proxy,
  no ``local=`` (what the loop blocks for without the local tier).

The server is SeaweedFS on loopback (tests/_weed.py) behind
tests/_faultproxy.py, which runs in a process of its own (a real remote is
another machine: the proxy's Python threads must not share the measured
process's GIL). Prints one JSON object: per case the blocking time of
each ``save()`` (median, max), its ratio to ``local-only``'s median, the
remote steps committed, how long the final ``wait()`` (flush catch-up) took.

Usage::

    python benchmarks/bench_tiers.py --size-mb 64 --steps 8 --step-s 0.5 --stall-s 30
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import statistics
import sys
import tempfile
import threading
import time
import uuid
from typing import Any, Dict, List, Optional

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, HERE)
sys.path.insert(0, os.path.join(os.path.dirname(HERE), "tests"))


CASES = ("tiers-delayed", "tiers-stalled", "direct-delayed")


def _serve_proxy(upstream_port: int, conn) -> None:
    """Child process: one FaultProxy, driven by ``(method, kwargs)`` messages; replies with its result."""
    from _faultproxy import FaultProxy

    proxy = FaultProxy(("127.0.0.1", upstream_port), seed=1)
    conn.send(proxy.endpoint)
    while True:
        method, kw = conn.recv()
        if method == "close":
            proxy.close()
            conn.send(None)
            return
        if method == "stats":
            conn.send(dict(proxy.stats))
        else:
            proxy.set_faults(**kw)
            conn.send(None)


class _ProxyProcess:
    """The fault proxy in a process of its own: a real remote is another machine, so its byte pumping
    (Python threads) must not take the GIL from the training process being measured."""

    def __init__(self, upstream_port: int):
        import multiprocessing as mp

        ctx = mp.get_context("spawn")
        self._conn, child = ctx.Pipe()
        self._proc = ctx.Process(target=_serve_proxy, args=(upstream_port, child), daemon=True)
        self._proc.start()
        self.endpoint = self._conn.recv()
        self._lock = threading.Lock()  # the heal timer's thread calls too

    def _call(self, method: str, **kw: Any) -> Any:
        with self._lock:
            self._conn.send((method, kw))
            return self._conn.recv()

    def set_faults(self, **kw: Any) -> None:
        self._call("set_faults", **kw)

    @property
    def stats(self) -> Dict[str, int]:
        return self._call("stats")

    def close(self) -> None:
        try:
            self._call("close")
        finally:
            self._proc.join(timeout=10)
            if self._proc.is_alive():
                self._proc.kill()


def _loop(mgr, state, steps: int, step_s: float) -> List[float]:
    blocked = []
    for step in range(1, steps + 1):
        time.sleep(step_s)  # the training step's compute
        state["w"].add_(1.0)
        t0 = time.perf_counter()
        mgr.save(step, state)
        blocked.append(time.perf_counter() - t0)
    return blocked


def _case(name: str, blocked: List[float], base: Optional[float], **extra: Any) -> Dict[str, Any]:
    med = statistics.median(blocked)
    out = {"case": name, "blocked_s": [round(b, 4) for b in blocked], "median_s": round(med, 4), "max_s": round(max(blocked), 4)}
    if base:
        out["median_vs_local"] = round(med / base, 3)
        out["max_vs_local_median"] = round(max(blocked) / base, 3)
    out.update(extra)
    return out


def main(argv: Optional[List[str]] = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n", 1)[0])
    ap.add_argument("--size-mb", type=int, default=64)
    ap.add_argument("--steps", type=int, default=8)
    ap.add_argument("--step-s", type=float, default=0.5)
    ap.add_argument("--delay-s", type=float, default=1.0, help="delay of every new S3 connection (tiers-delayed, direct-delayed)")
    ap.add_argument("--stall-s", type=float, default=30.0, help="how long S3 hangs in tiers-stalled")
    ap.add_argument("--server-bin", default=None)
    ap.add_argument("--server-dir", default=None,
                    help="where the S3 server keeps its data (default: the temp dir). On one machine, another disk or "
                         "/dev/shm keeps the 'remote' from writing to the local tier's disk, as a real remote does not")
    ap.add_argument("--cases", default=",".join(CASES),
                    help=f"comma-separated, after local-only: {', '.join(CASES + ('tiers-delayed-noyield',))} "
                         "(the last: tiers-delayed with the flusher not yielding to saves, _flush.YIELD_MAX_S = 0)")
    ap.add_argument("--json", default=None)
    args = ap.parse_args(argv)

    import torch
    from _weed import SEAWEED_BUCKET, SeaweedServer, seaweed_options

    import shardckpt
    from shardckpt import _flush

    yield_max = _flush.YIELD_MAX_S
    state = {"w": torch.randn(args.size_mb << 18), "step": 0}
    nbytes = state["w"].numel() * 4
    server = SeaweedServer(args.server_bin, data_dir=args.server_dir)
    results: List[Dict[str, Any]] = []
    try:
        opts = seaweed_options(server.endpoint)
        port = int(opts["endpoint_url"].rsplit(":", 1)[1])
        with tempfile.TemporaryDirectory() as tmp:
            # A first save in the process pays one-time costs (imports, allocations): not any case's.
            shardckpt.save(state, os.path.join(tmp, "warm-up"))
            # Baseline: local disk only.
            with shardckpt.CheckpointManager(os.path.join(tmp, "local-only"), keep_last=2) as mgr:
                base_blocked = _loop(mgr, state, args.steps, args.step_s)
            base = statistics.median(base_blocked)
            results.append(_case("local-only", base_blocked, None))

            for case in args.cases.split(","):
                if case not in CASES + ("tiers-delayed-noyield",):
                    raise SystemExit(f"unknown case {case!r}")
                _flush.YIELD_MAX_S = 0.0 if case.endswith("noyield") else yield_max
                proxy = _ProxyProcess(port)
                heal = None
                if case == "tiers-stalled":
                    proxy.set_faults(stall=1.0, stall_s=args.stall_s)
                    heal = threading.Timer(args.stall_s * 0.9, proxy.set_faults)
                    heal.start()
                else:
                    proxy.set_faults(delay=1.0, delay_s=args.delay_s)
                remote = f"s3://{SEAWEED_BUCKET}/bench-tiers-{uuid.uuid4().hex[:8]}"
                ropts = dict(opts, endpoint_url=proxy.endpoint)
                local = os.path.join(tmp, f"{case}-{len(results)}") if case.startswith("tiers") else None
                t_start = time.perf_counter()
                try:
                    mgr = shardckpt.CheckpointManager(remote, local=local, keep_last=2, storage_options=ropts)
                    blocked = _loop(mgr, state, args.steps, args.step_s)
                    loop_s = time.perf_counter() - t_start
                    durable_at_loop_end = mgr.durable_step
                    t0 = time.perf_counter()
                    mgr.wait()
                    catch_up = time.perf_counter() - t0
                    flusher = mgr._tiers.flusher if mgr._tiers is not None else None
                    extra = {
                        "loop_s": round(loop_s, 2),
                        "durable_at_loop_end": durable_at_loop_end,
                        "wait_after_loop_s": round(catch_up, 2),
                        "remote_steps": mgr.remote_steps(),
                        "skipped_flushes": list(flusher.skipped) if flusher else [],
                        "last_flush_s": round(flusher.last_flush[1], 2) if flusher and flusher.last_flush else None,
                        "proxy": dict(proxy.stats),
                    }
                    mgr.close()
                    for s in extra["remote_steps"]:
                        shardckpt.verify(f"{remote}/step-{s:08d}", storage_options=opts)
                    extra["remote_verified"] = True
                finally:
                    if heal is not None:
                        heal.cancel()
                    proxy.close()
                results.append(_case(case, blocked, base, **extra))
    finally:
        server.stop()
    out = {
        "machine": f"{platform.node()} {platform.machine()}, {os.cpu_count()} CPUs, {platform.python_version()}",
        "date": time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime()),
        "state_bytes": nbytes,
        "steps": args.steps,
        "step_s": args.step_s,
        "delay_s": args.delay_s,
        "stall_s": args.stall_s,
        "server_dir": args.server_dir or tempfile.gettempdir(),
        "local_dir": tempfile.gettempdir(),
        "cases": results,
    }
    print(json.dumps(out, indent=1))
    if args.json:
        with open(args.json, "w") as f:
            json.dump(out, f, indent=1)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
