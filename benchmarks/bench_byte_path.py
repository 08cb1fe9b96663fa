"""The same bytes through every path, in one process: copies, raw reads and writes, safetensors, shardckpt, DCP.

Issue 43. One state of tensors in a realistic mix of sizes (default 1 GiB:
an embedding and an output head, layers of matrices, norms of a few KiB)
is saved once per format under ``--dir`` (default a private directory in
``/dev/shm``: tmpfs, so loads run at memory speed and the engine's own cost
shows), then each load fills the same resident live tensors, in place:

=====================  ================================================================
``memcpy``             ``copy_`` of in-memory tensors of the same sizes: the ceiling
``read``               ``readinto`` of one raw file (the tensors back to back) straight
                       into the live tensors' memory (no checksum): what the storage gives
``safetensors``        ``safetensors.torch.load_file`` + ``copy_`` into the live tensors
                       (what ``load_state_dict`` does)
``shardckpt``          ``shardckpt.load`` of a native checkpoint, checksums on (the default)
``shardckpt-nocrc``    the same with ``SHARDCKPT_CHECKSUMS`` off (``_knobs.CHECKSUMS``)
``shardckpt-map``      the same with ``SHARDCKPT_LOAD_INTO`` off: tmpfs pieces mapped, checked
                       and copied out of the mapping instead of ``preadv``-ed into the tensors
``shardckpt-hf``       ``shardckpt.load`` of the Hugging Face directory that
                       ``converters.to_safetensors`` exported from it
``shardckpt-hf-map``   the same with ``SHARDCKPT_LOAD_INTO`` off
``dcp``                ``torch.distributed.checkpoint.load`` (``FileSystemReader``)
``read8``              (not by default) the raw file read by 8 threads, a contiguous eighth
                       each: the raw 8-stream read of the same bytes, in the same rounds
=====================  ================================================================

Any load or save case may be suffixed ``@KNOB=value`` (``--loads
shardckpt,shardckpt@LOAD_LANES=0``, ``--saves hf-export-warm@IO_THREADS=8``):
the same case with ``_knobs.KNOB`` set for it, in the same run (wave 12: the
lanes against the scheduling before them). ``@POOL_EAGER=1`` is the read
buffer pool as before wave 15 (a new buffer whenever one fits, not the
oldest finished read's). ``@MODULE.NAME=value`` sets a module constant of
the package for the case (an experiment, not a knob:
``@_readers.SCRATCH_PIECE_BYTES=16777216`` reads the scratch pieces of a CPU load
in 16 MiB).

and on a GPU (``torch.cuda`` available), into CUDA live tensors:
``safetensors-cuda`` (``load_file(device="cuda")`` + ``copy_``),
``fastsafetensors`` (when importable; no GPUDirect), ``shardckpt-cuda``.

Saves (each fsyncs its files before the clock stops; tmpfs makes that
free): ``write`` (``os.write`` of the raw file), ``save_file``
(safetensors), ``shardckpt.save``, ``dcp.save``; and ``hf-export``
(``converters.to_safetensors`` of the native checkpoint). ``--saves`` may
also name ``hf-export-warm`` / ``hf-export-cold`` (the source read into, or
dropped from, the page cache before the clock) and ``hf-export-packed`` /
``hf-export-packed-cold`` (the packed writer, ``SHARDCKPT_EXPORT_PLACED=0``);
the report sets each export against ``os.write`` and, with ``--cold``, the
raw parallel write, and a cold-source export against the disk's two bounds
(min(read, write) if reads overlap writes, their harmonic sum if not).

Every case runs ``--repeat`` times, cases interleaved so a noisy neighbour
hits all of them alike; the table shows medians of GB/s (10^9 bytes/s), the
ratio to ``safetensors`` (loads) or ``save_file`` (saves), and the process
CPU seconds per case. ``--cold`` (with ``--dir`` on a real disk): the page
cache is dropped before every load (``/proc/sys/vm/drop_caches`` when root,
else ``posix_fadvise``; the report says which) and the disk's own parallel
write and read (8 streams of ``--raw-gb`` GB, fsync, cache dropped) are
measured in the same run. A separate fresh process measures the peak extra
RSS of one ``shardckpt.load`` (``peak_rss``, ``ru_maxrss`` after an
identical warm-up load).

Usage::

    python benchmarks/bench_byte_path.py                      # 1 GiB from /dev/shm
    python benchmarks/bench_byte_path.py --dir /nvme/x --cold --size-gib 8 --json out.json
    taskset -c 0,1 python benchmarks/bench_byte_path.py       # a 2-core machine

Limits: one process, no process group; tensors are fp32 and bf16.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import shutil
import statistics
import sys
import tempfile
import time
import warnings
from concurrent.futures import ThreadPoolExecutor
from typing import Any, Callable, Dict, List, Optional, Tuple

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(1, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
from _common import drop_page_cache, gbps, machine_info, markdown_table, run_isolated  # noqa: E402

GIB = 1 << 30
LOADS = ["memcpy", "read", "safetensors", "shardckpt", "shardckpt-map", "shardckpt-nocrc", "shardckpt-hf", "shardckpt-hf-map", "dcp"]
CUDA_LOADS = ["safetensors-cuda", "fastsafetensors", "shardckpt-cuda"]
SAVES = ["write", "save_file", "shardckpt", "dcp", "hf-export"]
#: The HF export with its source's cache state set before the clock (``--saves`` may name them):
#: ``-warm`` every source file read first, ``-cold`` the source dropped from the page cache;
#: ``-packed``: the packed single writer (``SHARDCKPT_EXPORT_PLACED=0``) instead of the placed one.
EXPORTS = ["hf-export-warm", "hf-export-cold", "hf-export-packed", "hf-export-packed-cold"]
#: Parallel streams of the raw disk measurement.
RAW_STREAMS = 8


def state_spec(size_bytes: int) -> List[Tuple[str, Tuple[int, ...], str]]:
    """(name, shape, dtype) of a transformer-like state of about ``size_bytes``: big, medium and tiny tensors.

    An embedding and a head of 1/8 each; the rest in layers of four square
    attention matrices, three MLP matrices of 8/3 that size, two norms; every
    fourth layer in bf16.
    """
    layers = 16
    per_layer = size_bytes * 3 // 4 // layers
    # 4 d^2 + 3 * (8/3) d^2 = 12 d^2 elements of 4 bytes
    d = max(64, int((per_layer / 48) ** 0.5) // 64 * 64)
    vocab = max(64, size_bytes // 8 // (4 * d))
    out = [("embed.weight", (vocab, d), "float32"), ("lm_head.weight", (vocab, d), "float32")]
    for i in range(layers):
        dt = "bfloat16" if i % 4 == 3 else "float32"
        for m in ("q", "k", "v", "o"):
            out.append((f"layers.{i}.attn.{m}.weight", (d, d), dt))
        for m in ("up", "gate", "down"):
            out.append((f"layers.{i}.mlp.{m}.weight", (d * 8 // 3, d) if m != "down" else (d, d * 8 // 3), dt))
        out += [(f"layers.{i}.norm1.weight", (d,), "float32"), (f"layers.{i}.norm2.weight", (d,), "float32")]
    out.append(("norm.weight", (d,), "float32"))
    return out


def make_state(size_bytes: int, device: str = "cpu", *, seed: Optional[int] = 0) -> Dict[str, Any]:
    import torch

    g = torch.Generator().manual_seed(seed or 0)
    out = {}
    for name, shape, dt in state_spec(size_bytes):
        t = torch.empty(shape, dtype=getattr(torch, dt))
        if seed is None:
            t.fill_(0.5)  # resident, not the saved values
        else:
            t.copy_(torch.randn(shape, generator=g))
        out[name] = t.to(device) if device != "cpu" else t
    return out


def nbytes_of(state: Dict[str, Any]) -> int:
    return sum(t.numel() * t.element_size() for t in state.values())


def _fsync_tree(path: str) -> None:
    from _common import fsync_tree

    fsync_tree(path)


@contextlib.contextmanager
def _quiet():
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        yield


def _byte_view(t):
    """Writable flat bytes of a contiguous CPU tensor (NumPy)."""
    import torch

    return memoryview(t.detach().reshape(-1).view(torch.uint8).numpy()).cast("B")


class Bench:
    """One state, its saved copies, and the cases that load or save it."""

    def __init__(self, root: str, size_bytes: int, cuda: bool):
        self.root = root
        self.src = make_state(size_bytes)
        self.live = make_state(size_bytes, seed=None)
        self.nbytes = nbytes_of(self.src)
        self.cuda = cuda
        self.live_cuda = make_state(size_bytes, "cuda", seed=None) if cuda else None
        self.p = {k: os.path.join(root, k) for k in ("raw", "st", "native", "hf", "dcp")}
        self.p["st"] += ".safetensors"

    # -- saves ----------------------------------------------------------------------

    def save(self, case: str, tag: str = "") -> None:
        """Save ``case`` (``case@KNOB=value`` as for loads: e.g. ``hf-export-warm@IO_THREADS=8``)."""
        _knobbed(case, lambda base: self._save(base, tag))

    def _save(self, case: str, tag: str = "") -> None:
        import torch

        path = self.p[_SAVE_PATH[case]] + tag
        if os.path.isdir(path):
            shutil.rmtree(path)
        elif os.path.exists(path):
            os.unlink(path)
        if case == "write":
            fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
            try:
                for t in self.src.values():
                    mv = _byte_view(t)
                    done = 0
                    while done < len(mv):
                        done += os.write(fd, mv[done:])
                os.fsync(fd)
            finally:
                os.close(fd)
        elif case == "save_file":
            from safetensors.torch import save_file

            save_file(self.src, path)
            _fsync_tree(path)
        elif case == "shardckpt":
            import shardckpt

            shardckpt.save({"model": self.src}, path, no_dist=True)
        elif case == "dcp":
            import torch.distributed.checkpoint as dcp

            with _quiet():
                dcp.save({"model": self.src}, storage_writer=dcp.FileSystemWriter(path), no_dist=True)
        elif case.startswith("hf-export"):
            try:
                from shardckpt import converters
            except ImportError:  # the tree run from a plain copy (a device host): the top-level package
                import converters  # type: ignore[no-redef]
            from shardckpt import _knobs

            was = _knobs.EXPORT_PLACED
            _knobs.EXPORT_PLACED = "packed" not in case
            try:
                converters.to_safetensors(self.p["native"], path)
            finally:
                _knobs.EXPORT_PLACED = was
            _fsync_tree(path)
        else:
            raise ValueError(case)
        del torch

    def prepare_save(self, case: str, drop_how: str) -> Optional[str]:
        """Out of the clock: an export's source read into the page cache (``-warm``) or dropped from it (``-cold``)."""
        case = case.partition("@")[0]
        if case.endswith("-cold"):
            return drop_page_cache([self.p["native"]], how=drop_how)
        if case.endswith("-warm") or case == "hf-export-packed":
            buf = bytearray(8 << 20)
            for d, _, files in os.walk(self.p["native"]):
                for n in files:
                    with open(os.path.join(d, n), "rb", buffering=0) as f:
                        while f.readinto(buf):
                            pass
        return None

    # -- loads ----------------------------------------------------------------------

    def load(self, case: str) -> None:
        """Load ``case``; ``case@KNOB=value`` (e.g. ``shardckpt@LOAD_LANES=0``): the same with ``_knobs.KNOB`` set for it."""
        _knobbed(case, self._load)

    def _load(self, case: str) -> None:
        import torch

        live = self.live
        if case == "memcpy":
            for k, t in live.items():
                t.copy_(self.src[k])
        elif case == "read":
            fd = os.open(self.p["raw"], os.O_RDONLY)
            try:
                off = 0
                for t in live.values():
                    mv = _byte_view(t)
                    done = 0
                    while done < len(mv):
                        got = os.preadv(fd, [mv[done:]], off + done)
                        if got <= 0:
                            raise EOFError(self.p["raw"])
                        done += got
                    off += len(mv)
            finally:
                os.close(fd)
        elif case == "read8":
            # The raw file read back by 8 threads, each a contiguous eighth in
            # 16 MiB reads (no checksum, into a scratch buffer): the raw
            # 8-stream read, in the same rounds as the loads.
            fd = os.open(self.p["raw"], os.O_RDONLY)
            try:
                size = os.fstat(fd).st_size
                part = -(-size // 8)

                def stream(k: int) -> None:
                    buf = bytearray(16 << 20)
                    mv = memoryview(buf)
                    pos, end = k * part, min(size, (k + 1) * part)
                    while pos < end:
                        got = os.preadv(fd, [mv[: min(len(mv), end - pos)]], pos)
                        if got <= 0:
                            raise EOFError(self.p["raw"])
                        pos += got

                with ThreadPoolExecutor(8) as ex:
                    list(ex.map(stream, range(8)))
            finally:
                os.close(fd)
            return
        elif case == "safetensors":
            from safetensors.torch import load_file

            got = load_file(self.p["st"])
            for k, t in live.items():
                t.copy_(got[k])
            del got
        elif case in ("shardckpt", "shardckpt-nocrc", "shardckpt-map"):
            import shardckpt
            from shardckpt import _knobs

            was = _knobs.CHECKSUMS, _knobs.LOAD_INTO
            _knobs.CHECKSUMS = case != "shardckpt-nocrc"
            _knobs.LOAD_INTO = case != "shardckpt-map" and was[1]
            try:
                shardckpt.load({"model": live}, self.p["native"], no_dist=True)
            finally:
                _knobs.CHECKSUMS, _knobs.LOAD_INTO = was
        elif case in ("shardckpt-hf", "shardckpt-hf-map"):
            import shardckpt
            from shardckpt import _knobs

            was_into = _knobs.LOAD_INTO
            _knobs.LOAD_INTO = case == "shardckpt-hf" and was_into
            try:
                shardckpt.load(live, self.p["hf"], no_dist=True)
            finally:
                _knobs.LOAD_INTO = was_into
        elif case == "dcp":
            import torch.distributed.checkpoint as dcp

            with _quiet():
                dcp.load({"model": live}, storage_reader=dcp.FileSystemReader(self.p["dcp"]), no_dist=True)
        elif case == "safetensors-cuda":
            from safetensors.torch import load_file

            got = load_file(self.p["st"], device="cuda")
            for k, t in self.live_cuda.items():
                t.copy_(got[k])
            del got
            torch.cuda.synchronize()
        elif case == "fastsafetensors":
            from fastsafetensors import fastsafe_open

            with fastsafe_open(filenames=[self.p["st"]], framework="pt", device="cuda:0", nogds=True) as f:
                for k, t in self.live_cuda.items():
                    t.copy_(f.get_tensor(k))
                torch.cuda.synchronize()
        elif case == "shardckpt-cuda":
            import shardckpt

            shardckpt.load({"model": self.live_cuda}, self.p["native"], no_dist=True)
            torch.cuda.synchronize()
        else:
            raise ValueError(case)

    def check(self, case: str) -> None:
        import torch

        if case == "read8":
            return  # nothing loaded
        live = self.live_cuda if case.partition("@")[0] in CUDA_LOADS else self.live
        for k, t in self.src.items():
            if not torch.equal(live[k].cpu(), t):
                raise AssertionError(f"{case}: {k} differs after the load")
        for t in live.values():
            t.fill_(0.5)


_SAVE_PATH = {"write": "raw", "save_file": "st", "shardckpt": "native", "dcp": "dcp", "hf-export": "hf", **{c: "hf" for c in EXPORTS}}


def export_report(out: Dict[str, Any]) -> List[str]:
    """The HF export against the destination's write speed (warm source) and the disk's read+write bound (cold source)."""
    cases, raw = out["cases"], out.get("raw_disk")
    lines = []
    wr = cases.get("save:write", {}).get("gbps")
    for c in ["hf-export"] + EXPORTS:
        v = cases.get(f"save:{c}", {}).get("gbps")
        if not v:
            continue
        parts = [f"{c} {v:.2f} GB/s"]
        if wr:
            parts.append(f"{v / wr:.0%} of os.write (one stream, fsync) {wr:.2f}")
        if raw:
            r, w = raw["read_gbps"], raw["write_gbps"]
            parts.append(f"{v / w:.0%} of the raw {RAW_STREAMS}-stream write {w:.2f}")
            if c.endswith("-cold"):
                overlap, serial = min(r, w), 1 / (1 / r + 1 / w)
                parts.append(f"cold-source bounds: min(read, write) {overlap:.2f} ({v / overlap:.0%}), "
                             f"read then write {serial:.2f} ({v / serial:.0%})")
        lines.append("; ".join(parts))
    return lines


def _knobbed(case: str, run: Callable[[str], None]) -> None:
    """``run(base)`` of ``case`` = ``base@KNOB=value[@KNOB2=value2...]``, each ``shardckpt._knobs.KNOB`` set meanwhile (plain ``base``: as is)."""
    base, _, setting = case.rpartition("@")
    if not base:
        return run(case)
    from shardckpt import _knobs

    name, _, value = setting.partition("=")
    if "." in name:  # a module constant of the package, e.g. ``_readers.STEP_BYTES=...`` (not a knob: an experiment)
        import importlib

        mod_name, _, attr = name.rpartition(".")
        mod = importlib.import_module(f"shardckpt.{mod_name}")
        was_attr = getattr(mod, attr)
        setattr(mod, attr, type(was_attr)(value))
        try:
            return _knobbed(base, run)
        finally:
            setattr(mod, attr, was_attr)
    if name == "POOL_EAGER":  # the pool as before wave 15: a new buffer whenever one fits, never the oldest read's first
        from shardckpt import _readers

        real = _readers.BufferPool.can_reuse
        if value.lower() in ("1", "on", "true", "yes"):
            _readers.BufferPool.can_reuse = lambda self, n: True  # type: ignore[method-assign]
        try:
            return _knobbed(base, run)
        finally:
            _readers.BufferPool.can_reuse = real  # type: ignore[method-assign]
    was = getattr(_knobs, name)
    setattr(_knobs, name, type(was)(value) if not isinstance(was, bool) else value.lower() in ("1", "on", "true", "yes"))
    try:
        return _knobbed(base, run)
    finally:
        setattr(_knobs, name, was)


def available(case: str, cuda: bool) -> Optional[str]:
    """None when ``case`` can run here, else why not."""
    case = case.partition("@")[0]
    if case in CUDA_LOADS and not cuda:
        return "no CUDA"
    if case == "fastsafetensors":
        try:
            import fastsafetensors  # noqa: F401
        except Exception as e:  # noqa: BLE001 - any import failure: say it
            return f"not importable ({type(e).__name__}: {e})"
    return None


def _cpu() -> float:
    t = os.times()
    return t.user + t.system


def timed(fn: Callable[[], None]) -> Tuple[float, float]:
    c0, t0 = _cpu(), time.perf_counter()
    fn()
    return time.perf_counter() - t0, _cpu() - c0


def raw_disk(root: str, total_bytes: int, how: str) -> Dict[str, Any]:
    """The disk's own speed: ``RAW_STREAMS`` files written in parallel (1 MiB writes, fsync), dropped, read back in parallel."""
    d = tempfile.mkdtemp(prefix="raw-", dir=root)
    per = total_bytes // RAW_STREAMS
    block = os.urandom(1 << 20)
    paths = [os.path.join(d, f"f{i}") for i in range(RAW_STREAMS)]

    def write(p: str) -> None:
        fd = os.open(p, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
        try:
            for _ in range(per >> 20):
                os.write(fd, block)
            os.fsync(fd)
        finally:
            os.close(fd)

    def read(p: str) -> None:
        buf = bytearray(8 << 20)
        with open(p, "rb", buffering=0) as f:
            while f.readinto(buf):
                pass

    try:
        with ThreadPoolExecutor(RAW_STREAMS) as ex:
            t0 = time.perf_counter()
            list(ex.map(write, paths))
            w = time.perf_counter() - t0
            method = drop_page_cache([d], how=how)
            t0 = time.perf_counter()
            list(ex.map(read, paths))
            r = time.perf_counter() - t0
        n = (per >> 20 << 20) * RAW_STREAMS
        return {"bytes": n, "write_gbps": gbps(n, w), "read_gbps": gbps(n, r), "drop": method}
    finally:
        shutil.rmtree(d, ignore_errors=True)


def _status(key: str) -> int:
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith(key + ":"):
                return int(line.split()[1]) * 1024
    return 0


def rss_child(path: str, size_bytes: int, tiny: str) -> Dict[str, Any]:
    """Peak RSS growth of one ``shardckpt.load`` of ``path`` into resident tensors (fresh process, after a warm-up).

    ``VmHWM`` reset (``/proc/self/clear_refs``) just before the load, so
    the peak is the load's own, measured from the RSS it started at.
    """
    import torch

    import shardckpt

    live = make_state(size_bytes, seed=None)
    shardckpt.load({"model": {"w": torch.zeros(4)}}, tiny, no_dist=True)  # imports and first-call set-up
    with open("/proc/self/clear_refs", "w") as f:
        f.write("5")  # VmHWM := VmRSS
    base = _status("VmRSS")
    shardckpt.load({"model": live}, path, no_dist=True)
    return {"extra_rss": _status("VmHWM") - base}


def run(args) -> Dict[str, Any]:
    import torch

    torch.manual_seed(0)
    cuda = torch.cuda.is_available() and not args.no_cuda
    owned = args.dir is None
    root = tempfile.mkdtemp(prefix="bytepath-", dir="/dev/shm" if os.path.isdir("/dev/shm") else None) if owned else \
        tempfile.mkdtemp(prefix="bytepath-", dir=args.dir)
    os.chmod(root, 0o700)
    out: Dict[str, Any] = {"dir": root, "cold": args.cold, "size_bytes": None, "cpus": len(os.sched_getaffinity(0))}
    try:
        b = Bench(root, int(args.size_gib * GIB), cuda)
        out["size_bytes"] = b.nbytes
        out["tensors"] = len(b.src)
        loads = [c for c in args.loads.split(",") if c] + ([c for c in CUDA_LOADS] if cuda else [])
        saves = [c for c in args.saves.split(",") if c]
        skipped = {c: why for c in loads if (why := available(c, cuda))}
        loads = [c for c in loads if c not in skipped]
        # Every saved copy exists before the loads; hf-export needs the native one.
        for c in ["write", "save_file", "shardckpt", "dcp", "hf-export"]:
            b.save(c)
        # Warm-up: imports and first calls out of the clock; a case that fails here is reported, not run.
        for c in list(loads):
            try:
                b.load(c)
                b.check(c)
            except Exception as e:  # noqa: BLE001 - an alternative failing must not lose the other numbers
                skipped[c] = f"failed: {type(e).__name__}: {str(e)[:300]}"
                loads.remove(c)
        res: Dict[str, Dict[str, List[float]]] = {f"load:{c}": {"s": [], "cpu_s": []} for c in loads}
        res.update({f"save:{c}": {"s": [], "cpu_s": []} for c in saves})
        drops = set()
        # What the disk saw during each cold load (/proc/diskstats): requests, their mean size, the queue depth.
        from bench_cold_profile import _disk_delta, _diskstats

        from shardckpt._storage._local import queue_info

        dev = queue_info(root).get("device", "") if args.cold else ""
        out["queue"] = queue_info(root) if args.cold else {}
        disk: Dict[str, List[Dict[str, Any]]] = {}
        for _ in range(args.repeat):
            for c in loads:
                if args.cold and c != "memcpy":
                    drops.add(drop_page_cache([root], how=args.drop_cache))
                before = _diskstats(dev) if dev else None
                s, cpu = timed(lambda c=c: b.load(c))
                if before:
                    disk.setdefault(f"load:{c}", []).append(_disk_delta(dev, before, s))
                b.check(c)
                res[f"load:{c}"]["s"].append(s)
                res[f"load:{c}"]["cpu_s"].append(cpu)
            for c in saves:
                dropped = b.prepare_save(c, args.drop_cache)
                if dropped:
                    drops.add(dropped)
                s, cpu = timed(lambda c=c: b.save(c, ".again"))
                res[f"save:{c}"]["s"].append(s)
                res[f"save:{c}"]["cpu_s"].append(cpu)
                p = b.p[_SAVE_PATH[c.partition("@")[0]]] + ".again"
                shutil.rmtree(p) if os.path.isdir(p) else os.unlink(p)
        out["disk"] = disk
        out["drop"] = sorted(drops)
        out["skipped"] = skipped
        out["settings"] = _load_settings()
        out["cases"] = {
            k: {"runs_s": v["s"], "cpu_s": v["cpu_s"], "median_s": statistics.median(v["s"]),
                "gbps": gbps(b.nbytes, statistics.median(v["s"])), "median_cpu_s": statistics.median(v["cpu_s"])}
            for k, v in res.items() if v["s"]
        }
        if args.cold:
            out["raw_disk"] = raw_disk(root, int(args.raw_gb * 1e9), args.drop_cache)
        if not args.no_rss:
            tiny = os.path.join(root, "tiny")
            import shardckpt

            shardckpt.save({"model": {"w": torch.ones(4)}}, tiny, no_dist=True)
            got = run_isolated(__file__, "rss_child", {"path": b.p["native"], "size_bytes": int(args.size_gib * GIB), "tiny": tiny})
            out["shardckpt_load_extra_rss"] = got["extra_rss"]
        out["aims"] = aims(out)
        return out
    finally:
        shutil.rmtree(root, ignore_errors=True)


def _load_settings() -> Dict[str, Any]:
    """The knobs a CPU load of this run used (threads: one per usable core, at most 16), and the CRC-32C backend."""
    from shardckpt import _knobs

    try:
        import crc32c

        crc = f"crc32c {getattr(crc32c, '__version__', '?')} ({'hardware' if getattr(crc32c, 'hardware_based', False) else 'software'})"
    except ImportError:
        crc = "none"
    return {"cpu_io_threads": _knobs.LOAD_CPU_IO_THREADS, "buffer_bytes": _knobs.LOAD_BUFFER_BYTES,
            "range_bytes": _knobs.LOAD_RANGE_BYTES, "map": _knobs.LOAD_MAP,
            "into": getattr(_knobs, "LOAD_INTO", None), "checksums": crc}


#: Issue 43's aims for a load into CPU tensors, as (name, case, against, at least): the
#: ratio of the two cases' speeds (same run) must reach the bound.
AIMS = [
    ("load >= 0.9x load_file+copy", "load:shardckpt", "load:safetensors", 0.9),
    ("HF-directory load >= 0.9x load_file+copy", "load:shardckpt-hf", "load:safetensors", 0.9),
    ("native load >= HF-directory load", "load:shardckpt", "load:shardckpt-hf", 1.0),
]
#: Peak extra RSS a load may take (issue 43), whatever the checkpoint size.
AIM_RSS = 256 << 20


def aims(out: Dict[str, Any]) -> List[Dict[str, Any]]:
    """Issue 43's aims measured in ``out`` (those whose cases ran): value, target, met."""
    cases = out.get("cases", {})
    got = []
    for name, case, ref, bound in AIMS:
        if case in cases and ref in cases:
            r = cases[ref]["median_s"] / cases[case]["median_s"]
            got.append({"aim": name, "value": round(r, 3), "target": bound, "met": r >= bound})
    if "shardckpt_load_extra_rss" in out:
        mib = out["shardckpt_load_extra_rss"] / 2**20
        got.append({"aim": "peak extra RSS of a load (MiB)", "value": round(mib, 1), "target": AIM_RSS >> 20,
                    "met": mib <= AIM_RSS >> 20})
    return got


def report(out: Dict[str, Any], info: Dict[str, str]) -> str:
    cases = out["cases"]
    disk = out.get("disk") or {}
    lines = [f"# bench_byte_path: {out['size_bytes'] / GIB:.2f} GiB in {out['tensors']} tensors, "
             f"{'cold (page cache dropped: ' + ','.join(out['drop']) + ')' if out['cold'] else 'warm'}, {out['cpus']} CPUs usable",
             "", "machine: " + "; ".join(f"{k}={v}" for k, v in info.items()), ""]
    rows = []
    for kind, ref in (("load", "load:safetensors"), ("save", "save:save_file")):
        for k, v in cases.items():
            if not k.startswith(kind + ":"):
                continue
            base = cases.get(ref) if not k.startswith("load:") or "cuda" not in k and "fast" not in k else \
                cases.get("load:safetensors-cuda")
            ratio = base["median_s"] / v["median_s"] if base else None
            row = [k, v["gbps"], ratio, v["median_s"], v["median_cpu_s"], " ".join(f"{s:.3f}" for s in v["runs_s"])]
            if disk:
                seen = disk.get(k, [])
                req = [d["mean_request_kib"] for d in seen if d.get("mean_request_kib")]
                qd = [d["mean_queue_depth"] for d in seen if d.get("mean_queue_depth") is not None]
                r8 = cases.get("load:read8")
                row += [r8["median_s"] / v["median_s"] if r8 and kind == "load" else None,
                        statistics.median(req) if req else None, statistics.median(qd) if qd else None]
            rows.append(row)
    head = ["case", "GB/s (median)", "x reference", "s", "CPU s", "runs (s)"]
    if disk:
        head += ["x read8 (raw 8 streams, same rounds)", "disk request KiB (median)", "disk queue depth"]
    lines.append(markdown_table(head, rows))
    lines.append("")
    lines.append("reference: loads against `load:safetensors` (CUDA loads against `load:safetensors-cuda`), saves against `save:save_file`")
    if "raw_disk" in out:
        r = out["raw_disk"]
        lines.append(f"raw disk, {RAW_STREAMS} streams, {r['bytes'] / 1e9:.1f} GB: write+fsync {r['write_gbps']:.2f} GB/s, "
                     f"cold read {r['read_gbps']:.2f} GB/s (cache dropped by {r['drop']})")
    lines.extend(export_report(out))
    if "shardckpt_load_extra_rss" in out:
        lines.append(f"peak extra RSS of one shardckpt.load (fresh process): {out['shardckpt_load_extra_rss'] / 2**20:.0f} MiB")
    if out.get("settings"):
        lines.append("shardckpt load settings: " + ", ".join(f"{k}={v}" for k, v in out["settings"].items()))
    aims = out.get("aims") or []
    if aims:
        lines += ["", "issue 43 aims, this run (" + ("cold" if out["cold"] else "warm") + f", {out['cpus']} CPUs):", ""]
        lines.append(markdown_table(["aim", "value", "target", "met"],
                                    [[a["aim"], a["value"], a["target"], "yes" if a["met"] else "NO"] for a in aims]))
    for c, why in out.get("skipped", {}).items():
        lines.append(f"skipped {c}: {why}")
    return "\n".join(lines)


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--size-gib", type=float, default=1.0, help="state size in GiB (default 1)")
    p.add_argument("--dir", default=None, help="scratch directory (default: a private one in /dev/shm)")
    p.add_argument("--cold", action="store_true", help="drop the page cache before every load; measure the raw disk too")
    p.add_argument("--raw-gb", type=float, default=4.0, help="GB of the raw disk measurement (--cold)")
    p.add_argument("--drop-cache", choices=["auto", "fadvise"], default="auto")
    p.add_argument("--repeat", type=int, default=3)
    p.add_argument("--loads", default=",".join(LOADS), help=f"comma-separated subset of {','.join(LOADS)}")
    p.add_argument("--saves", default=",".join(SAVES), help=f"comma-separated subset of {','.join(SAVES + EXPORTS)}")
    p.add_argument("--no-cuda", action="store_true", help="skip the CUDA loads on a GPU host")
    p.add_argument("--no-rss", action="store_true", help="skip the peak-RSS process")
    p.add_argument("--json", help="also write the raw results here")
    p.add_argument("--markdown", help="also write the report here")
    args = p.parse_args(argv)
    info = machine_info(args.dir or ("/dev/shm" if os.path.isdir("/dev/shm") else "."))
    out = run(args)
    out["machine"] = info
    out["date"] = time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime())
    text = report(out, info)
    print(text)
    if args.json:
        with open(args.json, "w") as f:
            json.dump(out, f, indent=1)
    if args.markdown:
        with open(args.markdown, "w") as f:
            f.write(text + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
