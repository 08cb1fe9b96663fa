"""Planning that scales: linear-time tiling checks, shared file bytes, regular layouts.

Every new function is checked against the reference functions of ``_geometry``
(``local_boxes``, ``layout_holders``, ``check_cover``, ``plan_reads``) or a
brute-force paint of the tensor, with plain ints. Complexity is asserted as a
ratio of times between two sizes, never as an absolute time.
"""

from __future__ import annotations

import itertools
import math
import os
import random
import subprocess
import sys
import time

import numpy as np
import pytest

from shardckpt._geometry import (
    DEFAULT_OFFENDER_LIMIT,
    Box,
    LocalBox,
    RangeClash,
    Replicate,
    Shard,
    boxes_to_write,
    check_cover,
    chunks_overlapping,
    intersect,
    is_writer,
    layout_chunks,
    layout_from_json,
    layout_holders,
    layout_to_json,
    local_boxes,
    mesh_coord,
    mesh_coords,
    plan_reads,
    regular_layout,
    replica_count,
    replica_index,
    shard_count,
    shard_index,
    shared_byte_ranges,
    writer_coord,
    writer_rotations,
)

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

# --------------------------------------------------------------------------
# helpers


def _ratio(big, small, repeat=5) -> float:
    """CPU-time ratio ``big / small``, best of ``repeat`` interleaved runs each.

    Process CPU time, not wall time: other processes on a loaded machine
    delay a run without adding to it. Interleaving puts both sizes under the
    same conditions; the minimum is the least disturbed run (cache, GC).
    """
    best = {big: math.inf, small: math.inf}
    for _ in range(repeat):
        for fn in (small, big):
            t0 = time.process_time()
            fn()
            best[fn] = min(best[fn], time.process_time() - t0)
    return best[big] / max(best[small], 1e-9)


def _grid(shape):
    """One box per element: the crafted manifest of the tiling-check attack."""
    return [Box(tuple(c), (1,) * len(shape)) for c in itertools.product(*[range(n) for n in shape])]


def _paint(shape, boxes):
    count = np.zeros(shape, dtype=np.int64)
    for b in boxes:
        if any(o < 0 or n < 0 or o + n > s for o, n, s in zip(b.offsets, b.sizes, shape)):
            return False
        count[tuple(slice(o, o + n) for o, n in zip(b.offsets, b.sizes))] += 1
    return bool((count == 1).all())


def _guillotine(rng, box, depth):
    """Split ``box`` recursively along random dims at random points: a valid, usually non-grid, tiling."""
    if depth == 0 or rng.random() < 0.2:
        return [box]
    dims = [d for d, n in enumerate(box.sizes) if n > 1]
    if not dims:
        return [box]
    d = rng.choice(dims)
    cut = rng.randrange(1, box.sizes[d])
    lo_sizes = list(box.sizes)
    lo_sizes[d] = cut
    hi_offs = list(box.offsets)
    hi_offs[d] += cut
    hi_sizes = list(box.sizes)
    hi_sizes[d] -= cut
    return _guillotine(rng, Box(box.offsets, tuple(lo_sizes)), depth - 1) + _guillotine(
        rng, Box(tuple(hi_offs), tuple(hi_sizes)), depth - 1
    )


# --------------------------------------------------------------------------
# check_cover: linear time


def test_six_d_grid_of_one_element_chunks_is_linear():
    # The attack: a 6-D tensor stored as one-element chunks. The former
    # sweep compared every pair inside a slab (48 s for a 2 MB manifest).
    # 4^6 -> 6^6 is 11.4x the chunks: a quadratic check would take ~86x
    # longer, a linear one ~11-15x.
    small, big = _grid((4,) * 6), _grid((6,) * 6)
    assert check_cover((4,) * 6, small) is None and check_cover((6,) * 6, big) is None
    ratio = _ratio(lambda: check_cover((6,) * 6, big), lambda: check_cover((4,) * 6, small), 3)
    assert ratio < 40, f"check_cover grew {ratio:.1f}x for 11.4x the chunks"


