"""Live tensors -> geometry: which boxes of which global tensor this rank holds.

Bridges torch objects (plain tensors, DTensors, ShardedTensors) to the pure
geometry in ``_geometry``. A :class:`TensorLayout` lists the rank's parts — each a
box of the global tensor and the local tensor it lives in — and, for writer
assignment, which ranks hold every box.
"""

from __future__ import annotations

import itertools
import math
from dataclasses import dataclass
from typing import Any, Dict, List, Optional, Sequence, Tuple

import torch

from . import _geometry
from ._format import dtype_name
from .errors import UnsupportedStateError

__all__ = ["TensorLayout", "Part", "layout_of", "is_dtensor", "is_sharded_tensor", "box_view", "placement_str"]


@dataclass
class Part:
    """A box of the global tensor held here, and the tensor whose region it is."""

    box: _geometry.Box
    tensor: torch.Tensor  # the local tensor (a DTensor's _local_tensor, a shard...)
    local_offsets: Tuple[int, ...]

    def view(self) -> torch.Tensor:
        if 0 in self.box.sizes:
            # No bytes: a zero-size box may be wider than this rank's (also
            # empty) shard in another dim (a (0, 4) DTensor under
            # [Shard(0), Shard(1)]), where narrowing would raise (issue 19).
            return self.tensor.new_empty(tuple(self.box.sizes))
        return box_view(self.tensor, self.local_offsets, self.box.sizes)


@dataclass
class TensorLayout:
    """One live tensor's geometry on this rank.

    A *regular* tensor (a DTensor, or a plain tensor replicated over the
    world) has ``regular`` (its ``_geometry.RegularLayout``), ``mesh_ranks`` (the
    global rank at each coordinate of that mesh, row-major; None: ranks
    0..n-1) and ``coord`` (this rank's coordinate): enough to plan this rank's
    writes in time independent of the world size. Other tensors
    (ShardedTensor, per-rank data) list ``holders``: every box -> its ranks.
    """

    name: str
    dtype: str  # safetensors name
    torch_dtype: torch.dtype
    shape: Tuple[int, ...]
    parts: List[Part]
    holders: Dict[_geometry.Box, Tuple[int, ...]]  # irregular tensors: every box -> global ranks
    layout_json: Optional[Dict[str, Any]] = None
    kind: str = "tensor"  # "tensor" | "dtensor" | "sharded_tensor"
    regular: Optional[_geometry.RegularLayout] = None
    mesh_ranks: Optional[Tuple[int, ...]] = None
    coord: Optional[Tuple[int, ...]] = None
    #: The writer rotation rank 0 chose over the union of every rank's
    #: tensors (a rank-union save); None: the one this rank computes alone.
    rotation: Optional[int] = None


def box_view(t: torch.Tensor, offsets: Sequence[int], sizes: Sequence[int]) -> torch.Tensor:
    """The region ``offsets``/``sizes`` of ``t`` as a view (no copy)."""
    v = t
    for d, (o, n) in enumerate(zip(offsets, sizes)):
        if o != 0 or n != v.shape[d]:
            v = v.narrow(d, o, n)
    return v


def is_dtensor(t: Any) -> bool:
    try:
        from torch.distributed.tensor import DTensor
    except ImportError:  # pragma: no cover - torch built without distributed
        return False
    return isinstance(t, DTensor)


def is_sharded_tensor(t: Any) -> bool:
    try:
        from torch.distributed._shard.sharded_tensor import ShardedTensor
    except ImportError:  # pragma: no cover
        return False
    return isinstance(t, ShardedTensor)


def _placements(name: str, dt) -> List[object]:
    from torch.distributed.tensor import Replicate, Shard

    try:
        from torch.distributed.tensor.placement_types import _StridedShard
    except ImportError:  # pragma: no cover - very old torch
        _StridedShard = ()  # type: ignore[misc, assignment]  # isinstance(p, ()) is False
    out: List[object] = []
    for i, p in enumerate(dt.placements):
        if _StridedShard and isinstance(p, _StridedShard):  # type: ignore[truthy-function]
            sf = p._split_factor_int() if hasattr(p, "_split_factor_int") else int(p.split_factor)
            out.append(_geometry.Shard(p.dim, sf))
        elif isinstance(p, Shard):
            out.append(_geometry.Shard(p.dim))
        elif isinstance(p, Replicate):
            out.append(_geometry.Replicate())
        else:
            raise UnsupportedStateError(
                f"{name}: placement {p} on mesh dim {i} cannot be saved: a Partial DTensor holds unreduced values. "
                "Call .redistribute(placements=[Replicate()]) (or .full_tensor()) first."
            )
    return out


def placement_str(p: object) -> str:
    """A placement as the layout JSON writes it: ``"S(dim)"`` (``"S(dim,sf=n)"`` strided) or ``"R"``."""
    if isinstance(p, _geometry.Shard):
        return f"S({p.dim})" if p.split_factor == 1 else f"S({p.dim},sf={p.split_factor})"
    return "R"


