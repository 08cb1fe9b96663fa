"""Checkpoint every step into the memory tier, lose a node, recover (issue 28).

A real training loop (FSDP2 + AdamW, an MLP stack of ``--layers`` Linear+ReLU
blocks of ``--dim``, compute-bound steps of ``--accum`` microbatches of
``--rows`` rows per rank) on ``--world`` ranks as 2 "nodes" (each node's
shared memory a directory under ``--shm``). Three phases, each in fresh
processes:

1. *first run*: ``mgr.restore`` (nothing to restore: the tier's slots are
   then made in the background after the optimizer's first step), the
   device-to-host floor (each tensor of the rank's shard copied into one
   pinned, registered host buffer, the plain copy a snapshot cannot beat;
   for CPU tensors a ``memcpy`` into a buffer touched before), then one
   window of ``--steps`` steps per mode: without saving (``baseline``), the
   ideal (``ideal``: each tensor copied on a side stream into its own
   preallocated pinned buffer, the next ``opt.step()`` waiting for it on
   the GPU), ``save_to_memory`` every step (``blocking``), and
   ``save_to_memory(..., overlap=True)`` every step (the copy runs during
   the next forward and backward; the optimizer step waits for it).
   What training sees is measured: each step is timed on the training
   stream (``torch.cuda.current_stream().synchronize()``; side-stream
   copies run on), and the device is synced (every stream) only at a
   window's two ends, so ``window_s`` / ``steps_per_s`` are the throughput
   training gets, copies included. (A device-wide sync after every step, as
   this benchmark did before issue 44, forces each step's copy to finish
   inside the step: it measured the copy, +14.7% on one H100, where
   training pays +0.3%.) The first ``save_to_memory`` of the run is one
   step of its own (``first_save``), before the first saving mode's window.
   Then the last step is
   waited for (held), saved to storage (``mgr.save``, timed: the synchronous
   storage save of the same state) and with DCP, and training goes on
   ``--more`` steps: the reference losses. The processes exit without
   closing (killed) and node 1's memory directory is wiped (the node lost).
2. *replacement, same world*: every rank starts with other values; node 1's
   ranks have an empty memory directory. ``mgr.restore`` (timed) must say
   ``memory:<step>``; what each rank's restore did is reported beside its
   shard (``restore_same_world.per_rank``: bytes read in its node's memory,
   checked, received, sent, seconds per phase), with the checks of the
   issue: the replacement's bytes received over its shard (aim <= 1.05),
   each survivor's bytes checked over its own shard (once: ~1.0) and the
   restore against its aim, 1.25 x (shard / the measured peer link) + one
   host-to-device copy of the shard. Training goes on ``--more`` steps and its losses must
   equal phase 1's bit for bit. Then the cold storage restore (page cache
   dropped) and DCP's load are timed in the same processes, values checked
   (``memory_vs_storage_speedup``: aim >= 10 on GPUs).
3. *smaller world*: node 1 is not replaced; node 0's ranks alone restore
   from their memory and train on (losses equal up to float reduction order:
   the global batch is the same, split over fewer ranks).

``--world 1`` (one GPU, one node): phase 2 is a crash restart on the same
node (its memory directory kept), phase 3 is skipped.

Prints one JSON summary (``--json`` writes it too). The data are
deterministic: each microbatch is a global batch drawn from a seed of the
step, every rank taking its rows, so every world size trains on the same
examples.

Usage:
  python benchmarks/bench_every_step.py --backend gloo --world 4          # CPU, small
  python benchmarks/bench_every_step.py --backend nccl --world 2 --dim 8192 --layers 40 --rows 4096 --accum 4
  (2 GPUs: benchmarks/device/every_step_2gpu.sh; 1 GPU: benchmarks/device/every_step_1gpu.sh)
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import statistics
import sys
import tempfile
import time
from typing import Any, Dict, List

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

from _common import drop_page_cache, machine_info, run_isolated_ranks  # noqa: E402
from bench_memory_restore import _h2d_gbps, _link_gbps  # noqa: E402 - the same link and copy measurements

MODES = ("baseline", "ideal", "blocking", "overlap")


# --------------------------------------------------------------------------
# the training job (runs in each rank's process)


def _setup(backend: str):
    import torch
    import torch.distributed as dist

    torch.set_num_threads(max(1, int(os.environ.get("BENCH_THREADS", "1"))))
    dist.init_process_group(backend)
    rank = dist.get_rank()
    if backend == "nccl":
        torch.cuda.set_device(int(os.environ.get("LOCAL_RANK", rank)))
        torch.backends.cuda.matmul.allow_tf32 = True
        torch.backends.cudnn.allow_tf32 = True
        return rank, dist.get_world_size(), torch.device("cuda", torch.cuda.current_device())
    return rank, dist.get_world_size(), torch.device("cpu")


def _build(dim: int, layers: int, device, seed: int):
    import torch
    from torch.distributed.fsdp import fully_shard

    torch.manual_seed(seed)
    with torch.device(device):
        model = torch.nn.Sequential(*[torch.nn.Sequential(torch.nn.Linear(dim, dim), torch.nn.ReLU()) for _ in range(layers)])
    for block in model:
        fully_shard(block)
    fully_shard(model)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-4)
    return model, opt


def _train_step(model, opt, step: int, a: Dict[str, Any], rank: int, world: int, device) -> float:
    """One optimizer step over ``accum`` microbatches of the step's global batch; the global mean loss."""
    import torch
    import torch.distributed as dist

    total = torch.zeros((), device=device)
    rows = a["rows"] * a["world"] // world  # the same global batch at any world size
    for micro in range(a["accum"]):
        g = torch.Generator(device=device)
        g.manual_seed(1000 * step + micro)
        glob = a["rows"] * a["world"]
        x = torch.randn(glob, a["dim"], generator=g, device=device)[rank * rows : (rank + 1) * rows]
        y = torch.randn(glob, a["dim"], generator=g, device=device)[rank * rows : (rank + 1) * rows]
        loss = (model(x) - y).pow(2).mean() / a["accum"]
        loss.backward()
        total += loss.detach()
    opt.step()
    opt.zero_grad(set_to_none=True)
    dist.all_reduce(total)
    return float(total.item()) / world


