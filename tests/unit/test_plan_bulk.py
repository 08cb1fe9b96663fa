"""A loading rank's plan in bulk: per group of like tensors, not per tensor (issue 45).

A format v5 manifest's tensor table parses to rows (no ``TensorMeta`` per
tensor until one is asked for); ``resolve_reads`` groups the wanted tensors
by (kind, rotation, boxes), looks their chunks up in the writers' index
columns in one pass, and plans the read pieces once per group. Checked here
against the per-tensor reference (``_v2.resolve`` + ``plan_box_reads``) on
states of ``bench_scale.py`` (its simulated save, real format code), same
layout and resharded, and by counting the per-tensor objects and plans the
bulk path must not make (counts, never times).
"""

from __future__ import annotations

import importlib.util
import os

import pytest
import torch

import shardckpt
from shardckpt import _geometry
from shardckpt._format import (
    MetaCache,
    TensorMeta,
    _v2,
    manifest_from_bytes,
    manifest_to_bytes,
    open_manifest,
    resolve_many,
    resolve_reads,
    table,
)
from shardckpt._format.checksum import crc32c
from shardckpt._format.table import TableTensors
from shardckpt._load.plan import plan_load
from shardckpt._storage import Storage
from shardckpt.errors import CorruptCheckpointError

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
BLOCK = 1 << 20
#: Tensors per simulated state: above the (lowered) table threshold, small enough to stay quick.
TENSORS = 150


@pytest.fixture(autouse=True)
def _small_tables(monkeypatch):
    # Tables (manifest and columnar indexes) from 16 entries, as a 50,000-tensor state has them.
    monkeypatch.setattr(table, "TABLE_MIN_ENTRIES", 16)


def _bench():
    spec = importlib.util.spec_from_file_location("bench_scale_for_bulk", os.path.join(ROOT, "benchmarks", "bench_scale.py"))
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


def _checkpoint(bench, ranks: int, tensors: int, layout: str, damaged: str = ""):
    """``(manifest bytes, storage of the index files)`` of ``bench_scale``'s simulated save, every index file real.

    ``damaged``: a tensor whose index rows are written as if sharded over
    twice the ranks (the manifest's layout record says otherwise).
    """
    lays = bench.layouts(bench.model_tensors(tensors), ranks, layout, 2)
    _, rot = bench.v2_save_plan(lays, 0)
    written = dict(lays)
    if damaged:
        written[damaged] = bench.layouts([(damaged, lays[damaged].shape, "col")], 2 * ranks, layout, 2)[damaged]
    indexes, sizes = {}, {}
    for r in range(ranks):
        body, data_size = bench.v2_index(written, r, BLOCK)
        indexes[r], sizes[r] = body, (data_size, len(body))
    m = bench.v2_manifest(lays, rot, ranks, BLOCK, sizes)
    for im in m.indexes.values():
        im.crc32c = crc32c(indexes[im.rank])
    storage = bench._MemStorage(lambda rel: indexes[bench._rank_of_index(rel)])
    return manifest_to_bytes(m), storage


def _wants(bench, ranks: int, tensors: int, layout: str, rank: int, *, shared: bool = False):
    """``(name, boxes)`` of every tensor ``rank`` holds: a list of boxes per tensor, or (``shared``) ``held_boxes``' shared tuples."""
    lays = bench.layouts(bench.model_tensors(tensors), ranks, layout, 2)
    if shared:
        names = sorted(lays)
        held = _geometry.held_boxes([lays[n] for n in names], [bench.coord_of(lays[n].mesh_shape, rank) for n in names])
        return [(n, b) for n, b in zip(names, held) if b]
    out = []
    for name in sorted(lays):
        lay = lays[name]
        boxes = [(lb.box.offsets, lb.box.sizes) for lb in _geometry.local_boxes(lay.shape, lay.mesh_shape, lay.placements, bench.coord_of(lay.mesh_shape, rank))]
        if boxes:
            out.append((name, boxes))
    return out


