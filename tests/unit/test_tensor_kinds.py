"""Every tensor kind a training state holds (issue 19 item 1): one safe path for tensor bytes.

Wrapper subclasses (TwoTensor, torchao NF4 and low-bit optimizer states) go
through their flattening protocol and come back bit-exact; lazy conj/neg
views are stored as the values they show, by every writer alike; anything
else without bytes is refused before a byte is written; no code reads a
tensor's memory through a raw pointer.
"""

from __future__ import annotations

import pathlib
import re
import warnings

import pytest
import torch
from torch.testing._internal.two_tensor import TwoTensor

import shardckpt
from shardckpt import _knobs
from shardckpt.errors import StateMismatchError, UnsupportedStateError

PKG = pathlib.Path(shardckpt.__file__).parent
CONVERTERS = PKG.parent / "converters"


def _files(d):
    return sorted(p.name for p in pathlib.Path(d).rglob("*") if p.is_file())


# --------------------------------------------------------------------------
# no raw pointer reads


def test_no_pointer_reads_in_source():
    """No ctypes, no ``from_address``; ``data_ptr()`` only for alignment, pinning and offsets, never to read bytes."""
    # Addresses compared or subtracted (alignment, a staging arena's offsets,
    # storage identity) or handed to cudaHostRegister; never dereferenced.
    allowed = re.compile(
        r"cudaHost(Register|Unregister)\(|data_ptr\(\) % |data_ptr\(\) - arena|untyped_storage\(\)\.data_ptr\(\)"
        r"|return self\.tensor\.data_ptr\(\)|``data_ptr\(\)``"
    )
    # One use of ctypes that reads no memory: _fp8 asks the OpenMP runtime
    # already in the process for its per-thread thread count (two int functions).
    omp_only = re.compile(
        r'\s*(import ctypes|lib = ctypes\.CDLL\(path, mode=getattr\(os, "RTLD_NOLOAD", 0\)\)'
        r"|get\.argtypes, get\.restype = \[\], ctypes\.c_int|put\.argtypes, put\.restype = \[ctypes\.c_int\], None)\s*$"
    )
    bad = []
    for p in sorted(list(PKG.rglob("*.py")) + list(CONVERTERS.rglob("*.py"))):
        for i, line in enumerate(p.read_text().splitlines(), 1):
            code = line.split("#", 1)[0]
            if p.name == "_fp8.py" and omp_only.fullmatch(code):
                continue
            if re.search(r"\bctypes\b|from_address|string_at", code):
                bad.append(f"{p.name}:{i}: {line.strip()}")
            elif "data_ptr()" in code and not allowed.search(code):
                bad.append(f"{p.name}:{i}: {line.strip()}")
    assert not bad, bad


class _NoStorage(torch.Tensor):
    """A wrapper subclass with no storage and no flattening protocol: data_ptr() is 0."""

    @staticmethod
    def __new__(cls, shape):
        return torch.Tensor._make_wrapper_subclass(cls, shape, dtype=torch.float32)

    @classmethod
    def __torch_dispatch__(cls, func, types, args=(), kwargs=None):
        raise NotImplementedError(f"{func} on _NoStorage")


def test_storageless_subclass_refused_before_any_byte(tmp_path):
    """Where the old fallback read memory at address 0 (SIGSEGV), the save refuses and writes nothing."""
    t = _NoStorage((4,))
    with pytest.raises(UnsupportedStateError, match=r"x\.t: a .*_NoStorage cannot be saved"):
        shardckpt.save({"x": {"t": t}, "y": torch.ones(2)}, str(tmp_path / "ck"))
    assert _files(tmp_path) == []


# --------------------------------------------------------------------------
# conj / neg views


