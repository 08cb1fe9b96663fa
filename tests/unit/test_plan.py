"""Pure geometry (``shardckpt._geometry``) with plain ints.

torch appears only as an oracle: its own placement split functions tell what
a DTensor's local tensor really holds, and ``_geometry`` must agree with them.
"""

from __future__ import annotations

import random

import numpy as np
import pytest

from shardckpt._geometry import (
    Box,
    LocalBox,
    Replicate,
    Shard,
    assign_writers,
    check_cover,
    chunk_bounds,
    dim_intervals,
    fsdp_boxes,
    layout_holders,
    local_boxes,
    mesh_coords,
    plan_reads,
    split_box,
)

# --------------------------------------------------------------------------
# case generation (deterministic)


def _random_placements(rng: random.Random, ndim: int, mesh_ndim: int):
    out = []
    for _ in range(mesh_ndim):
        if ndim == 0 or rng.random() < 0.25:
            out.append(Replicate())
        else:
            out.append(Shard(rng.randrange(ndim)))
    # Strided shards exist where FSDP shards a dim that mesh dims to the right
    # (TP) shard too: split_factor = product of those mesh dims.
    return out


def _strided(placements, mesh_shape):
    """Turn the leftmost Shard(d) into a strided one when later mesh dims shard d too."""
    out = list(placements)
    for i, p in enumerate(out):
        if isinstance(p, Shard):
            sf = 1
            for j in range(i + 1, len(out)):
                if isinstance(out[j], Shard) and out[j].dim == p.dim:
                    sf *= mesh_shape[j]
            if sf > 1:
                out[i] = Shard(p.dim, sf)
                return out
    return None


def _cases(n: int, seed: int):
    rng = random.Random(seed)
    cases = set()
    while len(cases) < n:
        ndim = rng.choice([0, 1, 1, 2, 2, 3])
        shape = tuple(rng.choice([1, 2, 3, 5, 7, 8, 13]) for _ in range(ndim))
        mesh_ndim = rng.choice([1, 1, 2, 2, 3])
        mesh_shape = tuple(rng.choice([1, 2, 3, 4]) for _ in range(mesh_ndim))
        placements = _random_placements(rng, ndim, mesh_ndim)
        cases.add((shape, mesh_shape, tuple(placements)))
        s = _strided(placements, mesh_shape)
        if s is not None:
            cases.add((shape, mesh_shape, tuple(s)))
    return sorted(cases, key=repr)


HAND_CASES = [
    # dims smaller than the world size: ranks with zero rows
    ((3,), (8,), (Shard(0),)),
    ((1, 5), (4,), (Shard(0),)),
    ((2, 3), (2, 4), (Shard(0), Shard(1))),
    # every dim of a 3-d tensor
    ((5, 6, 7), (3,), (Shard(0),)),
    ((5, 6, 7), (3,), (Shard(1),)),
    ((5, 6, 7), (3,), (Shard(2),)),
    # replicate + shard (HSDP-like), shard + replicate
    ((7, 5), (2, 3), (Replicate(), Shard(1))),
    ((7, 5), (2, 3), (Shard(0), Replicate())),
    ((7, 5), (2, 2), (Replicate(), Replicate())),
    # the same dim sharded twice, left to right
    ((37, 3), (2, 2), (Shard(0), Shard(0))),
    # DESIGN.md: FSDP+TP on a 2x2 mesh, 37 rows
    ((37, 7), (2, 2), (Shard(0, 2), Shard(0))),
    ((7, 37), (2, 2), (Shard(0), Shard(1))),
    # strided shards of uneven dims: several boxes per rank
    ((9,), (4, 2), (Shard(0, 2), Shard(0))),
    ((5, 2), (3, 2), (Shard(0, 2), Shard(0))),
    ((11,), (2, 3), (Shard(0, 3), Shard(0))),
    ((11, 4), (2, 2, 2), (Shard(0, 4), Shard(0), Shard(0))),
    ((13, 6), (2, 3, 2), (Shard(0, 2), Shard(1), Shard(0))),
    # zero-size tensors
    ((0,), (3,), (Shard(0),)),
    ((4, 0), (2, 2), (Shard(0), Shard(1))),
    # 0-d
    ((), (3,), (Replicate(),)),
]

