"""How long does a checkpoint block training? shardckpt async/sync vs DCP async_save, same state, same run.

Measures the *stall* (time until the call returns and training may touch the
tensors again) of:

  * memcpy floor          copying every tensor of the state once into
                          preallocated host buffers (pinned for CUDA): the
                          least any snapshotting save can block;
  * shardckpt.save        synchronous save (the whole write);
  * shardckpt.async_save  returns once staged (first call allocates its
                          buffers; later calls reuse them);
  * DCP async_save        torch.distributed.checkpoint.async_save, default
                          stager; and, where this torch has it, DCP with its
                          pinned-memory stager (stall counted until its
                          staging completes, since training must wait for it).

Each row reports the first call and the median of the following ones (for
the floor, the fastest of them), and the time until the checkpoint is
committed. Methods take turns call by call, so noise on a shared machine hits
them alike. With several ranks, every number is the slowest rank's.

Usage:
    python benchmarks/bench_async.py --device cpu --size-gb 1 --out async.md
    python benchmarks/bench_async.py --gil --device cpu --size-gb 1 --iters 3   # GIL cost of the background write
    python benchmarks/bench_async.py --gil --device cuda --size-gb 2 --iters 5
    python benchmarks/bench_async.py --gil --writer both --size-gb 1 --iters 4   # thread vs process writer
    torchrun --nproc-per-node 2 benchmarks/bench_async.py --device cuda --size-gb 4 --out async.md

The state is ``--size-gb`` of fp32 in total (split evenly across ranks as
DTensors sharded on dim 0 when several ranks run), in ``--tensors`` large
tensors plus twice as many small ones (4 KB, like biases and norms).
"""

from __future__ import annotations

import argparse
import os
import platform
import shutil
import statistics
import sys
import tempfile
import time
from typing import Any, Dict, List, Optional

import torch
import torch.distributed as dist

import shardckpt


def _dist_setup(device: str):
    if "WORLD_SIZE" not in os.environ or int(os.environ["WORLD_SIZE"]) <= 1:
        return 0, 1
    if device == "cuda":
        torch.cuda.set_device(int(os.environ.get("LOCAL_RANK", 0)))
        # DCP's async_save needs a CPU backend next to NCCL.
        dist.init_process_group("cpu:gloo,cuda:nccl")
    else:
        dist.init_process_group("gloo")
    return dist.get_rank(), dist.get_world_size()


def _barrier():
    if dist.is_initialized():
        dist.barrier()


def _slowest(seconds: float) -> float:
    """The maximum over ranks (a stall is as long as the slowest rank's)."""
    if not dist.is_initialized():
        return seconds
    t = torch.tensor([seconds], dtype=torch.float64)
    dist.all_reduce(t, op=dist.ReduceOp.MAX, group=_cpu_group())
    return float(t.item())


_CPU_GROUP = None


def _cpu_group():
    global _CPU_GROUP
    if _CPU_GROUP is None:
        _CPU_GROUP = dist.new_group(backend="gloo")
    return _CPU_GROUP


def build_state(size_gb: float, n_tensors: int, device: str, rank: int, world: int) -> Dict[str, Any]:
    """``n_tensors`` big fp32 tensors + ``2 * n_tensors`` 4 KB ones, ~``size_gb`` in total (all ranks)."""
    cols = 1024
    per_rank_rows = max(1, int(size_gb * 1e9 / 4 / cols / n_tensors / world))
    g = torch.Generator(device="cpu").manual_seed(1234 + rank)
    state: Dict[str, Any] = {}
    if world > 1:
        from torch.distributed.tensor import DTensor, Shard, init_device_mesh

        mesh = init_device_mesh(device, (world,))
    for i in range(n_tensors):
        local = torch.randn(per_rank_rows, cols, generator=g).to(device)
        if world > 1:
            local = DTensor.from_local(
                local, mesh, [Shard(0)], run_check=False, shape=(per_rank_rows * world, cols), stride=(cols, 1)
            )
        state[f"layer{i:03d}.weight"] = local
        # Small tensors: whole on every rank (replicated), as biases/norms often are.
        state[f"layer{i:03d}.bias"] = torch.full((1024,), float(i), device=device)
        state[f"layer{i:03d}.norm"] = torch.ones(1024, device=device)
    state["step"] = 0
    return state


