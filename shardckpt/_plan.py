"""Pure geometry: placements -> boxes, writer assignment, overlaps, read plans.

Nothing here imports torch. Every function works on plain ints and tuples so
it can be tested exhaustively and reasoned about without processes.

Vocabulary
----------
* A *box* is a hyper-rectangle of a global tensor: ``offsets`` and ``sizes``,
  one int per tensor dim.
* A *placement* is how one mesh dim distributes a tensor:
  ``Shard(dim, split_factor=1)`` or ``Replicate()``. torch's ``_StridedShard``
  is ``Shard`` with ``split_factor > 1`` (the shard that FSDP applies on top
  of tensor parallelism, recorded in left-to-right order).
* Splitting follows ``torch.chunk``: ``n`` rows over ``k`` parts gives parts
  of ``ceil(n / k)`` rows, the last ones shorter or empty.
"""

from __future__ import annotations

import itertools
from dataclasses import dataclass
from typing import Dict, Iterable, List, Optional, Sequence, Tuple

__all__ = [
    "Shard",
    "Replicate",
    "Box",
    "LocalBox",
    "Piece",
    "chunk_bounds",
    "dim_intervals",
    "local_boxes",
    "mesh_coords",
    "layout_holders",
    "assign_writers",
    "intersect",
    "plan_reads",
    "check_cover",
    "fsdp_boxes",
    "split_box",
]

Interval = Tuple[int, int]  # (start, length) along one dim


@dataclass(frozen=True)
class Shard:
    """Split tensor dim ``dim`` over a mesh dim (``split_factor`` > 1: strided)."""

    dim: int
    split_factor: int = 1


@dataclass(frozen=True)
class Replicate:
    """Every rank along the mesh dim holds the same data."""


@dataclass(frozen=True)
class Box:
    """A region of a global tensor."""

    offsets: Tuple[int, ...]
    sizes: Tuple[int, ...]

    @property
    def numel(self) -> int:
        n = 1
        for s in self.sizes:
            n *= s
        return n


@dataclass(frozen=True)
class LocalBox:
    """A box of the global tensor and where it sits inside a rank's local tensor."""

    box: Box
    local_offsets: Tuple[int, ...]


@dataclass(frozen=True)
class Piece:
    """Copy ``sizes`` elements from a saved chunk into a local tensor.

    ``src_offsets`` are relative to the saved chunk, ``dst_offsets`` relative to
    the destination local tensor.
    """

    chunk: int
    src_offsets: Tuple[int, ...]
    dst_offsets: Tuple[int, ...]
    sizes: Tuple[int, ...]