def test_crafted_manifest_validates_in_linear_time():
    # The same attack through the format layer: a ~2 MB manifest.json of
    # one-element chunks, parsed and validated by manifest_from_bytes.
    from shardckpt._format import (
        ChunkMeta,
        FileMeta,
        Manifest,
        TensorMeta,
        manifest_from_bytes,
        manifest_to_bytes,
    )

    def manifest(side):
        shape = [side] * 6
        chunks = [
            ChunkMeta(file="d.safetensors", key=f"t@{i}", offsets=list(c), sizes=[1] * 6, byte_offset=4 * i, nbytes=4, crc32c=0)
            for i, c in enumerate(itertools.product(range(side), repeat=6))
        ]
        m = Manifest(world_size=1, tensors={"t": TensorMeta("F32", shape, chunks)}, files={"d.safetensors": FileMeta(4 * len(chunks))})
        return manifest_to_bytes(m)

    small, big = manifest(3), manifest(5)
    assert len(big) > 2_000_000  # the size of the reported attack
    assert len(manifest_from_bytes(big).tensors["t"].chunks) == 5**6
    ratio = _ratio(lambda: manifest_from_bytes(big), lambda: manifest_from_bytes(small), 2)
    # 21.4x the chunks: linear ~21-30x, the former check ~275x.
    assert ratio < 80, f"manifest validation grew {ratio:.1f}x for 21.4x the chunks"


def _brick_wall(rows, cols):
    """Rows of 2-wide bricks, every other row shifted by one: valid, not a product grid."""
    boxes = []
    for r in range(rows):
        c = 0
        if r % 2:
            boxes.append(Box((r, 0), (1, 1)))
            c = 1
        while c < cols:
            w = min(2, cols - c)
            boxes.append(Box((r, c), (1, w)))
            c += w
    return boxes


def test_non_grid_tiling_is_linear():
    # Brick walls take the general (signed-corner) path; 8x the bricks.
    small, big = _brick_wall(64, 64), _brick_wall(512, 64)
    assert check_cover((64, 64), small) is None and check_cover((512, 64), big) is None
    ratio = _ratio(lambda: check_cover((512, 64), big), lambda: check_cover((64, 64), small))
    assert ratio < 30, f"non-grid check grew {ratio:.1f}x for 8x the chunks"


def test_high_dim_guillotine_chain_stays_fast():
    # x0 < 1 | x0 >= 1, x1 < 1 | ...: 21 boxes in 20 dims. Without pruning and
    # memo the signed-corner recursion would visit 2^20 groups.
    nd = 20
    boxes = []
    for k in range(nd):
        offs = [1] * k + [0] + [0] * (nd - k - 1)
        sizes = [1] * k + [1] + [2] * (nd - k - 1)
        boxes.append(Box(tuple(offs), tuple(sizes)))
    boxes.append(Box((1,) * nd, (1,) * nd))
    t0 = time.perf_counter()
    assert check_cover((2,) * nd, boxes) is None
    boxes[-1] = Box((0,) * nd, (1,) * nd)  # the last corner stored twice, (1,..,1) never
    assert "overlap" in check_cover((2,) * nd, boxes)
    assert time.perf_counter() - t0 < 30  # guards against 2^20 blow-up only (a hang, not a timing)


