"""torchtitan's checkpointer contract with shardckpt.integrations.torchtitan.CheckpointManager (real processes, 2 gloo ranks).

torchtitan's own OptimizersContainer, LRSchedulersContainer, ParallelAwareDataloader
and checkpointer calls (``Config.build``, ``load``, ``save(step, last_step)``)
around an FSDP2 model: crash after step 4, resume at 2 ranks (bit-identical,
dataloader position included) and at 1 (within float tolerance); torchtitan's
DCP steps load as ``initial_load_path`` and convert with ``from_dcp``; a folder
holding DCP steps is refused, not shared; ``last_save_in_hf`` goes through the
run's sd_adapter.
"""

import json
import os

import pytest

pytest.importorskip("torchtitan.components.checkpointer")

from _launch import launch, losses, run_ok  # noqa: E402

pytestmark = pytest.mark.slow
SCRIPT = "_torchtitan_train.py"
CROSS_WORLD_RTOL = 1e-4  # measured 1e-7 relative (another reduction order)


@pytest.fixture(scope="module")
def run(tmp_path_factory):
    d = tmp_path_factory.mktemp("tt")
    run_ok(SCRIPT, 2, ["--folder", str(d / "full"), "--out", str(d / "full.jsonl")])
    assert launch(SCRIPT, 2, ["--mode", "crash", "--folder", str(d / "run"), "--out", str(d / "crash.jsonl")]) == [-9, -9]
    return d


def test_layout_and_entries(run):
    import shardckpt

    folder = run / "full" / "checkpoint"
    assert sorted(os.listdir(folder)) == ["step-00000004", "step-00000008"]  # keep_latest_k=2, interval=4
    m = shardckpt.verify(str(folder / "step-00000008"))
    assert {"model.0.weight", "optimizer.state.0.weight.exp_avg"} <= set(m.tensors)
    assert m.values["train_state"]["step"] == 8 and m.values["lr_scheduler"] == {"last_epoch": 8}
    assert "dataloader" in m.values


@pytest.mark.parametrize("world", [2, 1])
def test_resume_after_kill(run, world, tmp_path):
    import shutil

    folder = tmp_path / "run"
    shutil.copytree(run / "run", folder)
    out = tmp_path / "r.jsonl"
    run_ok(SCRIPT, world, ["--mode", "resume", "--folder", str(folder), "--out", str(out)])
    full, got = losses(str(run / "full.jsonl")), losses(str(out))
    assert sorted(got) == [5, 6, 7, 8]
    if world == 2:
        assert got == {s: full[s] for s in got}
    else:
        for s in got:
            assert got[s] == pytest.approx(full[s], rel=CROSS_WORLD_RTOL)


def test_torchtitan_dcp_steps_load_convert_and_are_never_shared(run, tmp_path):
    import torch

    import shardckpt
    from shardckpt import converters

    run_ok(SCRIPT, 2, ["--dcp", "--folder", str(tmp_path / "dcp"), "--out", str(tmp_path / "dcp.jsonl")])
    dcp_step = tmp_path / "dcp" / "checkpoint" / "step-4"
    assert (dcp_step / ".metadata").exists()
    # The same folder is refused before anything is written or deleted.
    assert launch(SCRIPT, 2, ["--folder", str(tmp_path / "dcp"), "--out", str(tmp_path / "x.jsonl")]) == [1, 1]
    assert sorted(os.listdir(tmp_path / "dcp" / "checkpoint")) == ["step-4", "step-8"]
    # initial_load_path: read through DCP, the run continues as the uninterrupted one.
    run_ok(SCRIPT, 2, ["--mode", "resume", "--initial", str(dcp_step), "--folder", str(tmp_path / "new"), "--out", str(tmp_path / "ri.jsonl")])
    full, got = losses(str(run / "full.jsonl")), losses(str(tmp_path / "ri.jsonl"))
    assert got == {s: full[s] for s in [5, 6, 7, 8]}
    # from_dcp: the DCP step as a shardckpt checkpoint (torchtitan's top-level model keys under "model."),
    # its weights those of our own step 4.
    converters.from_dcp(str(dcp_step), str(tmp_path / "native"))
    conv = shardckpt.inspect(str(tmp_path / "native"))
    ours = {}
    mine = {f"{i}.{k}": None for i in (0, 2, 4) for k in ("weight", "bias")}
    for name in mine:
        assert "model." + name in conv.tensors, sorted(conv.tensors)[:10]
        shape = conv.tensors["model." + name].shape
        mine[name], ours[name] = torch.empty(shape), torch.empty(shape)
    shardckpt.load({"model": mine}, str(tmp_path / "native"), strict=False)
    shardckpt.load({"model": ours}, str(run / "run" / "checkpoint" / "step-00000004"), strict=False)
    for name in mine:
        assert torch.equal(mine[name], ours[name]), name


