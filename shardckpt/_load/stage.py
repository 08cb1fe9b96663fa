"""``atomic=True``: stream into staging tensors, and copy them in only once every rank streamed without error.

One extra copy of the rank's shard in host memory buys a load that changes
nothing when a block fails its checksum part-way.
"""

from __future__ import annotations

from typing import List, Sequence

import torch

from .plan import LoadPlan

__all__ = ["stage_targets", "copy_staged"]


def stage_targets(plan: LoadPlan) -> List[List[torch.Tensor]]:
    """Host tensors shaped like each destination: ``atomic=True`` streams into these first."""
    return [[torch.empty(tuple(dst.shape), dtype=dst.dtype) for _, dst in t.parts] for t in plan.targets]


def copy_staged(plan: LoadPlan, staged: Sequence[Sequence[torch.Tensor]]) -> None:
    """Copy every staged tensor into its live destination (after every rank agreed the stream succeeded)."""
    with torch.no_grad():
        for t, dsts in zip(plan.targets, staged):
            for (_, live), tmp in zip(t.parts, dsts):
                live.copy_(tmp)
