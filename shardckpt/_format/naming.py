"""Names of the files a checkpoint is made of (``docs/format.md``, "Layout").

The commit file, the Hugging Face index, the data directory, the data file
names (the save id's first 12 hex digits, so files of a replaced checkpoint
are recognisable), and the key of a chunk inside its safetensors file.
"""

from __future__ import annotations

import re
from dataclasses import dataclass
from typing import Iterable, List, Optional, Sequence

__all__ = [
    "MANIFEST_NAME",
    "HF_INDEX_NAME",
    "DATA_DIR",
    "DATA_SUFFIX",
    "SAVE_ID_PREFIX_LEN",
    "data_file_name",
    "rank_file_name",
    "DataFileName",
    "parse_data_file_name",
    "index_file_name",
    "parse_index_file_name",
    "save_id_prefix",
    "STEP_PREFIX",
    "step_dir_name",
    "parse_step_dir",
    "staging_dir_name",
    "parse_staging_dir",
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


def rank_file_name(save_id: str, rank: int, part: int) -> str:
    """Path of data file ``part`` that rank ``rank`` writes in save ``save_id`` (``save`` names its files so).

    Example:
        >>> rank_file_name("0123456789abcdef", 1, 0)
        'data/0123456789ab-r00001-00.safetensors'
    """
    return data_file_name(save_id, f"r{rank:05d}-{part:02d}")


@dataclass(frozen=True)
class DataFileName:
    """The parts of a data file name :func:`rank_file_name` made: save id prefix (12 hex digits), writer rank, part."""

    save_prefix: str
    rank: int
    part: int


_RANK_FILE = re.compile(r"^" + DATA_DIR + r"/([0-9a-f]+)-r(\d+)-(\d+)" + re.escape(DATA_SUFFIX) + r"$")


def parse_data_file_name(rel: str) -> Optional[DataFileName]:
    """The inverse of :func:`rank_file_name`: the parts of ``rel``, or None for any other name.

    A converter's or an HF directory's data files (``model.safetensors``)
    and index files are not rank files: None.

    Example:
        >>> parse_data_file_name("data/0123456789ab-r00001-00.safetensors")
        DataFileName(save_prefix='0123456789ab', rank=1, part=0)
        >>> parse_data_file_name("model.safetensors") is None
        True
    """
    m = _RANK_FILE.match(rel)
    return DataFileName(m.group(1), int(m.group(2)), int(m.group(3))) if m else None


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


_INDEX_FILE = re.compile(r"^" + INDEX_DIR + r"/[0-9a-f]+-index-r(\d+)" + re.escape(INDEX_SUFFIX) + r"$")


def parse_index_file_name(rel: str) -> Optional[int]:
    """The inverse of :func:`index_file_name`: the rank whose index file ``rel`` is, or None.

    Example:
        >>> parse_index_file_name("data/0123456789ab-index-r00003.json"), parse_index_file_name("manifest.json")
        (3, None)
    """
    m = _INDEX_FILE.match(rel)
    return int(m.group(1)) if m else None


#: A managed run's step directories: ``step-<8 digits>`` (``CheckpointManager``, the memory tier's node directories).
STEP_PREFIX = "step-"
STEP_DIGITS = 8
_STEP_DIR = re.compile(r"^" + STEP_PREFIX + r"(\d+)$")


def step_dir_name(step: int) -> str:
    """``step-00001000`` for step 1000 (sortable; more digits past 99,999,999).

        >>> step_dir_name(1000), step_dir_name(123456789)
        ('step-00001000', 'step-123456789')
    """
    return f"{STEP_PREFIX}{step:0{STEP_DIGITS}d}"


def parse_step_dir(name: str) -> Optional[int]:
    """The step of a directory name made by :func:`step_dir_name` (a trailing ``/`` allowed), else None.

        >>> parse_step_dir("step-00001000/"), parse_step_dir("step-7-hf")
        (1000, None)
    """
    m = _STEP_DIR.match(name.rstrip("/"))
    return int(m.group(1)) if m else None


#: A restore's private staging directory in a memory tier's node directory: ``.restore-r<rank>-<pid>``.
_STAGING_DIR = re.compile(r"^\.restore-r\d+-(\d+)$")


def staging_dir_name(rank: int, pid: int) -> str:
    """``.restore-r<rank>-<pid>``: where rank ``rank`` (process ``pid``) stages a restore from a memory tier.

        >>> staging_dir_name(3, 4242)
        '.restore-r3-4242'
    """
    return f".restore-r{rank}-{pid}"


def parse_staging_dir(name: str) -> Optional[int]:
    """The process id of a staging directory :func:`staging_dir_name` made, else None.

        >>> parse_staging_dir(".restore-r3-4242"), parse_staging_dir("step-00000001")
        (4242, None)
    """
    m = _STAGING_DIR.match(name)
    return int(m.group(1)) if m else None