CASES = HAND_CASES + _cases(160, seed=1234)


def _ids(case):
    shape, mesh, pl = case
    return f"{list(shape)}-{list(mesh)}-{'/'.join(repr(p) for p in pl)}"


def _replicas(mesh_shape, placements) -> int:
    n = 1
    for m, p in zip(mesh_shape, placements):
        if isinstance(p, Replicate):
            n *= m
    return n


# --------------------------------------------------------------------------
# chunk_bounds


@pytest.mark.parametrize("n", list(range(0, 41)) + [97, 1000])
def test_chunk_bounds_matches_torch_chunk(n):
    import torch

    idx = torch.arange(n)
    for k in range(1, 10):
        parts = list(torch.chunk(idx, k))
        # torch.chunk returns fewer parts when they run out; the rest are empty.
        starts = []
        pos = 0
        for i in range(k):
            size = len(parts[i]) if i < len(parts) else 0
            starts.append((pos, pos + size))
            pos += size
        assert pos == n
        for i in range(k):
            assert chunk_bounds(n, k, i) == starts[i], (n, k, i)
            if i < len(parts) and len(parts[i]):
                assert parts[i][0].item() == starts[i][0]


@pytest.mark.parametrize("args", [(5, 0, 0), (5, 2, 2), (5, 2, -1), (0, -1, 0)])
def test_chunk_bounds_rejects_bad_index(args):
    with pytest.raises(ValueError, match="out of range"):
        chunk_bounds(*args)


# --------------------------------------------------------------------------
# local_boxes / dim_intervals


def _coverage(shape, mesh_shape, placements):
    """Times each element is held, summed over all mesh coordinates."""
    count = np.zeros(shape, dtype=np.int64)
    for coord in mesh_coords(mesh_shape):
        for lb in local_boxes(shape, mesh_shape, placements, coord):
            sl = tuple(slice(o, o + n) for o, n in zip(lb.box.offsets, lb.box.sizes))
            count[sl] += 1
    return count


@pytest.mark.parametrize("case", CASES, ids=[_ids(c) for c in CASES])
def test_local_boxes_tile_the_tensor(case):
    shape, mesh_shape, placements = case
    if 0 in shape:
        # Zero-size tensors: every rank has the one canonical empty box.
        for coord in mesh_coords(mesh_shape):
            (lb,) = local_boxes(shape, mesh_shape, placements, coord)
            assert lb.box == Box((0,) * len(shape), shape)
        return
    count = _coverage(shape, mesh_shape, placements)
    # Each element is held by exactly the ranks of the replicated mesh dims.
    assert (count == _replicas(mesh_shape, placements)).all()
    for coord in mesh_coords(mesh_shape):
        lbs = local_boxes(shape, mesh_shape, placements, coord)
        assert all(lb.box.numel > 0 for lb in lbs)
        if not lbs:
            continue
        # The local boxes tile the local tensor too (their local offsets).
        local_shape = tuple(sum(n for _, n in ivs) for ivs in dim_intervals(shape, mesh_shape, placements, coord))
        why = check_cover(local_shape, [Box(lb.local_offsets, lb.box.sizes) for lb in lbs])
        assert why is None, why


def _torch_local(global_t, mesh_shape, placements, coord):
    """What torch puts in a DTensor's local tensor: its placements applied left to right."""
    from torch.distributed.tensor import Shard as TShard
    from torch.distributed.tensor.placement_types import _StridedShard

    local = global_t
    for md, p in enumerate(placements):
        if isinstance(p, Replicate):
            continue
        tp = TShard(p.dim) if p.split_factor == 1 else _StridedShard(p.dim, split_factor=p.split_factor)
        shards, _ = tp._split_tensor(local, mesh_shape[md], with_padding=False)
        local = shards[coord[md]]
    return local


