"""The memory tier (issue 24), simulated on CPU: 4 gloo ranks as 2 "nodes", each node's shared memory a directory.

One first run (module fixture) trains 7 steps with FSDP2, saving to memory
every step and to storage at step 5, then dies without closing. Each test
copies what it left and restarts from it: node 1 lost (at 4 ranks and at 2),
a flipped byte in one memory copy, both copies of a file lost.
"""

import logging
import os
import shutil

import _training as T
import pytest
import torch
from _damage import data_file, flip_last_byte
from _dist import run_ranks

import shardckpt
from shardckpt._storage._local import LocalStorage

KIND = "fsdp2"
STEPS, STORAGE_EVERY, MORE = 7, 5, 2


def _mgr(base, rank, ranks_per_node=2, root=None):
    # The memory copy belongs to its root (issue 28): a restart uses the first run's root, whatever copy of the nodes.
    node = os.path.join(base, f"node{rank // ranks_per_node}")
    return shardckpt.CheckpointManager(root or os.path.join(base, "root"), memory=shardckpt.MemoryTier(dir=node, ranks_per_node=ranks_per_node))


def _state(model, opt, sched, step):
    return {"model": model, "optim": opt, "sched": sched, "step": step}


def _first(rank, world, base):
    model, opt, sched = T.make(KIND, rank, world)
    mgr = _mgr(base, rank)
    params = {}
    for step in range(1, STEPS + 1):
        T.train(model, opt, sched, step - 1, 1, KIND, rank, world)
        state = _state(model, opt, sched, step)
        assert mgr.save_to_memory(step, state)
        if step % STORAGE_EVERY == 0:
            mgr.save(step, state)
        params[step] = T.full_params(model)
    mgr.wait()  # the last step's background part (checksums, peer copy) done: held
    saved = dict(mgr._memory.last_save)
    losses, _ = T.train(model, opt, sched, STEPS, MORE, KIND, rank, world)
    # No close(): the run dies here; its memory directories stay.
    return {"params": {s: params[s] for s in (STORAGE_EVERY, STEPS)}, "losses": losses, "saved": saved}


class _Counted:
    """Tensor bytes read from the storage root (data files), counted at the storage class."""

    def __init__(self, root):
        self.root, self.bytes = root, 0

    def __enter__(self):
        self.ranges, self.read = LocalStorage._read_ranges, LocalStorage._read
        counter = self

        def read_ranges(st, rel, ranges):
            if st.path(rel).startswith(counter.root) and rel.endswith(".safetensors"):
                counter.bytes += sum(len(b) for _, b in ranges)
            return counter.ranges(st, rel, ranges)

        def read(st, path, start, end):
            out = counter.read(st, path, start, end)
            if path.startswith(counter.root) and path.endswith(".safetensors"):
                counter.bytes += len(out)
            return out

        LocalStorage._read_ranges, LocalStorage._read = read_ranges, read
        return self

    def __exit__(self, *exc):
        LocalStorage._read_ranges, LocalStorage._read = self.ranges, self.read


class _Logs(logging.Handler):
    def __init__(self):
        super().__init__(logging.INFO)
        self.lines = []

    def emit(self, record):
        self.lines.append(record.getMessage())


def _restart(rank, world, base, ranks_per_node, root):
    model, opt, sched = T.make(KIND, rank, world, seed=99)
    mgr = _mgr(base, rank, ranks_per_node, root)
    state = _state(model, opt, sched, 0)
    logs = _Logs()
    logging.getLogger("shardckpt").addHandler(logs)
    try:
        with _Counted(root) as counted:
            step = mgr.restore(state)
    finally:
        logging.getLogger("shardckpt").removeHandler(logs)
    params = T.full_params(model)
    losses, _ = T.train(model, opt, sched, step, MORE, KIND, rank, world)
    return {
        "step": step, "state_step": state["step"], "from": mgr.restored_from, "storage_bytes": counted.bytes,
        "params": params, "losses": losses, "logs": logs.lines, "stats": dict(mgr._memory.last_restore),
    }


@pytest.fixture(scope="module")
def first(tmp_path_factory):
    base = str(tmp_path_factory.mktemp("memtier"))
    out = run_ranks(4, _first, base)
    return base, out


def _copy(first, tmp_path):
    """A copy of the first run's node directories (restarts damage them); the storage root stays (restores only read it)."""
    base, out = first
    dst = str(tmp_path / "run")
    for node in ("node0", "node1"):
        shutil.copytree(os.path.join(base, node), os.path.join(dst, node))
    return dst, out


def _root(first):
    return os.path.join(first[0], "root")


def _same(a, b):
    return sorted(a) == sorted(b) and all(torch.equal(a[k], b[k]) for k in a)


def test_first_run_keeps_a_peer_copy(first):
    base, out = first
    # Each node holds its own ranks' files and the other node's: every rank sent as many bytes as it wrote.
    assert all(o["saved"]["step"] == STEPS and o["saved"]["peer_bytes_sent"] > o["saved"]["own_bytes"] > 0 for o in out)
    for node in ("node0", "node1"):
        assert sorted(n for n in os.listdir(os.path.join(base, node)) if n.startswith("step-")) == [f"step-{STEPS:08d}"]  # older steps freed
    a = set(os.listdir(os.path.join(base, "node0", f"step-{STEPS:08d}", "data")))
    assert a == set(os.listdir(os.path.join(base, "node1", f"step-{STEPS:08d}", "data")))


