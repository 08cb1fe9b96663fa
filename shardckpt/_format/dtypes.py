"""safetensors dtype names: item sizes, the torch dtype each stands for (torch imported on use), and which shapes a tensor can have."""

from __future__ import annotations

from typing import Any, Dict, List, Optional, Sequence, Tuple

from ..errors import CorruptCheckpointError, UnsupportedStateError

__all__ = ["DTYPES", "dtype_name", "torch_dtype", "itemsize", "MAX_TENSOR_BYTES", "shape_problem", "checked_shape"]

#: The most elements x item size a stored shape may claim, and the largest
#: dimension: torch sizes and byte counts are int64 (``torch.empty`` refuses
#: more, with a foreign ``TypeError`` or ``RuntimeError``).
MAX_TENSOR_BYTES = 2**63 - 1

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




def shape_problem(shape: Any, item_size: int) -> Optional[str]:
    """Why ``shape`` (read from a file) cannot be a tensor's shape; None when it can.

    Every dimension a non-negative int that fits int64, and the element count
    of the non-zero dimensions times ``item_size`` within
    :data:`MAX_TENSOR_BYTES`: torch computes the storage size from every
    dimension, so ``[2**64, 0]`` or ``[2**62, 2**62, 0]`` is no tensor
    even though it holds no element. The one check every reader (native
    manifest and index, safetensors header, DCP metadata, torch.save) applies.

    Example:
        >>> shape_problem([2**64, 0], 4)
        'dimension 0 is 18446744073709551616, over the int64 limit 9223372036854775807'
    """
    if not isinstance(shape, (list, tuple)):
        return f"a shape is a list of ints, not {type(shape).__name__}"
    count = 1
    for i, n in enumerate(shape):
        if not isinstance(n, int) or isinstance(n, bool) or n < 0:
            return f"dimension {i} is {n!r:.40}, not a non-negative int"
        if n > MAX_TENSOR_BYTES:
            return f"dimension {i} is {n}, over the int64 limit {MAX_TENSOR_BYTES}"
        count *= max(n, 1)
        if count * item_size > MAX_TENSOR_BYTES:
            return f"its non-zero dimensions hold {count} or more elements of {item_size} bytes, over the int64 byte limit {MAX_TENSOR_BYTES}"
    return None


def checked_shape(shape: Sequence[int], item_size: int, *, where: str) -> List[int]:
    """``shape`` as a list, when :func:`shape_problem` finds nothing wrong with it.

    Raises:
        CorruptCheckpointError: ``"{where}: shape [...] cannot be a tensor's: why"``
            (``where`` names the file and the tensor).
    """
    why = shape_problem(shape, item_size)
    if why:
        raise CorruptCheckpointError(f"{where}: shape {list(shape) if isinstance(shape, (list, tuple)) else shape!r:.120} cannot be a tensor's: {why}")
    return list(shape)
