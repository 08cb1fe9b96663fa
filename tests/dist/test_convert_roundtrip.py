"""Converters on real multi-rank checkpoints: every route back to FSDP2 bit-exact.

One 2-rank call saves an FSDP2 model (shardckpt and DCP) and a column-sharded
DTensor; the parent process converts (no process group, as a user would
offline); one 3-rank call loads every result into FSDP2 and records which
files each rank read.
"""

import glob
import json
import os

import torch
from _dist import run_ranks
from models import build, full_state, shard_fsdp2
from safetensors.torch import load_file

import shardckpt
from shardckpt import converters

IDX = torch.tensor([[1, 5, 36, 0], [7, 7, 2, 30]])


def _record_reads():
    """Patch Storage.read_into in this process: returns the list it appends (file, bytes) to."""
    from shardckpt import _storage

    log = []
    orig = _storage.Storage.read_into
    if getattr(orig, "_recording", False):
        orig = orig._orig

    def read_into(self, rel, ranges, **kw):
        log.append((rel, sum(len(b) for _, b in ranges)))
        return orig(self, rel, ranges, **kw)

    read_into._recording = True
    read_into._orig = orig
    _storage.Storage.read_into = read_into
    return log


def _save(rank, world, root):
    import torch.distributed.checkpoint as dcp
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import Shard, distribute_tensor

    model = shard_fsdp2(build(seed=1))
    model.emb.weight.data[0, 0] = float("nan")  # NaN payloads must survive bit-exactly
    shardckpt.save({"model": model, "step": 11}, f"{root}/native2")
    dcp.save({"model": model.state_dict(), "step": 11}, checkpoint_id=f"{root}/dcp2")
    mesh = init_device_mesh("cpu", (world,))
    full = torch.arange(5 * 9, dtype=torch.float32).reshape(5, 9)
    col = distribute_tensor(full, mesh, [Shard(1)])  # chunks split dim 1: exports must assemble rows
    shardckpt.save({"w": col, "ids": torch.arange(3)}, f"{root}/tp2")
    return full_state(model)


def _load_all(rank, world, paths):
    out = {}
    for tag, path, with_step in paths:
        model = shard_fsdp2(build(seed=2))
        # Forward first: FSDP2 has built its all-gather buffers, so a loader
        # that swapped Parameters would leave the next forward on old weights.
        model(IDX).sum().backward()
        state = {"model": model, "step": 0} if with_step else {"model": model}
        log = _record_reads()
        log.clear()
        shardckpt.load(state, path)
        out[tag] = (full_state(model), state.get("step"), model(IDX).detach(), sorted({f for f, _ in log}))
    return out


def _same(a, b):
    assert a.keys() == b.keys(), sorted(set(a) ^ set(b))
    for k in a:
        assert a[k].dtype == b[k].dtype, k
        assert torch.equal(a[k].reshape(-1).view(torch.uint8), b[k].reshape(-1).view(torch.uint8)) if a[k].is_floating_point() else torch.equal(a[k], b[k]), k


