"""Meta-device init + FSDP2 ``CPUOffloadPolicy`` + load without ``to_empty`` (issue 12, item 9).

On a GPU the bug left every materialized parameter as a DTensor reporting
``cuda:0`` over FSDP2's pinned CPU shard, and the next ``state_dict()``
raised. Here a model is built on the meta device, sharded with CPU offload,
and filled by ``shardckpt.load`` alone; then every parameter must be a CPU
DTensor whose local tensor is on the same device and shares its storage with
the shard FSDP2 all-gathers from, the module must be FSDP2's own parameter
object, ``state_dict()`` must work, a forward must equal the saving model's,
and training on from the load must match the saving run step for step
(optimizer and scheduler included) and save/reload bit-exactly.

On CPU the mesh's device type is ``cpu``, so the device move at the root of
the bug cannot happen in the full FSDP2 path; ``test_materialized_dtensor_keeps_device``
drives the materialization with a CUDA-typed mesh (no backend, no GPU
needed), which fails without the fix.
"""

import torch

import shardckpt
import _training as T
from _dist import run_ranks
from models import build

KIND = "fsdp2_offload"
SEED_SAVED, SEED_LOADED = 0, 7
PROBE_STEP = 77  # a batch no training step uses, for the forward comparison


def _fsdp_params(model):
    """``{fqn: FSDPParam}`` from FSDP2's state: what its all-gathers actually read."""
    from torch.distributed.fsdp import FSDPModule

    out = {}
    names = {id(p): n for n, p in model.named_parameters()}
    for m in model.modules():
        if isinstance(m, FSDPModule):
            state = m._get_fsdp_state()
            groups = getattr(state, "_fsdp_param_groups", None)  # torch >= 2.12; 2.11 has one group
            if groups is None:
                groups = [g for g in [state._fsdp_param_group] if g is not None]
            for g in groups:
                for fp in g.fsdp_params:
                    out[names.get(id(fp.sharded_param), f"<not a parameter of the model: {fp}>")] = fp
    return out


def _offload_problems(model) -> list:
    """Everything wrong with the offloaded parameters of ``model``, as readable strings."""
    from torch.distributed.tensor import DTensor

    bad = []
    fps = _fsdp_params(model)
    names = [n for n, _ in model.named_parameters()]
    if sorted(fps) != sorted(names):
        bad.append(f"FSDP2 tracks {sorted(fps)}, the model has {sorted(names)}")
    for n, p in model.named_parameters():
        if not isinstance(p, DTensor):
            bad.append(f"{n}: {type(p).__name__}, not a DTensor")
            continue
        lt = p._local_tensor
        if p.device.type != "cpu" or lt.device != p.device:
            bad.append(f"{n}: DTensor on {p.device}, local tensor on {lt.device} (both must be cpu)")
        if p.dtype != torch.float32 or lt.dtype != torch.float32:
            bad.append(f"{n}: dtype {p.dtype}/{lt.dtype}")
        if torch.cuda.is_available() and not lt.is_pinned():
            bad.append(f"{n}: offloaded shard not pinned")
        fp = fps.get(n)
        if fp is None:
            continue
        if fp.sharded_param is not p:
            bad.append(f"{n}: the module's parameter is not FSDP2's sharded_param")
        data = fp._sharded_param_data
        if data.device != lt.device:
            bad.append(f"{n}: FSDP2's padded shard on {data.device}, local tensor on {lt.device}")
        # The local tensor must be a view of the padded buffer FSDP2 all-gathers
        # from; a copy would train on one and checkpoint the other.
        if lt.numel() and lt.untyped_storage().data_ptr() != data.untyped_storage().data_ptr():
            bad.append(f"{n}: local tensor storage is not FSDP2's padded shard")
        if tuple(data.shape) != (fp.padded_sharded_param_size.numel(),):
            bad.append(f"{n}: padded shard {tuple(data.shape)}, expected {fp.padded_sharded_param_size}")
    return bad


def _meta_offload_model(world):
    with torch.device("meta"):
        model = build(SEED_LOADED)
    return T.shard(model, KIND, world)


def _probe(model, rank, world):
    x, _ = T.batch(PROBE_STEP, *T.dp_coords(KIND, rank, world))
    with torch.no_grad():
        out = model(x).detach().clone()
    # FSDP2 does not reshard the root after forward; shard it again so the
    # parameters are the sharded DTensors the checks look at.
    model.reshard()
    return out


