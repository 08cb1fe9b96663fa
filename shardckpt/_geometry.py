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
* A *regular layout* (``RegularLayout``: shape, mesh shape, placements) is a
  compact description from which every chunk, its holders and its writer
  derive on demand; the functions on it cost O(own boxes), not O(ranks)
  (see the section near the end and ``docs/scaling.md``).

Validation scales too: ``check_cover`` (exact tiling) and
``shared_byte_ranges`` (file bytes claimed twice) are O(n log n) on the
layouts placements produce, with no pairwise comparison of chunks.
"""

from __future__ import annotations

import functools
import gc
import itertools
from dataclasses import dataclass
from typing import Any, Dict, Iterable, Iterator, List, Optional, Sequence, Tuple

__all__ = [
    "Shard",
    "Replicate",
    "Box",
    "LocalBox",
    "Piece",
    "chunk_bounds",
    "dim_intervals",
    "local_boxes",
    "held_boxes",
    "mesh_coords",
    "layout_holders",
    "assign_writers",
    "intersect",
    "plan_reads",
    "check_cover",
    "shared_byte_ranges",
    "RangeClash",
    "DEFAULT_OFFENDER_LIMIT",
    "fsdp_boxes",
    "RegularLayout",
    "regular_layout",
    "layout_to_json",
    "layout_from_json",
    "shard_count",
    "replica_count",
    "shard_index",
    "replica_index",
    "mesh_coord",
    "layout_chunks",
    "writer_rotations",
    "writer_replica",
    "writer_coord",
    "is_writer",
    "boxes_to_write",
    "chunks_overlapping",
    "split_box",
]

Interval = Tuple[int, int]  # (start, length) along one dim


@dataclass(frozen=True)
class Shard:
    """Split tensor dim ``dim`` over a mesh dim (``split_factor`` > 1: strided)."""

    dim: int
    split_factor: int = 1

    def __hash__(self) -> int:
        # Cached: every memoized geometry is keyed on placements.
        h = self.__dict__.get("_hash")
        if h is None:
            h = hash((self.dim, self.split_factor))
            object.__setattr__(self, "_hash", h)
        return h


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


#: Distinct geometries remembered by the memoized functions below. A model
#: repeats a handful of layouts over its layers (every ``layers.k.wq`` is
#: placed alike), so planning costs O(distinct layouts) of geometry plus a
#: lookup per tensor, instead of the geometry once per tensor.
GEOMETRY_CACHE_ENTRIES = 4096


def _memo(fn):
    """``fn`` memoized on its (hashable) arguments; unhashable ones are computed directly."""
    cached = functools.lru_cache(maxsize=GEOMETRY_CACHE_ENTRIES)(fn)

    @functools.wraps(fn)
    def call(*args):
        # One hash of the arguments (the cache's): a 50,000-tensor plan calls
        # these once per tensor. Unhashable arguments fail to hash before
        # ``fn`` runs; a TypeError ``fn`` itself raises is raised again below.
        try:
            return cached(*args)
        except TypeError:
            return fn(*args)

    call.cache_clear = cached.cache_clear
    call.cache_info = cached.cache_info
    call.cached = cached
    return call


def clear_geometry_caches() -> None:
    """Forget every memoized geometry (benchmarks time cold planning with it)."""
    for fn in (_local_boxes, _regular_layout, _chunks_overlapping, _structure, _nominal_bytes, _plan_box_reads):
        fn.cache_clear()


def local_boxes(
    shape: Sequence[int],
    mesh_shape: Sequence[int],
    placements: Sequence[object],
    coord: Sequence[int],
) -> List[LocalBox]:
    """Boxes of the global tensor held at ``coord``, with their local offsets.

    Usually one box; a strided shard of an uneven dim can give several. A rank
    that holds nothing (uneven sharding, more ranks than rows) gets ``[]``.
    Zero-size tensors are one empty box so they still get saved. Memoized
    (the boxes are immutable; the list is the caller's).

    >>> [b.box for b in local_boxes((5, 3), (2,), (Shard(0),), (1,))]
    [Box(offsets=(3, 0), sizes=(2, 3))]
    """
    if type(shape) is tuple and type(mesh_shape) is tuple and type(placements) is tuple and type(coord) is tuple:
        try:  # the cache directly: a 50,000-tensor load asks once per tensor
            return list(_local_boxes.cached(shape, mesh_shape, placements, coord))
        except TypeError:  # an unhashable placement
            pass
    return list(_local_boxes(tuple(shape), tuple(mesh_shape), tuple(placements), tuple(coord)))


def held_boxes(
    layouts: Sequence["RegularLayout"],
    coords: Sequence[Tuple[int, ...]],
) -> List[Tuple[Tuple[Tuple[int, ...], Tuple[int, ...]], ...]]:
    """Per ``(layouts[i], coords[i])``, the ``(offsets, sizes)`` of the boxes held there: :func:`local_boxes` in bulk.

    What a loading rank asks for every tensor it holds. A mixture-of-experts
    state places thousands of same-shaped tensors alike, so the boxes are
    computed once per distinct (layout, coordinate) and the same tuple is
    given to each of its tensors (callers must not change it; a tuple of
    tuples, so they cannot). Equal layouts and coordinates give identical
    objects, which is what lets ``_format.resolve_reads`` group them cheaply.

    Args:
        layouts: one :class:`RegularLayout` per tensor.
        coords: the holder's coordinate in each layout's mesh (same length).

    Raises:
        ValueError: lengths differ, or a coordinate does not fit its mesh
            (as :func:`local_boxes`).

    >>> lay = regular_layout((5, 3), (2,), (Shard(0),))
    >>> held_boxes([lay, lay], [(1,), (1,)])
    [(((3, 0), (2, 3)),), (((3, 0), (2, 3)),)]

    Limits: layouts must be hashable (``RegularLayout`` is).
    """
    if len(layouts) != len(coords):
        raise ValueError(f"held_boxes: {len(layouts)} layouts but {len(coords)} coordinates")
    # Keyed by the objects' ids first (C-level hashes; callers pass the same
    # few layout and coordinate objects again and again), then each distinct
    # pair by value, so equal layouts built twice still share their boxes.
    # Both lists hold their objects for the whole call, so ids stay unique.
    was = gc.isenabled()
    gc.disable()  # 50,000 key tuples, none cyclic: no collector pass over the caller's heap
    try:
        # One hash per tensor: each id pair numbered by its first position.
        first: Dict[Tuple[int, int], int] = {}
        at = list(map(first.setdefault, zip(map(id, layouts), map(id, coords)), range(len(layouts))))
        by_value: Dict[Any, Any] = {}
        by_first: Dict[int, Any] = {}
        for i in first.values():
            lay, coord = layouts[i], coords[i]
            vkey = (lay, tuple(coord))
            got = by_value.get(vkey)
            if got is None:
                got = by_value[vkey] = tuple(
                    (lb.box.offsets, lb.box.sizes) for lb in _local_boxes(lay.shape, lay.mesh_shape, lay.placements, tuple(coord)))
            by_first[i] = got
        return list(map(by_first.__getitem__, at))
    finally:
        if was:
            gc.enable()


@_memo
def _local_boxes(
    shape: Tuple[int, ...],
    mesh_shape: Tuple[int, ...],
    placements: Tuple[object, ...],
    coord: Tuple[int, ...],
) -> Tuple[LocalBox, ...]:
    if any(n == 0 for n in shape):
        # Nothing to hold; one canonical empty box, owned like replicated data.
        return (LocalBox(Box((0,) * len(shape), shape), (0,) * len(shape)),)
    per_dim = dim_intervals(shape, mesh_shape, placements, coord)
    if any(not ivs for ivs in per_dim):
        return ()
    boxes = []
    for combo in itertools.product(*[_with_local_offsets(ivs) for ivs in per_dim]):
        boxes.append(
            LocalBox(
                Box(tuple(c[0] for c in combo), tuple(c[1] for c in combo)),
                tuple(c[2] for c in combo),
            )
        )
    return tuple(boxes)


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
            if chunk == lb.box:  # same layout: the one chunk is the box (no intersection to compute)
                zeros = (0,) * len(chunk.offsets)
                pieces.append(Piece(chunk=i, src_offsets=zeros, dst_offsets=lb.local_offsets, sizes=chunk.sizes))
                covered += lb.box.numel
                continue
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


def plan_box_reads(saved: Sequence[Box], box: Box) -> Tuple[Piece, ...]:
    """:func:`plan_reads` of one wanted box at local offset 0, memoized on ``(saved boxes, box)``.

    A load of a large state asks the same question for every tensor of a
    layout (same saved boxes, same wanted box): computed once per distinct
    question. Raises ``ValueError`` as :func:`plan_reads` does.
    """
    return _plan_box_reads(tuple(saved), box)


@_memo
def _plan_box_reads(saved: Tuple[Box, ...], box: Box) -> Tuple[Piece, ...]:
    return tuple(plan_reads(saved, [LocalBox(box, (0,) * len(box.offsets))]))


def check_cover(shape: Sequence[int], boxes: Sequence[Box]) -> Optional[str]:
    """Return why ``boxes`` fail to tile ``shape`` exactly, or ``None`` if they do.

    Args:
        shape: the tensor's global shape.
        boxes: its chunks (any order; empty boxes are allowed and ignored).

    Returns ``None`` for an exact tiling, else one sentence naming the first
    problem found (a box outside the shape, a volume mismatch, an overlap).

    Cost: O(n d log n) for n boxes in d dims when the boxes form a product
    grid (every layout placements produce: FSDP, TP, HSDP, strided shards);
    other tilings (converters, foreign files) take the signed-corner check,
    linear in n for a fixed number of dims that the boxes cut (at most 2^d
    per box, with cancellation making it far less in practice). No pairwise
    comparison of boxes, so a crafted manifest cannot make it quadratic.

    >>> check_cover((4, 3), [Box((0, 0), (2, 3)), Box((2, 0), (2, 3))]) is None
    True
    """
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
    held = sum(b.numel for b in nonempty)
    if held != total:
        return f"chunks hold {held} elements, shape {list(shape)} has {total}"
    if not shape:
        return None if len(nonempty) == 1 else f"{len(nonempty)} chunks for a 0-d tensor"
    # Equal volume plus no overlap means exact cover; both checks below prove
    # exact cover directly, so a failure with the right volume is an overlap.
    if _is_product_grid(shape, nonempty) or _tiles_by_corners(shape, nonempty):
        return None
    return _overlap_message(nonempty)


def _is_product_grid(shape: Tuple[int, ...], boxes: Sequence[Box]) -> bool:
    """True when ``boxes`` are exactly the cells of a product of per-dim partitions.

    Distinct boxes, each made of one interval per dim taken from a partition
    of that dim, and as many as the product has cells: then they are all the
    cells, an exact tiling. Linear (plus sorting the distinct intervals).
    """
    cells = 1
    for d, n in enumerate(shape):
        ivs = sorted({(o[d], z[d]) for o, z in zip([b.offsets for b in boxes], [b.sizes for b in boxes])})
        pos = 0
        for o, size in ivs:
            if o != pos:
                return False
            pos = o + size
        if pos != n:
            return False
        cells *= len(ivs)
        if cells > len(boxes):
            return False
    # Within a partition an interval is fixed by its start, so distinct
    # offsets mean distinct boxes.
    return cells == len(boxes) and len({b.offsets for b in boxes}) == len(boxes)


_Item = Tuple[Tuple[int, ...], Tuple[int, ...]]  # (offsets, sizes) over the dims not yet swept


def _tiles_by_corners(shape: Tuple[int, ...], boxes: Sequence[Box]) -> bool:
    """True when the boxes' indicator functions sum to the tensor's: an exact tiling.

    ``sum(1_box) - 1_tensor == 0`` is checked one dim at a time through its
    discrete derivative: along dim 0 the function is zero iff, at every cut
    coordinate x, the (d-1)-dim boxes starting at x minus those ending at x
    sum to zero; recurse on each such group. Faces shared by neighbouring
    boxes cancel at once, so a grid-like tiling costs about linear time.
    Pruning (a group with non-zero signed volume, or of one sign, is not
    zero) and a memo of groups already proven zero bound the work on hostile
    input.
    """
    items: Dict[_Item, int] = {}
    for b in boxes:
        items[(b.offsets, b.sizes)] = items.get((b.offsets, b.sizes), 0) + 1
    whole = ((0,) * len(shape), shape)
    items[whole] = items.get(whole, 0) - 1
    return _signed_sum_is_zero({k: w for k, w in items.items() if w}, {})


def _signed_sum_is_zero(items: Dict[_Item, int], memo: Dict[Any, bool]) -> bool:
    if not items:
        return True
    first = next(iter(items))
    if not first[0]:  # no dims left: the boxes are points
        return sum(items.values()) == 0
    groups: Dict[int, Dict[_Item, int]] = {}
    for (offs, sizes), w in items.items():
        rest = (offs[1:], sizes[1:])
        for x, sign in ((offs[0], w), (offs[0] + sizes[0], -w)):
            g = groups.setdefault(x, {})
            g[rest] = g.get(rest, 0) + sign
    for x in sorted(groups):
        g = {k: w for k, w in groups[x].items() if w}
        if not g:
            continue
        signs = {w > 0 for w in g.values()}
        if len(signs) == 1 or sum(w * _numel(k[1]) for k, w in g.items()) != 0:
            return False
        key = tuple(sorted(g.items()))
        neg = tuple(sorted((k, -w) for k, w in g.items()))
        key = min(key, neg)
        if key in memo:
            continue
        if not _signed_sum_is_zero(g, memo):
            return False
        memo[key] = True
    return True


def _numel(sizes: Sequence[int]) -> int:
    n = 1
    for s in sizes:
        n *= s
    return n


#: Pairwise comparisons spent naming an overlap once one is known to exist.
_OVERLAP_SEARCH_BUDGET = 200_000


def _overlap_message(boxes: Sequence[Box]) -> str:
    """Name two overlapping boxes (the volume matched, so some overlap exists)."""
    ordered = sorted(boxes, key=lambda b: (b.offsets, b.sizes))
    for a, b in zip(ordered, ordered[1:]):
        if a == b:
            return f"chunks {a} and {b} overlap"
    # Bounded sweep on the dim with the most distinct starts: it finds the
    # pair for any realistic manifest; a hostile one gets the general message.
    ndim = len(ordered[0].offsets)
    d = max(range(ndim), key=lambda k: (len({b.offsets[k] for b in ordered}), -k))
    ordered.sort(key=lambda b: (b.offsets[d], b.offsets))
    budget = _OVERLAP_SEARCH_BUDGET
    for i, a in enumerate(ordered):
        end = a.offsets[d] + a.sizes[d]
        for b in ordered[i + 1 :]:
            if b.offsets[d] >= end:
                break
            if intersect(a, b) is not None:
                return f"chunks {a} and {b} overlap"
            budget -= 1
            if budget <= 0:
                return f"chunks overlap: {len(ordered)} chunks hold as many elements as the tensor but do not tile it"
    return f"chunks overlap: {len(ordered)} chunks hold as many elements as the tensor but do not tile it"


# --------------------------------------------------------------------------
# file byte ranges claimed twice

#: Offender lists (clashing byte ranges...) stop at this many entries.
DEFAULT_OFFENDER_LIMIT = 20


@dataclass(frozen=True)
class RangeClash:
    """Two claims on the same bytes of one file: ``[start, stop)`` is shared."""

    file: str
    first: Any  # label of the claim that starts first
    second: Any
    start: int
    stop: int


def shared_byte_ranges(
    ranges: Iterable[Tuple[str, int, int, Any]],
    *,
    limit: int = DEFAULT_OFFENDER_LIMIT,
) -> List[RangeClash]:
    """Byte ranges of a file claimed more than once (chunks sharing file bytes).

    Args:
        ranges: ``(file, byte_offset, nbytes, label)`` per claim, e.g. one per
            chunk of every tensor of a manifest; ``label`` names the claim in
            the result (say ``"model.w chunk 3"``). Empty ranges claim nothing.
        limit: stop after this many clashes (offender lists stay bounded).

    Returns:
        Up to ``limit`` clashes, by file then offset; empty when every byte of
        every file is claimed at most once. Each later claim that starts
        inside an earlier one is reported once, against the earlier claim
        reaching furthest.

    Cost: O(n log n) for n claims (sort by offset, one sweep per file).

    >>> shared_byte_ranges([("a", 0, 8, "x"), ("a", 4, 8, "y"), ("b", 4, 8, "z")])
    [RangeClash(file='a', first='x', second='y', start=4, stop=8)]
    """
    by_file: Dict[str, List[Tuple[int, int, int, Any]]] = {}
    for i, (file, start, nbytes, label) in enumerate(ranges):
        if nbytes > 0:
            by_file.setdefault(file, []).append((start, nbytes, i, label))
    out: List[RangeClash] = []
    for file in sorted(by_file):
        reach, reach_label = None, None
        for start, nbytes, _, label in sorted(by_file[file], key=lambda r: r[:3]):
            if reach is not None and start < reach:
                out.append(RangeClash(file, reach_label, label, start, min(reach, start + nbytes)))
                if len(out) >= limit:
                    return out
            if reach is None or start + nbytes > reach:
                reach, reach_label = start + nbytes, label
    return out


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


# --------------------------------------------------------------------------
# regular layouts: chunks derived on demand, per-rank planning
#
# A DTensor laid out by placements over a mesh is fully described by
# (global shape, mesh shape, placements): every rank's boxes, which ranks hold
# the same box, and which chunks a wanted box overlaps follow from those few
# ints. The functions below answer those questions for one rank or one box in
# time independent of the number of ranks, where ``layout_holders`` and
# ``assign_writers`` enumerate every box of every rank.
#
# Shard coordinates and replicas: the mesh dims with a ``Shard`` placement
# pick the box (the *shard coordinate*, numbered row-major over those dims:
# the *shard index*); the ``Replicate`` mesh dims pick one of the ranks
# holding the same box (the *replica index*, row-major over those dims). A
# sub-mesh DTensor that is copied along other dims of its root mesh (FSDP on
# ``dp`` of a ``dp x tp`` mesh, for a parameter TP leaves alone) is described
# with one leading ``Replicate`` mesh dim per copy dimension.

#: Largest mesh a regular layout record may describe (read from untrusted JSON).
MAX_MESH_RANKS = 1 << 24
_MAX_MESH_NDIM = 16


@dataclass(frozen=True)
class RegularLayout:
    """A tensor distributed by placements over a mesh; every chunk derives from it.

    Build with :func:`regular_layout` (validates); store with
    :func:`layout_to_json` / :func:`layout_from_json`.
    """

    shape: Tuple[int, ...]
    mesh_shape: Tuple[int, ...]
    placements: Tuple[object, ...]

    def __hash__(self) -> int:
        # Cached: every memoized function below is keyed on layouts, and a
        # 50,000-tensor plan hashes each one several times.
        h = self.__dict__.get("_hash")
        if h is None:
            h = hash((self.shape, self.mesh_shape, self.placements))
            object.__setattr__(self, "_hash", h)
        return h

    @property
    def world(self) -> int:
        return _numel(self.mesh_shape)


def regular_layout(shape: Sequence[int], mesh_shape: Sequence[int], placements: Sequence[object]) -> RegularLayout:
    """Validate and describe a regular layout.

    Args:
        shape: global tensor shape.
        mesh_shape: sizes of the mesh dims (a leading ``Replicate`` dim per
            set of copies of a sub-mesh, see the section comment).
        placements: one ``Shard``/``Replicate`` per mesh dim.

    Raises:
        ValueError: mismatched lengths, a placement sharding a dim the tensor
            lacks, a non-positive mesh size, a strided split factor that is
            not positive, or a mesh larger than ``MAX_MESH_RANKS``.

    >>> regular_layout((8, 4), (4,), (Shard(0),)).world
    4
    """
    return _regular_layout(tuple(int(n) for n in shape), tuple(int(m) for m in mesh_shape), tuple(placements))


@_memo
def _regular_layout(shape: Tuple[int, ...], mesh_shape: Tuple[int, ...], placements: Tuple[object, ...]) -> RegularLayout:
    # Memoized: validating a layout splits its dims; a model's tensors share a
    # few layouts. Failures raise and are not remembered.
    if any(n < 0 for n in shape):
        raise ValueError(f"shape {list(shape)} has a negative size")
    if not mesh_shape or len(mesh_shape) > _MAX_MESH_NDIM or any(m < 1 for m in mesh_shape):
        raise ValueError(f"mesh shape {list(mesh_shape)} must have 1..{_MAX_MESH_NDIM} dims, each >= 1")
    if _numel(mesh_shape) > MAX_MESH_RANKS:
        raise ValueError(f"mesh shape {list(mesh_shape)} has more than {MAX_MESH_RANKS} ranks")
    for i, p in enumerate(placements):
        # torch's split factor is a product of mesh dims; capping it by the
        # mesh keeps a hostile record from making a split loop run for ages.
        if isinstance(p, Shard) and not 1 <= p.split_factor <= _numel(mesh_shape):
            raise ValueError(f"placement {p!r} on mesh dim {i} needs 1 <= split_factor <= {_numel(mesh_shape)} (the mesh size)")
    dim_intervals(shape, mesh_shape, placements, (0,) * len(mesh_shape))  # raises on bad placements
    return RegularLayout(shape, mesh_shape, placements)


def _placement_text(p: object) -> str:
    if isinstance(p, Shard):
        return f"S({p.dim})" if p.split_factor == 1 else f"S({p.dim},sf={p.split_factor})"
    return "R"


_PLACEMENT_RE = None


def _placement_of(text: Any) -> object:
    global _PLACEMENT_RE
    import re

    if _PLACEMENT_RE is None:
        _PLACEMENT_RE = re.compile(r"^S\((\d{1,2})(?:,sf=(\d{1,8}))?\)$")
    if text == "R":
        return Replicate()
    m = _PLACEMENT_RE.match(text) if isinstance(text, str) else None
    if m is None:
        raise ValueError(f"placement {text!r:.40} is not 'R', 'S(d)' or 'S(d,sf=k)'")
    return Shard(int(m.group(1)), int(m.group(2) or 1))


def layout_to_json(layout: RegularLayout) -> Dict[str, Any]:
    """The compact record of a regular layout (a few ints, whatever the world size).

    >>> layout_to_json(regular_layout((37, 7), (2, 2), (Shard(0, 2), Shard(0))))
    {'shape': [37, 7], 'mesh_shape': [2, 2], 'placements': ['S(0,sf=2)', 'S(0)']}
    """
    return {
        "shape": list(layout.shape),
        "mesh_shape": list(layout.mesh_shape),
        "placements": [_placement_text(p) for p in layout.placements],
    }


def layout_from_json(obj: Any) -> RegularLayout:
    """Parse (untrusted) :func:`layout_to_json` output back into a validated layout.

    Raises:
        ValueError: any field missing, of the wrong type, or describing an
            invalid layout (the format layer re-raises it naming the tensor).
    """
    if not isinstance(obj, dict):
        raise ValueError(f"layout record must be an object, found {type(obj).__name__}")
    vals = []
    for key in ("shape", "mesh_shape", "placements"):
        v = obj.get(key)
        if not isinstance(v, list) or len(v) > 64:
            raise ValueError(f"layout record field {key!r} must be a list of at most 64 entries, found {v!r:.80}")
        vals.append(v)
    shape, mesh_shape, placements = vals
    for key, v in (("shape", shape), ("mesh_shape", mesh_shape)):
        if any(not isinstance(n, int) or isinstance(n, bool) for n in v):
            raise ValueError(f"layout record field {key!r} must hold ints, found {v!r:.80}")
    return regular_layout(shape, mesh_shape, [_placement_of(p) for p in placements])


def _shard_dims(layout: RegularLayout) -> Tuple[int, ...]:
    """Mesh dims that pick the box; a zero-size tensor has one box held by all."""
    return _structure(layout)[0]


@_memo
def _structure(layout: RegularLayout) -> Tuple[Tuple[int, ...], Tuple[int, ...], int, int]:
    """``(shard dims, replica dims, shard count, replica count)``, once per distinct layout."""
    if any(n == 0 for n in layout.shape):
        sd: Tuple[int, ...] = ()
    else:
        sd = tuple(i for i, p in enumerate(layout.placements) if isinstance(p, Shard))
    rd = tuple(i for i in range(len(layout.mesh_shape)) if i not in sd)
    shards = _numel([layout.mesh_shape[i] for i in sd])
    return sd, rd, shards, layout.world // shards


def _radix(coord: Sequence[int], mesh_shape: Sequence[int], dims: Sequence[int]) -> int:
    idx = 0
    for i in dims:
        idx = idx * mesh_shape[i] + coord[i]
    return idx


def shard_count(layout: RegularLayout) -> int:
    """How many shard coordinates (distinct boxes or box sets, some maybe empty) the layout has."""
    return _structure(layout)[2]


def replica_count(layout: RegularLayout) -> int:
    """How many ranks hold each box."""
    return _structure(layout)[3]


def shard_index(layout: RegularLayout, coord: Sequence[int]) -> int:
    """Which box (set) the rank at mesh ``coord`` holds: row-major over the Shard mesh dims."""
    return _radix(coord, layout.mesh_shape, _shard_dims(layout))


def replica_index(layout: RegularLayout, coord: Sequence[int]) -> int:
    """Which of the box's holders the rank at ``coord`` is: row-major over the other mesh dims."""
    return _radix(coord, layout.mesh_shape, _structure(layout)[1])


def mesh_coord(layout: RegularLayout, shard: int, replica: int) -> Tuple[int, ...]:
    """The mesh coordinate of replica ``replica`` of shard index ``shard`` (inverse of the two above)."""
    sd, rd = _structure(layout)[:2]
    coord = [0] * len(layout.mesh_shape)
    for dims, idx in ((sd, shard), (rd, replica)):
        for i in reversed(dims):
            idx, coord[i] = divmod(idx, layout.mesh_shape[i])
        if idx:
            raise ValueError(f"index out of range for mesh {list(layout.mesh_shape)}")
    return tuple(coord)


def layout_chunks(layout: RegularLayout) -> Iterator[Tuple[int, List[Box]]]:
    """Every shard index with the boxes it holds, generated on demand (none stored).

    Shard indices whose boxes are empty (more ranks than rows) yield ``[]``.
    Together the boxes tile the tensor; ``layout_holders`` gives the same set.
    """
    for s in range(shard_count(layout)):
        yield s, [lb.box for lb in local_boxes(layout.shape, layout.mesh_shape, layout.placements, mesh_coord(layout, s, 0))]


@_memo
def _nominal_bytes(layout: RegularLayout, itemsize: int) -> int:
    """Bytes of the largest box set (shard index 0 holds a ceil share on every dim)."""
    ivs = dim_intervals(layout.shape, layout.mesh_shape, layout.placements, (0,) * len(layout.mesh_shape)) if all(layout.shape) else []
    return _numel([_length(iv) for iv in ivs]) * itemsize if ivs else 0


def writer_rotations(tensors: Sequence[Tuple[str, RegularLayout, int]]) -> Dict[str, int]:
    """Per tensor, the rotation that picks which replica writes each box.

    The rule (every rank derives it alone, from the names, shapes, dtypes and
    placements every rank of an SPMD program shares; cost O(T log T) for T
    tensors, independent of the world size): tensors whose layouts have the
    same replica structure (mesh shape and Replicate mesh dims, hence the same
    shard count) form a group; in a group, tensors are ordered by box size,
    largest first (ties by name), and ``rotation`` is the tensor's position in
    that order. Box ``s`` of a tensor is written by replica
    ``(rotation + s) % R`` of its R holders. So for every shard coordinate the
    R ranks holding it take the tensors' boxes round-robin, largest first,
    which keeps each rank's bytes within about one box of its co-holders'
    (exactly within the largest box when the shapes divide evenly); the
    ``+ s`` staggers which replica starts, so the big first tensors do not
    all land on replica 0. A plain (DDP-style) replicated state is the case
    S = 1: whole tensors dealt round-robin over all ranks.

    Args:
        tensors: ``(name, layout, itemsize)`` for every tensor of the save
            (the same list, in any order, on every rank).

    Returns:
        ``{name: rotation}``; use with :func:`is_writer` / :func:`writer_coord`.

    >>> lay = regular_layout((8, 2), (2, 2), (Replicate(), Shard(0)))
    >>> writer_rotations([("a", lay, 4), ("b", lay, 4)])
    {'a': 0, 'b': 1}
    """
    groups: Dict[Tuple[Any, ...], List[Tuple[int, str, RegularLayout]]] = {}
    for name, layout, size in tensors:
        key = (layout.mesh_shape, _structure(layout)[1])
        groups.setdefault(key, []).append((-_nominal_bytes(layout, size), name, layout))
    out: Dict[str, int] = {}
    for key in sorted(groups):
        members = groups[key]
        members.sort(key=lambda t: (t[0], t[1]))
        # One replica structure per group, hence one replica count.
        reps = replica_count(members[0][2])
        for pos, (_, name, _lay) in enumerate(members):
            out[name] = pos % reps
    return out


def writer_replica(layout: RegularLayout, rotation: int, shard: int) -> int:
    """The replica index that writes shard index ``shard``."""
    return (rotation + shard) % replica_count(layout)


def writer_coord(layout: RegularLayout, rotation: int, shard: int) -> Tuple[int, ...]:
    """Mesh coordinate of the rank that writes shard index ``shard`` (who wrote a chunk, on load)."""
    return mesh_coord(layout, shard, writer_replica(layout, rotation, shard))


def is_writer(layout: RegularLayout, rotation: int, coord: Sequence[int]) -> bool:
    """Whether the rank at ``coord`` writes the boxes it holds. O(mesh dims)."""
    return writer_replica(layout, rotation, shard_index(layout, coord)) == replica_index(layout, coord)


def boxes_to_write(layout: RegularLayout, rotation: int, coord: Sequence[int]) -> List[LocalBox]:
    """The boxes the rank at ``coord`` writes: its own boxes if it is their writer, else none.

    Cost proportional to the rank's own boxes; exactly one rank of the mesh
    writes each box, and the boxes written by all ranks tile the tensor.

    >>> lay = regular_layout((4,), (2,), (Replicate(),))
    >>> [len(boxes_to_write(lay, 1, (r,))) for r in range(2)]
    [0, 1]
    """
    if not is_writer(layout, rotation, coord):
        return []
    return local_boxes(layout.shape, layout.mesh_shape, layout.placements, coord)


def _parts_meeting(seq: Sequence[Interval], parts: int, split_factor: int, lo: int, hi: int) -> List[int]:
    """Part indices ``c`` whose ``_split(seq, parts, c, split_factor)`` meets global ``[lo, hi)``.

    ``seq`` is increasing in global position (splits keep it so), so the
    wanted range is one contiguous run of local positions; each of the
    ``split_factor`` pieces is then cut in ``parts`` equal parts.
    """
    p_lo = p_hi = pos = 0
    for s, n in seq:
        p_lo += min(max(lo - s, 0), n)
        p_hi += min(max(hi - s, 0), n)
        pos += n
    total = pos
    if p_hi <= p_lo:
        return []
    found: set = set()
    qs = -(-total // split_factor)
    for j in range(p_lo // qs, min(split_factor, (p_hi - 1) // qs + 1)):
        a, b = chunk_bounds(total, split_factor, j)
        u, v = max(p_lo, a) - a, min(p_hi, b) - a
        q = -(-(b - a) // parts) if b > a else 0
        if u < v and q:
            found.update(range(u // q, (v - 1) // q + 1))
    return sorted(found)


def chunks_overlapping(layout: RegularLayout, wanted: Box) -> List[Tuple[int, Box]]:
    """Saved boxes of a regular layout that meet ``wanted``, without listing the others.

    Args:
        layout: how the checkpoint's tensor was saved.
        wanted: a box the loading rank needs (global offsets and sizes).

    Returns:
        ``(shard index, saved box)`` for every saved box overlapping
        ``wanted``, sorted by box offsets; feed the boxes to
        :func:`plan_reads`. Empty for an empty ``wanted``.

    Cost: proportional to the number of boxes returned (times the mesh dims),
    not to the world size that saved: a rank of a 4,096-rank load of a
    4,096-rank save touches one chunk per tensor.

    >>> lay = regular_layout((8,), (4,), (Shard(0),))
    >>> chunks_overlapping(lay, Box((3,), (2,)))
    [(1, Box(offsets=(2,), sizes=(2,))), (2, Box(offsets=(4,), sizes=(2,)))]

    Memoized on ``(layout, wanted)``: the tensors of a model share a few
    layouts, so a load computes each distinct overlap once.
    """
    return list(_chunks_overlapping(layout, Box(tuple(wanted.offsets), tuple(wanted.sizes))))


@_memo
def _chunks_overlapping(layout: RegularLayout, wanted: Box) -> Tuple[Tuple[int, Box], ...]:
    shape = layout.shape
    if len(wanted.offsets) != len(shape) or wanted.numel == 0:
        return ()
    if any(n == 0 for n in shape):
        return ()
    sd = _shard_dims(layout)
    per_dim: List[List[Tuple[Dict[int, int], Interval]]] = []
    for d, n in enumerate(shape):
        lo, hi = max(wanted.offsets[d], 0), min(wanted.offsets[d] + wanted.sizes[d], n)
        if hi <= lo:
            return ()
        states: List[Tuple[Dict[int, int], List[Interval]]] = [({}, [(0, n)])]
        for i in sd:
            p: Any = layout.placements[i]
            if p.dim != d:
                continue
            nxt = []
            for sub, seq in states:
                for c in _parts_meeting(seq, layout.mesh_shape[i], p.split_factor, lo, hi):
                    nxt.append(({**sub, i: c}, _split(seq, layout.mesh_shape[i], c, p.split_factor)))
            states = nxt
        hits = [(sub, (s, k)) for sub, seq in states for s, k in seq if s < hi and s + k > lo]
        if not hits:
            return ()
        per_dim.append(hits)
    out = []
    for combo in itertools.product(*per_dim):
        coord = [0] * len(layout.mesh_shape)
        for sub, _ in combo:
            for i, c in sub.items():
                coord[i] = c
        box = Box(tuple(iv[0] for _, iv in combo), tuple(iv[1] for _, iv in combo))
        out.append((_radix(coord, layout.mesh_shape, sd), box))
    out.sort(key=lambda t: t[1].offsets)
    return tuple(out)
