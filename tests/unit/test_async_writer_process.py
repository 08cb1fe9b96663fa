"""async_save with SHARDCKPT_ASYNC_WRITER=process: a writer child writes the data files from shared memory."""

from __future__ import annotations

import gc
import os
import signal
import subprocess
import sys
import uuid

import pytest
import torch

import shardckpt
from shardckpt import _async, _knobs, _writerproc
from shardckpt.errors import SaveFailedError

ARENA_NAME = "memfd:shardckpt-staging"


@pytest.fixture
def process_writer(monkeypatch):
    monkeypatch.setattr(_knobs, "ASYNC_WRITER", "process")
    yield
    shardckpt.release_buffers()


def _state(seed: int) -> dict:
    g = torch.Generator().manual_seed(seed)
    return {
        "w": torch.randn(700, 300, generator=g),  # several 1 MiB CRC blocks
        "half": torch.randn(33, 17, generator=g).to(torch.bfloat16),
        "idx": torch.randint(0, 1 << 40, (129,), generator=g),
        "flags": torch.rand(13, generator=g) > 0.5,
        "scalar": torch.tensor(float(seed)),
        "empty": torch.empty(0, 4),
        "step": seed,
        "nested": {"lr": 0.5, "t": torch.arange(7, dtype=torch.int16)},
    }


def _zeros_like(state: dict) -> dict:
    out = {}
    for k, v in state.items():
        if isinstance(v, torch.Tensor):
            out[k] = torch.zeros_like(v)
        elif isinstance(v, dict):
            out[k] = _zeros_like(v)
        else:
            out[k] = 0
    return out


def _assert_equal(got: dict, want: dict) -> None:
    assert got.keys() == want.keys()
    for k, v in want.items():
        if isinstance(v, torch.Tensor):
            assert got[k].dtype == v.dtype and torch.equal(got[k], v), k
        elif isinstance(v, dict):
            _assert_equal(got[k], v)
        else:
            assert got[k] == v, k


def _child_pid() -> int:
    w = _writerproc.current_writer()
    assert w is not None and w.alive()
    return w.pid


def _arena_mappings(pid="self") -> int:
    with open(f"/proc/{pid}/maps") as f:
        return sum(ARENA_NAME in line for line in f)


def _tree(root) -> dict:
    out = {}
    for dirpath, _, names in os.walk(root):
        for n in names:
            p = os.path.join(dirpath, n)
            with open(p, "rb") as f:
                out[os.path.relpath(p, root)] = f.read()
    return out


def test_round_trip_bit_exact_and_child_reused(tmp_path, process_writer):
    state = _state(1)
    h = shardckpt.async_save(state, str(tmp_path / "a"), no_dist=True)
    state["w"].add_(1.0)  # training goes on: the checkpoint keeps the staged values
    h.result(timeout=300)
    pid = _child_pid()
    assert pid != os.getpid()
    got = _zeros_like(state)
    shardckpt.load(got, str(tmp_path / "a"), no_dist=True)
    want = _state(1)
    _assert_equal(got, want)
    shardckpt.verify(str(tmp_path / "a"))  # raises on any bad checksum

    # A second save reuses the child and the arena.
    arena = _async._ARENA_STAGER.arena
    shardckpt.async_save(_state(2), str(tmp_path / "b"), no_dist=True).result(timeout=300)
    assert _child_pid() == pid and _async._ARENA_STAGER.arena is arena
    got = _zeros_like(state)
    shardckpt.load(got, str(tmp_path / "b"), no_dist=True)
    _assert_equal(got, _state(2))


def test_same_bytes_as_the_thread_writer(tmp_path, monkeypatch):
    # One save id for both saves: it names the data and index files and is in their bytes.
    fixed = uuid.UUID("12345678123456781234567812345678")
    monkeypatch.setattr(uuid, "uuid4", lambda: fixed)
    # Several files (one per I/O thread) and several blocks per chunk.
    monkeypatch.setattr(_knobs, "MIN_BYTES_PER_FILE", 256 << 10)
    state = _state(3)
    try:
        for mode in ("thread", "process"):
            monkeypatch.setattr(_knobs, "ASYNC_WRITER", mode)
            shardckpt.async_save(state, str(tmp_path / mode), no_dist=True, io_threads=3).result(timeout=300)
        assert _writerproc.current_writer() is not None and _writerproc.current_writer().alive()
    finally:
        shardckpt.release_buffers()
    a, b = _tree(tmp_path / "thread"), _tree(tmp_path / "process")
    assert sorted(a) == sorted(b)
    data = [k for k in a if k.startswith("data" + os.sep)]
    assert len([k for k in data if k.endswith(".safetensors")]) >= 2 and any("index" in k for k in data)
    for k in data:
        assert a[k] == b[k], k
    assert a["manifest.json"] == b["manifest.json"]


