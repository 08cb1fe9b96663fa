"""Shared helpers for the benchmark scripts: isolation, timing, memory, cold cache, tables.

Each measurement should run in a fresh process so its peak RSS is its own:
``run_isolated`` runs a module-level function of a script in a new Python
interpreter and returns its (JSON) result with the child's ``peak_rss``.
``drop_page_cache`` evicts written files before a cold read and says how;
``cached_fraction`` checks how much of them is still in memory.

Usage from another benchmark script::

    import os, sys
    sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
    from _common import run_isolated, drop_page_cache, markdown_table, gbps

    res = run_isolated(__file__, "my_case", {"path": p})   # my_case(path=p) -> dict
    method = drop_page_cache([p])                            # 'drop_caches', 'fadvise' or 'none'

Limits: Linux-first. ``drop_page_cache`` needs root for ``drop_caches``; the
``fadvise`` fallback only evicts clean pages of the files given (call it
after they are fsync'ed). ``cached_fraction`` needs ``mincore`` (Linux/macOS).
"""

from __future__ import annotations

import ctypes
import ctypes.util
import json
import mmap
import os
import platform
import resource
import shutil
import subprocess
import sys
import tempfile
import time
from typing import Any, Dict, Iterable, List, Optional, Sequence

__all__ = [
    "gbps",
    "Stopwatch",
    "rss_bytes",
    "peak_rss_bytes",
    "run_isolated",
    "run_isolated_ranks",
    "free_port",
    "files_under",
    "drop_page_cache",
    "cached_fraction",
    "fsync_tree",
    "markdown_table",
    "machine_info",
    "IsolatedRunError",
]

GB = 1e9


def gbps(nbytes: float, seconds: float) -> float:
    """Throughput in GB/s (10^9 bytes per second); ``inf`` for a zero duration."""
    return nbytes / seconds / GB if seconds > 0 else float("inf")


class Stopwatch:
    """Wall-clock timer for a ``with`` block: ``with Stopwatch() as sw: ...; sw.seconds``."""

    def __enter__(self) -> "Stopwatch":
        self.seconds = 0.0
        self._t0 = time.perf_counter()
        return self

    def __exit__(self, *exc) -> None:
        self.seconds = time.perf_counter() - self._t0


def rss_bytes() -> int:
    """Current resident set size of this process (Linux ``/proc``; 0 elsewhere)."""
    try:
        with open("/proc/self/statm") as f:
            return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")
    except (OSError, ValueError, IndexError):
        return 0


def peak_rss_bytes() -> int:
    """Peak resident set size of this process so far (``ru_maxrss``)."""
    peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    # Linux reports KiB, macOS bytes.
    return int(peak) if sys.platform == "darwin" else int(peak) * 1024


class IsolatedRunError(RuntimeError):
    """A function run by ``run_isolated`` failed; the message holds the child's stderr tail."""


def run_isolated(
    script: str,
    func: str,
    kwargs: Dict[str, Any],
    *,
    timeout: Optional[float] = None,
    env: Optional[Dict[str, str]] = None,
) -> Dict[str, Any]:
    """Run ``func(**kwargs)`` from ``script`` in a fresh interpreter; return its result.

    Args:
        script: path of a Python file defining ``func`` at module level (its
            ``if __name__ == "__main__"`` block does not run).
        func: name of a function returning a JSON-able dict.
        kwargs: JSON-able keyword arguments.
        timeout: seconds before the child is killed.
        env: extra environment variables for the child.

    Returns:
        The function's dict plus ``peak_rss`` (the child's peak RSS in bytes,
        interpreter and imports included), unless the function set it itself.

    Raises:
        IsolatedRunError: the child raised, crashed or timed out.

    Example:
        >>> run_isolated("benchmarks/bench_save_load.py", "child", {...})  # doctest: +SKIP
    """
    fd, out_path = tempfile.mkstemp(prefix="bench-result-", suffix=".json")
    os.close(fd)
    cmd = [sys.executable, os.path.abspath(__file__), "--run", os.path.abspath(script), func, json.dumps(kwargs), out_path]
    child_env = dict(os.environ)
    child_env.update(env or {})
    try:
        proc = subprocess.run(cmd, env=child_env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, timeout=timeout, text=True)
        if proc.returncode != 0:
            tail = (proc.stderr or "")[-4000:]
            raise IsolatedRunError(f"{func}({kwargs}) failed with exit code {proc.returncode}:\n{tail}")
        with open(out_path) as f:
            return json.load(f)
    except subprocess.TimeoutExpired as e:
        raise IsolatedRunError(f"{func}({kwargs}) timed out after {timeout} s") from e
    finally:
        try:
            os.unlink(out_path)
        except OSError:
            pass