def _local_tensors(state: Dict[str, Any]) -> List[torch.Tensor]:
    out = []
    for v in state.values():
        if hasattr(v, "to_local"):
            v = v.to_local()
        if isinstance(v, torch.Tensor):
            out.append(v)
    return out


def _sync(device: str) -> None:
    if device == "cuda":
        torch.cuda.synchronize()


class Floor:
    """The memcpy floor: one copy of every local tensor into reused host buffers."""

    def __init__(self, tensors: List[torch.Tensor], device: str):
        self.tensors = tensors
        self.device = device
        pin = device == "cuda"
        self.bufs = [torch.empty(t.shape, dtype=t.dtype, pin_memory=pin) for t in tensors]
        self.stream = torch.cuda.Stream() if device == "cuda" else None

    def __call__(self) -> None:
        if self.stream is not None:
            self.stream.wait_stream(torch.cuda.current_stream())
            with torch.cuda.stream(self.stream):
                for b, t in zip(self.bufs, self.tensors):
                    b.copy_(t, non_blocking=True)
            self.stream.synchronize()
        else:
            for b, t in zip(self.bufs, self.tensors):
                b.copy_(t)


class Method:
    """One way of saving: ``start(i)`` blocks for the stall, ``finish(h)`` waits for the rest."""

    def __init__(self, name, start, finish=None, cleanup=None, touch=None):
        self.name, self.start, self.finish, self.cleanup, self.touch = name, start, finish, cleanup, touch
        self.stalls: List[float] = []
        self.totals: List[float] = []
        self.error: Optional[str] = None

    def once(self, i: int, device: str) -> None:
        if self.error is not None:
            return
        try:
            self._once(i, device)
        except Exception as e:  # e.g. a DCP stager that cannot take this state on this torch
            self.error = f"{type(e).__name__}: {str(e).splitlines()[0][:120] if str(e) else ''}"
            if dist.is_initialized():
                dist.barrier()

    def _once(self, i: int, device: str) -> None:
        _sync(device)
        _barrier()
        t0 = time.perf_counter()
        handle = self.start(i)
        stall = time.perf_counter() - t0
        if self.touch is not None:
            self.touch()  # training changes the tensors right away
        if self.finish is not None:
            self.finish(handle)
        total = time.perf_counter() - t0
        _sync(device)
        self.stalls.append(_slowest(stall))
        self.totals.append(_slowest(total))
        _barrier()
        if self.cleanup is not None:
            self.cleanup(i)

    def row(self) -> Dict[str, Any]:
        if self.error is not None or len(self.stalls) < 2:
            return {"name": self.name, "error": self.error or "no result"}
        return {
            "name": self.name,
            "first": self.stalls[0],
            "steady": statistics.median(self.stalls[1:]),
            "fastest": min(self.stalls[1:]),
            "total": statistics.median(self.totals[1:]),
        }


FLOOR = "memcpy floor (copy into reused host buffers)"


def _fmt(x: Optional[float]) -> str:
    return "n/a" if x is None else f"{x:.3f}"


def _gil_model(args, device: str):
    """A training step that is Python/GIL-bound: many small layers, a small batch."""
    torch.manual_seed(0)
    layers = []
    for _ in range(args.gil_layers):
        layers += [torch.nn.Linear(args.gil_width, args.gil_width), torch.nn.ReLU()]
    model = torch.nn.Sequential(*layers).to(device)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-4, foreach=False)  # per-parameter Python loop
    x = torch.randn(args.gil_batch, args.gil_width, device=device)

    def step() -> float:
        t0 = time.perf_counter()
        opt.zero_grad(set_to_none=True)
        model(x).square().mean().backward()
        opt.step()
        _sync(device)
        return time.perf_counter() - t0

    return step


