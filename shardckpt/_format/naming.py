"""Names of the files a checkpoint is made of (``docs/format.md``, "Layout").

The commit file, the Hugging Face index, the data directory, the data file
names (the save id's first 12 hex digits, so files of a replaced checkpoint
are recognisable), and the key of a chunk inside its safetensors file.
"""

from __future__ import annotations

from typing import Sequence

__all__ = [
    "MANIFEST_NAME",
    "HF_INDEX_NAME",
    "DATA_DIR",
    "DATA_SUFFIX",
    "SAVE_ID_PREFIX_LEN",
    "data_file_name",
    "save_id_prefix",
    "chunk_key",
]

MANIFEST_NAME = "manifest.json"
HF_INDEX_NAME = "model.safetensors.index.json"
DATA_DIR = "data"
DATA_SUFFIX = ".safetensors"
#: Data file names start with this many hex digits of the save id.
SAVE_ID_PREFIX_LEN = 12


def save_id_prefix(save_id: str) -> str:
    """The start every data file name of the save ``save_id`` shares (``"0123456789ab-"``)."""
    return save_id[:SAVE_ID_PREFIX_LEN] + "-"


def data_file_name(save_id: str, tag: str) -> str:
    """Path of a data file of save ``save_id``: ``data/<12 hex>-<tag>.safetensors``.

    Example:
        >>> data_file_name("0123456789abcdef", "r00001-00")
        'data/0123456789ab-r00001-00.safetensors'
    """
    return f"{DATA_DIR}/{save_id_prefix(save_id)}{tag}{DATA_SUFFIX}"


def chunk_key(name: str, offsets: Sequence[int], whole: bool) -> str:
    """Key of a chunk inside its safetensors file.

    A whole tensor is stored under its own name, so a checkpoint of whole
    tensors reads like any Hugging Face safetensors file.
    """
    if whole:
        return name
    return f"{name}@{','.join(str(o) for o in offsets)}"