@pytest.mark.parametrize("writer", ["sync", "thread", "process"])
def test_conj_neg_views_saved_as_shown(tmp_path, monkeypatch, writer):
    x = torch.tensor([1 + 4j, 2 + 5j, -3 - 1j])
    state = {"conj": x.conj(), "neg": x.conj().imag, "rot": torch.polar(torch.ones(3, 2), torch.ones(3, 2)).conj()}
    assert state["conj"].is_conj() and state["neg"].is_neg()
    want = {k: v.resolve_conj().resolve_neg().clone() for k, v in state.items()}
    if writer == "sync":
        shardckpt.save(state, str(tmp_path / "ck"))
    else:
        monkeypatch.setattr(_knobs, "ASYNC_WRITER", writer)
        try:
            shardckpt.async_save(state, str(tmp_path / "ck")).result()
        finally:
            shardckpt.release_buffers()
    shardckpt.verify(str(tmp_path / "ck"))
    back = {k: torch.zeros_like(v) for k, v in want.items()}
    shardckpt.load(back, str(tmp_path / "ck"))
    for k in want:
        assert torch.equal(back[k], want[k]), k
    from safetensors.torch import load_file

    files = list((tmp_path / "ck").rglob("*.safetensors"))
    raw = {k: v for f in files for k, v in load_file(f).items()}
    assert torch.equal(raw["conj"], want["conj"])


# --------------------------------------------------------------------------
# TwoTensor


@pytest.mark.parametrize("writer", ["sync", "thread", "process"])
def test_two_tensor_round_trip_in_place(tmp_path, monkeypatch, writer):
    t = TwoTensor(torch.randn(3, 4), torch.randn(3, 4))
    state = {"t": t, "plain": torch.arange(3.0)}
    if writer == "sync":
        shardckpt.save(state, str(tmp_path / "ck"))
    else:
        monkeypatch.setattr(_knobs, "ASYNC_WRITER", writer)
        try:
            shardckpt.async_save(state, str(tmp_path / "ck")).result()
        finally:
            shardckpt.release_buffers()
    shardckpt.verify(str(tmp_path / "ck"))
    m = shardckpt.inspect(str(tmp_path / "ck"))
    assert sorted(m.tensors) == ["plain", "t.a", "t.b"]
    live = TwoTensor(torch.zeros(3, 4), torch.zeros(3, 4))
    a, b = live.a, live.b
    back = {"t": live, "plain": torch.zeros(3)}
    shardckpt.load(back, str(tmp_path / "ck"))
    assert back["t"] is live and live.a is a and live.b is b  # filled in place
    assert torch.equal(live.a, t.a) and torch.equal(live.b, t.b)


def test_two_tensor_into_plain_tensor_refused(tmp_path):
    shardckpt.save({"t": TwoTensor(torch.ones(2), torch.zeros(2))}, str(tmp_path / "ck"))
    with pytest.raises(StateMismatchError, match="subclass"):
        shardckpt.load({"t": torch.zeros(2)}, str(tmp_path / "ck"))


def test_two_tensor_created_where_live_has_none(tmp_path):
    shardckpt.save({"d": {"t": TwoTensor(torch.ones(2), torch.arange(2.0))}}, str(tmp_path / "ck"))
    back = {"d": {"t": None}}  # a placeholder is filled with what was saved there
    shardckpt.load(back, str(tmp_path / "ck"))
    assert type(back["d"]["t"]) is TwoTensor and torch.equal(back["d"]["t"].b, torch.arange(2.0))


# --------------------------------------------------------------------------
# torchao: NF4 base weights, low-bit optimizer states


def _torchao():
    warnings.simplefilter("ignore")
    return pytest.importorskip("torchao", reason="torchao is in the test extra")


def _nf4(w):
    _torchao()
    from torchao.quantization.quantize_.workflows.nf4.nf4_tensor import to_nf4

    return to_nf4(w)


