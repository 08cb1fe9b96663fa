"""Converters on real files in one process: options, dtypes, damage, atomicity, unsafe pickles, fsspec."""

import io
import json
import os
import pickle
import subprocess
import sys
import zipfile

import pytest
import torch
from safetensors.torch import load_file, save_file

import shardckpt
from shardckpt import converters
from shardckpt.errors import (
    CheckpointExistsError,
    CheckpointNotFoundError,
    ChecksumMismatchError,
    CorruptCheckpointError,
    StateMismatchError,
    UnsafeMetadataError,
)


def _state():
    g = torch.Generator().manual_seed(0)
    return {
        "model": {
            "emb": torch.randn(37, 7, generator=g),
            "w_bf16": torch.randn(5, 3, generator=g).to(torch.bfloat16),
            "w_fp8": torch.randn(4, 4, generator=g).to(torch.float8_e4m3fn),
            "ids": torch.arange(6, dtype=torch.int64) - 3,
            "mask": torch.tensor([True, False, True]),
            "scalar": torch.tensor(2.5),
            "empty": torch.zeros(0, 3),
        },
        "opt": {"m": torch.ones(3)},
        "step": 4,
    }


@pytest.fixture
def ckpt(tmp_path):
    st = _state()
    shardckpt.save(st, str(tmp_path / "ck"))
    return str(tmp_path / "ck"), st


def _eq(a, b):
    assert a.dtype == b.dtype and a.shape == b.shape
    if a.is_floating_point():  # bitwise: NaN payloads and -0.0 count
        assert torch.equal(a.reshape(-1).view(torch.uint8), b.reshape(-1).view(torch.uint8))
    else:
        assert torch.equal(a, b)


def test_to_safetensors_selection_renaming_and_dtypes(ckpt, tmp_path):
    src, st = ckpt
    converters.to_safetensors(src, str(tmp_path / "hf"))
    got = load_file(str(tmp_path / "hf" / "model.safetensors"))
    assert set(got) == set(st["model"])  # "model." stripped, optimizer left out
    for k, v in st["model"].items():
        _eq(got[k], v)

    converters.to_safetensors(src, str(tmp_path / "bf"), dtype=torch.bfloat16, keys=["w_*", "ids", "mask"],
                              key_map={"ids": "input_ids"})
    got = load_file(str(tmp_path / "bf" / "model.safetensors"))
    assert set(got) == {"w_bf16", "w_fp8", "input_ids", "mask"}
    assert got["w_fp8"].dtype == torch.bfloat16 and torch.equal(got["w_fp8"], st["model"]["w_fp8"].to(torch.bfloat16))
    assert got["input_ids"].dtype == torch.int64 and torch.equal(got["input_ids"], st["model"]["ids"])  # ints keep dtype
    assert got["mask"].dtype == torch.bool and torch.equal(got["mask"], st["model"]["mask"])

    converters.to_safetensors(src, str(tmp_path / "f8"), dtype="float8_e4m3fn", prefix=None, key_map=lambda k: k.replace(".", "/"))
    got = load_file(str(tmp_path / "f8" / "model.safetensors"))
    assert "opt/m" in got and got["model/emb"].dtype == torch.float8_e4m3fn
    _eq(got["model/emb"], st["model"]["emb"].to(torch.float8_e4m3fn))

    with pytest.raises(StateMismatchError, match="nope"):
        converters.to_safetensors(src, str(tmp_path / "x"), keys=["nope*"])
    with pytest.raises(CheckpointExistsError):
        converters.to_safetensors(src, str(tmp_path / "hf"))
    converters.to_safetensors(src, str(tmp_path / "hf"), overwrite=True, max_shard_size=100)
    assert sorted(os.listdir(tmp_path / "hf"))[-1] == "model.safetensors.index.json"
    assert not any(n.startswith(".") for n in os.listdir(tmp_path))  # no temp dirs left


def test_to_full_pt_is_a_valid_zip_with_the_whole_structure(ckpt, tmp_path):
    src, st = ckpt
    r = converters.to_full(src, str(tmp_path / "full.pt"))
    assert r.tensors == 8
    with zipfile.ZipFile(tmp_path / "full.pt") as z:
        assert z.testzip() is None  # every record's CRC-32 filled in
    pt = torch.load(str(tmp_path / "full.pt"), weights_only=True)
    assert pt["step"] == 4
    for k, v in st["model"].items():
        _eq(pt["model"][k], v)
    _eq(pt["opt"]["m"], st["opt"]["m"])
    converters.to_full(src, str(tmp_path / "full.safetensors"), keys=["model.ids"])
    assert list(load_file(str(tmp_path / "full.safetensors"))) == ["model.ids"]
    with pytest.raises(ValueError, match="must end in"):
        converters.to_full(src, str(tmp_path / "full.txt"))


def test_damaged_source_publishes_nothing(ckpt, tmp_path):
    src, _ = ckpt
    m = shardckpt.inspect(src)
    c = m.tensors["model.emb"].chunks[0]
    path = os.path.join(src, c.file)
    raw = bytearray(open(path, "rb").read())
    raw[c.byte_offset + 5] ^= 0x40
    open(path, "wb").write(bytes(raw))
    with pytest.raises(ChecksumMismatchError, match="model.emb"):
        converters.to_safetensors(src, str(tmp_path / "hf"))
    with pytest.raises(ChecksumMismatchError):
        converters.to_full(src, str(tmp_path / "f.pt"))
    with pytest.raises(ChecksumMismatchError):
        converters.reshard(src, str(tmp_path / "rs"), world_size=2)
    assert not (tmp_path / "hf").exists() and not (tmp_path / "f.pt").exists()
    assert not (tmp_path / "rs" / "manifest.json").exists()
    # No temp files or data files left behind either.
    left = [os.path.join(d, f) for d, _, fs in os.walk(tmp_path) for f in fs if not d.startswith(src)]
    assert left == [], left
    assert not any(n.startswith(".") for n in os.listdir(tmp_path))
    # A truncated source file is caught before anything is written.
    os.truncate(path, c.byte_offset + 10)
    with pytest.raises(CorruptCheckpointError, match="truncated"):
        converters.to_safetensors(src, str(tmp_path / "hf"))
    assert not (tmp_path / "hf").exists()


