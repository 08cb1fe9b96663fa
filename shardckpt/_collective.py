"""Collectives over a process group; every helper is a no-op without one."""

from __future__ import annotations

from typing import Any, List


def _pg_active(group) -> bool:
    import torch.distributed as dist

    return dist.is_available() and dist.is_initialized() and dist.get_world_size(group) > 1


def _broadcast(obj: Any, group) -> Any:
    import torch.distributed as dist

    if not _pg_active(group):
        return obj
    box = [obj]
    src = dist.get_global_rank(group, 0) if group is not None else 0
    dist.broadcast_object_list(box, src=src, group=group)
    return box[0]


def _all_gather(obj: Any, group) -> List[Any]:
    import torch.distributed as dist

    if not _pg_active(group):
        return [obj]
    out: List[Any] = [None] * dist.get_world_size(group)
    dist.all_gather_object(out, obj, group=group)
    return out