@pytest.mark.parametrize("case", CASES, ids=[_ids(c) for c in CASES])
def test_local_boxes_match_torch_placements(case):
    import torch

    shape, mesh_shape, placements = case
    numel = int(np.prod(shape)) if shape else 1
    global_t = torch.arange(numel).reshape(shape)
    for coord in mesh_coords(mesh_shape):
        want = _torch_local(global_t, mesh_shape, placements, coord)
        lbs = local_boxes(shape, mesh_shape, placements, coord)
        if want.numel() == 0:
            assert all(lb.box.numel == 0 for lb in lbs), (coord, lbs)
            continue
        got = torch.full(tuple(want.shape), -1, dtype=global_t.dtype)
        for lb in lbs:
            src = global_t[tuple(slice(o, o + n) for o, n in zip(lb.box.offsets, lb.box.sizes))]
            got[tuple(slice(o, o + n) for o, n in zip(lb.local_offsets, lb.box.sizes))] = src
        assert torch.equal(got, want), (coord, lbs)


def test_fsdp_tp_example_from_design():
    # ColwiseParallel weight, 37 rows, (dp, tp) = 2x2: TP cuts 19 + 18 rows,
    # then FSDP cuts each TP piece: 10 + 9 and 9 + 9.
    mesh, pl = (2, 2), (Shard(0, 2), Shard(0))
    got = {c: [lb.box for lb in local_boxes((37, 7), mesh, pl, c)] for c in mesh_coords(mesh)}
    assert got == {
        (0, 0): [Box((0, 0), (10, 7))],
        (1, 0): [Box((10, 0), (9, 7))],
        (0, 1): [Box((19, 0), (9, 7))],
        (1, 1): [Box((28, 0), (9, 7))],
    }
    # The independent view: TP chunks first, then FSDP chunks each TP piece.
    rows = list(range(37))
    for dp, tp in mesh_coords(mesh):
        tp_lo, tp_hi = chunk_bounds(37, 2, tp)
        piece = rows[tp_lo:tp_hi]
        lo, hi = chunk_bounds(len(piece), 2, dp)
        (box,) = got[(dp, tp)]
        assert list(range(box.offsets[0], box.offsets[0] + box.sizes[0])) == piece[lo:hi]
    # RowwiseParallel weight: FSDP shards rows, TP shards columns.
    rw = {c: [lb.box for lb in local_boxes((37, 7), mesh, (Shard(0), Shard(1)), c)] for c in mesh_coords(mesh)}
    assert rw == {
        (0, 0): [Box((0, 0), (19, 4))],
        (0, 1): [Box((0, 4), (19, 3))],
        (1, 0): [Box((19, 0), (18, 4))],
        (1, 1): [Box((19, 4), (18, 3))],
    }


def test_strided_shard_gives_several_boxes():
    # torch's own example: 9 rows, split_factor 2, 4 chunks -> rank 0 holds rows 0, 1, 5.
    lbs = local_boxes((9,), (4,), (Shard(0, 2),), (0,))
    assert [(lb.box, lb.local_offsets) for lb in lbs] == [(Box((0,), (2,)), (0,)), (Box((5,), (1,)), (2,))]
    assert [lb.box for lb in local_boxes((9,), (4,), (Shard(0, 2),), (3,))] == [Box((8,), (1,))]


def test_local_boxes_zero_rows_and_docstring():
    assert [lb.box for lb in local_boxes((5, 3), (2,), (Shard(0),), (1,))] == [Box((3, 0), (2, 3))]
    # 3 rows on 8 ranks: ranks 3..7 hold nothing.
    held = [len(local_boxes((3,), (8,), (Shard(0),), (r,))) for r in range(8)]
    assert held == [1, 1, 1, 0, 0, 0, 0, 0]


@pytest.mark.parametrize(
    "args, msg",
    [
        (((4,), (2, 2), (Shard(0),), (0, 0)), "needs as many placements"),
        (((4,), (2,), (Shard(0),), (0, 0)), "needs as many placements"),
        (((4,), (2,), (Shard(1),), (0,)), "shards dim 1 of a 1-d tensor"),
        (((4,), (2,), ("Partial",), (0,)), "unsupported placement"),
    ],
)
def test_dim_intervals_rejects_bad_input(args, msg):
    with pytest.raises(ValueError, match=msg):
        dim_intervals(*args)