def _gil_child(args) -> int:
    """The control: the same save, run by another process (shares the CPUs, not the GIL)."""
    state = build_state(args.size_gb, args.tensors, "cpu", 0, 1)
    print("ready", flush=True)
    i = 0
    for line in sys.stdin:
        if line.strip() != "go":
            break
        url = os.path.join(args.dir, f"child{i}")
        shardckpt.save(state, url, no_dist=True)
        shutil.rmtree(url, ignore_errors=True)
        print("done", flush=True)
        i += 1
    return 0


class _Child:
    def __init__(self, args, base: str):
        import subprocess
        import threading

        cmd = [sys.executable, os.path.abspath(__file__), "--gil-child", "--size-gb", str(args.size_gb),
               "--tensors", str(args.tensors), "--dir", base]
        self.proc = subprocess.Popen(cmd, stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True)
        self.done = threading.Event()
        if self.proc.stdout.readline().strip() != "ready":
            raise RuntimeError("the control process did not start")

        def reader():
            for line in self.proc.stdout:
                if line.strip() == "done":
                    self.done.set()

        threading.Thread(target=reader, daemon=True).start()

    def go(self) -> None:
        self.done.clear()
        self.proc.stdin.write("go\n")
        self.proc.stdin.flush()

    def close(self) -> None:
        try:
            self.proc.stdin.write("quit\n")
            self.proc.stdin.close()
        except OSError:
            pass
        self.proc.wait(timeout=120)


def gil_probe(args) -> int:
    """Which kind of background byte work slows the GIL-bound loop: one thread of this process doing only it.

    ``crc 1 MiB`` is what the writer does (one CRC-32C call per format-v2
    block), ``crc 32 MiB`` the same bytes in 32x fewer calls, ``write 32 MiB``
    the writer's ``os.write`` calls. Each call that releases the GIL must
    take it back afterwards, and the training thread, which gives the GIL up
    around every torch op, then waits for the hand-back: the cost grows with
    the number of calls per second, not with the bytes.
    """
    import threading

    import crc32c

    step = _gil_model(args, "cpu")
    for _ in range(30):
        step()
    buf = bytearray(os.urandom(1 << 20)) * 256  # 256 MiB
    mv = memoryview(buf)
    path = os.path.join(args.dir or tempfile.gettempdir(), f"gil_probe_{os.getpid()}.bin")

    def work(kind: str, stop) -> None:
        while not stop.is_set():
            if kind == "write 32 MiB":
                fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC)
                try:
                    for o in range(0, len(mv), 32 << 20):
                        os.write(fd, mv[o : o + (32 << 20)])
                finally:
                    os.close(fd)
            else:
                piece = (1 << 20) if kind == "crc 1 MiB" else (32 << 20)
                for o in range(0, len(mv), piece):
                    crc32c.crc32c(mv[o : o + piece])

    def run(kind: Optional[str], n: int) -> float:
        stop = threading.Event()
        th = threading.Thread(target=work, args=(kind, stop)) if kind else None
        if th:
            th.start()
        xs = [step() for _ in range(n)]
        stop.set()
        if th:
            th.join()
        return statistics.median(xs)

    alone = run(None, args.gil_steps)
    lines = [f"torch threads {torch.get_num_threads()}, cpus {os.cpu_count()}; step alone median {alone * 1e3:.2f} ms"]
    for kind in ("crc 1 MiB", "crc 32 MiB", "write 32 MiB"):
        m = run(kind, args.gil_steps)
        lines.append(f"with a thread doing {kind:12s}: median {m * 1e3:.2f} ms ({m / alone:.3f}x)")
    try:
        os.unlink(path)
    except OSError:
        pass
    print("\n".join(lines))
    return 0


