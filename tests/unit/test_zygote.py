"""tests/_zygote.py (the snippet and CLI tests' fork server): a fork runs as ``python`` would run it."""

import os
import sys
import textwrap

import _zygote

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
    import torch
    import torch.distributed as dist

    t = torch.tensor([float(rank + 1)])
    dist.all_reduce(t)  # the group is really of ``world`` ranks
    assert (dist.get_rank(), dist.get_world_size(), t.item()) == (rank, world, world * (world + 1) / 2)
    return os.getpid()


def _gone(procs, within=10.0):
    import time

    deadline = time.monotonic() + within
    while any(p.is_alive() for p in procs) and time.monotonic() < deadline:
        time.sleep(0.05)
    return not any(p.is_alive() for p in procs)


def test_rank_processes_are_reused_across_world_sizes(monkeypatch):
    """Issue 47: a pool per world size kept 2 + 4 rank processes a test process (8.6 GiB summed RSS), or restarted them."""
    import _dist

    _dist._shutdown()
    monkeypatch.setattr(_dist, "MAX_POOLED_RANKS", 4)
    two = _dist.run_ranks(2, _pid)
    assert _dist.run_ranks(2, _pid) == two  # the same group, reused
    four = _dist.run_ranks(4, _pid)
    assert four[:2] == two and len(set(four)) == 4  # the first two regrouped with two new ones
    assert _dist.run_ranks(2, _pid) == two and _dist.run_ranks(3, _pid) == four[:3]
    assert len(_dist._POOL["pool"].procs) == 4  # the idle ones are kept within the cap
    _dist._shutdown()


def test_rank_processes_past_the_cap_close_at_the_next_smaller_call(monkeypatch):
    """Issue 47: a 16-rank pool started while the 8-rank pool of the test before was still kept (24 ranks, ~8 GB RSS)."""
    import _dist

    _dist._shutdown()
    monkeypatch.setattr(_dist, "MAX_POOLED_RANKS", 3)
    five = _dist.run_ranks(5, _pid)
    procs = list(_dist._POOL["pool"].procs)
    assert _dist.run_ranks(5, _pid) == five  # kept while in use
    assert _dist.run_ranks(2, _pid) == five[:2]
    assert [p.pid for p in _dist._POOL["pool"].procs] == five[:3] and _gone(procs[3:])
    assert _dist.run_ranks(4, _pid)[:3] == five[:3]
    _dist._shutdown()


def test_idle_rank_processes_exit_by_themselves(monkeypatch):
    """Issue 47: rank processes stayed to the end of the run, through minutes of tests that used none."""
    import time

    import _dist

    _dist._shutdown()
    monkeypatch.setattr(_dist, "RANK_IDLE_EXIT_S", 4.0)
    four = _dist.run_ranks(4, _pid)
    procs = list(_dist._POOL["pool"].procs)
    since = time.monotonic()
    while time.monotonic() - since < 2.5:  # past half of it: ranks 2 and 3, idle since, may be exiting
        assert _dist.run_ranks(2, _pid) == four[:2]
        time.sleep(0.2)
    assert _dist.run_ranks(2, _pid) == four[:2]
    assert len(_dist._POOL["pool"].procs) == 2 and _gone(procs[2:])  # closed, never sent to
    assert _gone(procs[:2], within=15.0)  # idle for RANK_IDLE_EXIT_S: they exit
    assert not set(_dist.run_ranks(2, _pid)) & set(four)  # the next call starts new ones
    _dist._shutdown()


def test_rank_processes_grown_heavy_are_replaced_when_another_module_calls(monkeypatch):
    """Issue 47: a rank keeps what every test file before imported (0.72 GB after five minutes, ~0.3 GB fresh)."""
    import operator

    import _dist

    _dist._shutdown()
    two = _dist.run_ranks(2, _pid)
    monkeypatch.setattr(_dist, "RANK_RSS_LIMIT", 1 << 40)
    assert _dist.run_ranks(2, operator.add) == [2, 3]  # another module, light ranks: kept
    assert _dist.run_ranks(2, _pid) == two
    monkeypatch.setattr(_dist, "RANK_RSS_LIMIT", 1)  # every rank is heavy now
    assert _dist.run_ranks(2, _pid) == two  # the same module: kept
    procs = list(_dist._POOL["pool"].procs)
    assert _dist.run_ranks(2, operator.add) == [2, 3]  # another module: replaced, then run
    assert _gone(procs) and not {p.pid for p in _dist._POOL["pool"].procs} & set(two)
    _dist._shutdown()
