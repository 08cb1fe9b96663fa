"""Run the fenced code blocks of README.md and docs/ (tests/e2e/test_snippets.py), so a snippet cannot drift.

Which blocks run: every block fenced as ``python`` or ``bash``. A block is
configured by an HTML comment on the line right above its fence (invisible
on GitHub and in the site)::

    <!-- snippet: torchrun=2 -->                 run under torchrun with 2 gloo processes
    <!-- snippet: fixtures=ckpt,hf -->           create these files in the working directory first
    <!-- snippet: preamble=none -->              run the block as written (no preamble)
    <!-- snippet: skip="why it cannot run" -->   not run; the reason is required
    <!-- snippet: once="why" -->                 a restoring block run once, not resumed; the reason is required

Blocks of one page run in order, in one fresh working directory, each in its
own process (files persist between them, Python names do not). A python
block runs after the preamble ``from snippet_preamble import *`` (see
tests/snippet_preamble.py: a tiny ``model``, ``optim``/``optimizer``,
``scheduler``, ``state``, ``step``, ``total``, ``train_step``...; under
torchrun it starts the gloo process group and shards ``model`` with
FSDP2) unless it says ``preamble=none``.

A python block that calls ``.restore(`` runs twice in the same directory:
the second run is a resume, which is what such a loop is for (a loop that
re-saves the restored step fails there with ``CheckpointExistsError``).
Each run is a new job: its own job id (``TORCHELASTIC_RUN_ID``, torchrun's
``--rdzv-id``), and the memory tier directories it made (the default one is
per root, ``/dev/shm/shardckpt-<uid>-<hash>``) are removed after it, as when a scheduler
restarts a job on other nodes: only what reached storage survives.
"""

from __future__ import annotations

import json
import os
import re
import shlex
import shutil
import subprocess
import sys
import tempfile
import uuid
from dataclasses import dataclass, field
from typing import Dict, List, Optional

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
TESTS = os.path.join(ROOT, "tests")
RUN_LANGS = ("python", "bash")
KNOWN_OPTIONS = ("torchrun", "fixtures", "preamble", "skip", "once")
FIXTURES = ("ckpt", "hf", "dcp", "pt")
BLOCK_TIMEOUT_S = 300

_MARK = re.compile(r"^\s*<!--\s*snippet:(.*?)-->\s*$")
_FENCE = re.compile(r"^(\s*)(```+|~~~+)\s*([\w+-]*)(.*)$")


@dataclass
class Block:
    path: str  # relative to ROOT
    line: int  # 1-based line of the opening fence
    lang: str
    code: str
    options: Dict[str, str] = field(default_factory=dict)

    @property
    def where(self) -> str:
        return f"{self.path}:{self.line}"


def _parse_options(text: str, where: str) -> Dict[str, str]:
    out = {}
    for tok in shlex.split(text):
        key, _, value = tok.partition("=")
        if key not in KNOWN_OPTIONS:
            raise ValueError(f"{where}: unknown snippet option {key!r} (known: {', '.join(KNOWN_OPTIONS)})")
        out[key] = value
    for key in ("skip", "once"):
        if key in out and not out[key].strip():
            raise ValueError(f'{where}: {key} needs a reason: <!-- snippet: {key}="why" -->')
    for name in filter(None, out.get("fixtures", "").split(",")):
        if name not in FIXTURES:
            raise ValueError(f"{where}: unknown fixture {name!r} (known: {', '.join(FIXTURES)})")
    return out


def extract(text: str, path: str) -> List[Block]:
    """The fenced blocks of one Markdown text, with the options of the comment above each."""
    blocks: List[Block] = []
    lines = text.splitlines()
    i = 0
    while i < len(lines):
        m = _FENCE.match(lines[i])
        if not m:
            i += 1
            continue
        indent, fence, lang = m.group(1), m.group(2), m.group(3).lower()
        start = i
        body = []
        i += 1
        while i < len(lines) and not lines[i].strip().startswith(fence):
            body.append(lines[i][len(indent):] if lines[i].startswith(indent) else lines[i])
            i += 1
        i += 1
        prev = start - 1
        while prev >= 0 and not lines[prev].strip():
            prev -= 1
        mark = _MARK.match(lines[prev]) if prev >= 0 and prev >= start - 2 else None
        where = f"{path}:{start + 1}"
        options = _parse_options(mark.group(1), where) if mark else {}
        blocks.append(Block(path, start + 1, lang, "\n".join(body) + "\n", options))
    return blocks