def test_fsdp2_roundtrips_through_every_converter(tmp_path):
    root = str(tmp_path)
    saved = run_ranks(2, _save, root)[0]
    model_keys = {k: v for k, v in saved.items()}

    # -> HF safetensors (several shards) checked with safetensors' own reader
    r = converters.to_safetensors(f"{root}/native2", f"{root}/hf", max_shard_size=600)
    shards = sorted(glob.glob(f"{root}/hf/model-*.safetensors"))
    assert len(shards) > 2 and r.files[-1] == "model.safetensors.index.json"
    index = json.load(open(f"{root}/hf/model.safetensors.index.json"))
    got = {}
    for f in shards:
        part = load_file(f)
        # Shard size respected unless one tensor alone is bigger.
        nbytes = sum(t.numel() * t.element_size() for t in part.values())
        assert nbytes <= 600 or len(part) == 1, (f, nbytes)
        for k in part:
            assert index["weight_map"][k] == os.path.basename(f)
        got.update(part)
    assert set(index["weight_map"]) == set(got) == set(model_keys)
    assert index["metadata"]["total_size"] == sum(t.numel() * t.element_size() for t in got.values())
    _same(got, model_keys)
    assert got["counts"].dtype == torch.int64 and got["mask"].dtype == torch.bool

    converters.from_safetensors(f"{root}/hf", f"{root}/from_hf")
    converters.to_full(f"{root}/native2", f"{root}/full.safetensors")
    converters.from_safetensors(f"{root}/full.safetensors", f"{root}/from_full_st", prefix="")
    converters.to_full(f"{root}/native2", f"{root}/full.pt")
    pt = torch.load(f"{root}/full.pt", weights_only=True)
    assert pt["step"] == 11
    _same(pt["model"], model_keys)
    converters.from_torch_save(f"{root}/full.pt", f"{root}/from_pt")
    rs = converters.reshard(f"{root}/native2", f"{root}/rs3", world_size=3)
    converters.from_dcp(f"{root}/dcp2", f"{root}/from_dcp")

    # Column-sharded chunks: the export assembles whole rows.
    converters.to_safetensors(f"{root}/tp2", f"{root}/hf_tp", prefix=None)
    tp = load_file(f"{root}/hf_tp/model.safetensors")
    assert torch.equal(tp["w"], torch.arange(45, dtype=torch.float32).reshape(5, 9))
    assert torch.equal(tp["ids"], torch.arange(3))

    paths = [
        ("hf", f"{root}/from_hf", False),
        ("hf_direct", f"{root}/hf", False),
        ("full_st", f"{root}/from_full_st", False),
        ("pt", f"{root}/from_pt", True),
        ("rs3", f"{root}/rs3", True),
        ("dcp", f"{root}/from_dcp", True),
    ]
    results = run_ranks(3, _load_all, paths)
    ref_out = None
    for tag, _, with_step in paths:
        got_state, step, out, _ = results[0][tag]
        _same(got_state, saved)
        if with_step:
            assert step == 11, tag
        if ref_out is None:
            ref_out = out
        # NaN in the embedding: compare outputs bit for bit, NaNs included.
        assert torch.equal(out.view(torch.int32), ref_out.view(torch.int32)), tag

    # Offline reshard 2 -> 3: each rank opened its own data file and the
    # shared one for replicated buffers, nothing else.
    data = [f for f in rs.files]
    own = {r: [f for f in data if f.endswith(f"-r{r:05d}.safetensors")] for r in range(3)}
    shared = [f for f in data if f.endswith("-replicated.safetensors")]
    assert all(len(own[r]) == 1 for r in range(3)) and len(shared) == 1
    for r in range(3):
        read = results[r]["rs3"][3]
        assert set(read) <= set(own[r] + shared), (r, read)
        assert own[r][0] in read


class _Big(torch.nn.Module):
    """Tensors of several MB, so one rank's rows and the other's are far apart in the file."""

    def __init__(self):
        super().__init__()
        self.a = torch.nn.Linear(512, 1536)
        self.b = torch.nn.Linear(1536, 512)
        self.register_buffer("steps", torch.arange(4, dtype=torch.int64))


def _load_hf_direct(rank, world, hf_dir, ren_dir):
    from torch.distributed.fsdp import fully_shard

    torch.manual_seed(7)
    model = _Big()
    fully_shard(model)
    log = _record_reads()
    log.clear()
    res = shardckpt.load({"model": model}, hf_dir)
    nread = sum(n for _, n in log)
    mine = sum(p.to_local().numel() * p.element_size() for p in model.parameters())
    mine += sum(b.numel() * b.element_size() for b in model.buffers())
    # Also with HF-style renaming through key_map and a key selection.
    torch.manual_seed(8)
    other = _Big()
    fully_shard(other)
    res2 = shardckpt.load({"net": other}, ren_dir, key_map=lambda k: "net." + k.replace("proj_", ""), keys=["proj_a.*"], strict=False)
    return full_state(model), nread, mine, res, full_state(other), res2