@pytest.mark.parametrize("seed", range(80))
def test_general_path_agrees_with_brute_force(seed):
    rng = random.Random(seed)
    shape = tuple(rng.choice([2, 3, 4, 5, 7]) for _ in range(rng.choice([1, 2, 3, 4])))
    boxes = _guillotine(rng, Box((0,) * len(shape), shape), depth=8)
    if rng.random() < 0.6:
        i = rng.randrange(len(boxes))
        b = boxes[i]
        d = rng.randrange(len(shape))
        kind = rng.choice(["shift", "grow", "dup", "drop", "swap"])
        if kind == "shift":
            offs = list(b.offsets)
            offs[d] += rng.choice([-1, 1])
            boxes[i] = Box(tuple(offs), b.sizes)
        elif kind == "grow":
            sizes = list(b.sizes)
            sizes[d] = max(0, sizes[d] + rng.choice([-1, 1]))
            boxes[i] = Box(b.offsets, tuple(sizes))
        elif kind == "dup":
            boxes.append(b)
        elif kind == "drop":
            boxes.pop(i)
        elif len(boxes) > 1:
            # keep the volume, move a box onto another: overlap plus gap
            j = (i + 1) % len(boxes)
            if boxes[j].sizes == b.sizes:
                boxes[i] = boxes[j]
    rng.shuffle(boxes)
    why = check_cover(shape, boxes)
    assert (why is None) == _paint(shape, boxes), (shape, boxes, why)
    if why is not None and sum(b.numel for b in boxes) == math.prod(shape) and "outside" not in why:
        assert "overlap" in why, why


def test_overlap_message_names_the_pair():
    # Right volume, one brick moved onto its neighbour: non-grid, so the
    # general path decides and the message names the two chunks.
    boxes = _brick_wall(4, 6)
    boxes[1] = Box((0, 0), (1, 2))  # duplicate of boxes[0]; (0, 2)-(0, 3) left empty
    why = check_cover((4, 6), boxes)
    assert why == "chunks Box(offsets=(0, 0), sizes=(1, 2)) and Box(offsets=(0, 0), sizes=(1, 2)) overlap", why
    crossing = [Box((0, 0), (2, 2)), Box((1, 1), (2, 2)), Box((2, 0), (1, 1)), Box((1, 0), (0, 3))]  # 9 elements, (0, 2) empty
    assert check_cover((3, 3), crossing) == f"chunks {crossing[0]} and {crossing[1]} overlap"


# --------------------------------------------------------------------------
# file byte ranges claimed twice


def test_shared_byte_ranges_basics_and_docstring():
    assert shared_byte_ranges([("a", 0, 8, "x"), ("a", 4, 8, "y"), ("b", 4, 8, "z")]) == [RangeClash("a", "x", "y", 4, 8)]
    # adjacent ranges share no byte; empty ranges claim nothing
    assert shared_byte_ranges([("a", 0, 8, "x"), ("a", 8, 8, "y"), ("a", 4, 0, "e")]) == []
    # a range nested in a long one, reported against the long one
    assert shared_byte_ranges([("f", 0, 100, "long"), ("f", 10, 5, "in"), ("f", 50, 5, "in2")]) == [
        RangeClash("f", "long", "in", 10, 15),
        RangeClash("f", "long", "in2", 50, 55),
    ]
    # the same range twice (a chunk copied under two names), whatever the input order
    got = shared_byte_ranges([("f", 16, 4, "b"), ("f", 16, 4, "a")])
    assert len(got) == 1 and {got[0].first, got[0].second} == {"a", "b"} and (got[0].start, got[0].stop) == (16, 20)
    # same offsets in different files do not clash
    assert shared_byte_ranges([("f", 0, 4, 1), ("g", 0, 4, 2)]) == []


def test_shared_byte_ranges_is_capped():
    ranges = [("f", 0, 10**6, "big")] + [("f", 8 * i, 8, f"c{i}") for i in range(1000)]
    got = shared_byte_ranges(ranges)
    assert len(got) == DEFAULT_OFFENDER_LIMIT
    assert len(shared_byte_ranges(ranges, limit=3)) == 3