def doc_files() -> List[str]:
    """README.md and every Markdown page under docs/ (device-run logs aside), relative to ROOT."""
    out = ["README.md"]
    for d, dirs, files in os.walk(os.path.join(ROOT, "docs")):
        dirs[:] = sorted(x for x in dirs if x not in ("device-runs",) and not x.startswith("_"))
        out += sorted(os.path.relpath(os.path.join(d, f), ROOT) for f in files if f.endswith(".md"))
    return out


def page_blocks(path: str) -> List[Block]:
    with open(os.path.join(ROOT, path)) as f:
        return [b for b in extract(f.read(), path) if b.lang in RUN_LANGS]


def _env(job: str = "") -> Dict[str, str]:
    env = dict(os.environ)
    env.pop("SLURM_JOB_ID", None)
    if job:
        env["TORCHELASTIC_RUN_ID"] = job
    env["PYTHONPATH"] = os.pathsep.join(filter(None, [TESTS, env.get("PYTHONPATH")]))
    env["PATH"] = os.pathsep.join([os.path.dirname(sys.executable), env.get("PATH", "")])  # the venv's shardckpt script
    env.setdefault("OMP_NUM_THREADS", "1")
    return env


def _memory_dirs() -> set:
    try:
        return {n for n in os.listdir("/dev/shm") if n.startswith("shardckpt-")}
    except OSError:
        return set()


def _made_by_this_page(name: str, cwd: str) -> bool:
    """Whether /dev/shm/``name`` is the memory tier of a root under ``cwd`` (its identity.json says).

    Other jobs of the host (another test process, another user's run) make
    theirs at the same time: a new directory alone is not this page's.
    """
    from shardckpt._memory.store import IDENTITY_NAME

    try:
        with open(os.path.join("/dev/shm", name, IDENTITY_NAME)) as f:
            root = json.load(f).get("root", "")
    except (OSError, ValueError, AttributeError):
        return False
    here = os.path.realpath(cwd)
    return isinstance(root, str) and (root == here or root.startswith(here + os.sep))


def _run(cmd: List[str], cwd: str, what: str, job: str = "") -> None:
    before = _memory_dirs()
    try:
        p = subprocess.run(cmd, cwd=cwd, env=_env(job), capture_output=True, text=True, timeout=BLOCK_TIMEOUT_S)
        code, out, err = p.returncode, p.stdout, p.stderr
    finally:
        if job:
            _remove_memory_dirs(before, cwd)
    _check(code, out, err, what)


def _remove_memory_dirs(before: set, cwd: str) -> None:
    """The job is over: the memory tier directories it made (per root: /dev/shm/shardckpt-<uid>-<hash>) go with it."""
    for name in _memory_dirs() - before:
        if _made_by_this_page(name, cwd):
            shutil.rmtree(os.path.join("/dev/shm", name), ignore_errors=True)


def _check(code: int, out: str, err: str, what: str) -> None:
    if code != 0:
        raise AssertionError(f"{what} failed (exit {code}):\n--- stdout\n{out[-4000:]}\n--- stderr\n{err[-6000:]}")