def gil_cost(args) -> int:
    """Step time of a GIL-bound training loop: alone, with an async_save writing, with the same save in another process.

    The state (``--size-gb`` of other tensors, on ``--device``) is written by
    ``async_save`` while the loop runs, with the writer of ``--writer``:
    ``thread`` (a background thread of this process), ``process``
    (``SHARDCKPT_ASYNC_WRITER=process``: a writer child fed through shared
    memory) or ``both`` (each in turn, every round). The control writes the
    same bytes through the same writer from a second process, so it competes
    for the CPUs but not for this process's GIL. Rounds interleave them all so
    that noise hits them alike (the two writers in alternating order); one
    unmeasured save per writer first (buffers
    allocated, the writer child started). The GIL cost of the background
    write is the in-process slowdown beyond the control's; the CPU cost is
    the control's slowdown itself (on a machine with spare cores, near zero).
    """
    device = args.device
    if device == "cuda" and not torch.cuda.is_available():
        raise SystemExit("--device cuda: no GPU visible")
    base = args.dir or tempfile.mkdtemp(prefix="bench_gil_")
    os.makedirs(base, exist_ok=True)
    state = build_state(args.size_gb, args.tensors, device, 0, 1)
    step = _gil_model(args, device)
    from shardckpt import _knobs

    writers = ["thread", "process"] if args.writer == "both" else [args.writer]
    child = None if args.no_control else _Child(args, base)
    for _ in range(30):
        step()
    alone: List[float] = []
    inproc: Dict[str, List[float]] = {w: [] for w in writers}
    control: List[float] = []
    stalls: Dict[str, List[float]] = {w: [] for w in writers}
    writes: Dict[str, List[float]] = {w: [] for w in writers}
    knob = _knobs.ASYNC_WRITER
    try:
        for w in writers:  # warm-up: staging buffers, the writer child
            _knobs.ASYNC_WRITER = w
            shardckpt.async_save(state, os.path.join(base, f"warm-{w}"), no_dist=True).result()
            shutil.rmtree(os.path.join(base, f"warm-{w}"), ignore_errors=True)
        for i in range(args.iters):
            alone += [step() for _ in range(args.gil_steps)]
            # Alternate the order: a save's write-back still runs when the next one starts.
            for w in writers if i % 2 == 0 else writers[::-1]:
                _knobs.ASYNC_WRITER = w
                url = os.path.join(base, f"a{i}-{w}")
                t0 = time.perf_counter()
                h = shardckpt.async_save(state, url, no_dist=True)
                stalls[w].append(time.perf_counter() - t0)
                while not h.done():
                    inproc[w].append(step())
                h.result()
                writes[w].append(time.perf_counter() - t0)
                shutil.rmtree(url, ignore_errors=True)
            if child is not None:
                child.go()
                while not child.done.is_set():
                    control.append(step())
    finally:
        _knobs.ASYNC_WRITER = knob
        if child is not None:
            child.close()
        shardckpt.release_buffers()
        if not args.dir:
            shutil.rmtree(base, ignore_errors=True)
    med = statistics.median
    m_alone = med(alone)
    nparams = args.gil_layers * (args.gil_width * args.gil_width + args.gil_width)
    lines = [
        f"device {device}, state {args.size_gb} GB in {args.tensors * 3} tensors, torch {torch.__version__}, "
        f"torch threads {torch.get_num_threads()}, cpus {os.cpu_count()}",
        f"loop: {args.gil_layers} x Linear({args.gil_width}) + ReLU, batch {args.gil_batch}, AdamW "
        f"({nparams / 1e6:.2f} M params); {args.iters} rounds",
    ]
    for w in writers:
        lines.append(f"async_save ({w}): stall median {med(stalls[w]) * 1e3:.0f} ms, "
                     f"call to committed median {med(writes[w]):.2f} s")
    lines.append(f"step alone:                          median {m_alone * 1e3:.2f} ms over {len(alone)} steps")
    for w in writers:
        if inproc[w]:
            m_in = med(inproc[w])
            lines.append(f"step, async_save writing ({w + '):':9s} median {m_in * 1e3:.2f} ms over {len(inproc[w])} steps "
                         f"({m_in / m_alone:.3f}x)")
    if control:
        m_ctl = med(control)
        lines.append(f"step, same save in another process:  median {m_ctl * 1e3:.2f} ms over {len(control)} steps "
                     f"({m_ctl / m_alone:.3f}x)")
        for w in writers:
            if inproc[w]:
                lines.append(f"GIL share of the slowdown ({w}): {(med(inproc[w]) - m_ctl) / m_alone * 100:+.1f}% of a step "
                             f"(in-process minus other-process); CPU share: {(m_ctl - m_alone) / m_alone * 100:+.1f}%")
    print("\n".join(lines))
    if args.out:
        with open(args.out, "w") as f:
            f.write("\n".join(lines) + "\n")
    return 0