# --------------------------------------------------------------------------
# holders and writer assignment


@pytest.mark.parametrize("case", CASES[:80], ids=[_ids(c) for c in CASES[:80]])
def test_layout_holders(case):
    shape, mesh_shape, placements = case
    world = int(np.prod(mesh_shape))
    ranks = [10 + r for r in range(world)]  # global ranks need not start at 0
    holders = layout_holders(shape, ranks, mesh_shape, placements)
    for box, hs in holders.items():
        assert list(hs) == sorted(set(hs))
        assert set(hs) <= set(ranks)
        if box.numel:
            assert len(hs) == _replicas(mesh_shape, placements)
    if 0 not in shape:
        assert check_cover(shape, list(holders)) is None


def test_layout_holders_rank_count_mismatch():
    with pytest.raises(ValueError, match="4 coordinates, got 3 ranks"):
        layout_holders((4,), [0, 1, 2], (2, 2), (Shard(0), Replicate()))


def test_assign_writers_single_holder_and_docstring():
    assert assign_writers([("a", 10, (0, 1)), ("b", 10, (0, 1))]) == {"a": 0, "b": 1}
    assert assign_writers([("x", 5, (3,)), ("y", 1, (2,))]) == {"x": 3, "y": 2}
    with pytest.raises(ValueError, match="no holder"):
        assign_writers([("z", 1, ())])


@pytest.mark.parametrize("seed", range(12))
def test_assign_writers_balanced_and_deterministic(seed):
    rng = random.Random(seed)
    world = rng.choice([2, 3, 4, 8])
    items = []
    for i in range(rng.randrange(1, 60)):
        k = rng.randrange(1, world + 1)
        holders = tuple(sorted(rng.sample(range(world), k)))
        items.append((f"t{i}", rng.choice([0, 1, 7, 64, 1000, 4096]), holders))
    out = assign_writers(items)
    assert set(out) == {k for k, _, _ in items}
    for key, _, holders in items:
        assert out[key] in holders
    # Every rank computes it alone: the answer must not depend on input order.
    shuffled = items[:]
    rng.shuffle(shuffled)
    assert assign_writers(shuffled) == out


@pytest.mark.parametrize("world, n, size", [(2, 10, 100), (3, 7, 64), (4, 33, 5), (8, 100, 4096)])
def test_assign_writers_balances_fully_replicated(world, n, size):
    rng = random.Random(world * n)
    items = [(f"t{i}", rng.randrange(1, size), tuple(range(world))) for i in range(n)]
    out = assign_writers(items)
    load = [0] * world
    for key, nbytes, _ in items:
        load[out[key]] += nbytes
    # Largest-first greedy: no rank exceeds another by more than one item.
    assert max(load) - min(load) <= max(nb for _, nb, _ in items)
    if n >= world:
        assert min(load) > 0  # every replica does some of the writing


# --------------------------------------------------------------------------
# read plans for resharding


def _distinct_boxes(shape, mesh_shape, placements):
    return sorted(layout_holders(shape, list(range(int(np.prod(mesh_shape)))), mesh_shape, placements), key=lambda b: b.offsets)


def _layouts_for(shape, rng):
    ndim = len(shape)
    mesh_ndim = rng.choice([1, 2])
    mesh_shape = tuple(rng.choice([1, 2, 3, 4]) for _ in range(mesh_ndim))
    pl = _random_placements(rng, ndim, mesh_ndim)
    s = _strided(pl, mesh_shape)
    if s is not None and rng.random() < 0.5:
        pl = s
    return mesh_shape, tuple(pl)


