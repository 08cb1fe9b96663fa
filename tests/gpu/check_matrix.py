"""The GPU matrix: every parallel layout saved and loaded into every other, bit-exact, on NCCL (or gloo).

    python3 tests/gpu/check_matrix.py --out DIR                          # 1 GPU, world size 1
    torchrun --nproc-per-node N tests/gpu/check_matrix.py --out DIR      # N GPUs (any N >= 1)
    torchrun --nproc-per-node 2 tests/gpu/check_matrix.py --out DIR --device cpu   # gloo on CPU, to debug

Cases (one PASS/FAIL line each, then a total):

* ``x/SAVE->LOAD``: a model + AdamW (stepped once) in layout SAVE is saved
  and loaded into a fresh, differently seeded and stepped model + AdamW in
  layout LOAD; the full model and optimizer state (gathered) must equal the
  saved ones bit for bit, and the live optimizer keeps its own ``foreach``.
  Layouts: FSDP2 (fp32, bf16 mixed precision), FSDP1, DDP, TP, FSDP2xTP on
  every (dp, tp) factorisation of the world (both orders at 2 GPUs: 1x2 and
  2x1), HSDP on every (replicate, shard) factorisation. Also loaded into a
  plain module on rank 0 alone (``no_dist``: another GPU count);
* ``atomic/...``: the same with ``load(atomic=True)``;
* ``writer_process/...``: ``async_save`` through the writer process
  (``SHARDCKPT_ASYNC_WRITER=process``), loaded into another layout;
* ``convert/...``: ``converters.reshard`` of a GPU-saved checkpoint to world
  size 1 and to N, and ``converters.to_safetensors``, each checked against
  the saved weights (the resharded ones loaded back on N ranks);
* ``read_once/LAYOUT``: bytes read from storage across all ranks, with the
  read-once load and without it, for the replicated layouts (DDP, HSDP);
  with read-once they must stay <= 1.05x the checkpoint's tensor bytes;
* ``train/...``: with ``--train``, ``tests/gpu/check_fsdp2_nccl.py``'s
  resume-equivalence configurations (bit-identical losses after a resume).

Exits 1 if any case failed; the results also go to DIR/matrix-rank0.json.
Not a pytest file: CI has no GPU. Started without torchrun it runs as one
process on a free loopback port.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time
import traceback
import warnings

import torch
import torch.distributed as dist
import torch.nn.functional as F

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, HERE)
sys.path.insert(0, os.path.dirname(os.path.dirname(HERE)))  # the repo, for an uninstalled checkout

import check_fsdp2_nccl as base  # noqa: E402

import shardckpt  # noqa: E402

warnings.filterwarnings("ignore")


class MBlock(torch.nn.Module):
    """check_fsdp2_nccl's block with an even hidden size: TP splits it (an uneven TP matmul is a torch limit)."""

    def __init__(self):
        super().__init__()
        self.norm = torch.nn.LayerNorm(base.DIM)
        self.up = torch.nn.Linear(base.DIM, HIDDEN)
        self.down = torch.nn.Linear(HIDDEN, base.DIM)

    def forward(self, x):
        return x + self.down(F.gelu(self.up(self.norm(x))))


class MNet(base.Net):
    """Vocabulary 101 rows (uneven FSDP shards), a saved buffer, two blocks, a head."""

    def __init__(self):
        super().__init__()
        self.blocks = torch.nn.ModuleList([MBlock() for _ in range(2)])


HIDDEN = 3 * 64 * 8  # divisible by every TP size up to 8 (and 3)


