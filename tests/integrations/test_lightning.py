"""Lightning (Trainer and Fabric) + ModelParallelStrategy (FSDP2) with shardckpt.integrations.lightning.

Real processes on 2 gloo ranks: fit with ModelCheckpoint, SIGKILL, resume
with ``Trainer.fit(ckpt_path=...)`` at the same world size and on one process
(losses compared with an uninterrupted run); a Lightning DCP checkpoint still
resumes through the switched strategy; ``consolidate`` gives a file
``load_from_checkpoint`` reads. Lightning's import costs ~10 s a process on
this box, hence slow.
"""

import os

import pytest

pytest.importorskip("lightning")

from _launch import launch, losses, run_ok  # noqa: E402

pytestmark = pytest.mark.slow
TRAIN, FABRIC = "_lightning_train.py", "_fabric_train.py"
#: One process against two (another reduction order); measured 1e-7 relative.
CROSS_WORLD_RTOL = 1e-4


@pytest.fixture(scope="module")
def run(tmp_path_factory):
    d = tmp_path_factory.mktemp("lit")
    run_ok(TRAIN, 2, ["--ckpt", str(d / "ckfull"), "--out", str(d / "full.jsonl")])
    codes = launch(TRAIN, 2, ["--mode", "crash", "--ckpt", str(d / "ck"), "--out", str(d / "crash.jsonl")])
    assert codes == [-9, -9], codes
    return d


def test_trainer_writes_shardckpt_checkpoints(run):
    import shardckpt

    names = sorted(os.listdir(run / "ck"))
    assert names == ["epoch=0-step=4.ckpt", "epoch=1-step=8.ckpt", "last.ckpt"], names
    m = shardckpt.verify(str(run / "ck" / "last.ckpt"))
    assert m.values["lightning"]["global_step"] == 8 and m.values["lightning"]["epoch"] == 1
    assert "state_dict.net.0.weight" in m.tensors and "optimizer_0.state.net.0.weight.exp_avg" in m.tensors
    assert not os.path.exists(run / "ck" / "last.ckpt" / "meta.pt")


@pytest.mark.parametrize("world", [2, 1])
def test_trainer_resumes_from_ckpt_path(run, world):
    out = run / f"r{world}.jsonl"
    run_ok(TRAIN, world, ["--mode", "resume", "--resume", str(run / "ck" / "last.ckpt"), "--ckpt", str(run / f"ck{world}"), "--out", str(out)])
    full, got = losses(str(run / "full.jsonl")), losses(str(out))
    assert sorted(got) == [9, 10, 11, 12]
    if world == 2:
        assert got == {s: full[s] for s in got}
    else:
        for s in got:
            assert got[s] == pytest.approx(full[s], rel=CROSS_WORLD_RTOL), (s, got[s], full[s])


def test_lightning_dcp_checkpoint_still_resumes(run, tmp_path):
    run_ok(TRAIN, 2, ["--dcp", "--ckpt", str(tmp_path / "dcp"), "--out", str(tmp_path / "dcp.jsonl")])
    src = tmp_path / "dcp" / "epoch=1-step=8.ckpt"
    assert (src / "meta.pt").exists()
    run_ok(TRAIN, 2, ["--mode", "resume", "--resume", str(src), "--ckpt", str(tmp_path / "ck"), "--out", str(tmp_path / "r.jsonl")])
    full, got = losses(str(run / "full.jsonl")), losses(str(tmp_path / "r.jsonl"))
    assert got == {s: full[s] for s in [9, 10, 11, 12]}


def test_consolidate_to_one_lightning_file(run, tmp_path):
    import torch

    from shardckpt.integrations.lightning import consolidate

    dst = consolidate(str(run / "ck" / "last.ckpt"), str(tmp_path / "full.ckpt"))
    ck = torch.load(dst, weights_only=True)
    assert ck["global_step"] == 8 and ck["epoch"] == 1 and "loops" in ck
    assert sorted(ck["state_dict"]) == sorted(f"net.{i}.{k}" for i in (0, 2, 4) for k in ("weight", "bias"))
    assert ck["state_dict"]["net.0.weight"].shape == (32, 8)
    # Lightning's own reader of a consolidated file.
    import lightning as L

    class M(L.LightningModule):
        def __init__(self):
            super().__init__()
            self.net = torch.nn.Sequential(torch.nn.Linear(8, 32), torch.nn.ReLU(), torch.nn.Linear(32, 32), torch.nn.ReLU(), torch.nn.Linear(32, 4))

    m = M.load_from_checkpoint(dst)
    assert torch.equal(m.net[4].bias, ck["state_dict"]["net.4.bias"])


def test_fabric_save_kill_load_on_one_process(tmp_path):
    run_ok(FABRIC, 2, ["--out", str(tmp_path / "full.jsonl")])
    assert launch(FABRIC, 2, ["--mode", "crash", "--save-at", "4", "--ckpt", str(tmp_path / "ck"), "--out", str(tmp_path / "c.jsonl")]) == [-9, -9]
    assert (tmp_path / "ck" / "manifest.json").exists()
    run_ok(FABRIC, 1, ["--mode", "resume", "--resume", str(tmp_path / "ck"), "--out", str(tmp_path / "r1.jsonl")])
    full, got = losses(str(tmp_path / "full.jsonl")), losses(str(tmp_path / "r1.jsonl"))
    assert sorted(got) == [5, 6, 7, 8]
    for s in got:
        assert got[s] == pytest.approx(full[s], rel=CROSS_WORLD_RTOL), (s, got[s], full[s])
