"""The memory tier's pure decisions, with ints and strings: peer mapping, step choice, source assignment."""

import pytest

from shardckpt._memory import MemoryTier
from shardckpt._memory import plan as P
from shardckpt.errors import UsageError


def test_default_peer_is_the_same_local_rank_on_the_next_node():
    assert P.peer_map(8, 4) == {0: 4, 1: 5, 2: 6, 3: 7, 4: 0, 5: 1, 6: 2, 7: 3}
    assert P.peer_map(6, 2) == {0: 2, 1: 3, 2: 4, 3: 5, 4: 0, 5: 1}  # a ring over 3 nodes
    assert P.peer_map(2, 2) == {0: None, 1: None}  # one node: nobody to copy to
    assert P.senders_to(0, P.peer_map(6, 2)) == [4]


def test_custom_peers_override_and_are_checked():
    assert P.peer_map(4, 2, {0: 3, 1: 1}) == {0: 3, 1: None, 2: 0, 3: 1}
    with pytest.raises(ValueError, match="peer of rank 0 is 9"):
        P.peer_map(4, 2, {0: 9})


def test_files_by_writer_reads_the_rank_from_the_name():
    files = ["manifest.json", "data/abc-r00000-00.safetensors", "data/abc-r00003-01.safetensors", "data/abc-index-r00003.json"]
    got = P.files_by_writer(files, {"data/abc-index-r00003.json": 3})
    assert got == {0: ["data/abc-r00000-00.safetensors", "manifest.json"], 3: ["data/abc-index-r00003.json", "data/abc-r00003-01.safetensors"]}


NEED = {"m": 1, "a": 4, "b": 4}


def test_choose_step_needs_the_union_of_live_nodes():
    n0 = {7: ("s7", NEED, {"m", "a"}), 5: ("s5", NEED, set(NEED))}
    n1 = {7: ("s7", NEED, {"m", "b"})}
    assert P.choose_step([n0, n1], storage_step=5) == (7, "s7")
    assert P.choose_step([n0], storage_step=5) == (5, "s5")  # 7 incomplete; 5 is as new as storage: memory is cheaper
    assert P.choose_step([n0], storage_step=6) is None  # storage is newer
    assert P.choose_step([n0, n1], storage_step=None) == (7, "s7")
    assert P.choose_step([{}, {}], storage_step=None) is None


def test_choose_step_keeps_saves_apart():
    # Two saves of step 7 (a re-run): their files never complete each other.
    assert P.choose_step([{7: ("x", NEED, {"m", "a"})}, {7: ("y", NEED, {"m", "b"})}], None) is None


def test_assign_sources_skips_own_node_and_bad_copies_and_spreads_work():
    node_of = {0: "n0", 1: "n0", 2: "n1", 3: "n1", 4: "n2"}
    holders = {"a": [0, 1, 4], "b": [0, 1, 4], "c": [2, 3]}
    sizes = {"a": 10, "b": 10, "c": 1}
    sends, missing = P.assign_sources({2: ["a", "b"], 0: ["c"]}, holders, node_of, sizes)
    assert sends == [(2, 0, "c"), (0, 2, "a"), (1, 2, "b")] and missing == {}
    # n0's copy of "a" is damaged: n2 sends it; nobody left for "c" once n1's copy is bad.
    sends, missing = P.assign_sources({2: ["a"], 0: ["c"]}, holders, node_of, sizes, bad=[("n0", "a"), ("n1", "c")])
    assert sends == [(4, 2, "a")] and missing == {0: ["c"]}
    # A rank never fetches from its own node (that copy is the one it lacks).
    assert P.assign_sources({1: ["a"]}, {"a": [0]}, node_of, sizes) == ([], {1: ["a"]})


def test_memory_tier_options_are_checked():
    assert MemoryTier.of(True) == MemoryTier()
    assert MemoryTier.of("/dev/shm/x").dir == "/dev/shm/x"
    assert MemoryTier.of({"max_bytes": 5}).max_bytes == 5
    with pytest.raises(UsageError, match="max_bytes"):
        MemoryTier(max_bytes=-1)
    with pytest.raises(UsageError, match="options are"):
        MemoryTier.of({"size": 1})
    with pytest.raises(UsageError, match="not a memory tier"):
        MemoryTier.of(3)
    assert MemoryTier().resolved_dir("s3://b/run").startswith("/dev/shm/shardckpt-")


def test_holders_of_names_every_node_holding_a_file_of_one_save():
    need = {"m": 10, "i0": 5, "d0": 40, "d2": 40}
    node0 = {7: ("s7", need, {"m", "i0", "d0"})}  # ranks 0-1: one node's disk
    node1 = {7: ("s7", need, {"m", "d2"})}  # ranks 2-3: the other's (no index file, no d0)
    other = {7: ("old", {"m": 9, "d9": 1}, {"m", "d9"})}  # another save of the step: counts for nothing
    inv = [node0, node0, node1, node1, other, {}]
    assert P.choose_step(inv, None) == (7, "s7")
    holders, sizes = P.holders_of(inv, 7, "s7")
    assert holders == {"d0": [0, 1], "i0": [0, 1], "m": [0, 1, 2, 3], "d2": [2, 3]}
    assert sizes == need
    # Node 1 gone: d2 is held nowhere, so the step is not whole (the caller falls back).
    assert P.choose_step([node0, node0], None) is None
    assert "d2" not in P.holders_of([node0, node0], 7, "s7")[0]