class _QLoRA(torch.nn.Module):
    """A frozen NF4 base weight plus a trainable LoRA pair, as QLoRA recipes build them."""

    def __init__(self, seed: int):
        super().__init__()
        g = torch.Generator().manual_seed(seed)
        self.base = torch.nn.Parameter(_nf4(torch.randn(128, 128, generator=g)), requires_grad=False)
        self.lora_a = torch.nn.Linear(128, 4, bias=False)
        self.lora_b = torch.nn.Linear(4, 128, bias=False)

    def forward(self, x):
        return torch.nn.functional.linear(x, self.base.get_original_weight()) + self.lora_b(self.lora_a(x))


def _inner_equal(x, y):
    names, _ = x.__tensor_flatten__()
    return type(x) is type(y) and all(torch.equal(getattr(x, n), getattr(y, n)) for n in names)


def test_nf4_qlora_round_trip_bit_exact(tmp_path):
    torch.manual_seed(0)
    m = _QLoRA(0)
    opt = torch.optim.AdamW([p for p in m.parameters() if p.requires_grad])
    m(torch.randn(2, 128)).sum().backward()
    opt.step()
    opt.zero_grad()
    shardckpt.save({"model": m, "optim": opt}, str(tmp_path / "ck"))
    shardckpt.verify(str(tmp_path / "ck"))
    m2 = _QLoRA(1)
    base = m2.base
    opt2 = torch.optim.AdamW([p for p in m2.parameters() if p.requires_grad])
    shardckpt.load({"model": m2, "optim": opt2}, str(tmp_path / "ck"))
    assert m2.base is base and _inner_equal(m.base, m2.base)
    assert torch.equal(m.base.get_original_weight(), m2.base.get_original_weight())
    x = torch.randn(2, 128)
    for mm, oo in ((m, opt), (m2, opt2)):
        mm(x).sum().backward()
        oo.step()
    assert torch.equal(m.lora_a.weight, m2.lora_a.weight)


def test_nf4_other_block_size_refused(tmp_path):
    _torchao()
    from torchao.quantization.quantize_.workflows.nf4.nf4_tensor import to_nf4

    shardckpt.save({"w": to_nf4(torch.randn(128, 128), block_size=64)}, str(tmp_path / "ck"))
    with pytest.raises(StateMismatchError, match="context"):
        shardckpt.load({"w": to_nf4(torch.randn(128, 128), block_size=32)}, str(tmp_path / "ck"))


@pytest.mark.parametrize("name", ["AdamW8bit", "AdamWFp8", "AdamW4bit"])
def test_torchao_lowbit_optimizer_states_exact(tmp_path, name):
    _torchao()
    import torchao.optim

    cls = getattr(torchao.optim, name)
    torch.manual_seed(0)
    lin = torch.nn.Linear(256, 256)
    opt = cls(lin.parameters())
    for _ in range(2):
        lin(torch.randn(2, 256)).sum().backward()
        opt.step()
        opt.zero_grad()
    shardckpt.save({"model": lin, "optim": opt}, str(tmp_path / "ck"))
    shardckpt.verify(str(tmp_path / "ck"))
    # Into a stepped optimizer (filled in place) and into a fresh one (rebuilt).
    stepped = torch.nn.Linear(256, 256)
    o_stepped = cls(stepped.parameters())
    stepped(torch.randn(2, 256)).sum().backward()
    o_stepped.step()
    o_stepped.zero_grad()
    held = {k: v for k, v in next(iter(o_stepped.state.values())).items()}
    fresh = torch.nn.Linear(256, 256)
    o_fresh = cls(fresh.parameters())
    shardckpt.load({"model": stepped, "optim": o_stepped}, str(tmp_path / "ck"))
    shardckpt.load({"model": fresh, "optim": o_fresh}, str(tmp_path / "ck"))
    assert next(iter(o_stepped.state.values()))["exp_avg"] is held["exp_avg"]
    for o2 in (o_stepped, o_fresh):
        for s1, s2 in zip(opt.state.values(), o2.state.values()):
            for k, v in s1.items():
                w = s2[k]
                assert _inner_equal(v, w) if type(v) is not torch.Tensor else torch.equal(v, w), k
    x = torch.randn(2, 256)
    for mm, oo in ((lin, opt), (stepped, o_stepped), (fresh, o_fresh)):
        mm(x).sum().backward()
        oo.step()
    assert torch.equal(lin.weight, stepped.weight) and torch.equal(lin.weight, fresh.weight)


