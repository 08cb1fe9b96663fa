"""A standalone copy of an incremental checkpoint: every byte in its own files, no references."""

from __future__ import annotations

from typing import TYPE_CHECKING

from ._options import ConvertOptions, ConvertResult, Options
from ._reshard import write_resharded
from ._source import open_checkpoint

if TYPE_CHECKING:
    from typing_extensions import Unpack

__all__ = ["consolidate"]


def consolidate(src: str, dst: str, **options: Unpack[ConvertOptions]) -> ConvertResult:
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
        **options: :class:`ConvertOptions` (``storage_options`` for ``src``,
            ``dst_storage_options``, ``overwrite`` a committed checkpoint at
            ``dst``, ``progress``, ``io_threads``).

    Raises:
        CheckpointNotFoundError: nothing committed at ``src``.
        CorruptCheckpointError / ChecksumMismatchError: a chunk of ``src``
            (its own, or one it references in another step) is missing or damaged.

    Example:
        >>> converters.consolidate("run/step-00000300", "archive/step-300")   # doctest: +SKIP
    """
    opts = Options.of("consolidate", options)
    world = max(1, open_checkpoint(src, opts.storage_options).world_size)
    return write_resharded(src, dst, world, opts)
