"""The RNG recipe with torchdata's StatefulDataLoader is exact in either order (issue 19 item 6).

``iter(loader)`` draws a base seed from torch's global generator. A load
creates a restored loader's iterator before it restores ``RNGState`` (the
generators are restored last, whatever their key), so loading and then
calling ``iter(loader)`` — the order the docs show — continues every stream
exactly, and so does calling ``iter`` first.
"""

from __future__ import annotations

import warnings

import pytest
import torch

import shardckpt

pytest.importorskip("torchdata", reason="torchdata is in the test extra")
from torchdata.stateful_dataloader import StatefulDataLoader  # noqa: E402


def _loader():
    return StatefulDataLoader(list(range(40)), batch_size=2, shuffle=True)


def _run(tmp_path, rng_key: str, order: str):
    warnings.simplefilter("ignore")
    torch.manual_seed(0)
    loader = _loader()
    it = iter(loader)
    seen = []
    ck = str(tmp_path / f"ck-{rng_key}-{order}")
    for step in range(6):
        if step == 3:
            shardckpt.save({"loader": shardckpt.PerRank(loader), rng_key: shardckpt.RNGState()}, ck)
        seen.append((next(it).tolist(), torch.rand(2).tolist()))
    torch.manual_seed(123)
    loader2 = _loader()
    state = {"loader": shardckpt.PerRank(loader2), rng_key: shardckpt.RNGState()}
    if order == "load-then-iter":  # docs/runtimes/README.md's order
        shardckpt.load(state, ck)
        it2 = iter(loader2)
    else:
        iter(loader2)
        shardckpt.load(state, ck)
        it2 = iter(loader2)
    got = [(next(it2).tolist(), torch.rand(2).tolist()) for _ in range(3)]
    return got, seen[3:]


@pytest.mark.parametrize("order", ["load-then-iter", "iter-then-load"])
@pytest.mark.parametrize("rng_key", ["rng", "a_rng"])  # sorted after and before "loader"
def test_stateful_dataloader_and_rng_resume_exact(tmp_path, order, rng_key):
    got, want = _run(tmp_path, rng_key, order)
    assert got == want


def test_without_priming_the_natural_order_is_one_draw_off(tmp_path, monkeypatch):
    """The trap the load avoids: restore the generators, then iter() draws a seed from them."""
    from shardckpt._state import stateful

    monkeypatch.setattr(stateful, "_prime_loader", lambda obj: None)
    got, want = _run(tmp_path, "rng", "load-then-iter")
    assert [b for b, _ in got] == [b for b, _ in want]  # the loader's own position is right...
    assert [r for _, r in got] != [r for _, r in want]  # ...main-process randomness is not
