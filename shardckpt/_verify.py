"""inspect and verify: read a checkpoint's metadata; re-read and check every byte.

Imports no torch (a test pins it): ``shardckpt verify`` / ``inspect`` run
where torch is not installed, and start in a fraction of a second.
"""

from __future__ import annotations

from concurrent.futures import ThreadPoolExecutor
from typing import Any, Callable, Dict, List, Optional, Tuple, cast

from ._format import ChunkMeta, Manifest, open_manifest, plural, read_safetensors_header
from ._format.checksum import crc32c
from ._format.files import check_files
from .errors import ChecksumMismatchError, CorruptCheckpointError

__all__ = ["inspect", "verify", "verify_manifest", "VERIFY_BLOCK_BYTES", "VERIFY_IO_THREADS", "MAX_LISTED_PROBLEMS"]

#: Bytes read (and checksummed) at a time: memory stays this small per thread.
VERIFY_BLOCK_BYTES = 32 << 20
#: Files checked in parallel (the engine's default I/O threads per rank).
VERIFY_IO_THREADS = 4
#: Problems a damage report lists before "... (N more)".
MAX_LISTED_PROBLEMS = 20


def _storage(url: str, storage_options: Optional[Dict[str, Any]]):
    # The storage backends (S3 clients) cost more to import than the format: only when used.
    from ._storage import Storage

    return Storage(url, storage_options=storage_options)


def inspect(url: str, *, storage_options: Optional[Dict[str, Any]] = None, no_dist: bool = False) -> Manifest:
    """Return a committed checkpoint's metadata without reading tensor bytes.

    The result lists every tensor (dtype, global shape, chunks with file,
    offsets, sizes, checksum), the files and their sizes, the world size that
    saved it, the saved plain values, and ``total_bytes``. Needs no torch.

    Raises:
        CheckpointNotFoundError: nothing committed at ``url`` (the message
            says what is there: a run root, a DCP directory, a file...).
        CorruptCheckpointError: the manifest is damaged or unsafe.

    Example:
        >>> import torch, shardckpt, tempfile
        >>> d = tempfile.mkdtemp(); shardckpt.save({"w": torch.ones(4)}, d)
        >>> m = shardckpt.inspect(d); (m.world_size, m.tensors["w"].shape, m.total_bytes)
        (1, [4], 16)
    """
    return open_manifest(_storage(url, storage_options))


def verify(
    url: str,
    *,
    storage_options: Optional[Dict[str, Any]] = None,
    io_threads: int = VERIFY_IO_THREADS,
    no_dist: bool = False,
) -> Manifest:
    """Re-read every byte of a checkpoint and check every checksum.

    Also checks that each data file's safetensors header agrees with the
    manifest (keys, dtypes, shapes, offsets). Reads in bounded blocks
    (``VERIFY_BLOCK_BYTES``), so memory stays small whatever the checkpoint
    size. Needs no torch. Never collective (``no_dist`` is accepted for
    symmetry with ``save``/``load`` and changes nothing): every rank that
    calls it re-reads everything, so call it on one.

    Raises:
        CheckpointNotFoundError: nothing committed at ``url``.
        CorruptCheckpointError / ChecksumMismatchError: listing every damaged
            file and chunk found (the first ``MAX_LISTED_PROBLEMS``).

    Example:
        >>> import torch, shardckpt, tempfile
        >>> d = tempfile.mkdtemp(); shardckpt.save({"w": torch.ones(4)}, d)
        >>> shardckpt.verify(d).world_size
        1

    Limits: a safetensors source has no checksums; its headers, bounds and
    sizes are checked.
    """
    storage = _storage(url, storage_options)
    m = open_manifest(storage)
    verify_manifest(storage, m, io_threads=io_threads)
    return m