def factor_pairs(world):
    return [(a, world // a) for a in range(1, world + 1) if world % a == 0]


def layouts(world):
    out = ["fsdp2", "fsdp2_bf16", "fsdp1", "ddp", "tp"]
    out += [f"fsdp2xtp_{a}x{b}" for a, b in factor_pairs(world)]
    out += [f"hsdp_{a}x{b}" for a, b in factor_pairs(world)]
    return out


def build(kind, device, seed):
    """(model, AdamW) in layout ``kind``, stepped once on a seed-dependent batch (dropout off)."""
    from torch.distributed.device_mesh import init_device_mesh

    torch.manual_seed(seed)
    model = MNet().to(device)
    world = dist.get_world_size()
    dt = device.type
    foreach = None
    if kind in ("fsdp2", "fsdp2_bf16"):
        from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard

        kw = {"mp_policy": MixedPrecisionPolicy(param_dtype=torch.bfloat16, reduce_dtype=torch.float32)} if kind.endswith("bf16") else {}
        for b in model.blocks:
            fully_shard(b, **kw)
        fully_shard(model, **kw)
    elif kind == "fsdp1":
        from torch.distributed.fsdp import FullyShardedDataParallel as FSDP

        model = FSDP(model, device_id=device, use_orig_params=True)
    elif kind == "ddp":
        from torch.nn.parallel import DistributedDataParallel as DDP

        model = DDP(model, device_ids=[device.index] if dt == "cuda" else None)
    elif kind == "tp" or kind.startswith("fsdp2xtp_"):
        from torch.distributed.tensor.parallel import ColwiseParallel, RowwiseParallel, parallelize_module

        if kind == "tp":
            mesh, tp = init_device_mesh(dt, (world,)), None
            tp = mesh
        else:
            a, b = map(int, kind.split("_")[1].split("x"))
            mesh = init_device_mesh(dt, (a, b), mesh_dim_names=("dp", "tp"))
            tp = mesh["tp"]
        plan = {}
        for i in range(len(model.blocks)):
            plan[f"blocks.{i}.up"] = ColwiseParallel()
            plan[f"blocks.{i}.down"] = RowwiseParallel()
        parallelize_module(model, tp, plan)
        if kind != "tp":
            from torch.distributed.fsdp import fully_shard

            for blk in model.blocks:
                fully_shard(blk, mesh=mesh["dp"])
            fully_shard(model, mesh=mesh["dp"])
        # Sharded and plain parameters together: the user turns foreach off
        # (torch's foreach kernels refuse the mix); a load must keep that.
        foreach = False
    elif kind.startswith("hsdp_"):
        from torch.distributed.fsdp import fully_shard

        a, b = map(int, kind.split("_")[1].split("x"))
        mesh = init_device_mesh(dt, (a, b), mesh_dim_names=("replicate", "shard"))
        for blk in model.blocks:
            fully_shard(blk, mesh=mesh)
        fully_shard(model, mesh=mesh)
    elif kind != "plain":
        raise ValueError(kind)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2, weight_decay=0.1, foreach=foreach)
    step(model, opt, device, seed)
    return model, opt


def step(model, opt, device, seed):
    model.eval()  # no dropout: every layout computes the same function on every rank
    g = torch.Generator().manual_seed(seed)
    idx = torch.randint(0, base.VOCAB, (base.ROWS, base.SEQ + 1), generator=g).to(device)
    loss = F.cross_entropy(model(idx[:, :-1]).float().reshape(-1, base.VOCAB), idx[:, 1:].reshape(-1))
    loss.backward()
    opt.step()
    opt.zero_grad(set_to_none=True)


def full_state(model, opt, single=False):
    """{name: cpu tensor} of the model's and the optimizer's full state (collective unless ``single``)."""
    from torch.distributed.checkpoint.state_dict import StateDictOptions, get_model_state_dict, get_optimizer_state_dict

    if single:
        msd = {k: v.detach().cpu().clone() for k, v in model.state_dict().items()}
        names = {id(p): n for n, p in model.named_parameters()}
        osd = {names[id(p)]: {k: v.detach().cpu().clone() if torch.is_tensor(v) else v for k, v in s.items()} for p, s in opt.state.items()}
    else:
        o = StateDictOptions(full_state_dict=True)  # (cpu_offload=True crashes FSDP1 on CPU, torch 2.13)
        msd = {k: v.detach().cpu().clone() for k, v in get_model_state_dict(model, options=o).items()}
        osd = get_optimizer_state_dict(model, opt, options=o)["state"]
    out = {f"model.{k}": v for k, v in msd.items()}
    for fqn, st in osd.items():
        for k, v in st.items():
            out[f"optim.{fqn}.{k}"] = v.detach().cpu().clone() if torch.is_tensor(v) else torch.tensor(v)
    return out


def differ(ref, got):
    bad = sorted(k for k in ref if k not in got or got[k].dtype != ref[k].dtype or not torch.equal(got[k].float(), ref[k].float()))
    bad += sorted(k for k in got if k not in ref)
    return bad


class Matrix:
    def __init__(self, out, device):
        self.out, self.device = out, device
        self.rank, self.world = dist.get_rank(), dist.get_world_size()
        self.results = {}

    def case(self, name, fn, *args, **kw):
        t0 = time.perf_counter()
        try:
            fails = fn(*args, **kw) or []
        except Exception as e:  # report and go on with the next case
            fails = [f"{type(e).__name__}: {e}\n{traceback.format_exc(limit=6)}"]
        every = [None] * self.world
        dist.all_gather_object(every, fails)
        self.results[name] = [f"rank {r}: {f}" for r, fs in enumerate(every) for f in fs]
        if self.rank == 0:
            print(f"{'PASS' if not self.results[name] else 'FAIL'} {name} ({time.perf_counter() - t0:.1f}s)", flush=True)
            for f in self.results[name][:6]:
                print(f"    {f}", flush=True)
        if self.device.type == "cuda":
            torch.cuda.empty_cache()

    def path(self, name):
        p = os.path.join(self.out, name)
        return p

    def saved(self, kind, how="sync"):
        """Save layout ``kind``; returns (path, reference full state)."""
        path = self.path(f"{kind}-{how}")
        model, opt = build(kind, self.device, 0)
        state = {"model": model, "optim": opt}
        if how == "process":
            from shardckpt import _knobs

            old = _knobs.ASYNC_WRITER
            _knobs.ASYNC_WRITER = "process"
            try:
                shardckpt.async_save(state, path, overwrite=True).result()
            finally:
                _knobs.ASYNC_WRITER = old
        else:
            shardckpt.save(state, path, overwrite=True)
        return path, full_state(model, opt)

    def load_check(self, path, ref, kind, **kw):
        model, opt = build(kind, self.device, 1)
        foreach = opt.param_groups[0]["foreach"]
        shardckpt.load({"model": model, "optim": opt}, path, **kw)
        fails = [f"differs: {k}" for k in differ(ref, full_state(model, opt))[:8]]
        if opt.param_groups[0]["foreach"] != foreach:
            fails.append(f"optimizer foreach {opt.param_groups[0]['foreach']!r}, the live optimizer had {foreach!r}")
        if opt.param_groups[0]["lr"] != 1e-2:
            fails.append("lr not loaded")
        step(model, opt, self.device, 5)  # and it trains on
        return fails

    def single_check(self, path, ref):
        fails = []
        if self.rank == 0:
            model, opt = build("plain", self.device, 1)
            shardckpt.load({"model": model, "optim": opt}, path, no_dist=True)
            fails = [f"differs: {k}" for k in differ(ref, full_state(model, opt, single=True))[:8]]
        dist.barrier()
        return fails

    def saved_case(self, kind, how="sync"):
        """``saved`` as a case of its own: (path, ref), or None when the save failed."""
        got = []
        self.case(f"save/{kind}" + ("" if how == "sync" else f"/{how}"), lambda: got.append(self.saved(kind, how)))
        return got[0] if got and not self.results[list(self.results)[-1]] else None

    def run(self, which, train):
        lays = layouts(self.world)
        for s in lays:
            if which and not any(w in s for w in which):
                continue
            saved = self.saved_case(s)
            if saved is None:
                continue
            path, ref = saved
            for t in lays:
                self.case(f"x/{s}->{t}", self.load_check, path, ref, t)
            self.case(f"x/{s}->single_process", self.single_check, path, ref)
        hs = [x for x in lays if x.startswith("hsdp_")]
        saved = self.saved_case("fsdp2")
        if saved is None:
            return
        path, ref = saved
        for t in ["fsdp2", hs[-1], "ddp"]:
            self.case(f"atomic/fsdp2->{t}", self.load_check, path, ref, t, atomic=True)
        for s in ("fsdp2", "fsdp2_bf16", hs[0]):
            saved = self.saved_case(s, "process")
            if saved is None:
                continue
            p2, ref2 = saved
            self.case(f"writer_process/{s}->ddp", self.load_check, p2, ref2, "ddp")
        self.case("convert/reshard+to_safetensors", self.convert, path, ref)
        for t in ["ddp"] + hs:
            self.case(f"read_once/{t}", self.read_once, path, ref, t)
        if train:
            for name, cfg in base.CONFIGS.items():
                self.case(f"train/{name}", base.check_config, name, cfg, self.out, self.device, self.rank, self.world)

    def convert(self, path, ref):
        from shardckpt import converters

        fails = []
        one, many, hf = self.path("resharded-1"), self.path(f"resharded-{self.world}"), self.path("hf")
        if self.rank == 0:
            converters.reshard(path, one, world_size=1)
            if self.world > 1:
                converters.reshard(path, many, world_size=self.world)
            converters.to_safetensors(path, hf)
            from safetensors.torch import load_file

            got = {}
            for f in sorted(os.listdir(hf)):
                if f.endswith(".safetensors"):
                    got.update(load_file(os.path.join(hf, f)))
            for k, v in ref.items():
                if k.startswith("model."):
                    name = k[len("model."):]
                    if name not in got or not torch.equal(got[name], v):
                        fails.append(f"to_safetensors: {name} differs or missing")
        dist.barrier()
        for p in (one, many):
            fails += [f"{os.path.basename(p)}: {f}" for f in self.load_check(p, ref, "fsdp2")]
        fails += [f"resharded-1 single: {f}" for f in self.single_check(one, ref)]
        return fails

    def read_once(self, path, ref, kind):
        from shardckpt import _knobs, _storage

        counts = {}
        for on in (True, False):
            seen = []
            orig = _storage.Storage.read_into

            def read_into(self_, rel, ranges, seen=seen, orig=orig):
                if rel.startswith("data/"):
                    seen.append(sum(len(b) for _, b in ranges))
                return orig(self_, rel, ranges)

            _storage.Storage.read_into = read_into
            _knobs.LOAD_READ_ONCE = on
            try:
                fails = self.load_check(path, ref, kind)
            finally:
                _storage.Storage.read_into = orig
                _knobs.LOAD_READ_ONCE = True
            if fails:
                return fails
            n = torch.tensor([sum(seen)], dtype=torch.float64, device=self.device)
            dist.all_reduce(n)
            counts[on] = n.item()
        total = sum(m.nbytes for m in shardckpt.inspect(path).tensors.values())
        if self.rank == 0:
            print(f"    storage bytes read / checkpoint tensor bytes: read-once {counts[True] / total:.3f}x, "
                  f"without {counts[False] / total:.3f}x", flush=True)
        return [] if counts[True] <= 1.05 * total else [f"read {counts[True] / total:.2f}x the checkpoint with read-once"]


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--out", required=True, help="directory for the checkpoints and result json")
    ap.add_argument("--device", default=None, help="cuda (default with CUDA; NCCL) or cpu (gloo)")
    ap.add_argument("--only", default=None, help="comma-separated substrings of the save layouts to cross (default all)")
    ap.add_argument("--train", action="store_true", help="also run check_fsdp2_nccl.py's resume configurations")
    args = ap.parse_args(argv)
    if "RANK" not in os.environ:
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
        dist.init_process_group("nccl", device_id=device)
    else:
        device = torch.device("cpu")
        dist.init_process_group("gloo")
    os.makedirs(args.out, exist_ok=True)
    m = Matrix(args.out, device)
    m.run(args.only.split(",") if args.only else None, args.train)
    rank, world = dist.get_rank(), dist.get_world_size()
    if rank == 0:
        env = {
            "torch": torch.__version__,
            "backend": dist.get_backend(),
            "device": torch.cuda.get_device_name(device) if use_cuda else "cpu",
            "world_size": world,
            "nccl": ".".join(map(str, torch.cuda.nccl.version())) if use_cuda else None,
        }
        n_fail = sum(1 for v in m.results.values() if v)
        print(f"TOTAL: {len(m.results) - n_fail}/{len(m.results)} passed ({env})", flush=True)
        with open(os.path.join(args.out, "matrix-rank0.json"), "w") as f:
            json.dump({"env": env, "results": m.results}, f, indent=2)
    ok = not any(m.results.values())
    dist.destroy_process_group()
    sys.exit(0 if ok else 1)


if __name__ == "__main__":
    main()