def _fork_run(cwd: str, what: str, job: str = "", script: str = "", code: str = "", ranks: int = 0) -> None:
    """Run ``python script`` (or ``python -c code``) in ``cwd`` as a fork of the snippet server.

    ``ranks=N`` starts N processes with the environment torchrun gives its
    workers on one node (rank 0 hosts the store, as without torchrun's agent).
    Real processes, like ``_run``'s, but without each one importing torch.
    """
    import _zygote

    env = _env(job)
    base = dict(script=script) if script else dict(code=code)
    envs = _zygote.torchrun_envs(env, ranks, job) if ranks else [env]
    procs = [dict(base, env=e) for e in envs]
    logs = tempfile.mkdtemp(prefix="snippet-logs-")  # 0700, outside the page's directory (a block may list it)
    for i, p in enumerate(procs):
        p.update(cwd=cwd, stdout=os.path.join(logs, f"out-{i}"), stderr=os.path.join(logs, f"err-{i}"))
    before = _memory_dirs()
    try:
        ans = _zygote.server(env, job_vars=_zygote.TORCHRUN_JOB_VARS).run(procs, BLOCK_TIMEOUT_S)
    finally:
        if job:
            _remove_memory_dirs(before, cwd)
        outs, errs = [], []
        for p in procs:
            for path, into in ((p["stdout"], outs), (p["stderr"], errs)):
                try:
                    with open(path, errors="replace") as f:
                        into.append(f.read())
                except OSError:
                    into.append("")
        shutil.rmtree(logs, ignore_errors=True)
    if ans["timed_out"]:
        raise subprocess.TimeoutExpired(what, BLOCK_TIMEOUT_S, "".join(outs), "".join(errs))
    codes = ans["codes"]
    bad = 0 if ans["first_failed"] is None else codes[ans["first_failed"]]  # the cause, as torchrun reports it
    label = (lambda i: f"[rank {i}] ") if ranks else (lambda i: "")
    _check(bad, "".join(label(i) + o for i, o in enumerate(outs) if o), "".join(label(i) + e for i, e in enumerate(errs) if e), what)


def run_block(block: Block, cwd: str) -> Optional[str]:
    """Run one block in ``cwd``; returns the skip reason for a skipped block, else None (raises AssertionError on failure)."""
    if "skip" in block.options:
        return block.options["skip"]
    fixtures = [f for f in block.options.get("fixtures", "").split(",") if f]
    forked = os.environ.get("SHARDCKPT_TEST_SNIPPETS") != "subprocess"
    if fixtures:
        code, what = f"import snippet_preamble as p; p.make_fixtures({fixtures!r})", f"{block.where}: fixtures {fixtures}"
        if forked:
            _fork_run(cwd, what, code=code)
        else:
            _run([sys.executable, "-c", code], cwd, what)
    if block.lang == "bash":
        script = os.path.join(cwd, f".snippet-{block.line}.sh")
        with open(script, "w") as f:
            f.write("set -euo pipefail\n" + block.code)
        _run(["bash", script], cwd, block.where)
        return None
    script = os.path.join(cwd, f".snippet-{block.line}.py")
    head = "" if block.options.get("preamble") == "none" else "from snippet_preamble import *  # noqa\n"
    with open(script, "w") as f:
        f.write(head + block.code)
    runs = 2 if ".restore(" in block.code and "once" not in block.options else 1
    for i in range(runs):
        job = f"snippet-{uuid.uuid4().hex[:12]}"
        what = block.where + (" (run again as a new job: the resume)" if i else "")
        n = int(block.options.get("torchrun") or 0)
        if forked:
            _fork_run(cwd, what, job, script=script, ranks=n)
            continue
        cmd = [sys.executable, script]
        if n:
            cmd = [sys.executable, "-m", "torch.distributed.run", "--nnodes=1", f"--nproc-per-node={n}", "--rdzv-backend=c10d",
                   "--rdzv-endpoint=localhost:0", f"--rdzv-id={job}", script]
        _run(cmd, cwd, what, job)
    return None


def run_page(path: str, cwd: str) -> List[str]:
    """Run every block of a page in order in ``cwd``; returns the skip notes ("file:line: reason")."""
    skipped = []
    for block in page_blocks(path):
        reason = run_block(block, cwd)
        if reason is not None:
            skipped.append(f"{block.where}: {reason}")
    return skipped
