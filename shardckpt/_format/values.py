"""The values codec: plain (non-tensor) state as JSON, with tagged nodes (``docs/format.md``, "values").

A saved state's structure is one JSON tree. JSON lacks some things a
training state holds, so those become objects tagged with :data:`TAG`:

- ``{TAG: "tensor", "name": n}``: a reference to tensor ``n`` of the manifest;
- ``{TAG: "float", "value": "nan"}``: a non-finite float (JSON has no NaN);
- ``{TAG: "dtype" | "device", "value": ...}``: a ``torch.dtype`` / ``torch.device``;
- ``{TAG: "tuple", "items": [...]}``, ``{TAG: "dict", "items": [[k, v], ...]}``:
  a tuple, and a dict whose keys are not all strings;
- ``{TAG: "per_rank", ...}``: values each rank saved for itself (see ``_state``);
- ``{TAG: "bytes", "value": base64, "io": bool}``: ``bytes`` (``io``: an
  ``io.BytesIO``, as DCP and torchtitan's ``TrainState`` hold), stored as
  bytes and never pickled; meant for small blobs (they live in the manifest).

Imports no torch: decoding a dtype or device imports it then, and only then.
Saved trees are untrusted input; :func:`decode_value` raises
``CorruptCheckpointError`` on anything it does not know, and a name in a
tree is looked up in a fixed table, never with ``getattr(torch, name)``
(which walks torch's lazy ``__getattr__`` and imports ``torch.onnx`` for
``"onnx"``): decoding imports nothing a checkpoint names.
"""

from __future__ import annotations

import base64
import binascii
import io
import math
import sys
from typing import Any, Dict, Iterable, Iterator, Optional

from ..errors import CheckpointError, CorruptCheckpointError, StateMismatchError, UnsupportedStateError

__all__ = [
    "dtype_by_name",
    "TAG",
    "MAX_VALUE_DEPTH",
    "value_depth_problem",
    "tensor_ref",
    "is_tensor_ref",
    "encode_value",
    "decode_value",
    "rename_refs",
    "tensor_names",
    "has_plain",
    "plain_values",
]

TAG = "__shardckpt__"

#: Deepest nesting of JSON containers a values tree may have (a tagged tuple
#: or dict costs two levels). Saved trees deeper than this are refused at
#: commit and at parse, so every walker of a tree (all recursive) stays far
#: from Python's recursion limit however the file was made.
MAX_VALUE_DEPTH = 200


def value_depth_problem(node: Any, *, limit: int = MAX_VALUE_DEPTH) -> Optional[str]:
    """Why ``node`` nests too deeply (``None`` when it is within ``limit``); iterative, never recurses.

    Example:
        >>> value_depth_problem([[[1]]], limit=2)
        'values nest more than 2 levels deep (limit MAX_VALUE_DEPTH)'
    """
    stack = [(node, 1)]
    while stack:
        n, d = stack.pop()
        children: Iterable[Any]
        if isinstance(n, dict):
            children = n.values()
        elif isinstance(n, (list, tuple)):
            children = n
        else:
            continue
        if d > limit:
            return f"values nest more than {limit} levels deep (limit MAX_VALUE_DEPTH)"
        stack.extend((c, d + 1) for c in children if isinstance(c, (dict, list, tuple)))
    return None


def tensor_ref(name: str) -> Dict[str, str]:
    """The node that stands for tensor ``name`` in a values tree."""
    return {TAG: "tensor", "name": name}


def is_tensor_ref(node: Any) -> bool:
    """Whether ``node`` is a tensor reference (:func:`tensor_ref`)."""
    return isinstance(node, dict) and node.get(TAG) == "tensor"


def _torch_type(v: Any, name: str) -> bool:
    # A torch.dtype/device can only exist once torch is imported: no import here.
    torch = sys.modules.get("torch")
    return torch is not None and isinstance(v, getattr(torch, name))


