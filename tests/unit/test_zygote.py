"""tests/_zygote.py (the snippet and CLI tests' fork server): a fork runs as ``python`` would run it."""

import os
import sys
import textwrap

import _zygote
import pytest

SCRIPT = textwrap.dedent('''
    import atexit, json, os, sys
    atexit.register(lambda: print("atexit ran", flush=True))
    print(json.dumps({"argv": sys.argv, "cwd": os.getcwd(), "var": os.environ.get("ZYGOTE_TEST_VAR"),
                      "getenv": os.popen("echo $ZYGOTE_TEST_VAR").read().strip(), "main": __name__,
                      "path0": sys.path[0], "file": __file__}))
    sys.stdout.flush()
    if len(sys.argv) > 1 and sys.argv[1] == "fail":
        raise KeyError("from the script")
    sys.exit(int(sys.argv[1]) if len(sys.argv) > 1 else 0)
''')


def test_a_fork_runs_a_script_as_python_does(tmp_path):
    import json

    script = tmp_path / "s.py"
    script.write_text(SCRIPT)
    work = tmp_path / "work"
    work.mkdir()
    env = dict(os.environ, ZYGOTE_TEST_VAR="x1")
    code, out, err = _zygote.run([str(script), "7"], cwd=str(work), env=env)
    got = json.loads(out.splitlines()[0])
    assert code == 7 and out.splitlines()[1] == "atexit ran", (code, out, err)
    assert got == {"argv": [str(script), "7"], "cwd": str(work), "var": "x1", "getenv": "x1", "main": "__main__",
                   "path0": str(tmp_path), "file": str(script)}
    code, out, err = _zygote.run([str(script), "fail"], cwd=str(work), env=env)
    assert code == 1 and "KeyError: 'from the script'" in err and "Traceback" in err
    code, out, err = _zygote.run(["-c", "import sys; print(sys.argv); sys.exit('bye')", "a"], cwd=str(work), env=env)
    assert code == 1 and out == "['-c', 'a']\n" and err == "bye\n"
    code, out, err = _zygote.run(["-m", "shardckpt", "inspect", str(tmp_path / "missing")], cwd=str(work), env=env)
    assert code == 2 and "no committed checkpoint" in err


def test_torchrun_ranks_and_a_failed_rank_stops_its_peer(tmp_path):
    import snippets

    (tmp_path / "r.py").write_text(
        "from snippet_preamble import *\nimport torch.distributed as dist\n"
        "t = torch.tensor([rank + 1]); dist.all_reduce(t)\n"
        "assert t.item() == 3 and world == 2 and os.environ['LOCAL_WORLD_SIZE'] == '2', (t, world)\n"
        "open(f'rank{rank}-{os.environ[\"TORCHELASTIC_RUN_ID\"]}', 'w').close()\n"
    )
    snippets._fork_run(str(tmp_path), "r.py", "job-1", script=str(tmp_path / "r.py"), ranks=2)
    assert sorted(p.name for p in tmp_path.glob("rank*")) == ["rank0-job-1", "rank1-job-1"]
    # rank 1 fails; rank 0 waits in a collective that never completes: stopped, as torchrun stops it
    (tmp_path / "f.py").write_text(
        "from snippet_preamble import *\nimport torch.distributed as dist\n"
        "if rank == 1:\n    raise SystemExit(4)\ndist.barrier()\n"
    )
    try:
        snippets._fork_run(str(tmp_path), "f.py", "job-2", script=str(tmp_path / "f.py"), ranks=2)
    except AssertionError as e:
        assert "exit 4" in str(e), e
    else:
        raise AssertionError("a failed rank passed")
    assert sys.executable


def test_fork_servers_do_not_outlive_their_use(tmp_path, monkeypatch):
    """Issue 47 item 3: one server per environment, each 0.5-0.65 GB, kept to the end of the run, added up to GBs."""
    import time

    _zygote._stop_servers()
    first = dict(os.environ, ZYGOTE_TEST_VAR="a")
    assert _zygote.run(["-c", "pass"], cwd=str(tmp_path), env=first)[0] == 0
    (a,) = _zygote.live_servers()
    # Another environment (a test's own variables): the first server goes before the second starts.
    assert _zygote.run(["-c", "pass"], cwd=str(tmp_path), env=dict(os.environ, ZYGOTE_TEST_VAR="b"))[0] == 0
    (b,) = _zygote.live_servers()
    assert a != b and not os.path.exists(f"/proc/{a}"), a  # stopped and reaped
    # A server nobody uses exits by itself (its tests are over), and the next use starts a new one.
    _zygote._stop_servers()
    monkeypatch.setattr(_zygote, "IDLE_EXIT_S", 1.0)
    assert _zygote.run(["-c", "pass"], cwd=str(tmp_path), env=first)[0] == 0
    (z,) = _zygote._SERVERS.values()
    assert z.proc.wait(timeout=120) == 0  # exited on its own, idle
    assert _zygote.live_servers() == []
    code, out, _ = _zygote.run(["-c", "print('again')"], cwd=str(tmp_path), env=first)
    assert code == 0 and out == "again\n"
    (again,) = _zygote.live_servers()
    time.sleep(0.6)  # idle past half the limit: not sent to (it may be exiting), replaced
    assert _zygote.run(["-c", "pass"], cwd=str(tmp_path), env=first)[0] == 0
    (last,) = _zygote.live_servers()
    assert last not in (z.proc.pid, again)
    _zygote._stop_servers()


def _pid(rank, world):
    return os.getpid()


