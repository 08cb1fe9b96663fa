"""What a cold read of a real disk does: the disk's own behaviour, then a profile of one shardckpt load (issue 43).

Two parts, one process, page cache dropped before every read
(``/proc/sys/vm/drop_caches`` when root, else ``posix_fadvise``):

``sweep``   the disk alone: ``--sweep-gb`` GB in 8 files read back by
            ``preadv`` from T threads in requests of S bytes, each way of
            asking: ``buffered`` (plain ``preadv``), ``willneed``
            (``POSIX_FADV_WILLNEED`` of the request first, in steps of the
            device's readahead window), ``direct`` (``O_DIRECT`` into aligned
            memory), ``mmap`` (a mapping of the request, every page touched
            by a CRC-32C, as the load's mapped path does); for each, GB/s and
            what ``/proc/diskstats`` saw over the read: requests completed,
            their mean size, the mean queue depth (weighted I/O time / wall).
``load``    a state like a model + AdamW (params, ``exp_avg``, ``exp_avg_sq``,
            a scalar ``step`` per param; big matrices and many small norms)
            of ``--load-gb`` GB saved with ``shardckpt.save``, loaded cold
            into resident tensors (``--device``) once per ``SHARDCKPT_LOAD_DIRECT``
            mode, every storage read, CRC and buffer-pool wait timed by
            wrapping the engine's functions: reads in flight over time
            (sampled every 10 ms), request sizes, seconds of CRC and of waits
            for a free buffer, time before the first read (planning) and after
            the last (finishing), the same diskstats. ``--lanes map,read,0``
            (wave 12) loads once per ``SHARDCKPT_LOAD_LANES`` value too,
            ``--repeat`` rounds alternated (``modes`` then holds a list per setting).

The device's queue settings (``read_ahead_kb``, ``max_sectors_kb``,
``nr_requests``, scheduler) are read from sysfs (never written) and reported.

Usage::

    python benchmarks/bench_cold_profile.py --dir /tmp/x --json out.json
    python benchmarks/bench_cold_profile.py --dir /tmp/x --parts load --load-gb 8 --device cuda

Limits: one process; Linux only (diskstats, sysfs, ``O_DIRECT``).
"""

from __future__ import annotations