def encode_value(v: Any, path: str) -> Any:
    """A JSON-able scalar, with non-finite floats, dtypes and devices tagged.

    Raises:
        UnsupportedStateError: ``v`` is of another type (``path`` names it).

    Example:
        >>> encode_value(float("inf"), "lr")
        {'__shardckpt__': 'float', 'value': 'inf'}
    """
    if v is None or isinstance(v, (bool, str)):
        return v
    if isinstance(v, int):
        return int(v)
    if isinstance(v, float):
        if math.isfinite(v):
            return v
        return {TAG: "float", "value": repr(v)}
    if isinstance(v, (bytes, bytearray, io.BytesIO)):
        raw = v.getvalue() if isinstance(v, io.BytesIO) else bytes(v)
        return {TAG: "bytes", "value": base64.b64encode(raw).decode("ascii"), "io": isinstance(v, io.BytesIO)}
    if _torch_type(v, "dtype"):
        return {TAG: "dtype", "value": str(v).replace("torch.", "")}
    if _torch_type(v, "device"):
        return {TAG: "device", "value": str(v)}
    raise UnsupportedStateError(
        f"{path or '<root>'}: values of type {type(v).__module__}.{type(v).__qualname__} cannot be saved; "
        "use tensors, numbers, strings, bools, None, or dicts/lists of those, or give the object "
        "state_dict()/load_state_dict()"
    )


#: The only spellings of the ``float`` tag (what ``repr`` gives for them).
NONFINITE = {"nan": float("nan"), "inf": float("inf"), "-inf": float("-inf")}


def _nonfinite(text: Any) -> float:
    """The float a ``float`` tag stands for: exactly ``nan``/``inf``/``-inf``.

    ``float("1e5000")`` is ``inf`` too: a damaged or crafted tag must not
    turn a finite-looking string into an infinity without saying so.
    """
    if not isinstance(text, str) or text not in NONFINITE:
        raise ValueError(f"float tag value {text!r:.40} is not 'nan', 'inf' or '-inf'")
    return NONFINITE[text]


_DTYPES: Dict[str, Any] = {}


def dtype_by_name(name: Any) -> Any:
    """The ``torch.dtype`` a saved name stands for (``"bfloat16"`` -> ``torch.bfloat16``).

    A fixed table: the dtypes torch's own namespace defines, by the name
    ``str(dtype)`` gives (what :func:`encode_value` writes), read from
    ``vars(torch)`` so no lazy attribute is triggered and nothing is imported.

    Raises:
        CorruptCheckpointError: ``name`` is not a dtype of this torch.

    Example:
        >>> dtype_by_name("float32")                      # doctest: +SKIP
        torch.float32
    """
    import torch

    if not _DTYPES:
        _DTYPES.update({str(v).replace("torch.", ""): v for v in list(vars(torch).values()) if isinstance(v, torch.dtype)})
    dt = _DTYPES.get(name) if isinstance(name, str) else None
    if dt is None:
        raise CorruptCheckpointError(f"{name!r:.60} is not a torch dtype (known: {', '.join(sorted(_DTYPES)[:8])}, ...)")
    return dt


# What a malformed tagged node raises while decoding (a missing key, a wrong
# type, bad base64, a device string torch does not parse).
_MALFORMED = (KeyError, TypeError, ValueError, RuntimeError, AttributeError, binascii.Error)


def decode_value(node: Any) -> Any:
    """The Python value of an encoded node (tensor references are an error here).

    Raises:
        StateMismatchError: an unknown tag (or a tensor reference).
        CorruptCheckpointError: a malformed tagged node (a missing field, a
            dtype name that is not one, a bad device, bad base64); it is a
            ``ValueError``, as before.

    Example:
        >>> decode_value({"__shardckpt__": "tuple", "items": [1, {"__shardckpt__": "float", "value": "nan"}]})
        (1, nan)
    """
    if isinstance(node, dict) and TAG in node:
        try:
            return _decode_tagged(node)
        except CheckpointError:
            raise
        except _MALFORMED as e:
            raise CorruptCheckpointError(f"saved value {node!r:.100} cannot be decoded ({type(e).__name__}: {e})") from None
    if isinstance(node, dict):
        return {k: decode_value(v) for k, v in node.items()}
    if isinstance(node, list):
        return [decode_value(x) for x in node]
    return node