@pytest.mark.parametrize("seed", range(40))
def test_plan_reads_random_resharding(seed):
    rng = random.Random(seed)
    ndim = rng.choice([1, 2, 2, 3])
    shape = tuple(rng.choice([1, 2, 5, 7, 9]) for _ in range(ndim))
    global_a = np.arange(int(np.prod(shape))).reshape(shape)
    save_mesh, save_pl = _layouts_for(shape, rng)
    saved = _distinct_boxes(shape, save_mesh, save_pl)
    rng.shuffle(saved)  # the manifest's chunk order must not matter
    stored = [global_a[tuple(slice(o, o + n) for o, n in zip(b.offsets, b.sizes))] for b in saved]
    load_mesh, load_pl = _layouts_for(shape, rng)
    for coord in mesh_coords(load_mesh):
        wanted = local_boxes(shape, load_mesh, load_pl, coord)
        if not wanted:
            continue
        ivs = dim_intervals(shape, load_mesh, load_pl, coord)
        local_shape = tuple(sum(n for _, n in iv) for iv in ivs)
        dst = np.full(local_shape, -1, dtype=np.int64)
        hits = np.zeros(local_shape, dtype=np.int64)
        for p in plan_reads(saved, wanted):
            src_sl = tuple(slice(o, o + n) for o, n in zip(p.src_offsets, p.sizes))
            dst_sl = tuple(slice(o, o + n) for o, n in zip(p.dst_offsets, p.sizes))
            dst[dst_sl] = stored[p.chunk][src_sl]
            hits[dst_sl] += 1
        assert (hits == 1).all(), (coord, save_pl, load_pl)
        want = np.full(local_shape, -1, dtype=np.int64)
        for lb in wanted:
            want[tuple(slice(o, o + n) for o, n in zip(lb.local_offsets, lb.box.sizes))] = global_a[
                tuple(slice(o, o + n) for o, n in zip(lb.box.offsets, lb.box.sizes))
            ]
        assert (dst == want).all()


def test_plan_reads_reports_uncovered():
    saved = [Box((0, 0), (4, 3))]  # rows 4..7 were never saved
    with pytest.raises(ValueError, match="cover 6 of the 18 elements"):
        plan_reads(saved, [LocalBox(Box((2, 0), (6, 3)), (0, 0))])
    # Empty wanted boxes need nothing.
    assert plan_reads(saved, [LocalBox(Box((0, 0), (0, 3)), (0, 0))]) == []


# --------------------------------------------------------------------------
# check_cover


@pytest.mark.parametrize(
    "shape, boxes, msg",
    [
        ((4, 3), [Box((0, 0), (2, 3)), Box((1, 0), (3, 3))], "elements"),  # 15 elements for 12
        ((4, 3), [Box((0, 0), (3, 3)), Box((2, 0), (1, 3))], "overlap"),  # right count, overlapping
        ((4, 4), [Box((0, 0), (2, 2)), Box((0, 0), (2, 2)), Box((2, 0), (2, 4))], "overlap"),  # duplicate + gap
        # the overlapping pair is not adjacent once sorted
        ((4, 2), [Box((0, 0), (4, 1)), Box((0, 1), (1, 1)), Box((1, 1), (1, 1)), Box((2, 0), (1, 1)), Box((3, 1), (1, 1))], "overlap"),
        ((4, 3), [Box((0, 0), (2, 3))], "hold 6 elements"),  # gap
        ((4, 3), [Box((0, 0), (2, 3)), Box((3, 0), (2, 3))], "outside"),
        ((4, 3), [Box((-1, 0), (1, 3))], "outside"),
        ((4, 3), [Box((0,), (4,))], "1 dims"),
        ((0, 3), [], "no chunk"),
        ((), [Box((), ()), Box((), ())], "hold 2 elements"),
        ((), [], "0 elements"),
    ],
)
def test_check_cover_catches(shape, boxes, msg):
    why = check_cover(shape, boxes)
    assert why is not None and msg in why, why


@pytest.mark.parametrize(
    "shape, boxes",
    [
        ((4, 3), [Box((2, 0), (2, 3)), Box((0, 0), (2, 3))]),
        ((4, 4), [Box((0, 0), (4, 2)), Box((0, 2), (4, 2))]),
        ((), [Box((), ())]),
        ((0, 3), [Box((0, 0), (0, 3))]),
        ((5,), [Box((0,), (5,)), Box((5,), (0,))]),  # empty boxes are allowed
    ],
)
def test_check_cover_accepts_tilings(shape, boxes):
    assert check_cover(shape, boxes) is None