def test_last_save_in_hf_through_the_sd_adapter(tmp_path):
    from safetensors import safe_open

    run_ok(SCRIPT, 2, ["--hf", "--folder", str(tmp_path / "hf"), "--out", str(tmp_path / "hf.jsonl")])
    hf = tmp_path / "hf" / "checkpoint" / "step-00000008-hf" / "model.safetensors"
    with safe_open(str(hf), "pt") as f:
        assert sorted(f.keys()) == sorted(f"hf.{i}.{k}" for i in (0, 2, 4) for k in ("weight", "bias"))
        assert f.get_tensor("hf.0.weight").shape == (32, 8)
    assert json.loads((tmp_path / "hf.jsonl").read_text().splitlines()[-1])["step"] == 8


def _stage(rank_or_none, seed):
    """torchtitan's pipeline split: a copy of the whole model with the other stages' layers deleted (FQNs kept)."""
    import torch

    torch.manual_seed(seed)
    full = torch.nn.ModuleDict({"a": torch.nn.Linear(4, 8), "b": torch.nn.Linear(8, 2)})
    if rank_or_none is not None:
        del full[["b", "a"][rank_or_none]]
    return full


def _tt_parts(parts, root):
    from torchtitan.components.optimizer import LRSchedulersContainer, OptimizersContainer, ParamGroupConfig

    from shardckpt.integrations.torchtitan import CheckpointManager

    opts = OptimizersContainer(OptimizersContainer.Config(
        param_groups=[ParamGroupConfig(pattern=".*", optimizer_name="AdamW", optimizer_kwargs={"lr": 1e-2})],
        implementation="for-loop"), model_parts=parts)
    scheds = LRSchedulersContainer.Config(warmup_steps=2).build(optimizers=opts, training_steps=10)
    ckpt = CheckpointManager.Config(enable=True, folder="checkpoint", interval=1, last_save_model_only=False).build(
        dataloader=None, model_parts=parts, optimizers=opts, lr_schedulers=scheds, states={}, sd_adapter=None, base_folder=root)
    return opts, scheds, ckpt


def _save_stage(rank, world, root):
    import torch

    stage = _stage(rank, seed=0)
    opts, scheds, ckpt = _tt_parts([stage], root)
    for _ in range(2):
        sum(p.square().sum() for p in stage.parameters()).backward()
        opts.step()
        scheds.step()
        opts.zero_grad()
    ckpt.save(2)
    ckpt.close()
    with torch.no_grad():
        return {n: p.clone() for n, p in stage.named_parameters()}, opts.state_dict()


def test_pipeline_stages_saved_as_a_union_load_into_one_process(tmp_path):
    """Two ranks, each one pipeline stage (disjoint FQNs), save one step; one process holding both stages loads it."""
    import torch
    from _dist import run_ranks

    per_rank = run_ranks(2, _save_stage, str(tmp_path), fresh=True)
    parts = [_stage(0, seed=1), _stage(1, seed=1)]
    opts, scheds, ckpt = _tt_parts(parts, str(tmp_path))
    assert ckpt.load() is True
    live = {n: p for part in parts for n, p in part.named_parameters()}
    flat = opts.state_dict()
    for weights, saved_opt in per_rank:
        for n, t in weights.items():
            assert torch.equal(live[n], t), n
        for k, v in saved_opt.items():
            if isinstance(v, torch.Tensor):
                assert torch.equal(flat[k], v), k
    assert scheds.schedulers[0].last_epoch == 2
    ckpt.close()
