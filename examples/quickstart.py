"""shardckpt quickstart: save a sharded FSDP2 run on 2 processes, resume it on 1.

    python examples/quickstart.py [--dir ckpt-demo]

With no launcher around it, this script starts itself under
``torch.distributed.run`` with 2 CPU processes (gloo), which train a small
FSDP2 model with AdamW and save sharded checkpoints through a
``CheckpointManager`` (model, optimizer, step). Then, in this one process
with no process group at all, it restores the newest step into a plain model
and optimizer, checks the model computes exactly what the sharded one did,
and shows ``inspect`` and ``verify``.

Run it again with the same ``--dir`` and the sharded run resumes after the
newest committed step and trains ``--steps`` more: the training loop is the
one to copy (restore, then continue after the restored step, save each step
once).
"""

from __future__ import annotations

import argparse
import os
import subprocess
import sys
import warnings

import torch
import torch.nn as nn

import shardckpt

PROBE = torch.tensor([[3, 1, 4, 1, 5, 9, 2, 6]])


class TinyLM(nn.Module):
    def __init__(self, vocab: int = 101, dim: int = 24, layers: int = 2):
        super().__init__()
        self.emb = nn.Embedding(vocab, dim)
        self.layers = nn.ModuleList(
            [nn.TransformerEncoderLayer(dim, nhead=4, dim_feedforward=3 * dim, dropout=0.0, batch_first=True) for _ in range(layers)]
        )
        self.head = nn.Linear(dim, vocab)

    def forward(self, idx):
        x = self.emb(idx)
        for layer in self.layers:
            x = layer(x)
        return self.head(x)


def train_sharded(root: str, steps: int) -> None:
    """Runs on every rank under torchrun: FSDP2 training, then one collective save."""
    import torch.distributed as dist
    from torch.distributed.fsdp import fully_shard

    # FSDP2 warns when a root module returns a view; harmless for this demo.
    warnings.filterwarnings("ignore", message="FSDP2-wrapped module")
    dist.init_process_group("gloo")
    rank = dist.get_rank()
    torch.manual_seed(0)
    model = TinyLM()
    for layer in model.layers:
        fully_shard(layer)
    fully_shard(model)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    mgr = shardckpt.CheckpointManager(root, keep_last=2)
    state = {"model": model, "optim": opt, "step": 0, "probe": []}
    # Resume if the directory already holds a run (run the script twice: the
    # second run continues after the newest step instead of starting over).
    start = mgr.restore(state) or 0
    gen = torch.Generator().manual_seed(1234 + rank + start)
    for step in range(start + 1, start + steps + 1):
        batch = torch.randint(0, 101, (4, 16), generator=gen)
        logits = model(batch[:, :-1])
        loss = nn.functional.cross_entropy(logits.reshape(-1, 101), batch[:, 1:].reshape(-1))
        loss.backward()
        opt.step()
        opt.zero_grad()
        if rank == 0:
            print(f"[rank 0] step {step} loss {loss.item():.4f}", flush=True)
        if step % 2 == 1 or step == start + steps:
            with torch.no_grad():
                state["probe"] = model(PROBE)[0, -1, :5].tolist()
            state["step"] = step
            # Every rank calls save; each writes only its own shards, rank 0
            # commits the step, and keep_last=2 prunes older steps after that.
            # Each step is saved once: the loop starts after the restored step.
            mgr.save(step, state)
            if rank == 0:
                print(f"[rank 0] saved step {step} under {root}: committed steps {mgr.steps()}", flush=True)
    mgr.close()
    dist.destroy_process_group()


def resume_single(root: str) -> None:
    """One process, no process group: restore the 2-rank checkpoint into a plain model."""
    model = TinyLM()
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    state = {"model": model, "optim": opt, "step": 0, "probe": []}
    mgr = shardckpt.CheckpointManager(root)
    step = mgr.restore(state)
    assert step is not None, f"no committed checkpoint under {root}"
    ckpt = mgr.step_url(step)
    # The optimizer state came back too, resharded from 2 ranks to 1.
    assert all("exp_avg" in opt.state[p] for p in model.parameters())
    with torch.no_grad():
        probe = model(PROBE)[0, -1, :5].tolist()
    assert probe == state["probe"], f"resumed model differs: {probe} vs {state['probe']}"
    print(f"resumed step {state['step']} on 1 process; outputs match the sharded run exactly")

    m = shardckpt.inspect(ckpt)
    print(f"checkpoint: {len(m.tensors)} tensors, {m.total_bytes / 1e6:.2f} MB, saved by {m.world_size} ranks, {len(m.data_files)} data files")
    for name in list(m.tensors)[:4]:
        t = m.tensors[name]
        print(f"  {name:32s} {t.dtype:5s} {str(t.shape):12s} {len(t.chunks)} chunk(s)")
    shardckpt.verify(ckpt)
    print("verify: every checksum matches")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--dir", default="ckpt-demo", help="where to write the checkpoint (default: ./ckpt-demo)")
    ap.add_argument("--steps", type=int, default=5)
    ap.add_argument("--nproc", type=int, default=2)
    ap.add_argument("--phase", choices=["all", "train"], default="all", help=argparse.SUPPRESS)
    args = ap.parse_args()
    root = os.path.abspath(args.dir)
    if args.phase == "train":
        train_sharded(root, args.steps)
        return
    cmd = [
        sys.executable, "-m", "torch.distributed.run", "--standalone", f"--nproc-per-node={args.nproc}",
        os.path.abspath(__file__), "--phase", "train", "--dir", args.dir, "--steps", str(args.steps),
    ]
    print("launching:", " ".join(cmd[1:]), flush=True)
    env = dict(os.environ, OMP_NUM_THREADS="1")
    subprocess.run(cmd, check=True, env=env)
    resume_single(root)


if __name__ == "__main__":
    main()
