"""Offline resharding: rewrite a checkpoint as FSDP2 would lay it out on M ranks."""

from __future__ import annotations

from typing import TYPE_CHECKING, Any, Dict, List, Optional, Tuple

from shardckpt._format import chunk_key
from shardckpt._format.naming import chunk_key_clashes
from shardckpt._format.values import tensor_ref
from shardckpt._geometry import Shard, layout_chunks, layout_to_json, regular_layout
from shardckpt.errors import UnsupportedStateError

from ._common import Reader, write_native
from ._options import ConvertOptions, ConvertResult, Options, check_apart
from ._safetensors import nest_under
from ._source import OutEntry, open_checkpoint, whole_entry

if TYPE_CHECKING:
    from typing_extensions import Unpack

__all__ = ["reshard", "write_resharded", "REPLICATED_FILE"]

#: Name (before the save id) of the file holding tensors every rank reads whole.
REPLICATED_FILE = "replicated"


def reshard(src: str, dst: str, *, world_size: int, **options: Unpack[ConvertOptions]) -> ConvertResult:
    """Rewrite a checkpoint for ``world_size`` FSDP2 ranks, offline (no GPUs, no process group).

    Every tensor of 1+ dims is cut along dim 0 exactly as ``fully_shard``
    on a 1-D mesh of ``world_size`` would cut it (``torch.chunk`` sizes,
    uneven tails, ranks past the last row empty) and rank ``r``'s pieces go
    to one file, ``data/<id>-r0000r.safetensors``. A later load on
    ``world_size`` FSDP2 ranks then reads exactly one data file per rank
    for its parameters and optimizer state. Tensors a multi-rank save wrote
    as plain (replicated) tensors — buffers, which FSDP2 does not shard,
    scalars like optimizer steps — and 0-d tensors stay whole in a shared
    ``...-replicated.safetensors`` that every rank reads. The plain values
    (step, RNG, scheduler...) are carried over unchanged.

    The result is an ordinary checkpoint: it loads at any world size; it is
    only fastest at ``world_size``. A safetensors source's bare names are
    put under ``model.`` (as ``from_safetensors`` does).

    Args:
        src: checkpoint to reshard (a shardckpt checkpoint or safetensors dir).
        dst: new checkpoint directory (committed by ``manifest.json`` last).
        world_size: target number of ranks (>= 1).
        **options: :class:`ConvertOptions` (``storage_options`` for ``src``,
            ``dst_storage_options``, ``overwrite`` a committed checkpoint at
            ``dst``, ``progress``, ``io_threads``).

    Raises:
        ValueError: ``world_size`` < 1.
        CheckpointNotFoundError / ChecksumMismatchError: bad source (nothing committed).

    Example:
        >>> converters.reshard("run/step-500", "run/step-500-w8", world_size=8)   # doctest: +SKIP
    """
    return write_resharded(src, dst, world_size, Options.of("reshard", options))


def write_resharded(src: str, dst: str, world_size: int, opts: Options) -> ConvertResult:
    """:func:`reshard` with its options checked (``consolidate`` calls it too)."""
    check_apart(src, dst)
    if not isinstance(world_size, int) or isinstance(world_size, bool) or world_size < 1:
        raise ValueError(f"world_size must be an int >= 1, got {world_size!r}")
    source = open_checkpoint(src, opts.storage_options)
    values = source.values
    if source.kind == "safetensors":
        # Bare HF names: place them under "model." as from_safetensors does,
        # so shardckpt.load({"model": model}, dst) finds them.

        source.tensors = {f"model.{n}": t for n, t in source.tensors.items()}
        for n, t in source.tensors.items():
            t.name = n
        values = nest_under("model.", {n[len("model."):]: tensor_ref(n) for n in source.tensors})
    clash = chunk_key_clashes(source.tensors)
    if clash:  # checkpoints written before save refused these names (issue 19)
        raise UnsupportedStateError(
            f"{src}: tensor names {clash} equal chunk keys ('<name>@<offsets>') of other tensors; the resharded "
            "checkpoint could not be loaded. Rename them (shardckpt.load(..., key_map=...)) and save again"
        )
    # Writing rank -> file tag -> entries: rank r writes its own rows, rank 0 the replicated file.
    ranks: Dict[int, Dict[str, List[OutEntry]]] = {}
    tensors: Dict[str, Tuple[str, Tuple[int, ...], Optional[Dict[str, Any]], Optional[Dict[str, Any]]]] = {}
    layout = {"mesh_shape": [world_size], "mesh_dim_names": None, "placements": ["S(0)"], "resharded": True}
    for name, t in source.tensors.items():
        replicated = not t.shape or t.numel == 0 or (t.layout is None and source.world_size > 1)
        if replicated:
            ranks.setdefault(0, {}).setdefault(REPLICATED_FILE, []).append(whole_entry(t, name, native=True))
            tensors[name] = (t.dtype, t.shape, None, None)
            continue
        # FSDP2's cut, as a save of Shard(0) DTensors on world_size ranks
        # records it: a layout record in the manifest (a few ints whatever
        # the world size), rank r's chunks in rank r's index file.
        lay = regular_layout(t.shape, (world_size,), (Shard(0),))
        for r, boxes in layout_chunks(lay):
            for box in boxes:
                ranks.setdefault(r, {}).setdefault(f"r{r:05d}", []).append(
                    OutEntry(
                        key=chunk_key(name, box.offsets, box.sizes == tuple(t.shape)),
                        src=t,
                        start=box.offsets[0] * t.row,
                        stop=(box.offsets[0] + box.sizes[0]) * t.row,
                        shape=box.sizes,
                        dtype=t.dtype,
                        name=name,
                        offsets=box.offsets,
                    )
                )
        record = {k: v for k, v in layout_to_json(lay).items() if k != "shape"}
        tensors[name] = (t.dtype, t.shape, layout, {**record, "mesh": 0, "rotation": 0})
    reader = Reader(source, threads=opts.io_threads)
    reader.check_source_files(list(source.tensors))
    extra = {k: v for k, v in source.extra.items() if k != "source"}
    extra["resharded_from_world_size"] = source.world_size
    return write_native(dst, ranks, reader, opts, tensors=tensors, values=values, world_size=world_size, extra=extra, desc="reshard")
