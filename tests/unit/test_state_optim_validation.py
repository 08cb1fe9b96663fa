"""Optimizer state that does not fit the live optimizer is refused while planning, before anything changes."""

from __future__ import annotations

import pytest
import torch

import shardckpt
from shardckpt._state.optim import optimizer_state_problems, state_shape_fits
from shardckpt.errors import StateMismatchError


def _model(seed: int) -> torch.nn.Module:
    torch.manual_seed(seed)
    return torch.nn.Sequential(torch.nn.Linear(4, 6), torch.nn.ReLU(), torch.nn.Linear(6, 2))


def _step(model, optim) -> None:
    model(torch.randn(3, 4)).sum().backward()
    optim.step()
    optim.zero_grad()


def _snapshot(model, optim):
    return {k: v.clone() for k, v in model.state_dict().items()}, repr(optim.state_dict())


def _assert_unchanged(model, optim, before):
    weights, osd = before
    for k, v in model.state_dict().items():
        assert torch.equal(v, weights[k]), k
    assert repr(optim.state_dict()) == osd


def _saved_adam(tmp_path):
    model = _model(1)
    optim = torch.optim.Adam(model.parameters(), lr=1e-3)
    _step(model, optim)
    url = str(tmp_path / "adam")
    shardckpt.save({"model": model, "optim": optim}, url)
    return url


@pytest.mark.parametrize("stepped", [False, True], ids=["fresh", "stepped"])
def test_adam_state_into_sgd_is_refused_naming_the_keys(tmp_path, stepped):
    url = _saved_adam(tmp_path)
    model = _model(2)
    optim = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
    if stepped:
        _step(model, optim)
    before = _snapshot(model, optim)
    with pytest.raises(StateMismatchError) as ei:
        shardckpt.load({"model": model, "optim": optim}, url)
    msg = str(ei.value)
    assert "optim.param_groups.0" in msg and "dampening, momentum" in msg and "betas" in msg and "SGD" in msg, msg
    if stepped:
        assert "exp_avg" in msg and "momentum_buffer" in msg, msg
    # Refused while planning: the model was not loaded either.
    _assert_unchanged(model, optim, before)


def test_sgd_state_into_adam_is_refused(tmp_path):
    model = _model(1)
    optim = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
    _step(model, optim)
    url = str(tmp_path / "sgd")
    shardckpt.save({"model": model, "optim": optim}, url)
    live = _model(2)
    adam = torch.optim.Adam(live.parameters())
    before = _snapshot(live, adam)
    with pytest.raises(StateMismatchError, match="betas, eps"):
        shardckpt.load({"model": live, "optim": adam}, url, strict=False)
    _assert_unchanged(live, adam, before)


@pytest.mark.parametrize("stepped", [False, True], ids=["fresh", "stepped"])
def test_optimizer_state_of_other_shapes_is_refused(tmp_path, stepped):
    model = _model(1)
    optim = torch.optim.Adam(model.parameters())
    _step(model, optim)
    w = model[0].weight
    # Same numel, another shape: what another model's (or a transposed) state looks like.
    optim.state[w]["exp_avg"] = torch.randn(4, 6)
    url = str(tmp_path / "bad")
    shardckpt.save({"model": model, "optim": optim}, url)

    live = _model(2)
    adam = torch.optim.Adam(live.parameters())
    if stepped:
        _step(live, adam)
    before = _snapshot(live, adam)
    with pytest.raises(StateMismatchError) as ei:
        shardckpt.load({"model": live, "optim": adam}, url)
    msg = str(ei.value)
    assert "optim.state.0.weight.exp_avg" in msg and "[4, 6]" in msg and "[6, 4]" in msg, msg
    _assert_unchanged(live, adam, before)
    if not stepped:
        assert not adam.state  # no state of the saved shape was created


def test_hyperparameter_of_another_kind_is_refused(tmp_path):
    model = _model(1)
    optim = torch.optim.Adam(model.parameters())
    _step(model, optim)
    optim.param_groups[0]["lr"] = "0.001"  # a string where a number belongs
    url = str(tmp_path / "lr")
    shardckpt.save({"model": model, "optim": optim}, url)
    live = _model(2)
    adam = torch.optim.Adam(live.parameters())
    before = _snapshot(live, adam)
    with pytest.raises(StateMismatchError, match=r"lr \(saved str, live number\)"):
        shardckpt.load({"model": live, "optim": adam}, url)
    _assert_unchanged(live, adam, before)


@pytest.mark.parametrize("make", [torch.optim.Adam, torch.optim.AdamW, torch.optim.Adafactor], ids=lambda c: c.__name__)
def test_same_optimizer_still_loads_into_a_fresh_one(tmp_path, make):
    model = _model(1)
    optim = make(model.parameters(), lr=0.01)
    for _ in range(2):
        _step(model, optim)
    url = str(tmp_path / "ok")
    shardckpt.save({"model": model, "optim": optim}, url)
    live = _model(2)
    fresh = make(live.parameters(), lr=0.5)
    shardckpt.load({"model": live, "optim": fresh}, url)
    want, got = optim.state_dict(), fresh.state_dict()
    assert got["param_groups"][0]["lr"] == 0.01
    for i, st in want["state"].items():
        assert set(got["state"][i]) == set(st)
        for k, v in st.items():
            assert torch.equal(torch.as_tensor(got["state"][i][k]), torch.as_tensor(v)), (i, k)
    _step(live, fresh)  # and it steps


def test_state_shape_fits():
    assert state_shape_fits([6, 4], [6, 4]) and state_shape_fits([], [6, 4]) and state_shape_fits([1], [6, 4])
    assert state_shape_fits([6, 1], [6, 4]) and state_shape_fits([1, 4], [6, 4])
    assert not state_shape_fits([4, 6], [6, 4]) and not state_shape_fits([24], [6, 4]) and not state_shape_fits([6], [6, 4])


def test_optimizer_state_problems_is_pure_and_tolerates_defaulted_flags():
    model = _model(1)
    optim = torch.optim.Adam(model.parameters())
    saved = [{k: v for k, v in g.items() if k not in ("params", "decoupled_weight_decay", "fused")} for g in optim.param_groups]
    assert optimizer_state_problems(optim, saved, {0: 0}, {}, {}, "optim") == []
    saved[0]["max_lr"] = 0.9  # an LR scheduler's key: carried along
    assert optimizer_state_problems(optim, saved, {0: 0}, {}, {}, "optim") == []
    del saved[0]["betas"]
    saved[0]["momentum"] = 0.9
    assert optimizer_state_problems(optim, saved, {0: 0}, {}, {}, "optim") == [
        "optim.param_groups.0: the live Adam's hyperparameters betas are not in the checkpoint, "
        "which has max_lr, momentum instead"
    ]
