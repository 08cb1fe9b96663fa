"""inspect and verify: read a checkpoint's metadata; re-read and check every byte."""

from __future__ import annotations

from concurrent.futures import ThreadPoolExecutor
from typing import Any, Dict, List, Optional, Tuple


from ._format import (
    ChunkMeta,
    Manifest,
    parse_safetensors_header,
)
from ._io import DEFAULT_IO_THREADS, check_files
from ._storage import Storage
from .errors import (
    ChecksumMismatchError,
    CorruptCheckpointError,
)

from ._load import read_manifest

__all__ = ["inspect", "verify", "VERIFY_BLOCK_BYTES"]


def inspect(url: str, *, storage_options: Optional[Dict[str, Any]] = None) -> Manifest:
    """Return a committed checkpoint's metadata without reading tensor bytes.

    The result lists every tensor (dtype, global shape, chunks with file,
    offsets, sizes, checksum), the files and their sizes, the world size that
    saved it, the saved plain values, and ``total_bytes``.

    Raises:
        CheckpointNotFoundError: nothing committed at ``url``.
        CorruptCheckpointError: the manifest is damaged or unsafe.

    Example:
        >>> import torch, shardckpt, tempfile
        >>> d = tempfile.mkdtemp(); shardckpt.save({"w": torch.ones(4)}, d)
        >>> m = shardckpt.inspect(d); (m.world_size, m.tensors["w"].shape, m.total_bytes)
        (1, [4], 16)
    """
    return read_manifest(Storage(url, storage_options=storage_options))


VERIFY_BLOCK_BYTES = 32 << 20


def verify(
    url: str, *, storage_options: Optional[Dict[str, Any]] = None, io_threads: int = DEFAULT_IO_THREADS
) -> Manifest:
    """Re-read every byte of a checkpoint and check every checksum.

    Also checks that each data file's safetensors header agrees with the
    manifest (keys, dtypes, shapes, offsets). Reads in bounded blocks, so
    memory stays small whatever the checkpoint size.

    Raises:
        CheckpointNotFoundError: nothing committed at ``url``.
        CorruptCheckpointError / ChecksumMismatchError: listing every damaged
            file and chunk found.

    Example:
        >>> import torch, shardckpt, tempfile
        >>> d = tempfile.mkdtemp(); shardckpt.save({"w": torch.ones(4)}, d)
        >>> shardckpt.verify(d).world_size
        1
    """
    from ._io import crc32c

    storage = Storage(url, storage_options=storage_options)
    m = read_manifest(storage)
    check_files(storage, {rel: f.size for rel, f in m.files.items()})
    by_file: Dict[str, List[Tuple[str, ChunkMeta]]] = {}
    for name, t in m.tensors.items():
        for c in t.chunks:
            by_file.setdefault(c.file, []).append((name, c))

    def check_file(rel: str) -> List[str]:
        errs = []
        size = m.files[rel].size
        head = storage.read_range(rel, 0, min(size, 1 << 20))
        try:
            import struct

            (n,) = struct.unpack("<Q", head[:8]) if len(head) >= 8 else (0,)
            from . import _format

            # Re-read a long header only within the limit: the length prefix is untrusted.
            if 8 + n > len(head) and 8 + n <= size and n <= _format.MAX_HEADER_BYTES:
                head = storage.read_range(rel, 0, 8 + n)
            header, start = parse_safetensors_header(head, file_size=size, where=storage.url_of(rel))
        except CorruptCheckpointError as e:
            return [str(e)]
        for name, c in by_file.get(rel, []):
            e = header.get(c.key)
            want_dt = m.tensors[name].dtype
            if not isinstance(e, dict) or e.get("dtype") != want_dt or e.get("shape") != c.sizes or (
                start + e["data_offsets"][0] != c.byte_offset
            ):
                errs.append(f"{storage.url_of(rel)}: header entry {c.key!r} disagrees with the manifest")
                continue
            if c.crc32c is None:
                continue  # safetensors source: no checksum; header, bounds and size checked
            crc = 0
            for off in range(0, c.nbytes, VERIFY_BLOCK_BYTES):
                n = min(VERIFY_BLOCK_BYTES, c.nbytes - off)
                data = storage.read_range(rel, c.byte_offset + off, n)
                if len(data) != n:
                    errs.append(f"{storage.url_of(rel)}: chunk {c.key!r} truncated")
                    break
                crc = crc32c(data, crc)
            else:
                if crc != c.crc32c:
                    errs.append(
                        f"{storage.url_of(rel)}: chunk {c.key!r} of tensor {name!r} has crc32c {crc:#010x}, "
                        f"manifest says {c.crc32c:#010x}"
                    )
        return errs

    rels = sorted(m.files)
    if io_threads > 1 and len(rels) > 1:
        with ThreadPoolExecutor(max_workers=io_threads) as ex:
            errors = [e for errs in ex.map(check_file, rels) for e in errs]
    else:
        errors = [e for rel in rels for e in check_file(rel)]
    if errors:
        cls = ChecksumMismatchError if all("crc32c" in e for e in errors) else CorruptCheckpointError
        raise cls(f"{storage.url} is damaged ({len(errors)} problems): " + "; ".join(sorted(errors)[:20]))
    return m
