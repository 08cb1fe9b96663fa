"""Fault matrix, a second CheckpointManager on the same root racing a save (real processes, real files).

Two processes each run ``manager.save`` loops with retention (``keep_last=2``) on one root, steps going
forward (one saves odd steps, the other even ones), while a third loops ``restore()``. One manager per
root is what is supported: the other writer is detected on the next save (steps appear that this
manager did not save) and refused with ``ConcurrentUseError``; retention is skipped meanwhile. Here a
refused saver starts over with a new manager (as a blindly restarted job would), so the two keep
racing, retention and leftover removal included, for every save. What
must hold whatever the interleaving: no committed step with missing or wrong bytes, ``restore()``
always returns a whole step (bit-exact), nothing but our exception types escapes, and nothing hangs.
The table of results is in docs/reliability.md ("Fault matrix").
"""

from __future__ import annotations

import json
import os
import time

import torch
from _faultkids import finish, result, start

#: Saves each manager attempts after the lockstep first round.
FREE_SAVES = 10
#: Bound of one child, and of each wait for the other manager's first round.
CHILD_TIMEOUT_S = 240


def _state(step: int):
    g = torch.Generator().manual_seed(step)
    return {"w": torch.randn(32, 17, generator=g), "ids": torch.arange(50) * step, "step": step, "cfg": {"z": step, "a": -step}}


def _blank():
    return {"w": torch.zeros(32, 17), "ids": torch.zeros(50, dtype=torch.int64), "step": -1, "cfg": {}}


def _same(got, step: int) -> bool:
    want = _state(step)
    return (
        torch.equal(got["w"], want["w"])
        and torch.equal(got["ids"], want["ids"])
        and got["step"] == step
        and list(got["cfg"].items()) == list(want["cfg"].items())
    )


def _wait_for(path: str) -> None:
    deadline = time.monotonic() + CHILD_TIMEOUT_S
    while not os.path.exists(path):
        if time.monotonic() > deadline:
            raise TimeoutError(f"{path} never appeared")
        time.sleep(0.02)


def _child_saver(root: str, sync: str, me: int) -> None:
    """Saver ``me`` (0: odd steps, 1: even steps): one save, a lockstep barrier with the other, then free-running saves."""
    import shardckpt
    from shardckpt.errors import CheckpointError, ConcurrentUseError

    mgr = shardckpt.CheckpointManager(root, keep_last=2)
    out = {"saved": [], "refused": [], "failed": [], "escaped": []}
    steps = [2 * i + 1 + me for i in range(FREE_SAVES + 1)]
    for n, step in enumerate(steps):
        try:
            mgr.save(step, _state(step))
            out["saved"].append(step)
        except ConcurrentUseError as e:
            out["refused"].append(f"{step}: {e}")
            # A job that ignores the refusal and starts over (a new manager takes the
            # root as a restarted run does): the race goes on, now with retention.
            mgr = shardckpt.CheckpointManager(root, keep_last=2)
        except CheckpointError as e:
            out["failed"].append(f"{step}: {type(e).__name__}: {e}")
        except BaseException as e:  # anything else is a defect
            out["escaped"].append(f"{step}: {type(e).__name__}: {e}")
        if n == 0:
            # Both have made their first save before either makes its second: the second
            # save of one of them must find a step of the other (see the test).
            open(f"{sync}.{me}", "w").close()
            _wait_for(f"{sync}.{1 - me}")
    print("RESULT " + json.dumps(out), flush=True)


def _child_restorer(root: str, stop: str) -> None:
    import shardckpt
    from shardckpt.errors import CheckpointError

    mgr = shardckpt.CheckpointManager(root)
    out = {"restored": [], "wrong": [], "errors": [], "escaped": []}
    deadline = time.monotonic() + CHILD_TIMEOUT_S
    while not os.path.exists(stop) and time.monotonic() < deadline:
        got = _blank()
        try:
            step = mgr.restore(got)
        except CheckpointError as e:
            out["errors"].append(f"{type(e).__name__}: {e}")
            continue
        except BaseException as e:
            out["escaped"].append(f"{type(e).__name__}: {e}")
            continue
        if step is None:
            continue
        (out["restored"] if _same(got, step) else out["wrong"]).append(step)
    print("RESULT " + json.dumps(out), flush=True)


def _finish(p, what: str):
    rc, out = finish(p, CHILD_TIMEOUT_S + 60, what)
    res = result(out)
    assert rc == 0 and res is not None, f"{what}: exit {rc}\n{out}"
    return res


def test_a_second_manager_racing_saves_is_refused_and_no_step_is_damaged(tmp_path):
    import shardckpt

    root = str(tmp_path / "run")
    os.makedirs(root)
    stop = str(tmp_path / "stop")
    restorer = start(_child_restorer, root, stop)
    savers = [start(_child_saver, root, str(tmp_path / "round1"), me) for me in (0, 1)]
    try:
        results = [_finish(p, f"saver {me}") for me, p in enumerate(savers)]
    finally:
        open(stop, "w").close()
    restored = _finish(restorer, "restorer")

    for me, r in enumerate(results):
        assert not r["escaped"], (me, r["escaped"])
    # Supported: one manager per root. The second writer is found on the next save and refused.
    refused = [x for r in results for x in r["refused"]]
    assert refused, results
    assert all("by another writer" in x and "Two managers must not save under one root" in x for x in refused), refused
    # Every attempt ended as saved, refused or failed with our error; saves kept committing.
    for r in results:
        assert len(r["saved"]) + len(r["refused"]) + len(r["failed"]) == FREE_SAVES + 1, r
        assert r["saved"], r

    # restore() only ever returned whole steps, exactly as saved.
    assert not restored["escaped"] and not restored["wrong"], restored
    assert not restored["errors"], restored["errors"][:3]
    assert restored["restored"], restored

    # Every committed step is whole: verifies, and restores bit-exact.
    mgr = shardckpt.CheckpointManager(root)
    committed = mgr.steps()
    saved = {s for r in results for s in r["saved"]}
    # A save may end unsure (its directory moved aside by the other's leftover
    # removal and not back within the wait): it says so, and keeps its files.
    unsure = {int(x.split(":")[0]) for r in results for x in r["failed"] if "cannot tell whether" in x}
    assert committed and set(committed) <= saved | unsure, (committed, results)
    for s in committed:
        shardckpt.verify(mgr.step_url(s))
        got = _blank()
        assert mgr.restore(got, step=s) == s and _same(got, s), s
    # Nothing saved was lost: the newest saved step is committed (retention never deletes the newest).
    assert max(committed) == max(saved), (committed, saved)
    print("saved", [r["saved"] for r in results], "refused", len(refused), "committed", committed,
          "restores", len(restored["restored"]))
