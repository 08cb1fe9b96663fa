"""A fork server for the doc snippets (tests/snippets.py): ``python script.py`` without the torch import each time.

Every README/docs block used to run as a fresh ``python`` (or ``torchrun``)
process that spent 1.5-2.5 s of CPU importing torch before its three lines
ran; on a 2-core box the snippet pages were a fifth of the suite. This
module, run as a script, imports the heavy modules once (``PRELOAD``) and
then forks one child per process asked for. Each child is still a process
of its own, set up as ``python script.py`` would be: its own working
directory, environment (``os.environ`` replaced, so C ``getenv`` sees it
too), ``sys.argv``, ``sys.path[0]``, a fresh ``__main__`` module and
stdin/stdout/stderr on the files given. The script then runs at the top
level of the child's interpreter, so it ends as ``python`` ends: an uncaught
exception prints its traceback and exits 1, ``sys.exit`` sets the code, and
the normal shutdown runs (non-daemon threads joined, ``atexit`` handlers,
module teardown), which is where an exit-time abort would show.

The server stays pristine: it only imports (no process group, no thread
pool, no tensor op), as ``multiprocessing``'s forkserver does for the rank
harness (tests/_dist.py). Importing torch starts one native thread in every
process; the server checks that preloading started no other.

Protocol (one JSON line each way on stdin/stdout): a request is a list of
processes ``{"script" | "code", "cwd", "env", "stdout", "stderr"}`` started
together (the ranks of one ``torchrun``); the answer is their exit codes
(``-N`` for a signal, as ``subprocess`` reports), after all ended. When one
exits non-zero the others are stopped (SIGTERM, then SIGKILL), as torchrun
does; past ``timeout`` all are killed and the answer says so.
"""

from __future__ import annotations

import gc
import importlib
import json
import os
import signal
import sys
import time
from typing import Any, Dict, List, Optional

#: What a snippet imports before its first line runs (the preamble's imports
#: and what a save/load pulls in). Importing only: nothing here may start a
#: thread or a process group.
PRELOAD = (
    "torch",
    "torch.nn",
    "torch.optim",
    "torch.distributed",
    "torch.distributed.fsdp",
    "torch.distributed.checkpoint",
    "torch.distributed.checkpoint.state_dict",
    "torch.distributed.tensor",
    "safetensors",
    "safetensors.torch",
    "torch._dynamo",  # the optimizer's first step and GradScaler import these (~1 s)
    "torch._inductor.config",
    "torch.onnx",
    "torch._numpy",
    "torch.nn.utils._expanded_weights",
    "shardckpt",
    "shardckpt.converters",
    "shardckpt._save",
    "shardckpt._load",
    "shardckpt._replicas",
    "blake3",
)
#: After a peer failed, how long the other processes get after SIGTERM.
TERM_GRACE_S = 5.0


def _threads() -> int:
    try:
        return len(os.listdir("/proc/self/task"))
    except OSError:
        return 0


def _preload() -> Optional[str]:
    """Import ``PRELOAD``; returns an error line, or None."""
    import torch  # noqa: F401  (one native thread of its own, in every process that imports it)

    base = _threads()
    for name in PRELOAD:
        try:
            importlib.import_module(name)
        except Exception as e:  # an optional module missing: the child imports it itself
            print(f"zygote: not preloaded {name}: {type(e).__name__}: {e}", file=sys.stderr)
    if _threads() > base:
        return f"preloading started threads ({base} -> {_threads()}): a fork of this process is not safe"
    return None


def _code(status: int) -> int:
    return -os.WTERMSIG(status) if os.WIFSIGNALED(status) else os.WEXITSTATUS(status)


def _wait(pids: List[int], timeout: float) -> Dict[str, Any]:
    codes: Dict[int, int] = {}
    deadline = time.monotonic() + timeout
    term_at = None
    timed_out = False
    while len(codes) < len(pids):
        for pid in pids:
            if pid in codes:
                continue
            done, status = os.waitpid(pid, os.WNOHANG)
            if done:
                codes[pid] = _code(status)
        if len(codes) == len(pids):
            break
        now = time.monotonic()
        failed = any(c != 0 for c in codes.values())
        if (failed or now > deadline) and term_at is None:
            timed_out = not failed
            term_at = now
            for pid in pids:
                if pid not in codes:
                    _signal(pid, signal.SIGKILL if timed_out else signal.SIGTERM)
        elif term_at is not None and now > term_at + TERM_GRACE_S:
            for pid in pids:
                if pid not in codes:
                    _signal(pid, signal.SIGKILL)
        time.sleep(0.02)
    return {"codes": [codes[p] for p in pids], "timed_out": timed_out}


def _signal(pid: int, sig: int) -> None:
    try:
        os.killpg(pid, sig)  # the child leads its own group: what it started goes too
    except OSError:
        pass


def _serve() -> Optional[Dict[str, Any]]:
    """Answer requests until stdin closes (returns None); in a forked child, return its job."""
    err = _preload()
    sys.stdout.write(json.dumps({"ready": err is None, "error": err, "pid": os.getpid()}) + "\n")
    sys.stdout.flush()
    if err:
        return None
    # What the server imported is never garbage: out of the collector's sight,
    # a child's collections (and its exit) do not touch, and so copy, those
    # pages (a child's exit took 0.9 s, 0.3 s with this).
    gc.freeze()
    while True:
        line = sys.stdin.readline()
        if not line:
            return None
        req = json.loads(line)
        sys.stdout.flush()
        sys.stderr.flush()
        pids = []
        for job in req["procs"]:
            pid = os.fork()
            if pid == 0:
                os.setpgid(0, 0)
                return job
            pids.append(pid)
        sys.stdout.write(json.dumps(_wait(pids, req["timeout"])) + "\n")
        sys.stdout.flush()


def _become(job: Dict[str, Any]) -> Dict[str, Any]:
    """Set this forked child up as ``python <script>`` (or ``python -c <code>``) would start."""
    import io
    import types

    fd = os.open(os.devnull, os.O_RDONLY)
    os.dup2(fd, 0)
    os.close(fd)
    for target, path in ((1, job["stdout"]), (2, job["stderr"])):
        fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_APPEND, 0o600)
        os.dup2(fd, target)
        os.close(fd)
    sys.stdin = io.TextIOWrapper(io.FileIO(0, "r", closefd=False))
    sys.stdout = io.TextIOWrapper(io.FileIO(1, "w", closefd=False), line_buffering=False, write_through=False)
    sys.stderr = io.TextIOWrapper(io.FileIO(2, "w", closefd=False), errors="backslashreplace", line_buffering=True)
    sys.__stdin__, sys.__stdout__, sys.__stderr__ = sys.stdin, sys.stdout, sys.stderr
    os.chdir(job["cwd"])
    os.environ.clear()
    os.environ.update(job["env"])
    main = types.ModuleType("__main__")
    if "script" in job:
        script = os.path.abspath(job["script"])
        sys.argv = [job["script"]]
        sys.path[0] = os.path.dirname(script)
        with open(script) as f:
            source, filename = f.read(), script
        main.__file__ = script
    else:
        sys.argv = ["-c"]
        sys.path[0] = ""
        source, filename = job["code"], "<string>"
    main.__dict__["__builtins__"] = __builtins__
    sys.modules["__main__"] = main
    return {"code": compile(source, filename, "exec"), "globals": main.__dict__}


if __name__ == "__main__":
    _job = _serve()
    if _job is None:
        sys.exit(0)
    _run = _become(_job)
    del _job
    exec(_run["code"], _run["globals"])  # at the top level: an exception or exit ends the child as it ends python
