"""Accelerate + FSDP2 with shardckpt.integrations.accelerate: the user's own loop on 2 gloo ranks (real processes).

Train, ``save_state`` through the integration, SIGKILL, ``load_state`` at the
same world size (losses bit-identical to an uninterrupted run) and on one
process (within float tolerance: a different reduction order); a checkpoint
Accelerate wrote itself (DCP) loads through the switched ``load_state``.
"""

import json
import os

import pytest

pytest.importorskip("accelerate")

from _launch import launch, losses, run_ok  # noqa: E402

SCRIPT = "_accelerate_train.py"
#: One process against two: the same math in another reduction order (Adam
#: magnifies it over steps); measured 1e-3 relative at step 8.
CROSS_WORLD_RTOL = 1e-2


@pytest.fixture(scope="module")
def run(tmp_path_factory):
    d = tmp_path_factory.mktemp("acc")
    run_ok(SCRIPT, 2, ["--out", str(d / "full.jsonl")])
    codes = launch(SCRIPT, 2, ["--mode", "crash", "--save-at", "4", "--ckpt", str(d / "ck"), "--out", str(d / "crash.jsonl")])
    assert codes == [-9, -9], codes  # both ranks died by SIGKILL right after the save
    return d


def test_checkpoint_is_shardckpt_and_verifies(run):
    import shardckpt

    m = shardckpt.verify(str(run / "ck"))
    names = set(m.tensors)
    assert {"model.0.weight", "optimizer.state.0.weight.exp_avg"} <= names, sorted(names)[:20]
    assert m.world_size == 2
    assert m.values["accelerate"]["step"] == 4
    assert m.values["scheduler"]["last_epoch"] == 4
    assert not any(f.endswith((".distcp", ".pkl", ".bin")) for f in os.listdir(run / "ck"))


def test_resume_same_world_is_bit_identical(run):
    run_ok(SCRIPT, 2, ["--mode", "resume", "--resume", str(run / "ck"), "--out", str(run / "r2.jsonl")])
    full, got = losses(str(run / "full.jsonl")), losses(str(run / "r2.jsonl"))
    assert sorted(got) == [5, 6, 7, 8]
    assert got == {s: full[s] for s in got}


def test_resume_on_one_process(run):
    run_ok(SCRIPT, 1, ["--mode", "resume", "--resume", str(run / "ck"), "--out", str(run / "r1.jsonl")])
    full, got = losses(str(run / "full.jsonl")), losses(str(run / "r1.jsonl"))
    assert sorted(got) == [5, 6, 7, 8]
    assert got[5] == pytest.approx(full[5], rel=1e-6)  # the first step after the load: the loaded weights alone
    for s in got:
        assert got[s] == pytest.approx(full[s], rel=CROSS_WORLD_RTOL), (s, got[s], full[s])


@pytest.mark.slow
def test_accelerate_dcp_checkpoint_still_loads(run, tmp_path):
    run_ok(SCRIPT, 2, ["--dcp", "--save-at", "4", "--ckpt", str(tmp_path / "dcp"), "--out", str(tmp_path / "dcp.jsonl")])
    assert (tmp_path / "dcp" / "pytorch_model_fsdp_0" / ".metadata").exists()
    run_ok(SCRIPT, 2, ["--mode", "resume", "--resume", str(tmp_path / "dcp"), "--out", str(tmp_path / "r.jsonl")])
    full, got = losses(str(run / "full.jsonl")), losses(str(tmp_path / "r.jsonl"))
    assert got == {s: full[s] for s in got} and sorted(got) == [5, 6, 7, 8]