@pytest.mark.parametrize("world", [4, 2])
def test_node_lost_restores_from_survivors_memory(first, tmp_path, world):
    base, ref = _copy(first, tmp_path)
    shutil.rmtree(os.path.join(base, "node1"))  # node 1's processes killed and its memory gone
    out = run_ranks(world, _restart, base, 2, _root(first))
    for o in out:
        assert o["step"] == STEPS and o["state_step"] == STEPS and o["from"] == f"memory:{STEPS}"
        assert o["storage_bytes"] == 0  # no tensor byte read from storage
        assert _same(o["params"], ref[0]["params"][STEPS])  # bit-exact to the last in-memory step
    if world == 4:
        assert [o["losses"] for o in out] == [r["losses"] for r in ref]  # training continues identically
        # The replacement ranks receive their shard; the survivors read theirs
        # in their node's memory (and share replicated tensors, read once).
        assert out[2]["stats"]["peer_bytes"] > 0 and out[3]["stats"]["peer_bytes"] > 0
        assert out[0]["stats"]["peer_bytes"] < out[2]["stats"]["peer_bytes"]
    else:
        torch.testing.assert_close(out[0]["losses"], ref[0]["losses"], rtol=1e-5, atol=1e-6)
        # The survivors' node holds everything: nothing but replicated ranges (read once) crosses.
        assert all(o["stats"]["peer_bytes"] < o["stats"]["needed_bytes"] // 2 for o in out)


def test_flipped_byte_falls_back_to_the_other_holder(first, tmp_path):
    base, ref = _copy(first, tmp_path)
    flip_last_byte(data_file(os.path.join(base, "node0"), STEPS, 0))
    out = run_ranks(4, _restart, base, 2, _root(first))
    for o in out:
        assert o["step"] == STEPS and o["storage_bytes"] == 0
        assert _same(o["params"], ref[0]["params"][STEPS])
    said = [line for o in out for line in o["logs"] if "damaged" in line]
    assert said and any("node0" in line and "reading it from" in line and "node1" in line for line in said)
    # Every rank learns which copy is damaged (the stream runs again without it).
    assert all(any("node0" in d and "r00000-00.safetensors" in d for d in o["stats"]["damaged"]) for o in out)


def test_both_copies_lost_restores_the_last_storage_step(first, tmp_path):
    base, ref = _copy(first, tmp_path)
    shutil.rmtree(os.path.join(base, "node1"))
    flip_last_byte(data_file(os.path.join(base, "node0"), STEPS, 2))  # rank 2's only copy left
    out = run_ranks(4, _restart, base, 2, _root(first))
    for o in out:
        assert o["step"] == STORAGE_EVERY and o["from"].endswith(f"step-{STORAGE_EVERY:08d}")
        assert _same(o["params"], ref[0]["params"][STORAGE_EVERY])
    assert any("restoring from storage" in line for o in out for line in o["logs"])
    # Node 0 only sent that file (rank 2 loads it): rank 2 checked it on arrival and named node 0's copy.
    said = [line for o in out for line in o["logs"] if "damaged" in line]
    assert said and all("node0" in line and "r00002-00.safetensors" in line for line in said), said


def _sends(rank, world, base):
    from shardckpt._memory.transfer import run_sends

    src, dst = os.path.join(base, f"src{rank}"), os.path.join(base, f"dst{rank}")
    os.makedirs(src)
    files = {"a": bytes(range(10)), "b": b"", "c": bytes(range(100, 125)), "d": b"xyz"}
    for name, data in files.items():
        with open(os.path.join(src, name), "wb") as f:
            f.write(data)
    # Several files between one pair, both ways, an empty one, and a missing source (zeros arrive).
    os.remove(os.path.join(src, "d"))
    sends = [(0, 1, "a"), (1, 0, "c"), (0, 1, "b"), (2, 3, "c"), (0, 1, "c"), (3, 1, "d")]
    got, sent, recv = run_sends(
        sends, me=rank, group_ranks=list(range(world)), group=None, sizes={k: len(v) for k, v in files.items()},
        src_path=lambda f: os.path.join(src, f), dst_path=lambda f: os.path.join(dst, f), piece_bytes=4,
    )
    return {g: open(os.path.join(dst, g), "rb").read() for g in got}, sent, recv


def test_transfers_in_pieces_both_ways(tmp_path):
    out = run_ranks(4, _sends, str(tmp_path))
    assert out[1][0] == {"a": bytes(range(10)), "b": b"", "c": bytes(range(100, 125)), "d": b"\0\0\0"}
    assert out[0][0] == {"c": bytes(range(100, 125))} and out[3][0] == {"c": bytes(range(100, 125))}
    assert out[0][1] == 10 + 25 and out[1][2] == 10 + 25 + 3


def test_damaged_index_copy_is_fetched_from_the_other_node(first, tmp_path):
    base, ref = _copy(first, tmp_path)
    d = os.path.join(base, "node0", f"step-{STEPS:08d}", "data")
    index = os.path.join(d, next(f for f in sorted(os.listdir(d)) if f.endswith("-index-r00000.json")))
    flip_last_byte(index)
    out = run_ranks(4, _restart, base, 2, _root(first))
    for o in out:
        assert o["step"] == STEPS and o["from"] == f"memory:{STEPS}" and o["storage_bytes"] == 0
        assert _same(o["params"], ref[0]["params"][STEPS])
    said = [line for o in out[:2] for line in o["logs"] if "this node's copy of" in line and "index-r00000" in line]
    assert len(said) == 2  # both ranks of node 0 found it, and fetched it from node 1
    assert out[0]["stats"]["meta_bytes"] == os.path.getsize(index) and out[2]["stats"]["meta_bytes"] == 0
