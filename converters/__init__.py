"""Format converters, importable as ``shardckpt.converters``.

Every conversion streams (peak memory: a few 16 MiB blocks, never the whole
model), reads and writes with several threads, works between any local
paths and fsspec URLs (``storage_options`` for the source,
``dst_storage_options`` for the destination), verifies source checksums on
the way, and publishes its output atomically: native checkpoints are
committed by ``manifest.json`` written last; safetensors/full outputs on
local disk are built under a hidden name and renamed into place.

    >>> from shardckpt import converters                                  # doctest: +SKIP
    >>> converters.to_safetensors("run/step-1000", "hf/", dtype="bf16")   # HF layout + index
    >>> converters.to_full("run/step-1000", "full.pt")                    # one unsharded file
    >>> converters.reshard("run/step-1000", "run/w8", world_size=8)       # offline, no GPUs
    >>> converters.from_safetensors("Llama-3-8B/", "native/")             # HF -> native
    >>> converters.from_dcp("dcp_ckpt/", "native/")                       # DCP/torchtitan -> native, no pickle runs
    >>> converters.from_torch_save("model.pt", "native/")                 # weights_only, streamed
    >>> converters.to_safetensors("run/step-1000", "hf/", copy_from="Llama-3-8B/")   # publishable: config + tokenizer

Importers share one rule for where a bare state dict goes (under
``model.``) and recognise torchtitan's layout; see docs/interop.md.
Each returns a :class:`ConvertResult` (url, files, tensors, nbytes, seconds).
The options they share (``storage_options``, ``dst_storage_options``,
``overwrite``, ``progress``, ``io_threads``; ``keys`` and ``key_map`` where
tensors are selected) are :class:`ConvertOptions` / :class:`SelectOptions`,
documented once.
"""

from ._consolidate import consolidate
from ._dcp import from_dcp
from ._full import to_full
from ._options import ConvertOptions, ConvertResult, SelectOptions, parse_size
from ._reshard import reshard
from ._safetensors import from_safetensors, to_safetensors
from ._torch_save import from_torch_save

__all__ = [
    "to_safetensors",
    "to_full",
    "reshard",
    "consolidate",
    "from_safetensors",
    "from_dcp",
    "from_torch_save",
    "ConvertResult",
    "ConvertOptions",
    "SelectOptions",
    "parse_size",
]