def layout_of(name: str, t: Any, *, rank: int, world_size: int, local_only: bool = False) -> TensorLayout:
    """Geometry of one live tensor on this rank.

    ``local_only`` (``no_dist=True``): this process alone saves or loads, so
    the tensor must be whole here; a DTensor on a mesh of one rank counts as
    whole and is written by this process (rank 0 of a world of one).

    Raises:
        UnsupportedStateError: a Partial placement, or with ``local_only`` a
            tensor sharded over several ranks (named, with the fix).
    """
    if local_only and (is_dtensor(t) or is_sharded_tensor(t)):
        return _whole_here(name, t)
    if is_dtensor(t):
        return _dtensor_layout(name, t)
    if is_sharded_tensor(t):
        return _sharded_tensor_layout(name, t)
    if not isinstance(t, torch.Tensor):
        raise UnsupportedStateError(f"{name}: expected a tensor, found {type(t).__name__}")
    shape = tuple(t.shape)
    whole = _geometry.Box((0,) * len(shape), shape)
    return TensorLayout(
        name=name,
        dtype=dtype_name(t.dtype, key=name),
        torch_dtype=t.dtype,
        shape=shape,
        parts=[Part(whole, t, (0,) * len(shape))],
        # A plain tensor in a distributed save is taken as replicated (as in
        # DDP); per-rank data must be marked per-rank by the state layer.
        holders={},
        regular=_replicated(shape, world_size),
        coord=(rank,),
    )


def _replicated(shape: Tuple[int, ...], world: int) -> _geometry.RegularLayout:
    return _geometry.RegularLayout(tuple(shape), (world,), (_geometry.Replicate(),))


def _whole_here(name: str, t: Any) -> TensorLayout:
    lay = _dtensor_layout(name, t) if is_dtensor(t) else _sharded_tensor_layout(name, t)
    whole = _geometry.Box((0,) * len(lay.shape), tuple(lay.shape))
    if len(lay.parts) != 1 or lay.parts[0].box != whole:
        if lay.regular is not None:
            ranks = sorted(lay.mesh_ranks) if lay.mesh_ranks is not None else list(range(lay.regular.world))
        else:
            ranks = sorted({r for rs in lay.holders.values() for r in rs})
        raise UnsupportedStateError(
            f"{name}: sharded over ranks {ranks}, so this process holds only part of it and no_dist=True "
            "cannot save or load it. Call it from every rank without no_dist, or use a full copy "
            "(DTensor.full_tensor(), or a model built without sharding)"
        )
    # Whatever global rank the one-rank mesh has, this process is rank 0 of a world of one.
    lay.holders = {}
    lay.regular, lay.mesh_ranks, lay.coord = _replicated(lay.shape, 1), None, (0,)
    return lay


#: DTensor geometry by (mesh, placements, global shape, local shape). The same
#: parameters are laid out again at every save, and computing it
#: (``DeviceMesh.mesh``, boxes, holders) costs ~100 us a tensor, paid inside
#: the training stall of an async save. Values hold the mesh, so ids are not reused.
_GEOMETRY_CACHE: Dict[Any, Any] = {}
_GEOMETRY_CACHE_MAX = 1 << 16


def _dtensor_layout(name: str, t) -> TensorLayout:
    mesh = t.device_mesh
    local = t._local_tensor
    try:
        key = (id(mesh), tuple(t.placements), tuple(t.shape), tuple(local.shape))
        hit = _GEOMETRY_CACHE.get(key)
    except TypeError:  # unhashable placement: no caching
        key, hit = None, None
    if hit is None or hit[0] is not mesh:
        hit = (mesh, _dtensor_geometry(name, t))
        if key is not None:
            if len(_GEOMETRY_CACHE) >= _GEOMETRY_CACHE_MAX:
                _GEOMETRY_CACHE.clear()
            _GEOMETRY_CACHE[key] = hit
    shape, boxes, regular, mesh_ranks, coord, layout_json = hit[1]
    return TensorLayout(
        name=name,
        dtype=dtype_name(t.dtype, key=name),
        torch_dtype=t.dtype,
        shape=shape,
        parts=[Part(box, local, offsets) for box, offsets in boxes],
        holders={},
        layout_json=dict(layout_json),
        kind="dtensor",
        regular=regular,
        mesh_ranks=mesh_ranks,
        coord=coord,
    )