def chunk_bounds(length: int, parts: int, index: int) -> Tuple[int, int]:
    """Return ``(start, stop)`` of part ``index`` when ``torch.chunk`` splits ``length`` into ``parts``."""
    if parts <= 0 or not 0 <= index < parts:
        raise ValueError(f"chunk index {index} out of range for {parts} parts")
    size = -(-length // parts) if length else 0
    start = min(size * index, length)
    stop = min(size * (index + 1), length)
    return start, stop


def _slice_intervals(seq: Sequence[Interval], start: int, stop: int) -> List[Interval]:
    """Positions ``[start, stop)`` of the concatenation of ``seq``, as intervals."""
    out: List[Interval] = []
    pos = 0
    for s, n in seq:
        lo, hi = max(start, pos), min(stop, pos + n)
        if lo < hi:
            out.append((s + lo - pos, hi - lo))
        pos += n
        if pos >= stop:
            break
    return out


def _length(seq: Sequence[Interval]) -> int:
    return sum(n for _, n in seq)


def _split(seq: Sequence[Interval], parts: int, index: int, split_factor: int) -> List[Interval]:
    if split_factor == 1:
        return _slice_intervals(seq, *chunk_bounds(_length(seq), parts, index))
    # Strided: torch first splits into split_factor pieces (the shards of the
    # mesh dims to the right, applied first), then each piece into `parts`;
    # this rank gets piece j's part `index`, for every j, concatenated.
    out: List[Interval] = []
    total = _length(seq)
    for j in range(split_factor):
        piece = _slice_intervals(seq, *chunk_bounds(total, split_factor, j))
        out.extend(_slice_intervals(piece, *chunk_bounds(_length(piece), parts, index)))
    return _merge(out)


def _merge(seq: Sequence[Interval]) -> List[Interval]:
    out: List[Interval] = []
    for s, n in seq:
        if n == 0:
            continue
        if out and out[-1][0] + out[-1][1] == s:
            out[-1] = (out[-1][0], out[-1][1] + n)
        else:
            out.append((s, n))
    return out


def dim_intervals(
    shape: Sequence[int],
    mesh_shape: Sequence[int],
    placements: Sequence[object],
    coord: Sequence[int],
) -> List[List[Interval]]:
    """Global index intervals each tensor dim holds at mesh coordinate ``coord``.

    The intervals of a dim are in local order: the local tensor is their
    concatenation. A dim no rank shards is one interval covering it.
    """
    if len(mesh_shape) != len(placements) or len(coord) != len(mesh_shape):
        raise ValueError(
            f"mesh of {len(mesh_shape)} dims needs as many placements and coordinates, "
            f"got {len(placements)} placements and coordinate {tuple(coord)}"
        )
    per_dim: List[List[Interval]] = [[(0, n)] if n else [] for n in shape]
    for mesh_dim, p in enumerate(placements):
        if isinstance(p, Replicate):
            continue
        if not isinstance(p, Shard):
            raise ValueError(f"unsupported placement {p!r} on mesh dim {mesh_dim}")
        if not 0 <= p.dim < len(shape):
            raise ValueError(f"placement {p!r} shards dim {p.dim} of a {len(shape)}-d tensor")
        per_dim[p.dim] = _split(per_dim[p.dim], mesh_shape[mesh_dim], coord[mesh_dim], p.split_factor)
    return per_dim


def local_boxes(
    shape: Sequence[int],
    mesh_shape: Sequence[int],
    placements: Sequence[object],
    coord: Sequence[int],
) -> List[LocalBox]:
    """Boxes of the global tensor held at ``coord``, with their local offsets.

    Usually one box; a strided shard of an uneven dim can give several. A rank
    that holds nothing (uneven sharding, more ranks than rows) gets ``[]``.
    Zero-size tensors are one empty box so they still get saved.

    >>> [b.box for b in local_boxes((5, 3), (2,), (Shard(0),), (1,))]
    [Box(offsets=(3, 0), sizes=(2, 3))]
    """
    shape = tuple(shape)
    if any(n == 0 for n in shape):
        # Nothing to hold; one canonical empty box, owned like replicated data.
        return [LocalBox(Box((0,) * len(shape), shape), (0,) * len(shape))]
    per_dim = dim_intervals(shape, mesh_shape, placements, coord)
    if any(not ivs for ivs in per_dim):
        return []
    boxes = []
    for combo in itertools.product(*[_with_local_offsets(ivs) for ivs in per_dim]):
        boxes.append(
            LocalBox(
                Box(tuple(c[0] for c in combo), tuple(c[1] for c in combo)),
                tuple(c[2] for c in combo),
            )
        )
    return boxes


def _with_local_offsets(ivs: Sequence[Interval]) -> List[Tuple[int, int, int]]:
    out, pos = [], 0
    for s, n in ivs:
        out.append((s, n, pos))
        pos += n
    return out


def mesh_coords(mesh_shape: Sequence[int]) -> List[Tuple[int, ...]]:
    """All coordinates of a mesh, in row-major (rank) order."""
    return list(itertools.product(*[range(n) for n in mesh_shape]))


def layout_holders(
    shape: Sequence[int],
    mesh_ranks: Sequence[int],
    mesh_shape: Sequence[int],
    placements: Sequence[object],
) -> Dict[Box, Tuple[int, ...]]:
    """Map each distinct box of a distributed tensor to the global ranks holding it.

    ``mesh_ranks`` lists the global rank at each mesh coordinate, row-major
    (``DeviceMesh.mesh.flatten()``). Replicated mesh dims make several holders.
    """
    coords = mesh_coords(mesh_shape)
    if len(coords) != len(mesh_ranks):
        raise ValueError(f"mesh of shape {tuple(mesh_shape)} has {len(coords)} coordinates, got {len(mesh_ranks)} ranks")
    holders: Dict[Box, List[int]] = {}
    for coord, rank in zip(coords, mesh_ranks):
        for lb in local_boxes(shape, mesh_shape, placements, coord):
            holders.setdefault(lb.box, []).append(int(rank))
    return {b: tuple(sorted(r)) for b, r in holders.items()}


def assign_writers(items: Sequence[Tuple[object, int, Sequence[int]]]) -> Dict[object, int]:
    """Pick one writer per item, balancing bytes across ranks.

    ``items`` are ``(key, nbytes, holders)``. Every rank runs this on the same
    items and gets the same answer, so no communication is needed. Items with
    one holder go to it; the rest are placed largest first on the holder with
    the fewest bytes so far (ties: lowest rank).

    >>> assign_writers([("a", 10, (0, 1)), ("b", 10, (0, 1))])
    {'a': 0, 'b': 1}
    """
    load: Dict[int, int] = {}
    out: Dict[object, int] = {}
    for key, nbytes, holders in items:
        if not holders:
            raise ValueError(f"item {key!r} has no holder")
        if len(holders) == 1:
            out[key] = holders[0]
            load[holders[0]] = load.get(holders[0], 0) + nbytes
    shared = [it for it in items if len(it[2]) > 1]
    shared.sort(key=lambda it: (-it[1], str(it[0])))
    for key, nbytes, holders in shared:
        best = min(holders, key=lambda r: (load.get(r, 0), r))
        out[key] = best
        load[best] = load.get(best, 0) + nbytes
    return out


def intersect(a: Box, b: Box) -> Optional[Box]:
    """The common part of two boxes, or ``None`` when they do not meet."""
    offs, sizes = [], []
    for ao, an, bo, bn in zip(a.offsets, a.sizes, b.offsets, b.sizes):
        lo, hi = max(ao, bo), min(ao + an, bo + bn)
        if hi <= lo:
            return None
        offs.append(lo)
        sizes.append(hi - lo)
    return Box(tuple(offs), tuple(sizes))


def plan_reads(saved: Sequence[Box], wanted: Sequence[LocalBox]) -> List[Piece]:
    """Pieces to copy from saved chunks so that every wanted box is filled.

    Raises ``ValueError`` if the saved chunks leave any wanted element uncovered.
    """
    pieces: List[Piece] = []
    for lb in wanted:
        covered = 0
        if lb.box.numel == 0:
            continue
        for i, chunk in enumerate(saved):
            inter = intersect(chunk, lb.box)
            if inter is None:
                continue
            pieces.append(
                Piece(
                    chunk=i,
                    src_offsets=tuple(o - c for o, c in zip(inter.offsets, chunk.offsets)),
                    dst_offsets=tuple(
                        lo + o - bo for lo, o, bo in zip(lb.local_offsets, inter.offsets, lb.box.offsets)
                    ),
                    sizes=inter.sizes,
                )
            )
            covered += inter.numel
        if covered != lb.box.numel:
            raise ValueError(f"saved chunks cover {covered} of the {lb.box.numel} elements of box {lb.box}")
    return pieces


def check_cover(shape: Sequence[int], boxes: Sequence[Box]) -> Optional[str]:
    """Return why ``boxes`` fail to tile ``shape`` exactly, or ``None`` if they do."""
    shape = tuple(shape)
    total = 1
    for n in shape:
        total *= n
    for b in boxes:
        if len(b.offsets) != len(shape) or len(b.sizes) != len(shape):
            return f"chunk {b} has {len(b.offsets)} dims, tensor has {len(shape)}"
        for o, n, s in zip(b.offsets, b.sizes, shape):
            if o < 0 or n < 0 or o + n > s:
                return f"chunk {b} lies outside shape {list(shape)}"
    if total == 0:
        return None if boxes else "no chunk"
    nonempty = [b for b in boxes if b.numel]
    if sum(b.numel for b in nonempty) != total:
        return f"chunks hold {sum(b.numel for b in nonempty)} elements, shape {list(shape)} has {total}"
    if not shape:
        return None if len(nonempty) == 1 else f"{len(nonempty)} chunks for a 0-d tensor"
    # Equal volume plus no overlap means exact cover. Sorted by their start on
    # dim d, a box can only overlap later boxes that start before it ends on
    # d. Sweeping the dim with the most distinct starts keeps this near
    # linear for the usual layouts (e.g. thousands of column shards, where a
    # dim-0 sweep would compare every pair).
    d = max(range(len(shape)), key=lambda k: (len({b.offsets[k] for b in nonempty}), -k))
    nonempty.sort(key=lambda b: (b.offsets[d], b.offsets))
    for i, a in enumerate(nonempty):
        end = a.offsets[d] + a.sizes[d]
        for b in nonempty[i + 1 :]:
            if b.offsets[d] >= end:
                break
            if intersect(a, b) is not None:
                return f"chunks {a} and {b} overlap"
    return None


def fsdp_boxes(shape: Sequence[int], world_size: int) -> List[Box]:
    """Boxes FSDP2 (``Shard(0)`` on a 1-D mesh) gives each rank, rank order.

    A 0-d tensor cannot be split: the list then holds one box (for rank 0).
    Ranks past the last row get an empty box.
    """
    shape = tuple(shape)
    if not shape:
        return [Box((), ())]
    out = []
    for r in range(world_size):
        start, stop = chunk_bounds(shape[0], world_size, r)
        out.append(Box((start,) + (0,) * (len(shape) - 1), (stop - start,) + shape[1:]))
    return out


def split_box(box: Box, max_elems: int) -> List[Box]:
    """Cut a box along its first dim into pieces of at most ``max_elems`` elements.

    Used to stream big tensors through bounded buffers. A single row larger
    than the limit stays whole (the limit is a target, not a hard cap).
    """
    if not box.sizes or box.numel <= max_elems or box.sizes[0] <= 1:
        return [box]
    row = box.numel // box.sizes[0]
    rows = max(1, max_elems // max(row, 1))
    out = []
    for start in range(0, box.sizes[0], rows):
        n = min(rows, box.sizes[0] - start)
        out.append(Box((box.offsets[0] + start,) + box.offsets[1:], (n,) + box.sizes[1:]))
    return out
