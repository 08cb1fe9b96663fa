"""Accelerate + FSDP2 on a machine without GPUs: what ``enable`` does with each way of building the Accelerator.

    argv: MODE OUT    MODE: cpu (cpu=True + enable(fsdp_plugin=)), nogpu (no cpu=True),
                      noplugin (cpu=True, enable without the plugin), late (enable after prepare)

Each rank writes ``OUT.<rank>``: JSON with what it saw, or the refusal's type and message.
"""

import json
import os
import sys

import torch

torch.set_num_threads(1)
from accelerate import Accelerator, FullyShardedDataParallelPlugin  # noqa: E402
from accelerate.state import AcceleratorState  # noqa: E402

import shardckpt.integrations.accelerate as sc_accelerate  # noqa: E402

mode, out = sys.argv[1], sys.argv[2]
rank = int(os.environ["RANK"])
plugin = FullyShardedDataParallelPlugin(fsdp_version=2)
res = {}
try:
    accelerator = Accelerator(fsdp_plugin=plugin, cpu=mode != "nogpu")
    if mode != "late":
        sc_accelerate.enable(accelerator, fsdp_plugin=None if mode == "noplugin" else plugin)
    model = accelerator.prepare(torch.nn.Sequential(torch.nn.Linear(4, 8), torch.nn.Linear(8, 2)))
    if mode == "late":
        sc_accelerate.enable(accelerator, fsdp_plugin=plugin)
    AcceleratorState()  # made again (Accelerate does so internally): must keep FSDP
    from torch.distributed.tensor import DTensor

    res = {"type": str(accelerator.distributed_type), "fsdp2": bool(accelerator.is_fsdp2),
           "dtensor": all(isinstance(p, DTensor) for p in model.parameters()), "world": accelerator.num_processes}
    accelerator.wait_for_everyone()
except Exception as e:  # the refusal is the result
    res = {"error": type(e).__name__, "message": str(e)}
with open(f"{out}.{rank}", "w") as f:
    json.dump(res, f)
