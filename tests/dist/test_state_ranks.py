"""State that differs between ranks, on real gloo ranks: per-rank plain values are never silently
dropped, and collectives inside state_dict()/load_state_dict() run in one order on every rank."""

from __future__ import annotations

import os

import torch
from _dist import run_ranks

import shardckpt


def _torchtitan_like(rank, world, root):
    """A data loader state keyed by ``dp_rank_<r>``, as torchtitan's: it differs on every rank."""
    out = {}
    url = os.path.join(root, "plain")
    state = {"w": torch.arange(6.0), "step": 3, "dataloader": {f"dp_rank_{rank}": {"position": 100 + rank}}}
    # A rank-union save: each rank's own key is kept, none is dropped.
    shardckpt.save(state, url)
    out["committed"] = os.path.exists(os.path.join(url, "manifest.json"))
    live = {"w": torch.zeros(6), "step": 0, "dataloader": {f"dp_rank_{rank}": {"position": -1}}}
    shardckpt.load(live, url)
    out["union"] = (live["dataloader"], live["step"])

    # Values that differ under the same key are refused the same way.
    same_key = {"w": torch.arange(6.0), "loader": {"epoch": 1, "position": 100 + rank}}
    try:
        shardckpt.save(same_key, os.path.join(root, "same_key"))
    except shardckpt.errors.UnsupportedStateError as e:
        out["same_key"] = str(e)

    # Wrapped in PerRank, each rank keeps its own copy.
    url = os.path.join(root, "per_rank")
    loader = {f"dp_rank_{rank}": {"position": 100 + rank}}
    shardckpt.save({"w": torch.arange(6.0), "step": 3, "dataloader": shardckpt.PerRank(loader)}, url)
    live = {f"dp_rank_{rank}": {"position": -1}}
    state = {"w": torch.zeros(6), "step": 0, "dataloader": shardckpt.PerRank(live)}
    shardckpt.load(state, url)
    out["resumed"] = (live, state["step"], state["w"].tolist())
    return out


def test_per_rank_plain_values_are_kept_or_refused_never_dropped(tmp_path):
    results = run_ranks(2, _torchtitan_like, str(tmp_path))
    for rank, out in enumerate(results):
        assert out["committed"], rank
        # A plain dict loads whole: every rank's key comes back, its own with its own position.
        assert out["union"] == ({"dp_rank_0": {"position": 100}, "dp_rank_1": {"position": 101}}, 3), out["union"]
        assert "loader.position" in out["same_key"] and "loader.epoch" not in out["same_key"], out["same_key"]
        assert out["resumed"] == ({f"dp_rank_{rank}": {"position": 100 + rank}}, 3, list(range(6))), rank
    assert results[0]["same_key"] == results[1]["same_key"]  # the same error on every rank


class _Collective:
    """A stateful object whose state_dict() and load_state_dict() run an all_reduce (as FSDP1's do)."""

    def __init__(self, tag: float):
        self.tag = tag
        self.loaded = None
        self.saved_sum = None

    def state_dict(self):
        import torch.distributed as dist

        t = torch.tensor([self.tag])
        dist.all_reduce(t)
        self.saved_sum = t.item()
        return {"tag": self.tag}

    def load_state_dict(self, sd):
        import torch.distributed as dist

        t = torch.tensor([sd["tag"]])
        dist.all_reduce(t)  # paired with a peer's other object's call if the orders differed
        self.loaded = t.item()


def _orders(rank, world, root):
    url = os.path.join(root, "ckpt")
    a, b = _Collective(1.0), _Collective(100.0)
    # Insertion orders differ by rank, at the top level and nested.
    if rank == 0:
        state = {"a": a, "b": b, "nested": {"x": torch.ones(2), "c": _Collective(10000.0)}}
    else:
        state = {"nested": {"c": _Collective(10000.0), "x": torch.ones(2)}, "b": b, "a": a}
    shardckpt.save(state, url, collective_timeout_s=60)
    saved = (a.saved_sum, b.saved_sum, state["nested"]["c"].saved_sum)
    shardckpt.load(state, url, collective_timeout_s=60)
    return saved, (a.loaded, b.loaded, state["nested"]["c"].loaded), list(state), list(state["nested"])


def test_collective_state_dict_calls_run_in_one_order_on_every_rank(tmp_path):
    # Bounded: run_ranks fails the test after its timeout instead of hanging.
    results = run_ranks(2, _orders, str(tmp_path), timeout=120)
    for rank, (saved, loaded, _top, _nested) in enumerate(results):
        assert saved == (2.0, 200.0, 20000.0), (rank, saved)
        assert loaded == (2.0, 200.0, 20000.0), (rank, loaded)
    # The user's dicts keep their own order.
    assert results[0][2] == ["a", "b", "nested"] and results[1][2] == ["nested", "b", "a"]
    assert results[0][3] == ["x", "c"] and results[1][3] == ["c", "x"]
