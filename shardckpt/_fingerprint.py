"""Replica fingerprints: catch diverged copies of replicated state before a save commits.

A save writes each replicated box once (DDP replicas, HSDP's replicate dim,
tensors replicated over a tensor-parallel group, the scalars every rank
holds). If the copies have diverged — silent data corruption on one GPU, a
non-deterministic kernel, a bug that updated one replica differently — the
checkpoint would freeze one version and lose the evidence. So, before any
byte is written, every holder of a replicated box computes a fingerprint of
its own copy where the data lives (on the GPU for GPU tensors: only three
integers per box cross to the host) and the fingerprints meet on rank 0
through one ``distinct``-mode agreement: replicas that agree post identical
values, which travel once, so the exchange is O(N) store round trips and its
payload grows with the number of distinct shard positions, not with the
number of replicas.

The fingerprint (:func:`fingerprint`) reads a box's bytes as 32-bit words
``w[0..m)`` (bytes when the size is not a multiple of 4), laid out as rows of
``FP_ROW_WORDS``, and returns two int64 sums, modulo 2**64:

* ``S0 = sum(w[i])``: a single flipped bit changes one word by ``±2**j``
  (``j < 32``), so ``S0`` changes by ``±2**j``, which is never 0 modulo
  2**64: **every single-bit flip is caught**, whatever the tensor's size or
  dtype (integer sums are exact and order-free, so GPUs, CPUs and kernels
  agree bit for bit);
* ``S1 = sum((2r + 1) * rowsum[r])``: odd weights by row, so rows that
  trade places (a misrouted or stale piece of a copy) change ``S1``.

Words that trade places within one row (4 KiB) are not seen; nor is a
change that leaves both sums equal. One pass over the bytes, a row-wise
reduction where the data lives: memory-bound on a GPU.

It is a check against corruption, not an adversary: two copies made to
collide on purpose would pass. Pure planning and comparison
(:func:`compare`, :func:`describe`) take plain values and are tested with ints.
"""

from __future__ import annotations

import logging
from typing import Any, Dict, List, Mapping, Optional, Sequence, Tuple

import torch

from . import _geometry, _knobs
from ._collective import DISTINCT, Comm, Group, agree
from ._layout import TensorLayout
from .errors import MAX_OFFENDERS, ReplicaDivergenceError, UsageError

__all__ = [
    "REPLICA_MODES",
    "FP_ROW_WORDS",
    "fingerprint",
    "replicated_parts",
    "local_fingerprints",
    "compare",
    "describe",
    "check_replicas",
    "replicas_mode",
]

log = logging.getLogger("shardckpt")

#: What ``save(replicas=...)`` accepts: refuse a diverged save, commit it with
#: a warning, or skip the check.
REPLICA_MODES = ("check", "warn", "off")

#: Words per row of the fingerprint's row/column weighting: a row is summed on
#: the device in one reduction; the column sums are a vector of this length.
FP_ROW_WORDS = 1024

#: A box's key in the exchange: (tensor name, offsets, sizes).
Key = Tuple[str, Tuple[int, ...], Tuple[int, ...]]


def replicas_mode(replicas: Optional[str]) -> str:
    """The mode to use: ``replicas`` if given, else ``SHARDCKPT_REPLICAS``; validated.

    Raises:
        UsageError: not one of ``REPLICA_MODES``.
    """
    mode = _knobs.REPLICAS if replicas is None else replicas
    if mode not in REPLICA_MODES:
        raise UsageError(f"replicas={mode!r}: expected one of {', '.join(map(repr, REPLICA_MODES))}")
    return mode


def _words(t: torch.Tensor) -> torch.Tensor:
    t = t.detach()
    if t.is_conj() or t.is_neg():
        # A lazy conj/neg view cannot be viewed as bytes; its values are what
        # the writers store (_io.tensor_bytes resolves them the same way).
        t = t.resolve_conj().resolve_neg()
    b = t.contiguous().reshape(-1).view(torch.uint8)
    if b.numel() % 4:
        return b
    if b.storage_offset() % 4:  # a view at an odd offset: the same words as its aligned copy
        b = b.clone()
    return b.view(torch.int32)


