"""A mixture-of-experts state at thousands of simulated ranks: planning, metadata and the control plane.

The state: a MoE transformer (d 4,096; 128 experts of hidden 1,536 per
layer, w1/w3 column- and w2 row-parallel; attention wq/wk/wv/wo; two norms; a
router) + AdamW's exp_avg/exp_avg_sq, as many layers as make ``--tensors``
(default 50,000) tensor names, laid out as a 397B-class run is:

* experts: expert parallel ``EP`` (16) x tensor parallel ``TP`` (8) x FSDP:
  expert ``e`` of every layer lives on EP group ``e // (128 / EP)``, a
  sub-mesh ``(dp_mod_ep, tp)`` of ``N / (EP x TP)`` x TP ranks (FSDP strided
  on dim 0 for column-parallel matrices, ``(Shard(0), Shard(1))`` for w2);
  a rank holds the experts of its group only (a rank-union save);
* dense layers: FSDP x TP over the whole world (``(dp, tp)``), norms and
  router FSDP on ``dp``, replicated over ``tp``.

Simulated in one process with the real planning and format code (as
``bench_scale.py``; no tensor bytes, no process group):

* save_plan_s    rank 0's write plan (writer rotations + its boxes to write);
* commit_s       rank 0 builds the manifest of every tensor (layout records,
                 the EP groups' meshes, the file table), serialises and
                 re-parses it;
* load_plan_s    rank 0 of a load at the same layout: parse the manifest,
                 resolve every tensor it holds (``resolve_reads``: the index
                 files of the ranks that wrote its chunks, served from
                 memory), plan the read pieces;
* reshard_plan_s the same at half the ranks, EP 16 -> 8 (``--reshard``);
* manifest_mb, load_meta_mb / reshard_meta_mb: the manifest, and all the
  metadata that loading rank reads (manifest + index files);
* with ``--control-plane``: rank 0's records and value tree of this state
  through the save's first exchange and the rest of a save and a load
  (``_collective.agree`` on a real TCPStore, ``bench_control_plane.run``):
  the largest store value and rank 0's seconds.

Every phase starts with the geometry caches empty. Usage::

    python benchmarks/bench_moe_scale.py --ranks 1024,4096,16384 [--control-plane]
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time
from itertools import chain
from operator import attrgetter, itemgetter
from typing import Any, Dict, List, Tuple

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

import bench_scale as B  # noqa: E402

from shardckpt import _geometry  # noqa: E402
from shardckpt._format import (  # noqa: E402
    FORMAT_VERSION,
    ChunkMeta,
    FileMeta,
    IndexMeta,
    Manifest,
    MetaCache,
    TensorMeta,
    chunk_key,
    data_file_name,
    index_file_name,
    manifest_from_bytes,
    manifest_to_bytes,
    resolve_reads,
)
from shardckpt._format._v2 import index_bytes, nblocks  # noqa: E402
from shardckpt._format.checksum import crc32c  # noqa: E402
from shardckpt._format.manifest import paused_gc  # noqa: E402
from shardckpt._geometry import Replicate, Shard  # noqa: E402

D, H, EXPERTS = 4096, 1536, 128
ITEMSIZE, DTYPE = 2, "BF16"
SAVE_ID = B.SAVE_ID
BLOCK = 1 << 20

_DENSE = [
    ("attention.wq.weight", (8192, D), "col"),
    ("attention.wk.weight", (512, D), "col"),
    ("attention.wv.weight", (512, D), "col"),
    ("attention.wo.weight", (D, 8192), "row"),
    ("attention_norm.weight", (D,), "none"),
    ("ffn_norm.weight", (D,), "none"),
    ("moe.router.weight", (EXPERTS, D), "none"),
]
_EXPERT = [("w1.weight", (H, D), "col"), ("w3.weight", (H, D), "col"), ("w2.weight", (D, H), "row")]
_STATES = ("model.", "optim.exp_avg.", "optim.exp_avg_sq.")


def moe_tensors(count: int) -> List[Tuple[str, Tuple[int, ...], str, int]]:
    """``(name, shape, style, expert or -1)``: embeddings, then whole layers until ``count`` names (x3 with AdamW)."""
    out: List[Tuple[str, Tuple[int, ...], str, int]] = []
    for pre in _STATES:
        out += [(pre + "tok_embeddings.weight", (128256, D), "col", -1), (pre + "norm.weight", (D,), "none", -1),
                (pre + "output.weight", (128256, D), "col", -1)]
    layer = 0
    while len(out) < count:
        for pre in _STATES:
            out += [(f"{pre}layers.{layer}.{s}", shape, st, -1) for s, shape, st in _DENSE]
            for e in range(EXPERTS):
                out += [(f"{pre}layers.{layer}.moe.experts.{e}.{s}", shape, st, e) for s, shape, st in _EXPERT]
        layer += 1
    return out


class World:
    """N ranks as ``(dp_mod_ep, ep, tp)``; the dense mesh ``(dp, tp)`` is the same ranks row-major."""

    def __init__(self, ranks: int, ep: int, tp: int):
        if ranks % (ep * tp) or EXPERTS % ep:
            raise SystemExit(f"--ranks {ranks} must be a multiple of EP x TP = {ep * tp}, and {EXPERTS} of EP")
        self.n, self.ep, self.tp = ranks, ep, tp
        self.dp_mod_ep = ranks // (ep * tp)
        # Each EP group's rank list (its sub-mesh (dp_mod_ep, tp), row-major): the manifest's meshes 1..EP.
        self.groups = [tuple((d * ep + g) * tp + t for d in range(self.dp_mod_ep) for t in range(tp)) for g in range(ep)]

    def group_of(self, rank: int) -> int:
        return (rank // self.tp) % self.ep

    def expert_group(self, e: int) -> int:
        return e // (EXPERTS // self.ep)

    def dense_coord(self, rank: int) -> Tuple[int, int]:
        return divmod(rank, self.tp)

    def expert_coord(self, rank: int) -> Tuple[int, int]:
        return rank // (self.ep * self.tp), rank % self.tp


def _placements(style: str, tp: int) -> Tuple[Any, ...]:
    if style == "col":
        return (Shard(0, tp), Shard(0))
    if style == "row":
        return (Shard(0), Shard(1))
    return (Shard(0), Replicate())


def layouts(tensors, w: World) -> Dict[str, Tuple[Any, int]]:
    """``name -> (regular layout, mesh id)``: mesh 0 the world (``"iota"``), 1 + g EP group g."""
    out = {}
    for name, shape, style, e in tensors:
        if e < 0:
            out[name] = (_geometry.regular_layout(shape, (w.n // w.tp, w.tp), _placements(style, w.tp)), 0)
        else:
            out[name] = (_geometry.regular_layout(shape, (w.dp_mod_ep, w.tp), _placements(style, w.tp)), 1 + w.expert_group(e))
    return out


def held(lays, tensors, w: World, rank: int) -> List[Tuple[str, Any, Tuple[int, ...]]]:
    """What ``rank`` holds: ``(name, layout, its coordinate)``; dense everywhere, experts of its EP group."""
    g = w.group_of(rank)
    out = []
    for name, *_ in tensors:
        lay, mesh = lays[name]
        if mesh == 0:
            out.append((name, lay, w.dense_coord(rank)))
        elif mesh == 1 + g:
            out.append((name, lay, w.expert_coord(rank)))
    return out


def save_plan(lays, tensors, w: World, rank: int):
    """A rank's write plan; rotations over the union (what rank 0 decides in the first exchange)."""
    rot = _geometry.writer_rotations([(name, lay, ITEMSIZE) for name, (lay, _) in lays.items()])
    mine = [(name, lb.box) for name, lay, coord in held(lays, tensors, w, rank) for lb in _geometry.boxes_to_write(lay, rot[name], coord)]
    return mine, rot


