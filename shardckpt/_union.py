"""Rank-union saves: every rank saves the tensors and values it holds; rank 0 learns the union cheaply.

Ranks need not hold the same names: pipeline stages hold their own layers,
a save over a sub-group holds what its ranks hold. Each rank describes its
regular tensors (DTensors and plain tensors) by a small record per name and
sends it, with its value tree, through one ``DISTINCT`` exchange
(``_collective.agree``): ranks whose records and trees are identical (every
rank of a stage, every copy of a sub-mesh) send one copy between them, so
rank 0 receives a handful of maps, not N. Rank 0 (:func:`decide`, pure):

* checks that a name held by several ranks agrees in dtype, global shape and
  placements (else ``UnsupportedStateError`` naming the tensor and the ranks,
  raised on every rank before any byte is written);
* finds each tensor's true holders: a plain tensor is replicated over the
  ranks that hold it (not over the world); a DTensor over the copies of its
  mesh that hold it (not every copy its root mesh has: another pipeline
  stage holds other layers), in the group's rank numbering;
* picks the writer rotation over the union (``_geometry.writer_rotations``);
* merges the value trees (``_state.ranks.merge_values``): a path several
  ranks hold must agree, paths some ranks hold are kept.

Each group gets back only the corrections to the plan it made alone
(:func:`apply`): none when every rank holds the same names (the SPMD case),
so the reply stays small. Rank 0 keeps the union for the manifest
(:func:`with_peers`).
"""

from __future__ import annotations

import hashlib
import math
from dataclasses import replace
from typing import Any, Dict, List, Optional, Sequence, Tuple, cast

from . import _geometry
from ._format import itemsize, torch_dtype
from ._layout import TensorLayout, placement_str
from ._state.ranks import merge_values
from .errors import UnsupportedStateError, format_offenders

__all__ = ["records", "decide", "apply", "with_peers", "normalize", "Packed"]


def _ranks_sig(ranks: Optional[Sequence[int]]) -> str:
    text = "iota" if ranks is None else ",".join(map(str, ranks))
    return hashlib.blake2b(text.encode(), digest_size=8).hexdigest()


def _has_copies(lay: TensorLayout) -> bool:
    lj = lay.layout_json or {}
    return lay.kind == "dtensor" and len(cast(Any, lay.regular).mesh_shape) == len(lj.get("mesh_shape", ())) + 1


def _own_split(lay: TensorLayout) -> Tuple[int, int, _geometry.RegularLayout, Tuple[int, ...]]:
    """A DTensor's own mesh as ``(start, n)`` positions in its root mesh's rank list, its own layout and coordinate.

    Without the copies its root mesh implies; O(1) (no rank list is built).
    """
    reg = cast(_geometry.RegularLayout, lay.regular)  # a DTensor's layout has both
    coord = cast(Tuple[int, ...], lay.coord)
    if not _has_copies(lay):
        return 0, reg.world, reg, tuple(coord)
    n = math.prod(reg.mesh_shape[1:])
    own = _geometry.regular_layout(reg.shape, reg.mesh_shape[1:], list(reg.placements[1:]))
    return coord[0] * n, n, own, tuple(coord[1:])


#: A mesh in a record is ``(IOTA, first, n)`` when its ranks are
#: first..first+n-1 (FSDP2's whole world, an HSDP row), else its rank tuple.
#: Rank tuples hold only ints, so the tag cannot be mistaken for one.
IOTA = "iota"


def _mesh_ref(lay: TensorLayout, start: int, n: int, refs: Dict[Any, Any]) -> Any:
    """This DTensor's own mesh as it goes into its record: one object per distinct mesh on this rank.

    Meshes are shared by reference (pickle writes an object it has seen
    once) or as the iota form, so a rank's share holds each mesh once, not
    once per tensor: at 16,384 ranks a fresh ``tuple(range(world))`` per
    DTensor made 720 FSDP2 tensors 25 MiB (issue 29).
    """
    key = (id(lay.mesh_ranks), start, n)
    hit = refs.get(key)
    if hit is None:
        if lay.mesh_ranks is None:
            hit = (IOTA, start, n)
        else:
            own = tuple(lay.mesh_ranks[start : start + n])
            hit = (IOTA, own[0], n) if own == tuple(range(own[0], own[0] + n)) else own
            # Equal rank tuples from different mesh objects: one object too.
            hit = refs.setdefault(("content", hit), hit)
        refs[key] = hit
    return hit