def test_from_safetensors_index_and_single_file(tmp_path):
    g = torch.Generator().manual_seed(1)
    sd = {"a.weight": torch.randn(6, 4, generator=g), "b.weight": torch.randn(3, generator=g).half(), "pos": torch.arange(4)}
    hf = tmp_path / "hf"
    hf.mkdir()
    save_file({"a.weight": sd["a.weight"]}, str(hf / "model-00001-of-00002.safetensors"))
    save_file({"b.weight": sd["b.weight"], "pos": sd["pos"]}, str(hf / "model-00002-of-00002.safetensors"))
    wm = {"a.weight": "model-00001-of-00002.safetensors", "b.weight": "model-00002-of-00002.safetensors",
          "pos": "model-00002-of-00002.safetensors"}
    (hf / "model.safetensors.index.json").write_text(json.dumps({"metadata": {}, "weight_map": wm}))
    converters.from_safetensors(str(hf), str(tmp_path / "nat"))
    shardckpt.verify(str(tmp_path / "nat"))
    live = {"model": {k: torch.zeros_like(v) for k, v in sd.items()}}
    shardckpt.load(live, str(tmp_path / "nat"))
    for k in sd:
        _eq(live["model"][k], sd[k])
    # One file, no index; the direct load puts bare keys under "model".
    save_file(sd, str(tmp_path / "one.safetensors"))
    live = {"model": {k: torch.zeros_like(v) for k, v in sd.items()}}
    shardckpt.load(live, str(tmp_path / "one.safetensors"))
    _eq(live["model"]["a.weight"], sd["a.weight"])
    m = shardckpt.verify(str(hf))  # no checksums: headers, bounds and sizes
    assert m.extra["source"] == "safetensors" and len(m.tensors) == 3
    # An index naming a missing file, or a key its file lacks, is refused.
    os.remove(hf / "model-00002-of-00002.safetensors")
    with pytest.raises(Exception, match="model-00002-of-00002.safetensors"):
        shardckpt.inspect(str(hf))


def test_uncommitted_native_save_is_not_mistaken_for_hf(tmp_path):
    d = tmp_path / "ck"
    shardckpt.save({"w": torch.ones(3)}, str(d))
    os.remove(d / "manifest.json")  # as if the save died right before its commit
    assert (d / "model.safetensors.index.json").exists()
    with pytest.raises(CheckpointNotFoundError, match="never finished"):
        shardckpt.inspect(str(d))


class _Evil:
    def __init__(self, marker):
        self.marker = marker

    def __reduce__(self):
        return (os.system, (f"touch {self.marker}",))


def test_pickles_that_run_code_are_refused(tmp_path):
    marker = tmp_path / "PWNED"
    for i, zipped in enumerate([True, False]):
        bad = tmp_path / f"evil{i}.pt"
        torch.save({"w": torch.ones(2), "x": _Evil(marker)}, str(bad), _use_new_zipfile_serialization=zipped)
        with pytest.raises(UnsafeMetadataError, match="system"):
            converters.from_torch_save(str(bad), str(tmp_path / f"out{i}"))
    # DCP: a .metadata pickle with a __reduce__ gadget, and a poisoned non-tensor item.
    import torch.distributed.checkpoint as dcp

    d = tmp_path / "dcp"
    dcp.save({"w": torch.ones(3), "step": 1}, checkpoint_id=str(d), no_dist=True)
    good = (d / ".metadata").read_bytes()
    (d / ".metadata").write_bytes(pickle.dumps(_Evil(marker)))
    with pytest.raises(UnsafeMetadataError, match="posix.system|os.system"):
        converters.from_dcp(str(d), str(tmp_path / "o3"))
    (d / ".metadata").write_bytes(good)
    md = pickle.loads(good)
    info = next(v for k, v in md.storage_data.items() if k.fqn == "step")
    buf = io.BytesIO()
    torch.save(_Evil(marker), buf)
    data = bytearray((d / info.relative_path).read_bytes())
    payload = buf.getvalue()
    # Append the poisoned item at the end of the data file and point "step" at it.
    info.offset, info.length = len(data), len(payload)
    (d / info.relative_path).write_bytes(bytes(data) + payload)
    (d / ".metadata").write_bytes(pickle.dumps(md))
    with pytest.raises(UnsafeMetadataError, match="step"):
        converters.from_dcp(str(d), str(tmp_path / "o4"))
    assert not marker.exists()
    assert not (tmp_path / "out0" / "manifest.json").exists()


def test_dcp_safetensors_serialization(tmp_path):
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.filesystem import FileSystemWriter, SerializationFormat

    sd = {"model": {"w": torch.randn(5, 3), "b": torch.arange(4)}}
    writer = FileSystemWriter(str(tmp_path / "d"), serialization_format=SerializationFormat.SAFETENSORS)
    dcp.save(sd, storage_writer=writer, no_dist=True)
    converters.from_dcp(str(tmp_path / "d"), str(tmp_path / "n"))
    live = {"model": {"w": torch.zeros(5, 3), "b": torch.zeros(4, dtype=torch.int64)}}
    shardckpt.load(live, str(tmp_path / "n"))
    _eq(live["model"]["w"], sd["model"]["w"])
    _eq(live["model"]["b"], sd["model"]["b"])


