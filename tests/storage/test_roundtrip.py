"""Each backend end to end through the public API, as a user would call it:
save -> load -> verify, overwrite, export to safetensors and ``.pt`` (the
converters' writes go through the storage layer) and a manager's retention.

``local://`` is fsspec's own local filesystem: an fsspec backend with real
directories, which must get its ``data/`` directory created for it.
"""

from __future__ import annotations

import io
import uuid

import pytest
import torch
from safetensors.torch import load as load_safetensors

import shardckpt
from shardckpt import converters
from shardckpt._manager import step_dir_name
from shardckpt._storage import Storage
from shardckpt.errors import ChecksumMismatchError

BACKENDS = ["path", "file-options", "fsspec-dirs", "memory", pytest.param("s3", marks=pytest.mark.s3)]


@pytest.fixture(params=BACKENDS)
def where(request, tmp_path):
    """``(make_url(name), storage_options)`` for one backend."""
    kind = request.param
    if kind == "path":
        yield (lambda name: str(tmp_path / name)), None
    elif kind == "file-options":
        yield (lambda name: f"file://{tmp_path}/{name}"), {"auto_mkdir": True}
    elif kind == "fsspec-dirs":
        yield (lambda name: f"local://{tmp_path}/{name}"), None
    elif kind == "memory":
        base = f"memory://shardckpt-roundtrip/{uuid.uuid4().hex}"
        yield (lambda name: f"{base}/{name}"), None
        Storage(base).remove_tree()
    else:
        prefix, options = request.getfixturevalue("s3_endpoint")
        base = f"{prefix}/roundtrip-{uuid.uuid4().hex[:12]}"
        yield (lambda name: f"{base}/{name}"), options
        Storage(base, storage_options=options).remove_tree()


def _state(seed):
    g = torch.Generator().manual_seed(seed)
    return {
        "model": {"w": torch.randn(33, 17, generator=g), "b": torch.randn(17, generator=g).to(torch.bfloat16)},
        "ids": torch.arange(50) * seed,
        "step": seed,
    }


def _same(a, b):
    return (
        all(torch.equal(a["model"][k], b["model"][k]) for k in a["model"])
        and torch.equal(a["ids"], b["ids"])
        and a["step"] == b["step"]
    )


def test_save_load_verify_overwrite(where):
    url_for, opts = where
    url = url_for("ck")
    shardckpt.save(_state(1), url, storage_options=opts)
    live = _state(2)
    shardckpt.load(live, url, storage_options=opts)
    assert _same(live, _state(1))
    m = shardckpt.verify(url, storage_options=opts)
    st = Storage(url, storage_options=opts)
    assert set(st.walk_files("data")) == set(m.files)
    shardckpt.save(_state(3), url, storage_options=opts, overwrite=True)
    shardckpt.load(live, url, storage_options=opts)
    assert _same(live, _state(3))
    m3 = shardckpt.verify(url, storage_options=opts)
    assert set(st.walk_files("data")) == set(m3.files), "stale data files of the replaced checkpoint remain"
    # damage one byte through the storage layer: load and verify both notice
    rel = sorted(m3.files)[0]
    raw = bytearray(st.read_bytes(rel))
    raw[-1] ^= 0x01
    st.write_atomic(rel, bytes(raw))
    with pytest.raises(ChecksumMismatchError):
        shardckpt.verify(url, storage_options=opts)


def test_exports(where):
    url_for, opts = where
    src = url_for("ck")
    state = _state(4)
    shardckpt.save(state, src, storage_options=opts)
    # a directory of safetensors files, written twice (the second replaces the first)
    hf = url_for("hf")
    converters.to_safetensors(src, hf, prefix=None, storage_options=opts, dst_storage_options=opts, max_shard_size=2000)
    converters.to_safetensors(src, hf, prefix=None, storage_options=opts, dst_storage_options=opts, overwrite=True)
    names = Storage(hf, storage_options=opts).listdir()
    assert names == ["model.safetensors"], names
    back = load_safetensors(Storage(hf, storage_options=opts).read_bytes("model.safetensors"))
    assert sorted(back) == ["ids", "model.b", "model.w"], sorted(back)
    assert torch.equal(back["model.w"], state["model"]["w"]) and torch.equal(back["model.b"], state["model"]["b"])
    # one torch.save file, built at a local path and published whole
    pt = url_for("full.pt")
    converters.to_full(src, pt, storage_options=opts, dst_storage_options=opts)
    base = Storage(url_for(""), storage_options=opts)
    got = torch.load(io.BytesIO(base.read_bytes("full.pt")), weights_only=True)
    assert torch.equal(got["model"]["w"], state["model"]["w"]) and torch.equal(got["ids"], state["ids"])
    assert base.listdir() == ["ck", "full.pt", "hf"], "staging leftovers"


def test_manager_retention(where):
    url_for, opts = where
    root = url_for("run")
    mgr = shardckpt.CheckpointManager(root, keep_last=2, storage_options=opts)
    for step in (1, 2, 3):
        mgr.save(step, _state(step))
    mgr.wait()
    assert mgr.steps() == [2, 3]
    assert Storage(root, storage_options=opts).listdir() == [step_dir_name(2), step_dir_name(3)]
    live = _state(0)
    assert mgr.restore(live) == 3 and _same(live, _state(3))
    mgr.close()