def _expand(ref: Any, cache: Dict[Any, Tuple[int, ...]]) -> Tuple[int, ...]:
    """The rank tuple a record's mesh stands for (one object per distinct mesh)."""
    hit = cache.get(ref)
    if hit is None:
        hit = tuple(range(ref[1], ref[1] + ref[2])) if ref and ref[0] == IOTA else tuple(ref)
        cache[ref] = hit
    return hit


def normalize(layouts: Dict[str, TensorLayout], group_ranks: Sequence[int]) -> Dict[str, TensorLayout]:
    """Plain tensors: replicated over the group's global ranks (``mesh_ranks`` None: ranks 0..n-1)."""
    if tuple(group_ranks) == tuple(range(len(group_ranks))):
        return layouts
    ranks = tuple(group_ranks)
    return {
        n: (replace(lay, mesh_ranks=ranks) if lay.kind == "tensor" and lay.regular is not None else lay)
        for n, lay in layouts.items()
    }


def records(layouts: Dict[str, TensorLayout], rotations: Dict[str, int]) -> Dict[str, Tuple[Any, ...]]:
    """This rank's regular tensors: ``name -> (dtype, shape, placements record, own mesh, guess signature, rotation)``.

    The own mesh is None for a plain tensor (held by "whoever holds the
    name"), else the DTensor's own mesh ranks, as ``(IOTA, first, n)`` or a
    rank tuple shared by every record on that mesh (:func:`_mesh_ref`), so
    this rank's share does not grow with world size x tensor count; the
    guess signature digests the mesh and layout this rank planned with alone.
    """
    out = {}
    sigs: Dict[int, str] = {}
    refs: Dict[Any, Any] = {}
    # One object per distinct part (a 50,000-tensor state has a few dozen
    # layouts): pickle writes a repeated object once, then refers to it.
    parts: Dict[Any, Any] = {}
    for name, lay in layouts.items():
        if lay.regular is None:
            continue
        key = id(lay.mesh_ranks)
        if key not in sigs:
            sigs[key] = _ranks_sig(lay.mesh_ranks)
        gkey = ("guess", key, lay.regular)
        guess = parts.get(gkey)
        if guess is None:
            guess = parts[gkey] = sigs[key] + repr(_geometry.layout_to_json(lay.regular))
        if lay.kind == "dtensor":
            start, n, reg, _ = _own_split(lay)
            own = _mesh_ref(lay, start, n, refs)
            names = (lay.layout_json or {}).get("mesh_dim_names")
            pkey = ("place", reg, tuple(names) if names else None)
            place = parts.get(pkey)
            if place is None:
                place = parts[pkey] = (_geometry.layout_to_json(reg), names)
        else:
            own, place = None, None
        shape = parts.setdefault(("shape", tuple(lay.shape)), tuple(lay.shape))
        out[name] = (lay.dtype, shape, place, own, guess, rotations[name])
    return out


class Packed:
    """``value``, pickled zlib-compressed; unpickles to ``value`` itself (not a ``Packed``).

    What a rank shares in the save's first exchange (its records and value
    tree) travels through the store, one value at most
    ``_collective.MAX_VALUE_BYTES``. A 50,000-tensor state's share is ~4 MB
    pickled (names, a value tree of tensor references) and repeats a few
    layouts and name patterns: compressed it is ~0.7 MB, one value under
    1 MiB. Deterministic (the same value gives the same bytes), so identical
    ranks still share one copy.

        >>> import pickle
        >>> pickle.loads(pickle.dumps(Packed({"a": 1})))
        {'a': 1}
    """

    def __init__(self, value: Any) -> None:
        self.value = value

    def __reduce__(self) -> Tuple[Any, ...]:
        import pickle
        import zlib

        return (_unpack, (zlib.compress(pickle.dumps(self.value, protocol=pickle.HIGHEST_PROTOCOL), 1),))


