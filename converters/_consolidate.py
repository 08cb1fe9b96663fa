"""A standalone copy of an incremental checkpoint: every byte in its own files, no references."""

from __future__ import annotations

from typing import Any, Dict, Optional

from ._options import ConvertResult
from ._reshard import reshard
from ._source import open_checkpoint

__all__ = ["consolidate"]


def consolidate(
    src: str,
    dst: str,
    *,
    storage_options: Optional[Dict[str, Any]] = None,
    dst_storage_options: Optional[Dict[str, Any]] = None,
    overwrite: bool = False,
    progress: bool = False,
    io_threads: Optional[int] = None,
) -> ConvertResult:
    """Write ``src`` (a step of an incremental run, whose chunks may live in other steps) as a standalone checkpoint.

    Reads every chunk through the references (each read verified) and writes
    them into ``dst``'s own files, committed by ``manifest.json`` last (the
    one ``commit()``): ``dst`` then needs no other directory, and may be
    moved, copied or kept after the run's retention deleted the steps
    ``src`` referenced. The copy is laid out for ``src``'s world size (as
    :func:`reshard` lays out one: dim 0 cut over the ranks) and loads at any
    world size; plain values are carried over unchanged.

    Args:
        src: the checkpoint to copy (any shardckpt checkpoint).
        dst: new checkpoint directory.
        storage_options: fsspec options for ``src``.
        dst_storage_options: fsspec options for ``dst``.
        overwrite: replace a committed checkpoint at ``dst``.
        progress: progress bar.
        io_threads: files written in parallel (default ``SHARDCKPT_IO_THREADS``).

    Raises:
        CheckpointNotFoundError: nothing committed at ``src``.
        CorruptCheckpointError / ChecksumMismatchError: a chunk of ``src``
            (its own, or one it references in another step) is missing or damaged.

    Example:
        >>> converters.consolidate("run/step-00000300", "archive/step-300")   # doctest: +SKIP
    """
    world = max(1, open_checkpoint(src, storage_options).world_size)
    return reshard(src, dst, world_size=world, storage_options=storage_options, dst_storage_options=dst_storage_options,
                   overwrite=overwrite, progress=progress, io_threads=io_threads)
