"""Small models with awkward dims, shared by the tests (importable in rank processes)."""

from __future__ import annotations

import torch
import torch.nn as nn


class Block(nn.Module):
    def __init__(self, dim: int, hidden: int):
        super().__init__()
        self.norm = nn.LayerNorm(dim)
        self.up = nn.Linear(dim, hidden)
        self.down = nn.Linear(hidden, dim, bias=False)

    def forward(self, x):
        return x + self.down(torch.relu(self.up(self.norm(x))))


class Awkward(nn.Module):
    """Odd sizes: 37-row embedding, 7-wide layers, a 1-row weight, int and bool buffers."""

    def __init__(self, vocab: int = 37, dim: int = 7, hidden: int = 13, layers: int = 2):
        super().__init__()
        self.emb = nn.Embedding(vocab, dim)
        self.blocks = nn.ModuleList([Block(dim, hidden) for _ in range(layers)])
        self.tiny = nn.Parameter(torch.randn(1, dim))
        self.head = nn.Linear(dim, vocab)
        self.register_buffer("counts", torch.arange(5, dtype=torch.int64))
        self.register_buffer("mask", torch.tensor([True, False, True]))

    def forward(self, idx):
        x = self.emb(idx) + self.tiny
        for b in self.blocks:
            x = b(x)
        return self.head(x)


def build(seed: int = 0, **kw) -> Awkward:
    torch.manual_seed(seed)
    return Awkward(**kw)


def shard_fsdp2(model: nn.Module, mesh=None, **kw) -> nn.Module:
    from torch.distributed.fsdp import fully_shard

    for b in model.blocks:
        fully_shard(b, mesh=mesh, **kw)
    fully_shard(model, mesh=mesh, **kw)
    return model


def full_state(model: nn.Module) -> dict:
    """Full (unsharded) CPU state dict, gathering DTensors."""
    out = {}
    for k, v in model.state_dict().items():
        if hasattr(v, "full_tensor"):
            v = v.full_tensor()
        out[k] = v.detach().cpu().clone()
    return out