def test_torch_save_views_tied_weights_and_nested_values(tmp_path):
    base = torch.arange(24, dtype=torch.float32).reshape(4, 6)
    obj = {"model": {"t": base.t(), "tied_a": base, "tied_b": base, "half": base[1:3]}, "sched": {"lr": 0.5, "ms": [1, 2]}, "epoch": 3}
    torch.save(obj, str(tmp_path / "x.pt"))
    converters.from_torch_save(str(tmp_path / "x.pt"), str(tmp_path / "nat"))
    live = {"model": {k: torch.zeros_like(v.contiguous()) for k, v in obj["model"].items()}, "sched": {}, "epoch": 0}
    shardckpt.load(live, str(tmp_path / "nat"))
    for k, v in obj["model"].items():
        _eq(live["model"][k], v.contiguous())
    assert live["epoch"] == 3 and live["sched"] == {"lr": 0.5, "ms": [1, 2]}
    # A bare state dict goes under "model." by default.
    torch.save({"w": torch.ones(2)}, str(tmp_path / "sd.pt"))
    converters.from_torch_save(str(tmp_path / "sd.pt"), str(tmp_path / "nat2"))
    assert list(shardckpt.inspect(str(tmp_path / "nat2")).tensors) == ["model.w"]


def test_any_fsspec_url_on_both_sides(ckpt, tmp_path):
    src, st = ckpt
    converters.to_safetensors(src, "memory://shardckpt-test/hf", max_shard_size="200B")
    converters.from_safetensors("memory://shardckpt-test/hf", "memory://shardckpt-test/nat")
    converters.reshard("memory://shardckpt-test/nat", "memory://shardckpt-test/rs", world_size=3, progress=True)
    converters.to_full("memory://shardckpt-test/rs", "memory://shardckpt-test/full.pt")
    converters.to_full("memory://shardckpt-test/rs", str(tmp_path / "back.safetensors"), dst_storage_options=None)
    got = load_file(str(tmp_path / "back.safetensors"))
    for k, v in st["model"].items():
        _eq(got[f"model.{k}"], v)
    import fsspec

    with fsspec.open("memory://shardckpt-test/full.pt", "rb") as f:
        pt = torch.load(io.BytesIO(f.read()), weights_only=True)
    _eq(pt["model"]["emb"], st["model"]["emb"])
    fsspec.filesystem("memory").rm("/shardckpt-test", recursive=True)


MEMORY_SCRIPT = r"""
import json, sys, torch, shardckpt
from shardckpt import converters
src, dst = sys.argv[1], sys.argv[2]
def hwm():
    return int(next(l for l in open("/proc/self/status") if l.startswith("VmHWM")).split()[1]) * 1024
before = hwm()
r = converters.to_safetensors(src, dst, prefix=None, dtype="bf16" if len(sys.argv) > 3 else None)
print(json.dumps({"growth": hwm() - before, "nbytes": r.nbytes}))
"""


@pytest.mark.slow
def test_exporting_1gib_grows_peak_rss_by_well_under_400mb(tmp_path):
    src = str(tmp_path / "big")
    g = torch.Generator().manual_seed(0)
    # ~1 GiB in 2 ranks' worth of chunks is not needed: one process, 8 tensors of 128 MiB.
    shardckpt.save({f"layer{i}": torch.randn(32768, 1024, generator=g) for i in range(8)}, src)
    for extra in ([], ["cast"]):
        dst = str(tmp_path / f"hf{len(extra)}")
        out = subprocess.run([sys.executable, "-c", MEMORY_SCRIPT, src, dst] + extra, capture_output=True, text=True, check=True)
        res = json.loads(out.stdout.strip().splitlines()[-1])
        assert res["nbytes"] >= (1 << 30) // (2 if extra else 1)
        assert res["growth"] < 400 << 20, res


# --------------------------------------------------------------------------
# Interop: the bare-dict rule, torchtitan's layout, model-only exports,
# publishable exports, legacy .bin directories, hostile DCP metadata.


class _Tiny(torch.nn.Module):
    def __init__(self, seed=0):
        super().__init__()
        torch.manual_seed(seed)
        self.emb = torch.nn.Embedding(11, 6)
        self.layers = torch.nn.ModuleList([torch.nn.Linear(6, 6) for _ in range(2)])
        self.head = torch.nn.Linear(6, 11, bias=False)

    def forward(self, idx):
        x = self.emb(idx)
        for layer in self.layers:
            x = torch.tanh(layer(x))
        return self.head(x)


_IDS = torch.tensor([[1, 4, 9, 2], [3, 3, 0, 10]])


def _trained(seed=0, steps=2, lr=1e-2):
    """A model and an AdamW stepped ``steps`` times (two param groups, a scheduler)."""
    m = _Tiny(seed)
    opt = torch.optim.AdamW(
        [{"params": [m.emb.weight], "lr": lr, "weight_decay": 0.0},
         {"params": [p for n, p in m.named_parameters() if not n.startswith("emb.")], "lr": lr / 2}],
        betas=(0.8, 0.95),
    )
    sched = torch.optim.lr_scheduler.LambdaLR(opt, lambda s: 0.5 ** s)
    for _ in range(steps):
        m(_IDS).logsumexp(-1).sum().backward()
        opt.step()
        sched.step()
        opt.zero_grad()
    return m, opt, sched


