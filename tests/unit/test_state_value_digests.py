"""Digests of plain values (pure): where two ranks' trees differ."""

from shardckpt._state.ranks import DIGEST_FANOUT, differing_paths, value_digests


def test_identical_trees_in_other_key_orders_agree():
    a = value_digests({"x": {"p": 1, "q": [1, 2]}, "y": 2})
    b = value_digests({"y": 2, "x": {"q": [1, 2], "p": 1}})
    assert differing_paths([a, b]) == []


def test_the_deepest_differing_paths_are_named():
    a = value_digests({"loader": {"epoch": 1, "pos": {"i": 5}}, "step": 3})
    b = value_digests({"loader": {"epoch": 1, "pos": {"i": 6}}, "step": 3})
    assert differing_paths([a, b]) == ["loader.pos.i"]


def test_keys_present_on_one_rank_only_are_named():
    a = value_digests({"dl": {"dp_rank_0": {"n": 1}}})
    b = value_digests({"dl": {"dp_rank_1": {"n": 1}}})
    assert differing_paths([a, b]) == ["dl.dp_rank_0", "dl.dp_rank_1"]


def test_lists_and_wide_dicts_are_digested_whole():
    wide = {str(i): i for i in range(DIGEST_FANOUT + 1)}
    a = value_digests({"w": wide, "l": [1, {"a": 1}]})
    b = value_digests({"w": dict(wide, **{"0": -1}), "l": [1, {"a": 2}]})
    assert differing_paths([a, b]) == ["l", "w"]
    assert differing_paths([a]) == [] and differing_paths([a, None]) == []
