"""Misuse of the collective rule, on real gloo ranks: a missing rank is named within
``collective_timeout_s``; ``no_dist=True`` works from one rank; agree() raises the
same error everywhere; torchrun without a process group is refused."""

from __future__ import annotations

import os
import subprocess
import sys
import textwrap
import time

import pytest
import torch

import shardckpt
from _dist import run_ranks
from models import build, full_state, shard_fsdp2

TIMEOUT_S = 3.0


def _alone(rank, world, root, op, who):
    """Rank ``who`` calls ``op`` alone; the others wait on the training group until it is done."""
    import torch.distributed as dist

    out = {"type": None, "msg": None, "seconds": None}
    url = os.path.join(root, "ckpt")
    if op == "load" and rank == 0:
        shardckpt.save({"w": torch.arange(4.0)}, os.path.join(root, "src"), no_dist=True)
    dist.barrier()
    if rank == who:
        t0 = time.perf_counter()
        try:
            if op == "save":
                shardckpt.save({"w": torch.ones(3)}, url, collective_timeout_s=TIMEOUT_S)
            elif op == "async_save":
                shardckpt.async_save({"w": torch.ones(3)}, url, collective_timeout_s=TIMEOUT_S).result()
            elif op == "load":
                shardckpt.load({"w": torch.zeros(4)}, os.path.join(root, "src"), collective_timeout_s=TIMEOUT_S)
            elif op == "manager":
                shardckpt.CheckpointManager(root, collective_timeout_s=TIMEOUT_S).save(1, {"w": torch.ones(3)})
        except Exception as e:  # noqa: BLE001 - the test looks at what was raised
            out.update(type=type(e).__name__, msg=str(e))
        out["seconds"] = time.perf_counter() - t0
    dist.barrier()
    out["committed"] = os.path.exists(os.path.join(url, "manifest.json"))
    return out


@pytest.mark.parametrize(
    "op,who,error",
    [
        ("save", 0, "SaveFailedError"),
        ("save", 1, "SaveFailedError"),  # rank 0 (the one that commits) is the missing one
        ("async_save", 0, "SaveFailedError"),
        ("load", 0, "LoadFailedError"),
        ("manager", 0, "SaveFailedError"),
    ],
)
def test_a_rank_that_never_calls_is_named(tmp_path, op, who, error):
    # fresh: the missing rank's exchanges are out of step afterwards, as after
    # any collective timeout; those processes are not reused.
    res = run_ranks(2, _alone, str(tmp_path), op, who, timeout=120, fresh=True)
    out = res[who]
    missing = 1 - who
    assert out["type"] == error, out
    assert f"rank {missing} of 2 did not reach" in out["msg"], out["msg"]
    assert "every rank of the process group must call" in out["msg"] and "no_dist=True" in out["msg"], out["msg"]
    assert f"collective_timeout_s={TIMEOUT_S:g}" in out["msg"], out["msg"]
    assert not any(r["committed"] for r in res)


def _late_rank(rank, world, root):
    """Rank 0 saves alone and gives up; rank 1 comes late and gets the same error."""
    import torch.distributed as dist

    url = os.path.join(root, "ckpt")
    msgs = {}
    if rank == 0:
        try:
            shardckpt.save({"w": torch.ones(3)}, url, collective_timeout_s=TIMEOUT_S)
        except shardckpt.SaveFailedError as e:
            msgs["first"] = str(e)
    dist.barrier()
    if rank == 1:
        try:
            shardckpt.save({"w": torch.ones(3)}, url, collective_timeout_s=TIMEOUT_S)
        except shardckpt.SaveFailedError as e:
            msgs["first"] = str(e)
    dist.barrier()
    # In step again: the next save works on both ranks.
    shardckpt.save({"w": torch.full((3,), float(rank))}, url, collective_timeout_s=30)
    state = {"w": torch.zeros(3)}
    shardckpt.load(state, url, collective_timeout_s=30)
    msgs["after"] = state["w"].tolist()
    return msgs


def test_a_late_rank_raises_the_same_error_and_the_group_recovers(tmp_path):
    res = run_ranks(2, _late_rank, str(tmp_path), timeout=120, fresh=True)
    assert res[0]["first"] == res[1]["first"], res
    assert "rank 1 of 2 did not reach shardckpt.save" in res[0]["first"]
    # plain tensors are replicated, written once (by rank 0's balancing or rank 1's): all equal on load
    assert res[0]["after"] == res[1]["after"]


def _agree_cases(rank, world):
    from shardckpt._collective import FROM_ROOT, TO_ROOT, agree, open_comm
    from shardckpt.errors import SaveFailedError, StateMismatchError

    out = {}
    comm = open_comm(None, op="demo", collective_timeout_s=30)

    def fail_on(r, exc):
        def fn():
            if rank == r:
                raise exc
            return rank

        return fn

    for name, fn in [
        ("ours", fail_on(1, StateMismatchError("w: shape [2] vs [3]"))),
        ("foreign", fail_on(0, KeyError("boom"))),
    ]:
        try:
            agree(comm, fn, what="demo step")
            out[name] = None
        except Exception as e:  # noqa: BLE001
            out[name] = (type(e).__name__, str(e), type(e.__cause__).__name__ if e.__cause__ else None)
    _, out["all"] = agree(comm, lambda: rank * 10, what="x", share=lambda v: v + 1)
    _, out["to_root"] = agree(comm, lambda: rank, what="x", share=lambda v: f"r{v}", mode=TO_ROOT)
    _, out["from_root"] = agree(comm, lambda: rank, what="x", share=lambda v: f"r{v}", mode=FROM_ROOT)

    def both_fail():
        raise SaveFailedError(f"disk {rank} full")

    try:
        agree(comm, both_fail, what="write")
    except SaveFailedError as e:
        out["both"] = str(e)
    return out