@pytest.mark.parametrize("shared", [False, True], ids=["boxes-per-tensor", "held-boxes"])
@pytest.mark.parametrize(
    "saved,loaded,layout,rank",
    [(8, 8, "fsdp", 3), (8, 3, "fsdp", 1), (8, 12, "fsdp-tp", 5), (4, 1, "fsdp", 0)],
    ids=["same-layout", "reshard-8-to-3", "reshard-tp-8-to-12", "to-one-process"],
)
def test_bulk_resolution_agrees_with_the_per_tensor_reference(saved, loaded, layout, rank, shared):
    bench = _bench()
    body, storage = _checkpoint(bench, saved, TENSORS, layout)
    # Both ways of grouping: by value (a boxes list per tensor, as ``_load.plan``
    # makes them) and by the ids of the boxes objects ``held_boxes`` shares.
    wants = _wants(bench, loaded, TENSORS, layout, rank, shared=shared)
    got = resolve_reads(manifest_from_bytes(body), storage, wants, cache=MetaCache())
    ref_m = manifest_from_bytes(body)
    for (name, boxes), r in zip(wants, got, strict=True):
        ref = _v2.resolve(ref_m, storage, name, boxes, MetaCache())
        assert list(r.chunks) == ref, name
        saved_boxes = [_geometry.Box(c.offsets, c.sizes) for c in ref]
        assert r.pieces == tuple(_geometry.plan_box_reads(saved_boxes, _geometry.Box(o, z)) for o, z in boxes), name
    assert [list(r.chunks) for r in got] == resolve_many(manifest_from_bytes(body), storage, wants)
    if saved != loaded:
        assert any(len(r.chunks) > 1 for r in got)  # the resharded groups span several saved chunks


def test_a_load_plan_makes_no_per_tensor_record_or_plan(monkeypatch):
    """Parsing a tensor table and resolving every tensor of it: no TensorMeta, one read plan per group, one parse per index."""
    bench = _bench()
    body, storage = _checkpoint(bench, 8, 10 * TENSORS, "fsdp")
    wants = _wants(bench, 5, 10 * TENSORS, "fsdp", 2)
    built, planned = [], []
    init = TensorMeta.__init__
    plan = _geometry.plan_box_reads
    check = _v2.check_index
    parsed = []
    monkeypatch.setattr(TensorMeta, "__init__", lambda self, *a, **k: (built.append(1), init(self, *a, **k))[1])
    monkeypatch.setattr(_geometry, "plan_box_reads", lambda *a: (planned.append(1), plan(*a))[1])
    monkeypatch.setattr(_v2, "check_index", lambda m, data, rel, where: (parsed.append(rel), check(m, data, rel, where))[1])
    m = manifest_from_bytes(body)
    assert isinstance(m.tensors, TableTensors) and len(m.tensors) == 10 * TENSORS and not built
    got = resolve_reads(m, storage, wants, cache=MetaCache())
    assert len(got) == len(wants) == 10 * TENSORS
    # A dozen distinct (kind, boxes) groups: a plan per group (was one per tensor), a parse per index file read.
    assert len(planned) <= 40, len(planned)
    assert not built
    assert len(parsed) == len(set(parsed)) <= 4
    # The records still come when asked for, as the dict held them, and stay.
    name = wants[7][0]
    t = m.tensors[name]
    assert t is m.tensors[name] and len(built) == 1 and t.regular["rotation"] == 0 and t.dtype == "BF16"


def test_bulk_resolution_refuses_what_the_reference_refuses():
    """An index whose rows for one tensor are not the chunks its layout record says: refused in bulk, naming that tensor."""
    bench = _bench()
    victim = bench.model_tensors(TENSORS)[100][0]
    body, storage = _checkpoint(bench, 4, TENSORS, "fsdp", damaged=victim)
    wants = _wants(bench, 4, TENSORS, "fsdp", 1)
    assert victim in dict(wants)
    with pytest.raises(CorruptCheckpointError, match=f"tensor {victim!r}: the index of rank 1 lacks chunk"):
        resolve_reads(manifest_from_bytes(body), storage, wants, cache=MetaCache())
    with pytest.raises(CorruptCheckpointError, match=f"tensor {victim!r}"):
        _v2.resolve(manifest_from_bytes(body), storage, victim, dict(wants)[victim], MetaCache())
    with pytest.raises(KeyError):
        resolve_reads(manifest_from_bytes(body), storage, wants[:3] + [("no.such.tensor", wants[0][1])], cache=MetaCache())


def test_a_real_load_plans_its_pieces_once_per_group(tmp_path, monkeypatch):
    """``plan_load`` of a saved state with a tensor table: one read plan per distinct shape, bit-exact load."""
    path = str(tmp_path / "ck")
    state = {f"l{i}": torch.randn(3 + i % 4, 2) for i in range(TENSORS)}
    shardckpt.save(state, path)
    assert isinstance(open_manifest(Storage(path), chunks=False).tensors, TableTensors)
    planned = []
    plan = _geometry.plan_box_reads
    monkeypatch.setattr(_geometry, "plan_box_reads", lambda *a: (planned.append(1), plan(*a))[1])
    live = {k: torch.zeros_like(v) for k, v in state.items()}
    p = plan_load(live, Storage(path), rank=0, world=1)
    assert len(p.targets) == TENSORS and len(planned) <= 4, len(planned)  # was one per tensor
    monkeypatch.undo()
    shardckpt.load(live, path)
    assert all(torch.equal(live[k], state[k]) for k in state)


