"""DDP: replicated state is written once (bytes = model bytes), names carry no ``module.``, loads into FSDP2."""

import torch

import shardckpt
import _training as T
from _dist import run_ranks


def _save(rank, world, root):
    model, opt, sched = T.make("ddp", rank, world)
    T.train(model, opt, sched, 0, 2, "ddp", rank, world)
    shardckpt.save({"model": model}, f"{root}/model")
    shardckpt.save({"model": model, "optim": opt, "sched": sched}, f"{root}/full")
    nbytes = sum(t.numel() * t.element_size() for t in model.module.state_dict().values())
    return nbytes, T.full_params(model), T.full_optim(model, opt), T.train(model, opt, sched, 2, 2, "ddp", rank, world)


def _load(rank, world, root, kind):
    model, opt, sched = T.make(kind, rank, world, seed=6)
    shardckpt.load({"model": model, "optim": opt, "sched": sched}, f"{root}/full")
    return T.full_params(model), T.full_optim(model, opt), T.train(model, opt, sched, 2, 2, kind, rank, world)


def _files_bytes(path):
    m = shardckpt.inspect(path)
    return sum(f.size for f in m.files.values()), m


def test_ddp_stored_once_and_loads_into_ddp_and_fsdp2(tmp_path):
    nbytes, params, optim, (losses, lrs) = run_ranks(2, _save, str(tmp_path))[0]
    on_disk, m = _files_bytes(str(tmp_path / "model"))
    assert m.total_bytes == nbytes
    # headers (JSON, a few hundred bytes a tensor) are the only overhead
    assert nbytes <= on_disk <= nbytes + 400 * len(m.tensors)
    assert all(len(t.chunks) == 1 for t in m.tensors.values())
    assert "model.emb.weight" in m.tensors and not [n for n in m.tensors if ".module." in n or n.startswith("model.module")]
    # the two ranks share the writing
    assert len({c.file.split("-r")[1][:5] for t in m.tensors.values() for c in t.chunks}) == 2

    for kind, world in (("ddp", 2), ("fsdp2", 3)):
        gp, go, (gl, glr) = run_ranks(world, _load, str(tmp_path), kind)[0]
        for k in params:
            assert torch.equal(params[k], gp[k]), (kind, k)
        for k in optim:
            assert (torch.equal(optim[k], go[k]) if isinstance(optim[k], torch.Tensor) else optim[k] == go[k]), (kind, k)
        if kind == "ddp":
            assert gl == losses
        else:
            torch.testing.assert_close(torch.tensor(gl), torch.tensor(losses), rtol=1e-5, atol=1e-5)
        assert glr == lrs
