"""``PerRank``: values that differ across ranks, saved once per rank, and their built-in adapter."""

from __future__ import annotations

from typing import Any, Dict

import torch

from .._format.values import TAG, is_tensor_ref
from ..errors import CorruptCheckpointError, StateMismatchError, UnsupportedStateError
from .base import (
    MISSING,
    SEP,
    Adapter,
    Raw,
    fill_from_saved,
    is_tensor,
)
from .walker import LoadWalker

__all__ = ["PER_RANK_MARK", "PerRank", "PerRankAdapter", "per_rank_prefix"]


PER_RANK_MARK = "@rank"


class PerRank:
    """Mark a value as per-rank: every rank saves and restores its own copy.

    Most training state is global (the same on every rank, or one sharded
    tensor). Some is not: a data loader's position, a sampler's shuffle
    state, RNG streams. Wrap such a value and each rank's copy is kept
    separately: its JSON values go to ``manifest.extra["per_rank"][rank]``,
    its tensors are written by that rank alone under names containing
    ``@rank<r>`` (``loader.@rank1.buffer``).

    Args:
        obj: an object with ``state_dict()``/``load_state_dict()``, a dict
            (filled in place on load), or a tensor.
        on_resize: what a load does when the checkpoint was saved by a
            different number of ranks. ``"error"`` (default) raises
            ``StateMismatchError`` before anything is loaded. ``"skip"`` keeps
            every rank's live value (an explicit choice, nothing is loaded).
            A callable ``fn(saved, rank, world) -> state`` gets the list of
            all saved ranks' states (JSON values decoded, tensors as full CPU
            tensors) and returns the state for this rank, which goes to
            ``obj.load_state_dict`` (or into the dict).

    A multi-rank save compares every rank's plain values: values that differ
    across ranks and are not wrapped are refused (``UnsupportedStateError``
    naming their paths), never saved from rank 0 alone.

    Same world size: rank ``r`` gets what rank ``r`` saved. The saving and
    loading groups are matched by rank within ``process_group``.

    Example:
        >>> loader_state = {"epoch": 0, "position": 0}
        >>> state = {"model": model, "loader": shardckpt.PerRank(loader_state)}  # doctest: +SKIP
        >>> shardckpt.save(state, url)                                           # doctest: +SKIP

        Resuming 4 ranks' positions on 2 ranks, each taking two old shards::

            def remap(saved, rank, world):
                mine = saved[rank::world]
                return {"epoch": mine[0]["epoch"], "position": sum(s["position"] for s in mine)}

            state = {"loader": shardckpt.PerRank(loader_state, on_resize=remap)}
    """

    def __init__(self, obj: Any, *, on_resize: Any = "error"):
        if not (on_resize in ("error", "skip") or callable(on_resize)):
            raise UnsupportedStateError(f"PerRank on_resize must be 'error', 'skip' or a callable, got {on_resize!r}")
        if isinstance(obj, PerRank):
            raise UnsupportedStateError("PerRank(PerRank(...)): wrap the value once")
        self.obj = obj
        self.on_resize = on_resize

    def __repr__(self) -> str:
        return f"PerRank({self.obj!r}, on_resize={self.on_resize!r})"


def per_rank_prefix(path: str, rank: int) -> str:
    return f"{path}{SEP}{PER_RANK_MARK}{rank}"


class PerRankAdapter(Adapter):
    """:class:`PerRank` values (and :class:`shardckpt.RNGState`)."""

    def matches(self, obj):
        return isinstance(obj, PerRank)

    def save(self, obj, path, walker):
        walker.per_rank_depth += 1
        try:
            node = walker.walk(obj.obj, per_rank_prefix(path, walker.rank))
        finally:
            walker.per_rank_depth -= 1
        if path in walker.flat.per_rank:
            raise UnsupportedStateError(f"{path}: two per-rank entries map to the same name")
        walker.flat.per_rank[path] = node
        return Raw({TAG: "per_rank", "world_size": walker.world})

    def load(self, obj, path, saved, walker):
        if saved is MISSING:
            walker.missing_values.append(path)
            return
        if not (isinstance(saved, dict) and saved.get(TAG) == "per_rank"):
            raise StateMismatchError(f"{path}: the checkpoint holds a plain value here, the live state a PerRank value")
        saved_world = walker.saved_world
        trees = walker.per_rank
        if not isinstance(trees, list) or len(trees) != saved_world or not all(isinstance(t, dict) for t in trees):
            raise CorruptCheckpointError(
                f"{path}: per-rank state is damaged: manifest extra['per_rank'] must list one dict for each of "
                f"the {saved_world} saving ranks"
            )
        lost = [r for r in range(saved_world) if path not in trees[r]]
        if lost:
            raise CorruptCheckpointError(f"{path}: per-rank state of rank(s) {lost} is missing from the manifest")
        # Other ranks' tensors are theirs, not unexpected.
        walker.flat.skip.extend(per_rank_prefix(path, r) for r in range(saved_world) if r != walker.rank or saved_world != walker.world)
        if saved_world == walker.world:
            prefix = per_rank_prefix(path, walker.rank)
            _load_into(obj.obj, trees[walker.rank][path], prefix, walker)
            return
        if obj.on_resize == "error":
            raise StateMismatchError(
                f"{path}: per-rank state was saved by {saved_world} ranks but this load runs on {walker.world}; "
                "one rank's state cannot be split or merged automatically. Load with "
                f"{saved_world} ranks, or wrap it as PerRank(obj, on_resize=fn) to remap the {saved_world} saved "
                "states, or on_resize='skip' to keep the live values, or leave "
                f"{path!r} out of the state you load"
            )
        if obj.on_resize == "skip":
            return
        holders = []
        for r in range(saved_world):
            h: Dict[str, Any] = {}
            fill_from_saved(h, "v", trees[r][path], per_rank_prefix(path, r), walker)
            holders.append(h)
        fn, rank, world = obj.on_resize, walker.rank, walker.world

        def remap():
            _apply_state(obj.obj, fn([h["v"] for h in holders], rank, world), path)

        walker.flat.finalizers.append(remap)


def _load_into(live: Any, saved: Any, prefix: str, walker: LoadWalker) -> None:
    if isinstance(live, dict):
        # The dict is the user's object: refill it rather than replace it.
        def refill(v, d=live):
            d.clear()
            d.update(v)

        walker.walk(live, saved, prefix, refill)
        return
    if is_tensor(live):
        if is_tensor_ref(saved):
            walker.target(saved["name"], live)
        else:
            walker.missing_values.append(prefix + " (not saved as a tensor)")
        return
    adapter = walker.adapter_for(live)
    if adapter is None:
        raise UnsupportedStateError(
            f"{prefix}: PerRank needs a dict, a tensor or an object with state_dict()/load_state_dict(), "
            f"got {type(live).__name__}"
        )
    adapter.load(live, prefix, saved, walker)


def _apply_state(live: Any, new: Any, path: str) -> None:
    if isinstance(live, dict):
        if not isinstance(new, dict):
            raise StateMismatchError(f"{path}: on_resize returned {type(new).__name__}, the live value is a dict")
        live.clear()
        live.update(new)
    elif is_tensor(live):
        with torch.no_grad():
            live.copy_(new)
    else:
        live.load_state_dict(new)
