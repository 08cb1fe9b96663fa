"""Data files keep their safetensors headers under a limit: many small tensors go to several files.

safetensors' own readers refuse a header over 100 MB (and ``verify`` calls such a file damaged), so
the save's file planning cuts a rank's chunks over several files by estimated header bytes
(``SHARDCKPT_HEADER_BYTES_PER_FILE``), and so does every writer of native checkpoints.
"""

from __future__ import annotations

import json
import os
import random
import struct

import pytest
import torch

import shardckpt
from shardckpt import _io, _knobs
from shardckpt._format import safetensors_header
from shardckpt._io import HEADER_BASE_BYTES, WriteItem, entry_header_bytes, partition, split_by_header, write_files
from shardckpt._storage import Storage
from shardckpt.errors import UnsupportedStateError

#: A small limit, so a few hundred tiny tensors need several files.
SMALL_LIMIT = 8192


def _header_len(path) -> int:
    with open(path, "rb") as f:
        return struct.unpack("<Q", f.read(8))[0]


def _data_files(root):
    d = os.path.join(root, "data")
    return sorted(os.path.join(d, f) for f in os.listdir(d) if f.endswith(".safetensors"))


# -- planning (pure, on ints) ---------------------------------------------------


def test_split_by_header_covers_every_entry_in_order_within_the_limit():
    rng = random.Random(3)
    for _ in range(300):
        costs = [rng.randint(1, 500) for _ in range(rng.randint(0, 60))]
        limit = HEADER_BASE_BYTES + rng.randint(1, 3000)
        runs = split_by_header(costs, limit)
        assert [i for a, b in runs for i in range(a, b)] == list(range(len(costs)))
        assert all(b > a for a, b in runs)
        for a, b in runs:
            # Within the limit, unless one entry alone is bigger than it.
            assert HEADER_BASE_BYTES + sum(costs[a:b]) <= limit or b - a == 1
        # Greedy: no run could have taken the next entry.
        for (a, b), (c, _) in zip(runs, runs[1:]):
            assert HEADER_BASE_BYTES + sum(costs[a : b + 1]) > limit and c == b


def test_split_by_header_edges():
    assert split_by_header([], 1000) == []
    assert split_by_header([10], HEADER_BASE_BYTES + 10) == [(0, 1)]
    assert split_by_header([10, 1], HEADER_BASE_BYTES + 10) == [(0, 1), (1, 2)]
    assert split_by_header([10**9, 5, 5], HEADER_BASE_BYTES + 10) == [(0, 1), (1, 3)]  # an oversized entry is alone


def test_the_estimate_bounds_the_real_header():
    rng = random.Random(7)
    alphabet = 'ab.\\"\u00e9\u4e2d_0'
    for _ in range(50):
        entries, chunks, costs = [], {}, []
        for i in range(rng.randint(1, 40)):
            name = "".join(rng.choice(alphabet) for _ in range(rng.randint(1, 30))) + str(i)
            nd = rng.randint(0, 4)
            sizes = [rng.randint(0, 10**6) for _ in range(nd)]
            offsets = [rng.randint(0, 10**9) for _ in range(nd)]
            key = f"{name}@{i}"
            entries.append((key, "F32", sizes, 4))
            chunks[key] = {"tensor": name, "offsets": offsets}
            costs.append(entry_header_bytes(key, name, "F32", sizes, offsets))
        header, _ = safetensors_header(entries, chunks=chunks)
        assert len(header) <= HEADER_BASE_BYTES + sum(costs)


def _items(n: int, *, name_len: int = 40):
    out = []
    for i in range(n):
        name = f"layers.{i}." + "p" * name_len
        t = torch.full((3,), float(i))
        out.append(WriteItem(name=name, key=name, dtype="F32", offsets=(0,), sizes=(3,), tensor=t))
    return out


def test_partition_cuts_groups_by_header_bytes():
    items = _items(300)
    files = partition(items, 1, header_limit=SMALL_LIMIT)
    assert len(files) > 1
    assert sorted(it.name for f in files for it in f) == sorted(it.name for it in items)
    for f in files:
        assert HEADER_BASE_BYTES + sum(entry_header_bytes(it.key, it.name, it.dtype, it.sizes, it.offsets) for it in f) <= SMALL_LIMIT
    # The default limit keeps them in one file.
    assert len(partition(items, 1)) == 1


def test_a_writer_never_leaves_a_header_safetensors_refuses(tmp_path, monkeypatch):
    monkeypatch.setattr(_io, "MAX_HEADER_BYTES", 2000)  # stands for safetensors' 100 MB
    st = Storage(str(tmp_path))
    with pytest.raises(UnsupportedStateError, match="header would be .* bytes, over the 2000"):
        write_files(st, {"data/x.safetensors": _items(50)})
    assert not (tmp_path / "data" / "x.safetensors").exists()


# -- save, load, verify ---------------------------------------------------------------


def _many(n: int):
    return {"layers": {f"block{i:04d}": {"weight_with_a_long_name": torch.arange(4.0) + i, "b": torch.tensor(i)} for i in range(n)}}


def test_save_of_many_tiny_tensors_splits_files_and_loads(tmp_path, monkeypatch):
    monkeypatch.setattr(_knobs, "HEADER_BYTES_PER_FILE", SMALL_LIMIT)
    root = str(tmp_path / "ck")
    state = _many(400)
    shardckpt.save(state, root)
    files = _data_files(root)
    assert len(files) >= 5, files  # one rank, one I/O group: split by header bytes alone
    for f in files:
        assert _header_len(f) <= SMALL_LIMIT, f
    shardckpt.verify(root)
    live = {"layers": {k: {n: torch.zeros_like(t) for n, t in v.items()} for k, v in state["layers"].items()}}
    shardckpt.load(live, root)
    for k, v in state["layers"].items():
        for n, t in v.items():
            assert torch.equal(live["layers"][k][n], t), (k, n)
    # safetensors' own reader opens each file.
    from safetensors import safe_open

    seen = 0
    for f in files:
        with safe_open(f, framework="pt") as sf:
            seen += len(list(sf.keys()))
    assert seen == 800


def test_converters_split_native_files_too(tmp_path, monkeypatch):
    from safetensors.torch import save_file
    from shardckpt.converters import from_safetensors

    src = tmp_path / "hf"
    src.mkdir()
    tensors = {f"model.layers.{i}.mlp.weight": torch.arange(6.0).reshape(2, 3) + i for i in range(300)}
    save_file(tensors, str(src / "model.safetensors"))
    monkeypatch.setattr(_knobs, "HEADER_BYTES_PER_FILE", SMALL_LIMIT)
    dst = str(tmp_path / "native")
    from_safetensors(str(src), dst)
    files = _data_files(dst)
    assert len(files) >= 3, files
    assert all(_header_len(f) <= SMALL_LIMIT for f in files)
    shardckpt.verify(dst)
    m = shardckpt.inspect(dst)
    assert len(m.tensors) == 300
    raw = json.loads(open(os.path.join(dst, "manifest.json"), "rb").read())
    assert sum(1 for f in raw["files"] if f.endswith(".safetensors")) == len(files)


def test_split_files_by_header_keeps_tags_that_fit_and_numbers_the_cut_ones():
    from shardckpt._io import split_files_by_header

    small = _items(3)
    many = _items(300)
    out = split_files_by_header({"00": small, "01": many, "02": []}, header_limit=SMALL_LIMIT)
    assert out["00"] == small and "02" not in out
    cut = [t for t in out if t.startswith("01-h")]
    assert len(cut) > 1 and cut == sorted(cut) and [it for t in cut for it in out[t]] == many