def test_writer_killed_mid_save_fails_and_keeps_the_previous_checkpoint(tmp_path, process_writer, monkeypatch):
    url = str(tmp_path / "ckpt")
    shardckpt.async_save(_state(4), url, no_dist=True).result(timeout=300)
    before = _tree(url)
    pid = _child_pid()
    # Frozen, the child cannot answer the save's request; it dies once the
    # request is sent (killed earlier, the save would just start a new child).
    os.kill(pid, signal.SIGSTOP)
    real_recv = _writerproc.ProcessWriter._recv

    def kill_then_recv(self, timeout, *, what):
        if what.startswith("writing"):
            os.kill(pid, signal.SIGKILL)
        return real_recv(self, timeout, what=what)

    monkeypatch.setattr(_writerproc.ProcessWriter, "_recv", kill_then_recv)
    h = shardckpt.async_save(_state(5), url, no_dist=True, overwrite=True)
    with pytest.raises(SaveFailedError) as ei:
        h.result(timeout=300)
    msg = str(ei.value)
    assert f"writer process (pid {pid}) died" in msg and "signal 9" in msg and "previous checkpoint is untouched" in msg
    # The previous checkpoint: same files, same bytes; it loads.
    assert _tree(url) == before
    got = _zeros_like(_state(4))
    shardckpt.load(got, url, no_dist=True)
    _assert_equal(got, _state(4))

    # The next save starts a new child and commits.
    monkeypatch.setattr(_writerproc.ProcessWriter, "_recv", real_recv)
    shardckpt.async_save(_state(6), url, no_dist=True, overwrite=True).result(timeout=300)
    assert _child_pid() != pid
    got = _zeros_like(_state(6))
    shardckpt.load(got, url, no_dist=True)
    _assert_equal(got, _state(6))


def test_error_in_the_child_reaches_result(tmp_path, process_writer):
    url = str(tmp_path / "ckpt")
    shardckpt.async_save(_state(7), str(tmp_path / "warm"), no_dist=True).result(timeout=300)
    pid = _child_pid()
    # data/ cannot be created: a plain file has its name.
    os.makedirs(url)
    with open(os.path.join(url, "data"), "w") as f:
        f.write("in the way")
    h = shardckpt.async_save(_state(7), url, no_dist=True)
    err = h.exception(timeout=300)
    assert err is not None and not os.path.exists(os.path.join(url, "manifest.json"))
    assert "data" in str(err)
    assert _child_pid() == pid  # a failed write leaves the child serving


def _shm_entries():
    # Not this test's on a shared host: the memory tier's directories
    # (shardckpt-<uid>-<hash>) and the POSIX semaphores of other processes'
    # multiprocessing locks (sem.mp-*; the writer child is a subprocess on a
    # socket, it makes none). Other jobs made them appear mid-test (a race).
    return sorted(n for n in os.listdir("/dev/shm") if not n.startswith(("shardckpt-", "sem.mp-")))


def _shm_mappings(pid="self") -> int:
    """Mappings of /dev/shm files in a process, semaphores aside (the arena is a memfd: there must be none)."""
    with open(f"/proc/{pid}/maps") as f:
        return sum(" /dev/shm/" in line and " /dev/shm/sem." not in line for line in f)


def test_release_buffers_stops_the_child_and_frees_shared_memory(tmp_path, process_writer):
    shm_before = _shm_entries()
    gc.collect()  # a failed save of an earlier test may sit in a reference cycle
    assert _arena_mappings() == 0
    shardckpt.async_save(_state(8), str(tmp_path / "a"), no_dist=True).result(timeout=300)
    pid = _child_pid()
    assert _arena_mappings() >= 1 and _arena_mappings(pid) >= 1
    assert _shm_mappings() == 0 and _shm_mappings(pid) == 0  # the staging memory is nowhere in /dev/shm
    proc = _writerproc.current_writer()._proc
    shardckpt.release_buffers()
    assert proc.poll() is not None  # the child exited (and was reaped)
    assert not os.path.exists(f"/proc/{pid}/maps") or _arena_mappings(pid) == 0
    gc.collect()
    assert _arena_mappings() == 0
    assert _shm_entries() == shm_before


def test_no_reuse_frees_the_arena_after_the_save(tmp_path, process_writer):
    h = shardckpt.async_save(_state(9), str(tmp_path / "a"), no_dist=True, reuse_buffers=False)
    h.result(timeout=300)
    _async.wait_pending()  # the background thread, and its views of the arena, are gone
    gc.collect()
    assert _async._ARENA_STAGER.arena is None and _arena_mappings() == 0
    got = _zeros_like(_state(9))
    shardckpt.load(got, str(tmp_path / "a"), no_dist=True)
    _assert_equal(got, _state(9))


def test_in_process_storage_writes_in_a_thread(process_writer):
    url = f"memory://wproc-{uuid.uuid4().hex}"
    shardckpt.async_save(_state(10), url, no_dist=True).result(timeout=300)
    assert _writerproc.current_writer() is None or not _writerproc.current_writer().alive()
    got = _zeros_like(_state(10))
    shardckpt.load(got, url, no_dist=True)
    _assert_equal(got, _state(10))


def test_bad_knob_value_names_the_variable():
    env = dict(os.environ, SHARDCKPT_ASYNC_WRITER="fork")
    p = subprocess.run([sys.executable, "-c", "import shardckpt._knobs"], env=env, capture_output=True, text=True)
    assert p.returncode != 0
    assert "SHARDCKPT_ASYNC_WRITER='fork'" in p.stderr and "thread, process" in p.stderr


def test_gil_benchmark_runs_both_writers(tmp_path):
    """``bench_async.py --gil --writer both`` (tiny) runs end to end, as a user runs it."""
    root = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
    cmd = [sys.executable, os.path.join(root, "benchmarks", "bench_async.py"), "--gil", "--writer", "both",
           "--size-gb", "0.01", "--tensors", "4", "--iters", "1", "--gil-steps", "3", "--gil-layers", "2",
           "--dir", str(tmp_path / "scratch"), "--out", str(tmp_path / "gil.txt")]
    p = subprocess.run(cmd, cwd=root, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, timeout=600)
    assert p.returncode == 0, p.stdout[-4000:]
    out = (tmp_path / "gil.txt").read_text()
    for w in ("thread", "process"):
        assert f"async_save ({w}): stall median" in out and f"GIL share of the slowdown ({w})" in out, out
