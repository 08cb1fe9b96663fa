"""examples/train_fsdp2.py under torchrun: 2 processes, then resumed on 3, then on 1 (the resumes with torchrun's worker environment, forked)."""

import os
import re
import signal
import subprocess
import sys
import uuid

import _zygote

import shardckpt

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
SCRIPT = os.path.join(ROOT, "examples", "train_fsdp2.py")


def _run(nproc, ckpt, steps, tmp_path, real=True):
    """The example on ``nproc`` processes: under torchrun, or (``real=False``) as ``nproc`` forks of the test
    fork server with the environment torchrun gives its workers (tests/_zygote.py; no torch import per rank)."""
    env = dict(os.environ, CUDA_VISIBLE_DEVICES="")  # gloo on CPU even on a GPU box
    args = ["--ckpt-dir", ckpt, "--steps", str(steps), "--save-every", "2", "--dim", "32", "--seq", "16"]
    if not real:
        envs = _zygote.torchrun_envs(env, nproc, f"train-{uuid.uuid4().hex[:8]}")
        codes, outs = _zygote.run_many([SCRIPT, *args], envs, cwd=str(tmp_path), job_vars=_zygote.TORCHRUN_JOB_VARS,
                                       timeout=240, stop_peers=True, base_env=env)
        assert codes == [0] * nproc, (codes, "\n".join(outs))
        return "".join(outs)
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", str(nproc), SCRIPT, *args]
    # A session of its own, so a time-out takes the workers down with torchrun.
    p = subprocess.Popen(cmd, cwd=tmp_path, env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, start_new_session=True)
    try:
        stdout, stderr = p.communicate(timeout=240)
    except subprocess.TimeoutExpired:
        os.killpg(p.pid, signal.SIGKILL)
        stdout, stderr = p.communicate()
        raise AssertionError(f"torchrun --nproc-per-node {nproc} timed out:\n{stdout}\n{stderr}") from None
    assert p.returncode == 0, stdout + stderr
    return stdout


def _losses(text):
    return {int(m.group(1)): float(m.group(2)) for m in re.finditer(r"^step (\d+) loss (\S+)", text, re.M)}


def test_train_example_resumes_at_other_world_sizes(tmp_path):
    ckpt = str(tmp_path / "run")
    out = _run(2, ckpt, 4, tmp_path)
    assert "starting from scratch on 2 process(es)" in out
    assert sorted(_losses(out)) == [1, 2, 3, 4]
    assert "done at step 4; checkpoints: [2, 4]" in out

    out = _run(3, ckpt, 6, tmp_path, real=False)  # torchrun itself: the first run (and test_quickstart.py)
    assert "resumed from step 4 (saved by 2 processes, resharded to 3)" in out
    assert sorted(_losses(out)) == [5, 6]

    out = _run(1, ckpt, 8, tmp_path, real=False)
    assert "resumed from step 6 (saved by 3 processes, resharded to 1)" in out
    losses = _losses(out)
    assert sorted(losses) == [7, 8] and all(0 < v < 10 for v in losses.values())
    assert "checkpoints: [4, 6, 8]" in out  # keep_last=3

    m = shardckpt.verify(os.path.join(ckpt, "step-00000008"))
    assert m.world_size == 1
    # the loader positions followed the documented remap: 2 x 48 -> 3 x 32 (+16 each) -> 1 x 144 (+48)
    assert m.extra["per_rank"][0]["loader"] == {"samples": 192}
    assert "optim.state.blocks.0.qkv.weight.exp_avg" in m.tensors
