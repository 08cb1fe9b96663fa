"""Peak memory of a command and every process it starts: the test suite's, by default.

    python benchmarks/suite_memory.py                              # the README's test run (2 test processes)
    python benchmarks/suite_memory.py -- -m slow                   # the long cases (left out of a plain run)
    python benchmarks/suite_memory.py --cmd "python examples/quickstart.py"

Starts the command in a process group of its own and samples ``/proc`` every
``--interval`` seconds: the command's process tree (every descendant, found by
parent pid, plus anything left in its process group), each process's RSS
(``statm``) and, every ``--pss-every`` samples, its PSS (``smaps_rollup``:
pages shared by forks counted once, split between them). At the end it prints
one line, ``peak summed RSS: X GiB at M:SS (N processes); peak summed PSS: Y
GiB``, then the largest processes at the RSS peak (pid, age, RSS, command) —
what to look at when the peak is too high (issue 47: fork servers started
twenty minutes earlier, 0.5-0.65 GB each) — and exits with the command's code.
``--json PATH`` writes the samples too.

Linux only (``/proc``). RSS summed over forks counts shared pages once per
process, so it overstates what the tree really takes; it is what the kernel's
OOM killer weighs per process, and what the README states; PSS is the fairer
total.
"""

from __future__ import annotations

import argparse
import json
import os
import shlex
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from typing import Dict, List, Optional, Tuple