def test_agree_raises_the_same_type_and_message_on_every_rank():
    res = run_ranks(2, _agree_cases)
    assert res[0]["ours"][:2] == res[1]["ours"][:2] == ("StateMismatchError", "demo step: rank 1: w: shape [2] vs [3]")
    assert res[1]["ours"][2] == "StateMismatchError" and res[0]["ours"][2] is None  # the cause stays where it happened
    assert res[0]["foreign"][:2] == res[1]["foreign"][:2] == ("SaveFailedError", "demo step: rank 0: KeyError: 'boom'")
    assert res[0]["all"] == res[1]["all"] == [1, 11]
    assert res[0]["to_root"] == ["r0", "r1"] and res[1]["to_root"] is None
    assert res[0]["from_root"] == res[1]["from_root"] == "r0"
    assert res[0]["both"] == res[1]["both"] == "write: rank 0: disk 0 full; rank 1: disk 1 full"


def _no_dist(rank, world, root):
    import torch.distributed as dist

    out = {}
    sharded = shard_fsdp2(build(seed=4))
    plain = build(seed=4)
    url = os.path.join(root, "export")
    if rank == 0:
        # rank 0 alone: an evaluation/export copy, while rank 1 does nothing
        shardckpt.save({"model": plain, "step": 3}, url, no_dist=True)
        fresh = build(seed=5)
        state = {"model": fresh, "step": 0}
        shardckpt.load(state, url, no_dist=True)
        out["reload_ok"] = state["step"] == 3 and all(
            torch.equal(v, plain.state_dict()[k]) for k, v in fresh.state_dict().items()
        )
        for what, call in [
            ("save", lambda: shardckpt.save({"model": sharded}, os.path.join(root, "x"), no_dist=True)),
            ("load", lambda: shardckpt.load({"model": sharded}, url, no_dist=True)),
        ]:
            try:
                call()
                out[what] = None
            except shardckpt.UnsupportedStateError as e:
                out[what] = str(e)
        out["world"] = shardckpt.inspect(url).world_size
    dist.barrier()
    # the collective path still works for everyone afterwards
    shardckpt.load({"model": sharded}, url, collective_timeout_s=30)
    out["collective_ok"] = all(torch.equal(v, plain.state_dict()[k]) for k, v in full_state(sharded).items())
    return out


def test_no_dist_from_one_rank_of_a_job(tmp_path):
    res = run_ranks(2, _no_dist, str(tmp_path))
    r0 = res[0]
    assert r0["reload_ok"] and r0["world"] == 1
    for what in ("save", "load"):
        assert r0[what] and "sharded over ranks [0, 1]" in r0[what] and "no_dist=True" in r0[what], r0[what]
    assert all(r["collective_ok"] for r in res)


_TORCHRUN = textwrap.dedent(
    """
    import sys, tempfile, torch, shardckpt
    d = tempfile.mkdtemp()
    calls = {
        "save": lambda: shardckpt.save({"w": torch.ones(2)}, d),
        "load": lambda: shardckpt.load({"w": torch.ones(2)}, d),
        "async_save": lambda: shardckpt.async_save({"w": torch.ones(2)}, d).result(),
        "manager.save": lambda: shardckpt.CheckpointManager(d).save(1, {"w": torch.ones(2)}),
        "manager.restore": lambda: shardckpt.CheckpointManager(d).restore({"w": torch.ones(2)}),
    }
    for name, call in calls.items():
        try:
            call()
            print(name, "NO ERROR")
        except shardckpt.UsageError as e:
            print(name, "|", e)
    shardckpt.save({"w": torch.ones(2)}, d, no_dist=True)
    s = {"w": torch.zeros(2)}
    shardckpt.load(s, d, no_dist=True)
    print("no_dist", s["w"].tolist())
    """
)


def test_torchrun_without_a_process_group_is_refused():
    env = dict(os.environ, WORLD_SIZE="2", RANK="1", LOCAL_RANK="1", MASTER_ADDR="127.0.0.1", MASTER_PORT="29999")
    out = subprocess.run([sys.executable, "-c", _TORCHRUN], env=env, capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr
    lines = out.stdout.strip().splitlines()
    assert len(lines) == 6, out.stdout
    for line in lines[:5]:
        assert "|" in line, line
        assert "WORLD_SIZE=2" in line and "init_process_group()" in line, line
        # save/load take no_dist=True; the manager does not, so it must not suggest it.
        assert ("no_dist=True" in line) != line.startswith("manager"), line
    assert lines[5] == "no_dist [1.0, 1.0]"