@pytest.mark.parametrize("seed", range(30))
def test_shared_byte_ranges_agrees_with_brute_force(seed):
    rng = random.Random(seed)
    ranges = [(rng.choice("fg"), rng.randrange(0, 200), rng.choice([0, 1, 4, 8, 16, 40]), i) for i in range(rng.randrange(1, 40))]
    got = shared_byte_ranges(ranges, limit=10**6)
    order = sorted((r for r in ranges if r[2] > 0), key=lambda r: (r[0], r[1], r[2], r[3]))
    want = set()
    for j, (f, s, n, lab) in enumerate(order):
        for f2, s2, n2, _ in order[:j]:
            if f2 == f and s2 < s + n and s < s2 + n2:
                want.add(lab)
    assert {c.second for c in got} == want
    for c in got:
        a = ranges[c.first]
        b = ranges[c.second]
        assert a[0] == b[0] == c.file and c.start < c.stop
        assert max(a[1], b[1]) <= c.start and c.stop <= min(a[1] + a[2], b[1] + b[2])


def test_shared_byte_ranges_is_fast_on_a_big_manifest():
    # 4,096 ranks x 1,000 tensors of claims, all disjoint: one sort, one sweep.
    ranges = [(f"r{r}", 1024 * t, 1024, (r, t)) for r in range(512) for t in range(200)]
    assert shared_byte_ranges(ranges) == []


# --------------------------------------------------------------------------
# regular layouts against the reference functions


def _cases(n, seed):
    rng = random.Random(seed)
    out = set()
    while len(out) < n:
        ndim = rng.choice([0, 1, 1, 2, 2, 3])
        shape = tuple(rng.choice([1, 2, 3, 5, 7, 8, 13]) for _ in range(ndim))
        mesh = tuple(rng.choice([1, 2, 3, 4]) for _ in range(rng.choice([1, 1, 2, 2, 3])))
        pl = [Replicate() if ndim == 0 or rng.random() < 0.3 else Shard(rng.randrange(ndim)) for _ in mesh]
        out.add((shape, mesh, tuple(pl)))
        # FSDP over TP: the leftmost Shard(d) becomes strided when later mesh dims shard d too
        for i, p in enumerate(pl):
            if isinstance(p, Shard):
                sf = math.prod(mesh[j] for j in range(i + 1, len(pl)) if isinstance(pl[j], Shard) and pl[j].dim == p.dim)
                if sf > 1:
                    strided = list(pl)
                    strided[i] = Shard(p.dim, sf)
                    out.add((shape, mesh, tuple(strided)))
                break
    return sorted(out, key=repr)


HAND = [
    ((3,), (8,), (Shard(0),)),  # zero-row ranks
    ((1, 5), (4,), (Shard(0),)),
    ((37, 7), (2, 2), (Shard(0, 2), Shard(0))),  # DESIGN.md FSDP+TP ColwiseParallel
    ((7, 37), (2, 2), (Shard(0), Shard(1))),  # RowwiseParallel
    ((9,), (4, 2), (Shard(0, 2), Shard(0))),  # strided: several boxes per rank
    ((11, 4), (2, 2, 2), (Shard(0, 4), Shard(0), Shard(0))),
    ((13, 6), (2, 3, 2), (Shard(0, 2), Shard(1), Shard(0))),
    ((7, 5), (2, 3), (Replicate(), Shard(1))),  # HSDP
    ((7, 5), (3, 2), (Replicate(), Replicate())),  # DDP
    ((3, 37, 7), (2, 2, 2), (Replicate(), Shard(1, 2), Shard(1))),  # a copy dim in front of FSDP+TP
    ((0,), (3,), (Shard(0),)),
    ((4, 0), (2, 2), (Shard(0), Shard(1))),
    ((), (3,), (Replicate(),)),
]
CASES = HAND + _cases(140, seed=99)


def _ids(c):
    return f"{list(c[0])}-{list(c[1])}-{'/'.join(repr(p) for p in c[2])}"


def _rank(mesh, coord):
    r = 0
    for m, c in zip(mesh, coord):
        r = r * m + c
    return r


