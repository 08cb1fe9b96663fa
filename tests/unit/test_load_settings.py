"""Load defaults by target: CPU loads keep a small buffer bound; CUDA loads get a large pinned pool and more threads."""

from __future__ import annotations

import os
import subprocess
import sys

import pytest
import torch

import shardckpt
from shardckpt import _knobs, _load


def test_settings_by_target_and_given_values_win(monkeypatch):
    assert _load.load_settings(False) == (_knobs.LOAD_CPU_IO_THREADS, _knobs.LOAD_BUFFER_BYTES)
    assert _load.load_settings(True) == (_knobs.LOAD_CUDA_IO_THREADS, _knobs.LOAD_CUDA_BUFFER_BYTES)
    assert _knobs.LOAD_CUDA_BUFFER_BYTES == 512 << 20 or "SHARDCKPT_LOAD_CUDA_BUFFER_BYTES" in os.environ
    assert 1 <= _knobs.LOAD_CUDA_IO_THREADS <= 16 or "SHARDCKPT_LOAD_CUDA_IO_THREADS" in os.environ
    monkeypatch.setattr(_knobs, "LOAD_CUDA_BUFFER_BYTES", 3 << 20)
    monkeypatch.setattr(_knobs, "LOAD_CUDA_IO_THREADS", 7)
    assert _load.load_settings(True) == (7, 3 << 20)  # knobs read at call time
    assert _load.load_settings(True, threads=2, buffer_bytes=1 << 20) == (2, 1 << 20)
    assert _load.load_settings(False, threads=5) == (5, _knobs.LOAD_BUFFER_BYTES)


def test_cpu_load_threads_follow_the_cores_the_process_may_use():
    """A process pinned to 1 or 2 cores (taskset, a cpuset) gets that many CPU-load readers, not IO_THREADS (4)."""
    code = ("import os, sys; os.sched_setaffinity(0, set(sorted(os.sched_getaffinity(0))[:int(sys.argv[1])])); "
            "from shardckpt import _knobs, _load; print(_knobs.usable_cpus(), _load.load_settings(False)[0], _knobs.IO_THREADS)")
    env = {k: v for k, v in os.environ.items() if k not in ("SHARDCKPT_LOAD_CPU_IO_THREADS", "SHARDCKPT_IO_THREADS")}
    have = len(os.sched_getaffinity(0))
    for n in sorted({1, min(2, have)}):
        out = subprocess.run([sys.executable, "-c", code, str(n)], env=env, capture_output=True, text=True, check=True)
        assert out.stdout.split() == [str(n), str(n), "4"], out
    env["SHARDCKPT_LOAD_CPU_IO_THREADS"] = "3"  # an explicit setting wins over the cores
    out = subprocess.run([sys.executable, "-c", code, "1"], env=env, capture_output=True, text=True, check=True)
    assert out.stdout.split() == ["1", "3", "4"], out


def test_cpu_load_threads_use_every_core_up_to_16():
    """A 16- or 64-core host gets a CPU-load reader per core, at most 16 (it got min(IO_THREADS, cores) = 4: issue 43).

    Each reader checks and copies its own pieces, so the warm load's CRCs
    and copies spread over the cores. The affinity call is replaced (this
    box has 2 cores) before the knobs are read, in a fresh interpreter.
    """
    code = ("import os, sys; n = int(sys.argv[1]); os.sched_getaffinity = lambda pid: set(range(n)); "
            "from shardckpt import _knobs, _load; print(_knobs.usable_cpus(), _load.load_settings(False)[0])")
    env = {k: v for k, v in os.environ.items() if k not in ("SHARDCKPT_LOAD_CPU_IO_THREADS", "SHARDCKPT_IO_THREADS")}
    for n, want in ((8, 8), (16, 16), (64, 16)):
        out = subprocess.run([sys.executable, "-c", code, str(n)], env=env, capture_output=True, text=True, check=True)
        assert out.stdout.split() == [str(n), str(want)], out


def test_knob_values_parse_from_the_environment(monkeypatch):
    monkeypatch.setenv("SHARDCKPT_LOAD_CUDA_BUFFER_BYTES", "1GiB")
    assert _knobs._int("LOAD_CUDA_BUFFER_BYTES", 512 << 20) == 1 << 30
    monkeypatch.setenv("SHARDCKPT_LOAD_CUDA_IO_THREADS", "zero")
    with pytest.raises(ValueError, match="SHARDCKPT_LOAD_CUDA_IO_THREADS"):
        _knobs._int("LOAD_CUDA_IO_THREADS", 16)


def _pools(monkeypatch):
    seen = []
    real = _load.stream.BufferPool

    def pool(capacity, **kw):
        seen.append(capacity)
        return real(capacity, **kw)

    monkeypatch.setattr(_load.stream, "BufferPool", pool)
    return seen


def test_cpu_load_keeps_the_small_bound(tmp_path, monkeypatch):
    # A huge CUDA setting must not reach a load into CPU tensors.
    monkeypatch.setattr(_knobs, "LOAD_CUDA_BUFFER_BYTES", 1 << 40)
    state = {"m": {"w": torch.arange(1000.0)}}
    shardckpt.save(state, str(tmp_path / "c"), no_dist=True)
    seen = _pools(monkeypatch)
    live = {"m": {"w": torch.zeros(1000)}}
    shardckpt.load(live, str(tmp_path / "c"), no_dist=True)
    assert torch.equal(live["m"]["w"], state["m"]["w"])
    assert seen == [_knobs.LOAD_BUFFER_BYTES]
    shardckpt.load(live, str(tmp_path / "c"), no_dist=True, buffer_bytes=12345)
    assert seen[-1] == 12345


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
def test_cuda_load_uses_the_cuda_pool_and_releases_it(tmp_path, monkeypatch):
    monkeypatch.setattr(_knobs, "LOAD_CUDA_BUFFER_BYTES", 32 << 20)
    state = {"m": {"w": torch.randn(1 << 20)}}
    shardckpt.save(state, str(tmp_path / "c"), no_dist=True)
    seen = _pools(monkeypatch)
    live = {"m": {"w": torch.zeros(1 << 20, device="cuda")}}
    shardckpt.load(live, str(tmp_path / "c"), no_dist=True)
    assert torch.equal(live["m"]["w"].cpu(), state["m"]["w"])
    assert seen == [32 << 20]
