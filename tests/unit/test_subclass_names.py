"""Names in a checkpoint resolve only against what is already loaded (issue 29 item 2, subclass half).

Hostile checkpoints: a subclass node whose ``type`` names a module that a
lazy ``__getattr__`` would import (``torch.onnx``, ``torch._dynamo``,
``shardckpt.converters``), and a subclass context naming a foreign,
already-imported dataclass whose ``__post_init__`` has a side effect. Each is
loaded into ``{"x": None}`` in a fresh interpreter: ``sys.modules`` is
unchanged, our error is raised, no foreign constructor ran.
"""

from __future__ import annotations

import json
import subprocess
import sys
import textwrap

import pytest
import torch
from torch.testing._internal.two_tensor import TwoTensor

import shardckpt
from shardckpt._format.values import TAG
from shardckpt._state import walk

EVIL_MODULE = textwrap.dedent(
    """
    import dataclasses, os

    @dataclasses.dataclass
    class Evil:
        marker: str = ""

        def __post_init__(self):
            open(self.marker, "w").close()  # the side effect a load must never cause
    """
)

LOADER = textwrap.dedent(
    """
    import json, sys
    sys.path.insert(0, sys.argv[1])
    import torch
    import evilmod  # the foreign dataclass is already imported
    if sys.argv[4] == "1":  # the subclass type the hostile node names must resolve (it imports torch._dynamo)
        from torch.testing._internal.two_tensor import TwoTensor
    import shardckpt
    # One benign load first: what a load imports by itself is not the checkpoint's doing.
    shardckpt.load({"x": None}, sys.argv[2])
    before = set(sys.modules)
    out = {}
    try:
        shardckpt.load({"x": None}, sys.argv[3])
        out["error"] = None
    except Exception as e:
        out["error"] = type(e).__module__ + "." + type(e).__name__
        out["message"] = str(e)
    out["new_modules"] = sorted(set(sys.modules) - before)
    out["lazy_loaded"] = [m for m in ("torch.onnx", "torch._dynamo", "shardckpt.converters") if m in sys.modules]
    print(json.dumps(out))
    """
)


def _save_with(tmp_path, name, edit, monkeypatch):
    """A checkpoint of a TwoTensor under ``x`` whose subclass node ``edit`` rewrote."""
    real = walk.flatten_subclass

    def hostile(t, path):
        inner, node = real(t, path)
        edit(node)
        return inner, node

    with monkeypatch.context() as m:
        m.setattr(walk, "flatten_subclass", hostile)
        shardckpt.save({"x": TwoTensor(torch.ones(4), torch.zeros(4))}, str(tmp_path / name))
    return str(tmp_path / name)


def _load_fresh(tmp_path, benign, hostile, two_tensor=False):
    (tmp_path / "evilmod.py").write_text(EVIL_MODULE)
    r = subprocess.run(
        [sys.executable, "-c", LOADER, str(tmp_path), benign, hostile, "1" if two_tensor else "0"], capture_output=True, text=True, timeout=300
    )
    assert r.returncode == 0, r.stderr[-3000:]
    return json.loads(r.stdout.strip().splitlines()[-1])


@pytest.fixture
def benign(tmp_path):
    path = str(tmp_path / "benign")
    shardckpt.save({"x": torch.ones(4)}, path)
    return path


@pytest.mark.parametrize("type_name", ["torch.onnx.Evil", "torch._dynamo.Evil", "shardckpt.converters.Evil"])
def test_a_subclass_type_in_a_lazy_package_imports_nothing(tmp_path, benign, monkeypatch, type_name):
    hostile = _save_with(tmp_path, "hostile", lambda node: node.update(type=type_name), monkeypatch)
    out = _load_fresh(tmp_path, benign, hostile)
    assert out["new_modules"] == [] and out["lazy_loaded"] == []
    assert out["error"] == "shardckpt.errors.StateMismatchError"
    assert type_name in out["message"] and "x" in out["message"]


def test_a_context_naming_a_foreign_dataclass_constructs_nothing(tmp_path, benign, monkeypatch):
    marker = tmp_path / "post_init_ran"
    ctx = {TAG: "dataclass", "type": "evilmod.Evil", "fields": {"marker": str(marker)}}
    hostile = _save_with(tmp_path, "hostile", lambda node: node.update(ctx=ctx), monkeypatch)
    out = _load_fresh(tmp_path, benign, hostile, two_tensor=True)
    assert not marker.exists()
    assert out["new_modules"] == []
    assert out["error"] == "shardckpt.errors.StateMismatchError"
    assert "evilmod.Evil" in out["message"] and "does not produce" in out["message"]


def test_static_lookup_finds_only_loaded_attributes():
    from shardckpt._state.subclass import _imported

    assert _imported("torch.testing._internal.two_tensor.TwoTensor") is TwoTensor
    assert _imported("torch.nn.Module") is torch.nn.Module  # a module's real attribute, a class
    assert _imported("torch.nn") is None  # a module, not a type
    assert _imported("shardckpt.converters.reshard") is None or "shardckpt.converters" in sys.modules