@pytest.mark.parametrize("case", CASES, ids=[_ids(c) for c in CASES])
def test_regular_layout_matches_reference(case):
    shape, mesh, pl = case
    lay = regular_layout(shape, mesh, pl)
    assert layout_from_json(layout_to_json(lay)) == lay
    world = math.prod(mesh)
    assert shard_count(lay) * replica_count(lay) == world
    holders = layout_holders(shape, list(range(world)), mesh, pl)
    # Same boxes, same holders, derived per shard index without enumerating ranks.
    derived = {}
    for s, boxes in layout_chunks(lay):
        rs = tuple(sorted(_rank(mesh, mesh_coord(lay, s, r)) for r in range(replica_count(lay))))
        for b in boxes:
            assert b not in derived, b
            derived[b] = rs
    assert derived == holders
    for coord in mesh_coords(mesh):
        s, r = shard_index(lay, coord), replica_index(lay, coord)
        assert mesh_coord(lay, s, r) == tuple(coord)
        assert [lb.box for lb in local_boxes(shape, mesh, pl, coord)] == dict(layout_chunks(lay))[s]


def _writes(tensors, rotations, mesh):
    """{(name, box): [writer ranks]} and bytes written per rank."""
    written, load = {}, [0] * math.prod(mesh)
    for name, lay, size in tensors:
        for coord in mesh_coords(mesh):
            for lb in boxes_to_write(lay, rotations[name], coord):
                written.setdefault((name, lb.box), []).append(_rank(mesh, coord))
                load[_rank(mesh, coord)] += lb.box.numel * size
    return written, load


@pytest.mark.parametrize("case", CASES, ids=[_ids(c) for c in CASES])
def test_exactly_one_writer_per_box(case):
    shape, mesh, pl = case
    lay = regular_layout(shape, mesh, pl)
    world = math.prod(mesh)
    holders = layout_holders(shape, list(range(world)), mesh, pl)
    # A few tensors of this layout so rotations other than 0 are exercised.
    tensors = [(f"t{i}", lay, 4) for i in range(3)]
    rot = writer_rotations(tensors)
    written, _ = _writes(tensors, rot, mesh)
    for name, _, _ in tensors:
        mine = {b: w for (n, b), w in written.items() if n == name}
        assert set(mine) == set(holders), (name, sorted(mine, key=repr))
        for b, ws in mine.items():
            assert len(ws) == 1 and ws[0] in holders[b], (b, ws)
            s = shard_index(lay, _coord_of(mesh, ws[0]))
            assert _rank(mesh, writer_coord(lay, rot[name], s)) == ws[0]
        if 0 not in shape:
            assert check_cover(shape, list(mine)) is None


def _coord_of(mesh, rank):
    coord = []
    for m in reversed(mesh):
        rank, c = divmod(rank, m)
        coord.append(c)
    return tuple(reversed(coord))


@pytest.mark.parametrize(
    "mesh, pl",
    [
        ((8,), (Replicate(),)),  # DDP
        ((4, 2), (Replicate(), Shard(0))),  # HSDP
        ((2, 2, 2), (Replicate(), Shard(0, 2), Shard(0))),  # HSDP over FSDP+TP
        ((3, 4), (Shard(1), Replicate())),
    ],
)
@pytest.mark.parametrize("seed", range(4))
@pytest.mark.parametrize("even", [True, False])
def test_replicated_bytes_balanced(mesh, pl, seed, even):
    rng = random.Random(seed)
    dims_needed = 1 + max((p.dim for p in pl if isinstance(p, Shard)), default=0)
    sizes = [12, 24, 48, 96, 192] if even else [5, 8, 13, 24, 97]
    tensors = []
    for i in range(rng.randrange(8, 40)):
        shape = tuple(rng.choice(sizes) * rng.choice([1, 1, 4, 16]) for _ in range(dims_needed))
        tensors.append((f"p{i:02d}", regular_layout(shape, mesh, pl), rng.choice([2, 4])))
    rot = writer_rotations(tensors)
    written, load = _writes(tensors, rot, mesh)
    some = tensors[0][1]
    biggest = {}
    for _name, lay, size in tensors:
        for s, boxes in layout_chunks(lay):
            biggest[s] = max(biggest.get(s, 0), sum(b.numel for b in boxes) * size)
    # Co-holders (ranks of one shard coordinate) write within one box of each
    # other when the shapes divide evenly (the round-robin bound is exact);
    # uneven tails reorder boxes a little, within a second box.
    for s in range(shard_count(some)):
        ranks = [_rank(mesh, mesh_coord(some, s, r)) for r in range(replica_count(some))]
        got = [load[r] for r in ranks]
        assert max(got) - min(got) <= (1 if even else 2) * biggest[s], (s, got, biggest[s])
        if len(tensors) >= len(ranks):
            assert min(got) > 0
    # Every rank computes the same rotations whatever order it lists the tensors in.
    shuffled = tensors[:]
    rng.shuffle(shuffled)
    assert writer_rotations(shuffled) == rot


