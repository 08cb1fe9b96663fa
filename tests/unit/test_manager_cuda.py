"""async_save and the manager with CUDA tensors: pinned reused staging, side-stream copies (skipped without a GPU)."""

from __future__ import annotations

import pytest
import torch

import shardckpt
from shardckpt import _async

pytestmark = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")


def _state(seed: int):
    g = torch.Generator(device="cuda").manual_seed(seed)
    return {
        "big": torch.randn(1024, 1024, device="cuda", generator=g),  # 4 MiB: registered host memory
        "half": torch.randn(333, 7, device="cuda", generator=g).to(torch.bfloat16),  # small: torch's pinned allocator
        "strided": torch.randn(64, 48, device="cuda", generator=g).t(),
        "cpu": torch.arange(10),  # mixed devices in one save
        "step": seed,
    }


def _host(s):
    return {k: (v.detach().cpu().clone() if isinstance(v, torch.Tensor) else v) for k, v in s.items()}


def _check(url, want):
    got = {k: (torch.zeros_like(v) if isinstance(v, torch.Tensor) else 0) for k, v in want.items()}
    shardckpt.load(got, url)
    for k, v in want.items():
        if isinstance(v, torch.Tensor):
            assert got[k].dtype == v.dtype and torch.equal(got[k], v), k
        else:
            assert got[k] == v, k


def test_cuda_async_snapshot_and_buffer_reuse(tmp_path):
    s = _state(1)
    want1 = _host(s)
    h = shardckpt.async_save(s, str(tmp_path / "a"))
    # Queued right after the call returns, on the current stream: must not reach the checkpoint.
    for k in ("big", "half", "strided"):
        s[k].mul_(-1).add_(3)
    want2 = _host(s)
    h.result()
    _check(str(tmp_path / "a"), want1)
    pinned = {key: [b.tensor for b in bufs] for key, bufs in _async._STAGER.free.items()}
    registered = [b.registered for bufs in _async._STAGER.free.values() for b in bufs]
    assert any(registered), "the 4 MiB tensor should be staged in registered host memory"
    assert all(t.is_pinned() for (shape, dtype, is_cuda), ts in pinned.items() if is_cuda for t in ts)

    h = shardckpt.async_save(s, str(tmp_path / "b"))
    s["big"].zero_()
    h.result()
    _check(str(tmp_path / "b"), want2)
    again = {key: [b.tensor for b in bufs] for key, bufs in _async._STAGER.free.items()}
    # Same shapes and dtypes: the very same buffers are reused.
    for key, ts in pinned.items():
        assert [t.data_ptr() for t in ts] == [t.data_ptr() for t in again[key]], key
    _async.release_buffers()
    assert _async._STAGER.free == {}


def test_cuda_manager_restore_into_gpu(tmp_path):
    s = _state(2)
    want = _host(s)
    with shardckpt.CheckpointManager(str(tmp_path), async_save=True, keep_last=1) as mgr:
        mgr.save(10, s)
        s["big"].fill_(7)
        mgr.save(11, s)
    live = _state(3)
    assert shardckpt.CheckpointManager(str(tmp_path)).restore(live, step=None) == 11
    assert live["big"].is_cuda and torch.all(live["big"] == 7)
    assert torch.equal(live["half"].cpu(), want["half"])
