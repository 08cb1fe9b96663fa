"""Tensor parallel, HSDP (replicate x shard), FSDP2 + TP on a 2x2 mesh, reshard_after_forward=2.

TP on 2 ranks reloads into TP and into one plain process. The 4-rank runtimes
are saved and reloaded in place (same world), FSDP2 + TP also into one plain
process; HSDP's replicate dim is written once.
"""

import torch

import shardckpt
import _training as T
from _dist import run_ranks


def _tp(rank, world, root):
    model, opt, sched = T.make("tp", rank, world)
    T.train(model, opt, sched, 0, 2, "tp", rank, world)
    shardckpt.save({"model": model, "optim": opt, "sched": sched}, f"{root}/tp")
    saved = (T.full_params(model), T.full_optim(model, opt), T.train(model, opt, sched, 2, 2, "tp", rank, world))
    model, opt, sched = T.make("tp", rank, world, seed=9)
    shardckpt.load({"model": model, "optim": opt, "sched": sched}, f"{root}/tp")
    loaded = (T.full_params(model), T.full_optim(model, opt), T.train(model, opt, sched, 2, 2, "tp", rank, world))
    return saved, loaded


def _plain_load(root, name, hidden):
    model, opt, sched = T.make("plain", 0, 1, seed=9, hidden=hidden)
    shardckpt.load({"model": model, "optim": opt, "sched": sched}, f"{root}/{name}")
    return T.full_params(model), T.full_optim(model, opt), T.train(model, opt, sched, 2, 2, "plain", 0, 1)


def _same(a, b, exact=True):
    (p, o, (l, lr)), (gp, go, (gl, glr)) = a, b
    assert p.keys() == gp.keys() and o.keys() == go.keys()
    for k in p:
        assert torch.equal(p[k], gp[k]), k
    for k in o:
        assert (torch.equal(o[k], go[k]) if isinstance(o[k], torch.Tensor) else o[k] == go[k]), k
    if exact:
        assert gl == l
    else:
        torch.testing.assert_close(torch.tensor(gl), torch.tensor(l), rtol=1e-5, atol=1e-5)
    assert glr == lr


def test_tp_save2_load_tp2_and_plain(tmp_path):
    saved, loaded = run_ranks(2, _tp, str(tmp_path))[0]
    _same(saved, loaded)
    m = shardckpt.inspect(str(tmp_path / "tp"))
    assert m.tensors["model.head.weight"].layout["placements"] == ["S(0)"]  # 37 rows over 2: uneven
    assert len(m.tensors["model.emb.weight"].chunks) == 1  # replicated over TP: written once
    _same(saved, _plain_load(str(tmp_path), "tp", 14), exact=False)


def _four(rank, world, root):
    out = {}
    for kind in ("hsdp", "fsdp2_tp", "fsdp2_raf2"):
        model, opt, sched = T.make(kind, rank, world)
        T.train(model, opt, sched, 0, 2, kind, rank, world)
        if kind == "hsdp":
            shardckpt.save({"model": model}, f"{root}/hsdp-model")
            out["hsdp_bytes"] = sum(t.numel() * t.element_size() for t in T.full_params(model).values())
        shardckpt.save({"model": model, "optim": opt, "sched": sched}, f"{root}/{kind}")
        saved = (T.full_params(model), T.full_optim(model, opt), T.train(model, opt, sched, 2, 2, kind, rank, world))
        model, opt, sched = T.make(kind, rank, world, seed=9)
        T.train(model, opt, sched, 40, 1, kind, rank, world)
        shardckpt.load({"model": model, "optim": opt, "sched": sched}, f"{root}/{kind}")
        out[kind] = (saved, (T.full_params(model), T.full_optim(model, opt), T.train(model, opt, sched, 2, 2, kind, rank, world)))
    return out


def test_hsdp_fsdp2_tp_and_reshard_int_on_4(tmp_path):
    out = run_ranks(4, _four, str(tmp_path))[0]
    for kind in ("hsdp", "fsdp2_tp", "fsdp2_raf2"):
        _same(*out[kind])
    m = shardckpt.inspect(str(tmp_path / "hsdp-model"))
    assert m.tensors["model.emb.weight"].layout["placements"] == ["R", "S(0)"]
    on_disk = sum(f.size for f in m.files.values())
    assert m.total_bytes == out["hsdp_bytes"]
    assert out["hsdp_bytes"] <= on_disk <= out["hsdp_bytes"] + 400 * sum(len(t.chunks) for t in m.tensors.values())
    # both replicas write (balanced), each box once
    writers = {c.file.split("-r")[1][:5] for t in m.tensors.values() for c in t.chunks}
    assert len(writers) == 4
    m = shardckpt.inspect(str(tmp_path / "fsdp2_tp"))
    assert m.tensors["model.blocks.0.up.weight"].layout["placements"] == ["S(0,sf=2)", "S(0)"]
    assert m.tensors["model.emb.weight"].layout["mesh_dim_names"] == ["dp"]  # FSDP only, replicated over tp
    _same(out["fsdp2_tp"][0], _plain_load(str(tmp_path), "fsdp2_tp", 14), exact=False)
