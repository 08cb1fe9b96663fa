"""What the trainer integrations share: a live template for values saved without one.

A trainer keeps part of its checkpoint as a free-form dict (Lightning's loops
and callbacks, torchtitan's extra entries) that the resuming process does not
hold in the same shape before the load. :func:`values_template` rebuilds that
part from the manifest — plain values as saved, each tensor an empty tensor
of its saved shape and dtype — so :func:`shardckpt.load` can fill it in place
and checksum-verify it like every other entry.
"""

from __future__ import annotations

from typing import Any

from .._format import TAG, Manifest, decode_value, is_tensor_ref
from .._format.values import tensor_names
from .._load import new_tensors
from .._storage import Storage
from ..errors import CorruptCheckpointError

__all__ = ["values_template"]


def values_template(manifest: Manifest, key: str, *, storage: Storage) -> Any:
    """The saved value tree under ``key`` with every tensor reference made an empty tensor.

    Args:
        manifest: the checkpoint's manifest (:func:`shardckpt.inspect`).
        key: a top-level entry of the saved state.
        storage: the checkpoint's storage: the tensors are allocated only
            after the load of them is planned there (a crafted manifest can
            claim any shape; the files must hold the bytes).

    Raises:
        CorruptCheckpointError: ``key`` is not in the checkpoint, references a
            tensor it does not hold, or claims more bytes than its files hold.

    Example:
        >>> tpl = values_template(shardckpt.inspect(url), "lightning", storage=Storage(url))   # doctest: +SKIP
        >>> shardckpt.load({"lightning": tpl}, url, strict=False)        # doctest: +SKIP

    Limits: tensors come back as plain CPU tensors of the saved global shape.
    """
    if key not in manifest.values:
        raise CorruptCheckpointError(f"checkpoint has no entry {key!r} (it holds {sorted(manifest.values)[:20]})")
    names = sorted(set(tensor_names(manifest.values[key])))
    lacking = [n for n in names if n not in manifest.tensors]
    if lacking:
        raise CorruptCheckpointError(f"value {key!r} references tensor {lacking[0]!r}, which the checkpoint lacks")
    empty = new_tensors(storage, manifest, names)

    def build(node: Any) -> Any:
        if is_tensor_ref(node):
            return empty[node["name"]]
        if isinstance(node, dict) and TAG in node:
            if node[TAG] == "tuple":
                return tuple(build(v) for v in node["items"])
            if node[TAG] == "dict":
                return {decode_value(k): build(v) for k, v in node["items"]}
            return decode_value(node)
        if isinstance(node, dict):
            return {k: build(v) for k, v in node.items()}
        if isinstance(node, list):
            return [build(v) for v in node]
        return node

    return build(manifest.values[key])
