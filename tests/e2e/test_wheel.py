"""The built wheel works on its own, as a user installs it (issue 29, item 1).

Every other test imports shardckpt from an editable install of the source tree,
so a module the wheel leaves out goes unseen there (``shardckpt._memory`` once
did, and ``CheckpointManager`` raised ``ModuleNotFoundError`` for every pip
user). Here the wheel is built from a copy of the tree, installed into a fresh
virtual environment outside the repository, and every module of the source tree
is imported from that environment, then the quickstart and ``shardckpt --help``
run from it.

Dependencies (torch, safetensors...) come from the test environment through a
``.pth`` line, so nothing is downloaded; shardckpt itself comes only from the
wheel (checked: each module's file lies in the new environment).
"""

import json
import os
import shutil
import subprocess
import sys
import sysconfig

import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
# What a source checkout needs to build the wheel (pyproject.toml's readme too).
BUILD_INPUTS = ("pyproject.toml", "setup.py", "README.md", "shardckpt", "converters")

# 20-60 s (a wheel build, a venv, a torchrun quickstart): CI runs it.
pytestmark = pytest.mark.slow



def source_modules():
    """Every module the source tree defines, by its installed name (converters/ ships as shardckpt.converters)."""
    names = []
    for top, package in (("shardckpt", "shardckpt"), ("converters", "shardckpt.converters")):
        base = os.path.join(ROOT, top)
        for dirpath, dirnames, filenames in os.walk(base):
            dirnames[:] = sorted(d for d in dirnames if d != "__pycache__")
            rel = os.path.relpath(dirpath, base)
            prefix = package if rel == "." else package + "." + rel.replace(os.sep, ".")
            for f in sorted(filenames):
                if not f.endswith(".py"):
                    continue
                stem = f[:-3]
                names.append(prefix if stem == "__init__" else f"{prefix}.{stem}")
    return names


def _clean_env():
    env = dict(os.environ)
    env.pop("PYTHONPATH", None)  # nothing may point back at the repository
    env.pop("PYTHONHOME", None)
    return env


def _run(args, cwd, timeout=600):
    p = subprocess.run([str(a) for a in args], cwd=cwd, env=_clean_env(), capture_output=True, text=True, timeout=timeout)
    assert p.returncode == 0, (args, p.returncode, p.stdout[-4000:], p.stderr[-4000:])
    return p


@pytest.fixture(scope="module")
def installed(tmp_path_factory):
    """(venv python, venv dir, work dir): the wheel installed into a fresh venv outside the repository."""
    tmp = tmp_path_factory.mktemp("wheel")
    src = tmp / "src"
    src.mkdir()
    for name in BUILD_INPUTS:  # build from a copy: the build writes build/ and *.egg-info beside its sources
        s = os.path.join(ROOT, name)
        if os.path.isdir(s):
            shutil.copytree(s, src / name, ignore=shutil.ignore_patterns("__pycache__", "*.pyc"))
        else:
            shutil.copy2(s, src / name)
    dist = tmp / "dist"
    _run([sys.executable, "-m", "pip", "wheel", "--no-deps", "--no-build-isolation", "--no-index", "-q", "-w", dist, src], cwd=tmp)
    wheels = sorted(p for p in os.listdir(dist) if p.endswith(".whl"))
    assert len(wheels) == 1, wheels

    venv = tmp / "venv"
    _run([sys.executable, "-m", "venv", venv], cwd=tmp)
    py = venv / "bin" / "python"
    # The dependencies: this environment's site-packages, appended after the
    # new venv's own (so the wheel's shardckpt comes first even where this
    # environment holds a non-editable shardckpt). A plain path line: the .pth
    # files there (an editable install's finder) are not processed.
    purelib = _run([py, "-c", "import sysconfig; print(sysconfig.get_paths()['purelib'])"], cwd=tmp).stdout.strip()
    deps = sorted({sysconfig.get_paths()["purelib"], sysconfig.get_paths()["platlib"]})
    with open(os.path.join(purelib, "zz_test_deps.pth"), "w") as f:
        f.write("\n".join(deps) + "\n")
    _run([py, "-m", "pip", "install", "--no-deps", "--no-index", "-q", dist / wheels[0]], cwd=tmp)
    work = tmp / "work"
    work.mkdir()
    return py, str(venv), work


def test_every_module_imports_from_the_installed_wheel(installed):
    py, venv, work = installed
    import importlib.util

    # A trainer integration imports its trainer: checked only where that trainer is installed (as test_imports does).
    optional = {"shardckpt.integrations.accelerate": "accelerate", "shardckpt.integrations.lightning": "lightning",
                "shardckpt.integrations.torchtitan": "torchtitan"}
    modules = [m for m in source_modules() if m != "shardckpt.__main__"  # __main__ runs the CLI: run below
               and (m not in optional or importlib.util.find_spec(optional[m]) is not None)]
    assert "shardckpt.integrations" in modules
    assert "shardckpt._memory" in modules and "shardckpt.converters._dcp" in modules, modules
    probe = (
        "import importlib, json, sys\n"
        "out = {}\n"
        "for name in json.loads(sys.argv[1]):\n"
        "    try:\n"
        "        out[name] = importlib.import_module(name).__file__\n"
        "    except Exception as e:\n"
        "        out[name] = 'FAILED: %s: %s' % (type(e).__name__, e)\n"
        "import shardckpt\n"
        "public = {n: type(getattr(shardckpt, n)).__name__ for n in shardckpt.__all__}\n"
        "print(json.dumps({'modules': out, 'public': public}))\n"
    )
    p = _run([py, "-c", probe, json.dumps(modules)], cwd=work)
    res = json.loads(p.stdout.strip().splitlines()[-1])
    bad = {n: f for n, f in res["modules"].items() if not (f and os.path.realpath(f).startswith(os.path.realpath(venv) + os.sep))}
    assert not bad, f"modules not importable from the installed wheel (or imported from elsewhere): {bad}"
    assert set(res["public"]) >= {"CheckpointManager", "MemoryTier", "NewerFormatError"}, res["public"]
    # PEP 561: the type hints ship too.
    assert os.path.exists(os.path.join(os.path.dirname(res["modules"]["shardckpt"]), "py.typed"))
    # The C kernel (optional): in the wheel wherever it was built for this checkout, with its type stub.
    from shardckpt._format.checksum import COPY_FUSED

    p = _run([py, "-c", "import importlib; c = importlib.import_module('shardckpt._format.checksum'); print(c.COPY_FUSED, c.__file__)"], cwd=work)
    fused, where = p.stdout.split()
    assert fused == str(COPY_FUSED), p.stdout
    assert os.path.exists(os.path.join(os.path.dirname(where), "_crccopy.pyi"))


def test_cli_help_runs_from_the_installed_wheel(installed):
    py, venv, work = installed
    script = os.path.join(venv, "bin", "shardckpt")
    p = _run([script, "--help"], cwd=work)
    assert "usage" in p.stdout.lower() and "inspect" in p.stdout, p.stdout
    p = _run([py, "-m", "shardckpt", "--help"], cwd=work)
    assert "usage" in p.stdout.lower(), p.stdout


def test_quickstart_runs_from_the_installed_wheel(installed):
    py, venv, work = installed
    script = work / "quickstart.py"  # a copy: its directory (sys.path[0]) must not be the repository
    shutil.copy2(os.path.join(ROOT, "examples", "quickstart.py"), script)
    p = _run([py, script, "--dir", work / "demo", "--steps", "2"], cwd=work)
    assert "outputs match the sharded run exactly" in p.stdout, p.stdout
    assert "verify: every checksum matches" in p.stdout, p.stdout