def rank_index(lays, tensors, w: World, rot, rank: int) -> Tuple[bytes, int]:
    """Rank ``rank``'s index file as ``execute_save`` writes it (CRCs made up), and its data bytes."""
    rel = data_file_name(SAVE_ID, f"r{rank:05d}-00")
    chunks, pos = [], 8
    for name, lay, coord in held(lays, tensors, w, rank):
        for lb in _geometry.boxes_to_write(lay, rot[name], coord):
            nbytes = lb.box.numel * ITEMSIZE
            c = ChunkMeta(rel, chunk_key(name, lb.box.offsets, lb.box.sizes == lay.shape), list(lb.box.offsets), list(lb.box.sizes),
                          pos, nbytes, pos & 0xFFFFFFFF)
            c.blocks = [(pos + i) & 0xFFFFFFFF for i in range(nblocks(nbytes, BLOCK))]
            chunks.append((name, c))
            pos += nbytes
    return index_bytes(SAVE_ID, rank, BLOCK, chunks), pos


@paused_gc  # as _save._build_manifest
def manifest(lays, w: World, rot, sizes: Dict[int, Tuple[int, int, int]]) -> Manifest:
    """``_save._build_manifest`` on rank 0: a layout record per tensor, the EP groups' meshes, two files per rank."""
    tensors, records = {}, {}
    for name, (lay, mesh) in lays.items():
        rec = records.get(lay)
        if rec is None:
            rec = records[lay] = _geometry.layout_to_json(lay)
        t = TensorMeta(dtype=DTYPE, shape=list(lay.shape), layout={"placements": rec["placements"]})
        t.regular = {"mesh_shape": rec["mesh_shape"], "placements": rec["placements"], "mesh": mesh, "rotation": rot[name]}
        tensors[name] = t
    files, indexes = {}, {}
    for r in range(w.n):
        data_size, index_size, crc = sizes.get(r, (1 << 30, 1 << 18, r))
        files[data_file_name(SAVE_ID, f"r{r:05d}-00")] = FileMeta(data_size)
        files[index_file_name(SAVE_ID, r)] = FileMeta(index_size)
        indexes[index_file_name(SAVE_ID, r)] = IndexMeta(r, index_size, crc)
    meshes: List[Any] = ["iota"] + [list(g) for g in w.groups]
    return Manifest(world_size=w.n, tensors=tensors, files=files, values={"step": 1000}, save_id=SAVE_ID,
                    version=FORMAT_VERSION, block_bytes=BLOCK, meshes=meshes, indexes=indexes)


