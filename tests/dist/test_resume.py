"""Resume equivalence: 2K steps straight == K steps, save, fresh processes, load, K more.

Same world size: per-step losses, learning rates, final weights and every
rank's RNG stream are bit-identical (training adds per-rank random noise, so
a lost RNG state shows in the losses). Another world size: the data are the
same global batches, so losses agree to reduction order; per-rank state
(RNG, a loader position) takes its documented resize path.
"""

import pytest
import torch

import shardckpt
import _training as T
from _dist import run_ranks
from shardckpt.errors import StateMismatchError

K = 3


def _seed(rank):
    torch.manual_seed(1000 + rank)


def _loader(rank, steps, dp_world):
    return {"position": steps * (T.ROWS // dp_world), "epoch": 0, "rank": rank}


def _remap(saved, rank, world):
    # every saved rank consumed the same number of samples of its slice
    total = sum(s["position"] for s in saved)
    return {"position": total // world, "epoch": saved[0]["epoch"], "rank": rank}


def _state(model, opt, sched, loader, rng, step):
    return {"model": model, "optim": opt, "sched": sched, "rng": rng, "loader": shardckpt.PerRank(loader, on_resize=_remap), "step": step}


def _straight(rank, world, kind, noise):
    model, opt, sched = T.make(kind, rank, world)
    _seed(rank)
    losses, lrs = T.train(model, opt, sched, 0, 2 * K, kind, rank, world, noise=noise)
    return losses, lrs, T.full_params(model), torch.rand(4)


def _first(rank, world, kind, noise, path):
    model, opt, sched = T.make(kind, rank, world)
    _seed(rank)
    losses, lrs = T.train(model, opt, sched, 0, K, kind, rank, world, noise=noise)
    dp_rank, dp_world = T.dp_coords(kind, rank, world)
    loader = _loader(rank, K, dp_world)
    shardckpt.save(_state(model, opt, sched, loader, shardckpt.RNGState(), K), path)
    return losses, lrs


def _resume(rank, world, kind, noise, path, saved_world):
    model, opt, sched = T.make(kind, rank, world, seed=77)
    torch.manual_seed(555 + rank)
    loader = {"position": -1, "epoch": -1, "rank": -1}
    if world != saved_world:
        # The default refuses to split or merge per-rank RNG streams, before
        # anything is loaded.
        before = T.full_params(model)
        with pytest.raises(StateMismatchError, match=r"saved by %d ranks but this load runs on %d" % (saved_world, world)):
            shardckpt.load(_state(model, opt, sched, loader, shardckpt.RNGState(), 0), path)
        after = T.full_params(model)
        assert all(torch.equal(before[k], after[k]) for k in before) and loader["position"] == -1
        rng = shardckpt.RNGState(on_resize="skip")
    else:
        rng = shardckpt.RNGState()
    state = _state(model, opt, sched, loader, rng, 0)
    assert shardckpt.load(state, path) == ([], [])
    assert state["step"] == K
    losses, lrs = T.train(model, opt, sched, K, K, kind, rank, world, noise=noise)
    return losses, lrs, T.full_params(model), torch.rand(4), dict(loader)


def _compare(straight, first, resumed, exact):
    s_losses, s_lrs, s_params, _ = straight
    f_losses, f_lrs = first
    r_losses, r_lrs, r_params = resumed[:3]
    assert f_lrs + r_lrs == s_lrs  # the scheduler continues exactly
    if exact:
        assert f_losses + r_losses == s_losses
        for k in s_params:
            assert torch.equal(r_params[k], s_params[k]), k
    else:
        torch.testing.assert_close(torch.tensor(f_losses + r_losses), torch.tensor(s_losses), rtol=1e-5, atol=1e-5)
        for k in s_params:
            if s_params[k].is_floating_point():
                torch.testing.assert_close(r_params[k], s_params[k], rtol=1e-4, atol=1e-5)
            else:
                assert torch.equal(r_params[k], s_params[k]), k


@pytest.mark.parametrize("kind", ["fsdp2", pytest.param("fsdp2_bf16", marks=pytest.mark.slow), pytest.param("ddp", marks=pytest.mark.slow)])
def test_resume_same_world_is_bit_exact(tmp_path, kind):
    path = str(tmp_path / "ckpt")
    straight = run_ranks(2, _straight, kind, 0.5)
    first = run_ranks(2, _first, kind, 0.5, path)[0]
    resumed = run_ranks(2, _resume, kind, 0.5, path, 2, fresh=True)
    _compare(straight[0], first, resumed[0], exact=True)
    for r in range(2):
        # each rank's RNG stream continues where it was, and differs from the other's
        assert torch.equal(resumed[r][3], straight[r][3]), r
        assert resumed[r][4] == _loader(r, K, 2)
    assert not torch.equal(straight[0][3], straight[1][3])
    m = shardckpt.inspect(path)
    for r in range(2):
        # per-rank tensors are written by their own rank, under their rank's name
        assert {c.file.split("-r")[1][:5] for c in m.tensors[f"rng.@rank{r}.torch"].chunks} == {f"{r:05d}"}


CHANGES = [
    ("fsdp2", 2, 3, "fsdp2"),
    pytest.param("fsdp2", 3, 1, "plain", marks=pytest.mark.slow),
    pytest.param("fsdp2", 4, 2, "fsdp2", marks=pytest.mark.slow),
    pytest.param("hsdp", 4, 2, "fsdp2", marks=pytest.mark.slow),
]


@pytest.mark.parametrize("kind,save_world,load_world,load_kind", CHANGES)
def test_resume_other_world_size(tmp_path, kind, save_world, load_world, load_kind):
    path = str(tmp_path / "ckpt")
    straight = run_ranks(save_world, _straight, kind, 0.0)[0]
    first = run_ranks(save_world, _first, kind, 0.0, path)[0]
    if load_world == 1:
        resumed = [_resume(0, 1, load_kind, 0.0, path, save_world)]
    else:
        resumed = run_ranks(load_world, _resume, load_kind, 0.0, path, save_world, fresh=True)
    _compare(straight, first, resumed[0], exact=False)
    total = save_world * K * (T.ROWS // save_world)
    for r, res in enumerate(resumed):
        assert res[4] == {"position": total // load_world, "epoch": 0, "rank": r}  # the documented remap
