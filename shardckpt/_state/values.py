"""The values codec, as the state layer sees it.

One implementation lives in the torch-free format layer
(``shardckpt._format.values``): the manifest's ``values`` tree has a single
on-disk meaning. This module re-exports it under the names the state walk uses.
"""

from __future__ import annotations

from .._format.values import TAG, decode_value, encode_value, is_tensor_ref, tensor_ref

__all__ = ["TAG", "tensor_ref", "encode_value", "decode_value", "is_tensor_ref"]