import argparse
import json
import mmap
import os
import shutil
import statistics
import sys
import tempfile
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from typing import Any, Callable, Dict, List, Optional, Tuple

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(1, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
from _common import drop_page_cache, gbps, machine_info  # noqa: E402

MIB = 1 << 20
FILES = 8
ALIGN = 4096


# -- the disk's counters ------------------------------------------------------------------


def _diskstats(dev: str) -> Optional[List[int]]:
    """The 11+ counters of ``dev`` in /proc/diskstats (reads, merged, sectors, ms, writes, ..., in flight, io ms, weighted ms)."""
    try:
        with open("/proc/diskstats") as f:
            for line in f:
                p = line.split()
                if len(p) > 13 and p[2] == dev:
                    return [int(x) for x in p[3:]]
    except OSError:
        pass
    return None


def _disk_delta(dev: str, before: Optional[List[int]], wall: float) -> Dict[str, Any]:
    after = _diskstats(dev)
    if not before or not after:
        return {}
    d = [a - b for a, b in zip(after, before)]
    reads, sectors, weighted = d[0], d[2], d[10]
    return {"reads": reads, "mean_request_kib": round(sectors * 512 / reads / 1024, 1) if reads else None,
            "mean_queue_depth": round(weighted / 1000 / wall, 2) if wall > 0 else None,
            "read_mb": round(sectors * 512 / 1e6, 1)}


# -- the sweep ----------------------------------------------------------------------------


def _make_files(root: str, total: int) -> List[str]:
    per = total // FILES // MIB * MIB
    block = os.urandom(8 * MIB)
    paths = [os.path.join(root, f"f{i}") for i in range(FILES)]

    def write(p: str) -> None:
        fd = os.open(p, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
        try:
            done = 0
            while done < per:
                done += os.write(fd, block[: min(len(block), per - done)])
            os.fsync(fd)
        finally:
            os.close(fd)

    with ThreadPoolExecutor(FILES) as ex:
        list(ex.map(write, paths))
    return paths


def _readahead_step(q: Dict[str, Any]) -> int:
    kb = max([v for v in (q.get("read_ahead_kb"), q.get("max_sectors_kb")) if isinstance(v, int)], default=0)
    return kb * 1024 if kb >= 64 else 512 * 1024


def read_all(paths: List[str], how: str, threads: int, size: int, step: int) -> float:
    """Seconds to read every file in requests of ``size`` from ``threads`` threads, asked ``how``."""
    import crc32c

    reqs = [(p, off, min(size, os.path.getsize(p) - off)) for p in paths for off in range(0, os.path.getsize(p), size)]
    # Files interleaved in order, as a load walks its ranges: request k of every file, then k + 1.
    it = iter(reqs)
    lock = threading.Lock()
    direct = how == "direct"
    fds = {p: os.open(p, os.O_RDONLY | (os.O_DIRECT if direct else 0)) for p in paths}

    def worker() -> None:
        buf = mmap.mmap(-1, size) if how in ("direct", "buffered", "willneed") else None
        view = memoryview(buf) if buf is not None else None
        while True:
            with lock:
                r = next(it, None)
            if r is None:
                break
            p, off, n = r
            fd = fds[p]
            if how == "willneed":
                for a in range(off, off + n, step):
                    os.posix_fadvise(fd, a, min(step, off + n - a), os.POSIX_FADV_WILLNEED)
            if how in ("mmap", "mmap-willneed"):
                if how == "mmap-willneed":
                    for a in range(off, off + n, step):
                        os.posix_fadvise(fd, a, min(step, off + n - a), os.POSIX_FADV_WILLNEED)
                m = mmap.mmap(fd, n, prot=mmap.PROT_READ, offset=off)
                crc32c.crc32c(m)
                m.close()
                continue
            got = 0
            want = -(-n // ALIGN) * ALIGN if direct else n
            while got < n:
                k = os.preadv(fd, [view[got:want]], off + got)  # type: ignore[index]
                if k <= 0:
                    break
                got += k
        if view is not None:
            view.release()
            buf.close()  # type: ignore[union-attr]

    try:
        t0 = time.perf_counter()
        with ThreadPoolExecutor(threads) as ex:
            for f in [ex.submit(worker) for _ in range(threads)]:
                f.result()
        return time.perf_counter() - t0
    finally:
        for fd in fds.values():
            os.close(fd)


def sweep(root: str, total: int, q: Dict[str, Any], configs: List[Tuple[str, int, int]], how_drop: str) -> List[Dict[str, Any]]:
    d = tempfile.mkdtemp(prefix="sweep-", dir=root)
    try:
        paths = _make_files(d, total)
        n = sum(os.path.getsize(p) for p in paths)
        out = []
        dev = q.get("device", "")
        for how, threads, size in configs:
            drop_page_cache([d], how=how_drop)
            before = _diskstats(dev)
            try:
                s = read_all(paths, how, threads, size, _readahead_step(q))
            except OSError as e:
                out.append({"how": how, "threads": threads, "size_mib": size // MIB, "error": str(e)})
                continue
            row = {"how": how, "threads": threads, "size_mib": size // MIB, "gbps": round(gbps(n, s), 3)}
            row.update(_disk_delta(dev, before, s))
            out.append(row)
            print(f"  {how:14s} T={threads:3d} S={size // MIB:3d} MiB  {row['gbps']:.2f} GB/s  "
                  f"req {row.get('mean_request_kib')} KiB  qd {row.get('mean_queue_depth')}", flush=True)
        return out
    finally:
        shutil.rmtree(d, ignore_errors=True)


# -- the load profile ---------------------------------------------------------------------


def adamw_state(total: int, device: str) -> Dict[str, Any]:
    """Params + exp_avg + exp_avg_sq + step per param (~total bytes, fp32): matrices of layers, many small norms/biases."""
    import torch

    per = total // 3  # params, exp_avg, exp_avg_sq
    layers = 24
    d = max(64, int((per / layers / 4 / 12) ** 0.5) // 64 * 64)
    shapes: Dict[str, Tuple[int, ...]] = {"embed": (max(64, per // 16 // (4 * d)), d)}
    for i in range(layers):
        for m, shp in (("qkv", (3 * d, d)), ("o", (d, d)), ("up", (4 * d, d)), ("down", (d, 4 * d))):
            shapes[f"l{i}.{m}.weight"] = shp
            shapes[f"l{i}.{m}.bias"] = (shp[0],)
        for m in ("ln1", "ln2"):
            shapes[f"l{i}.{m}.weight"] = (d,)
            shapes[f"l{i}.{m}.bias"] = (d,)
    torch.manual_seed(0)
    params, optim = {}, {}
    for k, shp in shapes.items():  # made where they live (randn of GBs on a CPU takes long)
        params[k] = torch.randn(shp, device=device)
        optim[k + ".exp_avg"] = torch.randn(shp, device=device)
        optim[k + ".exp_avg_sq"] = torch.rand(shp, device=device)
        optim[k + ".step"] = torch.tensor(10.0, device=device)
    return {"model": params, "optim": optim}


class Recorder:
    """Wraps the engine's storage reads, CRCs and buffer-pool takes; keeps (start, end, bytes, kind) per event."""

    def __init__(self) -> None:
        self.events: List[Tuple[float, float, int, str]] = []
        self.lock = threading.Lock()
        self.undo: List[Callable[[], None]] = []

    def wrap(self, owner: Any, name: str, kind: str, nbytes: Callable[..., int]) -> None:
        real = getattr(owner, name)

        def wrapped(*a: Any, **kw: Any) -> Any:
            t0 = time.perf_counter()
            try:
                return real(*a, **kw)
            finally:
                t1 = time.perf_counter()
                with self.lock:
                    self.events.append((t0, t1, nbytes(*a, **kw), kind))

        setattr(owner, name, wrapped)
        self.undo.append(lambda: setattr(owner, name, real))

    def __enter__(self) -> "Recorder":
        from shardckpt import _readers
        from shardckpt._storage import LocalStorage

        self.wrap(LocalStorage, "_read_ranges", "read", lambda self_, rel, ranges: sum(len(b) for _, b in ranges))
        self.wrap(LocalStorage, "map_range", "read", lambda self_, rel, a, b: b - a)
        from shardckpt._storage import _local  # pieces read into the tensors (tmpfs; a lane's with LOAD_LANES=read)

        self.wrap(_local.HotFile, "readv", "read", lambda self_, off, views: sum(len(v) for v in views))
        self.wrap(_readers, "crc32c", "crc", lambda data, *r: len(data))
        self.wrap(_readers.BufferPool, "take", "pool-wait", lambda self_, n: n)
        return self

    def __exit__(self, *exc: Any) -> None:
        for u in reversed(self.undo):
            u()

    def summary(self, t_start: float, t_end: float) -> Dict[str, Any]:
        reads = sorted((e for e in self.events if e[3] == "read"), key=lambda e: e[0])
        out: Dict[str, Any] = {"wall_s": round(t_end - t_start, 3)}
        if not reads:
            return out
        sizes = sorted(e[2] for e in reads)
        out["reads"] = len(reads)
        out["read_size_mib"] = {"p10": round(sizes[len(sizes) // 10] / MIB, 2), "median": round(statistics.median(sizes) / MIB, 2),
                                "p90": round(sizes[len(sizes) * 9 // 10] / MIB, 2), "max": round(sizes[-1] / MIB, 2)}
        out["read_s_total"] = round(sum(e[1] - e[0] for e in reads), 3)
        first, last = reads[0][0], max(e[1] for e in reads)
        out["before_first_read_s"] = round(first - t_start, 3)
        out["after_last_read_s"] = round(t_end - last, 3)
        # Reads in flight, sampled every 10 ms over the reading window.
        samples = []
        t = first
        while t < last:
            samples.append(sum(1 for e in reads if e[0] <= t < e[1]))
            t += 0.01
        if samples:
            out["in_flight"] = {"mean": round(statistics.mean(samples), 2), "p10": sorted(samples)[len(samples) // 10],
                                "median": statistics.median(samples), "max": max(samples)}
            # Idle: sampled moments with no read in flight (the disk waits on the engine).
            out["idle_fraction"] = round(sum(1 for s in samples if s == 0) / len(samples), 3)
        crcs = [e for e in self.events if e[3] == "crc"]
        out["crc_s_total"] = round(sum(e[1] - e[0] for e in crcs), 3)
        out["crc_calls"] = len(crcs)
        waits = [e for e in self.events if e[3] == "pool-wait"]
        out["pool_take_s_total"] = round(sum(e[1] - e[0] for e in waits), 3)
        out["pool_takes"] = len(waits)
        return out


def load_profile(root: str, total: int, device: str, modes: List[str], how_drop: str, dev: str, lanes: Optional[List[str]] = None,
                 repeat: int = 1) -> Dict[str, Any]:
    import torch

    import shardckpt
    from shardckpt import _knobs

    d = tempfile.mkdtemp(prefix="load-", dir=root)
    try:
        src = adamw_state(total, device)
        nbytes = sum(t.numel() * t.element_size() for part in src.values() for t in part.values())
        ntensors = sum(len(p) for p in src.values())
        t0 = time.perf_counter()
        shardckpt.save(src, os.path.join(d, "ck"), no_dist=True)
        save_s = time.perf_counter() - t0
        live = {k: {n: torch.zeros_like(t) for n, t in part.items()} for k, part in src.items()}
        # Imports and first-call set-up (CUDA pinned allocator...) out of the clock: a small load first.
        tiny = os.path.join(d, "tiny")
        shardckpt.save({"w": torch.ones(1 << 20, device=device)}, tiny, no_dist=True)
        shardckpt.load({"w": torch.zeros(1 << 20, device=device)}, tiny, no_dist=True)
        out: Dict[str, Any] = {"bytes": nbytes, "tensors": ntensors, "device": device, "save_gbps": round(gbps(nbytes, save_s), 3),
                               "modes": {}}
        was, was_lanes = _knobs.LOAD_DIRECT, _knobs.LOAD_LANES
        # Every (lanes, O_DIRECT mode) in turn, ``repeat`` rounds: alternated, so a shared disk's drift hits each alike.
        runs = [(ln, m) for _ in range(repeat) for ln in (lanes or ["1"]) for m in modes]
        for lane, mode in runs:
            _knobs.LOAD_DIRECT = mode
            _knobs.LOAD_LANES = lane
            drop = drop_page_cache([d], how=how_drop)
            before = _diskstats(dev)
            with Recorder() as rec:
                t_start = time.perf_counter()
                shardckpt.load(live, os.path.join(d, "ck"), no_dist=True)
                if device == "cuda":
                    torch.cuda.synchronize()
                t_end = time.perf_counter()
            _knobs.LOAD_DIRECT, _knobs.LOAD_LANES = was, was_lanes
            for k, part in src.items():
                for n, t in part.items():
                    if not torch.equal(live[k][n], t):
                        raise AssertionError(f"{mode}: {k}.{n} differs after the load")
                    live[k][n].zero_()
            s = rec.summary(t_start, t_end)
            s["gbps"] = round(gbps(nbytes, t_end - t_start), 3)
            s["drop"] = drop
            s.update({"disk_" + k: v for k, v in _disk_delta(dev, before, t_end - t_start).items()})
            key = mode if lanes is None else f"lanes={lane},direct={mode}"
            out["modes"].setdefault(key, []).append(s)
            print(f"  load {key}: {s['gbps']:.2f} GB/s  {json.dumps({k: v for k, v in s.items() if k != 'gbps'})}", flush=True)
        return out
    finally:
        shutil.rmtree(d, ignore_errors=True)


def main(argv: Optional[List[str]] = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--dir", required=True, help="a directory on the disk to profile")
    p.add_argument("--parts", default="sweep,load")
    p.add_argument("--sweep-gb", type=float, default=2.0)
    p.add_argument("--threads", default="1,4,8,16,32")
    p.add_argument("--sizes-mib", default="1,4,16,64")
    p.add_argument("--hows", default="buffered,willneed,direct,mmap,mmap-willneed")
    p.add_argument("--load-gb", type=float, default=4.0)
    p.add_argument("--device", default="cpu")
    p.add_argument("--modes", default="0,auto", help="SHARDCKPT_LOAD_DIRECT values to load with")
    p.add_argument("--lanes", default=None, help="SHARDCKPT_LOAD_LANES values to load with (e.g. 1,map,0: the wave-12 scheduling, with mapped pieces, the old one)")
    p.add_argument("--repeat", type=int, default=1, help="rounds of every load setting, alternated")
    p.add_argument("--drop-cache", choices=["auto", "fadvise"], default="auto")
    p.add_argument("--json")
    args = p.parse_args(argv)
    from shardckpt._storage._local import queue_info

    root = tempfile.mkdtemp(prefix="coldprof-", dir=args.dir)
    q = queue_info(root)
    out: Dict[str, Any] = {"machine": machine_info(root), "queue": q, "date": time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime())}
    print("queue:", json.dumps(q), flush=True)
    try:
        parts = args.parts.split(",")
        if "sweep" in parts:
            hows = args.hows.split(",")
            threads = [int(x) for x in args.threads.split(",")]
            sizes = [int(x) * MIB for x in args.sizes_mib.split(",")]
            # The full grid for buffered and direct; the hinted and mapped ways at the load's sizes.
            configs = [(h, t, s) for h in hows for t in threads for s in sizes
                       if h in ("buffered", "direct") or s in (4 * MIB, 16 * MIB)]
            out["sweep"] = sweep(root, int(args.sweep_gb * 1e9), q, configs, args.drop_cache)
        if "load" in parts:
            out["load"] = load_profile(root, int(args.load_gb * 1e9), args.device, args.modes.split(","), args.drop_cache,
                                       q.get("device", ""), args.lanes.split(",") if args.lanes else None, args.repeat)
    finally:
        shutil.rmtree(root, ignore_errors=True)
        if args.json:
            with open(args.json, "w") as f:
                json.dump(out, f, indent=1)
    return 0


if __name__ == "__main__":
    sys.exit(main())
