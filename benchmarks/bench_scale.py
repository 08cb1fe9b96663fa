"""Metadata and planning at scale: one rank's save plan, the commit, one rank's load plan.

Simulates an R-rank save and load of T tensors in one process, with no
process group and no tensor bytes, from the real planning code
(``shardckpt._geometry``) and the real format code (``shardckpt._format``:
``Manifest``/``TensorMeta``/``ChunkMeta``/``FileMeta``, ``manifest_to_bytes``,
``manifest_from_bytes``, ``tiling_problems``):

* save_plan_s   one rank computes what it writes;
* commit_s      rank 0 builds the manifest of all R ranks' chunks, serialises
                and validates it (what ``execute_save`` does before the write);
* manifest_mb   size of ``manifest.json``;
* load_plan_s   one rank of a load at the same layout plans its reads;
* load_meta_mb  metadata bytes that loading rank reads.

``--format v2`` (the default) times what this version does: the v2
manifest (layout records, one data file and one index file per rank, its own
CRC-32C) built, serialised and re-parsed by rank 0; a loading rank parses it
and resolves its chunks and read pieces with ``_format.resolve_reads`` (what
``_load.plan`` calls), which reads only the index files of the ranks that
wrote them (served from memory here; their bytes count in load_meta_mb).
The live layout is ``_geometry.held_boxes`` over every tensor (``local_boxes``,
what ``layout_of`` derives, once per distinct layout and coordinate), the
rank's mesh coordinate once per mesh (``DeviceMesh.get_coordinate``).
``--format v1`` keeps the v1 manifest figures.

``--planner v1`` is the planning of shardckpt 0.1 (every rank derives the
boxes and holders of every tensor on every rank, ``layout_holders`` +
``assign_writers``; a load parses the whole manifest and intersects its boxes
with every saved chunk). ``--planner v2`` uses the per-rank functions
(``writer_rotations`` + ``boxes_to_write``; ``chunks_overlapping``). The
manifest itself is still format v1 in both modes (the format wave replaces
it): in v2 mode the v1 manifest parse is reported on its own line and left
out of load_plan_s, and the projected size of the compact v2 records
(docs/scaling.md) is printed for reference.

Usage::

    python benchmarks/bench_scale.py --ranks 1024 --tensors 1000 --layout fsdp --planner v1

Two trees on one host (say the previous tip copied to ``_old/``)::

    python benchmarks/bench_scale.py --ranks 16384 --tensors 50000 --layout fsdp --compare-with _old --repeat 5

runs ``_old/benchmarks/bench_scale.py`` (importing ``_old/shardckpt``) and
this tree's alternately in fresh processes and prints each run's line
(``tree=old|new run=i ...``), then both trees' medians and new/old ratios.

The last line is always
``ranks=R tensors=T layout=L save_plan_s=.. commit_s=.. manifest_mb=.. load_plan_s=.. load_meta_mb=..``,
then (format v2) each phase's CPU seconds, ``save_plan_cpu_s=.. commit_cpu_s=.. load_plan_cpu_s=..``
(the steadier figure on a shared machine).
Limits: plain Python, one core; v1 at 4,096 ranks needs several GB of memory.
"""

from __future__ import annotations

import argparse
import functools
import gc
import json
import os
import sys
import time
from itertools import chain
from operator import attrgetter
from typing import Any, Dict, List, Tuple

from shardckpt import _geometry
from shardckpt._format import (
    FORMAT_VERSION,
    ChunkMeta,
    FileMeta,
    Manifest,
    TensorMeta,
    chunk_key,
    manifest_from_bytes,
    manifest_to_bytes,
    tiling_problems,
)
from shardckpt._geometry import Box, LocalBox, Replicate, Shard

DEFAULT_TP = 8
DEFAULT_RANK = 0
ITEMSIZE = 2  # bf16
DTYPE = "BF16"