def test_balance_as_good_as_the_greedy_reference():
    # DDP-style: 60 whole tensors on 8 ranks. The per-rank rule must not be
    # materially worse than assign_writers, which sees every box at once.
    from shardckpt._geometry import assign_writers

    rng = random.Random(5)
    mesh = (8,)
    tensors = [(f"w{i:02d}", regular_layout((rng.randrange(1, 4000),), mesh, (Replicate(),)), 4) for i in range(60)]
    _, load = _writes(tensors, writer_rotations(tensors), mesh)
    ref = [0] * 8
    items = [(n, lay.shape[0] * 4, tuple(range(8))) for n, lay, _ in tensors]
    for key, w in assign_writers(items).items():
        ref[w] += {n: b for n, b, _ in items}[key]
    largest = max(b for _, b, _ in items)
    assert max(load) - min(load) <= largest
    assert max(load) <= max(ref) + largest


def test_writer_rule_for_uneven_and_zero_row_ranks():
    # 3 rows on 2 replicas x 4 shards: shards 2 and 3 hold nothing, nobody writes for them.
    lay = regular_layout((3, 2), (2, 4), (Replicate(), Shard(0)))
    rot = writer_rotations([("w", lay, 4)])["w"]
    writers = {}
    for coord in mesh_coords((2, 4)):
        for lb in boxes_to_write(lay, rot, coord):
            writers[lb.box] = coord
    assert sorted(writers, key=lambda b: b.offsets) == [Box((0, 0), (1, 2)), Box((1, 0), (1, 2)), Box((2, 0), (1, 2))]
    # replicas alternate along the shard index: (rotation + s) % 2
    assert [writers[b][0] for b in sorted(writers, key=lambda b: b.offsets)] == [0, 1, 0]
    assert not is_writer(lay, rot, (1, 0)) and is_writer(lay, rot, (1, 1))


@pytest.mark.parametrize(
    "obj, msg",
    [
        ([], "must be an object"),
        ({"shape": [4], "mesh_shape": [2]}, "'placements'"),
        ({"shape": [4], "mesh_shape": [2], "placements": ["S(1)"]}, "shards dim 1"),
        ({"shape": [4], "mesh_shape": [0], "placements": ["R"]}, "each >= 1"),
        ({"shape": [4], "mesh_shape": [2], "placements": ["P"]}, "is not 'R'"),
        ({"shape": [4], "mesh_shape": [2], "placements": ["S(0,sf=0)"]}, "1 <= split_factor <= 2"),
        ({"shape": [4], "mesh_shape": [2], "placements": ["S(0,sf=99999999)"]}, "the mesh size"),
        ({"shape": [True], "mesh_shape": [2], "placements": ["R"]}, "must hold ints"),
        ({"shape": [4], "mesh_shape": [1 << 13, 1 << 13], "placements": ["R", "R"]}, "more than"),
        ({"shape": [4], "mesh_shape": [2, 2], "placements": ["R"]}, "needs as many placements"),
    ],
)
def test_layout_from_json_rejects_bad_records(obj, msg):
    with pytest.raises(ValueError, match=msg):
        layout_from_json(obj)


# --------------------------------------------------------------------------
# chunks a wanted box overlaps, without materialising all chunks


