"""safetensors dtype names: item sizes, and the torch dtype each stands for (torch imported on use)."""

from __future__ import annotations

from typing import Any, Dict, Tuple

from ..errors import UnsupportedStateError

__all__ = ["DTYPES", "dtype_name", "torch_dtype", "itemsize"]

# safetensors dtype name -> (torch attribute, item size in bytes)
DTYPES: Dict[str, Tuple[str, int]] = {
    "BOOL": ("bool", 1),
    "U8": ("uint8", 1),
    "I8": ("int8", 1),
    "I16": ("int16", 2),
    "U16": ("uint16", 2),
    "I32": ("int32", 4),
    "U32": ("uint32", 4),
    "I64": ("int64", 8),
    "U64": ("uint64", 8),
    "F16": ("float16", 2),
    "BF16": ("bfloat16", 2),
    "F32": ("float32", 4),
    "F64": ("float64", 8),
    "C64": ("complex64", 8),
    "F8_E4M3": ("float8_e4m3fn", 1),
    "F8_E5M2": ("float8_e5m2", 1),
    "F8_E4M3FNUZ": ("float8_e4m3fnuz", 1),
    "F8_E5M2FNUZ": ("float8_e5m2fnuz", 1),
}
_BY_TORCH = {attr: name for name, (attr, _) in DTYPES.items()}


def dtype_name(dtype: Any, *, key: str = "?") -> str:
    """safetensors name of a torch dtype (``torch.float32`` -> ``"F32"``)."""
    attr = str(dtype).replace("torch.", "")
    try:
        return _BY_TORCH[attr]
    except KeyError:
        raise UnsupportedStateError(
            f"{key}: dtype {dtype} has no safetensors encoding; supported: "
            f"{', '.join(sorted(_BY_TORCH))}. Cast it (e.g. .to(torch.float32)) before saving."
        ) from None


def torch_dtype(name: str) -> Any:
    """torch dtype of a safetensors dtype name."""
    import torch

    return getattr(torch, DTYPES[name][0])


def itemsize(name: str) -> int:
    return DTYPES[name][1]