#: One Llama-3-8B-like decoder layer: (suffix, shape, tensor-parallel style).
_LAYER = [
    ("attention.wq.weight", (4096, 4096), "col"),
    ("attention.wk.weight", (1024, 4096), "col"),
    ("attention.wv.weight", (1024, 4096), "col"),
    ("attention.wo.weight", (4096, 4096), "row"),
    ("feed_forward.w1.weight", (14336, 4096), "col"),
    ("feed_forward.w3.weight", (14336, 4096), "col"),
    ("feed_forward.w2.weight", (4096, 14336), "row"),
    ("attention_norm.weight", (4096,), "none"),
    ("ffn_norm.weight", (4096,), "none"),
]
_EDGES = [
    ("tok_embeddings.weight", (128256, 4096), "col"),
    ("norm.weight", (4096,), "none"),
    ("output.weight", (128256, 4096), "col"),
]


def model_tensors(count: int) -> List[Tuple[str, Tuple[int, ...], str]]:
    """``count`` tensors of a Llama-like model: embeddings, then as many layers as fit."""
    out = list(_EDGES[:count])
    layer = 0
    while len(out) < count:
        for suffix, shape, style in _LAYER:
            if len(out) == count:
                break
            out.append((f"layers.{layer}.{suffix}", shape, style))
        layer += 1
    return out


class _Layout:
    """Stand-in for ``_geometry.RegularLayout`` when timing shardckpt 0.1 (``--planner v1`` on an old tree)."""

    def __init__(self, shape, mesh_shape, placements):
        self.shape, self.mesh_shape, self.placements = tuple(shape), tuple(mesh_shape), tuple(placements)
        self.world = 1
        for m in self.mesh_shape:
            self.world *= m


