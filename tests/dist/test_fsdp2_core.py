"""FSDP2 model saved on 2 ranks, loaded bit-exactly on 1-4 ranks, after a forward."""

import pytest
import torch

import shardckpt
from _dist import run_ranks
from models import build, full_state, shard_fsdp2

IDX = torch.tensor([[1, 5, 36, 0], [7, 7, 2, 30]])


def _save(rank, world, path):
    model = shard_fsdp2(build(seed=1))
    shardckpt.save({"model": model, "step": 11}, path)
    return full_state(model)


def _load(rank, world, path):
    model = shard_fsdp2(build(seed=2))
    # Forward BEFORE the load: FSDP2 has built its all-gather buffers, so a
    # loader that swaps Parameters would leave the next forward on old weights.
    model(IDX).sum().backward()
    before = {id(p) for p in model.parameters()}
    state = {"model": model, "step": 0}
    shardckpt.load(state, path)
    assert {id(p) for p in model.parameters()} == before
    out = model(IDX).detach()
    return full_state(model), state["step"], out


@pytest.mark.parametrize("load_world", [1, 2, 3, 4])
def test_fsdp2_save2_load_n(tmp_path, load_world):
    path = str(tmp_path / "ckpt")
    saved = run_ranks(2, _save, path)[0]
    ref = build(seed=1)
    ref_out = ref(IDX).detach()
    if load_world == 1:
        model = build(seed=3)
        state = {"model": model, "step": 0}
        shardckpt.load(state, path)
        got, step, out = full_state(model), state["step"], model(IDX).detach()
    else:
        got, step, out = run_ranks(load_world, _load, path)[0]
    assert step == 11
    assert saved.keys() == got.keys()
    for k in saved:
        assert torch.equal(saved[k], got[k]), k
    torch.testing.assert_close(out, ref_out, rtol=0, atol=0)
