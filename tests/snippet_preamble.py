"""The preamble of every python snippet in README.md and docs/ (tests/snippets.py runs them).

A snippet runs as ``from snippet_preamble import *`` followed by its code,
so docs can show the three lines that matter and still run. It provides:

* ``torch``, ``nn``, ``os``, ``shardckpt``, ``converters``;
* ``model``: a tiny ``TinyModel`` (embedding, two linears, a head; 101-token
  vocabulary), ``optim`` / ``optimizer`` (AdamW), ``scheduler`` (LambdaLR),
  ``state = {"model", "optim", "sched", "step"}``, ``step = 100``,
  ``total = total_steps = 6``, ``train_step()`` (one AdamW step on random
  tokens), ``lr_scheduler``, ``grad_scaler`` (CPU ``GradScaler``), ``loader``;
* under torchrun (``<!-- snippet: torchrun=N -->``): the gloo process group
  is started, ``rank`` / ``world`` are set and ``model`` is sharded with
  FSDP2 (``fully_shard`` on each layer, then the root); the group is
  destroyed at exit.

``make_fixtures`` builds the files a snippet's comment asks for
(``fixtures=ckpt,hf,dcp,pt``) in the working directory.
"""

from __future__ import annotations

import atexit
import os

import torch
import torch.nn as nn

import shardckpt
from shardckpt import converters  # noqa: F401  (a name the snippets use)

VOCAB = 101


class TinyModel(nn.Module):
    """Embedding, two linears and a head: small enough for a snippet, shaped like a language model."""

    def __init__(self, vocab: int = VOCAB, dim: int = 16):
        super().__init__()
        self.emb = nn.Embedding(vocab, dim)
        self.w1 = nn.Linear(dim, 2 * dim)
        self.w2 = nn.Linear(2 * dim, dim)
        self.head = nn.Linear(dim, vocab)

    def forward(self, idx):
        x = self.emb(idx)
        return self.head(x + self.w2(torch.relu(self.w1(x))))


rank, world = 0, 1
torch.manual_seed(0)
model = TinyModel()
if "WORLD_SIZE" in os.environ:
    import torch.distributed as dist
    from torch.distributed.fsdp import fully_shard

    dist.init_process_group("gloo")
    rank, world = dist.get_rank(), dist.get_world_size()
    for _m in (model.w1, model.w2):
        fully_shard(_m)
    fully_shard(model)
    atexit.register(lambda: dist.is_initialized() and dist.destroy_process_group())
optim = optimizer = torch.optim.AdamW(model.parameters(), lr=1e-2)
scheduler = torch.optim.lr_scheduler.LambdaLR(optim, lambda s: 1.0 / (1 + s))
step = 100
total = total_steps = 6
lr_scheduler = scheduler
grad_scaler = torch.amp.GradScaler("cpu")
loader = {"epoch": 0, "offset": 0}  # a stand-in data pipeline state (a dict is refilled in place); PerRank keeps one per rank
state = {"model": model, "optim": optim, "sched": scheduler, "step": 0}
_gen = torch.Generator().manual_seed(1234 + rank)


def train_step(*_args, **_kw) -> float:
    """One AdamW step on random tokens; returns the loss."""
    batch = torch.randint(0, VOCAB, (4, 9), generator=_gen)
    loss = nn.functional.cross_entropy(model(batch[:, :-1]).reshape(-1, VOCAB), batch[:, 1:].reshape(-1))
    loss.backward()
    optim.step()
    optim.zero_grad()
    scheduler.step()
    return loss.item()


def _hf_dir(path: str) -> None:
    """A tiny Llama as a Hub directory holds it: config.json, generation config, weights (nothing downloaded)."""
    from transformers import GenerationConfig, LlamaConfig, LlamaForCausalLM

    cfg = LlamaConfig(vocab_size=64, hidden_size=16, intermediate_size=32, num_hidden_layers=2, num_attention_heads=2,
                      num_key_value_heads=1, max_position_embeddings=32, tie_word_embeddings=False)
    torch.manual_seed(0)
    LlamaForCausalLM(cfg).save_pretrained(path)
    GenerationConfig(max_new_tokens=3, do_sample=False).save_pretrained(path)


def make_fixtures(names) -> None:
    """Create the named files in the working directory (those already there are kept).

    ``ckpt``: ``ckpt/step-100`` and ``ckpt/step-200`` (shardckpt checkpoints of
    ``state``); ``hf``: ``hf-model/`` (a tiny Llama, safetensors + config);
    ``dcp``: ``dcp-ckpt/`` (``torch.distributed.checkpoint.save`` of the model
    and optimizer state dicts, by parameter name, as DCP users and torchtitan
    write them); ``pt``: ``model.pt`` (``torch.save`` of a state dict).
    """
    for name in names:
        if name == "ckpt":  # the steps a page's earlier block did not already write
            for s in (100, 200):
                train_step()
                if not os.path.exists(f"ckpt/step-{s}"):
                    shardckpt.save({"model": model, "optim": optim, "step": s}, f"ckpt/step-{s}")
        elif name == "hf":
            if not os.path.exists("hf-model"):
                _hf_dir("hf-model")
        elif name == "dcp":
            import torch.distributed.checkpoint as dcp
            from torch.distributed.checkpoint.state_dict import get_model_state_dict, get_optimizer_state_dict

            if os.path.exists("dcp-ckpt"):
                continue
            train_step()
            dcp.save({"model": get_model_state_dict(model), "optim": get_optimizer_state_dict(model, optim)},
                     checkpoint_id="dcp-ckpt")
        elif name == "pt":
            torch.save(model.state_dict(), "model.pt")
        else:
            raise ValueError(f"unknown fixture {name!r}")