def _unpack(blob: bytes) -> Any:
    import pickle
    import zlib

    return pickle.loads(zlib.decompress(blob))


def _span(positions: Sequence[int]) -> str:
    return format_offenders(sorted(positions)[:8]) + (" ..." if len(positions) > 8 else "")


def decide(groups, group_ranks: Sequence[int], url: str, keep: Dict[str, Any]):
    """Rank 0: check and merge the distinct groups' records and trees; the corrections for each group.

    ``groups`` are ``_collective.Group``s whose value is ``(records, tree)``.
    Fills ``keep`` with ``"tree"`` (the merged values) and ``"truth"``
    (name -> (dtype, shape, layout_json, mesh ranks, layout, rotation)).

    Raises:
        UnsupportedStateError: plain values, or a tensor's dtype, shape or
            placements, differ between ranks (named, with the ranks).
    """
    merged, paths = merge_values([g.value[1] for g in groups])
    if paths:
        raise UnsupportedStateError(
            f"save to {url} refused: these plain values differ between ranks, and only one rank's would be "
            f"saved: {format_offenders(paths)}. Wrap per-rank state in shardckpt.PerRank(...) (e.g. "
            "{'loader': shardckpt.PerRank(loader)}) so each rank keeps its own copy, or make the values "
            "the same on every rank"
        )
    pos = {r: i for i, r in enumerate(group_ranks)}
    entries: Dict[str, List[Tuple[int, Tuple[Any, ...]]]] = {}
    for gi, g in enumerate(groups):
        for name, rec in g.value[0].items():
            entries.setdefault(name, []).append((gi, rec))
    bad: List[str] = []
    truth: Dict[str, Tuple[Any, ...]] = {}
    plain_meshes: Dict[Tuple[int, ...], Tuple[Any, int]] = {}
    dt_meshes: Dict[Any, Tuple[List[Tuple[int, ...]], List[int], Optional[Tuple[int, ...]]]] = {}
    expanded: Dict[Any, Tuple[int, ...]] = {}
    for name in sorted(entries):
        ents = entries[name]
        first = ents[0][1]
        for gi, rec in ents[1:]:
            if rec[:3] != first[:3] or (rec[3] is None) != (first[3] is None):
                bad.append(
                    f"{name}: dtype {first[0]}, shape {list(first[1])}, layout {first[2]} on ranks "
                    f"{_span(groups[ents[0][0]].ranks)} but dtype {rec[0]}, shape {list(rec[1])}, layout {rec[2]} "
                    f"on ranks {_span(groups[gi].ranks)}"
                )
                break
        else:
            dtype, shape = first[0], tuple(first[1])
            if first[3] is None:
                # Holders are a union of groups: computed once per set of groups, O(N) each.
                gset = tuple(gi for gi, _ in ents)
                if gset not in plain_meshes:
                    holders = sorted(p for gi in gset for p in groups[gi].ranks)
                    m = tuple(group_ranks[p] for p in holders)
                    plain_meshes[gset] = None if m == tuple(range(len(m))) else m, len(m)
                mesh, count = plain_meshes[gset]
                reg = _geometry.RegularLayout(shape, (count,), (_geometry.Replicate(),))
                rows = None
            else:
                # Per set of meshes (one, or one per copy), once: O(N) each, not per tensor.
                mkey = frozenset(rec[3] for _, rec in ents)
                if mkey not in dt_meshes:
                    rows_ = sorted({_expand(ref, expanded) for ref in mkey})
                    outside = sorted({r for row in rows_ for r in row if r not in pos})
                    flat = tuple(r for row in rows_ for r in row)
                    dt_meshes[mkey] = rows_, outside, (None if flat == tuple(range(len(flat))) else flat)
                rows, outside, mesh = dt_meshes[mkey]
                if outside:
                    bad.append(
                        f"{name}: its mesh holds ranks {format_offenders(outside)} (global) outside the process group "
                        "of this save, so their shards would not be written; save over a group that contains the "
                        "whole mesh"
                    )
                    continue
                own = _geometry.layout_from_json(first[2][0])
                if len(rows) == 1:
                    reg = own
                else:
                    reg = _geometry.regular_layout(shape, (len(rows),) + own.mesh_shape, [_geometry.Replicate()] + list(own.placements))
            truth[name] = (dtype, shape, first[2], mesh, reg, rows)
    if bad:
        raise UnsupportedStateError(
            f"save to {url} refused: tensors held by several ranks must agree in dtype, shape and placements: "
            + format_offenders(bad, sep="; ")
        )
    rotations = _geometry.writer_rotations([(n, t[4], itemsize(t[0])) for n, t in truth.items()])
    keep["tree"] = merged
    keep["truth"] = {n: t[:5] + (rotations[n],) for n, t in truth.items()}
    pieces = []
    sigs: Dict[Any, str] = {}
    for g in groups:
        meshes: List[Any] = []
        mesh_ids: Dict[Any, int] = {}
        fix: Dict[str, Tuple[Any, ...]] = {}
        for name, rec in g.value[0].items():
            dtype, shape, place, mesh, reg, rows = truth[name]
            if mesh not in sigs:
                sigs[mesh] = _ranks_sig(mesh)
            rot = rotations[name]
            if sigs[mesh] + repr(_geometry.layout_to_json(reg)) == rec[4] and rot == rec[5]:
                continue
            if mesh not in mesh_ids:
                mesh_ids[mesh] = len(meshes)
                meshes.append(mesh)
            row = None if rows is None else (rows.index(_expand(rec[3], expanded)) if len(rows) > 1 else -1)
            fix[name] = (mesh_ids[mesh], _geometry.layout_to_json(reg), rot, row)
        pieces.append({"meshes": meshes, "fix": fix} if fix else None)
    return None, pieces


