"""A tiny Lightning Trainer + ModelParallelStrategy (FSDP2) loop on CPU (gloo): the user's script the tests drive.

    --mode full     fit 3 epochs (4 steps each), a checkpoint at every epoch end
    --mode crash    as full, SIGKILL at the start of epoch 2 (after epoch 1's checkpoint)
    --mode resume   Trainer.fit(ckpt_path=--resume)
    --dcp           Lightning's own strategy (DCP checkpoints) instead of shardckpt's

Global-mean losses by step go to --out (rank 0, JSON lines).
"""

import argparse
import json
import os
import signal

import torch
import torch.distributed as dist

p = argparse.ArgumentParser()
p.add_argument("--mode", default="full")
p.add_argument("--ckpt", required=True)
p.add_argument("--resume", default=None)
p.add_argument("--out", required=True)
p.add_argument("--dcp", action="store_true")
a = p.parse_args()
torch.set_num_threads(1)

import lightning as L  # noqa: E402
from lightning.pytorch.callbacks import Callback, ModelCheckpoint  # noqa: E402
from torch.distributed.fsdp import fully_shard  # noqa: E402

if a.dcp:
    from lightning.pytorch.strategies import ModelParallelStrategy
else:
    from shardckpt.integrations.lightning import ModelParallelStrategy  # <- the one line a user changes

WORLD = int(os.environ.get("WORLD_SIZE", "1"))
GLOBAL_BATCH = 8


class Net(L.LightningModule):
    def __init__(self):
        super().__init__()
        torch.manual_seed(0)
        self.net = torch.nn.Sequential(torch.nn.Linear(8, 32), torch.nn.ReLU(), torch.nn.Linear(32, 32), torch.nn.ReLU(), torch.nn.Linear(32, 4))

    def configure_model(self):
        mesh = self.device_mesh["data_parallel"]
        for layer in self.net:
            if isinstance(layer, torch.nn.Linear):
                fully_shard(layer, mesh=mesh)
        fully_shard(self.net, mesh=mesh)

    def training_step(self, batch, i):
        x, y = batch
        loss = torch.nn.functional.mse_loss(self.net(x), y)
        g = loss.detach().clone()
        if dist.is_initialized():
            dist.all_reduce(g)
        if self.global_rank == 0:
            with open(a.out, "a") as f:
                f.write(json.dumps({"step": self.global_step + 1, "loss": g.item() / WORLD}) + "\n")
        return loss

    def configure_optimizers(self):
        opt = torch.optim.AdamW(self.parameters(), lr=1e-2)
        return {"optimizer": opt, "lr_scheduler": torch.optim.lr_scheduler.StepLR(opt, step_size=3, gamma=0.5)}

    def train_dataloader(self):
        g = torch.Generator().manual_seed(1234)
        ds = torch.utils.data.TensorDataset(torch.randn(32, 8, generator=g), torch.randn(32, 4, generator=g))
        return torch.utils.data.DataLoader(ds, batch_size=GLOBAL_BATCH // WORLD, shuffle=False)


class Crash(Callback):
    def on_train_epoch_start(self, trainer, pl_module):
        if a.mode == "crash" and trainer.current_epoch == 2:
            os.kill(os.getpid(), signal.SIGKILL)


trainer = L.Trainer(
    accelerator="cpu", devices=WORLD, max_epochs=3,
    strategy=ModelParallelStrategy(data_parallel_size=WORLD, tensor_parallel_size=1),
    callbacks=[Crash(), ModelCheckpoint(dirpath=a.ckpt, save_top_k=-1, save_last=True)],
    logger=False, enable_progress_bar=False, enable_model_summary=False, num_sanity_val_steps=0,
    use_distributed_sampler=True, deterministic=True,
)
trainer.fit(Net(), ckpt_path=a.resume if a.mode == "resume" else None)