def load_plan(body: bytes, storage, live, rank: int) -> Tuple[int, int]:
    """A loading rank: parse the manifest, resolve every tensor it holds in one call, plan the pieces."""
    m = manifest_from_bytes(body)
    cache = MetaCache()
    # The live layout of every held tensor, in bulk: each distinct (layout, coordinate) once.
    held = _geometry.held_boxes(list(map(itemgetter(1), live)), list(map(itemgetter(2), live)))
    wants = [(name, boxes) for (name, _, _), boxes in zip(live, held) if boxes]
    # What ``_load.plan`` does: every tensor's chunks and read pieces in one call.
    reads = resolve_reads(m, storage, wants, cache=cache)
    pieces = sum(map(len, chain.from_iterable(map(attrgetter("pieces"), reads))))  # the pieces of every box, counted
    return pieces, cache.bytes_read


def _writers_of(live, lays, rot, w: World) -> List[int]:
    """Ranks whose index files a load of ``live`` reads (to learn their sizes and CRCs before the commit)."""
    out = set()
    for name, lay, coord in live:
        saved, mesh = lays[name]
        ranks = None if mesh == 0 else w.groups[mesh - 1]
        for lb in _geometry.local_boxes(lay.shape, lay.mesh_shape, lay.placements, coord):
            for s, _ in _geometry.chunks_overlapping(saved, lb.box):
                flat = 0
                for m, c in zip(saved.mesh_shape, _geometry.writer_coord(saved, rot[name], s)):
                    flat = flat * m + c
                out.add(flat if ranks is None else ranks[flat])
    return sorted(out)


CPU: Dict[str, float] = {}


def _timed(label: str, fn):
    """``bench_scale._timed`` (cold geometry caches, wall seconds), plus the process's CPU seconds in ``CPU``.

    On a shared, loaded machine the CPU seconds are the steadier figure (the
    wall clock counts the time other processes held the cores).
    """
    t0 = time.process_time()
    out = B._timed(fn)
    CPU[label] = time.process_time() - t0
    return out


