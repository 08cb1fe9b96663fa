"""Format v1: golden bytes, an old checkpoint that must keep loading, safetensors/HF compatibility, every dtype."""

from __future__ import annotations

import importlib.util
import json
import math
import os

import pytest
import torch
from safetensors import safe_open
from safetensors.torch import load_file

import shardckpt
from shardckpt._format import DTYPES, HF_INDEX_NAME, manifest_from_bytes, manifest_to_bytes

DATA = os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "data")
GOLDEN_DIR = os.path.join(DATA, "v1_golden")


def _golden_module():
    spec = importlib.util.spec_from_file_location("make_golden", os.path.join(DATA, "make_golden.py"))
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


golden = _golden_module()


def _bits(t: torch.Tensor) -> torch.Tensor:
    """Raw bytes of a tensor, so NaN payloads and -0.0 compare exactly."""
    t = t.detach().contiguous().reshape(-1)
    if t.dtype.is_complex:
        t = t.view(torch.float32)
    return t.view(torch.uint8)


def _bit_equal(a: torch.Tensor, b: torch.Tensor) -> bool:
    return a.dtype == b.dtype and a.shape == b.shape and torch.equal(_bits(a), _bits(b))


# --------------------------------------------------------------------------
# golden manifest bytes


def test_manifest_bytes_are_golden():
    with open(os.path.join(DATA, "manifest_golden.json"), "rb") as f:
        want = f.read()
    got = manifest_to_bytes(golden.golden_manifest())
    assert got == want, "manifest serialization changed: that is a format change (bump FORMAT_VERSION)"
    # Parsing and re-serializing is the identity.
    assert manifest_to_bytes(manifest_from_bytes(want)) == want
    raw = json.loads(want)
    assert raw["format"] == "shardckpt" and raw["format_version"] == 1 and raw["checksum"] == "crc32c"
    assert [c["offsets"] for c in raw["tensors"]["w"]["chunks"]] == [[0, 0], [2, 0]]


def test_manifest_rejects_nan_values():
    m = golden.golden_manifest()
    m.values = {"x": float("nan")}
    with pytest.raises(ValueError):
        manifest_to_bytes(m)


# --------------------------------------------------------------------------
# the committed v1 checkpoint


def _golden_template():
    state = {k: torch.zeros_like(v) for k, v in golden.golden_tensors().items()}
    state.update({"step": 0, "meta": {"name": "", "lr": 0.0, "nan": 0.0, "inf": 0.0, "pair": (0, 0), "none": 1}, "items": [0, "", False]})
    return state


def test_v1_golden_checkpoint_loads():
    state = _golden_template()
    res = shardckpt.load(state, GOLDEN_DIR)
    assert res.missing_keys == [] and res.unexpected_keys == []
    for k, want in golden.golden_tensors().items():
        assert _bit_equal(state[k], want), k
    want_v = golden.golden_values()
    assert state["step"] == 42 and state["items"] == want_v["items"]
    meta = state["meta"]
    assert math.isnan(meta["nan"]) and meta["inf"] == -math.inf
    assert meta["pair"] == (1, 2) and meta["none"] is None and meta["lr"] == 1e-3 and meta["name"] == "golden"


def test_v1_golden_inspect_and_verify():
    m = shardckpt.inspect(GOLDEN_DIR)
    assert m.world_size == 2 and m.version == 1
    assert len(m.tensors["sharded"].chunks) == 2
    assert m.tensors["sharded"].layout["placements"] == ["S(0)"]
    assert m.tensors["scalar"].shape == [] and m.tensors["empty"].shape == [0, 4]
    assert m.total_bytes == sum(t.numel() * t.element_size() for t in golden.golden_tensors().values())
    assert shardckpt.verify(GOLDEN_DIR).save_id == m.save_id


def test_v1_golden_data_files_are_plain_safetensors():
    m = shardckpt.inspect(GOLDEN_DIR)
    full = golden.golden_tensors()
    by_file = {}
    for name, t in m.tensors.items():
        for c in t.chunks:
            by_file.setdefault(c.file, []).append((name, c))
    assert set(by_file) == set(m.files)
    for rel, entries in by_file.items():
        path = os.path.join(GOLDEN_DIR, rel)
        loaded = load_file(path)
        with safe_open(path, framework="pt") as f:
            md = f.metadata()
        assert md["format"] == "pt" and md["shardckpt_format_version"] == "1"
        described = json.loads(md["shardckpt"])
        assert set(loaded) == set(described) == {c.key for _, c in entries}
        for name, c in entries:
            assert described[c.key] == {"tensor": name, "offsets": c.offsets}
            region = full[name][tuple(slice(o, o + n) for o, n in zip(c.offsets, c.sizes))]
            assert _bit_equal(loaded[c.key], region), c.key
            assert c.byte_offset % full[name].element_size() == 0  # aligned: zero-copy views


# --------------------------------------------------------------------------
# Hugging Face layout


