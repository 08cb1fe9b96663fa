"""FSDP1 (FullyShardedDataParallel on CPU), use_orig_params False and True.

FlatParameters are reached through torch's sharded state dict (ShardedTensors
by original FQN); the checkpoint holds plain FQNs, so it also loads into FSDP2
at another world size.
"""

import torch

import shardckpt
import _training as T
from _dist import run_ranks

KINDS = ("fsdp1", "fsdp1_orig")


def _save(rank, world, root):
    out = {}
    for kind in KINDS:
        model, opt, sched = T.make(kind, rank, world)
        T.train(model, opt, sched, 0, 2, kind, rank, world)
        shardckpt.save({"model": model, "optim": opt, "sched": sched, "step": 2}, f"{root}/{kind}")
        out[kind] = (T.full_params(model), T.full_optim(model, opt), T.train(model, opt, sched, 2, 2, kind, rank, world))
        # an optimizer that has not stepped is saved empty and left so
        model, opt, sched = T.make(kind, rank, world)
        shardckpt.save({"model": model, "optim": opt}, f"{root}/{kind}-fresh")
        assert not opt.state
    return out


def _load(rank, world, root, into):
    out = {}
    for kind in KINDS:
        target = into or kind
        model, opt, sched = T.make(target, rank, world, seed=4)
        if kind == "fsdp1":
            T.train(model, opt, sched, 40, 1, target, rank, world)  # a stepped live optimizer too
        state = {"model": model, "optim": opt, "sched": sched, "step": 0}
        shardckpt.load(state, f"{root}/{kind}")
        assert state["step"] == 2
        out[kind] = (T.full_params(model), T.full_optim(model, opt), T.train(model, opt, sched, 2, 2, target, rank, world))
        # the unstepped checkpoint empties a stepped optimizer
        shardckpt.load({"model": model, "optim": opt}, f"{root}/{kind}-fresh")
        assert not opt.state, (kind, target)
    return out


def test_fsdp1_save2_load_fsdp1_2_and_fsdp2_3(tmp_path):
    saved = run_ranks(2, _save, str(tmp_path))[0]
    m = shardckpt.inspect(str(tmp_path / "fsdp1"))
    assert m.tensors["model.blocks.0.up.weight"].layout == {"sharded_tensor": True}
    assert "optim.state.blocks.0.up.weight.exp_avg" in m.tensors
    same = run_ranks(2, _load, str(tmp_path), None)[0]
    cross = run_ranks(3, _load, str(tmp_path), "fsdp2")[0]
    for kind in KINDS:
        params, optim, (losses, lrs) = saved[kind]
        for got, exact in ((same[kind], True), (cross[kind], False)):
            gparams, goptim, (glosses, glrs) = got
            assert params.keys() == gparams.keys()
            for k in params:
                assert torch.equal(params[k], gparams[k]), (kind, k)
            assert optim.keys() == goptim.keys()
            for k in optim:
                if isinstance(optim[k], torch.Tensor):
                    assert torch.equal(optim[k], goptim[k]), (kind, k)
                else:
                    assert optim[k] == goptim[k], (kind, k)
            if exact:
                assert glosses == losses
            else:
                torch.testing.assert_close(torch.tensor(glosses), torch.tensor(losses), rtol=1e-5, atol=1e-5)
            assert glrs == lrs
