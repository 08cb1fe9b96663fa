"""A tiny Hugging Face Trainer run with FSDP2 (through Accelerate) on CPU/gloo: the user's script the tests drive.

    --mode full      train --steps steps, a checkpoint every --save-every steps
    --mode crash     as full, SIGKILL itself right after the checkpoint of step --save-every (a real crash)
    --mode resume    trainer.train(resume_from_checkpoint=True): the newest checkpoint under --out-dir

Losses (the Trainer's logged loss, every step) go to --losses as JSON lines by rank 0.
"""

import argparse
import json
import os
import signal

import torch

p = argparse.ArgumentParser()
p.add_argument("--mode", default="full")
p.add_argument("--steps", type=int, default=8)
p.add_argument("--save-every", type=int, default=4)
p.add_argument("--out-dir", required=True)
p.add_argument("--losses", required=True)
p.add_argument("--native", action="store_true", help="the Trainer's own checkpoints (no shardckpt)")
a = p.parse_args()

torch.set_num_threads(1)
from transformers import LlamaConfig, LlamaForCausalLM, Trainer, TrainerCallback, TrainingArguments  # noqa: E402

import shardckpt.integrations.transformers as sc_transformers  # noqa: E402


class Tokens(torch.utils.data.Dataset):
    def __init__(self, n=64, length=12, vocab=64):
        g = torch.Generator().manual_seed(7)
        self.ids = torch.randint(0, vocab, (n, length), generator=g)

    def __len__(self):
        return len(self.ids)

    def __getitem__(self, i):
        return {"input_ids": self.ids[i], "labels": self.ids[i]}


class Record(TrainerCallback):
    def on_log(self, args, state, control, logs=None, **kw):
        if state.is_world_process_zero and logs and "loss" in logs:
            with open(a.losses, "a") as f:
                f.write(json.dumps({"step": state.global_step, "loss": logs["loss"]}) + "\n")

    def on_save(self, args, state, control, **kw):
        if a.mode == "crash" and state.global_step == a.save_every:
            os.kill(os.getpid(), signal.SIGKILL)


torch.manual_seed(0)
cfg = LlamaConfig(vocab_size=64, hidden_size=16, intermediate_size=32, num_hidden_layers=2, num_attention_heads=2,
                  num_key_value_heads=2, max_position_embeddings=32, attention_dropout=0.1)  # dropout: RNG matters
model = LlamaForCausalLM(cfg)
args = TrainingArguments(
    a.out_dir, max_steps=a.steps, save_strategy="steps", save_steps=a.save_every, logging_steps=1,
    per_device_train_batch_size=2, learning_rate=1e-2, lr_scheduler_type="linear", seed=0, report_to=[],
    use_cpu=True, fsdp="full_shard", fsdp_config={"version": 2, "transformer_layer_cls_to_wrap": ["LlamaDecoderLayer"]},
    dataloader_num_workers=0, disable_tqdm=True,
)
trainer = Trainer(model=model, args=args, train_dataset=Tokens(), callbacks=[Record()])
sc_transformers.enable(trainer)  # <- the one line a user adds
if a.native:
    sc_transformers.disable(trainer)  # the Trainer's own checkpoints (FSDP stays on)
trainer.train(resume_from_checkpoint=True if a.mode == "resume" else None)
assert trainer.is_fsdp_enabled and trainer.accelerator.is_fsdp2, trainer.accelerator.distributed_type
