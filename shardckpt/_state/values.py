"""The values codec: JSON-able values of the state, with tags for what JSON lacks.

``TAG`` marks a node that is not plain JSON: a reference to a stored tensor
(``tensor_ref``), a non-finite float, a dtype, a device, a tuple, a dict with
non-string keys. This module is the on-disk meaning of the manifest's
``values`` tree; the format layer keeps a torch-free copy (``_format/values``).
"""

from __future__ import annotations

import math
from typing import Any, Dict

import torch

from ..errors import StateMismatchError, UnsupportedStateError

__all__ = ["TAG", "tensor_ref", "encode_value", "decode_value"]

TAG = "__shardckpt__"


def tensor_ref(name: str) -> Dict[str, str]:
    return {TAG: "tensor", "name": name}


def _is_ref(node: Any) -> bool:
    return isinstance(node, dict) and node.get(TAG) == "tensor"


def encode_value(v: Any, path: str) -> Any:
    """A JSON-able scalar, with non-finite floats tagged (JSON has no NaN)."""
    if v is None or isinstance(v, (bool, str)):
        return v
    if isinstance(v, int):
        return int(v)
    if isinstance(v, float):
        if math.isfinite(v):
            return v
        return {TAG: "float", "value": repr(v)}
    if isinstance(v, torch.dtype):
        return {TAG: "dtype", "value": str(v).replace("torch.", "")}
    if isinstance(v, torch.device):
        return {TAG: "device", "value": str(v)}
    raise UnsupportedStateError(
        f"{path or '<root>'}: values of type {type(v).__module__}.{type(v).__qualname__} cannot be saved; "
        "use tensors, numbers, strings, bools, None, or dicts/lists of those, or give the object "
        "state_dict()/load_state_dict()"
    )


def decode_value(node: Any) -> Any:
    if isinstance(node, dict) and TAG in node:
        kind = node[TAG]
        if kind == "float":
            return float(node["value"])
        if kind == "dtype":
            dt = getattr(torch, str(node["value"]), None)
            if not isinstance(dt, torch.dtype):
                raise ValueError(f"{node['value']!r} is not a torch dtype")
            return dt
        if kind == "device":
            return torch.device(node["value"])
        if kind == "tuple":
            return tuple(decode_value(x) for x in node["items"])
        if kind == "dict":
            return {decode_value(k): decode_value(v) for k, v in node["items"]}
        raise StateMismatchError(f"unexpected tagged value {kind!r} in saved state")
    if isinstance(node, dict):
        return {k: decode_value(v) for k, v in node.items()}
    if isinstance(node, list):
        return [decode_value(x) for x in node]
    return node