def test_hf_directory_loads_into_fsdp2_reading_only_own_rows(tmp_path):
    from safetensors.torch import save_file

    torch.manual_seed(3)
    ref = _Big()
    sd = {k: v.detach().clone() for k, v in ref.state_dict().items()}
    hf = tmp_path / "hf"
    hf.mkdir()
    # An HF-style sharded directory written by safetensors itself.
    save_file({k: sd[k] for k in ("a.weight", "a.bias")}, str(hf / "model-00001-of-00002.safetensors"), metadata={"format": "pt"})
    save_file({k: sd[k] for k in ("b.weight", "b.bias", "steps")}, str(hf / "model-00002-of-00002.safetensors"), metadata={"format": "pt"})
    wm = {k: "model-00001-of-00002.safetensors" for k in ("a.weight", "a.bias")}
    wm.update({k: "model-00002-of-00002.safetensors" for k in ("b.weight", "b.bias", "steps")})
    (hf / "model.safetensors.index.json").write_text(json.dumps({"metadata": {"total_size": 0}, "weight_map": wm}))
    # A renamed copy for the key_map/keys case.
    ren = tmp_path / "ren"
    ren.mkdir()
    save_file({"proj_" + k: v for k, v in sd.items()}, str(ren / "model.safetensors"))

    res = run_ranks(2, _load_hf_direct, str(hf), str(ren))
    total = sum(v.numel() * v.element_size() for v in sd.values())
    for rank, (state, nread, mine, lr, _, _) in enumerate(res):
        _same(state, sd)
        assert lr.missing_keys == [] and lr.unexpected_keys == []
        # Ranged reads of this rank's rows only (plus page alignment), about
        # half the model on each of the 2 ranks.
        # The replicated buffer is read by one of the ranks and sent to the
        # other (read-once), so a rank may read it or not.
        steps = sd["steps"].numel() * sd["steps"].element_size()
        assert mine - steps <= nread <= mine + (64 << 10), (rank, nread, mine)
        assert nread < 0.6 * total
    for state, _, _, _, other, lr2 in res:
        assert torch.equal(other["a.weight"], sd["a.weight"]) and torch.equal(other["a.bias"], sd["a.bias"])
        assert not torch.equal(other["b.weight"], sd["b.weight"])
        assert sorted(lr2.missing_keys) == ["net.b.bias", "net.b.weight", "net.steps"]


# --------------------------------------------------------------------------
# torchtitan: model keys at the top level, the optimizer flattened, written
# with the real DCP API by FSDP2 ranks; imported, then resumed by FSDP2.


def _tt_model(seed):
    model = shard_fsdp2(build(seed=seed))
    opt = torch.optim.AdamW(model.parameters(), lr=0.05 if seed == 21 else 0.9, betas=(0.8, 0.9), weight_decay=0.01 if seed == 21 else 0.5)
    return model, opt


def _tt_step(model, opt):
    model(IDX).float().pow(2).mean().backward()
    opt.step()
    opt.zero_grad()


def _full_optim(model, opt):
    from torch.distributed.checkpoint.state_dict import StateDictOptions, get_optimizer_state_dict

    # Full tensors on every rank (cpu_offload would leave the other ranks empty).
    osd = get_optimizer_state_dict(model, opt, options=StateDictOptions(full_state_dict=True))
    return {"state": {k: {n: v.detach().cpu().clone() for n, v in s.items()} for k, s in osd["state"].items()},
            "param_groups": osd["param_groups"]}


def _tt_save(rank, world, root):
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.state_dict import StateDictOptions, get_model_state_dict, get_optimizer_state_dict

    model, opt = _tt_model(21)
    for _ in range(3):
        _tt_step(model, opt)
    state = dict(get_model_state_dict(model))
    state["optimizer"] = get_optimizer_state_dict(model, opt, options=StateDictOptions(flatten_optimizer_state_dict=True))
    state["train_state"] = {"step": torch.tensor(3, dtype=torch.int32)}
    dcp.save(state, checkpoint_id=f"{root}/tt")
    saved = (full_state(model), _full_optim(model, opt))
    _tt_step(model, opt)  # the step a resumed run must reproduce
    return saved, full_state(model)