def _fresh_optim(m, lr=1e-2):
    return torch.optim.AdamW(
        [{"params": [m.emb.weight], "lr": 0.5, "weight_decay": 0.3},
         {"params": [p for n, p in m.named_parameters() if not n.startswith("emb.")], "lr": 0.5}],
    )


def _same_optim(a, b):
    sa, sb = a.state_dict(), b.state_dict()
    assert sa["param_groups"] == sb["param_groups"]
    assert sa["state"].keys() == sb["state"].keys()
    for i in sa["state"]:
        assert sa["state"][i].keys() == sb["state"][i].keys()
        for k in sa["state"][i]:
            _eq(sa["state"][i][k], sb["state"][i][k])


def test_bare_state_dict_imports_the_same_way_from_dcp_torch_save_and_safetensors(tmp_path):
    import torch.distributed.checkpoint as dcp

    ref = _Tiny(1)
    sd = {k: v.detach().clone() for k, v in ref.state_dict().items()}
    dcp.save(sd, checkpoint_id=str(tmp_path / "dcp"), no_dist=True)
    torch.save(sd, str(tmp_path / "sd.pt"))
    save_file(sd, str(tmp_path / "model.safetensors"))
    converters.from_dcp(str(tmp_path / "dcp"), str(tmp_path / "n_dcp"))
    converters.from_torch_save(str(tmp_path / "sd.pt"), str(tmp_path / "n_pt"))
    converters.from_safetensors(str(tmp_path / "model.safetensors"), str(tmp_path / "n_st"))
    for tag in ("n_dcp", "n_pt", "n_st"):
        live = _Tiny(2)
        res = shardckpt.load({"model": live}, str(tmp_path / tag))  # strict: every weight found
        assert res.missing_keys == [] and res.unexpected_keys == [], tag
        for k, v in live.state_dict().items():
            _eq(v, sd[k])
        # An explicit prefix wins over the rule, the same way everywhere.
    converters.from_dcp(str(tmp_path / "dcp"), str(tmp_path / "n_dcp_net"), prefix="net.")
    converters.from_torch_save(str(tmp_path / "sd.pt"), str(tmp_path / "n_pt_net"), prefix="net.")
    for tag in ("n_dcp_net", "n_pt_net"):
        live = _Tiny(3)
        shardckpt.load({"net": live}, str(tmp_path / tag))
        _eq(live.head.weight, sd["head.weight"])


def _torchtitan_dcp(path, m, opt, sched, step):
    """Write ``path`` the way torchtitan's checkpointer does, with the real DCP API (no torchtitan needed)."""
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.state_dict import StateDictOptions, get_model_state_dict, get_optimizer_state_dict

    state = dict(get_model_state_dict(m))  # torchtitan flattens the model's keys to the top level
    state["optimizer"] = get_optimizer_state_dict(m, opt, options=StateDictOptions(flatten_optimizer_state_dict=True))
    state["lr_scheduler"] = sched.state_dict()
    state["train_state"] = {"step": torch.tensor(step, dtype=torch.int32), "ntokens_seen": torch.tensor(step * 8)}
    assert any(k.startswith("state.") for k in state["optimizer"])  # really the flattened form
    dcp.save(state, checkpoint_id=str(path), no_dist=True)


def test_torchtitan_layout_resumes_model_and_adamw_bit_exactly(tmp_path):
    m, opt, sched = _trained(seed=4)
    _torchtitan_dcp(tmp_path / "tt", m, opt, sched, step=2)
    converters.from_dcp(str(tmp_path / "tt"), str(tmp_path / "native"))
    m2 = _Tiny(9)
    opt2 = _fresh_optim(m2)
    state = {"model": m2, "optim": opt2, "train_state": {"step": torch.tensor(0, dtype=torch.int32), "ntokens_seen": torch.tensor(0)}}
    res = shardckpt.load(state, str(tmp_path / "native"))
    assert res.missing_keys == []
    for k, v in m.state_dict().items():
        _eq(m2.state_dict()[k], v)
    _same_optim(opt, opt2)
    assert int(state["train_state"]["step"]) == 2 and int(state["train_state"]["ntokens_seen"]) == 16
    # The next step is the same step: Adam's bias correction needs the right `step`.
    for mm, oo in ((m, opt), (m2, opt2)):
        mm(_IDS).logsumexp(-1).sum().backward()
        oo.step()
    for k, v in m.state_dict().items():
        _eq(m2.state_dict()[k], v)
    # The scheduler's state is there too, under torchtitan's name.
    man = json.load(open(tmp_path / "native" / "manifest.json"))
    assert man["values"]["lr_scheduler"]["last_epoch"] == 2
    assert "optim.state.emb.weight.exp_avg" in man["tensors"]


def test_flattened_optimizer_in_a_dcp_recipe_checkpoint_is_rebuilt(tmp_path):
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.state_dict import StateDictOptions, get_optimizer_state_dict

    m, opt, _ = _trained(seed=5)
    osd = get_optimizer_state_dict(m, opt, options=StateDictOptions(flatten_optimizer_state_dict=True))
    dcp.save({"model": m.state_dict(), "optim": osd, "step": 2}, checkpoint_id=str(tmp_path / "d"), no_dist=True)
    converters.from_dcp(str(tmp_path / "d"), str(tmp_path / "n"))
    m2 = _Tiny(6)
    opt2 = _fresh_optim(m2)
    state = {"model": m2, "optim": opt2, "step": 0}
    shardckpt.load(state, str(tmp_path / "n"))
    assert state["step"] == 2
    _same_optim(opt, opt2)