def _local_tensors(model, opt) -> List[Any]:
    """The tensors of this rank's shard: parameters and optimizer state, local pieces."""
    out = [p.to_local() if hasattr(p, "to_local") else p for p in model.parameters()]
    for st in opt.state.values():
        for v in st.values():
            if hasattr(v, "to_local"):
                v = v.to_local()
            if hasattr(v, "numel"):
                out.append(v)
    return [t.detach() for t in out]


def _d2h_floor(tensors, reps: int = 3) -> float:
    """Seconds of the plain copy of these tensors into one pinned host buffer (median of ``reps``)."""
    import torch

    total = sum(t.numel() * t.element_size() for t in tensors)
    host = torch.empty(total, dtype=torch.uint8)
    cuda = any(t.is_cuda for t in tensors)
    registered = cuda and int(torch.cuda.cudart().cudaHostRegister(host.data_ptr(), total, 0)) == 0
    host.fill_(0)  # pages touched before timing (for CPU: the floor is a memcpy into warm memory)
    times = []
    try:
        for _ in range(reps):
            if cuda:
                torch.cuda.synchronize()
            t0 = time.perf_counter()
            off = 0
            for t in tensors:
                n = t.numel() * t.element_size()
                host[off : off + n].copy_(t.reshape(-1).view(torch.uint8), non_blocking=cuda)
                off += n
            if cuda:
                torch.cuda.synchronize()
            times.append(time.perf_counter() - t0)
    finally:
        if registered:
            torch.cuda.cudart().cudaHostUnregister(host.data_ptr())
    return statistics.median(times)