def _tt_resume(rank, world, native):
    model, opt = _tt_model(22)  # other weights and hyperparameters, optimizer never stepped
    state = {"model": model, "optim": opt, "train_state": {"step": torch.tensor(0, dtype=torch.int32)}}
    shardckpt.load(state, native)
    loaded = (full_state(model), _full_optim(model, opt), int(state["train_state"]["step"]))
    _tt_step(model, opt)
    return loaded, full_state(model)


def _same_optim_state(a, b):
    assert a["param_groups"] == b["param_groups"]
    assert a["state"].keys() == b["state"].keys()
    for k in a["state"]:
        assert a["state"][k].keys() == b["state"][k].keys(), k
        _same(a["state"][k], b["state"][k])


def test_torchtitan_fsdp2_checkpoint_resumes_adamw_bit_exactly(tmp_path):
    root = str(tmp_path)
    (saved_model, saved_optim), after = run_ranks(2, _tt_save, root)[0]
    converters.from_dcp(f"{root}/tt", f"{root}/native")
    man = json.load(open(f"{root}/native/manifest.json"))
    assert "optim.state.emb.weight.exp_avg_sq" in man["tensors"] and "model.head.weight" in man["tensors"]
    for rank_out in run_ranks(2, _tt_resume, f"{root}/native"):
        (model, optim, step), resumed = rank_out
        _same(model, saved_model)
        _same_optim_state(optim, saved_optim)
        assert step == 3
        _same(resumed, after)  # the next step is bit-identical to the uninterrupted run
    # ...and in one process, no process group: the same state.
    model, opt = build(seed=23), None
    opt = torch.optim.AdamW(model.parameters(), lr=0.9)
    shardckpt.load({"model": model, "optim": opt}, f"{root}/native")
    _same(full_state(model), saved_model)
    osd = opt.state_dict()
    names = [n for n, _ in model.named_parameters()]
    assert osd["param_groups"][0]["lr"] == 0.05 and osd["param_groups"][0]["betas"] == (0.8, 0.9)
    for i, n in enumerate(names):
        _same({k: v for k, v in osd["state"][i].items()}, saved_optim["state"][n])


# --------------------------------------------------------------------------
# Converter outputs are format v2: a 4-rank load of a tensor a converter wrote
# whole reads about its own rows (block checksums), like a save's output.


class _Wide(torch.nn.Module):
    """16 MiB and 4 MiB weights: each of 4 FSDP2 ranks needs a quarter (1 MiB blocks)."""

    def __init__(self):
        super().__init__()
        self.a = torch.nn.Linear(2048, 2048)
        self.b = torch.nn.Linear(2048, 512)


def _load_counting(rank, world, src):
    from torch.distributed.fsdp import fully_shard

    torch.manual_seed(5)
    model = _Wide()
    fully_shard(model)
    log = _record_reads()
    log.clear()
    shardckpt.load({"model": model}, src)
    nread = sum(n for _, n in log)
    mine = sum(p.to_local().numel() * p.element_size() for p in model.parameters())
    return full_state(model), nread, mine


def test_converter_outputs_load_on_4_ranks_reading_1_1x_the_needed_bytes(tmp_path):
    from safetensors.torch import save_file

    root = str(tmp_path)
    torch.manual_seed(4)
    sd = {k: v.detach().clone() for k, v in _Wide().state_dict().items()}
    os.makedirs(f"{root}/hf")
    save_file(sd, f"{root}/hf/model.safetensors")
    converters.from_safetensors(f"{root}/hf", f"{root}/imported")  # one writer, whole tensors
    converters.reshard(f"{root}/imported", f"{root}/rs2", world_size=2)  # 2 writers, dim-0 halves
    for out in ("imported", "rs2"):
        assert shardckpt.verify(f"{root}/{out}").version == 5
        res = run_ranks(4, _load_counting, f"{root}/{out}")
        for rank, (state, nread, mine) in enumerate(res):
            _same(state, sd)
            assert mine <= nread <= 1.1 * mine, (out, rank, nread, mine)