PAGE = os.sysconf("SC_PAGE_SIZE")
GIB = 1 << 30
#: Seconds between samples: a peak lasting less can be missed (pytest workers
#: and servers live for minutes; the peak is their sum, not a spike).
DEFAULT_INTERVAL_S = 0.5
#: PSS reads every process's smaps_rollup (slower than statm): every Nth sample.
DEFAULT_PSS_EVERY = 4
TOP = 12
DEFAULT_PYTEST = [sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider"]


def _stat(pid: int) -> Optional[Tuple[int, int, float]]:
    """(parent pid, process group, start time in clock ticks) of ``pid``, or None if it is gone."""
    try:
        with open(f"/proc/{pid}/stat") as f:
            raw = f.read()
    except OSError:
        return None
    rest = raw[raw.rindex(")") + 2:].split()  # the command name may hold spaces and parentheses
    return int(rest[1]), int(rest[2]), float(rest[19])


def _rss(pid: int) -> int:
    try:
        with open(f"/proc/{pid}/statm") as f:
            return int(f.read().split()[1]) * PAGE
    except (OSError, IndexError, ValueError):
        return 0


def _pss(pid: int) -> int:
    try:
        with open(f"/proc/{pid}/smaps_rollup") as f:
            for line in f:
                if line.startswith("Pss:"):
                    return int(line.split()[1]) * 1024
    except (OSError, IndexError, ValueError):
        pass
    return 0


def _cmdline(pid: int) -> str:
    try:
        with open(f"/proc/{pid}/cmdline", "rb") as f:
            return f.read().replace(b"\0", b" ").decode(errors="replace").strip()[:160]
    except OSError:
        return "?"


def tree(root: int, pgid: int, parents_out: Optional[Dict[int, int]] = None) -> List[int]:
    """``root`` and its descendants (by parent pid), plus the processes of group ``pgid`` (children reparented to init).

    ``parents_out``, if given, receives every process's parent pid.
    """
    parents: Dict[int, int] = {}
    members = set()
    for name in os.listdir("/proc"):
        if not name.isdigit():
            continue
        st = _stat(int(name))
        if st is None:
            continue
        parents[int(name)] = st[0]
        if st[1] == pgid:
            members.add(int(name))
    if parents_out is not None:
        parents_out.update(parents)
    kids: Dict[int, List[int]] = {}
    for pid, ppid in parents.items():
        kids.setdefault(ppid, []).append(pid)
    out, todo = set(), [root, *members]
    while todo:
        pid = todo.pop()
        if pid in out or pid not in parents:
            continue
        out.add(pid)
        todo.extend(kids.get(pid, ()))
    return sorted(out)


def _group(pid: int, root: int, parents: Dict[int, int]) -> int:
    """The child of ``root`` that ``pid`` descends from (a test process: its rank pools, fork servers,
    S3 servers), ``root`` itself for the root, 0 for a process reparented away from the tree."""
    seen = 0
    while pid != root and seen < 64:
        ppid = parents.get(pid, 0)
        if ppid == root:
            return pid
        if ppid <= 1:
            return 0
        pid, seen = ppid, seen + 1
    return root


def _traces(folder: str) -> Dict[str, List[Tuple[float, int, str, str]]]:
    """Per test process (gw0, gw1, main): its ``(time, pid, start|end, test id)`` lines (tests/conftest.py)."""
    out: Dict[str, List[Tuple[float, int, str, str]]] = {}
    for name in sorted(os.listdir(folder)):
        if not name.endswith(".log"):
            continue
        rows = []
        with open(os.path.join(folder, name)) as f:
            for line in f:
                parts = line.rstrip("\n").split(" ", 3)
                if len(parts) == 4:
                    rows.append((float(parts[0]), int(parts[1]), parts[2], parts[3]))
        out[name[:-4]] = rows
    if len(out) > 1:
        out.pop("main", None)  # an xdist controller's lines repeat its workers'
    return out


def _running(rows: List[Tuple[float, int, str, str]], at: float) -> str:
    """The test a process ran at time ``at`` (or the last one it finished before, marked so)."""
    last = "(no test yet)"
    for t, _pid, what, nodeid in rows:
        if t > at:
            break
        if what not in ("start", "end"):
            continue
        last = nodeid if what == "start" else f"(between tests; last {nodeid})"
    return last


def _heaviest(rows: List[Tuple[float, int, str, str]], series: List[Tuple[float, int]]) -> List[Tuple[int, str]]:
    """Each test of one process with the most RSS its process tree held while it ran, largest first."""
    out = []
    starts: Dict[str, float] = {}
    for t, _pid, what, nodeid in rows:
        if what == "start":
            starts[nodeid] = t
        elif nodeid in starts:
            t0 = starts.pop(nodeid)
            held = [rss for when, rss in series if t0 <= when <= t]
            if held:
                out.append((max(held), nodeid))
    return sorted(out, reverse=True)


def main(argv: Optional[List[str]] = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--cmd", help="the command to measure (a shell-quoted string); default: pytest with the arguments after --")
    p.add_argument("--interval", type=float, default=DEFAULT_INTERVAL_S, help="seconds between samples")
    p.add_argument("--pss-every", type=int, default=DEFAULT_PSS_EVERY, help="read PSS every N samples (0: never)")
    p.add_argument("--json", help="write every sample here")
    p.add_argument("pytest_args", nargs=argparse.REMAINDER, help="after --: pytest's arguments")
    a = p.parse_args(argv)
    extra = a.pytest_args[1:] if a.pytest_args[:1] == ["--"] else a.pytest_args
    cmd = shlex.split(a.cmd) if a.cmd else DEFAULT_PYTEST + extra
    ticks = os.sysconf("SC_CLK_TCK")
    with open("/proc/uptime") as f:
        boot = time.time() - float(f.read().split()[0])
    trace = tempfile.mkdtemp(prefix="suite-memory-")  # 0700, ours
    env = dict(os.environ, SHARDCKPT_SUITE_TRACE=trace)
    t0 = time.time()
    child = subprocess.Popen(cmd, start_new_session=True, env=env)
    pgid = child.pid
    samples = []
    peak: Tuple[int, float, List[Tuple[int, int, float, str, int]]] = (0, 0.0, [])
    # Per sample, the RSS of each test process's tree (keyed by its pid): which test held what.
    by_group: Dict[int, List[Tuple[float, int]]] = {}
    peak_pss = 0
    n = 0

    def forward(sig, _frame):
        os.killpg(pgid, sig)

    signal.signal(signal.SIGINT, forward)
    signal.signal(signal.SIGTERM, forward)
    try:
        while child.poll() is None:
            parents: Dict[int, int] = {}
            pids = tree(child.pid, pgid, parents)
            rows = []
            for pid in pids:
                st = _stat(pid)
                rss = _rss(pid)
                if st is not None and rss:
                    rows.append((pid, rss, boot + st[2] / ticks, "", _group(pid, child.pid, parents)))
            total = sum(r[1] for r in rows)
            now_abs = time.time()
            sums: Dict[int, int] = {}
            for r in rows:
                sums[r[4]] = sums.get(r[4], 0) + r[1]
            for g, v in sums.items():
                by_group.setdefault(g, []).append((now_abs, v))
            pss = sum(_pss(pid) for pid in pids) if a.pss_every and n % a.pss_every == 0 else None
            now = time.time() - t0
            samples.append({"t": round(now, 2), "rss": total, "pss": pss, "processes": len(rows)})
            if total > peak[0]:
                peak = (total, now, [(pid, rss, started, _cmdline(pid), g) for pid, rss, started, _, g in rows])
            if pss is not None:
                peak_pss = max(peak_pss, pss)
            n += 1
            time.sleep(a.interval)
    finally:
        code = child.wait()
    total, when, rows = peak
    traces = _traces(trace)
    shutil.rmtree(trace, ignore_errors=True)
    names = {rows_[0][1]: name for name, rows_ in traces.items() if rows_}  # test process pid -> gw0/gw1/main
    print(f"peak summed RSS: {total / GIB:.2f} GiB at {int(when // 60)}:{int(when % 60):02d} ({len(rows)} processes); "
          f"peak summed PSS: {peak_pss / GIB:.2f} GiB; wall {time.time() - t0:.0f} s; exit {code}")
    groups: Dict[int, int] = {}
    for r in rows:
        groups[r[4]] = groups.get(r[4], 0) + r[1]
    for g, v in sorted(groups.items(), key=lambda kv: -kv[1]):
        name = names.get(g, "the command" if g == child.pid else f"pid {g}")
        test = _running(traces[names[g]], t0 + when) if g in names else ""
        n_g = sum(1 for r in rows if r[4] == g)
        print(f"  {name}: {v / GIB:.2f} GiB in {n_g} processes  {test}")
    for pid, rss, started, cmdline, g in sorted(rows, key=lambda r: -r[1])[:TOP]:
        print(f"  pid {pid:>7} {names.get(g, ''):>4} up {t0 + when - started:7.0f} s  {rss / GIB:6.2f} GiB  {cmdline}")
    for name, rows_ in traces.items():
        events: Dict[str, int] = {}
        for _t, _pid, what, _detail in rows_:
            if what not in ("start", "end"):
                events[what] = events.get(what, 0) + 1
        if events:
            print(f"  {name}: " + ", ".join(f"{n} x {what}" for what, n in sorted(events.items())))
    heavy = {name: _heaviest(traces[name], by_group.get(g, [])) for g, name in names.items()}
    for name, tests in heavy.items():
        print(f"  {name}'s tests holding the most (its process tree's RSS while each ran):")
        for rss, nodeid in tests[:TOP]:
            print(f"    {rss / GIB:5.2f} GiB  {nodeid}")
    if a.json:
        with open(a.json, "w") as f:
            json.dump({"cmd": cmd, "peak_rss": total, "peak_pss": peak_pss, "peak_at_s": when, "exit": code, "samples": samples,
                       "peak_processes": [{"pid": pid, "rss": rss, "group": names.get(g, g), "cmdline": c}
                                          for pid, rss, _s, c, g in rows],
                       "heaviest_tests": {name: tests[:50] for name, tests in heavy.items()},
                       "t0": t0, "traces": traces}, f)
    return code


if __name__ == "__main__":
    sys.exit(main())
