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
(``-N`` for a signal, as ``subprocess`` reports) and which failed first,
after all ended. When one
exits non-zero the others are stopped (SIGTERM, then SIGKILL), as torchrun
does (unless the request says ``"stop_peers": false``); past ``timeout`` all
are killed and the answer says so.
"""

from __future__ import annotations

import atexit
import gc
import importlib
import json
import os
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from typing import Any, Dict, List, Optional, Tuple

TESTS = os.path.dirname(os.path.abspath(__file__))

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
#: Fork servers alive at once in one test process: the last used only. Each
#: holds 0.5-0.65 GB (torch and the preloads); kept one per environment until
#: the test process ended, they added up to GBs of a suite run (17 GB of RSS
#: on a 24 GB box, servers started 20 minutes earlier among them: issue 47).
MAX_SERVERS = 1
#: A server with no request for this long exits by itself (the tests that used
#: it are over). The client never sends to one idle for more than half of it,
#: so no request races the exit; it starts a new one instead.
IDLE_EXIT_S = 120.0


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


def _wait(pids: List[int], timeout: float, stop_peers: bool) -> Dict[str, Any]:
    codes: Dict[int, int] = {}
    deadline = time.monotonic() + timeout
    term_at = None
    timed_out = False
    first = None  # the process that failed first: the cause (the others may have been stopped for it)
    while len(codes) < len(pids):
        for pid in pids:
            if pid in codes:
                continue
            done, status = os.waitpid(pid, os.WNOHANG)
            if done:
                codes[pid] = _code(status)
                if codes[pid] != 0 and first is None:
                    first = pids.index(pid)
        if len(codes) == len(pids):
            break
        now = time.monotonic()
        failed = stop_peers and any(c != 0 for c in codes.values())
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
    return {"codes": [codes[p] for p in pids], "first_failed": first, "timed_out": timed_out}


def _signal(pid: int, sig: int) -> None:
    try:
        os.killpg(pid, sig)  # the child leads its own group: what it started goes too
    except OSError:
        pass


def _serve(idle_exit_s: float = IDLE_EXIT_S) -> Optional[Dict[str, Any]]:
    """Answer requests until stdin closes or none came for ``idle_exit_s`` (returns None); in a forked child, return its job."""
    import select

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
        # One request at a time, answered before the next is written: nothing
        # waits in sys.stdin's buffer when the descriptor is polled.
        ready, _, _ = select.select([sys.stdin], [], [], idle_exit_s)
        if not ready:
            return None  # idle: the tests that used this server are over
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
        sys.stdout.write(json.dumps(_wait(pids, req["timeout"], req.get("stop_peers", True))) + "\n")
        sys.stdout.flush()


def _become(job: Dict[str, Any]) -> Dict[str, Any]:
    """Set this forked child up as ``python <script>`` (or ``python -c <code>``) would start."""
    import types

    fd = os.open(os.devnull, os.O_RDONLY)
    os.dup2(fd, 0)
    os.close(fd)
    for target, path in ((1, job["stdout"]), (2, job["stderr"])):
        fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_APPEND, 0o600)
        os.dup2(fd, target)
        os.close(fd)
    # sys.stdin/stdout/stderr stay the objects python made at start-up, on
    # fds 0-2 (pipes then, the files now; buffering as for a file), flushed
    # empty before the fork.
    os.chdir(job["cwd"])
    os.environ.clear()
    os.environ.update(job["env"])
    argv = job.get("argv") or ([job["script"]] if "script" in job else ["-c", job["code"]])
    main = types.ModuleType("__main__")
    main.__dict__["__builtins__"] = __builtins__
    if argv[0] == "-m":  # as python -m: runpy finds the module and runs it as __main__
        sys.argv = [argv[1], *argv[2:]]  # runpy sets argv[0] to the module's file
        sys.path[0] = os.getcwd()
        return {"code": compile("import runpy as _r; _r._run_module_as_main(%r)" % argv[1], "<run_module>", "exec"),
                "globals": main.__dict__, "main": main}
    if argv[0] == "-c":
        sys.argv = ["-c", *argv[2:]]
        sys.path[0] = ""
        source, filename = argv[1], "<string>"
    else:
        script = os.path.abspath(argv[0])
        sys.argv = list(argv)
        sys.path[0] = os.path.dirname(script)
        with open(script) as f:
            source, filename = f.read(), script
        main.__file__ = script
    return {"code": compile(source, filename, "exec"), "globals": main.__dict__, "main": main}


# ---------------------------------------------------------------------------
# The client side, for the test process (tests/snippets.py, tests/e2e/test_cli.py).

_SERVERS: Dict[tuple, "Server"] = {}


class Server:
    """A running tests/_zygote.py server: forks ``python script.py`` processes from an interpreter that imported torch."""

    def __init__(self, env: Dict[str, str], idle_exit_s: Optional[float] = None):
        self.idle_exit_s = IDLE_EXIT_S if idle_exit_s is None else idle_exit_s
        self.proc = subprocess.Popen([sys.executable, os.path.join(TESTS, "_zygote.py"), "--idle-exit", str(self.idle_exit_s)],
                                     cwd=TESTS, env=env, stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True)
        hello = self._answer(120)
        if not hello.get("ready"):
            self.close()
            raise RuntimeError(f"the snippet fork server did not start: {hello.get('error')}")
        self.last_used = time.monotonic()

    def usable(self) -> bool:
        """Alive, and not so long idle that it may be exiting on its own (``IDLE_EXIT_S``)."""
        return self.proc.poll() is None and time.monotonic() - self.last_used < self.idle_exit_s / 2

    def _answer(self, timeout: float) -> dict:
        import select

        assert self.proc.stdout is not None
        ready, _, _ = select.select([self.proc.stdout], [], [], timeout)
        line = self.proc.stdout.readline() if ready else ""
        if not line:
            code = self.proc.poll()
            self.close()
            raise RuntimeError(f"the snippet fork server {'exited ' + str(code) if code is not None else 'did not answer'}")
        return json.loads(line)

    def run(self, procs: List[dict], timeout: float, stop_peers: bool = True) -> dict:
        assert self.proc.stdin is not None
        self.proc.stdin.write(json.dumps({"procs": procs, "timeout": timeout, "stop_peers": stop_peers}) + "\n")
        self.proc.stdin.flush()
        try:
            return self._answer(timeout + 60)
        finally:
            self.last_used = time.monotonic()

    def close(self) -> None:
        try:
            if self.proc.stdin is not None:
                self.proc.stdin.close()
            self.proc.wait(timeout=10)
        except Exception:
            self.proc.kill()


@atexit.register
def _stop_servers() -> None:
    for z in list(_SERVERS.values()):
        z.close()
    _SERVERS.clear()


def server(env: Dict[str, str], job_vars: Tuple[str, ...] = ()) -> Server:
    """The server for ``env`` (started on first use, one per base environment, stopped at exit).

    A child's environment is its own (the request's), but what the server
    read at import (shardckpt's knobs, torch's settings) came from the
    server's: every variable but ``job_vars`` must match, so another base
    environment gets another server. The variables torchrun adds
    (``torchrun_envs``) may be missing from the server's: they are read at
    run time (``init_process_group``, shardckpt's calls), not at import.
    """
    from _dist import close_pools_of_other_tests

    close_pools_of_other_tests()  # rank pools a test before left would sit idle beside this one's processes
    base = {k: v for k, v in env.items() if k not in job_vars}
    key = tuple(sorted(base.items()))
    z = _SERVERS.get(key)
    if z is not None and not z.usable():
        z.close()
        z = None
    # The least recently used others go first: at most MAX_SERVERS alive, this one included.
    others = sorted((k for k in _SERVERS if k != key), key=lambda k: _SERVERS[k].last_used)
    for other in others[: max(0, len(others) - (MAX_SERVERS - 1))]:
        _SERVERS.pop(other).close()
    if z is None:
        _SERVERS.pop(key, None)
        z = _SERVERS[key] = Server(base)
    return z


def live_servers() -> List[int]:
    """The pids of this process's fork servers still running (tests of the limits above)."""
    return [z.proc.pid for z in _SERVERS.values() if z.proc.poll() is None]


def run_many(argv: List[str], envs: List[Dict[str, str]], *, cwd: str, job_vars: Tuple[str, ...], timeout: float,
             stop_peers: bool = False, base_env: Optional[Dict[str, str]] = None) -> Tuple[List[int], List[str]]:
    """``python *argv`` once per environment in ``envs``, all at once (ranks): (exit codes, outputs) in that order.

    Each output is the process's stdout and stderr together, as with
    ``stderr=subprocess.STDOUT``. The environments may differ only in
    ``job_vars`` (one server), or ``base_env`` is the server's environment
    (``torchrun_envs`` adds to it only what torchrun sets, read at run time).
    ``stop_peers=True`` stops the others when one fails, as torchrun does.
    Raises ``subprocess.TimeoutExpired``.
    """
    logs = tempfile.mkdtemp(prefix="zygote-logs-")
    procs = [{"argv": list(argv), "cwd": cwd, "env": e, "stdout": os.path.join(logs, f"out-{i}"),
              "stderr": os.path.join(logs, f"out-{i}")} for i, e in enumerate(envs)]
    outs = []
    try:
        ans = server(base_env or envs[0], job_vars).run(procs, timeout, stop_peers)
        for p in procs:
            with open(p["stdout"], errors="replace") as f:
                outs.append(f.read())
    finally:
        shutil.rmtree(logs, ignore_errors=True)
    if ans["timed_out"]:
        raise subprocess.TimeoutExpired(argv, timeout, "".join(outs))
    return ans["codes"], outs


#: What torchrun sets per worker beyond the job's environment (one node; the
#: rest of torchrun's variables are the same for every worker).
TORCHRUN_JOB_VARS = ("RANK", "LOCAL_RANK", "ROLE_RANK", "MASTER_PORT", "TORCHELASTIC_RUN_ID")


def torchrun_envs(env: Dict[str, str], nproc: int, run_id: str) -> List[Dict[str, str]]:
    """The environments ``torchrun --nnodes=1 --nproc-per-node=nproc`` gives its workers (by rank).

    Rank 0 hosts the rendezvous store (``TORCHELASTIC_USE_AGENT_STORE`` is
    not set: there is no agent), on a free loopback port.
    """
    from _dist import free_port

    port = str(free_port())
    return [dict(env, RANK=str(r), LOCAL_RANK=str(r), GROUP_RANK="0", ROLE_RANK=str(r), ROLE_NAME="default",
                 WORLD_SIZE=str(nproc), LOCAL_WORLD_SIZE=str(nproc), ROLE_WORLD_SIZE=str(nproc), GROUP_WORLD_SIZE="1",
                 MASTER_ADDR="localhost", MASTER_PORT=port, TORCHELASTIC_RUN_ID=run_id, TORCHELASTIC_RESTART_COUNT="0",
                 TORCHELASTIC_MAX_RESTARTS="0", TORCH_NCCL_ASYNC_ERROR_HANDLING="1", OMP_NUM_THREADS=env.get("OMP_NUM_THREADS", "1"))
            for r in range(nproc)]


def run(argv: List[str], *, cwd: str, env: Dict[str, str], timeout: float = 300) -> Tuple[int, str, str]:
    """``subprocess.run([sys.executable, *argv], ...)`` as a fork of the server: (exit code, stdout, stderr).

    ``argv`` is ``[script, args...]``, ``["-c", code, args...]`` or
    ``["-m", module, args...]``. Raises ``subprocess.TimeoutExpired``.
    """
    logs = tempfile.mkdtemp(prefix="zygote-logs-")
    proc = {"argv": list(argv), "cwd": cwd, "env": env, "stdout": os.path.join(logs, "out"), "stderr": os.path.join(logs, "err")}
    try:
        ans = server(env).run([proc], timeout)
        with open(proc["stdout"], errors="replace") as f:
            out = f.read()
        with open(proc["stderr"], errors="replace") as f:
            err = f.read()
    finally:
        shutil.rmtree(logs, ignore_errors=True)
    if ans["timed_out"]:
        raise subprocess.TimeoutExpired(argv, timeout, out, err)
    return ans["codes"][0], out, err



if __name__ == "__main__":
    _idle = float(sys.argv[sys.argv.index("--idle-exit") + 1]) if "--idle-exit" in sys.argv else IDLE_EXIT_S
    _job = _serve(_idle)
    if _job is None:
        sys.exit(0)
    _run = _become(_job)
    del _job
    sys.modules["__main__"] = _run["main"]
    exec(_run["code"], _run["globals"])  # at the top level: an exception or exit ends the child as it ends python
