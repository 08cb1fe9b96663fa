"""Format converters, importable as ``shardckpt.converters``.

Filled in by the converters issue: to_safetensors, to_full, reshard,
from_safetensors, from_dcp, from_torch_save.
"""

__all__: list = []
