"""Child processes of the fault tests: each test file re-runs itself as ``python FILE child ARGS``.

One spawn and one bounded wait for every cell, so a hung child fails its
test (naming the hang) instead of hanging the suite.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from typing import Any, Optional, Tuple

import pytest

TESTS = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def spawn(script: str, *args: Any) -> subprocess.Popen:
    """Start ``script child <args as JSON>`` with tests/ importable and no GPU."""
    env = dict(os.environ, PYTHONPATH=TESTS + os.pathsep + os.environ.get("PYTHONPATH", ""), CUDA_VISIBLE_DEVICES="")
    return subprocess.Popen(
        [sys.executable, os.path.abspath(script), "child", json.dumps(args)],
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
        env=env,
    )


def finish(p: subprocess.Popen, timeout_s: float, what: str = "child") -> Tuple[int, str]:
    """``(exit code, output)`` of a child; the test fails if it runs past ``timeout_s`` (a hang)."""
    try:
        out, _ = p.communicate(timeout=timeout_s)
    except subprocess.TimeoutExpired:
        p.kill()
        out, _ = p.communicate()
        pytest.fail(f"{what} did not finish within {timeout_s}s (hang):\n{out}")
    return p.returncode, out


def result(out: str) -> Optional[Any]:
    """The JSON of the child's last ``RESULT `` line, or None."""
    lines = [ln for ln in out.splitlines() if ln.startswith("RESULT ")]
    return json.loads(lines[-1][7:]) if lines else None
