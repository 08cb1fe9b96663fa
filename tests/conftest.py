import fcntl
import os
import sys
import tempfile

import pytest

# Tests import helpers (tests/_dist.py, tests/models.py) as top-level modules,
# also inside spawned rank processes, which inherit PYTHONPATH.
HERE = os.path.dirname(os.path.abspath(__file__))
if HERE not in sys.path:
    sys.path.insert(0, HERE)
os.environ["PYTHONPATH"] = HERE + os.pathsep + os.environ.get("PYTHONPATH", "")

import _dist  # noqa: E402  (tests/ is on sys.path now)

#: Test processes of a whole-suite run (``pytest`` with no paths: CI and the
#: README's command) when pytest-xdist is installed. Runs of chosen files stay
#: in one process (no worker start-up for a few tests); ``-n N`` or
#: ``SHARDCKPT_TEST_WORKERS=N`` chooses, ``-n 0`` or ``-p no:xdist`` turns it off.
SUITE_WORKERS = 2


@pytest.hookimpl(tryfirst=True)  # before xdist's own, which reads -n
def pytest_cmdline_main(config):
    if not config.pluginmanager.hasplugin("xdist") or hasattr(config, "workerinput"):
        return None
    if config.option.numprocesses is not None:  # -n given
        return None
    workers = os.environ.get("SHARDCKPT_TEST_WORKERS")
    if workers is None and config.args_source != pytest.Config.ArgsSource.TESTPATHS:
        return None
    config.option.numprocesses = int(workers) if workers is not None else SUITE_WORKERS
    if getattr(config.option, "dist", "no") in ("no", "load"):
        # A worker that runs out of tests takes some of the other's queue: with
        # plain "load", the slow cases left at the end of one worker's queue ran
        # for minutes while the other sat idle (CI, 2026-11-28).
        config.option.dist = "worksteal"
    return None


def pytest_runtest_logstart(nodeid, location):
    _dist.trace("start", nodeid)  # for benchmarks/suite_memory.py: which test ran when


#: Per test file: whether it calls ``run_ranks`` (its text names it).
_USES_POOLS: dict = {}


@pytest.hookimpl(tryfirst=True)
def pytest_runtest_setup(item):
    # The rank pools of tests/_dist.py outlive their tests (a pool is reused
    # across a file's tests); a test of a file that never calls run_ranks
    # would only keep them idle beside its own processes (issue 47).
    path = str(item.path)
    uses = _USES_POOLS.get(path)
    if uses is None:
        try:
            with open(path, encoding="utf-8") as f:
                uses = "run_ranks" in f.read()
        except OSError:
            uses = True
        _USES_POOLS[path] = uses
    _dist.on_test_start(uses_pools=uses)


def pytest_runtest_logfinish(nodeid, location):
    # After the test's teardown: the C heap's free pages back to the kernel,
    # so a test process's RSS is what it holds, not its high-water mark.
    _dist.give_back_freed_memory()
    _dist.trace("end", nodeid)


# Tests marked ``exclusive`` (the 16-rank reshard, the peak-RSS loads: 4-5 GiB
# of processes each) run while the other test process runs nothing: beside
# the other's heaviest tests the suite's summed RSS passed 8 GB (issue 47).
# Every test takes a shared lock of the run's lock file, an exclusive test an
# exclusive one; a "gate" lock taken first lets a waiting exclusive test in
# before the other process's next tests (flock alone would let their shared
# locks starve it). The files are the run's own (xdist's run id), 0600, never
# followed through a link; a crashed worker's locks go with its process.
_LOCKS: dict = {}


def _lock_fds(config):
    wi = getattr(config, "workerinput", None)
    if wi is None:
        return None  # one test process: nothing runs beside it
    if not _LOCKS:
        base = os.path.join(tempfile.gettempdir(), f"shardckpt-tests-{os.getuid()}-{wi['testrunuid']}")
        for kind in ("run", "gate"):
            fd = os.open(f"{base}.{kind}.lock", os.O_RDWR | os.O_CREAT | os.O_NOFOLLOW | os.O_CLOEXEC, 0o600)
            if os.fstat(fd).st_uid != os.getuid():
                os.close(fd)
                raise RuntimeError(f"{base}.{kind}.lock belongs to another user")
            _LOCKS[kind] = (fd, f"{base}.{kind}.lock")
    return _LOCKS["run"][0], _LOCKS["gate"][0]


@pytest.hookimpl(hookwrapper=True)
def pytest_runtest_protocol(item, nextitem):
    fds = _lock_fds(item.config)
    if fds is None:
        yield
        return
    run, gate = fds
    if item.get_closest_marker("exclusive") is not None:
        fcntl.flock(gate, fcntl.LOCK_EX)
        fcntl.flock(run, fcntl.LOCK_EX)
        fcntl.flock(gate, fcntl.LOCK_UN)
    else:
        fcntl.flock(gate, fcntl.LOCK_SH)  # behind an exclusive test waiting for its turn
        fcntl.flock(gate, fcntl.LOCK_UN)
        fcntl.flock(run, fcntl.LOCK_SH)
    try:
        yield
    finally:
        fcntl.flock(run, fcntl.LOCK_UN)


def pytest_sessionfinish(session, exitstatus):
    for fd, path in _LOCKS.values():
        os.close(fd)
        try:
            os.unlink(path)  # the other worker keeps its open files (and its locks) until it ends
        except OSError:
            pass
    _LOCKS.clear()
