"""Damaged checkpoints, multi-process: every rank raises a clear error and no rank's model changes.

An FSDP2 model is saved once on 2 ranks; each damage is staged on its own
copy; all copies are then loaded in one 2-rank call (and in one process).
"""

from __future__ import annotations

import json
import os
import shutil

import pytest
import torch

import shardckpt
from _dist import run_ranks
from models import build, shard_fsdp2
from shardckpt.errors import CheckpointNotFoundError, ChecksumMismatchError, CorruptCheckpointError, UnsafeMetadataError


def _save(rank, world, path):
    shardckpt.save({"model": shard_fsdp2(build(seed=1)), "step": 9}, path)
    return True


def _local_snapshot(model):
    out = {}
    for k, v in model.state_dict().items():
        v = v.to_local() if hasattr(v, "to_local") else v
        out[k] = v.detach().clone()
    return out


def _try_loads(model, cases, atomic=False):
    """Load every case into ``model``; report (error type, message, model unchanged?, step unchanged?)."""
    out = {}
    for name, path in cases.items():
        before = _local_snapshot(model)
        state = {"model": model, "step": -1}
        try:
            shardckpt.load(state, path, atomic=atomic)
            out[name] = (None, "loaded", True, True)
            continue
        except Exception as e:  # noqa: BLE001 - the test inspects it
            err = (type(e).__name__, str(e))
        after = _local_snapshot(model)
        same = before.keys() == after.keys() and all(torch.equal(before[k], after[k]) for k in before)
        out[name] = (err[0], err[1], same, state["step"] == -1)
    return out


def _load_cases(rank, world, cases, atomic=False):
    model = shard_fsdp2(build(seed=2))
    idx = torch.tensor([[1, 5, 36, 0]])
    model(idx).sum().backward()  # FSDP2 buffers exist, as in training
    return _try_loads(model, cases, atomic=atomic)


def _load_cases_both(rank, world, cases):
    return {"stream": _load_cases(rank, world, cases), "atomic": _load_cases(rank, world, cases, atomic=True)}


def _data_files(d):
    # Tensor data only (format v2 keeps per-rank index files beside them).
    return sorted(os.path.join(d, "data", f) for f in os.listdir(os.path.join(d, "data")) if f.endswith(".safetensors"))


def _bitflip(d):
    f = _data_files(d)[-1]  # rank 1's file: only some ranks read it
    data = bytearray(open(f, "rb").read())
    data[len(data) - 5] ^= 0x04
    open(f, "wb").write(bytes(data))
    return os.path.basename(f)


def _truncate(d):
    f = _data_files(d)[0]
    with open(f, "r+b") as fh:
        fh.truncate(os.path.getsize(f) - 16)
    return os.path.basename(f)


def _missing(d):
    f = _data_files(d)[-1]
    os.remove(f)
    return os.path.basename(f)


def _no_manifest(d):
    os.remove(os.path.join(d, "manifest.json"))
    return "manifest.json"


def _escape(d):
    # A real, valid data file sits at ../x: the loader must refuse the path, not read it.
    f = _data_files(d)[0]
    shutil.copy(f, os.path.join(os.path.dirname(d), "x"))
    with open(os.path.join(d, "manifest.json")) as fh:
        raw = json.load(fh)
    rel = "data/" + os.path.basename(f)
    if rel in raw["files"]:
        raw["files"]["../x"] = raw["files"].pop(rel)
    else:  # format v3: the rank's files are in the compact file table
        raw["files"]["../x"] = {"size": os.path.getsize(f)}
    for t in raw["tensors"].values():
        for c in t.get("chunks", []):  # format v2 lists no chunks
            if c["file"] == rel:
                c["file"] = "../x"
    with open(os.path.join(d, "manifest.json"), "w") as fh:
        json.dump(raw, fh)
    return "'../x'"


