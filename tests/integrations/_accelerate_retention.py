"""Accelerate's project conventions the integration must keep exactly (2 gloo ranks, cpu=True).

    argv: MODE ROOT
    retention   total_limit=1 beside a previous run's checkpoint_7, a run_2024 folder and a
                checkpoint_9 that holds no checkpoint; then an iteration whose folder exists
    counters    load_state of a checkpoint whose saved counters are malformed (re-signed manifest)

Rank 0 writes ROOT/result.json.
"""

import json
import os
import sys

import torch
import torch.distributed as dist

torch.set_num_threads(1)
from accelerate import Accelerator  # noqa: E402
from accelerate.utils import ProjectConfiguration  # noqa: E402

import shardckpt  # noqa: E402
import shardckpt.integrations.accelerate as sc_accelerate  # noqa: E402
from shardckpt._format import manifest_from_bytes, manifest_to_bytes  # noqa: E402

mode, root = sys.argv[1], sys.argv[2]
res = {}


def folders():
    return sorted(os.listdir(os.path.join(root, "checkpoints")))


if mode == "retention":
    pc = ProjectConfiguration(project_dir=root, automatic_checkpoint_naming=True, total_limit=1)
    accelerator = sc_accelerate.enable(Accelerator(project_config=pc, cpu=True))
    ck = os.path.join(root, "checkpoints")
    if accelerator.is_main_process:
        shardckpt.save({"w": torch.ones(2)}, os.path.join(ck, "checkpoint_7"), no_dist=True)  # a previous run's
        os.makedirs(os.path.join(ck, "run_2024"))
        os.makedirs(os.path.join(ck, "checkpoint_9"))  # the name, but no checkpoint in it
        open(os.path.join(ck, "checkpoint_9", "notes.txt"), "w").close()
    accelerator.wait_for_everyone()
    net = torch.nn.Linear(4, 4)
    model, opt = accelerator.prepare(net, torch.optim.SGD(net.parameters(), lr=0.1))
    accelerator.save_state()
    res["after_first"] = folders()
    accelerator.save_state()
    res["after_second"] = folders()
    accelerator.project_configuration.iteration = 1  # checkpoint_1 exists
    try:
        accelerator.save_state()
    except Exception as e:
        res["overwrite"] = [type(e).__name__, str(e)]
    res["after_refusal"] = folders()
elif mode == "counters":
    accelerator = sc_accelerate.enable(Accelerator(cpu=True))
    torch.manual_seed(0)
    net = torch.nn.Linear(4, 4)
    model, opt = accelerator.prepare(net, torch.optim.AdamW(net.parameters(), lr=0.1))

    def train():
        model(torch.randn(3, 4)).sum().backward()
        opt.step()
        opt.zero_grad()

    train()
    ck = os.path.join(root, "ck")
    accelerator.save_state(ck)
    train()  # live state now differs from the checkpoint's
    live = {k: v.detach().clone() for k, v in model.state_dict().items()}
    live_avg = [s["exp_avg"].clone() for s in opt.optimizer.state.values()]
    clean = open(os.path.join(ck, "manifest.json"), "rb").read()
    res["cases"] = []
    for bad in ({"step": "x", "iteration": 0}, None, "7", {"step": True, "iteration": 0}, {"step": 1}):
        accelerator.wait_for_everyone()
        if accelerator.is_main_process:
            m = manifest_from_bytes(clean)
            m.values["accelerate"] = bad
            with open(os.path.join(ck, "manifest.json"), "wb") as f:
                f.write(manifest_to_bytes(m))
        accelerator.wait_for_everyone()
        try:
            accelerator.load_state(ck)
            err = None
        except Exception as e:
            err = [type(e).__name__, str(e)]
        untouched = all(torch.equal(v, live[k]) for k, v in model.state_dict().items()) and all(
            torch.equal(s["exp_avg"], a) for s, a in zip(opt.optimizer.state.values(), live_avg)
        )
        res["cases"].append({"bad": repr(bad), "error": err, "untouched": untouched})
if dist.get_rank() == 0:
    with open(os.path.join(root, "result.json"), "w") as f:
        json.dump(res, f)
dist.barrier()
dist.destroy_process_group()