def free_port() -> int:
    """A TCP port on the loopback that was free a moment ago (for ``MASTER_PORT``)."""
    import socket

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def run_isolated_ranks(
    script: str,
    func: str,
    kwargs: Dict[str, Any],
    world: int,
    *,
    timeout: Optional[float] = None,
    env: Optional[Dict[str, str]] = None,
) -> List[Dict[str, Any]]:
    """Run ``func(**kwargs)`` in ``world`` fresh interpreters at once, as ranks of one job.

    Each child gets ``RANK``, ``WORLD_SIZE``, ``LOCAL_RANK``, ``MASTER_ADDR``
    and ``MASTER_PORT`` (as torchrun sets them), so ``func`` can call
    ``torch.distributed.init_process_group()`` with the env:// defaults.

    Returns:
        One result dict per rank (rank order), each with its own ``peak_rss``.

    Raises:
        IsolatedRunError: any rank failed or timed out (the others are killed).
    """
    port = str(free_port())
    procs = []
    outs = []
    try:
        for r in range(world):
            fd, out_path = tempfile.mkstemp(prefix=f"bench-result-r{r}-", suffix=".json")
            os.close(fd)
            outs.append(out_path)
            child_env = dict(os.environ)
            child_env.update(env or {})
            child_env.update(
                RANK=str(r), LOCAL_RANK=str(r), WORLD_SIZE=str(world), MASTER_ADDR="127.0.0.1", MASTER_PORT=port
            )
            cmd = [sys.executable, os.path.abspath(__file__), "--run", os.path.abspath(script), func, json.dumps(kwargs), out_path]
            procs.append(subprocess.Popen(cmd, env=child_env, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True))
        deadline = None if timeout is None else time.monotonic() + timeout
        errors = []
        for r, p in enumerate(procs):
            try:
                left = None if deadline is None else max(1.0, deadline - time.monotonic())
                _, err = p.communicate(timeout=left)
            except subprocess.TimeoutExpired:
                raise IsolatedRunError(f"{func} rank {r} timed out after {timeout} s") from None
            if p.returncode != 0:
                errors.append(f"--- rank {r} exit code {p.returncode}:\n{(err or '')[-3000:]}")
        if errors:
            raise IsolatedRunError(f"{func}({kwargs}) failed:\n" + "\n".join(errors))
        results = []
        for path in outs:
            with open(path) as f:
                results.append(json.load(f))
        return results
    finally:
        for p in procs:
            if p.poll() is None:
                p.kill()
                p.wait()
        for path in outs:
            try:
                os.unlink(path)
            except OSError:
                pass


def _child_main(argv: Sequence[str]) -> None:
    import importlib.util

    script, func, kwargs_json, out_path = argv
    spec = importlib.util.spec_from_file_location("_bench_isolated", script)
    if spec is None or spec.loader is None:
        raise SystemExit(f"cannot import {script}")
    mod = importlib.util.module_from_spec(spec)
    sys.path.insert(0, os.path.dirname(script))
    spec.loader.exec_module(mod)
    result = getattr(mod, func)(**json.loads(kwargs_json))
    if not isinstance(result, dict):
        raise SystemExit(f"{func} returned {type(result).__name__}, expected dict")
    result.setdefault("peak_rss", peak_rss_bytes())
    with open(out_path, "w") as f:
        json.dump(result, f)


def files_under(path: str) -> List[str]:
    """Every regular file below ``path`` (or ``[path]`` if it is a file), sorted."""
    if os.path.isfile(path):
        return [path]
    out = []
    for d, _, names in os.walk(path):
        out.extend(os.path.join(d, n) for n in names)
    return sorted(out)


def fsync_tree(path: str) -> None:
    """fsync every file below ``path`` and every directory holding them."""
    dirs = set()
    for p in files_under(path):
        fd = os.open(p, os.O_RDONLY)
        try:
            os.fsync(fd)
        finally:
            os.close(fd)
        dirs.add(os.path.dirname(p))
    for d in sorted(dirs):
        fd = os.open(d, os.O_RDONLY)
        try:
            os.fsync(fd)
        except OSError:
            pass
        finally:
            os.close(fd)


