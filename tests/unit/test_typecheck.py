"""The package type-checks: mypy (configured in pyproject's [tool.mypy]) finds no error.

``py.typed`` ships, so users' type checkers read our annotations: they must
be true. Runs ``python -m mypy`` from the repository root, exactly what a
developer runs; its incremental cache (``.mypy_cache``) makes reruns take
seconds, a cold run about half a minute of CPU (torch's own annotations are
read), hence ``slow``.
"""

from __future__ import annotations

import os
import subprocess
import sys

import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


@pytest.mark.slow
def test_mypy_finds_no_error():
    pytest.importorskip("mypy")
    out = subprocess.run(
        [sys.executable, "-m", "mypy"], cwd=ROOT, capture_output=True, text=True, timeout=900
    )
    report = out.stdout + out.stderr
    assert out.returncode == 0 and "Success: no issues found" in report, report[-6000:]