def test_unflatten_optimizer_groups_by_hyperparameters():
    from shardckpt.converters._safetensors import unflatten_optimizer

    flat = {
        "state.a.b.weight.exp_avg": torch.ones(2),
        "state.a.b.weight.step": torch.tensor(3.0),
        "param_groups.a.b.weight.lr": 0.1,
        "param_groups.a.b.weight.betas": (0.9, 0.99),
        "param_groups.c.weight.lr": 0.2,
        "param_groups.c.weight.betas": (0.9, 0.99),
        "param_groups.d.lr": 0.1,
        "param_groups.d.betas": (0.9, 0.99),
    }
    out = unflatten_optimizer(flat)
    assert list(out["state"]) == ["a.b.weight"] and set(out["state"]["a.b.weight"]) == {"exp_avg", "step"}
    assert out["param_groups"] == [
        {"lr": 0.1, "betas": (0.9, 0.99), "params": ["a.b.weight", "d"]},
        {"lr": 0.2, "betas": (0.9, 0.99), "params": ["c.weight"]},
    ]
    # Not torch's flattening: left alone.
    assert unflatten_optimizer({"state.x": 1}) == {"state.x": 1}
    assert unflatten_optimizer({"state.a.exp_avg": 1, "other": 2}) == {"state.a.exp_avg": 1, "other": 2}


def test_to_safetensors_exports_only_the_model_entry(tmp_path):
    m, opt, _ = _trained(seed=7)
    shardckpt.save({"net": m, "optim": opt, "step": 2}, str(tmp_path / "c_net"))
    converters.to_safetensors(str(tmp_path / "c_net"), str(tmp_path / "hf_net"))
    got = load_file(str(tmp_path / "hf_net" / "model.safetensors"))
    assert set(got) == set(m.state_dict())  # no exp_avg, no optim.*: only the weights, bare names
    _eq(got["head.weight"], m.head.weight.detach())
    shardckpt.save({"policy": m}, str(tmp_path / "c_pol"))
    converters.to_safetensors(str(tmp_path / "c_pol"), str(tmp_path / "hf_pol"))
    assert set(load_file(str(tmp_path / "hf_pol" / "model.safetensors"))) == set(m.state_dict())
    # Two models: ambiguous -> the entries are listed with the option to choose.
    shardckpt.save({"actor": m, "critic": _Tiny(8), "optim": opt}, str(tmp_path / "c_two"))
    with pytest.raises(StateMismatchError, match=r"'actor' \(tensors\), 'critic' \(tensors\), 'optim' \(optimizer\).*model_key="):
        converters.to_safetensors(str(tmp_path / "c_two"), str(tmp_path / "hf_two"))
    assert not (tmp_path / "hf_two").exists()
    converters.to_safetensors(str(tmp_path / "c_two"), str(tmp_path / "hf_two"), model_key="critic")
    assert set(load_file(str(tmp_path / "hf_two" / "model.safetensors"))) == set(m.state_dict())
    with pytest.raises(StateMismatchError, match="optimizer"):
        converters.to_safetensors(str(tmp_path / "c_two"), str(tmp_path / "hf_x"), model_key="optim")
    with pytest.raises(StateMismatchError, match="names no top-level entry"):
        converters.to_safetensors(str(tmp_path / "c_two"), str(tmp_path / "hf_x"), model_key="nope")
    # prefix=None still exports everything, for those who ask.
    converters.to_safetensors(str(tmp_path / "c_net"), str(tmp_path / "hf_all"), prefix=None)
    assert any(k.startswith("optim.state.") for k in load_file(str(tmp_path / "hf_all" / "model.safetensors")))


COMPANIONS = {
    "config.json": b'{"model_type": "tiny"}\n',
    "generation_config.json": b'{"max_length": 5}\n',
    "tokenizer.json": b'{"version": "1.0"}\n',
    "tokenizer_config.json": b"{}\n",
    "special_tokens_map.json": b"{}\n",
    "vocab.json": b'{"a": 0}\n',
    "merges.txt": b"#version: 0.2\n",
    "tokenizer.model": b"\x00\x01spm",
}


def test_export_keeps_config_and_tokenizer_files_and_replaces_only_weights(tmp_path):
    m, _, _ = _trained(seed=10)
    shardckpt.save({"model": m}, str(tmp_path / "c"))
    hub = tmp_path / "hub"
    hub.mkdir()
    for k, v in COMPANIONS.items():
        (hub / k).write_bytes(v)
    save_file({"junk": torch.zeros(1)}, str(hub / "model.safetensors"))
    # copy_from brings the companion files along (and never the source's weights).
    r = converters.to_safetensors(str(tmp_path / "c"), str(tmp_path / "out"), copy_from=str(hub))
    assert set(r.files) == set(COMPANIONS) | {"model.safetensors"}
    for k, v in COMPANIONS.items():
        assert (tmp_path / "out" / k).read_bytes() == v
    assert set(load_file(str(tmp_path / "out" / "model.safetensors"))) == set(m.state_dict())
    # Into a directory holding config/tokenizer files and a README but no weights: no overwrite needed.
    tgt = tmp_path / "tgt"
    tgt.mkdir()
    (tgt / "config.json").write_bytes(COMPANIONS["config.json"])
    (tgt / "README.md").write_text("my model\n")
    (tgt / "extra").mkdir()
    (tgt / "extra" / "notes.txt").write_text("keep\n")
    converters.to_safetensors(str(tmp_path / "c"), str(tgt), max_shard_size=400)
    names = sorted(os.listdir(tgt))
    assert "config.json" in names and "README.md" in names and "model.safetensors.index.json" in names
    assert (tgt / "extra" / "notes.txt").read_text() == "keep\n"
    shards = [n for n in names if n.endswith(".safetensors")]
    assert len(shards) > 1
    # Weights there now: a second export needs overwrite, and then replaces only them.
    with pytest.raises(CheckpointExistsError, match="overwrite=True"):
        converters.to_safetensors(str(tmp_path / "c"), str(tgt))
    converters.to_safetensors(str(tmp_path / "c"), str(tgt), overwrite=True)
    names = sorted(os.listdir(tgt))
    assert names == ["README.md", "config.json", "extra", "model.safetensors"], names  # stale shards and index gone
    assert (tgt / "README.md").read_text() == "my model\n"
    assert not [n for n in os.listdir(tmp_path) if n.startswith(".")]  # no staging left behind
    # A failed export (ambiguous model) leaves the directory exactly as it was.
    shardckpt.save({"a": m, "b": _Tiny(1)}, str(tmp_path / "c2"))
    with pytest.raises(StateMismatchError):
        converters.to_safetensors(str(tmp_path / "c2"), str(tgt), overwrite=True)
    assert sorted(os.listdir(tgt)) == names
    with pytest.raises(CheckpointNotFoundError, match="config.json"):
        converters.to_safetensors(str(tmp_path / "c"), str(tmp_path / "o3"), copy_from=str(tmp_path / "c"))


