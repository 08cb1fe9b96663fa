"""A torchtitan-style training loop on CPU (gloo) with torchtitan's own components and checkpointer contract.

torchtitan's OptimizersContainer, LRSchedulersContainer, ParallelAwareDataloader
(torchdata's StatefulDataLoader) and checkpointer ``Config.build(...)`` /
``load()`` / ``save(step, last_step=...)`` calls, as its Trainer makes them,
around an FSDP2 model (torchtitan's Trainer itself needs its model registry and
a GPU device; see docs/integrations/torchtitan.md).

    --mode full|crash|resume   (crash: SIGKILL right after the step-4 checkpoint)
    --dcp                      torchtitan's own DCP CheckpointManager
    --initial PATH             checkpoint.initial_load_path (with initial_load_model_only=False)
    --hf                       last_save_in_hf at the last step (through a renaming sd_adapter)
"""

import argparse
import json
import os
import signal

import torch
import torch.distributed as dist

p = argparse.ArgumentParser()
p.add_argument("--mode", default="full")
p.add_argument("--folder", required=True)
p.add_argument("--out", required=True)
p.add_argument("--dcp", action="store_true")
p.add_argument("--initial", default=None)
p.add_argument("--hf", action="store_true")
p.add_argument("--steps", type=int, default=8)
a = p.parse_args()
torch.set_num_threads(1)
dist.init_process_group("gloo")

from torch.distributed.device_mesh import init_device_mesh  # noqa: E402
from torch.distributed.fsdp import fully_shard  # noqa: E402
from torchtitan.components.dataloader import ParallelAwareDataloader  # noqa: E402
from torchtitan.components.optimizer import LRSchedulersContainer, OptimizersContainer, ParamGroupConfig  # noqa: E402
from torchtitan.protocols.state_dict_adapter import BaseStateDictAdapter  # noqa: E402

if a.dcp:
    from torchtitan.components.checkpoint import CheckpointManager
else:
    from shardckpt.integrations.torchtitan import CheckpointManager  # <- the changed line (or config.checkpoint)

rank, world = dist.get_rank(), dist.get_world_size()
GLOBAL_BATCH = 8


class Windows(torch.utils.data.IterableDataset):
    """Sample i of the global stream goes to rank i % world: the global batch of a step is the same at any world size."""

    def __init__(self, start=0):
        self.start = start

    def __iter__(self):
        i = self.start * GLOBAL_BATCH + rank
        while True:
            g = torch.Generator().manual_seed(10_000 + i)
            yield torch.randn(8, generator=g), torch.randn(4, generator=g)
            i += world


class TrainState:
    def __init__(self):
        self.step, self.world = 0, world

    def state_dict(self):
        return {"step": self.step, "world": self.world}

    def load_state_dict(self, sd):
        self.step, self.world = sd["step"], sd["world"]


class Rename(BaseStateDictAdapter):
    """An sd_adapter whose HF names are torchtitan's with a 'hf.' prefix (the mapping is the adapter's business)."""

    def __init__(self, *args, **kwargs):
        self.hf_assets_path = None

    def to_hf(self, sd):
        return {"hf." + k: v for k, v in sd.items()}

    def from_hf(self, sd):
        return {k[3:]: v for k, v in sd.items()}

    def get_hf_storage_reader(self, path, from_quantized=False):
        raise NotImplementedError


mesh = init_device_mesh("cpu", (world,))
torch.manual_seed(0)
model = torch.nn.Sequential(torch.nn.Linear(8, 32), torch.nn.ReLU(), torch.nn.Linear(32, 32), torch.nn.ReLU(), torch.nn.Linear(32, 4))
for layer in model:
    if isinstance(layer, torch.nn.Linear):
        fully_shard(layer, mesh=mesh)
fully_shard(model, mesh=mesh)
optimizers = OptimizersContainer(
    OptimizersContainer.Config(param_groups=[ParamGroupConfig(pattern=".*", optimizer_name="AdamW", optimizer_kwargs={"lr": 1e-2})],
                               implementation="for-loop"), model_parts=[model])
lr_schedulers = LRSchedulersContainer.Config(warmup_steps=2).build(optimizers=optimizers, training_steps=a.steps)
dataset = Windows()
dataloader = ParallelAwareDataloader(dataset, dp_rank=rank, dp_world_size=world, batch_size=GLOBAL_BATCH // world)
train_state = TrainState()
config = CheckpointManager.Config(
    enable=True, folder="checkpoint", interval=4, keep_latest_k=2,
    initial_load_path=a.initial, initial_load_model_only=a.initial is None,
    last_save_model_only=a.hf, last_save_in_hf=a.hf,
)
ckpt = config.build(dataloader=dataloader, model_parts=[model], optimizers=optimizers, lr_schedulers=lr_schedulers,
                    states={"train_state": train_state}, sd_adapter=Rename() if a.hf else None, base_folder=a.folder)
ckpt.load(step=-1)
if train_state.world != world:
    # The dataloader's per-rank position does not carry over to another data-parallel size (torchtitan's rule too):
    # start the stream at the step.
    dataset.start = train_state.step
    train_state.world = world
batches = iter(dataloader)
for step in range(train_state.step + 1, a.steps + 1):
    x, y = next(batches)
    loss = torch.nn.functional.mse_loss(model(x), y)
    loss.backward()
    optimizers.step()
    lr_schedulers.step()
    optimizers.zero_grad()
    train_state.step = step
    glob = loss.detach().clone()
    dist.all_reduce(glob)
    if rank == 0:
        with open(a.out, "a") as f:
            f.write(json.dumps({"step": step, "loss": glob.item() / world}) + "\n")
    ckpt.save(step, last_step=step == a.steps)
    if a.mode == "crash" and step == 4:
        ckpt.maybe_wait_for_saving()
        os.kill(os.getpid(), signal.SIGKILL)
ckpt.maybe_wait_for_saving()
ckpt.close()
dist.barrier()
dist.destroy_process_group()
