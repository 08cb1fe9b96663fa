"""The pure parts of one restore: whose step it is (``_managed.identity``) and the order of sources (``_managed.restore``).

The real sources run in tests/dist/test_tiers_identity_dist.py and the tier
tests; here ``restore_from``'s order and fall-through are driven by sources
that report fixed steps, the way ``choose_step`` is tested with inventories.
"""

from __future__ import annotations

import os

from shardckpt._managed import identity
from shardckpt._managed.restore import restore_from, source_order


def test_stamp_and_foreign_compare_normalized_roots_and_runs(tmp_path):
    root = str(tmp_path / "remote")
    extra = identity.stamp(5, root=root + "/", run="r1")
    assert extra == {"step": 5, "root": os.path.realpath(root), "run": "r1"}
    assert identity.foreign(extra, root=root) is None
    assert identity.foreign(extra, root="file://" + root, run="r1") is None
    assert identity.foreign(extra, root=root, run=None) is None  # the run not known yet: the root decides
    assert "run r1" in identity.foreign(extra, root=root, run="r2")
    assert repr(os.path.realpath(root)) in identity.foreign(extra, root=str(tmp_path / "other"))
    assert "records no root" in identity.foreign({"step": 5}, root=root)
    assert "records no root" in identity.foreign(None, root=root)
    assert identity.whose({"root": 3, "run": ["x"]}) == (None, None)  # not strings: recorded nothing


def test_inherit_keeps_the_first_known_run_else_draws_a_new_one():
    assert identity.inherit("a", "b") == "a"
    assert identity.inherit(None, "b") == "b"
    one, two = identity.inherit(None, None), identity.inherit()
    assert one != two and len(one) == 16 and int(one, 16) >= 0


def test_source_order_newest_first_ties_to_the_faster():
    assert source_order([4, None, 5, 4]) == [2, 0, 3]
    assert source_order([None, None]) == []
    assert source_order([3, 3, 3]) == [0, 1, 2]


class _Fixed:
    """A source holding one step whose load succeeds or not (``ok``), recording the calls."""

    def __init__(self, name, step, ok, calls):
        self.name, self.step, self.ok, self.calls = name, step, ok, calls

    def newest(self, step):
        self.calls.append(("newest", self.name))
        if step is not None:
            return step if step == self.step else None
        return self.step

    def load(self, state, step, *, exact):
        self.calls.append(("load", self.name, step, exact))
        if not self.ok:
            return None
        state["from"] = self.name
        return step, f"{self.name}:{step}"


def test_restore_from_asks_durable_first_loads_newest_and_falls_through():
    calls, seen = [], []
    sources = [_Fixed("memory", 7, False, calls), _Fixed("local", 7, True, calls), _Fixed("remote", 6, True, calls)]
    state = {}
    got = restore_from(sources, state, None, probed=seen.append)
    assert got == (7, "local:7") and state == {"from": "local"}
    assert calls[:3] == [("newest", "remote"), ("newest", "local"), ("newest", "memory")]
    assert seen == [[7, 7, 6]]
    assert calls[3:] == [("load", "memory", 7, False), ("load", "local", 7, False)]


def test_restore_from_given_step_and_nothing_anywhere():
    calls = []
    sources = [_Fixed("local", 3, True, calls), _Fixed("remote", 5, True, calls)]
    assert restore_from(sources, {}, 3) == (3, "local:3")
    assert restore_from(sources, {}, 4) is None
    assert restore_from([_Fixed("remote", None, True, calls)], {}, None) is None


def _st(v: float):
    import torch

    return {"w": torch.full((4,), v)}


def test_two_live_runs_on_one_local_directory_are_refused_not_mixed(tmp_path):
    import pytest
    import torch

    import shardckpt
    from shardckpt.errors import ConcurrentUseError

    local = str(tmp_path / "nvme")
    a = shardckpt.CheckpointManager(str(tmp_path / "remoteA"), local=local, keep_local=1)
    b = shardckpt.CheckpointManager(str(tmp_path / "remoteB"), local=local, keep_local=1)
    try:
        a.save(1, _st(1.0))
        b.save(10, _st(10.0))
        b.save(11, _st(11.0))
        b.wait()  # flushed: retention after the next save protects only that one
        b.save(12, _st(12.0))
        b.wait()
        # B's retention (keep_local=1) planned over B's steps only: A's step stays, committed.
        assert b.steps() == [1, 12]
        with pytest.raises(ConcurrentUseError):  # A is refused, not mixed with B's steps
            a.save(2, _st(2.0))
        st = _st(0.0)
        assert a.restore(st) == 1 and torch.equal(st["w"], _st(1.0)["w"])  # each restores its own step
        assert b.restore(st) == 12 and torch.equal(st["w"], _st(12.0)["w"])
    finally:
        a.close()
        b.close()
