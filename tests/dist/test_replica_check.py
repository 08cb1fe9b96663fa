"""Diverged replicas are caught at save time (DDP, HSDP 2x2, TP's replicated tensors), with real gloo ranks.

One replica's tensor is moved by one ulp on one rank: ``replicas="check"``
(the default) refuses the save on every rank before any byte is written,
naming the tensor, the chunk and which ranks hold which version, and the
previous checkpoint at the URL stays as it was; ``"warn"`` commits and logs;
identical replicas report nothing.
"""

from __future__ import annotations

import logging
import os

import pytest
import torch

import _training as T
import shardckpt
from _dist import run_ranks


def _local(t):
    return t.to_local() if hasattr(t, "to_local") else t


def _nudge(model, name):
    """Move the first element of ``name``'s local copy by one ulp (in place, as corruption would)."""
    p = dict(model.named_parameters())[name]
    with torch.no_grad():
        loc = _local(p)
        flat = loc.view(-1)
        flat[0] = torch.nextafter(flat[0], torch.tensor(float("inf"), dtype=flat.dtype))


def _capture():
    records = []

    class H(logging.Handler):
        def emit(self, record):
            records.append(record.getMessage())

    h = H(level=logging.WARNING)
    logging.getLogger("shardckpt").addHandler(h)
    return records, h


def _default_warns(rank, world, root):
    model, _, _ = T.make("ddp", rank, world)
    if rank == 1:
        _nudge(model, "module.head.weight")
    records, h = _capture()
    try:
        shardckpt.save({"model": model}, f"{root}/ck")  # the default: warn, and save
    finally:
        logging.getLogger("shardckpt").removeHandler(h)
    return [r for r in records if "replicas differ" in r], os.path.exists(f"{root}/ck/manifest.json")


def test_the_default_warns_and_saves(tmp_path):
    res = run_ranks(2, _default_warns, str(tmp_path))
    assert res[0][1] and res[1][1]
    assert len(res[0][0]) == 1 and "model.head.weight" in res[0][0][0] and "rank 1 holds version" in res[0][0][0], res[0][0]
    assert res[1][0] == []  # rank 0 logs it, once


def _diverge(rank, world, root, kind, victim, param, mode):
    model, opt, sched = T.make(kind, rank, world)
    T.train(model, opt, sched, 0, 1, kind, rank, world)
    url = f"{root}/ck"
    shardckpt.save({"model": model}, url)  # identical replicas: nothing to report
    before = {n: _local(p).detach().clone() for n, p in model.named_parameters()}
    if rank == victim:
        _nudge(model, param)
    records, h = _capture()
    try:
        shardckpt.save({"model": model}, url, overwrite=True, replicas=mode)
        outcome = ("saved", None)
    except shardckpt.CheckpointError as e:
        outcome = (type(e).__name__, str(e))
    finally:
        logging.getLogger("shardckpt").removeHandler(h)
    # What is on disk now, loaded into a fresh model.
    fresh, _, _ = T.make(kind, rank, world, seed=9)
    shardckpt.load({"model": fresh}, url)
    on_disk = {n: _local(p).detach().clone() for n, p in fresh.named_parameters()}
    same_as_before = all(torch.equal(on_disk[n], before[n]) for n in before if n != param or rank != victim)
    return outcome, records, same_as_before, sorted(os.listdir(f"{url}/data"))


def test_ddp_one_ulp_refused_on_every_rank_nothing_written(tmp_path):
    name = "module.blocks.0.up.weight"
    res = run_ranks(2, _diverge, str(tmp_path), "ddp", 1, name, "check")
    files_before = None
    for rank, (outcome, _records, same, files) in enumerate(res):
        kind, text = outcome
        assert kind == "ReplicaDivergenceError", (rank, outcome)
        assert "model.blocks.0.up.weight chunk [0:" in text, text
        assert "rank 0 holds version A, rank 1 holds version B" in text or "rank 1 holds version A, rank 0 holds version B" in text, text
        assert "nothing" in text or "before any byte was written" in text, text
        assert same, rank  # the checkpoint on disk is the first save's
        files_before = files_before or files
        assert files == files_before  # no data file of the refused save was left
    # Only the diverged tensor is named.
    assert res[0][0][1].count(" chunk [") == 1, res[0][0][1]


def test_ddp_warn_commits_and_logs(tmp_path):
    name = "module.blocks.0.up.weight"
    res = run_ranks(2, _diverge, str(tmp_path), "ddp", 1, name, "warn")
    for rank, (outcome, records, _same, _files) in enumerate(res):
        assert outcome == ("saved", None), outcome
        logged = [r for r in records if "replicas differ" in r]
        if rank == 0:
            assert logged and "model.blocks.0.up.weight" in logged[0] and "rank 1" in logged[0], records
        else:
            assert not logged, records


