"""16 real processes: FSDP2 save at 8 ranks -> load (and save again) at 16 -> load at 2, every tensor bit-exact."""

import pytest
import torch
from _dist import run_ranks
from models import build, full_state, shard_fsdp2

import shardckpt


def _save8(rank, world, path):
    model = shard_fsdp2(build(seed=1))
    shardckpt.save({"model": model, "step": 8}, path)
    return full_state(model)


def _load_save16(rank, world, src, dst):
    model = shard_fsdp2(build(seed=2))
    state = {"model": model, "step": 0}
    shardckpt.load(state, src)
    shardckpt.save({"model": model, "step": state["step"] + 8}, dst)
    return full_state(model), state["step"]


def _load2(rank, world, path):
    model = shard_fsdp2(build(seed=3))
    state = {"model": model, "step": 0}
    shardckpt.load(state, path)
    return full_state(model), state["step"]


@pytest.mark.exclusive
@pytest.mark.slow
def test_save8_load16_save16_load2_bit_exact(tmp_path):
    a, b = str(tmp_path / "at8"), str(tmp_path / "at16")
    saved = run_ranks(8, _save8, a, timeout=600, fresh=True)[0]
    got16 = run_ranks(16, _load_save16, a, b, timeout=900, fresh=True)
    got2 = run_ranks(2, _load2, b, timeout=600)
    for got, _ in got16 + got2:
        assert saved.keys() == got.keys()
        for k in saved:
            assert torch.equal(saved[k], got[k]), k
    assert {s for _, s in got16} == {8} and {s for _, s in got2} == {16}
    shardckpt.verify(b)  # every byte of the 16-rank save checks (raises otherwise)
