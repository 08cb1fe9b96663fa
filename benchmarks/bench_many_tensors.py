"""Save and load of many tiny tensors in one dict, one process: shardckpt against DCP (and torch.save).

What it measures is the per-tensor cost of each library (walking the state,
naming, planning, metadata), not bandwidth: every tensor holds ``--floats``
fp32 values (default 64, 256 bytes), so the bytes are negligible and a
library whose planning grows faster than the number of tensors shows it at
once. MoE models with unfused experts have tens of thousands of tensors.

The state is ``{"model": {"layers.<i>.w": tensor}}`` (one dict of N tensors),
the same for every case:

  shardckpt   ``shardckpt.save`` / ``shardckpt.load`` (in place, checksums verified)
  dcp         ``dcp.save`` with ``FileSystemWriter`` (fsyncs) / ``dcp.load`` with
              ``FileSystemReader`` (in place)
  torch.save  ``torch.save`` of the dict + an fsync of the file / ``torch.load``
              (``weights_only=True``) + ``copy_`` into the live tensors (a reference:
              one pickle, no sharding, no checksums)

Each save and each load runs in a fresh interpreter (``_common.run_isolated``)
that first saves and loads a tiny state of its case, so imports and first-call
set-up are not timed. Load is in place into a resident dict of zeros and the
values are checked afterwards. Wall seconds and CPU seconds of the process are
both reported: on a shared machine the CPU time is the steadier one.

Usage:
  python benchmarks/bench_many_tensors.py                         # 10 / 1,000 / 100,000 tensors
  python benchmarks/bench_many_tensors.py --tensors 10,1000 --repeat 3 --json out.json --markdown out.md
  python benchmarks/bench_many_tensors.py --cases shardckpt,dcp --no-isolate   # quick, one process
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import statistics
import sys
import time
from typing import Any, Callable, Dict, List

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from _common import machine_info, markdown_table, run_isolated  # noqa: E402

CASES = ["shardckpt", "dcp", "torch.save"]
DESCRIPTIONS = {
    "shardckpt": "shardckpt.save / shardckpt.load (in place, checksums verified)",
    "dcp": "dcp.save FileSystemWriter (fsync) / dcp.load FileSystemReader (in place)",
    "torch.save": "torch.save + fsync / torch.load(weights_only=True) + copy_ (reference)",
}
DEFAULT_TENSORS = [10, 1_000, 100_000]


def make_state(n: int, floats: int, *, fill: bool) -> Dict[str, Any]:
    """``{"model": {"layers.<i>.w": tensor}}``: ``n`` fp32 tensors of ``floats`` values (i + j/floats, or zeros)."""
    import torch

    row = torch.arange(floats, dtype=torch.float32) / floats
    if fill:
        return {"model": {f"layers.{i}.w": row + i for i in range(n)}}
    return {"model": {f"layers.{i}.w": torch.zeros(floats) for i in range(n)}}


def check(state: Dict[str, Any], n: int, floats: int) -> None:
    """Raise unless ``state`` holds what ``make_state(fill=True)`` saved."""
    import torch

    got = state["model"]
    if len(got) != n:
        raise AssertionError(f"loaded {len(got)} tensors, saved {n}")
    row = torch.arange(floats, dtype=torch.float32) / floats
    # One comparison for the whole dict: stack the loaded tensors, subtract each one's i.
    flat = torch.stack([got[f"layers.{i}.w"] for i in range(n)]) - torch.arange(n, dtype=torch.float32)[:, None]
    if not torch.equal(flat, row.expand(n, floats)):
        bad = (flat != row).any(dim=1).nonzero().flatten()[:5].tolist()
        raise AssertionError(f"loaded values differ from the saved ones at tensors {bad}")


def _fsync_file(path: str) -> None:
    for p, flags in ((path, os.O_RDONLY), (os.path.dirname(os.path.abspath(path)), os.O_RDONLY)):
        fd = os.open(p, flags)
        try:
            os.fsync(fd)
        finally:
            os.close(fd)


def _save_fn(case: str) -> Callable[[Dict[str, Any], str], None]:
    if case == "shardckpt":
        import shardckpt

        return lambda state, path: shardckpt.save(state, path)
    if case == "dcp":
        import torch.distributed.checkpoint as dcp

        return lambda state, path: dcp.save(state, storage_writer=dcp.FileSystemWriter(path))
    if case == "torch.save":
        import torch

        def save(state, path):
            os.makedirs(path, exist_ok=True)
            f = os.path.join(path, "state.pt")
            torch.save(state, f)
            _fsync_file(f)

        return save
    raise ValueError(case)


def _load_fn(case: str) -> Callable[[Dict[str, Any], str], None]:
    if case == "shardckpt":
        import shardckpt

        return lambda state, path: shardckpt.load(state, path)
    if case == "dcp":
        import torch.distributed.checkpoint as dcp

        return lambda state, path: dcp.load(state, storage_reader=dcp.FileSystemReader(path))
    if case == "torch.save":
        import torch

        def load(state, path):
            saved = torch.load(os.path.join(path, "state.pt"), weights_only=True)
            with torch.no_grad():
                for k, t in state["model"].items():
                    t.copy_(saved["model"][k])

        return load
    raise ValueError(case)


def _timed(fn: Callable[[], None]) -> Dict[str, float]:
    w0, c0 = time.perf_counter(), time.process_time()
    fn()
    return {"seconds": time.perf_counter() - w0, "cpu_seconds": time.process_time() - c0}


def _warm(case: str, path: str) -> None:
    """A tiny save and load of this case, so imports and first-call set-up are not timed."""
    warm = path.rstrip("/") + ".warm"
    _save_fn(case)(make_state(2, 4, fill=True), warm)
    _load_fn(case)(make_state(2, 4, fill=False), warm)
    shutil.rmtree(warm, ignore_errors=True)


def child_save(case: str, path: str, n: int, floats: int) -> Dict[str, Any]:
    """One timed save of ``n`` tensors (run in its own process)."""
    _warm(case, path)
    state = make_state(n, floats, fill=True)
    save = _save_fn(case)
    return _timed(lambda: save(state, path))


def child_load(case: str, path: str, n: int, floats: int) -> Dict[str, Any]:
    """One timed in-place load of ``n`` tensors, values checked after the clock stops."""
    _warm(case, path)
    state = make_state(n, floats, fill=False)
    load = _load_fn(case)
    out = _timed(lambda: load(state, path))
    check(state, n, floats)
    return out


def run_cases(args) -> Dict[str, Any]:
    results: Dict[str, Dict[str, Dict[str, List[Dict[str, float]]]]] = {}
    os.makedirs(args.dir, exist_ok=True)
    for n in args.tensors:
        for case in args.cases:
            runs = results.setdefault(str(n), {}).setdefault(case, {"save": [], "load": []})
            for r in range(args.repeat):
                path = os.path.join(os.path.abspath(args.dir), f"many-{case}-{n}-{r}")
                shutil.rmtree(path, ignore_errors=True)
                kw = {"case": case, "path": path, "n": n, "floats": args.floats}
                for op, fn in (("save", "child_save"), ("load", "child_load")):
                    if args.isolate:
                        res = run_isolated(__file__, fn, kw, timeout=args.timeout)
                    else:
                        res = globals()[fn](**kw)
                    runs[op].append(res)
                    print(f"{n:>8} tensors  {case:<10} {op}  {res['seconds']:8.2f} s wall  {res['cpu_seconds']:8.2f} s cpu",
                          flush=True)
                shutil.rmtree(path, ignore_errors=True)
    return {"results": results}


def report(args, out: Dict[str, Any], info: Dict[str, str]) -> str:
    lines = [f"# Many tiny tensors, one process ({args.floats} fp32 values each)", ""]
    lines.append("Machine: " + ", ".join(f"{k} {v}" for k, v in info.items()))
    lines.append("")
    lines += [f"- `{c}`: {DESCRIPTIONS[c]}" for c in args.cases]
    lines.append("")
    rows = []
    for n, by_case in out["results"].items():
        for case, runs in by_case.items():
            row: List[Any] = [f"{int(n):,}", case]
            for op in ("save", "load"):
                wall = statistics.median(r["seconds"] for r in runs[op])
                cpu = statistics.median(r["cpu_seconds"] for r in runs[op])
                row += [wall, cpu, f"{wall / int(n) * 1e6:.0f}"]
            rows.append(row)
    headers = ["tensors", "case", "save s", "save cpu s", "save µs/tensor", "load s", "load cpu s", "load µs/tensor"]
    lines.append(markdown_table(headers, rows))
    lines.append("")
    lines.append(f"Medians of {args.repeat} run(s); every save and load in a fresh process "
                 f"({'isolated' if args.isolate else 'not isolated: --no-isolate'}).")
    return "\n".join(lines)


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--tensors", default=",".join(str(n) for n in DEFAULT_TENSORS),
                   help="comma-separated numbers of tensors (default 10,1000,100000)")
    p.add_argument("--floats", type=int, default=64, help="fp32 values per tensor (default 64)")
    p.add_argument("--cases", default=",".join(CASES), help=f"comma-separated subset of {','.join(CASES)}")
    p.add_argument("--repeat", type=int, default=1, help="runs of every case; the table shows medians")
    p.add_argument("--dir", default="bench-out", help="scratch directory (default ./bench-out)")
    p.add_argument("--no-isolate", dest="isolate", action="store_false",
                   help="run every case in this process (fast smoke test)")
    p.add_argument("--timeout", type=float, default=3600, help="seconds per measured process")
    p.add_argument("--json", help="also write raw results here")
    p.add_argument("--markdown", help="also write the report here")
    args = p.parse_args(argv)
    args.cases = [c.strip() for c in args.cases.split(",") if c.strip()]
    unknown = [c for c in args.cases if c not in CASES]
    if unknown or not args.cases:
        p.error(f"unknown case(s) {unknown}; choose from {CASES}")
    try:
        args.tensors = [int(x) for x in args.tensors.split(",") if x.strip()]
    except ValueError:
        p.error(f"--tensors must be comma-separated integers, got {args.tensors!r}")
    if not args.tensors or min(args.tensors) < 1 or args.floats < 1 or args.repeat < 1:
        p.error("--tensors, --floats and --repeat must be positive")

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
