"""Accelerate's project conventions through the integration: automatic naming, total_limit, pre-hooks."""

import json
import os
import sys

import torch
import torch.distributed as dist

torch.set_num_threads(1)
dist.init_process_group("gloo")
from accelerate import Accelerator  # noqa: E402
from accelerate.utils import ProjectConfiguration  # noqa: E402

import shardckpt.integrations.accelerate as sc_accelerate  # noqa: E402

root = sys.argv[1]
pc = ProjectConfiguration(project_dir=root, automatic_checkpoint_naming=True, total_limit=2)
accelerator = sc_accelerate.enable(Accelerator(project_config=pc, cpu=True), async_save=sys.argv[2:] == ["async"])
calls = []
accelerator.register_save_state_pre_hook(lambda models, weights, out: calls.append("save"))
accelerator.register_load_state_pre_hook(lambda models, inp: calls.append("load"))
torch.manual_seed(0)
net = torch.nn.Linear(4, 4)
model, opt = accelerator.prepare(net, torch.optim.SGD(net.parameters(), lr=0.1))
for i in range(4):
    accelerator.step = i + 1
    accelerator.save_state()
accelerator.step = 0
accelerator.project_configuration.iteration = 0
accelerator.load_state()  # waits for the async save in flight, then applies total_limit
if dist.get_rank() == 0:
    with open(os.path.join(root, "result.json"), "w") as f:
        json.dump({"folders": sorted(os.listdir(os.path.join(root, "checkpoints"))), "hooks": calls,
                   "step_after_load": accelerator.step, "iteration_after_load": accelerator.project_configuration.iteration}, f)
dist.barrier()
dist.destroy_process_group()