def test_export_to_an_object_store_keeps_companion_files(tmp_path):
    import fsspec

    m, _, _ = _trained(seed=11)
    shardckpt.save({"model": m}, str(tmp_path / "c"))
    fs = fsspec.filesystem("memory")
    fs.pipe("/interop-test/hf/config.json", COMPANIONS["config.json"])
    fs.pipe("/interop-test/hf/model-00001-of-00009.safetensors", b"stale")
    fs.pipe("/interop-test/hf/model.safetensors.index.json", b"{}")
    try:
        converters.to_safetensors(str(tmp_path / "c"), "memory://interop-test/hf", overwrite=True)
        names = sorted(p.rsplit("/", 1)[1] for p in fs.ls("/interop-test/hf", detail=False))
        assert names == ["config.json", "model.safetensors"], names
    finally:
        fs.rm("/interop-test", recursive=True)


def test_sharded_legacy_bin_directory_imports(tmp_path):
    ref = _Tiny(12)
    sd = {k: v.detach().clone() for k, v in ref.state_dict().items()}
    d = tmp_path / "legacy"
    d.mkdir()
    keys = sorted(sd)
    parts = {"pytorch_model-00001-of-00002.bin": keys[:3], "pytorch_model-00002-of-00002.bin": keys[3:]}
    for f, ks in parts.items():
        torch.save({k: sd[k] for k in ks}, str(d / f))
    wm = {k: f for f, ks in parts.items() for k in ks}
    (d / "pytorch_model.bin.index.json").write_text(json.dumps({"metadata": {"total_size": 0}, "weight_map": wm}))
    for src, tag in ((str(d), "n1"), (str(d / "pytorch_model.bin.index.json"), "n2")):
        r = converters.from_torch_save(src, str(tmp_path / tag))
        assert r.tensors == len(sd)
        live = _Tiny(13)
        shardckpt.load({"model": live}, str(tmp_path / tag))
        for k, v in live.state_dict().items():
            _eq(v, sd[k])
    # A single legacy file in a directory imports the same way.
    d1 = tmp_path / "legacy1"
    d1.mkdir()
    torch.save(sd, str(d1 / "pytorch_model.bin"))
    converters.from_torch_save(str(d1), str(tmp_path / "n3"))
    live = _Tiny(14)
    shardckpt.load({"model": live}, str(tmp_path / "n3"))
    _eq(live.emb.weight, sd["emb.weight"])
    # Damaged indexes are named, never followed out of the directory.
    (d / "pytorch_model.bin.index.json").write_text(json.dumps({"weight_map": {"x": "../evil.bin"}}))
    with pytest.raises(CorruptCheckpointError):
        converters.from_torch_save(str(d), str(tmp_path / "n4"))
    (d / "pytorch_model.bin.index.json").write_text("[1, 2")
    with pytest.raises(CorruptCheckpointError, match="not JSON"):
        converters.from_torch_save(str(d), str(tmp_path / "n5"))


def _bomb(levels: int) -> bytes:
    """A pickle of tuples nested through memo references: ~6 bytes per level, 2**levels nodes."""
    body = b"\x80\x04)\x94"  # PROTO 4, EMPTY_TUPLE, MEMOIZE
    for i in range(levels):
        body += b"h" + bytes([i]) + b"h" + bytes([i]) + b"\x86\x94"  # BINGET i, BINGET i, TUPLE2, MEMOIZE
    return body + b"."


def _list_bomb(depth: int) -> bytes:
    return b"\x80\x04" + b"]" * depth + b"a" * (depth - 1) + b"."  # nested lists, 2 bytes a level


def _dcp_dir(tmp_path, name="d"):
    import torch.distributed.checkpoint as dcp

    d = tmp_path / name
    dcp.save({"w": torch.ones(3)}, checkpoint_id=str(d), no_dist=True)
    return d


