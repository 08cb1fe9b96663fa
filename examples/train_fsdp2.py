"""Train a small transformer with FSDP2, checkpoint every K steps, resume automatically.

    torchrun --nproc-per-node 2 examples/train_fsdp2.py --ckpt-dir runs/demo --steps 40 --save-every 10

On CPU it uses gloo; with CUDA GPUs, NCCL and one GPU per process (bf16
mixed precision with ``--bf16``). Run the same command again after a crash or
a kill and it continues from the newest committed checkpoint under
``--ckpt-dir``: model, AdamW state, LR schedule, data position and every
rank's RNG streams.

Resuming at a different number of processes (``--nproc-per-node 3`` after a
run on 2) also works: the sharded model and optimizer are resharded on load.
The data pipeline here is a function of the global step (each step's global
batch is split over the ranks), so the run sees the same data at any N; the
global batch (``--batch``) must be divisible by N. Per-rank state takes its
documented path: the loader positions are remapped (``PerRank(on_resize=)``),
and the RNG streams, which cannot be split or merged, are skipped
(``RNGState(on_resize="skip")``) — each rank keeps its freshly seeded
generator, so dropout masks differ from an uninterrupted run. At the same N
the resumed run is bit-identical to an uninterrupted one.

Without torchrun it runs as a single process.
"""

from __future__ import annotations

import argparse
import math
import os
import socket
import time
import warnings

import torch
import torch.distributed as dist
import torch.nn as nn
import torch.nn.functional as F

import shardckpt

# FSDP2 warns when the root module returns a view; harmless here.
warnings.filterwarnings("ignore", message="FSDP2-wrapped module")


