"""safetensors file headers: build one for a data file, parse and bound-check one read from storage."""

from __future__ import annotations

import json
import math
import struct
from typing import Any, Dict, List, Optional, Sequence, Tuple

from ..errors import CorruptCheckpointError, UnsafeMetadataError
from .dtypes import DTYPES, checked_shape, itemsize
from .manifest import FORMAT_VERSION, int_list_field, required_field

__all__ = ["MAX_HEADER_BYTES", "safetensors_header", "parse_safetensors_header", "read_safetensors_header"]

MAX_HEADER_BYTES = 100_000_000  # same cap as the safetensors reference reader
#: Most headers fit in the first read; a bigger one costs a second read.
HEAD_GUESS_BYTES = 1 << 20



def safetensors_header(
    entries: Sequence[Tuple[str, str, Sequence[int], int]],
    *,
    chunks: Optional[Dict[str, Any]] = None,
) -> Tuple[bytes, List[int]]:
    """Build a safetensors header for ``(key, dtype, shape, nbytes)`` entries, in order.

    Returns the header bytes (8-byte length prefix included, padded to 8) and
    the absolute byte offset of each entry's data in the file. ``chunks``
    (key -> {tensor, offsets, shape}) goes into ``__metadata__`` so the file
    describes its own boxes.
    """
    header: Dict[str, Any] = {}
    meta = {"format": "pt"}
    if chunks is not None:
        meta["shardckpt"] = json.dumps(chunks, sort_keys=True, separators=(",", ":"))
        meta["shardckpt_format_version"] = str(FORMAT_VERSION)
    header["__metadata__"] = meta
    pos = 0
    rel = []
    for key, dt, shape, nbytes in entries:
        header[key] = {"dtype": dt, "shape": list(shape), "data_offsets": [pos, pos + nbytes]}
        rel.append(pos)
        pos += nbytes
    body = json.dumps(header, separators=(",", ":")).encode()
    body += b" " * (-len(body) % 8)
    prefix = struct.pack("<Q", len(body))
    base = len(prefix) + len(body)
    return prefix + body, [base + r for r in rel]


def parse_safetensors_header(head: bytes, *, file_size: int, where: str) -> Tuple[Dict[str, Any], int]:
    """Parse a safetensors header (``head`` starts at byte 0 and holds all of it).

    Returns ``(entries, data_start)`` with ``entries[key] = {dtype, shape,
    data_offsets}`` (``__metadata__`` included as is). Checks offsets lie in
    the file and match dtype x shape.
    """
    if len(head) < 8:
        raise CorruptCheckpointError(f"{where}: {len(head)} bytes is too short for a safetensors header")
    (n,) = struct.unpack("<Q", head[:8])
    if n > MAX_HEADER_BYTES or 8 + n > file_size:
        raise UnsafeMetadataError(f"{where}: header length {n} exceeds the limit or the file size {file_size}")
    if len(head) < 8 + n:
        raise CorruptCheckpointError(f"{where}: header truncated ({len(head) - 8} of {n} bytes)")
    try:
        header = json.loads(head[8 : 8 + n].decode("utf-8"))
    except (UnicodeDecodeError, ValueError, RecursionError) as e:  # RecursionError: absurdly deep nesting
        raise CorruptCheckpointError(f"{where}: header is not valid JSON ({e})") from None
    if not isinstance(header, dict):
        raise CorruptCheckpointError(f"{where}: header is not a JSON object")
    data_start = 8 + n
    for key, entry in header.items():
        if key == "__metadata__":
            continue
        ew = f"{where}: entry {key!r}"
        dt = required_field(entry, "dtype", str, ew)
        if dt not in DTYPES:
            raise CorruptCheckpointError(f"{ew}: unknown dtype {dt!r}")
        shape = checked_shape(int_list_field(entry, "shape", ew), itemsize(dt), where=ew)
        offs = int_list_field(entry, "data_offsets", ew, n=2)
        if offs[1] < offs[0] or data_start + offs[1] > file_size:
            raise CorruptCheckpointError(f"{ew}: data_offsets {offs} outside the file ({file_size} bytes)")
        if offs[1] - offs[0] != math.prod(shape) * itemsize(dt):
            raise CorruptCheckpointError(f"{ew}: {offs[1] - offs[0]} bytes for shape {shape} of {dt}")
    return header, data_start


def read_safetensors_header(storage: Any, rel: str, size: int) -> Tuple[Dict[str, Any], int]:
    """Read and parse the header of file ``rel`` (``size`` bytes) of ``storage``: ``(entries, data_start)``.

    The length prefix is untrusted: a long header is re-read only when it is
    within ``MAX_HEADER_BYTES`` and the file, so a hostile prefix never makes
    us read (or allocate) more than the limit.

    Raises:
        CorruptCheckpointError / UnsafeMetadataError: as
            :func:`parse_safetensors_header`.
    """
    where = storage.url_of(rel)
    head = storage.read_range(rel, 0, min(size, HEAD_GUESS_BYTES))
    if len(head) >= 8:
        (n,) = struct.unpack("<Q", head[:8])
        if len(head) < 8 + n <= size and n <= MAX_HEADER_BYTES:
            head = storage.read_range(rel, 0, 8 + n)
    return parse_safetensors_header(head, file_size=size, where=where)