def test_dcp_metadata_bombs_fail_fast(tmp_path):
    import time

    d = _dcp_dir(tmp_path)
    for data, what in ((_bomb(200), "describe more than"), (_list_bomb(600), "nested deeper")):
        assert len(data) <= 1300
        (d / ".metadata").write_bytes(data)
        t0 = time.perf_counter()
        with pytest.raises(UnsafeMetadataError, match=what):
            converters.from_dcp(str(d), str(tmp_path / "o"))
        assert time.perf_counter() - t0 < 5  # bounded work; unbounded took minutes
    # The bomb as a dict key: unpickling itself would hash 2**150 nodes.
    (d / ".metadata").write_bytes(b"\x80\x04}" + _bomb(150)[2:-1] + b"Ns.")  # EMPTY_DICT, bomb, None, SETITEM
    t0 = time.perf_counter()
    with pytest.raises(UnsafeMetadataError, match="describe more than"):
        converters.from_dcp(str(d), str(tmp_path / "o"))
    assert time.perf_counter() - t0 < 5
    # Garbage is corrupt, not a crash.
    (d / ".metadata").write_bytes(b"\x80\x04h\x07.")
    with pytest.raises(CorruptCheckpointError, match="pickle"):
        converters.from_dcp(str(d), str(tmp_path / "o"))


def test_dcp_unpickler_imports_nothing_on_a_pickles_request(tmp_path):
    d = _dcp_dir(tmp_path)
    cases = (("torch", "_inductor"), ("torch", "_dynamo"), ("torch", "onnx"), ("torch", "compile"),
             ("torch._dynamo", "config"), ("os", "system"))
    # One fresh interpreter for every case (a torch import each was most of
    # this test): each case checks what it imported itself, and a module one
    # case imported would already have failed that case.
    code = (
        "import sys, json, pickle, shardckpt.converters as c, pytest\n"
        "from shardckpt.errors import UnsafeMetadataError\n"
        "for mod, name in json.loads(sys.argv[2]):\n"
        "    open(sys.argv[1] + '/.metadata', 'wb').write(b'\\x80\\x04\\x8c' + bytes([len(mod)]) + mod.encode()"
        " + b'\\x8c' + bytes([len(name)]) + name.encode() + b'\\x93.')\n"
        "    before = set(sys.modules)\n"
        "    print('CASE', mod, name)\n"
        "    try:\n        c.from_dcp(sys.argv[1], sys.argv[1] + '-out')\n"
        "    except UnsafeMetadataError as e:\n        print('REFUSED', e)\n"
        "    new = sorted(m for m in set(sys.modules) - before if m.startswith(('torch._inductor', 'torch._dynamo', 'torch.onnx')))\n"
        "    print('NEW', new)\n"
    )
    out = subprocess.run([sys.executable, "-c", code, str(d), json.dumps(cases)], capture_output=True, text=True, timeout=120)
    parts = out.stdout.split("CASE ")[1:]
    assert len(parts) == len(cases), out.stdout + out.stderr
    for (mod, name), part in zip(cases, parts):
        assert part.startswith(f"{mod} {name}\n"), part
        assert "REFUSED" in part and f"{mod}.{name} is not allowed" in part, out.stdout + out.stderr
        assert "NEW []" in part, (mod, name, part)


def test_dcp_metadata_of_the_wrong_shape_says_what_is_wrong(tmp_path):
    from torch.distributed.checkpoint.metadata import Metadata

    d = _dcp_dir(tmp_path)
    good = pickle.loads((d / ".metadata").read_bytes())
    (d / ".metadata").write_bytes(pickle.dumps(Metadata(state_dict_metadata=[1, 2], storage_data=good.storage_data)))
    with pytest.raises(CorruptCheckpointError, match=r"Metadata\.state_dict_metadata is a list, expected a dict") as e:
        converters.from_dcp(str(d), str(tmp_path / "o"))
    assert "found Metadata" not in str(e.value)
    (d / ".metadata").write_bytes(pickle.dumps(Metadata(state_dict_metadata=good.state_dict_metadata, storage_data=None)))
    with pytest.raises(CorruptCheckpointError, match=r"Metadata\.storage_data is a NoneType"):
        converters.from_dcp(str(d), str(tmp_path / "o"))
    (d / ".metadata").write_bytes(pickle.dumps(torch.Size([1, 2])))
    with pytest.raises(CorruptCheckpointError, match="holds a Size, not DCP's Metadata"):
        converters.from_dcp(str(d), str(tmp_path / "o"))


def test_from_torch_save_on_a_directory_without_bin_files_names_the_other_converters(tmp_path):
    with pytest.raises(CheckpointNotFoundError, match="from_safetensors / from_dcp"):
        converters.from_torch_save(str(tmp_path), str(tmp_path / "out"))


# --------------------------------------------------------------------------
# One byte engine: native outputs are format v2 (block CRCs in per-rank
# index files), verify checks them, v1 sources still convert.

DATA = os.path.join(os.path.dirname(os.path.dirname(__file__)), "data")
GOLDEN_DIR = os.path.join(DATA, "v1_golden")


def _golden():
    import importlib.util

    spec = importlib.util.spec_from_file_location("make_golden", os.path.join(DATA, "make_golden.py"))
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


def _native_outputs(ckpt, tmp_path):
    """{name: output dir} of every converter that writes a native checkpoint, from one saved state."""
    import torch.distributed.checkpoint as dcp

    src, st = ckpt
    out = {}
    converters.reshard(src, str(tmp_path / "rs3"), world_size=3)
    out["reshard"] = str(tmp_path / "rs3")
    converters.to_safetensors(src, str(tmp_path / "hf"))
    converters.from_safetensors(str(tmp_path / "hf"), str(tmp_path / "from_hf"))
    out["from_safetensors"] = str(tmp_path / "from_hf")
    torch.save({"model": st["model"], "step": 4}, str(tmp_path / "m.pt"))
    converters.from_torch_save(str(tmp_path / "m.pt"), str(tmp_path / "from_pt"))
    out["from_torch_save"] = str(tmp_path / "from_pt")
    dcp.save({"model": dict(st["model"])}, checkpoint_id=str(tmp_path / "dcp"))
    converters.from_dcp(str(tmp_path / "dcp"), str(tmp_path / "from_dcp"))
    out["from_dcp"] = str(tmp_path / "from_dcp")
    return out