def test_hsdp_2x2_names_the_replica_pair(tmp_path):
    # HSDP mesh (replicate=2, shard=2): rank 2 holds a copy of rank 0's shard.
    res = run_ranks(4, _diverge, str(tmp_path), "hsdp", 2, "blocks.1.down.weight", "check")
    for outcome, _records, same, _files in res:
        kind, text = outcome
        assert kind == "ReplicaDivergenceError", outcome
        assert "model.blocks.1.down.weight chunk" in text, text
        assert "rank 0 holds version" in text and "rank 2 holds version" in text, text
        assert "rank 1" not in text and "rank 3" not in text, text  # the other shard's replicas agree
        assert same


def _tp_names(rank, world):
    model, _, _ = T.make("tp", rank, world)
    from torch.distributed.tensor import DTensor

    return sorted(n for n, p in model.named_parameters() if not isinstance(p, DTensor) or "Replicate" in str(p.placements))


def test_tp_replicated_tensor_diverged(tmp_path):
    replicated = run_ranks(2, _tp_names)[0]
    assert replicated, "the TP model has no replicated parameter to perturb"
    name = replicated[0]
    res = run_ranks(2, _diverge, str(tmp_path), "tp", 0, name, "check")
    for outcome, _records, same, _files in res:
        kind, text = outcome
        assert kind == "ReplicaDivergenceError", outcome
        assert f"model.{name} chunk" in text, text
        assert same


def _fails_in_check(rank, world, root):
    from shardckpt import _fingerprint

    model, _, _ = T.make("ddp", rank, world)
    if rank == 1:
        def broken(layouts):
            raise RuntimeError("device error while fingerprinting")

        _fingerprint.local_fingerprints = broken
    try:
        shardckpt.save({"model": model}, f"{root}/ck")
        return ("saved", "")
    except shardckpt.CheckpointError as e:
        return (type(e).__name__, str(e))
    finally:
        import importlib

        importlib.reload(_fingerprint)


def test_a_rank_failing_in_the_check_fails_the_save_everywhere(tmp_path):
    res = run_ranks(2, _fails_in_check, str(tmp_path))
    for kind, text in res:
        assert kind == "SaveFailedError", (kind, text)
        assert "rank 1" in text and "device error while fingerprinting" in text, text
    assert not os.path.exists(tmp_path / "ck" / "manifest.json")


def _manager_check(rank, world, root):
    model, opt, sched = T.make("ddp", rank, world)
    mgr = shardckpt.CheckpointManager(root, replicas="check")
    mgr.save(1, {"model": model, "optim": opt})
    if rank == 0:
        _nudge(model, "module.head.weight")
    try:
        mgr.save(2, {"model": model, "optim": opt})
        return "saved", mgr.steps()
    except shardckpt.ReplicaDivergenceError as e:
        return str(e), mgr.steps()


def test_manager_refuses_with_replicas_check(tmp_path):
    for text, steps in run_ranks(2, _manager_check, str(tmp_path)):
        assert "model.head.weight" in text, text
        assert steps == [1]


@pytest.mark.parametrize("mode", ["bogus"])
def test_bad_mode_is_a_usage_error(mode, tmp_path):
    with pytest.raises(shardckpt.UsageError, match="replicas='bogus'"):
        shardckpt.save({"w": torch.ones(2)}, str(tmp_path / "x"), replicas=mode)
    assert not os.path.exists(tmp_path / "x")


def _lazy_views(rank, world, root, diverge):
    torch.manual_seed(0)  # the same values on every rank: replicated plain tensors
    z, w = torch.randn(5, 3, dtype=torch.complex64), torch.randn(5, 3, dtype=torch.complex64)
    state = {"conj": z.conj(), "neg": w.conj().imag, "plain": z.real.clone()}
    assert state["conj"].is_conj() and state["neg"].is_neg()
    if diverge and rank == 1:
        z.imag[0, 0] += 1.0  # the conj view's values move on rank 1 only
    url = f"{root}/ck-{int(diverge)}"
    try:
        shardckpt.save(state, url, replicas="check")
    except shardckpt.CheckpointError as e:
        return type(e).__name__, str(e)
    back = {"conj": torch.zeros(5, 3, dtype=torch.complex64), "neg": torch.zeros(5, 3), "plain": torch.zeros(5, 3)}
    shardckpt.load(back, url)
    return "saved", all(torch.equal(back[k], state[k].resolve_conj().resolve_neg()) for k in back)


def test_conjugate_and_negative_views_are_fingerprinted_by_their_values(tmp_path):
    # Viewing the bytes of a lazy conj/neg view raised; every multi-rank save of one failed, even under "warn".
    assert run_ranks(2, _lazy_views, str(tmp_path), False) == [("saved", True), ("saved", True)]
    res = run_ranks(2, _lazy_views, str(tmp_path), True)
    assert [r[0] for r in res] == ["ReplicaDivergenceError"] * 2, res
    assert "conj chunk [0:5, 0:3]: rank 0 holds version A, rank 1 holds version B" in res[0][1], res[0][1]
    assert "neg chunk" not in res[0][1] and "plain chunk" not in res[0][1], res[0][1]