def _brute_cover(shape, boxes):
    count = np.zeros(shape, dtype=np.int64)
    for b in boxes:
        if any(o < 0 or n < 0 or o + n > s for o, n, s in zip(b.offsets, b.sizes, shape)):
            return False
        count[tuple(slice(o, o + n) for o, n in zip(b.offsets, b.sizes))] += 1
    return bool((count == 1).all())


@pytest.mark.parametrize("seed", range(60))
def test_check_cover_agrees_with_brute_force(seed):
    rng = random.Random(seed)
    shape = tuple(rng.choice([1, 2, 3, 5, 6]) for _ in range(rng.choice([1, 2, 3])))
    mesh, pl = _layouts_for(shape, rng)
    boxes = _distinct_boxes(shape, mesh, pl)
    if rng.random() < 0.7 and boxes:
        # perturb: shift, grow or shrink one box on one dim, or duplicate/drop one
        i = rng.randrange(len(boxes))
        b = boxes[i]
        kind = rng.choice(["shift", "grow", "dup", "drop"])
        d = rng.randrange(len(shape))
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
        else:
            boxes.pop(i)
    rng.shuffle(boxes)
    assert (check_cover(shape, boxes) is None) == _brute_cover(shape, boxes), (shape, boxes)


def test_check_cover_many_column_chunks_is_fast():
    # thousands of column shards (Shard(1) on a wide tensor): must not compare every pair
    import time

    n = 4096
    boxes = [Box((0, i), (3, 1)) for i in range(n)]
    t0 = time.perf_counter()
    assert check_cover((3, n), boxes) is None
    boxes[10] = Box((0, 11), (3, 1))  # column 11 twice, column 10 never
    assert "overlap" in check_cover((3, n), boxes)
    assert time.perf_counter() - t0 < 5


# --------------------------------------------------------------------------
# fsdp_boxes / split_box


@pytest.mark.parametrize("shape", [(1,), (3, 2), (8, 5), (37, 7), (2, 3, 4)])
@pytest.mark.parametrize("world", [1, 2, 3, 4, 8])
def test_fsdp_boxes_match_local_boxes(shape, world):
    boxes = fsdp_boxes(shape, world)
    assert len(boxes) == world
    for r, b in enumerate(boxes):
        lbs = local_boxes(shape, (world,), (Shard(0),), (r,))
        if b.numel:
            assert [lb.box for lb in lbs] == [b]
        else:
            assert lbs == [] and b.sizes[1:] == shape[1:]
    assert check_cover(shape, boxes) is None
    assert fsdp_boxes((), world) == [Box((), ())]


@pytest.mark.parametrize("box", [Box((3, 1), (10, 4)), Box((0,), (17,)), Box((0, 0, 0), (5, 3, 2)), Box((5,), (1,))])
@pytest.mark.parametrize("max_elems", [1, 3, 4, 8, 12, 1000])
def test_split_box_tiles(box, max_elems):
    pieces = split_box(box, max_elems)
    row = box.numel // box.sizes[0]
    for p in pieces:
        assert p.offsets[1:] == box.offsets[1:] and p.sizes[1:] == box.sizes[1:]
        assert p.numel <= max(max_elems, row)
    assert sum(p.sizes[0] for p in pieces) == box.sizes[0]
    starts = [p.offsets[0] for p in pieces]
    assert starts == sorted(starts) and starts[0] == box.offsets[0]
    for a, b in zip(pieces, pieces[1:]):
        assert a.offsets[0] + a.sizes[0] == b.offsets[0]


def test_split_box_edges():
    assert split_box(Box((), ()), 1) == [Box((), ())]
    # A single row larger than the limit stays whole.
    assert split_box(Box((0, 0), (1, 100)), 10) == [Box((0, 0), (1, 100))]
    assert split_box(Box((0, 0), (3, 100)), 10) == [Box((i, 0), (1, 100)) for i in range(3)]
    assert split_box(Box((0,), (0,)), 4) == [Box((0,), (0,))]


def test_plan_is_torch_free():
    import subprocess
    import sys

    code = "import sys, shardckpt._geometry, shardckpt._format; sys.exit(1 if 'torch' in sys.modules else 0)"
    assert subprocess.run([sys.executable, "-c", code]).returncode == 0, "_geometry/_format imported torch"