def test_a_rank_pool_of_another_world_size_left_idle_is_closed(monkeypatch):
    """Issue 47 item 3: every world size's pool of rank processes stayed to the end of the run."""
    import _dist

    _dist._shutdown()
    two = _dist.run_ranks(2, _pid)
    assert _dist.run_ranks(2, _pid) == two  # reused while in use
    pool2 = _dist._POOLS[2]
    monkeypatch.setattr(_dist, "POOL_IDLE_S", 0.0)
    _dist.run_ranks(3, _pid)
    assert sorted(_dist._POOLS) == [3] and not any(p.is_alive() for p in pool2.procs)
    _dist._shutdown()


def test_pools_past_the_rank_budget_close_the_least_recently_used_first(monkeypatch):
    """Issue 47: a 16-rank pool started while the 8-rank pool of the test before was still kept (24 ranks, ~8 GB RSS)."""
    import _dist

    _dist._shutdown()
    monkeypatch.setattr(_dist, "MAX_POOLED_RANKS", 5)
    _dist.run_ranks(2, _pid)
    one = _dist.run_ranks(1, _pid)
    _dist.run_ranks(2, _pid)  # the 1-rank pool is now the least recently used
    pool1 = _dist._POOLS[1]
    assert sorted(_dist._POOLS) == [1, 2]  # 3 ranks: within the budget, both kept
    _dist.run_ranks(3, _pid)  # 2 + 1 + 3 = 6 > 5: the 1-rank pool goes, 2 + 3 fits
    assert sorted(_dist._POOLS) == [2, 3] and not any(p.is_alive() for p in pool1.procs)
    assert _dist.run_ranks(1, _pid) != one  # a new pool (and 1 + 2 + 3 > 5: the 2-rank pool went)
    assert sorted(_dist._POOLS) == [1, 3]
    _dist._shutdown()


def test_a_pool_idle_past_its_limit_closes_at_the_next_test_whatever_its_world_size(monkeypatch):
    """Issue 47: a pool was only closed by a call for another world size; one left by the last run_ranks test stayed."""
    import _dist

    _dist._shutdown()
    _dist.run_ranks(2, _pid)
    pool2 = _dist._POOLS[2]
    _dist.on_test_start()
    assert sorted(_dist._POOLS) == [2]  # used a moment ago: kept for the next test
    monkeypatch.setattr(_dist, "POOL_IDLE_S", 0.0)
    _dist.on_test_start()
    assert not _dist._POOLS and not any(p.is_alive() for p in pool2.procs)


def test_a_test_of_a_file_without_run_ranks_closes_the_pools():
    """Issue 47: 2-rank pools sat idle (0.4-0.55 GB a rank) through the launched-script tests that followed."""
    import _dist

    _dist._shutdown()
    _dist.run_ranks(2, _pid)
    pool2 = _dist._POOLS[2]
    _dist.on_test_start(uses_pools=True)
    assert sorted(_dist._POOLS) == [2]
    _dist.on_test_start(uses_pools=False)
    assert not _dist._POOLS and not any(p.is_alive() for p in pool2.procs)


def _hello():
    print("RESULT {}")


def test_a_fault_child_closes_the_pools_of_earlier_tests_not_its_own():
    """Issue 47: the pools of the tests before sat idle beside a fault test's eight children (1.8 of 4.3 GB)."""
    import _dist
    from _faultkids import finish, start

    _dist._shutdown()
    _dist.on_test_start()
    _dist.run_ranks(2, _pid)
    code, _ = finish(start(_hello), 60)
    assert code == 0 and sorted(_dist._POOLS) == [2]  # this test's own pool stays
    pool2 = _dist._POOLS[2]
    _dist.on_test_start()
    code, _ = finish(start(_hello), 60)
    assert code == 0 and not _dist._POOLS and not any(p.is_alive() for p in pool2.procs)


def test_the_rank_fork_server_stops_once_idle_and_restarts_on_use(monkeypatch):
    """Issue 47: each test process's fork server (0.26 GB) lived to the end of the run."""
    from multiprocessing import forkserver

    import _dist

    _dist._shutdown()
    _dist.run_ranks(1, _pid)
    first = forkserver._forkserver._forkserver_pid
    assert first is not None
    monkeypatch.setattr(_dist, "FORKSERVER_IDLE_S", 0.0)
    assert not _dist.stop_idle_forkserver()  # a pool is alive: never
    _dist._shutdown()
    assert _dist.stop_idle_forkserver()
    assert forkserver._forkserver._forkserver_pid is None
    with pytest.raises(ChildProcessError):
        os.waitpid(first, os.WNOHANG)  # gone and reaped
    assert len(_dist.run_ranks(2, _pid)) == 2  # a new server forks the next pool
    _dist._shutdown()


_KEPT = []


def _fragment_heap(rank, world, mb):
    # Blocks under glibc's mmap threshold come from the heap; the last one kept
    # pins the heap's top, so only malloc_trim can give the freed ones back.
    blocks = [bytearray(100_000) for _ in range(mb * 10)]
    _KEPT.append(blocks[-1])
    del blocks


def _rss(rank, world):
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")


def test_a_rank_gives_its_freed_heap_back_after_each_call():
    """Issue 47: rank processes grew from 0.26 to 0.53 GB over a run and kept it while idle."""
    import _dist

    _dist._shutdown()
    before = _dist.run_ranks(1, _rss)[0]
    _dist.run_ranks(1, _fragment_heap, 200)
    after = _dist.run_ranks(1, _rss)[0]
    assert after - before < 50 << 20, (before, after)
    _dist._shutdown()