# --------------------------------------------------------------------------
# names and values refused up front (issue 19 item 4)


def _deep(n):
    v = 1
    for _ in range(n):
        v = [v]
    return v


@pytest.mark.parametrize(
    "state, match",
    [
        ({"\ud800": torch.ones(2)}, "surrogate"),
        ({"w": torch.ones(2, 2), "w@0,0": torch.ones(1)}, "chunk keys"),
        ({"w": torch.ones(2, 2), "w@": torch.ones(1)}, "chunk keys"),
        ({"x": _deep(250), "t": torch.ones(2)}, "MAX_VALUE_DEPTH"),
        ({"x": _deep(5000), "t": torch.ones(2)}, "recursion limit"),
    ],
    ids=["surrogate", "chunk-key", "chunk-key-0d", "deep", "deeper"],
)
def test_names_and_values_refused_before_any_byte(tmp_path, state, match):
    with pytest.raises(UnsupportedStateError, match=match):
        shardckpt.save(state, str(tmp_path / "ck"))
    assert _files(tmp_path) == []


def test_names_with_at_that_are_no_chunk_key_are_fine(tmp_path):
    state = {"w": torch.ones(2, 2), "w@x": torch.zeros(1), "v@0": torch.ones(3)}
    shardckpt.save(state, str(tmp_path / "ck"))
    back = {k: torch.empty_like(v) for k, v in state.items()}
    shardckpt.load(back, str(tmp_path / "ck"))
    assert all(torch.equal(back[k], state[k]) for k in state)


def test_reshard_refuses_an_old_checkpoint_with_clashing_names(tmp_path, monkeypatch):
    from shardckpt import converters
    from shardckpt._state import walk

    monkeypatch.setattr(walk, "_refuse_names", lambda flat: None)  # as saves did before issue 19
    shardckpt.save({"w": torch.ones(4, 4), "w@2,0": torch.ones(2)}, str(tmp_path / "old"))
    monkeypatch.undo()
    with pytest.raises(UnsupportedStateError, match="w@2,0"):
        converters.reshard(str(tmp_path / "old"), str(tmp_path / "new"), world_size=2)
    assert not (tmp_path / "new" / "manifest.json").exists()


# --------------------------------------------------------------------------
# DCP beside


def test_nf4_same_as_dcp(tmp_path):
    """DCP saves NF4 exactly; shardckpt gives back the same inner tensors."""
    import torch.distributed.checkpoint as dcp

    m = _QLoRA(0)
    dcp.save({"model": m.state_dict()}, checkpoint_id=str(tmp_path / "dcp"))
    shardckpt.save({"model": m}, str(tmp_path / "ck"))
    via_dcp, via_ours = _QLoRA(1), _QLoRA(1)
    sd = {"model": via_dcp.state_dict()}
    dcp.load(sd, checkpoint_id=str(tmp_path / "dcp"))
    via_dcp.load_state_dict(sd["model"])
    shardckpt.load({"model": via_ours}, str(tmp_path / "ck"))
    assert _inner_equal(via_dcp.base, m.base) and _inner_equal(via_ours.base, m.base)
    assert _inner_equal(via_dcp.base, via_ours.base)


def test_value_depth_refused_up_front_exactly_where_the_commit_would(tmp_path):
    """The save-time bound is the commit's: one level less saves, the limit itself is refused up front."""
    shardckpt.save({"x": _deep(199)}, str(tmp_path / "ok"))
    with pytest.raises(UnsupportedStateError, match="MAX_VALUE_DEPTH"):
        shardckpt.save({"x": _deep(200)}, str(tmp_path / "deep"))
    assert not (tmp_path / "deep").exists()
