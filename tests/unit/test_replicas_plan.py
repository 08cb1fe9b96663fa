"""The read-once plan: pure ints, no processes (shardckpt/_replicas.py)."""

from __future__ import annotations

import random

import pytest

from shardckpt._replicas import Shared, plan_shared, round_layout


def _keys(n, size=100, file="f"):
    return [(file, 0, i * size, (i + 1) * size) for i in range(n)]


def test_every_shared_range_has_exactly_one_reader_among_its_holders():
    a, b = _keys(10), _keys(10, file="g")
    p = plan_shared([a + b, a, b, a + b], round_bytes=1 << 20)
    seen = {}
    for r in p.rounds:
        for s in r:
            assert s.key not in seen
            seen[s.key] = s
            assert s.reader in s.holders
    assert set(seen) == set(a + b)
    assert all(seen[k].holders == (0, 1, 3) for k in a)
    assert all(seen[k].holders == (0, 2, 3) for k in b)


def test_ranges_one_rank_wants_are_not_shared():
    p = plan_shared([_keys(3), _keys(3, file="h")], round_bytes=1 << 20)
    assert p.rounds == [] and p.read_bytes == [0, 0]


def test_balanced_by_bytes_and_contiguous_per_reader():
    rng = random.Random(1)
    keys, at = [], 0
    for _ in range(200):
        n = rng.randrange(1, 5000)
        keys.append(("f", 0, at, at + n))
        at += n
    for replicas in (2, 3, 4):
        p = plan_shared([keys] * replicas, round_bytes=1 << 30)
        assert max(p.read_bytes) - min(p.read_bytes) <= 2 * 5000
        # each reader's ranges form one contiguous span of the file
        for r in range(replicas):
            mine = sorted(s.key for rr in p.rounds for s in rr if s.reader == r)
            assert all(x[3] == y[2] for x, y in zip(mine, mine[1:]))


def test_identical_on_every_rank_whatever_the_order_each_rank_lists_its_keys():
    keys = _keys(50)
    shuffled = keys[:]
    random.Random(2).shuffle(shuffled)
    assert plan_shared([keys, keys], round_bytes=1000) == plan_shared([shuffled, keys[::-1]], round_bytes=1000)


def test_rounds_bound_what_a_rank_reads_plus_receives():
    p = plan_shared([_keys(100)] * 4, round_bytes=1000)
    for r in p.rounds:
        for me in range(4):
            _, size = round_layout(r, me)
            # 64-byte alignment per range: 100 bytes -> 128
            assert size <= 1000 * 128 // 100 + 4 * 128
    assert sum(len(r) for r in p.rounds) == 100
    assert len(p.rounds) >= 100 * 100 // 1000


def test_every_holder_lays_out_a_group_alike():
    rnd = [Shared(("f", 0, 0, 10), 1, (0, 1, 2)), Shared(("f", 0, 10, 30), 1, (0, 1, 2)), Shared(("f", 0, 30, 31), 0, (0, 2))]
    views = {me: round_layout(rnd, me)[0] for me in range(3)}
    g1 = {me: [g for g in gs if g.reader == 1][0] for me, gs in views.items()}
    sizes = {g.stop - g.start for g in g1.values()}
    assert len(sizes) == 1
    assert {g.tag for g in g1.values()} == {g1[0].tag}
    assert [g.reader for g in views[1]] == [1]  # rank 1 holds nothing of rank 0's group


def test_with_readers_a_range_whose_holder_cannot_read_it_is_sent_by_a_rank_that_can():
    # The memory tier after losing node 1 (ranks 2, 3): files "f2"/"f3" are held only by node 0 (ranks 0, 1).
    f2, f3 = _keys(4, file="f2"), _keys(4, file="f3")
    readers = {"f2": [0, 1], "f3": [0, 1], "f0": [0, 1]}
    p = plan_shared([[], [], f2, f3], round_bytes=1 << 20, readers=readers)
    got = {s.key: s for r in p.rounds for s in r}
    assert set(got) == set(f2 + f3)
    assert all(got[k].holders == (2,) for k in f2) and all(got[k].holders == (3,) for k in f3)
    assert all(got[k].reader in (0, 1) for k in got)
    assert p.read_bytes[0] == p.read_bytes[1] == 400  # the senders share the work by bytes
    # The sender lays out what it sends exactly as its receiver does: one message per group.
    for rnd in p.rounds:
        for me in (0, 1):
            for g in round_layout(rnd, me)[0]:
                if g.reader == me:
                    theirs = [h for h in round_layout(rnd, g.holders[0])[0] if h.reader == me]
                    assert [(t.stop - t.start) for t in theirs] == [g.stop - g.start]


def test_with_readers_a_rank_that_can_read_its_range_reads_it_itself():
    a = _keys(3, file="f0")
    # One wanter that can read it: nothing to plan. Two wanters, one can read: it reads for both.
    assert plan_shared([a, []], round_bytes=1 << 20, readers={"f0": [0]}).rounds == []
    p = plan_shared([a, a], round_bytes=1 << 20, readers={"f0": [1]})
    assert {s.reader for r in p.rounds for s in r} == {1}
    with pytest.raises(ValueError, match="no rank can read 'f0'"):
        plan_shared([[], a], round_bytes=1 << 20, readers={"f0": []})