def main(argv: Optional[List[str]] = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--device", choices=["cpu", "cuda"], default="cpu")
    ap.add_argument("--size-gb", type=float, default=1.0, help="total state size over all ranks (default 1)")
    ap.add_argument("--tensors", type=int, default=64, help="number of large tensors (default 64)")
    ap.add_argument("--iters", type=int, default=4, help="calls per method; the first is reported apart (default 4)")
    ap.add_argument("--dir", default=None, help="where checkpoints go (default: a temp dir; removed after)")
    ap.add_argument("--out", default=None, help="write the markdown table here too")
    ap.add_argument("--no-dcp", action="store_true", help="skip the DCP rows")
    ap.add_argument("--gil", action="store_true",
                    help="instead: step time of a GIL-bound training loop alone, with an async_save in flight, "
                         "and with the same save in another process (--iters rounds)")
    ap.add_argument("--gil-layers", type=int, default=48, help="--gil: Linear layers of the loop's MLP (default 48)")
    ap.add_argument("--gil-width", type=int, default=64, help="--gil: their width (default 64)")
    ap.add_argument("--gil-batch", type=int, default=8, help="--gil: batch size (default 8)")
    ap.add_argument("--gil-steps", type=int, default=100, help="--gil: steps alone per round (default 100)")
    ap.add_argument("--no-control", action="store_true", help="--gil: skip the other-process control")
    ap.add_argument("--writer", choices=["thread", "process", "both"], default="thread",
                    help="--gil: the async save's writer (SHARDCKPT_ASYNC_WRITER); both: each in turn (default thread)")
    ap.add_argument("--gil-probe", action="store_true",
                    help="instead: the loop's step time next to a thread doing only CRC-32C (1 or 32 MiB calls) or writes")
    ap.add_argument("--gil-child", action="store_true", help=argparse.SUPPRESS)
    args = ap.parse_args(argv)
    if args.gil_child:
        return _gil_child(args)
    if args.gil_probe:
        return gil_probe(args)
    if args.gil:
        return gil_cost(args)
    if args.iters < 2:
        ap.error("--iters must be at least 2 (the first call is reported apart)")
    if args.device == "cuda" and not torch.cuda.is_available():
        ap.error("--device cuda: no GPU visible")

    rank, world = _dist_setup(args.device)
    base = args.dir or tempfile.mkdtemp(prefix="bench_async_")
    if world > 1:
        box = [base]
        dist.broadcast_object_list(box, src=0, group=_cpu_group())
        base = box[0]
    state = build_state(args.size_gb, args.tensors, args.device, rank, world)
    tensors = _local_tensors(state)
    nbytes = sum(t.numel() * t.element_size() for t in tensors)

    def url(kind: str, i: int) -> str:
        return os.path.join(base, f"{kind}-{i}")

    def rm(kind: str):
        def go(i: int) -> None:
            if rank == 0:
                shutil.rmtree(url(kind, i), ignore_errors=True)
            _barrier()

        return go

    def touch():
        with torch.no_grad():
            tensors[0].add_(1.0)

    floor = Floor(tensors, args.device)
    # The floor runs right before shardckpt.async_save, after the sync save's
    # fsync: neither sees page-cache writeback left by another method.
    methods = [
        Method("shardckpt.save (sync)", lambda i: shardckpt.save(state, url("sync", i)), cleanup=rm("sync")),
        Method(FLOOR, lambda i: floor()),
        Method(
            "shardckpt.async_save",
            lambda i: shardckpt.async_save(state, url("async", i)),
            finish=lambda h: h.result(),
            cleanup=rm("async"),
            touch=touch,
        ),
    ]
    stager = None
    if not args.no_dcp:
        import torch.distributed.checkpoint as dcp

        def dcp_state():
            return {k: v for k, v in state.items() if isinstance(v, torch.Tensor)}

        methods.append(
            Method(
                "DCP async_save (default stager)",
                lambda i: dcp.async_save(dcp_state(), checkpoint_id=url("dcp", i)),
                finish=lambda f: f.result(),
                cleanup=rm("dcp"),
                touch=touch,
            )
        )
        if args.device == "cuda":
            try:
                from torch.distributed.checkpoint.staging import DefaultStager, StagingOptions

                stager = DefaultStager(StagingOptions(True, False, True, True))
            except Exception as e:  # older torch: no such stager
                if rank == 0:
                    print(f"(skipping DCP's pinned stager: {type(e).__name__}: {e})", file=sys.stderr)
        if stager is not None:

            def dcp_pinned(i):
                resp = dcp.async_save(dcp_state(), checkpoint_id=url("dcpp", i), async_stager=stager)
                # Training may change the tensors only once staging is complete.
                if hasattr(resp, "staging_completion"):
                    resp.staging_completion.result()
                    return resp.upload_completion
                return resp

            methods.append(
                Method(
                    "DCP async_save (pinned stager, reused; stall until staged)",
                    dcp_pinned,
                    finish=lambda f: f.result(),
                    cleanup=rm("dcpp"),
                    touch=touch,
                )
            )
    # Round robin, so that noise from a shared machine hits every method alike.
    for i in range(args.iters):
        for m in methods:
            m.once(i, args.device)
    if stager is not None:
        stager.close()
    rows = [m.row() for m in methods]

    if rank == 0:
        floor_s = next(r for r in rows if r["name"] == FLOOR)["steady"]
        ours = next(r for r in rows if r["name"] == "shardckpt.async_save")["steady"]
        dcp_row = next((r for r in rows if r["name"].startswith("DCP async_save (default") and not r.get("error")), None)
        dev = torch.cuda.get_device_name() if args.device == "cuda" else platform.processor() or platform.machine()
        lines = [
            f"State: {nbytes / 1e9:.2f} GB per rank ({len(tensors)} tensors), {world} rank(s), device {args.device} ({dev}), "
            f"torch {torch.__version__}, {os.cpu_count()} CPUs, checkpoints in {base}. Times in seconds; "
            f"'median' and 'fastest' are over calls 2..{args.iters}; with several ranks, every number is the slowest rank's.",
            "",
            "| method | stall, first call | stall, median | stall, fastest | median / floor median | until committed (median) |",
            "| --- | ---: | ---: | ---: | ---: | ---: |",
        ]
        for r in sorted(rows, key=lambda r: r["name"] != FLOOR):
            if r.get("error"):
                lines.append(f"| {r['name']} | failed: {r['error']} | | | | |")
                continue
            total = _fmt(r["total"]) if r["name"] != FLOOR else "-"
            lines.append(
                f"| {r['name']} | {_fmt(r['first'])} | {_fmt(r['steady'])} | {_fmt(r['fastest'])} "
                f"| {r['steady'] / floor_s:.2f}x | {total} |"
            )
        lines.append("")
        lines.append(
            f"shardckpt async stall = {ours / floor_s:.2f}x the memcpy floor"
            + (f", {ours / dcp_row['steady']:.2f}x DCP's async stall." if dcp_row else ".")
        )
        text = "\n".join(lines)
        print(text)
        if args.out:
            with open(args.out, "w") as f:
                f.write(text + "\n")
    from shardckpt import release_buffers

    release_buffers()
    _barrier()
    if rank == 0 and args.dir is None:
        shutil.rmtree(base, ignore_errors=True)
    if dist.is_initialized():
        dist.destroy_process_group()
    return 0


if __name__ == "__main__":
    sys.exit(main())
