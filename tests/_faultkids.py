"""The one harness of the process-kill tests (tests/faults/, tests/dist/test_faults.py): children, kills, waits.

A child is a real process running a module-level function of the test file,
forked from the fork server of tests/_dist.py (a fresh interpreter that only
imported torch: no process group, no thread ran in it). A child that
SIGKILLs itself, hangs or holds a gloo group is as real as a spawned
``python`` one, but dozens per test no longer cost a torch import each
(~2-3 s of CPU apiece on a 2-core box). ``SHARDCKPT_TEST_SPAWN=1`` spawns
fresh interpreters instead (tests/_dist.py).

Every child is bounded: ``finish`` fails the test, naming the hang, when a
child runs past its time instead of hanging the suite. A child's stdout and
stderr (Python's and the C libraries') go to a private file (0600 in a 0700
directory) that ``finish`` returns as text, so a test reads a child's
``RESULT {json}`` line (``result``) or its output on failure.

The fault arming helpers (``die``, ``then_die``, ``die_mid_data_file``,
``die_at_manifest_rename``) patch the engine inside a child (the library has
no test hooks); ``join_group`` starts a child's gloo rank.

``spawn(script, *args)`` (a fresh ``python script child ARGS``) stays for a
test that needs a new interpreter; ``finish`` and ``result`` take either.
"""

from __future__ import annotations

import atexit
import json
import os
import shutil
import signal
import subprocess
import sys
import tempfile
from typing import Any, Callable, Dict, List, Optional, Tuple, Union

import pytest

TESTS = os.path.dirname(os.path.abspath(__file__))
#: Default bound of one child: a hang fails the cell instead of the suite.
CHILD_TIMEOUT_S = 240.0


def _child_env(extra: Optional[Dict[str, str]]) -> Dict[str, str]:
    env = dict(os.environ, PYTHONPATH=TESTS + os.pathsep + os.environ.get("PYTHONPATH", ""), CUDA_VISIBLE_DEVICES="")
    env.update(extra or {})
    return env


def _bootstrap(fn: Callable[..., Any], args: Tuple[Any, ...], out_path: str, env: Dict[str, str]) -> None:
    # Runs in the child: its output to the private file (the fork server's
    # fd 1/2 are whatever pytest's capture was when it started), the test's
    # environment as of the start (the fork server's is older).
    fd = os.open(out_path, os.O_WRONLY | os.O_APPEND | os.O_NOFOLLOW)
    os.dup2(fd, 1)
    os.dup2(fd, 2)
    os.close(fd)
    os.environ.clear()
    os.environ.update(env)
    if TESTS not in sys.path:
        sys.path.insert(0, TESTS)
    fn(*args)
    sys.stdout.flush()
    sys.stderr.flush()


class Child:
    """A started child: ``proc`` (a ``multiprocessing`` process) and the file its output goes to."""

    def __init__(self, proc: Any, out_dir: str, out_path: str):
        self.proc = proc
        self.out_dir = out_dir
        self.out_path = out_path

    @property
    def pid(self) -> int:
        return self.proc.pid

    def poll(self) -> Optional[int]:
        """The exit code (``-9`` after a SIGKILL), or None while it runs."""
        return self.proc.exitcode

    def kill(self) -> None:
        if self.proc.exitcode is None:
            os.kill(self.proc.pid, signal.SIGKILL)

    def wait(self, timeout: Optional[float] = None) -> Optional[int]:
        self.proc.join(timeout)
        return self.proc.exitcode

    def output(self) -> str:
        """What the child printed so far (all of it once it ended)."""
        with open(self.out_path, errors="replace") as f:
            return f.read()

    def close(self) -> str:
        """The whole output; the file is removed (the child must have ended)."""
        try:
            return self.output()
        finally:
            shutil.rmtree(self.out_dir, ignore_errors=True)
            if self in _STARTED:
                _STARTED.remove(self)


