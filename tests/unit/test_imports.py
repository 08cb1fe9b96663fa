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


#: The trainer integrations import their trainer (an optional dependency): each is
#: checked where its trainer is installed (shardckpt.integrations itself always).
OPTIONAL = {"shardckpt.integrations.accelerate": "accelerate", "shardckpt.integrations.lightning": "lightning",
            "shardckpt.integrations.torchtitan": "torchtitan"}


def _installed(module: str) -> bool:
    import importlib.util

    return module not in OPTIONAL or importlib.util.find_spec(OPTIONAL[module]) is not None


MODULES = [m for m in _modules() if _installed(m)]


def _run(code: str) -> subprocess.CompletedProcess:
    env = dict(os.environ, PYTHONWARNINGS="ignore")
    return subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=300, env=env)


def test_the_module_list_is_complete():
    # The list is discovered, not written down: it must see the subpackages.
    assert "shardckpt._format.committed" in MODULES and "shardckpt._format.values" in MODULES
    assert "shardckpt.converters._common" in MODULES and "shardckpt._verify" in MODULES
    assert "shardckpt.integrations" in MODULES and "shardckpt.integrations._common" in MODULES
    assert not any(m.endswith("_crc") for m in MODULES), "one checksum implementation: converters/_crc.py is gone"


# One fresh interpreter imports the third-party packages once (torch is most of
# an import's cost: ~1.5 s of CPU each), then forks a child per module, which
# imports that module alone: our modules are never preloaded, so an import that
# works only after another of ours was imported still fails here.
_FORK_EACH = r"""
import os, sys, traceback
import torch, numpy, safetensors  # third parties only
failed = []
for module in sys.argv[1:]:
    r, w = os.pipe()
    pid = os.fork()
    if pid == 0:
        os.close(r)
        try:
            __import__(module)
            code = 0
        except BaseException:
            os.write(w, traceback.format_exc().strip().splitlines()[-1].encode()[:2000])
            code = 1
        os._exit(code)
    os.close(w)
    with os.fdopen(r, "rb") as f:
        why = f.read().decode(errors="replace")
    _, status = os.waitpid(pid, 0)
    if status != 0:
        failed.append(f"{module}: {why or f'exit status {status}'}")
print("\n".join(failed))
sys.exit(1 if failed else 0)
"""


def test_every_module_imports_alone():
    half = (len(MODULES) + 1) // 2
    env = dict(os.environ, PYTHONWARNINGS="ignore")

    def batch(mods):
        return subprocess.run([sys.executable, "-c", _FORK_EACH, *mods], capture_output=True, text=True, timeout=300, env=env)

    with ThreadPoolExecutor(max_workers=2) as ex:
        results = list(ex.map(batch, [MODULES[:half], MODULES[half:]]))
    failed = [line for p in results for line in p.stdout.splitlines() if line.strip()]
    crashed = [p.stderr[-2000:] for p in results if p.returncode != 0 and not p.stdout.strip()]
    assert not failed and not crashed, "modules that fail to import alone:\n  " + "\n  ".join(failed + crashed)


def test_a_module_that_imports_only_after_another_fails_the_check(tmp_path):
    # The check itself can fail: a package whose submodule needs a sibling preloaded.
    pkg = tmp_path / "needsorder"
    pkg.mkdir()
    (pkg / "__init__.py").write_text("")
    (pkg / "a.py").write_text("import sys\nVALUE = sys.modules['needsorder.b'].VALUE\n")
    (pkg / "b.py").write_text("VALUE = 1\n")
    env = dict(os.environ, PYTHONWARNINGS="ignore", PYTHONPATH=str(tmp_path) + os.pathsep + os.environ.get("PYTHONPATH", ""))
    p = subprocess.run([sys.executable, "-c", _FORK_EACH, "needsorder.b", "needsorder.a"], capture_output=True, text=True,
                       timeout=300, env=env)
    assert p.returncode == 1 and "needsorder.a: KeyError" in p.stdout, p.stdout + p.stderr
    assert not p.stdout.startswith("needsorder.b:") and "\nneedsorder.b:" not in p.stdout  # b imported fine


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
