import os
import sys

import pytest

# Tests import helpers (tests/_dist.py, tests/models.py) as top-level modules,
# also inside spawned rank processes, which inherit PYTHONPATH.
HERE = os.path.dirname(os.path.abspath(__file__))
if HERE not in sys.path:
    sys.path.insert(0, HERE)
os.environ["PYTHONPATH"] = HERE + os.pathsep + os.environ.get("PYTHONPATH", "")

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


#: Set by benchmarks/suite_memory.py: a folder where each test process appends
#: ``<time> <pid> start|end <test id>`` lines (``<worker>.log``: gw0, gw1, or
#: main; an xdist controller's lines repeat its workers'), so the memory
#: measurement can say which test each process ran at the peak.
TRACE_DIR = os.environ.get("SHARDCKPT_SUITE_TRACE")

if TRACE_DIR:
    import time as _time

    def _trace(what, nodeid):
        name = os.environ.get("PYTEST_XDIST_WORKER", "main")
        with open(os.path.join(TRACE_DIR, f"{name}.log"), "a") as f:
            f.write(f"{_time.time():.2f} {os.getpid()} {what} {nodeid}\n")

    def pytest_runtest_logstart(nodeid, location):
        _trace("start", nodeid)

    def pytest_runtest_logfinish(nodeid, location):
        _trace("end", nodeid)