def fingerprint(t: torch.Tensor) -> torch.Tensor:
    """Two int64 sums of ``t``'s bytes (see the module docstring), on ``t``'s device.

    One pass over the bytes (a row-wise reduction) and no copy to the host:
    the caller gathers the results of many tensors and moves them in one
    transfer.

    >>> a = torch.arange(10, dtype=torch.float32)
    >>> b = a.clone(); b.view(torch.int32)[3] ^= 1   # one flipped bit
    >>> bool((fingerprint(a) != fingerprint(b)).any())
    True
    """
    w = _words(t)
    dev = w.device
    nrows, tail = divmod(w.numel(), FP_ROW_WORDS)
    out = torch.zeros(2, dtype=torch.int64, device=dev)
    if nrows:
        rows = w[: nrows * FP_ROW_WORDS].view(nrows, FP_ROW_WORDS).sum(dim=1, dtype=torch.int64)
        out[0] += rows.sum()
        out[1] += (rows * torch.arange(nrows, dtype=torch.int64, device=dev).mul_(2).add_(1)).sum()
    if tail:
        s = w[nrows * FP_ROW_WORDS :].sum(dtype=torch.int64)
        out[0] += s
        out[1] += s * (2 * nrows + 1)
    return out


def _has_copies(lay: TensorLayout, box: _geometry.Box) -> bool:
    if lay.regular is not None:
        return _geometry.replica_count(lay.regular) > 1
    return len(lay.holders.get(box, ())) > 1


def _plain(t: torch.Tensor) -> bool:
    from torch.utils._python_dispatch import is_traceable_wrapper_subclass

    return t.layout == torch.strided and t.device.type != "meta" and not is_traceable_wrapper_subclass(t)


def replicated_parts(layouts: Mapping[str, TensorLayout]) -> List[Tuple[Key, torch.Tensor]]:
    """This rank's boxes that other ranks hold too, with their local views, in name order.

    Empty boxes are left out (nothing to compare); so are wrapper subclasses
    (their bytes are not one plain buffer), which the check does not cover.
    """
    out: List[Tuple[Key, torch.Tensor]] = []
    for name in sorted(layouts):
        lay = layouts[name]
        for part in lay.parts:
            if part.box.numel == 0 or not _has_copies(lay, part.box):
                continue
            v = part.view()
            if _plain(v):
                out.append(((name, tuple(part.box.offsets), tuple(part.box.sizes)), v))
    return out


def local_fingerprints(layouts: Mapping[str, TensorLayout]) -> Dict[Key, Tuple[int, ...]]:
    """Fingerprints of this rank's replicated boxes: key -> (S0, S1), one device-to-host copy per device."""
    parts = replicated_parts(layouts)
    by_dev: Dict[torch.device, List[int]] = {}
    fps: List[Optional[torch.Tensor]] = []
    for i, (_, v) in enumerate(parts):
        fps.append(fingerprint(v))
        by_dev.setdefault(v.device, []).append(i)
    values: List[Any] = [None] * len(parts)
    for idx in by_dev.values():
        host = torch.stack([fps[i] for i in idx]).cpu().tolist()  # type: ignore[misc]
        for i, row in zip(idx, host):
            values[i] = tuple(row)
    return {key: values[i] for i, (key, _) in enumerate(parts)}


def compare(groups: Sequence[Tuple[Sequence[int], Mapping[Key, Tuple[int, ...]]]]) -> List[Tuple[Key, List[Tuple[Tuple[int, ...], List[int]]]]]:
    """The boxes whose holders disagree: ``[(key, [(fingerprint, ranks holding it), ...])]``, sorted.

    ``groups``: (ranks, that set of ranks' fingerprints), one per distinct
    value posted. Pure.

    >>> ok = {("w", (0,), (4,)): (1, 2)}
    >>> bad = {("w", (0,), (4,)): (9, 2)}
    >>> compare([([0, 2], ok), ([1], bad)])
    [(('w', (0,), (4,)), [((1, 2), [0, 2]), ((9, 2), [1])])]
    >>> compare([([0, 1], ok)])
    []
    """
    seen: Dict[Key, Dict[Tuple[int, ...], List[int]]] = {}
    for ranks, fps in groups:
        for key, fp in fps.items():
            seen.setdefault(key, {}).setdefault(tuple(fp), []).extend(ranks)
    out = []
    for key in sorted(seen):
        versions = seen[key]
        if len(versions) > 1:
            out.append((key, sorted(((fp, sorted(r)) for fp, r in versions.items()), key=lambda v: (-len(v[1]), v[1]))))
    return out


