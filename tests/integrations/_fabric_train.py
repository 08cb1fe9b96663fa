"""A tiny Fabric + ModelParallelStrategy (FSDP2) loop on CPU (gloo), checkpointing with fabric.save / fabric.load.

    --mode crash    train, fabric.save at step 4, SIGKILL      --mode resume   fabric.load(--resume), train to 8
    --mode full     train 8 steps (with --save-at, save there and go on)       --dcp   Lightning's own strategy
"""

import argparse
import json
import os
import signal

import torch
import torch.distributed as dist

p = argparse.ArgumentParser()
p.add_argument("--mode", default="full")
p.add_argument("--ckpt", default="")
p.add_argument("--resume", default="")
p.add_argument("--save-at", type=int, default=0)
p.add_argument("--out", required=True)
p.add_argument("--dcp", action="store_true")
a = p.parse_args()
torch.set_num_threads(1)

import lightning as L  # noqa: E402
from torch.distributed.fsdp import fully_shard  # noqa: E402

if a.dcp:
    from lightning.fabric.strategies import ModelParallelStrategy as Strategy
else:
    from shardckpt.integrations.lightning import FabricModelParallelStrategy as Strategy  # <- the changed line

WORLD = int(os.environ.get("WORLD_SIZE", "1"))


def parallelize(model, mesh):
    for layer in model:
        if isinstance(layer, torch.nn.Linear):
            fully_shard(layer, mesh=mesh["data_parallel"])
    return fully_shard(model, mesh=mesh["data_parallel"])


fabric = L.Fabric(accelerator="cpu", devices=WORLD, strategy=Strategy(parallelize, data_parallel_size=WORLD, tensor_parallel_size=1))
fabric.launch()
torch.manual_seed(0)
model = torch.nn.Sequential(torch.nn.Linear(8, 32), torch.nn.ReLU(), torch.nn.Linear(32, 4))
model = fabric.setup_module(model)
opt = fabric.setup_optimizers(torch.optim.AdamW(model.parameters(), lr=1e-2))
state = {"model": model, "optimizer": opt, "step": 0}
if a.mode == "resume":
    extra = fabric.load(a.resume, state)
    assert extra == {"note": "saved by fabric"}, extra
rank = fabric.global_rank
for step in range(state["step"] + 1, 9):
    g = torch.Generator().manual_seed(1000 + step)
    x, y = torch.randn(8, 8, generator=g), torch.randn(8, 4, generator=g)
    per = 8 // WORLD
    loss = torch.nn.functional.mse_loss(model(x[rank * per:(rank + 1) * per]), y[rank * per:(rank + 1) * per])
    fabric.backward(loss)
    opt.step()
    opt.zero_grad()
    glob = loss.detach().clone()
    if WORLD > 1:
        dist.all_reduce(glob)
    if rank == 0:
        with open(a.out, "a") as f:
            f.write(json.dumps({"step": step, "loss": glob.item() / WORLD}) + "\n")
    state["step"] = step
    if step == a.save_at:
        fabric.save(a.ckpt, {**state, "note": "saved by fabric"})
        if a.mode == "crash":
            os.kill(os.getpid(), signal.SIGKILL)