def _decode_tagged(node: Dict[str, Any]) -> Any:
    kind = node[TAG]
    if kind == "float":
        return _nonfinite(node["value"])
    if kind == "dtype":
        return dtype_by_name(node["value"])
    if kind == "device":
        import torch

        if not isinstance(node["value"], str):
            raise TypeError(f"a device is saved as a string, not {type(node['value']).__name__}")
        return torch.device(node["value"])
    if kind == "bytes":
        raw = base64.b64decode(node["value"], validate=True)
        return io.BytesIO(raw) if node.get("io") else raw
    if kind == "tuple":
        return tuple(decode_value(x) for x in node["items"])
    if kind == "dict":
        return {decode_value(k): decode_value(v) for k, v in node["items"]}
    raise StateMismatchError(f"unexpected tagged value {kind!r:.60} in saved state")


def rename_refs(node: Any, mapping: Dict[str, str]) -> Any:
    """``node`` with tensor references renamed by ``mapping``; references it lacks become ``None``."""
    if isinstance(node, dict):
        if is_tensor_ref(node):
            name = node.get("name")
            return None if name not in mapping else tensor_ref(mapping[name])
        return {k: rename_refs(v, mapping) for k, v in node.items()}
    if isinstance(node, list):
        return [rename_refs(v, mapping) for v in node]
    return node


def tensor_names(node: Any) -> Iterator[str]:
    """Names of the tensors ``node`` refers to, in tree order."""
    if isinstance(node, dict):
        if is_tensor_ref(node):
            name = node.get("name")
            if isinstance(name, str):
                yield name
            return
        for v in node.values():
            yield from tensor_names(v)
    elif isinstance(node, list):
        for v in node:
            yield from tensor_names(v)


def has_plain(node: Any) -> bool:
    """Whether a values subtree holds anything besides tensor references."""
    if isinstance(node, dict):
        if is_tensor_ref(node):
            return False
        return any(has_plain(v) for v in node.values()) if node else True
    if isinstance(node, list):
        return any(has_plain(v) for v in node) if node else True
    return True


_DROP = object()


def plain_values(node: Any) -> Optional[Any]:
    """The values tree as a person reads it: tensor references left out, tags made readable.

    Dicts and lists that held only tensors disappear; non-finite floats,
    dtypes and devices show as strings (``"nan"``, ``"torch.bfloat16"``,
    ``"cuda:0"``); tuples as lists; non-string dict keys as strings. ``None``
    when nothing plain is left. Never imports torch, never raises on odd tags.

    Example:
        >>> plain_values({"model": {"w": tensor_ref("model.w")}, "step": 7})
        {'step': 7}
    """
    out = _plain(node)
    return None if out is _DROP else out


def _plain(node: Any) -> Any:
    if isinstance(node, dict):
        kind = node.get(TAG)
        if kind == "tensor":
            return _DROP
        if kind == "float":
            return str(node.get("value"))
        if kind == "dtype":
            return f"torch.{node.get('value')}"
        if kind == "device":
            return str(node.get("value"))
        if kind == "bytes":
            return f"<{len(str(node.get('value', ''))) * 3 // 4} bytes>"
        if kind == "tuple":
            return _plain(node.get("items"))
        if kind == "dict":
            items = node.get("items")
            pairs = {}
            for kv in items if isinstance(items, list) else []:
                if isinstance(kv, list) and len(kv) == 2:
                    v = _plain(kv[1])
                    if v is not _DROP:
                        k = _plain(kv[0])
                        pairs[k if isinstance(k, str) else json_key(k)] = v
            return pairs if pairs else _DROP
        if kind is not None:
            rest = {k: v for k, v in node.items() if k != TAG}
            return {"<" + str(kind) + ">": _plain(rest) if rest else None}
        out = {}
        for k, v in node.items():
            p = _plain(v)
            if p is not _DROP:
                out[k] = p
        return out if out or not node else _DROP
    if isinstance(node, list):
        kept = [_plain(v) for v in node]
        kept = [v for v in kept if v is not _DROP]
        return kept if kept or not node else _DROP
    return node


def json_key(k: Any) -> str:
    """A dict key as shown in plain output (``1`` -> ``"1"``)."""
    return str(k)
