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
from typing import Any, Callable, Dict, List, Optional

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


def main(argv: Optional[List[str]] = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--device", choices=["cpu", "cuda"], default="cpu")
    ap.add_argument("--size-gb", type=float, default=1.0, help="total state size over all ranks (default 1)")
    ap.add_argument("--tensors", type=int, default=64, help="number of large tensors (default 64)")
    ap.add_argument("--iters", type=int, default=4, help="calls per method; the first is reported apart (default 4)")
    ap.add_argument("--dir", default=None, help="where checkpoints go (default: a temp dir; removed after)")
    ap.add_argument("--out", default=None, help="write the markdown table here too")
    ap.add_argument("--no-dcp", action="store_true", help="skip the DCP rows")
    args = ap.parse_args(argv)
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
