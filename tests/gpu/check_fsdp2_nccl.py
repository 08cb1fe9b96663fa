"""FSDP2 checkpoint checks for a GPU box: NCCL, CUDA RNG, bf16 mixed precision, pinned CPU offload, meta init.

    python3 tests/gpu/check_fsdp2_nccl.py --out DIR                       # 1 GPU, world size 1
    torchrun --nproc-per-node N tests/gpu/check_fsdp2_nccl.py --out DIR   # N GPUs (N >= 1)
    torchrun --nproc-per-node 2 tests/gpu/check_fsdp2_nccl.py --out DIR --backend gloo --device cpu

For each configuration it trains 2K steps straight, then K steps, saves
(model, AdamW, LR scheduler, every rank's RNG incl. CUDA), rebuilds
everything from another seed with scrambled RNGs, loads, trains K more, and
requires bit-identical per-step losses and final weights (dropout on the
accelerator makes the CUDA RNG streams count). It also checks dtype (fp32
master weights under bf16 compute), device and pinning (CPU offload), that a
model built on the meta device is filled on the right device, and that the
checkpoint verifies. Every parameter must also be FSDP2's own sharded
parameter, a DTensor on the same device as its local tensor, whose storage is
FSDP2's padded shard (what the all-gathers read), and ``model.state_dict()``
must work: a meta-initialized, CPU-offloaded model once ended with DTensors
reporting cuda:0 over pinned CPU shards. Prints one PASS/FAIL line per check
and a summary; exits 1 if anything failed. Results also go to
DIR/result-rank0.json.

Started without torchrun (no RANK in the environment) it runs as a single
process, world size 1, on a free loopback port.

Not a pytest file: CI has no GPU. Run it by hand on a GPU machine (torch >= 2.11).
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import traceback
import warnings

import torch
import torch.distributed as dist
import torch.nn as nn
import torch.nn.functional as F

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, os.path.dirname(os.path.dirname(HERE)))  # the repo, for an uninstalled checkout

import shardckpt  # noqa: E402

warnings.filterwarnings("ignore", message="FSDP2-wrapped module")
K = 3
VOCAB, DIM, SEQ, ROWS = 101, 64, 16, 8


class Block(nn.Module):
    def __init__(self):
        super().__init__()
        self.norm = nn.LayerNorm(DIM)
        self.up = nn.Linear(DIM, 3 * DIM + 5)  # odd sizes: uneven shards
        self.down = nn.Linear(3 * DIM + 5, DIM)
        self.drop = nn.Dropout(0.2)

    def forward(self, x):
        return x + self.drop(self.down(F.gelu(self.up(self.norm(x)))))


class Net(nn.Module):
    def __init__(self):
        super().__init__()
        self.emb = nn.Embedding(VOCAB, DIM)
        # A saved buffer used in forward: it must be on the compute device
        # (where FSDP2 moves buffers), also under CPU offload and meta init.
        self.register_buffer("pos", 0.02 * torch.randn(SEQ, DIM))
        self.blocks = nn.ModuleList([Block() for _ in range(2)])
        self.head = nn.Linear(DIM, VOCAB)

    def forward(self, idx):
        x = self.emb(idx) + self.pos
        for b in self.blocks:
            x = b(x)
        return self.head(x)


def build(cfg, device, seed, meta=False):
    from torch.distributed.fsdp import CPUOffloadPolicy, MixedPrecisionPolicy, fully_shard

    torch.manual_seed(seed)
    if meta:
        with torch.device("meta"):
            model = Net()
    else:
        model = Net().to(device)
    kw = {}
    if cfg.get("bf16"):
        kw["mp_policy"] = MixedPrecisionPolicy(param_dtype=torch.bfloat16, reduce_dtype=torch.float32)
    if cfg.get("offload"):
        kw["offload_policy"] = CPUOffloadPolicy(pin_memory=device.type == "cuda")
    for b in model.blocks:
        fully_shard(b, **kw)
    fully_shard(model, **kw)
    return model


def make_optim(model):
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2, weight_decay=0.1)
    sched = torch.optim.lr_scheduler.LambdaLR(opt, lambda s: min(1.0, (s + 1) / 3) * 0.9**s)
    return opt, sched


def train(model, opt, sched, start, steps, device, rank, world):
    losses = []
    for s in range(start, start + steps):
        g = torch.Generator().manual_seed(s)
        idx = torch.randint(0, VOCAB, (ROWS * world, SEQ + 1), generator=g)[rank * ROWS : (rank + 1) * ROWS].to(device)
        loss = F.cross_entropy(model(idx[:, :-1]).float().reshape(-1, VOCAB), idx[:, 1:].reshape(-1))
        loss.backward()
        opt.step()
        sched.step()
        opt.zero_grad(set_to_none=True)
        total = loss.detach().clone()
        dist.all_reduce(total)
        losses.append(total.item())
    return losses


def fsdp2_problems(model, offload, device):
    """What is wrong with the FSDP2 parameters of ``model`` (sharded state), as strings."""
    from torch.distributed.fsdp import FSDPModule
    from torch.distributed.tensor import DTensor

    bad = []
    fps = {}
    for m in model.modules():
        if not isinstance(m, FSDPModule):
            continue
        state = m._get_fsdp_state()
        groups = getattr(state, "_fsdp_param_groups", None)  # torch >= 2.12; 2.11 has one group
        if groups is None:
            groups = [g for g in [getattr(state, "_fsdp_param_group", None)] if g is not None]
        for g in groups:
            for fp in g.fsdp_params:
                fps[id(fp.sharded_param)] = fp
    want = torch.device("cpu") if offload else device
    for n, p in model.named_parameters():
        if not isinstance(p, DTensor):
            bad.append(f"{n}: {type(p).__name__}, not a sharded DTensor")
            continue
        lt = p._local_tensor
        if p.device != want or lt.device != want:
            bad.append(f"{n}: DTensor on {p.device} over a local tensor on {lt.device}, expected {want}")
        fp = fps.get(id(p))
        if fp is None:
            bad.append(f"{n}: not FSDP2's sharded parameter (identity lost)")
            continue
        data = fp._sharded_param_data
        if lt.numel() and lt.untyped_storage().data_ptr() != data.untyped_storage().data_ptr():
            bad.append(f"{n}: local tensor is not a view of FSDP2's padded shard")
    try:
        sd = model.state_dict()
        for k, v in sd.items():
            local = getattr(v, "_local_tensor", v)
            if v.device != local.device:
                bad.append(f"state_dict()[{k!r}]: DTensor on {v.device} over a local tensor on {local.device}")
    except Exception as e:  # the reported symptom: state_dict() raised
        bad.append(f"model.state_dict() raised {type(e).__name__}: {e}")
    return bad


def full(model):
    from torch.distributed.checkpoint.state_dict import StateDictOptions, get_model_state_dict

    sd = get_model_state_dict(model, options=StateDictOptions(full_state_dict=True))
    return {k: v.detach().cpu() for k, v in sd.items()}


def seed_all(n, device):
    torch.manual_seed(n)
    if device.type == "cuda":
        torch.cuda.manual_seed(n)


def check_config(name, cfg, out_dir, device, rank, world):
    """Resume equivalence for one FSDP2 configuration; returns a list of failures."""
    fails = []
    path = os.path.join(out_dir, name)
    # straight
    model = build(cfg, device, 0)
    opt, sched = make_optim(model)
    seed_all(100 + rank, device)
    straight = train(model, opt, sched, 0, 2 * K, device, rank, world)
    ref = full(model)
    # first half + save
    model = build(cfg, device, 0)
    opt, sched = make_optim(model)
    seed_all(100 + rank, device)
    first = train(model, opt, sched, 0, K, device, rank, world)
    shardckpt.save({"model": model, "optim": opt, "sched": sched, "rng": shardckpt.RNGState(), "step": K}, path, overwrite=True)
    del model, opt, sched
    # rebuilt, scrambled, loaded
    model = build(cfg, device, 1234, meta=cfg.get("meta", False))
    seed_all(999 + rank, device)
    if cfg.get("meta"):
        # no optimizer yet: the model is filled (on its final device) first
        shardckpt.load({"model": model}, path, strict=False)
        fails += [f"after the meta load: {f}" for f in fsdp2_problems(model, cfg.get("offload"), device)]
    opt, sched = make_optim(model)
    state = {"model": model, "optim": opt, "sched": sched, "rng": shardckpt.RNGState(), "step": 0}
    shardckpt.load(state, path)
    if state["step"] != K:
        fails.append(f"step {state['step']} != {K}")
    want_dev = "cpu" if cfg.get("offload") else device.type
    for n, p in model.named_parameters():
        if p.dtype != torch.float32:
            fails.append(f"{n}: dtype {p.dtype} (fp32 master weights expected)")
        if p.device.type != want_dev:
            fails.append(f"{n}: on {p.device}, expected {want_dev}")
        if cfg.get("offload") and device.type == "cuda" and not p._local_tensor.is_pinned():
            fails.append(f"{n}: CPU-offloaded parameter is not pinned")
    for n, b in model.named_buffers():
        if b.device != device:
            fails.append(f"buffer {n}: on {b.device}, expected {device}")
    fails += [f"after the load: {f}" for f in fsdp2_problems(model, cfg.get("offload"), device)]
    second = train(model, opt, sched, K, K, device, rank, world)
    fails += [f"after training: {f}" for f in fsdp2_problems(model, cfg.get("offload"), device)]
    if first + second != straight:
        fails.append(f"losses differ: straight {straight} vs resumed {first + second}")
    got = full(model)
    bad = sorted(k for k in ref if not torch.equal(ref[k], got[k]))
    if bad:
        fails.append(f"final weights differ: {bad[:5]}")
    if rank == 0:
        m = shardckpt.verify(path)
        if m.tensors["model.emb.weight"].dtype != "F32":
            fails.append(f"saved dtype {m.tensors['model.emb.weight'].dtype}, expected F32")
        if device.type == "cuda" and not any(n.endswith(".cuda.0") for n in m.tensors):
            fails.append("no CUDA RNG state in the checkpoint")
    return fails


CONFIGS = {
    "fsdp2_fp32": {},
    "fsdp2_bf16": {"bf16": True},
    "fsdp2_offload_pinned": {"offload": True},
    "fsdp2_bf16_offload": {"bf16": True, "offload": True},
    "fsdp2_meta_init": {"meta": True},
    "fsdp2_meta_init_offload": {"meta": True, "offload": True},
}


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--out", required=True, help="directory for the checkpoints and result json")
    ap.add_argument("--backend", default=None, help="nccl (default with CUDA) or gloo")
    ap.add_argument("--device", default=None, help="cuda (default with CUDA) or cpu")
    ap.add_argument("--only", default=None, help="comma-separated subset of: " + ",".join(CONFIGS))
    args = ap.parse_args(argv)
    if "RANK" not in os.environ:
        # Started as a plain script: one process, world size 1.
        import socket

        with socket.socket() as sock:
            sock.bind(("127.0.0.1", 0))
            port = sock.getsockname()[1]
        os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), RANK="0", WORLD_SIZE="1", LOCAL_RANK="0")
    use_cuda = (args.device or ("cuda" if torch.cuda.is_available() else "cpu")) == "cuda"
    local = int(os.environ.get("LOCAL_RANK", "0"))
    if use_cuda:
        device = torch.device("cuda", local)
        torch.cuda.set_device(device)
        dist.init_process_group(args.backend or "nccl", device_id=device)
    else:
        device = torch.device("cpu")
        dist.init_process_group(args.backend or "gloo")
    rank, world = dist.get_rank(), dist.get_world_size()
    os.makedirs(args.out, exist_ok=True)
    names = args.only.split(",") if args.only else list(CONFIGS)
    results = {}
    for name in names:
        try:
            fails = check_config(name, CONFIGS[name], args.out, device, rank, world)
        except Exception as e:  # report and go on with the next check
            fails = [f"{type(e).__name__}: {e}\n{traceback.format_exc()}"]
        every = [None] * world
        dist.all_gather_object(every, fails)
        results[name] = [f"rank {r}: {f}" for r, fs in enumerate(every) for f in fs]
        if rank == 0:
            print(f"{'PASS' if not results[name] else 'FAIL'} {name}", flush=True)
            for f in results[name]:
                print(f"    {f}", flush=True)
    if rank == 0:
        env = {
            "torch": torch.__version__,
            "backend": dist.get_backend(),
            "device": torch.cuda.get_device_name(device) if use_cuda else "cpu",
            "world_size": world,
        }
        n_fail = sum(1 for v in results.values() if v)
        print(f"SUMMARY: {len(results) - n_fail}/{len(results)} passed ({env})", flush=True)
        with open(os.path.join(args.out, "result-rank0.json"), "w") as f:
            json.dump({"env": env, "results": results}, f, indent=2)
    ok = not any(results.values())
    dist.destroy_process_group()
    sys.exit(0 if ok else 1)


if __name__ == "__main__":
    main()