def test_whole_tensor_checkpoint_is_a_hf_directory(tmp_path):
    torch.manual_seed(0)
    state = {
        "model": torch.nn.Sequential(torch.nn.Linear(5, 3), torch.nn.LayerNorm(3)),
        "extra.scale": torch.tensor(2.0),
        "step": 3,
    }
    shardckpt.save(state, str(tmp_path))
    with open(tmp_path / HF_INDEX_NAME) as f:
        index = json.load(f)
    sd = {f"model.{k}": v for k, v in state["model"].state_dict().items()}
    sd["extra.scale"] = state["extra.scale"]
    assert set(index["weight_map"]) == set(sd)
    assert index["metadata"]["total_size"] == sum(v.numel() * v.element_size() for v in sd.values())
    got = {}
    for rel in set(index["weight_map"].values()):
        got.update(load_file(str(tmp_path / rel)))
    assert set(got) == set(sd)
    for k, v in sd.items():
        assert _bit_equal(got[k], v.detach()), k


def test_sharded_checkpoint_has_no_hf_index():
    assert not os.path.exists(os.path.join(GOLDEN_DIR, HF_INDEX_NAME))


# --------------------------------------------------------------------------
# every dtype, bit-exact

_SPECIAL_F32 = [0x80000000, 0x7FC00001, 0xFFC12345, 0x7F800001, 0x7F800000, 0xFF800000, 0x00000001]
_SPECIAL_F16 = [0x8000, 0x7E01, 0xFD55, 0x7C01, 0x7C00, 0x0001]


def _sample(dt: torch.dtype, shape, seed: int) -> torch.Tensor:
    """Arbitrary bit patterns (NaN payloads, -0.0, subnormals, extremes) of ``dt``."""
    g = torch.Generator().manual_seed(seed)
    n = math.prod(shape)
    if dt == torch.bool:
        return torch.randint(0, 2, (n,), generator=g).bool().reshape(shape)
    size = torch.empty((), dtype=dt).element_size()
    raw = torch.randint(0, 256, (n * size,), dtype=torch.uint8, generator=g)
    t = raw.view(dt) if dt not in (torch.complex64,) else raw.view(torch.float32).view(dt)
    t = t.clone()
    flat = t.view(-1)
    special = {torch.float32: (_SPECIAL_F32, torch.int32), torch.float16: (_SPECIAL_F16, torch.int16)}
    if dt in special and n:
        vals, it = special[dt]
        bits = torch.tensor([v - (1 << (size * 8)) if v >= 1 << (size * 8 - 1) else v for v in vals], dtype=it)
        k = min(len(vals), n)
        flat[:k] = bits[:k].view(dt)
    if dt == torch.bfloat16 and n >= 3:
        flat[:3] = torch.tensor([0x8000 - 65536, 0x7FC1, 0xFF81 - 65536], dtype=torch.int16).view(dt)
    return t.reshape(shape)


ALL_DTYPES = sorted(name for name, (attr, _) in DTYPES.items() if hasattr(torch, attr))


def test_dtype_table_matches_torch():
    for name in ALL_DTYPES:
        attr, size = DTYPES[name]
        assert torch.empty((), dtype=getattr(torch, attr)).element_size() == size, name
    assert {"BOOL", "BF16", "F16", "F32", "F64", "I64", "F8_E4M3", "F8_E5M2"} <= set(ALL_DTYPES)


def test_every_dtype_round_trips_bit_exactly(tmp_path):
    saved = {}
    for i, name in enumerate(ALL_DTYPES):
        dt = getattr(torch, DTYPES[name][0])
        saved[f"{name}.mat"] = _sample(dt, (7, 3), seed=i)
        saved[f"{name}.scalar"] = _sample(dt, (), seed=100 + i)
        saved[f"{name}.empty"] = _sample(dt, (0, 5), seed=0)
    # the specials really are there
    f32 = saved["F32.mat"].reshape(-1)
    assert torch.isnan(f32).any() and (torch.signbit(f32) & (f32 == 0)).any()
    path = str(tmp_path / "ck")
    shardckpt.save(dict(saved), path)
    state = {k: torch.empty_like(v).zero_() if v.dtype != torch.bool else torch.zeros_like(v) for k, v in saved.items()}
    ptrs = {k: v.data_ptr() for k, v in state.items()}
    shardckpt.load(state, path)
    bad = [k for k in saved if not _bit_equal(state[k], saved[k])]
    assert not bad, f"not bit-exact: {bad}"
    assert all(state[k].data_ptr() == ptrs[k] for k in state)  # filled in place
    m = shardckpt.inspect(path)
    assert {m.tensors[f"{n}.mat"].dtype for n in ALL_DTYPES} == set(ALL_DTYPES)
    # A third-party reader sees the same bits.
    with open(os.path.join(path, HF_INDEX_NAME)) as f:
        index = json.load(f)
    other = {}
    for rel in set(index["weight_map"].values()):
        other.update(load_file(os.path.join(path, rel)))
    bad = [k for k in saved if not _bit_equal(other[k], saved[k])]
    assert not bad, f"safetensors reads different bits for {bad}"
    shardckpt.verify(path)
