"""Loads through ``key_map=`` / ``keys=`` / tied-weight aliases keep format v2's block checksums.

The renamed manifest a keyed load builds must keep every v2 field (block
size, meshes, index files): without them the reader falls back to whole
chunk checksums — it reads a whole chunk into one buffer of its size (past
``buffer_bytes``) and a damaged block is no longer named.
"""

from __future__ import annotations

import pytest
import torch

import shardckpt
from shardckpt import _knobs, _load
from shardckpt._format import open_manifest
from shardckpt._hf import select_for_load, with_aliases
from shardckpt._storage import Storage
from shardckpt.errors import ChecksumMismatchError

BLOCK = 4096
ROWS, COLS = 256, 64  # 64 KiB of fp32: 16 blocks of 4 KiB


@pytest.fixture()
def saved(tmp_path, monkeypatch):
    monkeypatch.setattr(_knobs, "BLOCK_BYTES", BLOCK)
    torch.manual_seed(0)
    lin = torch.nn.Linear(COLS, ROWS)
    state = {"model": {"w": lin.weight.detach().clone(), "b": lin.bias.detach().clone()}, "step": 7}
    path = str(tmp_path / "ckpt")
    shardckpt.save(state, path, no_dist=True)
    m = open_manifest(Storage(path), chunks=False)
    assert m.version >= 2 and m.block_bytes == BLOCK
    return path, state


def _pools(monkeypatch):
    pools = []
    real = _load.stream.BufferPool

    def pool(capacity, **kw):
        pools.append(real(capacity, **kw))
        return pools[-1]

    monkeypatch.setattr(_load.stream, "BufferPool", pool)
    return pools


def test_select_for_load_keeps_the_v2_fields(saved):
    path, _ = saved
    st = Storage(path)
    m = with_aliases(open_manifest(st, chunks=False))
    from shardckpt._format._v2 import materialize

    materialize(m, st)
    live = {"net": {"weight": torch.zeros(ROWS, COLS)}}
    got = select_for_load(m, live, keys=["model.w"], key_map={"model.w": "net.weight"})
    assert list(got.tensors) == ["net.weight"]
    for field in ("version", "block_bytes", "meshes", "indexes", "files", "save_id", "world_size", "library_version"):
        assert getattr(got, field) == getattr(m, field), field


@pytest.mark.parametrize("how", ["key_map", "keys", "callable"])
def test_keyed_load_reads_blocks_within_the_buffer_bound(saved, monkeypatch, how):
    path, state = saved
    pools = _pools(monkeypatch)
    if how == "key_map":
        live = {"net": {"weight": torch.zeros(ROWS, COLS), "bias": torch.zeros(ROWS)}}
        kw = {"key_map": {"model.w": "net.weight", "model.b": "net.bias"}, "strict": False}
        out = live["net"]
    elif how == "keys":
        live = {"model": {"w": torch.zeros(ROWS, COLS)}}
        kw = {"keys": ["model.w"], "strict": False}
        out = {"weight": live["model"]["w"]}
    else:
        live = {"net": {"weight": torch.zeros(ROWS, COLS)}}
        kw = {"key_map": lambda n: "net.weight" if n == "model.w" else None, "strict": False}
        out = live["net"]
    # 16 KiB of buffers for a 64 KiB chunk: fine with block checksums.
    shardckpt.load(live, path, no_dist=True, buffer_bytes=16 << 10, io_threads=1, **kw)
    assert torch.equal(out["weight"], state["model"]["w"])
    if "bias" in out:
        assert torch.equal(out["bias"], state["model"]["b"])
    (pool,) = pools
    assert pool.peak_bytes <= 16 << 10, f"a keyed load held {pool.peak_bytes} bytes of buffers (whole-chunk reads)"


def test_keyed_load_names_the_damaged_block(saved):
    path, _ = saved
    st = Storage(path)
    m = open_manifest(st)
    (chunk,) = m.tensors["model.w"].chunks
    import os

    with open(os.path.join(path, chunk.file), "r+b") as f:
        f.seek(chunk.byte_offset + 5 * BLOCK + 17)
        byte = f.read(1)
        f.seek(-1, 1)
        f.write(bytes([byte[0] ^ 0x40]))
    live = {"net": {"weight": torch.zeros(ROWS, COLS)}}
    with pytest.raises(ChecksumMismatchError, match=r"block 5 "):
        shardckpt.load(live, path, no_dist=True, key_map={"model.w": "net.weight"}, strict=False, atomic=True)
    assert not live["net"]["weight"].any()


def test_tied_alias_loads_through_a_key_map(tmp_path, monkeypatch):
    # A tied weight saved once, loaded into an untied model under the alias
    # name and renamed: the alias resolves to the stored tensor's v2 chunks.
    monkeypatch.setattr(_knobs, "BLOCK_BYTES", BLOCK)
    emb = torch.nn.Embedding(ROWS, COLS)
    head = torch.nn.Linear(COLS, ROWS, bias=False)
    head.weight = emb.weight
    model = torch.nn.ModuleDict({"emb": emb, "head": head})
    path = str(tmp_path / "tied")
    shardckpt.save({"model": model}, path, no_dist=True)
    pools = _pools(monkeypatch)
    live = {"other": {"proj": torch.zeros(ROWS, COLS)}}
    shardckpt.load(live, path, no_dist=True, key_map={"model.head.weight": "other.proj"}, keys=["model.head.weight"],
                   strict=False, buffer_bytes=16 << 10, io_threads=1)
    assert torch.equal(live["other"]["proj"], emb.weight.detach())
    assert pools[0].peak_bytes <= 16 << 10


@pytest.mark.parametrize("order", ["alias_sorts_after", "alias_sorts_before"])
def test_alias_found_whatever_its_sort_order(tmp_path, order):
    # Index rows are keyed by stored names; an alias sorting before its stored
    # tensor once made a keyed load ask the index for the alias's name.
    emb = torch.nn.Embedding(ROWS, COLS)
    head = torch.nn.Linear(COLS, ROWS, bias=False)
    head.weight = emb.weight
    first, second = ("a", "z") if order == "alias_sorts_after" else ("z", "a")
    model = torch.nn.ModuleDict({first: emb, second: head})  # saved under `first`, `second` is the alias
    path = str(tmp_path / "tied")
    shardckpt.save({"model": model}, path, no_dist=True)
    live = {"o": {"p": torch.zeros(ROWS, COLS)}}
    shardckpt.load(live, path, no_dist=True, key_map={f"model.{second}.weight": "o.p"}, keys=[f"model.{second}.weight"],
                   strict=False)
    assert torch.equal(live["o"]["p"], emb.weight.detach())
    got = shardckpt.load(None, path, keys=[f"model.{second}.weight"])
    assert torch.equal(got[f"model.{second}.weight"], emb.weight.detach())
