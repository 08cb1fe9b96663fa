"""From ``kill -9`` of one node's ranks to the first training step after the restart (issue 44).

A training job (FSDP2 + AdamW, the MLP of ``bench_every_step.py``) on
``--world`` ranks as 2 "nodes" (each node's shared memory a directory
under ``--shm``) saves into the memory tier every step
(``save_to_memory(..., overlap=True)``). Once every rank has trained
``--steps`` steps and the tier holds a step, the driver ``kill -9``s node
1's ranks, then does what torchrun's agent does when a worker dies: it
notices (polling every ``MONITOR_S``, torchrun's ``monitor_interval``),
stops the surviving workers (SIGTERM) and starts the job again, fresh
processes on a new rendezvous port. Two restarts, one after the other:

1. *replacement* (same world): node 1 comes back empty (its memory
   directory gone with the node); every rank restores (``memory:<step>``:
   node 0's ranks from their own node, node 1's from node 0's copies),
   trains one step and goes on saving every step, until the driver kills
   node 1 again;
2. *smaller world*: node 1 is not replaced; node 0's ranks alone restore
   from their memory (resharded) and train one step.

Reported for each: ``kill_to_first_step_s`` (the kill to the last rank's
first completed step after the restart) and its parts per rank, measured
by wall clock on this host: ``detect_s`` (kill to the survivors stopped),
``start_s`` (the new processes started to torch imported), ``pg_s``
(process groups), ``build_s`` (the model and optimizer built),
``restore_s`` (``mgr.restore``), ``step_s`` (the first step).

On CPU (gloo), small sizes: a smoke test of the path (``tests/unit/test_bench_kill_to_step.py``).
Timings on a loaded 2-core machine are mostly interpreter start and import.

Usage:
  python benchmarks/bench_kill_to_step.py --world 4                # CPU, 4 gloo ranks as 2 nodes
  python benchmarks/bench_kill_to_step.py --backend nccl --world 2 --dim 8192 --layers 8 --rows 1024
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from typing import Any, Dict, List, Optional

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

#: How often the driver looks at its workers (torchrun's default ``monitor_interval`` is 0.1 s).
MONITOR_S = 0.1
#: How long a stopped worker gets to exit after SIGTERM before SIGKILL (torchrun: 30 s; nothing to flush here).
STOP_GRACE_S = 10.0


# --------------------------------------------------------------------------
# the worker (one rank of the job)


def _write(path: str, obj: Dict[str, Any]) -> None:
    tmp = path + ".tmp"
    with open(tmp, "w") as f:
        json.dump(obj, f)
    os.replace(tmp, path)


def worker() -> int:
    """One rank: restore, then train and save to memory every step; progress to ``$BENCH_PROGRESS``."""
    t_start = float(os.environ["BENCH_T_SPAWN"])
    t_proc = time.time()
    a = json.loads(os.environ["BENCH_ARGS"])
    import bench_every_step as B
    import torch  # noqa: F401 - the import is part of what a restart costs

    import shardckpt

    times: Dict[str, float] = {"spawned": t_start, "process": t_proc, "imported": time.time()}
    rank, world, device = B._setup(a["backend"])
    times["pg"] = time.time()
    model, opt = B._build(a["dim"], a["layers"], device, seed=1 + rank + 10 * a["phase"])
    times["built"] = time.time()
    rpn = int(os.environ["LOCAL_WORLD_SIZE"])
    tier = shardckpt.MemoryTier(dir=os.path.join(a["shm"], f"node{rank // rpn}"), ranks_per_node=rpn)
    mgr = shardckpt.CheckpointManager(os.path.join(a["base"], "root"), memory=tier)
    state = {"model": model, "optim": opt, "step": 0}
    step = mgr.restore(state) or 0
    B._sync(device)
    times["restored"] = time.time()
    progress = os.path.join(a["progress"], f"p{a['phase']}-r{rank}.json")
    out: Dict[str, Any] = {"rank": rank, "world": world, "restored_step": step, "from": mgr.restored_from, "times": times,
                           "restore_stats": B._jsonable(mgr._memory.last_restore) if mgr._memory is not None else {}}
    dims = dict(a, world=a["world0"])  # the same global batch at any world size
    first = True
    while True:
        step += 1
        loss = B._train_step(model, opt, step, dims, rank, world, device)
        if first:
            times["first_step"] = time.time()
            first = False
        state["step"] = step
        mgr.save_to_memory(step, state, overlap=True)
        out.update(step=step, loss=loss, held=mgr._memory.last_save.get("step"))
        _write(progress, out)
        if a["stop_after"] and step - (out["restored_step"] or 0) >= a["stop_after"]:
            mgr.wait()
            return 0


# --------------------------------------------------------------------------
# the driver (torchrun's agent, played)


def _spawn(a: Dict[str, Any], world: int, rpn: int, phase: int, stop_after: int) -> List[subprocess.Popen]:
    from _common import free_port

    port = str(free_port())
    procs = []
    t = time.time()
    for r in range(world):
        env = dict(os.environ)
        env.update(RANK=str(r), LOCAL_RANK=str(r % rpn), WORLD_SIZE=str(world), LOCAL_WORLD_SIZE=str(rpn),
                   MASTER_ADDR="127.0.0.1", MASTER_PORT=port, BENCH_T_SPAWN=repr(t),
                   BENCH_ARGS=json.dumps(dict(a, phase=phase, stop_after=stop_after)),
                   PYTHONPATH=os.pathsep.join([os.path.dirname(os.path.abspath(__file__)), env.get("PYTHONPATH", "")]))
        log = open(os.path.join(a["progress"], f"p{phase}-r{r}.log"), "w")
        procs.append(subprocess.Popen([sys.executable, os.path.abspath(__file__), "--worker"], env=env,
                                      stdout=log, stderr=subprocess.STDOUT))
        log.close()
    return procs


def _progress(a: Dict[str, Any], phase: int, rank: int) -> Optional[Dict[str, Any]]:
    try:
        with open(os.path.join(a["progress"], f"p{phase}-r{rank}.json")) as f:
            return json.load(f)
    except (OSError, ValueError):
        return None


def _tail(a: Dict[str, Any], phase: int, rank: int) -> str:
    try:
        with open(os.path.join(a["progress"], f"p{phase}-r{rank}.log")) as f:
            return f.read()[-3000:]
    except OSError:
        return ""


def _wait_trained(a: Dict[str, Any], procs: List[subprocess.Popen], phase: int, steps: int, deadline: float) -> int:
    """Wait until every rank trained ``steps`` steps after its restore and a memory step is held everywhere; that step."""
    while True:
        ps = [_progress(a, phase, r) for r in range(len(procs))]
        if all(p is not None and p["step"] - (p["restored_step"] or 0) >= steps and p["held"] for p in ps):
            return min(p["held"] for p in ps if p is not None)
        for r, p in enumerate(procs):
            if p.poll() is not None:
                raise RuntimeError(f"phase {phase}: rank {r} exited with {p.returncode} while training:\n{_tail(a, phase, r)}")
        if time.monotonic() > deadline:
            raise TimeoutError(f"phase {phase}: the ranks did not train {steps} steps in time")
        time.sleep(MONITOR_S)


def _kill_node(procs: List[subprocess.Popen], node_ranks: List[int]) -> Dict[str, float]:
    """``kill -9`` the node's ranks; then, as torchrun's agent: notice, stop the survivors, wait for them."""
    t_kill = time.time()
    for r in node_ranks:
        os.kill(procs[r].pid, signal.SIGKILL)
    while all(procs[r].poll() is None for r in node_ranks):
        time.sleep(MONITOR_S)
    t_seen = time.time()
    for r, p in enumerate(procs):
        if r not in node_ranks and p.poll() is None:
            p.send_signal(signal.SIGTERM)
    for p in procs:
        try:
            p.wait(STOP_GRACE_S)
        except subprocess.TimeoutExpired:
            p.kill()
            p.wait()
    return {"kill": t_kill, "seen": t_seen, "stopped": time.time()}


def _wait_done(a: Dict[str, Any], procs: List[subprocess.Popen], phase: int, deadline: float) -> None:
    for r, p in enumerate(procs):
        try:
            rc = p.wait(max(1.0, deadline - time.monotonic()))
        except subprocess.TimeoutExpired:
            for q in procs:
                q.kill()
            raise TimeoutError(f"phase {phase}: rank {r} did not finish in time:\n{_tail(a, phase, r)}") from None
        if rc != 0:
            raise RuntimeError(f"phase {phase}: rank {r} exited with {rc}:\n{_tail(a, phase, r)}")


def _report(a: Dict[str, Any], phase: int, world: int, kill: Dict[str, float], held: int) -> Dict[str, Any]:
    """``kill_to_first_step_s`` and its parts (the slowest rank's first step counts)."""
    ps = [_progress(a, phase, r) for r in range(world)]
    if any(p is None or "first_step" not in p["times"] for p in ps):
        raise RuntimeError(f"phase {phase}: a rank reported no first step")
    first = max(p["times"]["first_step"] for p in ps)  # type: ignore[index]
    parts = []
    for p in ps:
        t = p["times"]  # type: ignore[index]
        s = p.get("restore_stats") or {}  # type: ignore[union-attr]
        # What the restore did on this rank (MemoryStore.last_restore): bytes read in its node's memory, checked,
        # received (data, metadata), sent, needed by its load, and seconds per phase.
        parts.append({"start_s": t["imported"] - t["spawned"], "pg_s": t["pg"] - t["imported"], "build_s": t["built"] - t["pg"],
                      "restore_s": t["restored"] - t["built"], "step_s": t["first_step"] - t["restored"],
                      "restore_bytes": {k: s.get(k) for k in ("local_bytes", "verified_bytes", "peer_bytes", "meta_bytes",
                                                              "sent_bytes", "needed_bytes")},
                      "restore_phases": s.get("seconds")})  # seconds per phase
    return {
        "world": world,
        "held_at_kill": held,  # seen held by the driver just before the kill
        "restored": sorted({(p["restored_step"], p["from"]) for p in ps}),  # type: ignore[index]
        "kill_to_first_step_s": first - kill["kill"],
        "detect_s": kill["seen"] - kill["kill"],
        "stop_s": kill["stopped"] - kill["seen"],
        "per_rank": parts,
        # The byte checks: the most any rank received (data + metadata) over what its load needs (aim <= 1.05),
        # the most any rank checked over what its load needs (each byte once: ~1.0; the senders' edge blocks aside).
        "max_received_over_needed": max(_ratio((q["restore_bytes"]["peer_bytes"] or 0) + (q["restore_bytes"]["meta_bytes"] or 0),
                                               q["restore_bytes"]["needed_bytes"]) for q in parts),
        "max_verified_over_needed": max(_ratio(q["restore_bytes"]["verified_bytes"] or 0, q["restore_bytes"]["needed_bytes"]) for q in parts),
    }


def _ratio(a: float, b: Optional[float]) -> float:
    return a / b if b else 0.0


def run(a: Dict[str, Any]) -> Dict[str, Any]:
    """The three launches (first run, replacement, smaller world) and their kills; the JSON summary."""
    world, rpn = a["world0"], a["world0"] // 2
    node1 = list(range(rpn, world))
    deadline = time.monotonic() + a["timeout"]
    out: Dict[str, Any] = {"config": {k: a[k] for k in ("backend", "world0", "dim", "layers", "rows", "accum", "steps")}}
    procs = _spawn(a, world, rpn, 0, 0)
    try:
        held = _wait_trained(a, procs, 0, a["steps"], deadline)
        kill = _kill_node(procs, node1)
        shutil.rmtree(os.path.join(a["shm"], "node1"), ignore_errors=True)  # the node is gone with its memory
        procs = _spawn(a, world, rpn, 1, 0)  # its replacement joins: the same world
        held2 = _wait_trained(a, procs, 1, a["steps"], deadline)
        out["replacement"] = _report(a, 1, world, kill, held)
        kill = _kill_node(procs, node1)
        shutil.rmtree(os.path.join(a["shm"], "node1"), ignore_errors=True)
        procs = _spawn(a, rpn, rpn, 2, 1)  # node 1 not replaced: node 0 alone
        _wait_done(a, procs, 2, deadline)
        out["smaller_world"] = _report(a, 2, rpn, kill, held2)
    finally:
        for p in procs:
            if p.poll() is None:
                p.kill()
                p.wait()
    for k in ("replacement", "smaller_world"):
        r = out[k]
        # One step on every rank, from memory, at least the one seen held before the kill (a newer one may be held by
        # the time the kill lands: the survivors train on until they are stopped).
        r["ok"] = len(r["restored"]) == 1 and r["restored"][0][0] >= r["held_at_kill"] and r["restored"][0][1] == f"memory:{r['restored'][0][0]}"
    return out


def main(argv: Optional[List[str]] = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--worker", action="store_true", help=argparse.SUPPRESS)
    ap.add_argument("--backend", default="gloo", choices=["gloo", "nccl"])
    ap.add_argument("--world", type=int, default=4, help="ranks of the first run (even: 2 nodes)")
    ap.add_argument("--dim", type=int, default=128)
    ap.add_argument("--layers", type=int, default=2)
    ap.add_argument("--rows", type=int, default=16, help="rows per rank per microbatch (at --world)")
    ap.add_argument("--accum", type=int, default=1)
    ap.add_argument("--steps", type=int, default=2, help="steps trained (and saved) before each kill")
    ap.add_argument("--dir", default=None, help="the storage root's parent (default: a temporary directory)")
    ap.add_argument("--shm", default="/dev/shm", help="where the two nodes' memory directories go")
    ap.add_argument("--json", default=None, help="also write the summary here")
    ap.add_argument("--timeout", type=float, default=600)
    ns = ap.parse_args(argv)
    if ns.worker:
        return worker()
    if ns.world < 2 or ns.world % 2:
        raise SystemExit("--world must be even (2 nodes)")
    base = tempfile.mkdtemp(prefix="bench-kill-", dir=ns.dir)
    shm = tempfile.mkdtemp(prefix="bench-kill-", dir=ns.shm)
    progress = os.path.join(base, "progress")
    os.makedirs(progress)
    a = {k: getattr(ns, k) for k in ("backend", "dim", "layers", "rows", "accum", "steps", "timeout")}
    a.update(world0=ns.world, world=ns.world, base=base, shm=shm, progress=progress)
    try:
        summary = run(a)
    finally:
        shutil.rmtree(shm, ignore_errors=True)
        shutil.rmtree(base, ignore_errors=True)
    text = json.dumps(summary, sort_keys=True)
    print(text, flush=True)
    if ns.json:
        with open(ns.json, "w") as f:
            f.write(text + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
