"""Optimizers on FSDP2: state sharded like the params, resharded on load, groups and steps restored."""

import torch

import shardckpt
import _training as T
from _dist import run_ranks

KINDS = ("adamw", "adam_fused", "sgd", "groups")


def _save_all(rank, world, root):
    out = {}
    for kind in KINDS:
        model, opt, sched = T.make("fsdp2", rank, world, optim=kind)
        T.train(model, opt, sched, 0, 2, "fsdp2", rank, world)
        shardckpt.save({"model": model, "optim": opt}, f"{root}/{kind}")
        out[kind] = T.full_optim(model, opt)
        # an optimizer that has not stepped: saved empty, left untouched
        model, opt, _ = T.make("fsdp2", rank, world, optim=kind)
        shardckpt.save({"model": model, "optim": opt}, f"{root}/{kind}-fresh")
        assert not opt.state
    return out


def _load_all(rank, world, root):
    out = {}
    for kind in KINDS:
        # live optimizer already stepped (states filled in place) and empty
        # (states created with the parameters' DTensor sharding)
        for pre in (True, False):
            model, opt, sched = T.make("fsdp2", rank, world, seed=7, optim=kind)
            if pre:
                T.train(model, opt, sched, 50, 1, "fsdp2", rank, world)
            for g in opt.param_groups:
                g["lr"] = 9.0
            shardckpt.load({"model": model, "optim": opt}, f"{root}/{kind}")
            from torch.distributed.tensor import DTensor

            for p, st in opt.state.items():
                for k, v in st.items():
                    if k != "step":
                        assert isinstance(v, DTensor) and v.placements == p.placements and v.shape == p.shape, (kind, k)
            out[(kind, pre)] = T.full_optim(model, opt)
            model, opt, sched = T.make("fsdp2", rank, world, seed=7, optim=kind)
            T.train(model, opt, sched, 50, 1, "fsdp2", rank, world)
            shardckpt.load({"model": model, "optim": opt}, f"{root}/{kind}-fresh")
            assert not opt.state, kind
    return out


def _same(a, b):
    assert a.keys() == b.keys()
    for k in a:
        if isinstance(a[k], torch.Tensor):
            assert torch.equal(a[k], b[k]), k
        else:
            assert a[k] == b[k], k


def test_optimizers_fsdp2_save2_load3(tmp_path):
    saved = run_ranks(2, _save_all, str(tmp_path))[0]
    loaded = run_ranks(3, _load_all, str(tmp_path))[0]
    for kind in KINDS:
        assert any(k.endswith(".exp_avg") or k.endswith(".momentum_buffer") for k in saved[kind])
        for pre in (True, False):
            _same(saved[kind], loaded[(kind, pre)])
    m = shardckpt.inspect(str(tmp_path / "adamw"))
    emb = m.tensors["optim.state.emb.weight.exp_avg"]
    assert emb.shape == [37, 7] and len(emb.chunks) == 2  # sharded like the parameter
    assert m.values["optim"]["param_groups"][0]["lr"] == saved["adamw"]["group0.lr"] != 2e-2  # scheduled
    g = shardckpt.inspect(str(tmp_path / "groups")).values["optim"]["param_groups"]
    assert [x["weight_decay"] for x in g] == [0.1, 0.0] and "emb.weight" in g[0]["params"] and "tiny" in g[0]["params"]