def _mgr(a: Dict[str, Any], rank: int, world: int):
    import shardckpt

    rpn = max(1, a["world"] // 2)  # the first run's node size: node k = ranks [k*rpn, (k+1)*rpn)
    tier = shardckpt.MemoryTier(dir=os.path.join(a["shm"], f"node{rank // rpn}"), ranks_per_node=min(rpn, world))
    return shardckpt.CheckpointManager(os.path.join(a["base"], "root"), memory=tier)


def _sync(device) -> None:
    """The whole device (every stream): only at a window's ends, never inside one."""
    import torch

    if device.type == "cuda":
        torch.cuda.synchronize()


def _stream_sync(device) -> None:
    """The training stream only: what the training loop itself waits for (side-stream copies run on)."""
    import torch

    if device.type == "cuda":
        torch.cuda.current_stream().synchronize()


class _IdealCopy:
    """The ideal every-step copy: each local tensor into its own preallocated pinned buffer on a side stream.

    The next ``opt.step()`` waits for the copy on the GPU (a step pre-hook
    makes the training stream wait for the copy's event), as the tier's
    ``overlap=True`` does, but with none of its work: no layout, no
    checksums, no commit, no peer copy. On CPU: a ``memcpy`` into buffers
    touched before (the copy cannot overlap: it is the floor).
    """

    def __init__(self, tensors, opt):
        import torch

        self.tensors = tensors
        self.cuda = any(t.is_cuda for t in tensors)
        self.host = [torch.empty(t.shape, dtype=t.dtype, pin_memory=self.cuda) for t in tensors]
        for h in self.host:
            h.zero_()
        self.stream = torch.cuda.Stream() if self.cuda else None
        self.event = None
        self.hook = opt.register_step_pre_hook(self._wait)

    def _wait(self, *_: Any) -> None:
        import torch

        if self.event is not None:
            torch.cuda.current_stream().wait_event(self.event)
            self.event = None

    def copy(self) -> None:
        import torch

        if not self.cuda:
            for h, t in zip(self.host, self.tensors):
                h.copy_(t)
            return
        self.stream.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(self.stream):
            for h, t in zip(self.host, self.tensors):
                h.copy_(t, non_blocking=True)
            self.event = torch.cuda.Event()
            self.event.record(self.stream)

    def close(self) -> None:
        self.hook.remove()
        if self.event is not None:
            self.event.synchronize()
        self.host = []


def first_run(**a: Any) -> dict:
    import torch.distributed as dist
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.state_dict import get_state_dict

    rank, world, device = _setup(a["backend"])
    model, opt = _build(a["dim"], a["layers"], device, seed=0)
    mgr = _mgr(a, rank, world)
    out: Dict[str, Any] = {"rank": rank}
    step = 0
    # As a training script starts: restore (nothing here: a fresh run). The tier's slots are then made in the
    # background, after the optimizer's first step (its state sized), so the first save allocates nothing.
    t0 = time.perf_counter()
    assert mgr.restore({"model": model, "optim": opt, "step": step}) is None
    out["restore_call_s"] = time.perf_counter() - t0
    # Warm-up (allocations, the optimizer state, kernels) then the floor on the real shard.
    for _ in range(a["warmup"]):
        step += 1
        _train_step(model, opt, step, a, rank, world, device)
    # The tier's warm-up (its slots made and pinned in the background, started by the first optimizer step) ends
    # before the windows, so that it perturbs none of them; how long it ran is reported.
    t0 = time.perf_counter()
    mgr._memory.snapshots.done.wait()
    out["warm_wait_s"] = time.perf_counter() - t0
    out["warm"] = dict(mgr._memory.snapshots.last_warm)
    tensors = _local_tensors(model, opt)
    out["shard_bytes"] = sum(t.numel() * t.element_size() for t in tensors)
    out["d2h_floor_s"] = _d2h_floor(tensors)
    times: Dict[str, List[float]] = {m: [] for m in MODES}
    windows: Dict[str, float] = {}
    calls: Dict[str, List[float]] = {m: [] for m in MODES if m not in ("baseline", "ideal")}
    held: List[float] = []
    state = {"model": model, "optim": opt, "step": step}

    def save(mode: str, step: int) -> float:
        t1 = time.perf_counter()
        state["step"] = step
        mgr.save_to_memory(step, state, overlap=mode == "overlap")
        return time.perf_counter() - t1

    ideal = None
    for mode in MODES:
        if mode == "ideal":
            ideal = _IdealCopy(tensors, opt)
        elif mode != "baseline" and "first_save" not in out:
            # The first save_to_memory of the run, on its own: one step, timed on the training stream.
            _sync(device)
            dist.barrier()
            t0 = time.perf_counter()
            step += 1
            _train_step(model, opt, step, a, rank, world, device)
            call = save(mode, step)
            _stream_sync(device)
            out["first_save"] = {"mode": mode, "call_s": call, "step_s": time.perf_counter() - t0}
        elif mode != "baseline":
            step += 1  # this mode's first save (untimed): the previous mode's step in flight settles
            _train_step(model, opt, step, a, rank, world, device)
            save(mode, step)
        # One window of ``steps`` steps: a device-wide sync (and a barrier) only at its two ends.
        _sync(device)
        dist.barrier()
        w0 = time.perf_counter()
        for _ in range(a["steps"]):
            t0 = time.perf_counter()
            step += 1
            _train_step(model, opt, step, a, rank, world, device)  # ends with the loss's .item(): the training stream
            if mode == "ideal":
                ideal.copy()
            elif mode != "baseline":
                calls[mode].append(save(mode, step))
                held.append(mgr._memory.last_save.get("held_s", 0.0))
            _stream_sync(device)
            times[mode].append(time.perf_counter() - t0)
        if mode == "ideal":
            ideal.close()  # waits for the last copy: inside the window, as the tier's last copy is
        _sync(device)
        dist.barrier()
        windows[mode] = time.perf_counter() - w0
    del tensors
    saved_step = step
    state = {"model": model, "optim": opt, "step": step}
    mgr._memory.snapshots.wait()  # the last step held (both copies, verified)
    out["last_save"] = dict(mgr._memory.last_save)
    out["host_bytes"] = mgr._memory.snapshots.host_bytes()
    out.update(step=saved_step, step_s=times, window_s=windows, call_s=calls, held_s=held)
    if a["only_first"]:
        dist.barrier()
        return out
    dist.barrier()
    t0 = time.perf_counter()
    mgr.save(saved_step, state)
    out["storage_save_s"] = time.perf_counter() - t0
    msd, osd = get_state_dict(model, opt)
    dist.barrier()
    t0 = time.perf_counter()
    dcp.save({"model": msd, "optim": osd}, checkpoint_id=os.path.join(a["base"], "dcp"))
    out["dcp_save_s"] = time.perf_counter() - t0
    out["losses"] = [_train_step(model, opt, saved_step + k + 1, a, rank, world, device) for k in range(a["more"])]
    dist.barrier()
    # No close(): the job dies here; the memory directories stay (node 1's is wiped by the driver).
    return out


def _fingerprint(model, opt) -> List[float]:
    """Sums of every local tensor: a cheap check that two restores left the same values."""
    return [float(t.double().sum().item()) for t in _local_tensors(model, opt)]


def restart(**a: Any) -> dict:
    import torch.distributed as dist
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.state_dict import get_state_dict, set_state_dict

    import shardckpt

    rank, world, device = _setup(a["backend"])
    model, opt = _build(a["dim"], a["layers"], device, seed=1 + rank)
    _train_step(model, opt, 0, a, rank, world, device)  # optimizer state exists, other values
    state = {"model": model, "optim": opt, "step": 0}
    mgr = _mgr(a, rank, world)
    dist.barrier()
    t0 = time.perf_counter()
    step = mgr.restore(state)
    _sync(device)
    out: Dict[str, Any] = {"rank": rank, "memory_restore_s": time.perf_counter() - t0, "from": mgr.restored_from,
                           "step": step, "restore_stats": _jsonable(mgr._memory.last_restore)}
    out["shard_bytes"] = sum(t.numel() * t.element_size() for t in _local_tensors(model, opt))
    want = _fingerprint(model, opt)
    if a["cold"] and world > 1:  # the restore's floor: the peer link (rank 0 -> node 1's first rank) and pinned H2D
        dev = "cpu" if device.type == "cpu" else str(device)
        out["link_gbps"] = _link_gbps(rank, world // 2, dev, nbytes=(64 << 20) if dev == "cpu" else (1 << 30))
        out["h2d_gbps"] = _h2d_gbps(dev)
    if a["cold"]:  # the cold storage restore and DCP's load, in the same processes
        other = shardckpt.CheckpointManager(os.path.join(a["base"], "root"))
        for name, fn, path in (
            ("storage_restore_s", lambda: other.restore(state), os.path.join(a["base"], "root")),
            ("dcp_load_s", lambda: _dcp_load(model, opt, os.path.join(a["base"], "dcp"), dcp, get_state_dict, set_state_dict), os.path.join(a["base"], "dcp")),
        ):
            _scramble(model, opt)
            if rank == 0:
                out["cache_drop"] = drop_page_cache([path])
            dist.barrier()
            t0 = time.perf_counter()
            fn()
            _sync(device)
            out[name] = time.perf_counter() - t0
            assert _fingerprint(model, opt) == want, f"{name}: the values differ from the memory restore's"
    out["losses"] = [_train_step(model, opt, step + k + 1, a, rank, world, device) for k in range(a["more"])]
    dist.barrier()
    # No close(): close() removes the node's memory directory, which the next phase restores from.
    return out


def _dcp_load(model, opt, path, dcp, get_state_dict, set_state_dict) -> None:
    msd, osd = get_state_dict(model, opt)
    sd = {"model": msd, "optim": osd}
    dcp.load(sd, checkpoint_id=path)
    set_state_dict(model, opt, model_state_dict=sd["model"], optim_state_dict=sd["optim"])


def _scramble(model, opt) -> None:
    import torch

    with torch.no_grad():
        for t in _local_tensors(model, opt):
            if t.is_floating_point():
                t.fill_(0.5)


def _jsonable(d: Any) -> Any:
    try:
        json.dumps(d)
        return d
    except TypeError:
        return {k: (v if isinstance(v, (int, float, str, bool, type(None))) else str(v)) for k, v in dict(d).items()}


# --------------------------------------------------------------------------
# the driver


def _stats(xs: List[float]) -> Dict[str, float]:
    if not xs:
        return {}
    s = sorted(xs)
    return {"median": statistics.median(s), "p99": s[min(len(s) - 1, int(round(0.99 * (len(s) - 1))))], "n": len(s)}


def summarize(a: Dict[str, Any], first: List[dict], same: List[dict], smaller: List[dict]) -> Dict[str, Any]:
    """The JSON summary: step times, blocking vs the floor, restore vs storage and DCP, bytes, losses."""
    slow = lambda rs, k: max(r[k] for r in rs)  # noqa: E731 - the slowest rank counts
    step_s = {m: _stats([max(r["step_s"][m][i] for r in first) for i in range(len(first[0]["step_s"][m]))]) for m in MODES}
    call_s = {m: _stats([max(r["call_s"][m][i] for r in first) for i in range(len(first[0]["call_s"][m]))]) for m in ("blocking", "overlap")}
    floor = slow(first, "d2h_floor_s")
    base = step_s["baseline"]["median"]
    window_s = {m: max(r["window_s"][m] for r in first) for m in MODES}
    fmode = first[0]["first_save"]["mode"]
    out: Dict[str, Any] = {
        "config": {k: a[k] for k in ("backend", "world", "dim", "layers", "rows", "accum", "steps", "more")},
        "state_bytes": sum(r["shard_bytes"] for r in first),
        "shard_bytes_per_rank": [r["shard_bytes"] for r in first],
        # Each step timed on the training stream (side-stream copies run on): what the training loop waits for.
        "step_s": step_s,
        "step_overhead_median": {m: step_s[m]["median"] / base - 1 for m in ("ideal", "blocking", "overlap")},
        # What training sees: each mode's window of ``steps`` steps, the device synced only at its two ends.
        "window_s": window_s,
        "steps_per_s": {m: a["steps"] / window_s[m] for m in MODES},
        "window_overhead": {m: window_s[m] / window_s["baseline"] - 1 for m in ("ideal", "blocking", "overlap")},
        "first_save": {
            "mode": fmode,
            "call_s": max(r["first_save"]["call_s"] for r in first),
            "step_s": max(r["first_save"]["step_s"] for r in first),
            "step_over_steady_step": max(r["first_save"]["step_s"] for r in first) / step_s[fmode]["median"],
            "call_over_steady_call": max(r["first_save"]["call_s"] for r in first) / call_s[fmode]["median"],
        },
        "restore_call_s": slow(first, "restore_call_s"),
        "warm": [r["warm"] for r in first],
        "warm_wait_s": slow(first, "warm_wait_s"),
        "save_call_s": call_s,
        "d2h_floor_s": floor,
        "blocking_over_floor": call_s["blocking"]["median"] / floor if floor else None,
        "held_s_median": statistics.median(x for r in first for x in r["held_s"]) if first[0]["held_s"] else None,
        "host_bytes_per_rank": [r["host_bytes"] for r in first],
        "host_bytes_bound_per_rank": [2 * (r["last_save"]["own_bytes"] + r["last_save"].get("peer_bytes_received", 0)) for r in first],
        "peer_copy_s": max(r["last_save"].get("peer_copy_s", 0.0) for r in first),
        "saved_step": first[0]["step"],
    }
    if a.get("only_first"):
        return out
    rpn = max(1, a["world"] // 2)
    replaced = [r for r in same if r["rank"] >= rpn]
    received = [int(r["restore_stats"].get("peer_bytes", r["restore_stats"].get("bytes_received", 0)) or 0) for r in replaced]
    out.update({
        "storage_save_s": slow(first, "storage_save_s"),
        "dcp_save_s": slow(first, "dcp_save_s"),
        "memory_call_vs_storage_save": call_s["blocking"]["median"] / slow(first, "storage_save_s"),
        "restore_same_world": {
            "from": sorted({r["from"] for r in same}),
            "memory_restore_s": slow(same, "memory_restore_s"),
            "storage_restore_s": slow(same, "storage_restore_s"),
            "dcp_load_s": slow(same, "dcp_load_s"),
            "cache_drop": same[0].get("cache_drop"),
            "replacement_bytes_received": received,
            "replacement_shard_bytes": [r["shard_bytes"] for r in replaced],
            "replacement_needed_bytes": [r["restore_stats"].get("needed_bytes") for r in replaced],
            "replacement_meta_bytes": [r["restore_stats"].get("meta_bytes") for r in replaced],
            "losses_identical": all(r["losses"] == f["losses"] for r, f in zip(same, first)),
        },
        "restore_smaller_world": {
            "world": len(smaller),
            "from": sorted({r["from"] for r in smaller}),
            "memory_restore_s": slow(smaller, "memory_restore_s"),
            "losses_max_abs_diff": max(abs(x - y) for x, y in zip(smaller[0]["losses"], first[0]["losses"])),
        } if smaller else None,
        "losses": first[0]["losses"],
    })
    out["restore_same_world"]["memory_vs_storage_speedup"] = out["restore_same_world"]["storage_restore_s"] / out["restore_same_world"]["memory_restore_s"]
    out["restore_same_world"]["received_over_shard"] = [g / s if s else None for g, s in zip(received, out["restore_same_world"]["replacement_shard_bytes"])]
    out["restore_same_world"].update(restore_breakdown(same, rpn))
    return out


def restore_breakdown(same: List[dict], rpn: int) -> Dict[str, Any]:
    """Per rank, what the node-loss restore did (``MemoryStore.last_restore``), and the issue's checks on it.

    ``survivor_verified_over_own``: bytes a survivor checked over the bytes
    its own load needs (each byte checked once: ~1.0; it was ~2.0 when the
    survivors also checked the lost node's copy they send);
    ``replacement_received_over_needed``: data + metadata received over the
    bytes the replacement's load needs (aim <= 1.05); ``aim_s``: 1.25 x the
    largest replacement shard / the measured link + that shard / pinned H2D
    (0 on CPU), against ``memory_restore_s``.
    """
    def row(r: dict) -> Dict[str, Any]:
        s = r["restore_stats"]
        return {"rank": r["rank"], "role": "survivor" if r["rank"] < rpn else "replacement",
                "read_bytes": s.get("local_bytes"), "verified_bytes": s.get("verified_bytes"),
                "received_bytes": s.get("peer_bytes"), "meta_bytes": s.get("meta_bytes"), "sent_bytes": s.get("sent_bytes"),
                "needed_bytes": s.get("needed_bytes"), "shard_bytes": r["shard_bytes"], "restore_s": r["memory_restore_s"],
                "seconds": s.get("seconds")}

    rows = [row(r) for r in same]
    ratio = lambda a, b: (a / b) if a is not None and b else None  # noqa: E731
    surv = [x for x in rows if x["role"] == "survivor"]
    repl = [x for x in rows if x["role"] == "replacement"]
    out: Dict[str, Any] = {
        "per_rank": rows,
        "survivor_verified_over_own": [ratio(x["verified_bytes"], x["needed_bytes"]) for x in surv],
        "survivor_read_over_own_plus_sent": [ratio(x["read_bytes"], (x["needed_bytes"] or 0) + (x["sent_bytes"] or 0)) for x in surv],
        "replacement_received_over_needed": [ratio((x["received_bytes"] or 0) + (x["meta_bytes"] or 0), x["needed_bytes"]) for x in repl],
    }
    link = max((r.get("link_gbps", 0.0) for r in same), default=0.0)
    h2d = min((r["h2d_gbps"] for r in same if r.get("h2d_gbps")), default=0.0)
    if link and repl:
        most = max(x["needed_bytes"] or 0 for x in repl)
        out.update(link_gbps=link, h2d_gbps=h2d,
                   aim_s=1.25 * most / (link * 1e9) + (most / (h2d * 1e9) if h2d else 0.0))
    return out


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--backend", default="gloo", choices=["gloo", "nccl"])
    ap.add_argument("--world", type=int, default=4, help="ranks of the first run (even: 2 nodes)")
    ap.add_argument("--dim", type=int, default=256)
    ap.add_argument("--layers", type=int, default=4)
    ap.add_argument("--rows", type=int, default=64, help="rows per rank per microbatch")
    ap.add_argument("--accum", type=int, default=2, help="microbatches per step")
    ap.add_argument("--steps", type=int, default=5, help="timed steps per mode")
    ap.add_argument("--warmup", type=int, default=1)
    ap.add_argument("--more", type=int, default=3, help="steps trained after the restore (losses compared)")
    ap.add_argument("--dir", default=None, help="storage and DCP checkpoints (default: a temporary directory)")
    ap.add_argument("--shm", default="/dev/shm", help="where the two nodes' memory directories go")
    ap.add_argument("--json", default=None, help="also write the summary here")
    ap.add_argument("--timeout", type=float, default=1800)
    ap.add_argument("--only-first", action="store_true",
                    help="the every-step windows only: no storage or DCP save, no restarts (one GPU: the step's cost)")
    a = ap.parse_args(argv)
    if a.world != 1 and a.world % 2:
        raise SystemExit("--world must be 1 (one node) or even (2 nodes)")
    base = tempfile.mkdtemp(prefix="bench-every-step-", dir=a.dir)
    shm = tempfile.mkdtemp(prefix="bench-every-step-", dir=a.shm)
    args = {k: getattr(a, k) for k in ("backend", "world", "dim", "layers", "rows", "accum", "steps", "warmup", "more")}
    args.update(base=base, shm=shm, cold=False, only_first=a.only_first)
    env = {"CUBLAS_WORKSPACE_CONFIG": ":4096:8"}
    try:
        first = run_isolated_ranks(__file__, "first_run", args, a.world, timeout=a.timeout, env=env)
        same: List[dict] = []
        smaller: List[dict] = []
        if not a.only_first:
            shutil.rmtree(os.path.join(shm, "node1"), ignore_errors=True)  # node 1 lost with its memory
            smaller = run_isolated_ranks(__file__, "restart", args, a.world // 2, timeout=a.timeout, env=env) if a.world > 1 else []
            same = run_isolated_ranks(__file__, "restart", dict(args, cold=True), a.world, timeout=a.timeout, env=env)
        summary = summarize(args, first, same, smaller)
        summary["machine"] = machine_info(base)
    finally:
        shutil.rmtree(shm, ignore_errors=True)
        shutil.rmtree(base, ignore_errors=True)
    text = json.dumps(summary, sort_keys=True)
    print(text, flush=True)
    if a.json:
        with open(a.json, "w") as f:
            f.write(text + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
