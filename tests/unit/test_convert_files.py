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
