"""Launch a training script on N real processes (gloo, CPU), as torchrun would, and collect what they wrote.

Each rank is a process of its own with ``RANK``/``WORLD_SIZE``/``LOCAL_RANK``/
``MASTER_ADDR``/``MASTER_PORT`` set (no torchrun agent: it costs seconds per
launch on a loaded box), forked from a server that imported torch once
(tests/_zygote.py) and set up as ``python script args`` would be. A script "crashes" by SIGKILL-ing itself after its
checkpoint, so the resume starts from what a dead process left on disk.
"""

from __future__ import annotations

import json
import os
import sys
from typing import Dict, List

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
import _zygote  # noqa: E402
from _dist import free_port  # noqa: E402

HERE = os.path.dirname(os.path.abspath(__file__))
REPO = os.path.dirname(os.path.dirname(HERE))
#: Seconds one launch may take before it counts as hung.
LAUNCH_TIMEOUT_S = 240


def launch(script: str, world: int, args: List[str], *, timeout: float = LAUNCH_TIMEOUT_S) -> List[int]:
    """Run ``tests/integrations/<script>`` on ``world`` processes; return their exit codes by rank."""
    port = free_port()
    envs = []
    for rank in range(world):
        env = dict(os.environ)
        env.update(
            RANK=str(rank), WORLD_SIZE=str(world), LOCAL_RANK=str(rank), LOCAL_WORLD_SIZE=str(world),
            MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), CUDA_VISIBLE_DEVICES="", OMP_NUM_THREADS="1",
            PYTHONPATH=os.pathsep.join([HERE, os.path.dirname(HERE), REPO, env.get("PYTHONPATH", "")]),
        )
        envs.append(env)
    # Each rank its own process, forked from a server that imported torch
    # once (tests/_zygote.py), set up as ``python script args`` would be.
    codes, logs = _zygote.run_many([os.path.join(HERE, script), *args], envs, cwd=REPO, timeout=timeout,
                                   job_vars=("RANK", "LOCAL_RANK", "MASTER_PORT"))
    launch.last_logs = logs  # type: ignore[attr-defined]
    return codes


def run_ok(script: str, world: int, args: List[str]) -> None:
    """``launch`` that must exit 0 on every rank (the logs of the failing ranks in the error)."""
    codes = launch(script, world, args)
    if any(codes):
        logs = launch.last_logs  # type: ignore[attr-defined]
        raise AssertionError(f"{script} {args} exit codes {codes}:\n" + "\n".join(l[-4000:] for l in logs))


def losses(path: str) -> Dict[int, float]:
    """``{step: loss}`` a rank-0 script wrote to ``path`` (JSON lines)."""
    out = {}
    with open(path) as f:
        for line in f:
            rec = json.loads(line)
            out[int(rec["step"])] = float(rec["loss"])
    return out