def _dtensor_geometry(name: str, t):
    """``(shape, [(box, local offsets)], regular layout, mesh ranks, coord, layout_json)`` of a DTensor on this rank.

    Costs O(own boxes) per tensor plus O(mesh) once per mesh (its copies in
    the root mesh): no enumeration of other ranks' boxes.
    """
    mesh = t.device_mesh
    placements = _placements(name, t)
    shape = tuple(t.shape)
    mesh_shape = tuple(mesh.shape)
    local = t._local_tensor
    coord = mesh.get_coordinate()
    if coord is None:
        raise UnsupportedStateError(f"{name}: this rank is not part of the DTensor's mesh")
    per_dim = _geometry.dim_intervals(shape, mesh_shape, placements, coord) if all(shape) else None
    if per_dim is not None:
        expect = tuple(sum(n for _, n in ivs) for ivs in per_dim)
        if expect != tuple(local.shape):
            raise UnsupportedStateError(
                f"{name}: local shard has shape {tuple(local.shape)} but placements "
                f"{t.placements} on mesh {mesh_shape} give {expect} for global shape {shape}; "
                "this torch version lays out the placement differently than shardckpt expects"
            )
    boxes = [(lb.box, lb.local_offsets) for lb in _geometry.local_boxes(shape, mesh_shape, placements, coord)]
    copies, ranks, copy_index = _mesh_ranks(mesh)
    try:
        if copies > 1:
            # Copies of a sub-mesh along other root dims: one leading Replicate dim.
            regular = _geometry.regular_layout(shape, (copies,) + mesh_shape, [_geometry.Replicate()] + placements)
            full_coord = (copy_index,) + tuple(coord)
        else:
            regular = _geometry.regular_layout(shape, mesh_shape, placements)
            full_coord = tuple(coord)
    except ValueError as e:
        # dim_intervals accepted it above, so this is a limit of the compact
        # record (say a mesh over MAX_MESH_RANKS): not expected in practice.
        raise UnsupportedStateError(f"{name}: placements {t.placements} on mesh {mesh_shape}: {e}") from None
    names = list(mesh.mesh_dim_names) if mesh.mesh_dim_names else None
    layout_json = {
        "mesh_shape": list(mesh_shape),
        "mesh_dim_names": names,
        "placements": [placement_str(p) for p in placements],
    }
    return shape, boxes, regular, ranks, full_coord, layout_json


#: Per mesh (by id, the mesh kept alive in the value): (copies, rank list or
#: None for 0..n-1, this rank's copy index). O(mesh) once per mesh.
_MESH_CACHE: Dict[int, Any] = {}


def _mesh_ranks(mesh) -> Tuple[int, Optional[Tuple[int, ...]], int]:
    hit = _MESH_CACHE.get(id(mesh))
    if hit is not None and hit[0] is mesh:
        return hit[1]
    import torch.distributed as dist

    rows = _mesh_copies(mesh)
    flat = tuple(r for row in rows for r in row)
    me = dist.get_rank() if dist.is_available() and dist.is_initialized() else flat[0]
    copy_index = next((i for i, row in enumerate(rows) if me in row), 0)
    got = (len(rows), None if flat == tuple(range(len(flat))) else flat, copy_index)
    if len(_MESH_CACHE) >= _GEOMETRY_CACHE_MAX:
        _MESH_CACHE.clear()
    _MESH_CACHE[id(mesh)] = (mesh, got)
    return got


def _mesh_copies(mesh) -> List[List[int]]:
    """Rank lists (in mesh order) of every parallel copy of a sub-mesh within its root mesh.

    A DTensor on a sub-mesh (FSDP2 on the ``dp`` dim of a ``dp x tp`` mesh,
    for a parameter TP leaves alone) is replicated over the other root dims:
    the ranks of each copy hold the same boxes. Every rank must see all
    copies, or ranks of different copies would each pick a different writer
    for the same box. Found from the root mesh alone, without communication:
    the copies are the rows of the root mesh with the sub-mesh's dims (in
    its order, flattened dims too) moved last.
    """
    own = [int(r) for r in mesh.mesh.flatten().tolist()]
    root = None
    try:
        if hasattr(mesh, "_get_root_mesh"):
            root = mesh._get_root_mesh()
        else:  # older torch keeps the parent link in a registry
            from torch.distributed.device_mesh import _mesh_resources

            root = _mesh_resources.get_root_mesh(mesh)
    except Exception:
        root = None
    if root is None or root is mesh or root.mesh.numel() == len(own):
        return [own]
    full = root.mesh
    nd = full.ndim
    for k in range(1, nd + 1):
        for dims in itertools.permutations(range(nd), k):
            if math.prod(full.shape[d] for d in dims) != len(own):
                continue
            rest = [d for d in range(nd) if d not in dims]
            rows = full.permute(*rest, *dims).reshape(-1, len(own)).tolist()
            if own in rows:
                return [[int(r) for r in row] for row in rows]
    return [own]


def _sharded_tensor_layout(name: str, st) -> TensorLayout:
    shape = tuple(st.size())
    md = st.metadata()
    holders: Dict[_geometry.Box, Tuple[int, ...]] = {}
    for sm in md.shards_metadata:
        box = _geometry.Box(tuple(sm.shard_offsets), tuple(sm.shard_sizes))
        rank = sm.placement.rank() if sm.placement is not None else 0
        holders[box] = tuple(sorted(set(holders.get(box, ())) | {int(rank)}))
    parts = []
    for shard in st.local_shards():
        box = _geometry.Box(tuple(shard.metadata.shard_offsets), tuple(shard.metadata.shard_sizes))
        parts.append(Part(box, shard.tensor, (0,) * len(shape)))
    dtype = md.tensor_properties.dtype
    return TensorLayout(
        name=name,
        dtype=dtype_name(dtype, key=name),
        torch_dtype=dtype,
        shape=shape,
        parts=parts,
        holders=holders,
        layout_json={"sharded_tensor": True},
        kind="sharded_tensor",
    )
