"""The memory tier's first save does not stall the step (issue 44): its slots are made after ``restore``.

``CheckpointManager.restore`` starts the tier's warm-up: the slot files for
the state's shard (both slots, own and peer) are reserved and mapped (and,
for CUDA sources, pinned) in the background thread, so the first and second
``save_to_memory`` allocate nothing in the training thread. Counted, not
timed: every slot file made (``_ShmFile``) and every reservation
(``reserve``) is recorded with the thread that made it. 4 gloo ranks as 2
"nodes": a fresh run (nothing to restore, the optimizer not stepped yet when
``restore`` runs), then a restart after node 1 is lost (restored from
memory, then saving on).
"""

import os
import shutil
import threading

import _training as T
from _dist import run_ranks

import shardckpt
from shardckpt._memory import snapshot

KIND = "fsdp2"


def _mgr(base, rank, rpn=2):
    return shardckpt.CheckpointManager(
        os.path.join(base, "root"), memory=shardckpt.MemoryTier(dir=os.path.join(base, f"node{rank // rpn}"), ranks_per_node=rpn)
    )


def _state(model, opt, sched, step):
    return {"model": model, "optim": opt, "sched": sched, "step": step}


class _Allocations:
    """Records, per thread kind, each slot file made and each space reservation."""

    def __init__(self):
        self.made = {"main": 0, "background": 0}
        self.reserved = {"main": 0, "background": 0}

    def __enter__(self):
        self.real_file, self.real_reserve = snapshot._ShmFile.__init__, snapshot.reserve
        rec = self

        def where():
            return "main" if threading.current_thread() is threading.main_thread() else "background"

        def made(obj, *a, **kw):
            rec.made[where()] += 1
            rec.real_file(obj, *a, **kw)

        def reserved(*a, **kw):
            rec.reserved[where()] += 1
            rec.real_reserve(*a, **kw)

        snapshot._ShmFile.__init__ = made
        snapshot.reserve = reserved
        return self

    def __exit__(self, *exc):
        snapshot._ShmFile.__init__, snapshot.reserve = self.real_file, self.real_reserve

    def main(self):
        return self.made["main"] + self.reserved["main"]


def _run(rank, world, base, restart):
    model, opt, sched = T.make(KIND, rank, world, seed=3 if restart else 0)
    if restart:
        T.train(model, opt, sched, 0, 1, KIND, rank, world)  # other values, to be replaced by the restore
    mgr = _mgr(base, rank)
    out = {}
    with _Allocations() as rec:
        got = mgr.restore(_state(model, opt, sched, 0))
        out["restored"] = (got, mgr.restored_from)
        first = 10 if restart else 0
        in_saves = []
        for k in (1, 2, 3):
            T.train(model, opt, sched, first + k - 1, first + k, KIND, rank, world)
            before = rec.main()
            assert mgr.save_to_memory(first + k, _state(model, opt, sched, first + k))
            in_saves.append(rec.main() - before)
        mgr.wait()
    out["in_saves"] = in_saves
    out["made"], out["reserved"] = dict(rec.made), dict(rec.reserved)
    out["held"] = mgr._memory.last_save["step"]
    out["host_bytes"] = mgr._memory.snapshots.host_bytes()
    out["bound"] = snapshot.host_bytes_bound(mgr._memory.last_save["own_bytes"], mgr._memory.last_save.get("peer_bytes_received", 0))
    return out


def _check(out, restored, held):
    for o in out:
        assert o["restored"] == restored
        assert o["in_saves"] == [0, 0, 0]  # no slot made or reserved inside any save_to_memory call
        assert o["made"]["main"] == 0 and o["reserved"]["main"] == 0
        assert o["made"]["background"] >= 2 and o["reserved"]["background"] == o["made"]["background"]  # both slots
        assert o["held"] == held and 0 < o["host_bytes"] <= o["bound"]
    assert any(o["made"]["background"] >= 4 for o in out)  # ranks with a peer's copy: peer slots made early too


def test_the_first_saves_allocate_nothing_in_the_training_thread(tmp_path):
    base = str(tmp_path)
    _check(run_ranks(4, _run, base, False), (None, None), 3)
    shutil.rmtree(os.path.join(base, "node1"))  # node 1 lost: its replacement restores from node 0's copies
    _check(run_ranks(4, _run, base, True), (3, "memory:3"), 13)


def _save_before_the_first_step(rank, world, base):
    model, opt, sched = T.make(KIND, rank, world, seed=0)
    mgr = _mgr(base, rank, rpn=1)
    assert mgr.restore(_state(model, opt, sched, 0)) is None
    held = mgr.save_to_memory(1, _state(model, opt, sched, 1))  # the optimizer has not stepped: no AdamW state yet
    mgr.wait()
    return {"held": held, "step": (mgr._memory.last_save or {}).get("step")}


def _restore_it(rank, world, base):
    model, opt, sched = T.make(KIND, rank, world, seed=3)
    mgr = _mgr(base, rank, rpn=1)
    return (mgr.restore(_state(model, opt, sched, 0)), mgr.restored_from)


def test_a_save_before_the_first_optimizer_step_is_held(tmp_path):
    """A save_to_memory before the optimizer's first step is a real save (the warm-up waits for that step; the save does not)."""
    base = str(tmp_path)
    assert all(o == {"held": True, "step": 1} for o in run_ranks(2, _save_before_the_first_step, base))
    assert run_ranks(2, _restore_it, base) == [(1, "memory:1")] * 2
