"""Every module imports alone in a fresh interpreter; the format layer and verify import no torch.

Modules are listed from the package itself, so a new module is covered the day
it is added. An import that works only after another module was imported (a
cycle resolved by luck of order) fails here.
"""

from __future__ import annotations

import os
import pkgutil
import subprocess
import sys
from concurrent.futures import ThreadPoolExecutor

import pytest
import shardckpt.converters

import shardckpt

# Modules that must never need torch: `shardckpt verify` / `inspect` run where it is not installed.
TORCH_FREE = ["shardckpt._format", "shardckpt._verify", "shardckpt._cli", "shardckpt.errors", "shardckpt._version"]


def _modules():
    out = ["shardckpt", "shardckpt.converters"]
    for pkg in (shardckpt, shardckpt.converters):
        for info in pkgutil.walk_packages(pkg.__path__, pkg.__name__ + "."):
            out.append(info.name)
    # __main__ is the `python -m shardckpt` script: importing it runs the CLI (tested below).
    return sorted(set(out) - {"shardckpt.__main__"})


MODULES = _modules()


def _run(code: str) -> subprocess.CompletedProcess:
    env = dict(os.environ, PYTHONWARNINGS="ignore")
    return subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=300, env=env)


def test_the_module_list_is_complete():
    # The list is discovered, not written down: it must see the subpackages.
    assert "shardckpt._format.committed" in MODULES and "shardckpt._format.values" in MODULES
    assert "shardckpt.converters._common" in MODULES and "shardckpt._verify" in MODULES
    assert not any(m.endswith("_crc") for m in MODULES), "one checksum implementation: converters/_crc.py is gone"


def test_every_module_imports_alone():
    # One fresh interpreter per module, a few at a time; every failure is reported.
    def one(module):
        return module, _run(f"import {module}")

    with ThreadPoolExecutor(max_workers=max(2, os.cpu_count() or 2)) as ex:
        results = list(ex.map(one, MODULES))
    failed = {m: p.stderr.strip().splitlines()[-1] for m, p in results if p.returncode != 0}
    assert not failed, "modules that fail to import alone:\n" + "\n".join(f"  {m}: {e}" for m, e in failed.items())


def test_python_dash_m_runs_the_cli():
    p = subprocess.run([sys.executable, "-m", "shardckpt", "--version"], capture_output=True, text=True, timeout=300)
    assert p.returncode == 0 and p.stdout.startswith("shardckpt ")


@pytest.mark.parametrize("module", TORCH_FREE + [m for m in MODULES if m.startswith("shardckpt._format.")])
def test_module_imports_without_torch(module):
    # sys.modules["torch"] = None makes every `import torch` raise ImportError.
    p = _run(
        "import sys; sys.modules['torch'] = None\n"
        f"import {module}\n"
        "assert sys.modules['torch'] is None"
    )
    assert p.returncode == 0, f"{module} imports torch:\n{p.stderr[-3000:]}"
