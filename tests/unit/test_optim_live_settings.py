"""How the live optimizer runs (foreach, fused, capturable, differentiable) survives a load; what it learned loads."""

from __future__ import annotations

import torch

import shardckpt


def _model(seed):
    torch.manual_seed(seed)
    return torch.nn.Sequential(torch.nn.Linear(8, 16), torch.nn.ReLU(), torch.nn.Linear(16, 4))


def _step(model, opt):
    model(torch.randn(3, 8)).sum().backward()
    opt.step()
    opt.zero_grad()


def test_load_keeps_the_live_implementation_settings_and_loads_the_hyperparameters(tmp_path):
    model = _model(0)
    opt = torch.optim.AdamW(model.parameters(), lr=0.05, betas=(0.8, 0.9), weight_decay=0.3, fused=True)
    _step(model, opt)
    path = str(tmp_path / "c")
    shardckpt.save({"model": model, "optim": opt}, path)

    live = _model(1)
    lopt = torch.optim.AdamW(live.parameters(), lr=1.0, foreach=False)
    _step(live, lopt)
    shardckpt.load({"model": live, "optim": lopt}, path)
    g = lopt.param_groups[0]
    # the user's choices for this machine
    assert g["foreach"] is False and not g["fused"] and not g["capturable"] and not g["differentiable"]
    # what training learned
    assert g["lr"] == 0.05 and g["betas"] == (0.8, 0.9) and g["weight_decay"] == 0.3
    for p, q in zip(model.parameters(), live.parameters()):
        assert torch.equal(opt.state[p]["exp_avg"], lopt.state[q]["exp_avg"])
    _step(live, lopt)  # and it steps on with its own settings


def test_settings_the_live_group_lacks_come_from_the_checkpoint(tmp_path):
    from shardckpt._state.optim import keep_live_settings

    assert keep_live_settings({"lr": 0.1, "fused": True}, {"lr": 1.0}) == {"lr": 0.1, "fused": True}
    assert keep_live_settings({"lr": 0.1, "fused": True}, {"lr": 1.0, "fused": None}) == {"lr": 0.1, "fused": None}