def start(fn: Callable[..., Any], *args: Any, env: Optional[Dict[str, str]] = None) -> Child:
    """Run ``fn(*args)`` in a new child process; returns at once.

    Args:
        fn: a module-level function (the child unpickles it by name).
        args: picklable arguments.
        env: variables set in the child on top of the test's environment
            (which the child gets with tests/ on ``PYTHONPATH`` and no GPU).

    The child's exit code is 0 when ``fn`` returns, 1 when it raises (the
    traceback is in its output), ``n`` after ``os._exit(n)``, ``-9`` after a
    SIGKILL. Pair with ``finish``.
    """
    from _dist import close_pools_of_other_tests, process_context

    close_pools_of_other_tests()  # idle beside this child otherwise
    out_dir = tempfile.mkdtemp(prefix="shardckpt-faultkid-")  # 0700, new: no symlink can be in the way
    out_path = os.path.join(out_dir, "out")
    os.close(os.open(out_path, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600))
    proc = process_context().Process(target=_bootstrap, args=(fn, args, out_path, _child_env(env)), daemon=True)
    proc.start()
    child = Child(proc, out_dir, out_path)
    _STARTED.append(child)
    return child


#: Children not yet cleaned up: a test that failed before ``finish`` leaves
#: no process running and no output file behind when the session ends.
_STARTED: List[Child] = []


@atexit.register
def _cleanup() -> None:
    for child in _STARTED:
        child.kill()
        child.wait(5)
        shutil.rmtree(child.out_dir, ignore_errors=True)
    _STARTED.clear()


def spawn(script: str, *args: Any) -> subprocess.Popen:
    """Start ``python script child <args as JSON>`` (a fresh interpreter) with tests/ importable and no GPU."""
    return subprocess.Popen(
        [sys.executable, os.path.abspath(script), "child", json.dumps(args)],
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
        env=_child_env(None),
    )


def finish(p: Union[Child, subprocess.Popen], timeout_s: float = CHILD_TIMEOUT_S, what: str = "child") -> Tuple[int, str]:
    """``(exit code, output)`` of a child; the test fails if it runs past ``timeout_s`` (a hang)."""
    if isinstance(p, subprocess.Popen):
        try:
            out, _ = p.communicate(timeout=timeout_s)
        except subprocess.TimeoutExpired:
            p.kill()
            out, _ = p.communicate()
            pytest.fail(f"{what} did not finish within {timeout_s}s (hang):\n{out}")
        return p.returncode, out
    if p.wait(timeout_s) is None:
        p.kill()
        p.wait()
        pytest.fail(f"{what} did not finish within {timeout_s}s (hang):\n{p.close()}")
    return p.poll(), p.close()  # type: ignore[return-value]


def result(out: str) -> Optional[Any]:
    """The JSON of the child's last ``RESULT `` line, or None."""
    lines = [ln for ln in out.splitlines() if ln.startswith("RESULT ")]
    return json.loads(lines[-1][7:]) if lines else None


# --------------------------------------------------------------------------
# inside a child


def join_group(rank: int, world: int, port: int, timeout_s: float = 60.0) -> None:
    """Make this child gloo rank ``rank`` of ``world`` (rendezvous on loopback ``port``), one CPU thread."""
    from datetime import timedelta

    import torch
    import torch.distributed as dist

    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), RANK=str(rank), WORLD_SIZE=str(world))
    torch.set_num_threads(1)
    dist.init_process_group("gloo", rank=rank, world_size=world, timeout=timedelta(seconds=timeout_s))


def die() -> None:
    """SIGKILL this process now (its output flushed first): no cleanup, no ``finally``, no atexit."""
    sys.stdout.flush()
    sys.stderr.flush()
    os.kill(os.getpid(), signal.SIGKILL)


def then_die(real: Callable[..., Any]) -> Callable[..., Any]:
    """``real`` that SIGKILLs the process once it returned."""

    def wrapped(*a, **kw):
        out = real(*a, **kw)
        die()
        return out

    return wrapped


def die_mid_data_file() -> None:
    """SIGKILL this process with a data file's header and one block durable on disk (small write blocks)."""
    from shardckpt import _knobs
    from shardckpt._storage import _local

    _knobs.WRITE_BLOCK_BYTES = 1024
    real = _local._LocalWriter.write
    calls = [0]

    def write(self, data):
        calls[0] += 1
        if calls[0] == 3:  # header and one block are on disk
            os.fsync(self.fd)
            die()
        real(self, data)

    _local._LocalWriter.write = write


def die_at_manifest_rename() -> None:
    """SIGKILL this process with the temporary manifest written and fsynced, not renamed (the commit point)."""
    from shardckpt._storage import _local

    real_replace = os.replace

    def replace(src, dst, *a, **kw):
        if str(dst).endswith("manifest.json"):
            die()
        return real_replace(src, dst, *a, **kw)

    _local.os.replace = replace