def verify_manifest(
    storage: Any, m: Manifest, *, io_threads: int = VERIFY_IO_THREADS, on_bytes: Optional[Callable[[int], None]] = None
) -> None:
    """Check the files of an opened manifest: sizes, headers, every checksum.

    ``on_bytes(n)`` is called as chunk bytes are checked (progress bars).

    Raises:
        CorruptCheckpointError / ChecksumMismatchError: as :func:`verify`.
    """
    check_files(storage, {rel: f.size for rel, f in m.files.items()})
    by_file: Dict[str, List[Tuple[str, ChunkMeta]]] = {}
    for name, t in m.tensors.items():
        for c in t.chunks:
            by_file.setdefault(c.file, []).append((name, c))

    def check_file(rel: str) -> List[str]:
        return _check_file(storage, m, rel, by_file.get(rel, []), on_bytes)

    rels = sorted(rel for rel in m.files if rel not in m.indexes)  # index files: checked when opened
    if io_threads > 1 and len(rels) > 1:
        with ThreadPoolExecutor(max_workers=io_threads, thread_name_prefix="shardckpt-verify") as ex:
            errors = [e for errs in ex.map(check_file, rels) for e in errs]
    else:
        errors = [e for rel in rels for e in check_file(rel)]
    if errors:
        cls = ChecksumMismatchError if all("crc32c" in e for e in errors) else CorruptCheckpointError
        errors.sort()
        more = len(errors) - MAX_LISTED_PROBLEMS
        listed = "; ".join(errors[:MAX_LISTED_PROBLEMS]) + (f"; ... ({more} more)" if more > 0 else "")
        raise cls(f"{storage.url} is damaged ({plural(len(errors), 'problem')}): {listed}")


def _check_file(
    storage: Any, m: Manifest, rel: str, chunks: List[Tuple[str, ChunkMeta]], on_bytes: Optional[Callable[[int], None]]
) -> List[str]:
    """Problems found in one data file: header against the manifest, then each chunk's checksum."""
    errs = []
    where = storage.url_of(rel)
    try:
        header, start = read_safetensors_header(storage, rel, m.files[rel].size)
    except CorruptCheckpointError as e:
        return [str(e)]
    for name, c in chunks:
        ent = header.get(c.key)
        if not isinstance(ent, dict) or ent.get("dtype") != m.tensors[name].dtype or ent.get("shape") != c.sizes or (
            start + ent["data_offsets"][0] != c.byte_offset
        ):
            errs.append(f"{where}: header entry {c.key!r} disagrees with the manifest")
            continue
        if c.crc32c is None:
            if on_bytes is not None:
                on_bytes(c.nbytes)
            continue  # safetensors source: no checksum; header, bounds and size checked
        if c.blocks is not None and m.block_bytes:
            errs.extend(_check_blocks(storage, m, rel, name, c, on_bytes))
            continue
        crc = 0
        for off in range(0, c.nbytes, VERIFY_BLOCK_BYTES):
            n = min(VERIFY_BLOCK_BYTES, c.nbytes - off)
            data = storage.read_range(rel, c.byte_offset + off, n)
            if len(data) != n:
                errs.append(f"{where}: chunk {c.key!r} truncated")
                break
            crc = crc32c(data, crc)
            if on_bytes is not None:
                on_bytes(n)
        else:
            if crc != c.crc32c:
                errs.append(
                    f"{where}: chunk {c.key!r} of tensor {name!r} has crc32c {crc:#010x}, manifest says {c.crc32c:#010x}"
                )
    return errs


def _check_blocks(
    storage: Any, m: Manifest, rel: str, name: str, c: ChunkMeta, on_bytes: Optional[Callable[[int], None]]
) -> List[str]:
    """Format v2: every block of a chunk against its own CRC-32C; names the damaged blocks by byte range."""
    where = storage.url_of(rel)
    bb = m.block_bytes
    step = max(bb, VERIFY_BLOCK_BYTES // bb * bb)  # whole blocks per read
    bad: List[int] = []
    for off in range(0, c.nbytes, step):
        n = min(step, c.nbytes - off)
        data = storage.read_range(rel, c.byte_offset + off, n)
        if len(data) != n:
            return [f"{where}: chunk {c.key!r} truncated"]
        mv = memoryview(data)
        for k in range(0, n, bb):
            i = (off + k) // bb
            if crc32c(mv[k : k + bb]) != cast(List[int], c.blocks)[i]:
                bad.append(i)
        if on_bytes is not None:
            on_bytes(n)
    if not bad:
        return []
    shown = ", ".join(f"[{c.byte_offset + i * bb}, {c.byte_offset + min((i + 1) * bb, c.nbytes)})" for i in bad[:5])
    more = f" and {len(bad) - 5} more" if len(bad) > 5 else ""
    return [
        f"{where}: chunk {c.key!r} of tensor {name!r}: crc32c of {plural(len(bad), 'block')} differs from the "
        f"index (file bytes {shown}{more})"
    ]
