"""FSDP2 policies (bf16 mixed precision, CPU offload, reshard_after_forward) and meta-device init.

Each checkpoint is saved on 2 ranks after 2 training steps; the saving ranks
then train 2 more steps as the reference. Loads run on 3 ranks into a model
that has already run forward/backward (so FSDP2's buffers exist), and must
give back the exact saved weights, keep dtype/device/Parameter identity, and
train the next 2 steps like the reference.
"""

import torch

import shardckpt
import _training as T
from _dist import run_ranks
from models import build

POLICIES = ("fsdp2_bf16", "fsdp2_offload", "fsdp2_keep")


def _save(rank, world, root):
    out = {}
    for kind in POLICIES + ("fsdp2",):
        model, opt, sched = T.make(kind, rank, world)
        T.train(model, opt, sched, 0, 2, kind, rank, world)
        if kind == "fsdp2_keep":
            # reshard_after_forward=False: a forward leaves the unsharded
            # (bf16/fp32) parameters registered; saving must still see shards.
            with torch.no_grad():
                model(T.batch(9)[0])
        shardckpt.save({"model": model, "optim": opt, "sched": sched}, f"{root}/{kind}")
        out[kind] = (T.full_params(model), T.train(model, opt, sched, 2, 2, kind, rank, world))
    return out


def _load_policies(rank, world, root):
    out = {}
    for kind in POLICIES:
        model, opt, sched = T.make(kind, rank, world, seed=3)
        T.train(model, opt, sched, 40, 1, kind, rank, world)
        ids = [id(p) for p in model.parameters()]
        shardckpt.load({"model": model, "optim": opt, "sched": sched}, f"{root}/{kind}")
        assert [id(p) for p in model.parameters()] == ids
        for n, p in model.named_parameters():
            assert p.dtype == torch.float32, (kind, n)  # master weights, also under bf16 compute
            assert p.device.type == "cpu", (kind, n)
            if kind == "fsdp2_offload" and torch.cuda.is_available():
                assert p._local_tensor.is_pinned(), n
        out[kind] = (T.full_params(model), T.train(model, opt, sched, 2, 2, kind, rank, world))
    return out


def _padding_consistent(model) -> bool:
    """Every FSDP2 parameter's local shard is a view of its padded all-gather input."""
    from torch.distributed.fsdp import FSDPModule

    ok = []
    for m in model.modules():
        if isinstance(m, FSDPModule):
            for g in m._get_fsdp_state()._fsdp_param_groups:
                for fp in g.fsdp_params:
                    lt = fp.sharded_param._local_tensor
                    ok.append(
                        lt.numel() == 0
                        or lt.untyped_storage().data_ptr() == fp._sharded_param_data.untyped_storage().data_ptr()
                    )
    return bool(ok) and all(ok)


def _load_meta(rank, world, root):
    """Meta-device model, with and without ``to_empty``; the optimizer is built after the load."""
    out = {}
    for to_empty in (True, False):
        with torch.device("meta"):
            model = build(11)
        model = T.shard(model, "fsdp2", world)
        if to_empty:
            model.to_empty(device="cpu")
        rng = torch.get_rng_state()
        res = shardckpt.load({"model": model}, f"{root}/fsdp2", strict=False)
        assert torch.equal(torch.get_rng_state(), rng)  # nothing was randomly initialized
        assert res.unexpected_keys == [] and res.missing_keys == []
        assert all(not t.is_meta for t in model.state_dict().values())
        assert _padding_consistent(model)
        opt = T.make_optimizer(model)
        sched = torch.optim.lr_scheduler.LambdaLR(opt, lambda s: min(1.0, (s + 1) / 3) * 0.95**s)
        shardckpt.load({"model": model, "optim": opt, "sched": sched}, f"{root}/fsdp2")
        out[to_empty] = (T.full_params(model), T.train(model, opt, sched, 2, 2, "fsdp2", rank, world))
    return out


def _check(saved, loaded, tol):
    params, (losses, lrs) = saved
    lparams, (llosses, llrs) = loaded
    assert params.keys() == lparams.keys()
    for k in params:
        assert torch.equal(params[k], lparams[k]), k
    torch.testing.assert_close(torch.tensor(llosses), torch.tensor(losses), rtol=tol, atol=tol)
    assert llrs == lrs


def test_fsdp2_policies_and_meta_init_save2_load3(tmp_path):
    saved = run_ranks(2, _save, str(tmp_path))[0]
    m = shardckpt.inspect(str(tmp_path / "fsdp2_bf16"))
    assert m.tensors["model.emb.weight"].dtype == "F32"  # fp32 master weights, not the bf16 compute copy
    assert m.tensors["model.emb.weight"].layout["placements"] == ["S(0)"]
    loaded = run_ranks(3, _load_policies, str(tmp_path))[0]
    for kind in POLICIES:
        # 3 ranks reduce in another order than 2: close, not bit-equal
        _check(saved[kind], loaded[kind], 1e-4 if kind == "fsdp2_bf16" else 1e-5)
    meta = run_ranks(3, _load_meta, str(tmp_path))[0]
    for to_empty in (True, False):
        _check(saved["fsdp2"], meta[to_empty], 1e-5)
