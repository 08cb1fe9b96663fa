"""A tiny Accelerate FSDP2 training loop (CPU, gloo): the user's script the tests drive.

    --mode full      train --steps steps; with --save-at K, save at step K (shardckpt, or Accelerate's DCP with --dcp)
    --mode crash     as full with --save-at K, then SIGKILL itself right after the save (a real crash)
    --mode resume    load_state(--resume), train on to --steps

Losses (the global mean over ranks) go to --out as JSON lines by rank 0.
"""

import argparse
import json
import os
import signal

import torch
import torch.distributed as dist
from torch.distributed.tensor import DTensor

p = argparse.ArgumentParser()
p.add_argument("--mode", default="full")
p.add_argument("--steps", type=int, default=8)
p.add_argument("--save-at", type=int, default=0)
p.add_argument("--ckpt", default="")
p.add_argument("--resume", default="")
p.add_argument("--out", required=True)
p.add_argument("--dcp", action="store_true", help="checkpoint through Accelerate's own (DCP) path")
a = p.parse_args()

torch.set_num_threads(1)
# Accelerate turns its FSDP plugin on only with GPUs: on CPU, cpu=True (gloo)
# and enable(accelerator, fsdp_plugin=plugin) turn FSDP on as it does on GPUs.
# Accelerate's FSDP2 prepare (fsdp2_prepare_model) and DCP save_state then run unchanged.
from accelerate import Accelerator, FullyShardedDataParallelPlugin  # noqa: E402

import shardckpt.integrations.accelerate as sc_accelerate  # noqa: E402

plugin = FullyShardedDataParallelPlugin(fsdp_version=2, state_dict_type="SHARDED_STATE_DICT", reshard_after_forward=True)
# step_scheduler_with_optimizer=False: one scheduler step per training step at any world size
# (Accelerate otherwise steps it once per process), so runs at 2 and 1 processes compare.
accelerator = Accelerator(fsdp_plugin=plugin, cpu=True, step_scheduler_with_optimizer=False)
sc_accelerate.enable(accelerator, fsdp_plugin=plugin)  # <- the one line a user adds
if a.dcp:
    sc_accelerate.disable(accelerator)  # Accelerate's own save_state / load_state (FSDP stays on)

torch.manual_seed(0)
model = torch.nn.Sequential(torch.nn.Linear(8, 32), torch.nn.ReLU(), torch.nn.Linear(32, 32), torch.nn.ReLU(), torch.nn.Linear(32, 4))
opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
sched = torch.optim.lr_scheduler.StepLR(opt, step_size=3, gamma=0.5)
model, opt, sched = accelerator.prepare(model, opt, sched)
assert accelerator.is_fsdp2, accelerator.distributed_type
assert all(isinstance(p, DTensor) for p in model.parameters())
rank, world = dist.get_rank(), dist.get_world_size()

start = 0
if a.mode == "resume":
    accelerator.load_state(a.resume)
    start = accelerator.step

GLOBAL_BATCH = 8
for step in range(start + 1, a.steps + 1):
    g = torch.Generator().manual_seed(1000 + step)
    x = torch.randn(GLOBAL_BATCH, 8, generator=g)
    y = torch.randn(GLOBAL_BATCH, 4, generator=g)
    per = GLOBAL_BATCH // world
    xs, ys = x[rank * per:(rank + 1) * per], y[rank * per:(rank + 1) * per]
    loss = torch.nn.functional.mse_loss(model(xs), ys)
    accelerator.backward(loss)
    opt.step()
    sched.step()
    opt.zero_grad()
    accelerator.step = step
    glob = loss.detach().clone()
    dist.all_reduce(glob)
    if rank == 0:
        with open(a.out, "a") as f:
            f.write(json.dumps({"step": step, "loss": glob.item() / world}) + "\n")
    if step == a.save_at:
        assert accelerator.is_fsdp2, accelerator.distributed_type  # still FSDP: nothing re-forced
        accelerator.save_state(a.ckpt)
        if a.mode == "crash":
            os.kill(os.getpid(), signal.SIGKILL)
dist.barrier()
dist.destroy_process_group()