def apply(layouts: Dict[str, TensorLayout], piece: Optional[Dict[str, Any]], me: int) -> Dict[str, TensorLayout]:
    """This rank's layouts with rank 0's corrections (``me``: this process's global rank)."""
    if not piece:
        return layouts
    out = dict(layouts)
    meshes = piece["meshes"]
    index: Dict[int, Dict[int, int]] = {}
    for name, (mi, reg_json, rot, row) in piece["fix"].items():
        lay = layouts[name]
        reg = _geometry.layout_from_json(reg_json)
        mesh = meshes[mi]
        if row is None:  # a plain tensor: its place among the holders
            if mi not in index:
                index[mi] = {r: i for i, r in enumerate(mesh if mesh is not None else range(reg.world))}
            coord: Tuple[int, ...] = (index[mi][me],)
        else:
            _, _, _, own_coord = _own_split(lay)
            coord = own_coord if row < 0 else (row,) + own_coord
        out[name] = replace(lay, regular=reg, mesh_ranks=mesh, coord=coord, rotation=rot)
    return out


def with_peers(layouts: Dict[str, TensorLayout], keep: Dict[str, Any]) -> Dict[str, TensorLayout]:
    """Rank 0: add the tensors other ranks hold (no local parts), with their true layouts, for the manifest."""
    out = dict(layouts)
    for name, (dtype, shape, place, mesh, reg, rot) in keep.get("truth", {}).items():
        if name in out:
            out[name] = replace(out[name], rotation=rot)
            continue
        lj = None
        kind = "tensor"
        if place is not None:
            own = _geometry.layout_from_json(place[0])
            lj = {
                "mesh_shape": list(own.mesh_shape),
                "mesh_dim_names": place[1],
                "placements": [placement_str(p) for p in own.placements],
            }
            kind = "dtensor"
        out[name] = TensorLayout(
            name=name, dtype=dtype, torch_dtype=torch_dtype(dtype), shape=tuple(shape), parts=[], holders={},
            layout_json=lj, kind=kind, regular=reg, mesh_ranks=mesh, coord=None, rotation=rot,
        )
    return {n: out[n] for n in sorted(out)}