# case -> (damage, error type on the rank that finds it, message fragments every rank must show)
CASES = {
    "bitflip": (_bitflip, ChecksumMismatchError, ["crc32c"]),
    "truncated": (_truncate, CorruptCheckpointError, ["truncated"]),
    "missing": (_missing, CorruptCheckpointError, ["is missing"]),
    "no_manifest": (_no_manifest, CheckpointNotFoundError, ["no committed checkpoint"]),
    "escape": (_escape, UnsafeMetadataError, ["not a plain relative path"]),
}


@pytest.fixture(scope="module")
def damaged(tmp_path_factory):
    root = tmp_path_factory.mktemp("corrupt")
    good = str(root / "good")
    run_ranks(2, _save, good)
    cases, names = {"intact": good}, {}
    for name, (damage, _, _) in CASES.items():
        d = root / name / "ck"
        os.makedirs(d.parent)
        shutil.copytree(good, d)
        names[name] = damage(str(d))
        cases[name] = str(d)
    return cases, names


# Damage only the bytes themselves reveal: a streaming load (the default)
# finds it after copying the blocks before it, and must say which tensors it
# overwrote; atomic=True stages everything first and changes nothing.
FOUND_WHILE_STREAMING = {"bitflip"}


def _check(results, names, where, atomic=True):
    assert results["intact"][0] is None, (where, results["intact"])
    for name, (_, exc, fragments) in CASES.items():
        etype, msg, same_model, same_step = results[name]
        assert etype is not None, f"{where}: {name} loaded"
        assert same_step, f"{where}: {name}: plain values changed on a failed load"
        if not same_model:
            assert not atomic and name in FOUND_WHILE_STREAMING, f"{where}: {name}: the state changed on a failed load"
            assert "already overwritten" in msg, f"{where}: {name}: changed tensors not named: {msg!r}"
        for frag in fragments + [names[name]]:
            assert frag in msg, f"{where}: {name}: {frag!r} not in {msg!r}"
    return True


def test_damage_fails_on_every_rank_and_loads_nothing(damaged):
    cases, names = damaged
    # the intact copy loads first and last: a failed load leaves no residue
    order = dict(cases)
    order["intact_again"] = cases["intact"]
    both = run_ranks(2, _load_cases_both, order)
    per_rank = [b["stream"] for b in both]
    for rank, b in enumerate(both):
        _check(b["stream"], names, f"rank {rank}", atomic=False)
        _check(b["atomic"], names, f"rank {rank} atomic=True", atomic=True)
        assert b["stream"]["intact_again"][0] is None and b["atomic"]["intact_again"][0] is None
    # The rank that found the damage raises its own type; every rank raises
    # something naming it (peers: "load aborted on another rank").
    for name, (_, exc, _) in CASES.items():
        types = {r[name][0] for r in per_rank}
        assert exc.__name__ in types, (name, types)
        assert types <= {exc.__name__, "CorruptCheckpointError"}, (name, types)


def test_damage_fails_in_one_process(damaged):
    cases, names = damaged
    res = _try_loads(build(seed=3), cases)
    _check(res, names, "world 1", atomic=False)
    _check(_try_loads(build(seed=3), cases, atomic=True), names, "world 1 atomic=True", atomic=True)
    for name, (_, exc, _) in CASES.items():
        assert res[name][0] in {exc.__name__, "CorruptCheckpointError"}, (name, res[name][0])


def test_verify_names_the_damage(damaged):
    cases, names = damaged
    assert shardckpt.verify(cases["intact"]).world_size == 2
    for name, exc in [("bitflip", ChecksumMismatchError), ("truncated", CorruptCheckpointError), ("missing", CorruptCheckpointError)]:
        with pytest.raises(exc) as ei:
            shardckpt.verify(cases[name])
        assert names[name] in str(ei.value), (name, str(ei.value))
    with pytest.raises(CheckpointNotFoundError):
        shardckpt.verify(cases["no_manifest"])
    with pytest.raises(UnsafeMetadataError, match="'../x'"):
        shardckpt.verify(cases["escape"])
