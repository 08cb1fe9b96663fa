"""The README's first command runs examples/quickstart.py; keep it working end to end."""

import os
import subprocess
import sys

import shardckpt

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


def test_quickstart_runs_under_torchrun_resumes_on_one_process_and_a_second_run_continues(tmp_path):
    """What the README tells users to copy, run twice: each run trains under torchrun and restores on 1 process;
    the second continues the first (no force=True, no step saved twice). One test: the second run needs the first's
    checkpoints, and each quickstart run starts three interpreters (torchrun's two ranks and the restore)."""
    cmd = [sys.executable, os.path.join(ROOT, "examples", "quickstart.py"), "--dir", str(tmp_path / "demo"), "--steps", "2"]
    for _ in range(2):
        out = subprocess.run(cmd, cwd=tmp_path, capture_output=True, text=True, timeout=300)
        assert out.returncode == 0, out.stdout + out.stderr
        assert "outputs match the sharded run exactly" in out.stdout
        assert "verify: every checksum matches" in out.stdout
    assert "[rank 0] step 3 " in out.stdout and "[rank 0] step 1 " not in out.stdout
    assert shardckpt.CheckpointManager(str(tmp_path / "demo")).steps() == [3, 4]
    m = shardckpt.inspect(str(tmp_path / "demo" / "step-00000004"))  # the newest of the kept steps
    assert m.world_size == 2
    assert m.values["step"] == 4