def _run(rank, world, root):
    # The saving run: 2 steps, save, then the reference forward and 2 more steps.
    model, opt, sched = T.make(KIND, rank, world, seed=SEED_SAVED)
    T.train(model, opt, sched, 0, 2, KIND, rank, world)
    shardckpt.save({"model": model, "optim": opt, "sched": sched}, f"{root}/a")
    ref_saved = T.full_params(model)
    ref_logits = _probe(model, rank, world)
    ref_losses = T.train(model, opt, sched, 2, 2, KIND, rank, world)
    ref_final = T.full_params(model)
    del model, opt, sched

    # Meta init + offload, filled by the load alone (no to_empty).
    model = _meta_offload_model(world)
    assert all(p.is_meta for p in model.parameters())
    rng = torch.get_rng_state()
    res = shardckpt.load({"model": model}, f"{root}/a", strict=False)
    assert torch.equal(torch.get_rng_state(), rng)  # nothing was randomly initialized
    assert res.missing_keys == [] and res.unexpected_keys == [], res
    problems = _offload_problems(model)
    assert not problems, problems
    assert all(not t.is_meta for t in model.state_dict().values())
    sd = model.state_dict()  # raised with the bug
    for k, v in sd.items():
        local = getattr(v, "_local_tensor", v)
        assert v.device.type == "cpu" and local.device == v.device, (k, v.device, local.device)
    got = T.full_params(model)
    assert sorted(got) == sorted(ref_saved)
    bad = [k for k in ref_saved if not torch.equal(got[k], ref_saved[k])]
    assert not bad, f"loaded weights differ from the saved ones: {bad}"
    logits = _probe(model, rank, world)
    assert torch.equal(logits, ref_logits), (logits - ref_logits).abs().max()
    problems = _offload_problems(model)  # after FSDP2's lazy init (first forward)
    assert not problems, problems

    # Optimizer built after the model load, then the full state: training
    # continues exactly as the saving run did.
    opt = T.make_optimizer(model)
    sched = torch.optim.lr_scheduler.LambdaLR(opt, lambda s: min(1.0, (s + 1) / 3) * 0.95**s)
    ids = [id(p) for p in model.parameters()]
    shardckpt.load({"model": model, "optim": opt, "sched": sched}, f"{root}/a")
    assert [id(p) for p in model.parameters()] == ids
    assert [id(p) for g in opt.param_groups for p in g["params"]] == ids
    losses = T.train(model, opt, sched, 2, 2, KIND, rank, world)
    assert losses == ref_losses, (losses, ref_losses)
    final = T.full_params(model)
    bad = [k for k in ref_final if not torch.equal(final[k], ref_final[k])]
    assert not bad, f"weights after resumed training differ: {bad}"
    problems = _offload_problems(model)
    assert not problems, problems

    # Save what the meta-loaded model trained to, reload into another meta model.
    shardckpt.save({"model": model, "optim": opt, "sched": sched}, f"{root}/b")
    optim_before = T.full_optim(model, opt)
    logits_before = _probe(model, rank, world)
    model2 = _meta_offload_model(world)
    shardckpt.load({"model": model2}, f"{root}/b", strict=False)
    opt2 = T.make_optimizer(model2)
    sched2 = torch.optim.lr_scheduler.LambdaLR(opt2, lambda s: min(1.0, (s + 1) / 3) * 0.95**s)
    shardckpt.load({"model": model2, "optim": opt2, "sched": sched2}, f"{root}/b")
    problems = _offload_problems(model2)
    assert not problems, problems
    again = T.full_params(model2)
    bad = [k for k in final if not torch.equal(again[k], final[k])]
    assert not bad, f"reloaded weights differ: {bad}"
    optim_again = T.full_optim(model2, opt2)
    assert optim_again.keys() == optim_before.keys()
    for k, v in optim_before.items():
        w = optim_again[k]
        assert torch.equal(w, v) if isinstance(v, torch.Tensor) else w == v, k
    assert torch.equal(_probe(model2, rank, world), logits_before)
    return losses


def test_meta_offload_load_without_to_empty_two_ranks(tmp_path):
    losses = run_ranks(2, _run, str(tmp_path))
    assert losses[0] == losses[1]


def test_meta_offload_load_without_to_empty_one_rank(tmp_path):
    # World size 1: every shard is the whole tensor (no padding), as in the GPU report.
    run_ranks(1, _run, str(tmp_path))


def _cuda_mesh_materialize(rank, world):
    """Materialize a meta DTensor of a CUDA-typed mesh on CPU, as offloaded FSDP2 parameters are."""
    from torch.distributed.device_mesh import DeviceMesh
    from torch.distributed.tensor import DTensor, Shard

    from shardckpt._runtimes import empty_like_meta

    # No backend is created and nothing runs on the mesh: it stands for the
    # CUDA mesh of a GPU job, whose offloaded shards must still live on CPU.
    mesh = DeviceMesh("cuda", torch.arange(world), _init_backend=False)
    with torch.device("meta"):
        full = torch.empty(37, 7)
    meta = DTensor.from_local(full.chunk(world)[rank], mesh, [Shard(0)], run_check=False, shape=full.shape, stride=full.stride())
    new = empty_like_meta(meta, torch.device("cpu"))
    assert isinstance(new, DTensor)
    assert new.device.type == "cpu" and new._local_tensor.device.type == "cpu", (new.device, new._local_tensor.device)
    assert new.device_mesh is mesh and new.placements == meta.placements
    assert new.shape == meta.shape and new.stride() == meta.stride() and new.dtype == meta.dtype
    assert new._local_tensor.shape == meta._local_tensor.shape
    p = torch.nn.Parameter(new)
    assert p.device.type == "cpu" and p._local_tensor.device.type == "cpu"
    return True


def test_materialized_dtensor_keeps_device():
    assert run_ranks(1, _cuda_mesh_materialize) == [True]