def run(ranks: int, count: int, ep: int, tp: int, rank: int, reshard: bool) -> Dict[str, Any]:
    tensors = moe_tensors(count)
    w = World(ranks, ep, tp)
    lays = layouts(tensors, w)
    (mine, rot), save_s = _timed("save_plan", lambda: save_plan(lays, tensors, w, rank))
    live_same = held(lays, tensors, w, rank)
    out: Dict[str, Any] = {"ranks": ranks, "tensors": len(tensors), "held": len(live_same), "writes": len(mine), "save_plan_s": save_s}
    w2 = World(ranks // 2, ep // 2, tp) if reshard else None
    live_re = held(layouts(tensors, w2), tensors, w2, rank) if w2 else []
    # Index files the two loads read, made before the commit (their sizes and CRCs go in the manifest).
    blobs: Dict[int, bytes] = {}
    sizes: Dict[int, Tuple[int, int, int]] = {}
    for r in sorted(set(_writers_of(live_same, lays, rot, w)) | set(_writers_of(live_re, lays, rot, w) if w2 else [])):
        body, data = rank_index(lays, tensors, w, rot, r)
        blobs[r], sizes[r] = body, (data, len(body), crc32c(body))

    def commit():
        body = manifest_to_bytes(manifest(lays, w, rot, sizes))
        manifest_from_bytes(body)  # the validation any reader repeats
        return body

    body, out["commit_s"] = _timed("commit", commit)
    out["manifest_mb"] = len(body) / 1e6

    def serve(rel: str) -> bytes:
        return blobs[B._rank_of_index(rel)]

    storage = B._MemStorage(serve)
    (_, meta), out["load_plan_s"] = _timed("load_plan", lambda: load_plan(body, storage, live_same, rank))
    out["load_meta_mb"] = (len(body) + meta) / 1e6
    if w2:
        (_, meta), out["reshard_plan_s"] = _timed("reshard_plan", lambda: load_plan(body, storage, live_re, rank))
        out["reshard_held"] = len(live_re)
        out["reshard_meta_mb"] = (len(body) + meta) / 1e6
    out.update({f"{k}_cpu_s": v for k, v in CPU.items()})
    return out


def control_plane(ranks: int, count: int, ep: int, tp: int) -> Dict[str, Any]:
    """Rank 0's records and value tree of this state (the real ``_union.records``) through ``bench_control_plane.run``."""
    import bench_control_plane as CP
    import torch

    from shardckpt._format import tensor_ref
    from shardckpt._layout import TensorLayout
    from shardckpt._save import _rotations

    tensors = moe_tensors(count)
    w = World(ranks, ep, tp)
    lays = layouts(tensors, w)
    live = held(lays, tensors, w, 0)
    tl = {}
    for name, lay, coord in live:
        mesh = lays[name][1]
        names = ["dp", "tp"] if mesh == 0 else ["dp_mod_ep", "tp"]
        tl[name] = TensorLayout(
            name=name, dtype=DTYPE, torch_dtype=torch.bfloat16, shape=lay.shape, parts=[], holders={},
            layout_json={"mesh_shape": list(lay.mesh_shape), "mesh_dim_names": names, "placements": [repr(p) for p in lay.placements]},
            kind="dtensor", regular=lay, mesh_ranks=None if mesh == 0 else w.groups[mesh - 1], coord=coord,
        )
    from shardckpt import _union

    recs = _union.records(tl, _rotations(tl))
    params = [n[len("model."):] for n in tl if n.startswith("model.")]
    tree = {
        "model": {p: tensor_ref("model." + p) for p in params},
        "optim": {"state": {p: {"exp_avg": tensor_ref(f"optim.exp_avg.{p}"), "exp_avg_sq": tensor_ref(f"optim.exp_avg_sq.{p}")} for p in params},
                  "param_groups": [{"lr": 3e-4, "betas": [0.9, 0.95], "weight_decay": 0.1, "params": params}]},
        "step": 1000,
    }
    r = CP.run(ranks, records=(recs, tree))
    return {"cp_save_s": r["save_s"], "cp_load_s": r["load_s"], "cp_largest_kib": r["save_largest"] / 1024,
            "cp_payload_kib": r["payload_bytes"] / 1024, "cp_trips_root": r["save_trips_root"]}


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--ranks", default="1024,4096,16384")
    ap.add_argument("--tensors", type=int, default=50000)
    ap.add_argument("--ep", type=int, default=16)
    ap.add_argument("--tp", type=int, default=8)
    ap.add_argument("--rank", type=int, default=0)
    ap.add_argument("--no-reshard", dest="reshard", action="store_false", help="skip the load at half the ranks, EP / 2")
    ap.add_argument("--control-plane", action="store_true", help="also run the real agree() exchanges with this state's records")
    ap.add_argument("--json")
    ap.add_argument("--compare-with", metavar="DIR", default=None,
                    help="another tree's root (say the previous tip copied as _old/): run its benchmarks/bench_moe_scale.py and this "
                         "tree's alternately in fresh processes, --repeat times each, and print both trees' medians (give one --ranks)")
    ap.add_argument("--repeat", type=int, default=B.DEFAULT_REPEAT, help="runs of each tree with --compare-with")
    args = ap.parse_args(argv)
    if args.compare_with is not None:
        argv = list(sys.argv[1:] if argv is None else argv)
        return B.compare({"old": os.path.abspath(args.compare_with), "new": B.HERE}, B.comparison_args(argv), args.repeat,
                         bench="bench_moe_scale")
    rows = []
    for n in [int(x) for x in args.ranks.split(",")]:
        t0 = time.time()
        r = run(n, args.tensors, args.ep, args.tp, args.rank, args.reshard)
        if args.control_plane:
            r.update(control_plane(n, args.tensors, args.ep, args.tp))
        rows.append(r)
        print(" ".join(f"{k}={v:.3f}" if isinstance(v, float) else f"{k}={v}" for k, v in r.items()), f"(wall {time.time() - t0:.0f} s)", flush=True)
    if args.json:
        with open(args.json, "w") as f:
            json.dump(rows, f, indent=1)
    return 0


if __name__ == "__main__":
    sys.exit(main())