def test_held_boxes_are_local_boxes_once_per_distinct_layout():
    """``held_boxes``: what ``local_boxes`` gives each (layout, coordinate), one shared tuple per distinct pair (ints only)."""
    a = _geometry.regular_layout((10, 4), (4,), (_geometry.Shard(0),))
    a2 = _geometry.regular_layout((10, 4), (4,), (_geometry.Shard(0),))  # equal, maybe another object
    b = _geometry.regular_layout((2,), (4,), (_geometry.Shard(0),))  # ranks 2, 3 hold nothing
    c = _geometry.regular_layout((0, 3), (4,), (_geometry.Shard(0),))  # zero-size: one empty box
    d = _geometry.regular_layout((7, 6), (2, 2), (_geometry.Shard(0, 2), _geometry.Shard(0)))  # strided FSDP on TP
    lays = [a, b, a2, c, d, a, d, b]
    coords = [(1,), (3,), (1,), (2,), (1, 1), (2,), (1, 1), (0,)]
    got = _geometry.held_boxes(lays, coords)
    for lay, coord, boxes in zip(lays, coords, got, strict=True):
        assert boxes == tuple((lb.box.offsets, lb.box.sizes) for lb in _geometry.local_boxes(lay.shape, lay.mesh_shape, lay.placements, coord))
    assert got[0] is got[2] and got[4] is got[6]  # equal layout and coordinate: the same tuple
    assert got[1] == () and got[3] == (((0, 0), (0, 3)),) and got[4] and got[0] != got[5]
    with pytest.raises(ValueError, match="2 layouts but 1 coordinates"):
        _geometry.held_boxes([a, b], [(0,)])


def test_manifest_checksum_checked_over_its_bytes_without_reencoding(monkeypatch):
    """A manifest as written is checked over its own bytes; any other encoding is re-encoded; damage and NaN still refused."""
    import json

    bench = _bench()
    body, _ = _checkpoint(bench, 4, TENSORS, "fsdp")
    encoded = []
    enc = _v2.manifest_json_v2
    monkeypatch.setattr(_v2, "manifest_json_v2", lambda raw: (encoded.append(1), enc(raw))[1])
    m = manifest_from_bytes(body)
    assert not encoded and len(m.tensors) == TENSORS  # the bytes are the writer's: no re-encoding
    # Pretty-printed (the same object, not the writer's bytes): re-encoded, the same manifest.
    pretty = json.dumps(json.loads(body), indent=1).encode()
    assert sorted(manifest_from_bytes(pretty).tensors) == sorted(m.tensors) and encoded
    # One digit of the file table changed: refused either way.
    at = body.index(b'"data_sizes":[[') + len(b'"data_sizes":[[')
    damaged = body[:at] + (b"7" if body[at : at + 1] != b"7" else b"8") + body[at + 1 :]
    with pytest.raises(CorruptCheckpointError, match="checksum mismatch"):
        manifest_from_bytes(damaged)
    # A NaN whose bytes carry a matching checksum: still refused, as the re-encoding refused it.
    raw = json.loads(body)
    del raw["manifest_crc32c"]
    raw["values"] = {"lr": float("nan")}
    plain = json.dumps(raw, sort_keys=True, separators=(",", ":")).encode() + b"\n"
    at = plain.index(b',"meshes":')
    nan = plain[:at] + b',"manifest_crc32c":%d' % crc32c(plain) + plain[at:]
    with pytest.raises(CorruptCheckpointError, match="canonical JSON cannot"):
        manifest_from_bytes(nan)


def test_index_names_equal_to_the_tables_are_not_decoded_again():
    """An index whose name columns are the manifest table's reuses its names; True for 1 is not taken for equal."""
    known = ([0, 1, 1], ["a", "b", "c"], ["a", "ab", "ac"])
    got = table.front_decode([0, 1, 1], ["a", "b", "c"], strict=False, where="", known=known)
    assert got == known[2] and got is not known[2]
    with pytest.raises(CorruptCheckpointError, match="name 1: prefix True"):
        table.front_decode([0, True, 1], ["a", "b", "c"], strict=False, where="x", known=known)
    assert table.front_decode([0, 1, 0], ["a", "b", "c"], strict=False, where="", known=known) == ["a", "ab", "c"]