@pytest.mark.parametrize("case", CASES, ids=[_ids(c) for c in CASES])
def test_chunks_overlapping_matches_brute_force(case):
    shape, mesh, pl = case
    lay = regular_layout(shape, mesh, pl)
    index_of = {b: s for s, boxes in layout_chunks(lay) for b in boxes}
    saved = list(index_of)
    rng = random.Random(repr(case))
    wanted = []
    for _ in range(12):
        offs, sizes = [], []
        for n in shape:
            o = rng.randrange(0, n + 1)
            offs.append(o)
            sizes.append(rng.randrange(0, n - o + 1))
        wanted.append(Box(tuple(offs), tuple(sizes)))
    wanted.append(Box((0,) * len(shape), tuple(shape)))
    for w in wanted:
        got = chunks_overlapping(lay, w)
        want = sorted(((index_of[b], b) for b in saved if b.numel and w.numel and intersect(b, w)), key=lambda t: t[1].offsets)
        assert got == want, (w, got, want)


@pytest.mark.parametrize("seed", range(40))
def test_regular_read_plans_reshard_exactly(seed):
    # N -> M resharding with the loader seeing only the overlapping chunks:
    # the pieces fill every wanted element exactly once, from the right place.
    rng = random.Random(seed)
    case_save = rng.choice(CASES)
    shape = case_save[0]
    if 0 in shape or not shape:
        return
    lay = regular_layout(*case_save)
    global_a = np.arange(math.prod(shape)).reshape(shape)
    load_mesh = tuple(rng.choice([1, 2, 3, 4]) for _ in range(rng.choice([1, 2])))
    load_pl = tuple(Shard(rng.randrange(len(shape))) if rng.random() < 0.7 else Replicate() for _ in load_mesh)
    for coord in mesh_coords(load_mesh):
        wanted = local_boxes(shape, load_mesh, load_pl, coord)
        for lb in wanted:
            hits = chunks_overlapping(lay, lb.box)
            pieces = plan_reads([b for _, b in hits], [LocalBox(lb.box, (0,) * len(shape))])
            dst = np.full(lb.box.sizes, -1)
            for p in pieces:
                src = hits[p.chunk][1]
                block = global_a[tuple(slice(o, o + n) for o, n in zip(src.offsets, src.sizes))]
                dst[tuple(slice(o, o + n) for o, n in zip(p.dst_offsets, p.sizes))] = block[
                    tuple(slice(o, o + n) for o, n in zip(p.src_offsets, p.sizes))
                ]
            assert (dst == global_a[tuple(slice(o, o + n) for o, n in zip(lb.box.offsets, lb.box.sizes))]).all()


def test_same_layout_reload_touches_one_chunk_per_rank():
    # 4,096-rank FSDP save loaded at 4,096 ranks: each rank's box meets one chunk.
    lay = regular_layout((128256, 4096), (4096,), (Shard(0),))
    for rank in (0, 1, 2047, 4007):  # 32 rows a rank: ranks 4008.. hold none
        (lb,) = local_boxes(lay.shape, lay.mesh_shape, lay.placements, (rank,))
        assert chunks_overlapping(lay, lb.box) == [(rank, lb.box)]
    assert local_boxes(lay.shape, lay.mesh_shape, lay.placements, (4095,)) == []
    # 4,096 -> 1,000 ranks: at most ceil(4096/1000) + 1 chunks a rank
    (lb,) = local_boxes(lay.shape, (1000,), (Shard(0),), (517,))
    assert len(chunks_overlapping(lay, lb.box)) <= 6


# --------------------------------------------------------------------------
# per-rank planning: cost independent of the world size


def _llama_layouts(world, tensors=200):
    from itertools import cycle

    shapes = cycle([(4096, 4096), (1024, 4096), (1024, 4096), (4096, 4096), (14336, 4096), (14336, 4096), (4096, 14336), (4096,), (4096,)])
    return [(f"layers.{i // 9}.p{i % 9}", regular_layout(next(shapes), (world,), (Shard(0),)), 2) for i in range(tensors)]


