"""The Hugging Face Trainer with FSDP2 (through Accelerate) checkpointing through shardckpt.integrations.transformers.

The user's own script (``_hf_trainer_train.py``: a tiny Llama, nothing
downloaded, attention dropout so the RNG matters) on 2 gloo ranks: train 8
steps with a checkpoint every 4; a second run is SIGKILLed right after its
step-4 checkpoint and resumes with ``train(resume_from_checkpoint=True)``:
the losses of steps 5-8 are bit-identical to the uninterrupted run's.
"""

import os
import shutil

import pytest

pytest.importorskip("transformers")
pytest.importorskip("accelerate")

from _launch import launch, losses, run_ok  # noqa: E402

SCRIPT = "_hf_trainer_train.py"


@pytest.fixture(scope="module")
def run(tmp_path_factory):
    d = tmp_path_factory.mktemp("hf")
    run_ok(SCRIPT, 2, ["--out-dir", str(d / "full"), "--losses", str(d / "full.jsonl")])
    codes = launch(SCRIPT, 2, ["--mode", "crash", "--out-dir", str(d / "ck"), "--losses", str(d / "crash.jsonl")])
    assert codes == [-9, -9], codes  # both ranks died by SIGKILL right after the step-4 checkpoint
    return d


@pytest.mark.slow
def test_trainer_checkpoint_is_shardckpt_and_verifies(run):
    import shardckpt

    ck = run / "ck" / "checkpoint-4"
    m = shardckpt.verify(str(ck))
    assert m.world_size == 2
    names = set(m.tensors)
    assert "model.model.layers.0.self_attn.q_proj.weight" in names, sorted(names)[:10]
    assert any(n.startswith("optimizer.state.") and n.endswith(".exp_avg") for n in names)
    assert m.values["trainer"]["global_step"] == 4
    assert m.values["scheduler"]["last_epoch"] == 4
    assert "rng" in m.values
    files = os.listdir(ck)
    assert "trainer_state.json" in files  # the Trainer's own file, beside the checkpoint
    # None of the Trainer's resume files: no DCP folders, optimizer/scheduler/RNG pickles.
    assert not [f for f in files if f.startswith(("pytorch_model_fsdp", "optimizer", "scheduler", "rng_state"))], files


@pytest.mark.slow
def test_trainer_resume_after_sigkill_is_bit_identical(run):
    run_ok(SCRIPT, 2, ["--mode", "resume", "--out-dir", str(run / "ck"), "--losses", str(run / "resume.jsonl")])
    full, got = losses(str(run / "full.jsonl")), losses(str(run / "resume.jsonl"))
    assert sorted(got) == [5, 6, 7, 8]
    assert got == {s: full[s] for s in got}
    assert len(set(full.values())) == len(full)  # the steps differ: equal losses mean the same state


@pytest.mark.slow
def test_trainer_state_file_missing_is_refused(run, tmp_path):
    """Committed, but the process died before the Trainer's trainer_state.json: refused, never restarted at step 0."""
    shutil.copytree(run / "ck" / "checkpoint-4", tmp_path / "ck" / "checkpoint-4")  # not the resume's checkpoint-8
    os.remove(tmp_path / "ck" / "checkpoint-4" / "trainer_state.json")
    codes = launch(SCRIPT, 2, ["--mode", "resume", "--out-dir", str(tmp_path / "ck"), "--losses", str(tmp_path / "r.jsonl")])
    logs = "\n".join(launch.last_logs)  # type: ignore[attr-defined]
    # Refused by the Trainer itself where it reads the file unguarded (transformers 5.x: FileNotFoundError),
    # else by the integration (CorruptCheckpointError): either way naming the file, before any step.
    assert all(codes) and "trainer_state.json" in logs, (codes, logs[-3000:])
    assert not os.path.exists(tmp_path / "r.jsonl")  # not a step trained


def test_enable_refuses_other_objects():
    from shardckpt.errors import UsageError
    from shardckpt.integrations.transformers import enable

    with pytest.raises(UsageError, match="expected a transformers.Trainer"):
        enable(object())


@pytest.mark.slow
def test_the_trainers_own_checkpoint_still_resumes(run, tmp_path):
    """A checkpoint the Trainer wrote itself (DCP, torch.save) resumes through the switched Trainer: a run switched mid-way."""
    codes = launch(SCRIPT, 2, ["--native", "--mode", "crash", "--out-dir", str(tmp_path / "ck"), "--losses", str(tmp_path / "c.jsonl")])
    assert codes == [-9, -9], codes
    assert not (tmp_path / "ck" / "checkpoint-4" / "manifest.json").exists()
    run_ok(SCRIPT, 2, ["--mode", "resume", "--out-dir", str(tmp_path / "ck"), "--losses", str(tmp_path / "r.jsonl")])
    full, got = losses(str(run / "full.jsonl")), losses(str(tmp_path / "r.jsonl"))
    assert got == {s: full[s] for s in got} and sorted(got) == [5, 6, 7, 8]