class Block(nn.Module):
    def __init__(self, dim: int, heads: int, dropout: float):
        super().__init__()
        self.heads = heads
        self.ln1 = nn.LayerNorm(dim)
        self.qkv = nn.Linear(dim, 3 * dim, bias=False)
        self.proj = nn.Linear(dim, dim, bias=False)
        self.ln2 = nn.LayerNorm(dim)
        self.mlp = nn.Sequential(nn.Linear(dim, 4 * dim), nn.GELU(), nn.Linear(4 * dim, dim))
        self.drop = nn.Dropout(dropout)

    def forward(self, x):
        b, t, d = x.shape
        q, k, v = self.qkv(self.ln1(x)).split(d, dim=-1)
        q, k, v = (z.view(b, t, self.heads, d // self.heads).transpose(1, 2) for z in (q, k, v))
        a = F.scaled_dot_product_attention(q, k, v, is_causal=True).transpose(1, 2).reshape(b, t, d)
        x = x + self.drop(self.proj(a))
        return x + self.drop(self.mlp(self.ln2(x)))


class TinyGPT(nn.Module):
    def __init__(self, vocab: int, dim: int, layers: int, heads: int, seq: int, dropout: float):
        super().__init__()
        self.tok = nn.Embedding(vocab, dim)
        self.pos = nn.Parameter(torch.zeros(seq, dim))
        self.blocks = nn.ModuleList([Block(dim, heads, dropout) for _ in range(layers)])
        self.ln = nn.LayerNorm(dim)
        self.head = nn.Linear(dim, vocab, bias=False)

    def forward(self, idx):
        x = self.tok(idx) + self.pos[: idx.shape[1]]
        for b in self.blocks:
            x = b(x)
        return self.head(self.ln(x))


def global_batch(step: int, args) -> torch.Tensor:
    """The step's global batch: noisy arithmetic sequences, a function of the step alone."""
    g = torch.Generator().manual_seed(args.seed * 1_000_003 + step)
    start = torch.randint(0, args.vocab, (args.batch, 1), generator=g)
    stride = torch.randint(1, 5, (args.batch, 1), generator=g)
    seq = (start + stride * torch.arange(args.seq + 1)) % args.vocab
    noise = torch.rand(seq.shape, generator=g) < 0.05
    return torch.where(noise, torch.randint(0, args.vocab, seq.shape, generator=g), seq)


def setup():
    """Process group (NCCL with GPUs, else gloo) and this rank's device."""
    if "RANK" not in os.environ:  # plain `python train_fsdp2.py`: a group of one
        with socket.socket() as s:
            s.bind(("127.0.0.1", 0))
            port = s.getsockname()[1]
        os.environ.update(RANK="0", WORLD_SIZE="1", LOCAL_RANK="0", MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    if torch.cuda.is_available():
        device = torch.device("cuda", int(os.environ["LOCAL_RANK"]))
        torch.cuda.set_device(device)
        dist.init_process_group("nccl", device_id=device)
    else:
        device = torch.device("cpu")
        dist.init_process_group("gloo")
    return dist.get_rank(), dist.get_world_size(), device


def main(argv=None) -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--ckpt-dir", required=True, help="checkpoint root (local path or fsspec URL)")
    p.add_argument("--steps", type=int, default=40, help="train until this global step")
    p.add_argument("--max-steps", type=int, default=200, help="length of the LR schedule (keep it fixed across resumes)")
    p.add_argument("--save-every", type=int, default=10, help="checkpoint every K steps")
    p.add_argument("--keep-last", type=int, default=3)
    p.add_argument("--async-save", action="store_true", help="write checkpoints in the background")
    p.add_argument("--batch", type=int, default=24, help="global batch (divisible by the number of processes)")
    p.add_argument("--seq", type=int, default=32)
    p.add_argument("--vocab", type=int, default=97)
    p.add_argument("--dim", type=int, default=64)
    p.add_argument("--layers", type=int, default=2)
    p.add_argument("--heads", type=int, default=4)
    p.add_argument("--dropout", type=float, default=0.1)
    p.add_argument("--lr", type=float, default=3e-3)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--bf16", action="store_true", help="bf16 compute (MixedPrecisionPolicy); fp32 master weights")
    args = p.parse_args(argv)

    rank, world, device = setup()
    if args.batch % world:
        raise SystemExit(f"--batch {args.batch} must be divisible by the number of processes ({world})")
    from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard

    torch.manual_seed(args.seed)  # same initial weights on every rank and at every N
    model = TinyGPT(args.vocab, args.dim, args.layers, args.heads, args.seq, args.dropout).to(device)
    mp = MixedPrecisionPolicy(param_dtype=torch.bfloat16, reduce_dtype=torch.float32) if args.bf16 else MixedPrecisionPolicy()
    for b in model.blocks:
        fully_shard(b, mp_policy=mp)
    fully_shard(model, mp_policy=mp)
    optim = torch.optim.AdamW(model.parameters(), lr=args.lr, weight_decay=0.1)
    warmup = max(1, args.max_steps // 20)
    sched = torch.optim.lr_scheduler.LambdaLR(
        optim, lambda s: min(1.0, (s + 1) / warmup) * 0.5 * (1 + math.cos(math.pi * min(s, args.max_steps) / args.max_steps))
    )
    torch.manual_seed(args.seed * 7919 + 1 + rank)  # per-rank streams (dropout)

    def remap_loader(saved, new_rank, new_world):
        # Positions are counts of samples this rank consumed; at a new N each
        # rank takes an equal share of the total.
        return {"samples": sum(s["samples"] for s in saved) // new_world}

    loader = {"samples": 0}
    state = {
        "model": model,
        "optim": optim,
        "sched": sched,
        "loader": shardckpt.PerRank(loader, on_resize=remap_loader),
        "rng": shardckpt.RNGState(on_resize="skip"),
        "config": {"dim": args.dim, "layers": args.layers, "vocab": args.vocab, "seq": args.seq},
    }
    mgr = shardckpt.CheckpointManager(args.ckpt_dir, keep_last=args.keep_last, async_save=args.async_save)
    newest = mgr.latest_step()
    saved_world = shardckpt.inspect(mgr.step_url(newest)).world_size if newest is not None else None
    start = mgr.restore(state) or 0
    if rank == 0:
        if start:
            how = "" if saved_world == world else f" (saved by {saved_world} processes, resharded to {world})"
            print(f"resumed from step {start}{how}", flush=True)
        else:
            print(f"no checkpoint under {args.ckpt_dir}: starting from scratch on {world} process(es), {device.type}", flush=True)

    per = args.batch // world
    for step in range(start + 1, args.steps + 1):
        t0 = time.perf_counter()
        data = global_batch(step, args)[rank * per : (rank + 1) * per].to(device)
        logits = model(data[:, :-1]).float()
        loss = F.cross_entropy(logits.reshape(-1, args.vocab), data[:, 1:].reshape(-1))
        loss.backward()
        optim.step()
        sched.step()
        optim.zero_grad(set_to_none=True)
        loader["samples"] += per
        total = loss.detach().clone()
        dist.all_reduce(total)
        if rank == 0:
            print(
                f"step {step} loss {total.item() / world:.6f} lr {sched.get_last_lr()[0]:.6e} "
                f"({(time.perf_counter() - t0) * 1e3:.0f} ms)",
                flush=True,
            )
        if step % args.save_every == 0 or step == args.steps:
            t0 = time.perf_counter()
            mgr.save(step, state)
            if rank == 0:
                print(f"saved step {step} ({(time.perf_counter() - t0) * 1e3:.0f} ms)", flush=True)
    mgr.wait()  # a background save must commit before the process exits
    if rank == 0:
        print(f"done at step {args.steps}; checkpoints: {mgr.steps()}", flush=True)
    mgr.close()
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