def test_native_outputs_are_format_v2_with_block_checksums_and_verify(ckpt, tmp_path):
    _, st = ckpt
    for conv, out in _native_outputs(ckpt, tmp_path).items():
        raw = json.loads(open(os.path.join(out, "manifest.json")).read())
        index_files = [f for f in raw["file_table"]["index_files"] if f is not None]  # format v3: the compact table
        assert raw["format_version"] == 5 and "manifest_crc32c" in raw and index_files, conv
        assert all("chunks" not in t for t in raw["tensors"].values()), conv  # chunks live in the index files
        if conv == "reshard":  # FSDP2's cut is a layout record, a few ints whatever the world size
            assert raw["tensors"]["model.emb"]["regular"]["mesh_shape"] == [3] and len(index_files) == 3
        m = shardckpt.verify(out)  # every block CRC re-read and checked
        assert m.version == 5 and m.block_bytes > 0, conv
        for name, t in m.tensors.items():
            for c in t.chunks:
                assert c.blocks is not None and len(c.blocks) == -(-c.nbytes // m.block_bytes), (conv, name)
        state = {"model": {k: torch.zeros_like(v) for k, v in st["model"].items()}}
        shardckpt.load(state, out, strict=False)
        for k, v in st["model"].items():
            _eq(state["model"][k], v)


def test_a_flipped_byte_in_a_converter_output_is_named_by_verify(ckpt, tmp_path):
    outs = _native_outputs(ckpt, tmp_path)
    for conv in ("reshard", "from_safetensors"):
        out = outs[conv]
        m = shardckpt.inspect(out)
        c = max(m.tensors["model.emb"].chunks, key=lambda c: c.nbytes)
        path = os.path.join(out, c.file)
        raw = bytearray(open(path, "rb").read())
        raw[c.byte_offset + c.nbytes // 2] ^= 0x01
        open(path, "wb").write(bytes(raw))
        with pytest.raises(ChecksumMismatchError, match=r"model\.emb.*block") as e:
            shardckpt.verify(out)
        assert c.key in str(e.value), conv
        # A load reads the same damaged block and refuses it.
        with pytest.raises(ChecksumMismatchError, match=r"model\.emb"):
            shardckpt.load({"model": {"emb": torch.zeros(37, 7)}}, out, strict=False)


def test_v1_sources_still_convert(tmp_path):
    golden = _golden()
    want = golden.golden_tensors()
    assert shardckpt.inspect(GOLDEN_DIR).version == 1
    converters.reshard(GOLDEN_DIR, str(tmp_path / "rs"), world_size=3)
    converters.to_safetensors(GOLDEN_DIR, str(tmp_path / "hf"), prefix=None)
    converters.to_full(GOLDEN_DIR, str(tmp_path / "full.pt"))
    m = shardckpt.verify(str(tmp_path / "rs"))
    assert m.version == 5 and m.world_size == 3
    state = {k: torch.zeros_like(v) for k, v in want.items()}
    shardckpt.load(state, str(tmp_path / "rs"), strict=False)
    hf = load_file(str(tmp_path / "hf" / "model.safetensors"))
    pt = torch.load(str(tmp_path / "full.pt"), weights_only=True)
    assert pt["step"] == 42
    for k, v in want.items():
        _eq(state[k], v)
        _eq(hf[k], v)
        _eq(pt[k], v)


def test_a_damaged_v1_source_converts_to_nothing(tmp_path):
    import shutil

    src = str(tmp_path / "v1")
    shutil.copytree(GOLDEN_DIR, src)
    c = shardckpt.inspect(src).tensors["sharded"].chunks[1]
    path = os.path.join(src, c.file)
    raw = bytearray(open(path, "rb").read())
    raw[c.byte_offset + 3] ^= 0x10
    open(path, "wb").write(bytes(raw))
    # v1 has one CRC per chunk: pieces are checked joined, before the commit.
    with pytest.raises(ChecksumMismatchError, match=r"chunk 'sharded@.*' of tensor 'sharded'.*crc32c"):
        converters.reshard(src, str(tmp_path / "rs"), world_size=2)
    with pytest.raises(ChecksumMismatchError, match="sharded"):
        converters.to_safetensors(src, str(tmp_path / "hf"), prefix=None)
    assert not (tmp_path / "rs" / "manifest.json").exists() and not (tmp_path / "hf").exists()
    assert not (tmp_path / "rs").exists() or not any(f.endswith(".safetensors") for _, _, fs in os.walk(tmp_path / "rs") for f in fs)


def test_a_damaged_torch_save_record_imports_nothing(tmp_path):
    w = torch.arange(4096, dtype=torch.float32)
    torch.save({"w": w}, str(tmp_path / "m.pt"))
    raw = bytearray(open(tmp_path / "m.pt", "rb").read())
    at = bytes(raw).index(w[100:104].numpy().tobytes())
    raw[at] ^= 0x01
    open(tmp_path / "m.pt", "wb").write(bytes(raw))
    with pytest.raises(ChecksumMismatchError, match=r"crc32 "):
        converters.from_torch_save(str(tmp_path / "m.pt"), str(tmp_path / "out"))
    assert not (tmp_path / "out" / "manifest.json").exists()
