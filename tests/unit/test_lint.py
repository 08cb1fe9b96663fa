"""The tree stays clean under the project's ruff configuration (pyproject.toml)."""

from __future__ import annotations

import os
import subprocess
import sys

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


def test_ruff_is_clean():
    p = subprocess.run([sys.executable, "-m", "ruff", "check", "--no-cache", ROOT], capture_output=True, text=True, cwd=ROOT)
    assert p.returncode == 0, p.stdout + p.stderr