@pytest.mark.slow
def test_accelerate_dcp_model_converts(run, tmp_path):
    """Accelerate's DCP model folder through converters.from_dcp, then loaded into a plain module."""
    import torch

    import shardckpt
    from shardckpt import converters

    run_ok(SCRIPT, 2, ["--dcp", "--save-at", "4", "--ckpt", str(tmp_path / "dcp"), "--out", str(tmp_path / "dcp.jsonl")])
    converters.from_dcp(str(tmp_path / "dcp" / "pytorch_model_fsdp_0"), str(tmp_path / "native"))
    ours = shardckpt.inspect(str(run / "ck"))
    model = torch.nn.Sequential(torch.nn.Linear(8, 32), torch.nn.ReLU(), torch.nn.Linear(32, 32), torch.nn.ReLU(), torch.nn.Linear(32, 4))
    shardckpt.load({"model": model}, str(tmp_path / "native"))
    mine = torch.nn.Sequential(torch.nn.Linear(8, 32), torch.nn.ReLU(), torch.nn.Linear(32, 32), torch.nn.ReLU(), torch.nn.Linear(32, 4))
    shardckpt.load({"model": mine}, str(run / "ck"), strict=False)
    assert set(n for n in ours.tensors if n.startswith("model.")) == {"model." + k for k in model.state_dict()}
    for (k, a), b in zip(model.state_dict().items(), mine.state_dict().values()):
        assert torch.equal(a, b), k


@pytest.mark.parametrize("mode", ["sync", pytest.param("async", marks=pytest.mark.slow)])
def test_automatic_naming_total_limit_and_hooks(tmp_path, mode):
    run_ok("_accelerate_project.py", 2, [str(tmp_path), mode])
    with open(tmp_path / "result.json") as f:
        res = json.load(f)
    assert res["folders"] == ["checkpoint_2", "checkpoint_3"]  # total_limit=2, numbered by iteration
    assert res["hooks"] == ["save", "save", "save", "save", "load"]
    assert res["step_after_load"] == 4 and res["iteration_after_load"] == 4


def _cpu_case(tmp_path, mode):
    run_ok("_accelerate_cpu.py", 2, [mode, str(tmp_path / "res")])
    out = []
    for rank in range(2):
        with open(tmp_path / f"res.{rank}") as f:
            out.append(json.load(f))
    return out


def test_fsdp2_on_cpu_through_enable(tmp_path):
    """Accelerator(fsdp_plugin=plugin, cpu=True) + enable(accelerator, fsdp_plugin=plugin): FSDP2, sharded, and it stays on."""
    for res in _cpu_case(tmp_path, "cpu"):
        assert res == {"type": "DistributedType.FSDP", "fsdp2": True, "dtensor": True, "world": 2}, res


@pytest.mark.parametrize("mode, words", [
    ("nogpu", ["runs each of the 2 processes alone", "DistributedType.NO", "cpu=True", "fsdp_plugin=plugin"]),
    ("noplugin", ["drops its FSDP plugin", "enable(accelerator, fsdp_plugin=plugin)"]),
    ("late", ["after prepare"]),
])
def test_fsdp_asked_but_impossible_is_refused(tmp_path, mode, words):
    """Never silently without FSDP: each way the plugin would be lost is refused, naming the working lines."""
    for res in _cpu_case(tmp_path, mode):
        assert res.get("error") == "UsageError", res
        for w in words:
            assert w in res["message"], (w, res["message"])


def test_total_limit_counts_only_checkpoint_folders_and_never_overwrites(tmp_path):
    """Accelerate's rule: only checkpoint_<i> folders holding a checkpoint count; the new one is never deleted."""
    run_ok("_accelerate_retention.py", 2, ["retention", str(tmp_path)])
    with open(tmp_path / "result.json") as f:
        res = json.load(f)
    # The previous run's checkpoint_7 is the oldest-numbered checkpoint: displaced, as Accelerate does;
    # run_2024 and checkpoint_9 (no checkpoint in it) are not ours: kept.
    assert res["after_first"] == ["checkpoint_0", "checkpoint_9", "run_2024"], res
    assert res["after_second"] == ["checkpoint_1", "checkpoint_9", "run_2024"], res
    kind, msg = res["overwrite"]
    assert kind == "CheckpointExistsError" and "checkpoint_1" in msg and "iteration" in msg, res["overwrite"]
    assert res["after_refusal"] == res["after_second"]


def test_malformed_counters_refused_before_anything_loads(tmp_path):
    run_ok("_accelerate_retention.py", 2, ["counters", str(tmp_path)])
    with open(tmp_path / "result.json") as f:
        res = json.load(f)
    assert len(res["cases"]) == 5
    for case in res["cases"]:
        assert case["error"] and case["error"][0] == "CorruptCheckpointError", case
        assert "'accelerate'" in case["error"][1] and "nothing was loaded" in case["error"][1], case
        assert case["untouched"], case  # model and optimizer as they were before the call