def _box_text(offsets: Sequence[int], sizes: Sequence[int]) -> str:
    return "[" + ", ".join(f"{o}:{o + n}" for o, n in zip(offsets, sizes)) + "]"


def _ranks_text(ranks: Sequence[int]) -> str:
    head = ", ".join(map(str, ranks[:8]))
    return f"rank{'s' if len(ranks) > 1 else ''} {head}{' ...' if len(ranks) > 8 else ''}"


def describe(diverged: Sequence[Tuple[Key, List[Tuple[Tuple[int, ...], List[int]]]]], *, limit: int = MAX_OFFENDERS) -> str:
    """One line per diverged box (capped at ``limit``): the tensor, the box, which ranks hold which version.

    >>> describe([(("w", (0,), (4,)), [((1, 2), [0, 2]), ((9, 2), [1])])])
    'w chunk [0:4]: ranks 0, 2 hold version A, rank 1 holds version B'
    """
    lines = []
    for (name, offsets, sizes), versions in list(diverged)[:limit]:
        held = ", ".join(
            f"{_ranks_text(ranks)} hold{'s' if len(ranks) == 1 else ''} version {chr(65 + i) if i < 26 else i}"
            for i, (_, ranks) in enumerate(versions)
        )
        lines.append(f"{name} chunk {_box_text(offsets, sizes)}: {held}")
    if len(diverged) > limit:
        lines.append(f"... and {len(diverged) - limit} more diverged chunks")
    return "\n".join(lines)


def check_replicas(comm: Comm, layouts: Mapping[str, TensorLayout], *, url: str, mode: str) -> None:
    """Compare every replicated box's copies across ranks before a save writes (collective).

    Args:
        comm: the save's ranks.
        layouts: this rank's final layouts (after the rank-union).
        url: the save's target, for messages.
        mode: ``"check"`` refuses a diverged save on every rank before any
            byte is written; ``"warn"`` logs the divergence on rank 0 and
            lets the save go on (each box is written by its writing replica,
            as always); ``"off"`` returns at once.

    Raises:
        ReplicaDivergenceError: under ``"check"``, on every rank, naming each
            diverged tensor and chunk and which ranks hold which version.
        SaveFailedError: a rank died or did not arrive (the usual agreement
            failure).
    """
    if mode == "off" or comm.world == 1:
        return

    def decide(groups: List[Group]) -> Tuple[Optional[str], List[None]]:
        diverged = compare([([comm.ranks[p] for p in g.ranks], g.value) for g in groups])
        if not diverged:
            return None, [None] * len(groups)
        text = describe(diverged)
        if mode == "check":
            raise ReplicaDivergenceError(
                f"the replicas of {len(diverged)} chunk{'s' if len(diverged) > 1 else ''} differ, so the save to {url} "
                f"was refused before any byte was written (the previous checkpoint there, if any, is untouched):\n{text}\n"
                "Replicas that differ mean silent data corruption, a non-deterministic kernel or a replica updated "
                "differently; find out which version is right before saving. replicas='warn' saves the writing "
                "replica's copy and logs this; replicas='off' skips the check"
            )
        return text, [None] * len(groups)

    _, (warning, _) = agree(
        comm,
        lambda: local_fingerprints(layouts),
        what=f"replica check of the save to {url}",
        share=lambda fps: fps,
        mode=DISTINCT,
        decide=decide,
    )
    if warning and comm.rank == 0:
        log.warning("shardckpt: the save to %s goes on (replicas='warn') although replicas differ:\n%s", url, warning)
