"""Names of the files a checkpoint is made of (``docs/format.md``, "Layout").

The commit file, the Hugging Face index, the data directory, the data file
names (the save id's first 12 hex digits, so files of a replaced checkpoint
are recognisable), and the key of a chunk inside its safetensors file.
"""

from __future__ import annotations

import re
from typing import Iterable, List, Sequence

__all__ = [
    "MANIFEST_NAME",
    "HF_INDEX_NAME",
    "DATA_DIR",
    "DATA_SUFFIX",
    "SAVE_ID_PREFIX_LEN",
    "data_file_name",
    "save_id_prefix",
    "chunk_key",
    "chunk_key_clashes",
    "unreadable_names",
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


_OFFSETS = re.compile(r"(?:\d+(?:,\d+)*)?")


def chunk_key_clashes(names: Iterable[str]) -> List[str]:
    """Names that equal a chunk key of another name (``w@0,0`` beside ``w``), sorted.

    A sharded tensor ``w`` stores its chunks under ``w@<offsets>``; a tensor
    named like one of them would share a key with it in a data file (now, or
    after ``converters.reshard``), and the checkpoint could not be loaded.
    Writers refuse such names before writing anything.

        >>> chunk_key_clashes(["w", "w@0,0", "v@x", "u@1"])
        ['w@0,0']
    """
    have = set(names)
    out = []
    for n in have:
        base, sep, tail = n.rpartition("@")
        if sep and base in have and _OFFSETS.fullmatch(tail):
            out.append(n)
    return sorted(out)


def unreadable_names(names: Iterable[str]) -> List[str]:
    """Names that cannot be written as UTF-8 (lone surrogates such as ``"\\ud800"``), which safetensors cannot read back.

        >>> unreadable_names(["ok", chr(0xD800)]) == [chr(0xD800)]
        True
    """
    out = []
    for n in names:
        try:
            n.encode("utf-8")
        except UnicodeEncodeError:
            out.append(n)
    return out


#: v2: the per-rank index files sit next to the data files (listed in ``files`` too).
INDEX_DIR = DATA_DIR
INDEX_SUFFIX = ".json"


def index_file_name(save_id: str, rank: int) -> str:
    """``data/<save>-index-r<rank>.json``: the chunks rank ``rank`` wrote, with their block checksums."""
    return f"{INDEX_DIR}/{save_id_prefix(save_id)}index-r{rank:05d}{INDEX_SUFFIX}"