def drop_page_cache(paths: Iterable[str], how: str = "auto") -> str:
    """Evict files from the page cache so the next read comes from the device.

    Tries the whole-system ``/proc/sys/vm/drop_caches`` (needs root outside a
    container), then ``posix_fadvise(POSIX_FADV_DONTNEED)`` on every file
    (works unprivileged for clean pages: fsync first, as this does).

    Args:
        paths: files or directories (every file below them).
        how: ``"auto"`` (the above order) or ``"fadvise"`` (skip the
            system-wide drop, which also evicts other processes' files).

    Returns:
        ``"drop_caches"``, ``"fadvise"`` or ``"none"`` (nothing worked: reads
        that follow are warm, say so when reporting).
    """
    if how not in ("auto", "fadvise"):
        raise ValueError(f"how must be 'auto' or 'fadvise', got {how!r}")
    files = [f for p in paths for f in files_under(p)]
    for f in files:
        fd = os.open(f, os.O_RDONLY)
        try:
            os.fsync(fd)
        finally:
            os.close(fd)
    try:
        if how != "auto":
            raise PermissionError
        os.sync()
        with open("/proc/sys/vm/drop_caches", "w") as fh:
            fh.write("3\n")
        # Some containers accept the write and do nothing: check.
        left = cached_fraction(files)
        if left is not None and left < 0.01:
            return "drop_caches"
    except OSError:
        pass
    if not hasattr(os, "posix_fadvise"):
        return "none"
    for f in files:
        fd = os.open(f, os.O_RDONLY)
        try:
            os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
        finally:
            os.close(fd)
    return "fadvise"


_libc = None


def _mincore():
    global _libc
    if _libc is None:
        name = ctypes.util.find_library("c")
        _libc = ctypes.CDLL(name, use_errno=True) if name else False
    if not _libc or not hasattr(_libc, "mincore"):
        return None
    fn = _libc.mincore
    fn.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_void_p]
    fn.restype = ctypes.c_int
    return fn


def cached_fraction(paths: Iterable[str]) -> Optional[float]:
    """Fraction (0..1) of the files' pages resident in the page cache; None if unknown.

    Maps each file read-only and asks ``mincore``; nothing is read.
    """
    mincore = _mincore()
    if mincore is None:
        return None
    page = mmap.PAGESIZE
    total = resident = 0
    for f in (f for p in paths for f in files_under(p)):
        size = os.path.getsize(f)
        if size == 0:
            continue
        pages = (size + page - 1) // page
        vec = (ctypes.c_ubyte * pages)()
        with open(f, "rb") as fh:
            # A private (copy-on-write) mapping is writable from Python's side,
            # which ctypes needs to take its address; no page is read or copied.
            mm = mmap.mmap(fh.fileno(), size, access=mmap.ACCESS_COPY)
            try:
                anchor = ctypes.c_char.from_buffer(mm)
                rc = mincore(ctypes.addressof(anchor), size, vec)
                del anchor
            finally:
                mm.close()
        if rc != 0:
            return None
        resident += sum(1 for b in vec if b & 1)
        total += pages
    return resident / total if total else 0.0


def markdown_table(headers: Sequence[str], rows: Sequence[Sequence[Any]]) -> str:
    """A GitHub markdown table; floats are printed with 2 decimals."""

    def cell(v: Any) -> str:
        if isinstance(v, float):
            return f"{v:.2f}"
        return "" if v is None else str(v)

    lines = ["| " + " | ".join(headers) + " |", "|" + "|".join("---" for _ in headers) + "|"]
    lines += ["| " + " | ".join(cell(v) for v in r) + " |" for r in rows]
    return "\n".join(lines)


def machine_info(path: str) -> Dict[str, str]:
    """What the numbers were measured on: CPUs, memory, the disk under ``path``, kernel, versions."""
    info: Dict[str, str] = {"nproc": str(os.cpu_count() or "?"), "kernel": platform.release(), "python": platform.python_version()}
    try:
        with open("/proc/cpuinfo") as f:
            model = next((l.split(":", 1)[1].strip() for l in f if l.startswith("model name")), "")
        if model:
            info["cpu"] = model
    except OSError:
        pass
    try:
        with open("/proc/meminfo") as f:
            kb = int(next(l for l in f if l.startswith("MemTotal")).split()[1])
        info["memory"] = f"{kb / 1024 / 1024:.1f} GiB"
    except (OSError, StopIteration, ValueError):
        pass
    try:
        out = subprocess.run(["df", "-hT", path], stdout=subprocess.PIPE, stderr=subprocess.DEVNULL, text=True, timeout=10)
        lines = out.stdout.strip().splitlines()
        if len(lines) >= 2:
            f = lines[-1].split()
            info["disk"] = f"{f[0]} ({f[1]}), size {f[2]}, free {f[4]}, mounted on {f[-1]}"
    except (OSError, subprocess.SubprocessError):
        usage = shutil.disk_usage(path)
        info["disk"] = f"free {usage.free / GB:.0f} GB"
    try:
        with open("/proc/loadavg") as f:
            info["loadavg"] = " ".join(f.read().split()[:3])
    except OSError:
        pass
    for mod in ("torch", "safetensors", "crc32c"):
        try:
            info[mod] = __import__(mod).__version__
        except Exception:  # noqa: BLE001 - optional
            pass
    return info


if __name__ == "__main__":
    if len(sys.argv) >= 2 and sys.argv[1] == "--run":
        _child_main(sys.argv[2:])
    else:
        raise SystemExit("benchmarks/_common.py is a helper module; run a bench_*.py script")
