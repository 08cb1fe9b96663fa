"""bf16 Hub weights into FSDP2 fp32 masters (MixedPrecisionPolicy) on 2 gloo ranks, issue 10 part 1."""

from __future__ import annotations

import torch
from _dist import run_ranks
from test_transformers import assert_bits_equal, full_state, make_model

import shardckpt
from shardckpt.errors import StateMismatchError


def _load_bf16(rank, world, hf):
    from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard

    model = make_model("llama", seed=2)
    mp = MixedPrecisionPolicy(param_dtype=torch.bfloat16, reduce_dtype=torch.float32)
    for layer in model.model.layers:
        fully_shard(layer, mp_policy=mp)
    fully_shard(model, mp_policy=mp)
    before = full_state(model)
    try:
        shardckpt.load({"model": model}, hf, cast=False)
        refused = None
    except StateMismatchError as e:
        refused = str(e)
    unchanged = all(torch.equal(v, before[k]) for k, v in full_state(model).items())
    res = shardckpt.load({"model": model}, hf)
    dtypes = {n: p.to_local().dtype for n, p in model.named_parameters()}
    return res, refused, unchanged, dtypes, full_state(model)


def test_bf16_hf_dir_into_fsdp2_fp32_masters(tmp_path):
    src = make_model("llama", seed=1).to(torch.bfloat16)
    hf = str(tmp_path / "hf")
    src.save_pretrained(hf, max_shard_size="20KB")
    want = full_state(src)
    for res, refused, unchanged, dtypes, state in run_ranks(2, _load_bf16, hf):
        assert res == ([], [])
        assert refused is not None and "checkpoint dtype BF16, live dtype F32 (cast=False" in refused and unchanged
        assert set(dtypes.values()) == {torch.float32}  # fp32 masters stay fp32
        for k, v in want.items():
            assert_bits_equal(state[k], v.float(), k)  # exactly bf16.float()