def layouts(tensors, ranks: int, layout: str, tp: int) -> Dict[str, Any]:
    """Each tensor's regular layout, as FSDP2 (and TP) would place it."""
    make = getattr(_geometry, "regular_layout", _Layout)
    out = {}
    for name, shape, style in tensors:
        if layout == "fsdp":
            out[name] = make(shape, (ranks,), (Shard(0),))
            continue
        mesh = (ranks // tp, tp)
        if style == "col":  # ColwiseParallel + FSDP: strided shard on dp
            pl = (Shard(0, tp), Shard(0))
        elif style == "row":  # RowwiseParallel + FSDP
            pl = (Shard(0), Shard(1))
        else:  # TP leaves it alone: FSDP on the dp sub-mesh, copied over tp
            pl = (Shard(0), Replicate())
        out[name] = make(shape, mesh, pl)
    return out


@functools.lru_cache(maxsize=None)
def coord_of(mesh_shape: Tuple[int, ...], rank: int) -> Tuple[int, ...]:
    """``rank``'s coordinate in a mesh (what ``DeviceMesh.get_coordinate()`` returns: computed once per mesh)."""
    coord = []
    for m in reversed(mesh_shape):
        rank, c = divmod(rank, m)
        coord.append(c)
    return tuple(reversed(coord))


# --------------------------------------------------------------------------
# v1: what shardckpt 0.1 computes


def _v1_holders(lay) -> Dict[Box, Tuple[int, ...]]:
    """``_layout._dtensor_geometry``: holders over every copy of the sub-mesh, per tensor."""
    if lay.placements[-1] == Replicate() and len(lay.mesh_shape) == 2:
        # FSDP on the dp sub-mesh, one copy per tp rank (``_mesh_copies``).
        dp, tp = lay.mesh_shape
        holders: Dict[Box, Tuple[int, ...]] = {}
        for t in range(tp):
            ranks = [d * tp + t for d in range(dp)]
            for box, rs in _geometry.layout_holders(lay.shape, ranks, (dp,), lay.placements[:1]).items():
                holders[box] = tuple(sorted(set(holders.get(box, ())) | set(rs)))
        return holders
    return _geometry.layout_holders(lay.shape, list(range(lay.world)), lay.mesh_shape, lay.placements)


def v1_save_plan(lays: Dict[str, Any], rank: int):
    """``prepare_save`` + ``_write_plan`` of one rank: every box of every rank, then greedy writers."""
    holders = {name: _v1_holders(lay) for name, lay in lays.items()}
    items = []
    for name in sorted(lays):
        for box in sorted(holders[name], key=lambda b: b.offsets):
            items.append(((name, box), box.numel * ITEMSIZE, holders[name][box]))
    writers = _geometry.assign_writers(items)
    mine = []
    for name in sorted(lays):
        lay = lays[name]
        for lb in _geometry.local_boxes(lay.shape, lay.mesh_shape, lay.placements, coord_of(lay.mesh_shape, rank)):
            if writers.get((name, lb.box)) == rank:
                mine.append((name, lb.box))
    return mine, writers


def v1_all_writes(writers: Dict[Tuple[str, Box], int]) -> Dict[int, List[Tuple[str, Box]]]:
    per_rank: Dict[int, List[Tuple[str, Box]]] = {}
    for (name, box), r in writers.items():
        per_rank.setdefault(r, []).append((name, box))
    return per_rank


# --------------------------------------------------------------------------
# v2: per-rank planning


def v2_save_plan(lays: Dict[str, Any], rank: int):
    rot = _geometry.writer_rotations([(name, lay, ITEMSIZE) for name, lay in lays.items()])
    mine = []
    for name in sorted(lays):
        lay = lays[name]
        for lb in _geometry.boxes_to_write(lay, rot[name], coord_of(lay.mesh_shape, rank)):
            mine.append((name, lb.box))
    return mine, rot


def v2_all_writes(lays, rot) -> Dict[int, List[Tuple[str, Box]]]:
    """Who writes what, for the v1 manifest rank 0 still commits (one record per chunk)."""
    per_rank: Dict[int, List[Tuple[str, Box]]] = {}
    for name, lay in lays.items():
        for s, boxes in _geometry.layout_chunks(lay):
            if not boxes:
                continue
            r = 0
            for m, c in zip(lay.mesh_shape, _geometry.writer_coord(lay, rot[name], s)):
                r = r * m + c
            per_rank.setdefault(r, []).extend((name, b) for b in boxes)
    return per_rank


# --------------------------------------------------------------------------
# commit and load


def build_manifest(lays, per_rank: Dict[int, List[Tuple[str, Box]]], ranks: int) -> Manifest:
    """``_build_manifest``: one file per rank, its chunks back to back."""
    tensors = {name: TensorMeta(dtype=DTYPE, shape=list(lay.shape), layout={"placements": [repr(p) for p in lay.placements]}) for name, lay in lays.items()}
    files = {}
    for r in sorted(per_rank):
        rel = f"data/0123456789ab-r{r:05d}-00.safetensors"
        pos = 8
        for name, box in per_rank[r]:
            nbytes = box.numel * ITEMSIZE
            whole = box.sizes == lays[name].shape
            tensors[name].chunks.append(
                ChunkMeta(file=rel, key=chunk_key(name, box.offsets, whole), offsets=list(box.offsets), sizes=list(box.sizes),
                          byte_offset=pos, nbytes=nbytes, crc32c=(pos * 2654435761) & 0xFFFFFFFF)
            )
            pos += nbytes
        files[rel] = FileMeta(pos)
    bad = tiling_problems(tensors)
    assert not bad, bad[:3]
    return Manifest(world_size=ranks, tensors=tensors, files=files, values={"step": 1000}, save_id="0123456789abcdef")


def v1_load_plan(body: bytes, lays, rank: int) -> int:
    """The v1 load plan (``_load.plan``): parse the whole manifest, intersect own boxes with every saved chunk."""
    m = manifest_from_bytes(body)
    pieces = 0
    for name in sorted(lays):
        lay = lays[name]
        saved = [Box(tuple(c.offsets), tuple(c.sizes)) for c in m.tensors[name].chunks]
        for lb in _geometry.local_boxes(lay.shape, lay.mesh_shape, lay.placements, coord_of(lay.mesh_shape, rank)):
            pieces += len(_geometry.plan_reads(saved, [LocalBox(lb.box, (0,) * len(lay.shape))]))
    return pieces


def v2_load_plan(records: Dict[str, Any], lays, rank: int) -> int:
    """Plan from the compact layout records: only the chunks each own box overlaps."""
    pieces = 0
    for name in sorted(lays):
        live = lays[name]
        saved = records[name]
        for lb in _geometry.local_boxes(live.shape, live.mesh_shape, live.placements, coord_of(live.mesh_shape, rank)):
            hits = _geometry.chunks_overlapping(saved, lb.box)
            pieces += len(_geometry.plan_reads([b for _, b in hits], [LocalBox(lb.box, (0,) * len(live.shape))]))
    return pieces


def compact_records(lays, rot, ranks: int) -> bytes:
    """Projected v2 metadata a loading rank reads (docs/scaling.md): per tensor one layout record."""
    body = {
        "format_version": 2,
        "world_size": ranks,
        "tensors": {
            name: {"dtype": DTYPE, "layout": _geometry.layout_to_json(lay), "rotation": rot[name]} for name, lay in sorted(lays.items())
        },
        # one data file per rank, named by rank: a pattern, not a list
        "files": {"pattern": "data/{save_id}-r{rank:05d}-{i:02d}.safetensors", "per_rank": 1},
    }
    return json.dumps(body, sort_keys=True, separators=(",", ":")).encode()


# --------------------------------------------------------------------------
# format v2: what save/load do now

SAVE_ID = "0123456789abcdef0123456789abcdef"


class _MemStorage:
    """Serves the index files a load reads, generated on first request (generation is not timed)."""

    url = "mem://bench"

    def __init__(self, make):
        self.make = make
        self.blobs: Dict[str, bytes] = {}

    def url_of(self, rel: str) -> str:
        return f"{self.url}/{rel}"

    def read_bytes(self, rel: str, limit: int = 0) -> bytes:
        if rel not in self.blobs:
            self.blobs[rel] = self.make(rel)
        return self.blobs[rel]


def _rank_of_index(rel: str) -> int:
    return int(rel.rsplit("-r", 1)[1].split(".")[0])


def v2_index(lays, rank: int, block_bytes: int) -> bytes:
    """Rank ``rank``'s index file, as ``execute_save`` writes it (CRCs made up)."""
    from shardckpt._format import data_file_name
    from shardckpt._format._v2 import index_bytes, nblocks

    mine, _ = v2_save_plan(lays, rank)
    rel = data_file_name(SAVE_ID, f"r{rank:05d}-00")
    chunks, pos = [], 8
    for name, box in mine:
        nbytes = box.numel * ITEMSIZE
        whole = box.sizes == lays[name].shape
        c = ChunkMeta(rel, chunk_key(name, box.offsets, whole), list(box.offsets), list(box.sizes), pos, nbytes, pos & 0xFFFFFFFF)
        c.blocks = [(pos + i) & 0xFFFFFFFF for i in range(nblocks(nbytes, block_bytes))]
        chunks.append((name, c))
        pos += nbytes
    return index_bytes(SAVE_ID, rank, block_bytes, chunks), pos


def v2_manifest(lays, rot, ranks: int, block_bytes: int, sizes: Dict[int, Tuple[int, int]]) -> Manifest:
    from shardckpt._format.manifest import paused_gc

    return paused_gc(_v2_manifest)(lays, rot, ranks, block_bytes, sizes)  # as _save._build_manifest


def _v2_manifest(lays, rot, ranks: int, block_bytes: int, sizes: Dict[int, Tuple[int, int]]) -> Manifest:
    """``_save._build_manifest`` on rank 0: a layout record per tensor, two files per rank, O(T + N)."""
    from shardckpt._format import IndexMeta, data_file_name, index_file_name

    tensors = {}
    records: Dict[Any, Dict[str, Any]] = {}
    for name, lay in lays.items():
        rec = records.get(lay)
        if rec is None:
            rec = records[lay] = _geometry.layout_to_json(lay)
        t = TensorMeta(dtype=DTYPE, shape=list(lay.shape), layout={"placements": rec["placements"]})
        t.regular = {"mesh_shape": rec["mesh_shape"], "placements": rec["placements"], "mesh": 0, "rotation": rot[name]}
        tensors[name] = t
    files, indexes = {}, {}
    for r in range(ranks):
        data_size, index_size = sizes.get(r, (1 << 30, 1 << 20))
        files[data_file_name(SAVE_ID, f"r{r:05d}-00")] = FileMeta(data_size)
        files[index_file_name(SAVE_ID, r)] = FileMeta(index_size)
        indexes[index_file_name(SAVE_ID, r)] = IndexMeta(r, index_size, (r * 2654435761) & 0xFFFFFFFF)
    return Manifest(world_size=ranks, tensors=tensors, files=files, values={"step": 1000}, save_id=SAVE_ID,
                    version=FORMAT_VERSION, block_bytes=block_bytes, meshes=["iota"], indexes=indexes)


def run_v2(args, lays) -> int:
    from shardckpt._format import MetaCache, resolve_reads
    from shardckpt._format.checksum import crc32c

    block_bytes = 1 << 20
    (mine, rot), save_s = _timed(lambda: v2_save_plan(lays, args.rank))
    cpu = {"save_plan": LAST_CPU[0]}
    print(f"rank {args.rank} writes {len(mine)} chunks ({sum(b.numel for _, b in mine) * ITEMSIZE / 1e6:.1f} MB)")
    indexes: Dict[int, bytes] = {}
    sizes: Dict[int, Tuple[int, int]] = {}

    def index_of(rel: str) -> bytes:
        r = _rank_of_index(rel)
        if r not in indexes:
            body, data_size = v2_index(lays, r, block_bytes)
            indexes[r] = body
            sizes[r] = (data_size, len(body))
        return indexes[r]

    # The manifest records each index file's size and CRC: learn the ones a
    # load at the same layout reads (dry run, not timed), then commit for real.
    storage = _MemStorage(index_of)
    m0 = v2_manifest(lays, rot, args.ranks, block_bytes, sizes)
    for name in sorted(lays):
        lay = lays[name]
        for lb in _geometry.local_boxes(lay.shape, lay.mesh_shape, lay.placements, coord_of(lay.mesh_shape, args.rank)):
            for s, _ in _geometry.chunks_overlapping(lay, lb.box):
                wc = _geometry.writer_coord(lay, rot[name], s)
                r = 0
                for mdim, c in zip(lay.mesh_shape, wc):
                    r = r * mdim + c
                index_of(f"data/x-index-r{r:05d}.json")
    del m0

    def commit():
        m = v2_manifest(lays, rot, args.ranks, block_bytes, sizes)
        for r, body in indexes.items():
            from shardckpt._format import index_file_name

            m.indexes[index_file_name(SAVE_ID, r)].crc32c = crc32c(body)
        body = manifest_to_bytes(m)
        manifest_from_bytes(body)  # the validation any reader repeats
        return body

    body, commit_s = _timed(commit)
    cpu["commit"] = LAST_CPU[0]
    print(f"manifest (format v2): {len(lays)} layout records, {2 * args.ranks} files, {len(body) / 1e6:.3f} MB")

    def load_plan():
        m = manifest_from_bytes(body)
        cache = MetaCache()
        pieces = 0
        # The live layout of every tensor (what ``layout_of`` derives from
        # each DTensor's placements), in bulk: each distinct layout once.
        names = sorted(lays)
        live = list(map(lays.__getitem__, names))
        coord = {ms: coord_of(ms, args.rank) for ms in {lay.mesh_shape for lay in live}}
        held = _geometry.held_boxes(live, [coord[lay.mesh_shape] for lay in live])
        wants = list(zip(names, held)) if all(held) else [(name, boxes) for name, boxes in zip(names, held) if boxes]
        # What ``_load.plan`` does: every tensor's chunks and read pieces in one call.
        reads = resolve_reads(m, storage, wants, cache=cache)
        pieces += sum(map(len, chain.from_iterable(map(attrgetter("pieces"), reads))))  # the pieces of every box, counted
        assert pieces >= len(wants)
        return cache.bytes_read

    index_read, load_s = _timed(load_plan)
    cpu["load_plan"] = LAST_CPU[0]
    meta_mb = (len(body) + index_read) / 1e6
    print(f"a loading rank reads the manifest ({len(body) / 1e6:.3f} MB) and {index_read / 1e6:.3f} MB of index files")
    print(
        f"ranks={args.ranks} tensors={args.tensors} layout={args.layout} save_plan_s={save_s:.3f} "
        f"commit_s={commit_s:.3f} manifest_mb={len(body) / 1e6:.3f} load_plan_s={load_s:.3f} load_meta_mb={meta_mb:.3f} "
        + " ".join(f"{k}_cpu_s={v:.3f}" for k, v in cpu.items())
    )
    return 0


#: CPU seconds of the last ``_timed`` call (this process's: on a shared,
#: loaded machine the steadier figure; the wall clock counts other processes).
LAST_CPU = [0.0]


def _timed(fn):
    # Cold: a phase must not reuse geometry memoized by an earlier one (a
    # loading process starts with nothing remembered).
    getattr(_geometry, "clear_geometry_caches", lambda: None)()
    coord_of.cache_clear()
    gc.collect()
    c0, t0 = time.process_time(), time.perf_counter()
    out = fn()
    wall = time.perf_counter() - t0
    LAST_CPU[0] = time.process_time() - c0
    return out, wall


#: Runs of each tree with ``--compare-with`` (medians reported).
DEFAULT_REPEAT = 5

# A child of ``--compare-with``: ``bench_scale.main`` of the tree at argv[1],
# importing that tree's ``shardckpt`` (checked, so an installed copy cannot
# stand in for it).
_CHILD = """
import importlib, os, sys
root = os.path.realpath(sys.argv[1])
sys.path[:0] = [root, os.path.join(root, "benchmarks")]
import shardckpt
bench = importlib.import_module(sys.argv[2])
for mod in (shardckpt, bench):
    if not os.path.realpath(mod.__file__).startswith(root + os.sep):
        sys.exit(f"{mod.__name__} imported from {mod.__file__}, not from {root}")
sys.exit(bench.main(sys.argv[3:]))
"""


def _figures(line: str) -> Dict[str, str]:
    return dict(f.split("=", 1) for f in line.split() if "=" in f)


def compare(trees: Dict[str, str], argv: List[str], repeat: int, *, bench: str = "bench_scale") -> int:
    """Run ``argv`` on each tree's own ``benchmarks/<bench>.py`` in fresh processes, alternately, ``repeat`` times; print medians.

    One command on one host gives figures of two trees that compare (the
    same machine, load and moment): each run's last ``ranks=`` line prefixed
    with ``tree=<label> run=<i>``, then per tree the medians of every ``*_s``
    figure, then new/old ratios. ``bench_moe_scale.py --compare-with`` uses
    it too.
    """
    import statistics
    import subprocess

    runs: Dict[str, List[Dict[str, str]]] = {label: [] for label in trees}
    for i in range(repeat):
        for label, root in trees.items():
            done = subprocess.run([sys.executable, "-c", _CHILD, root, bench, *argv], capture_output=True, text=True)
            lines = [ln for ln in done.stdout.splitlines() if ln.startswith("ranks=")]
            if done.returncode or not lines:
                print(done.stdout + done.stderr, file=sys.stderr)
                print(f"tree={label} ({root}) failed with exit status {done.returncode}", file=sys.stderr)
                return 1
            runs[label].append(_figures(lines[-1]))
            print(f"tree={label} run={i} {lines[-1]}", flush=True)
    timed = [k for k in runs[next(iter(runs))][0] if k.endswith("_s") and all(k in r for got in runs.values() for r in got)]
    medians: Dict[str, Dict[str, float]] = {}
    for label, got in runs.items():
        medians[label] = {k: statistics.median(float(r[k]) for r in got) for k in timed}
        sizes = " ".join(f"{k}={got[-1][k]}" for k in ("manifest_mb", "load_meta_mb") if k in got[-1])
        print(f"tree={label} median_of={repeat} " + " ".join(f"{k}={v:.3f}" for k, v in medians[label].items()) + f" {sizes}")
    old, new = list(trees)
    print(f"new/old ({new} over {old}): " + " ".join(f"{k}={medians[new][k] / medians[old][k]:.2f}" for k in timed))
    return 0


#: This tree's root (what ``--compare-with`` calls "new").
HERE = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def comparison_args(argv: List[str]) -> List[str]:
    """``argv`` less ``--compare-with`` and ``--repeat`` (and their values): what each tree's bench is run with."""
    rest, skip = [], False
    for a in argv:
        if skip:
            skip = False
        elif a in ("--compare-with", "--repeat"):
            skip = True
        elif not a.startswith(("--compare-with=", "--repeat=")):
            rest.append(a)
    return rest


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--ranks", type=int, required=True)
    ap.add_argument("--tensors", type=int, required=True)
    ap.add_argument("--layout", choices=["fsdp", "fsdp-tp"], required=True)
    ap.add_argument("--planner", choices=["v1", "v2"], default="v2")
    ap.add_argument("--format", choices=["v1", "v2"], default=None,
                    help="manifest format committed and read (default: v2 with --planner v2, v1 with --planner v1)")
    ap.add_argument("--tp", type=int, default=DEFAULT_TP, help="tensor-parallel degree of --layout fsdp-tp")
    ap.add_argument("--rank", type=int, default=DEFAULT_RANK, help="the rank whose save and load plans are timed")
    ap.add_argument("--compare-with", metavar="DIR", default=None,
                    help="another tree's root (say the previous tip copied as _old/): run its benchmarks/bench_scale.py and this "
                         "tree's alternately in fresh processes, --repeat times each, and print both trees' medians")
    ap.add_argument("--repeat", type=int, default=DEFAULT_REPEAT, help="runs of each tree with --compare-with")
    args = ap.parse_args(argv)
    if args.compare_with is not None:
        argv = list(sys.argv[1:] if argv is None else argv)
        return compare({"old": os.path.abspath(args.compare_with), "new": HERE}, comparison_args(argv), args.repeat)
    if args.layout == "fsdp-tp" and args.ranks % args.tp:
        ap.error(f"--ranks {args.ranks} is not a multiple of --tp {args.tp}")
    if not 0 <= args.rank < args.ranks:
        ap.error(f"--rank must lie in [0, {args.ranks})")

    lays = layouts(model_tensors(args.tensors), args.ranks, args.layout, args.tp)
    if args.format is None:
        args.format = args.planner
    if args.format == "v2":
        if args.planner != "v2":
            ap.error("--format v2 plans with --planner v2")
        return run_v2(args, lays)
    if args.planner == "v1":
        (mine, writers), save_s = _timed(lambda: v1_save_plan(lays, args.rank))
        per_rank = v1_all_writes(writers)
    else:
        (mine, rot), save_s = _timed(lambda: v2_save_plan(lays, args.rank))
        per_rank = v2_all_writes(lays, rot)
    print(f"rank {args.rank} writes {len(mine)} chunks ({sum(b.numel for _, b in mine) * ITEMSIZE / 1e6:.1f} MB)")

    def commit():
        m = build_manifest(lays, per_rank, args.ranks)
        body = manifest_to_bytes(m)
        manifest_from_bytes(body)  # the validation any reader repeats
        return m, body

    (manifest, body), commit_s = _timed(commit)
    nchunks = sum(len(t.chunks) for t in manifest.tensors.values())
    print(f"manifest (format v1): {nchunks} chunks, {len(body) / 1e6:.1f} MB")
    del manifest
    if args.planner == "v1":
        _, load_s = _timed(lambda: v1_load_plan(body, lays, args.rank))
        meta_mb = len(body) / 1e6
    else:
        _, parse_s = _timed(lambda: manifest_from_bytes(body))
        print(f"v1 manifest parse+validate, still done by every loading rank until format v2: {parse_s:.3f} s")
        compact = compact_records(lays, rot, args.ranks)
        records = {name: _geometry.layout_from_json(rec["layout"]) for name, rec in json.loads(compact)["tensors"].items()}
        print(f"projected v2 metadata (layout records, docs/scaling.md): {len(compact) / 1e6:.3f} MB")
        _, load_s = _timed(lambda: v2_load_plan(records, lays, args.rank))
        meta_mb = len(body) / 1e6
    print(
        f"ranks={args.ranks} tensors={args.tensors} layout={args.layout} save_plan_s={save_s:.3f} "
        f"commit_s={commit_s:.3f} manifest_mb={len(body) / 1e6:.1f} load_plan_s={load_s:.3f} load_meta_mb={meta_mb:.1f}"
    )
    return 0


if __name__ == "__main__":
    sys.exit(main())