def _plan_one_rank(layouts, rank):
    rot = writer_rotations(layouts)
    n = 0
    for name, lay, _ in layouts:
        n += len(boxes_to_write(lay, rot[name], (rank,)))
    return n


def test_per_rank_save_planning_does_not_grow_with_ranks():
    small, big = _llama_layouts(64), _llama_layouts(512)
    assert _plan_one_rank(small, 5) == _plan_one_rank(big, 5) == 200
    ratio = _ratio(lambda: _plan_one_rank(big, 5), lambda: _plan_one_rank(small, 5))
    # 8x the ranks; the former planning (all boxes of all ranks) grows ~8x.
    assert ratio < 3, f"per-rank planning grew {ratio:.1f}x for 8x the ranks"


def test_bench_scale_runs_and_prints_the_line():
    script = os.path.join(ROOT, "benchmarks", "bench_scale.py")
    for layout in ("fsdp", "fsdp-tp"):
        for planner in ("v1", "v2"):
            proc = subprocess.run(
                [sys.executable, script, "--ranks", "16", "--tensors", "20", "--layout", layout, "--planner", planner],
                cwd=ROOT, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, timeout=300,
            )
            assert proc.returncode == 0, proc.stdout[-3000:]
            last = proc.stdout.strip().splitlines()[-1]
            fields = dict(kv.split("=") for kv in last.split())
            first = ["ranks", "tensors", "layout", "save_plan_s", "commit_s", "manifest_mb", "load_plan_s", "load_meta_mb"]
            cpu = ["save_plan_cpu_s", "commit_cpu_s", "load_plan_cpu_s"] if planner == "v2" else []
            assert list(fields) == first + cpu, last
            assert (fields["ranks"], fields["tensors"], fields["layout"]) == ("16", "20", layout)
            assert float(fields["manifest_mb"]) > 0 and float(fields["load_meta_mb"]) > 0


# --------------------------------------------------------------------------
# load planning: geometry once per distinct layout, not once per tensor


def test_geometry_is_computed_once_per_distinct_layout(monkeypatch):
    # 900 tensors of a 9-layout model (FSDP+TP, 4,096 ranks): a loading rank's
    # boxes and the saved chunks meeting them are split out once per layout.
    from shardckpt import _geometry

    calls = []
    real = _geometry.dim_intervals
    monkeypatch.setattr(_geometry, "dim_intervals", lambda *a: calls.append(a) or real(*a))
    _geometry.clear_geometry_caches()
    shapes = [((4096, 4096), "col"), ((1024, 4096), "col"), ((4096, 14336), "row"), ((4096,), "none")]
    mesh = (512, 8)
    pls = {"col": (Shard(0, 8), Shard(0)), "row": (Shard(0), Shard(1)), "none": (Shard(0), Replicate())}
    pieces = 0
    for i in range(900):
        shape, style = shapes[i % len(shapes)]
        lay = regular_layout(shape, mesh, pls[style])
        for lb in local_boxes(shape, mesh, pls[style], (3, 5)):
            hits = chunks_overlapping(lay, lb.box)
            pieces += len(plan_reads([b for _, b in hits], [LocalBox(lb.box, (0,) * len(shape))]))
    assert pieces == 900
    # regular_layout validates with one split per layout, local_boxes one per (layout, coord)
    assert len(calls) <= 2 * len(shapes), len(calls)
    # The lists handed out are the caller's: changing one changes no later answer.
    got = local_boxes((4096,), mesh, pls["none"], (3, 5))
    got.clear()
    assert len(local_boxes((4096,), mesh, pls["none"], (3, 5))) == 1
    # Unhashable arguments still work (computed, not memoized).
    assert local_boxes([8], [2], [Shard(0)], [1]) == [LocalBox(Box((4,), (4,)), (0,))]


def test_bad_layouts_are_refused_every_time():
    # A failure is never memoized as an answer.
    for _ in range(2):
        with pytest.raises(ValueError, match="shards dim 1"):
            regular_layout((4,), (2,), (Shard(1),))
