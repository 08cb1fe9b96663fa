"""inspect and verify: read a checkpoint's metadata; re-read and check every byte.

Imports no torch (a test pins it): ``shardckpt verify`` / ``inspect`` run
where torch is not installed, and start in a fraction of a second.
"""

from __future__ import annotations

import os
from concurrent.futures import ThreadPoolExecutor
from typing import TYPE_CHECKING, Any, Callable, Dict, List, Optional, Tuple, Union

from ._format import ChunkMeta, Manifest, open_manifest, plural, read_safetensors_header
from ._format.checksum import crc32c, hash_available, new_hasher
from ._format.chunk import Chunk
from ._format.files import check_files
from ._format.refs import follow
from ._format.versions import spec
from ._readers import BufferPool, Want, read_verified
from .errors import ChecksumMismatchError, CorruptCheckpointError

if TYPE_CHECKING:  # pragma: no cover
    from ._storage import Storage

__all__ = ["inspect", "verify", "verify_manifest", "VERIFY_RANGE_BYTES", "VERIFY_IO_THREADS", "MAX_LISTED_PROBLEMS", "check_data_file", "check_file"]

#: Largest read range (bytes read and checked at once by one thread): memory
#: stays ``io_threads`` times this (a v1 chunk is one checksum unit and is read
#: whole, whatever its size).
VERIFY_RANGE_BYTES = 32 << 20
#: Files checked in parallel (the engine's default I/O threads per rank).
VERIFY_IO_THREADS = 4
#: Problems a damage report lists before "... (N more)".
MAX_LISTED_PROBLEMS = 20


def _storage(url: Union[str, "Storage"], storage_options: Optional[Dict[str, Any]]):
    # The storage backends (S3 clients) cost more to import than the format: only when used.
    from ._storage import open_storage

    return follow(open_storage(url, storage_options=storage_options))  # format v4 references


def inspect(url: Union[str, "Storage"], *, storage_options: Optional[Dict[str, Any]] = None, no_dist: bool = False) -> Manifest:
    """Return a committed checkpoint's metadata without reading tensor bytes.

    The result lists every tensor (dtype, global shape, chunks with file,
    offsets, sizes, checksum), the files and their sizes, the world size that
    saved it, the saved plain values, and ``total_bytes``. Needs no torch.
    ``url`` is a path, any fsspec URL, or a ``shardckpt.Storage`` object.

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
    url: Union[str, "Storage"],
    *,
    storage_options: Optional[Dict[str, Any]] = None,
    io_threads: int = VERIFY_IO_THREADS,
    no_dist: bool = False,
) -> Manifest:
    """Re-read every byte of a checkpoint and check every checksum.

    Also checks that each data file's safetensors header agrees with the
    manifest (keys, dtypes, shapes, offsets). Reads through the one verified
    reader in bounded ranges (``VERIFY_RANGE_BYTES`` per I/O thread), so
    memory stays small whatever the checkpoint size (a format v1 chunk, one
    checksum for all its bytes, is read whole). Needs no torch. Never collective (``no_dist`` is accepted for
    symmetry with ``save``/``load`` and changes nothing): every rank that
    calls it re-reads everything, so call it on one. ``url`` is a path, any
    fsspec URL, or a ``shardckpt.Storage`` object.

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

    Sizes and headers are metadata, checked here; every chunk byte is read
    and checked by the one verified reader (``_readers.read_verified``), in
    ranges of at most ``VERIFY_RANGE_BYTES``, ``io_threads`` at a time. A
    damaged checksum unit does not stop the read: every one is listed.
    ``on_bytes(n)`` is called as chunk bytes are checked (progress bars).

    Raises:
        CorruptCheckpointError / ChecksumMismatchError: as :func:`verify`.
    """
    check_files(storage, {rel: f.size for rel, f in m.files.items()})
    by_file: Dict[str, List[Tuple[str, ChunkMeta]]] = {}
    for name, t in m.tensors.items():
        for c in t.chunks:
            by_file.setdefault(c.file, []).append((name, c))

    def check_header(rel: str) -> Tuple[List[str], List[Chunk]]:
        return _check_header(storage, m, rel, by_file.get(rel, []))

    rels = sorted(rel for rel in m.files if rel not in m.indexes)  # index files: checked when opened
    if io_threads > 1 and len(rels) > 1:
        with ThreadPoolExecutor(max_workers=io_threads, thread_name_prefix="shardckpt-verify") as ex:
            found = list(ex.map(check_header, rels))
    else:
        found = [check_header(rel) for rel in rels]
    errors = [e for errs, _ in found for e in errs]
    errors.extend(_check_chunks(storage, [c for _, good in found for c in good], io_threads=io_threads, on_bytes=on_bytes,
                                hash_algo=_hash_algo(m)))
    if errors:
        cls = ChecksumMismatchError if all("crc32c" in e for e in errors) else CorruptCheckpointError
        errors.sort()
        more = len(errors) - MAX_LISTED_PROBLEMS
        listed = "; ".join(errors[:MAX_LISTED_PROBLEMS]) + (f"; ... ({more} more)" if more > 0 else "")
        raise cls(f"{storage.url} is damaged ({plural(len(errors), 'problem')}): {listed}")


def _check_chunks(
    storage: Any, chunks: List[Chunk], *, io_threads: int = VERIFY_IO_THREADS, on_bytes: Optional[Callable[[int], None]] = None,
    hash_algo: str = "",
) -> List[str]:
    """Every byte of ``chunks`` read and checked through the one verified reader: one problem line per damaged chunk.

    ``hash_algo`` (format v4's ``content_hash``): a chunk with a content hash
    whose blocks all match is hashed too, as its bytes are delivered (in
    order), and must match; skipped where this process cannot compute it.
    """
    hashing = bool(hash_algo) and hash_available(hash_algo)
    hashers: Dict[Chunk, Any] = {}
    wants: List[Want] = []
    for c in chunks:
        if not c.checked:
            if on_bytes is not None:
                on_bytes(c.nbytes)  # safetensors source: no checksum; header, bounds and size checked
            continue
        # Whole checksum units per want, so that each want is verified alone and none is split.
        step = max(c.block_bytes, VERIFY_RANGE_BYTES // c.block_bytes * c.block_bytes) if c.blocked else c.nbytes
        wants.extend(Want(c, lo, min(lo + step, c.nbytes)) for lo in range(0, c.nbytes, max(1, step)))
    damaged: Dict[Chunk, List[Tuple[int, Optional[int]]]] = {}

    def deliver(w: Want, data: memoryview, owner: Any, off: int) -> None:
        c = w.chunk
        if hashing and c.content_hash:
            if c not in hashers:
                hashers[c] = new_hasher(hash_algo)
            hashers[c].update(data)
        if on_bytes is not None:
            on_bytes(len(data))

    def mismatch(u: Any, crc: Optional[int]) -> None:
        damaged.setdefault(u.chunk, []).append((u.block, crc))

    pool = BufferPool(max(1, io_threads) * VERIFY_RANGE_BYTES, slot_bytes=VERIFY_RANGE_BYTES)
    read_verified(storage, wants, deliver, threads=io_threads, pool=pool, piece_bytes=VERIFY_RANGE_BYTES, on_mismatch=mismatch)
    out = [_damage_message(storage, c, bad) for c, bad in damaged.items()]
    for c, h in hashers.items():
        if c not in damaged and h.hexdigest() != c.content_hash:
            out.append(f"{storage.url_of(c.file)}: chunk {c.key!r} of tensor {c.tensor!r}: {hash_algo} content hash differs from the index")
    return out


def check_data_file(
    storage: Any, m: Manifest, rel: str, chunks: List[Tuple[str, ChunkMeta]], on_bytes: Optional[Callable[[int], None]]
) -> List[str]:
    """Problems of one data file: its header against the manifest, then every byte of ``chunks`` (its ``(tensor, chunk)`` pairs).

    What :func:`verify` does, for one file (the memory tier checks a staged file with it).
    """
    errs, good = _check_header(storage, m, rel, chunks)
    return errs + _check_chunks(storage, good, io_threads=1, on_bytes=on_bytes, hash_algo=_hash_algo(m))


def check_file(storage: Any, manifest: Manifest, rel: str, chunks: Optional[List[Tuple[str, ChunkMeta]]]) -> Optional[str]:
    """What is wrong with one file ``rel`` of a checkpoint on local disk (None: it is good): size, then its checksums.

    The single-file check (the memory tier checks each staged file with it
    before using or uploading it): an index file against its CRC-32C in the
    manifest; a data file chunk by chunk (``chunks``: its ``(tensor name,
    chunk)`` pairs), block CRCs from the index files, as :func:`verify`
    does (:func:`check_data_file`). The manifest itself is checked when opened.

    Args:
        storage: a storage with local paths (``storage.path``).
        manifest: the checkpoint's manifest.
        rel: the file, relative to the checkpoint.
        chunks: a data file's ``(tensor name, chunk)`` pairs (None: none to check).

    Example:
        >>> check_file(storage, manifest, "data/0123456789ab-index-r00000.json", None)   # doctest: +SKIP
    """
    want = manifest.files.get(rel)
    if want is None:
        return f"{rel} is not a file of the checkpoint"
    try:
        size = os.path.getsize(storage.path(rel))
    except OSError as e:
        return f"{rel}: {e}"
    if size != want.size:
        return f"{rel} has {size} bytes, the manifest says {want.size}"
    if rel in manifest.indexes:
        with open(storage.path(rel), "rb") as f:
            got = crc32c(f.read())
        exp = manifest.indexes[rel].crc32c
        return None if got == exp else f"{rel} has crc32c {got:#010x}, the manifest says {exp:#010x}"
    errs = check_data_file(storage, manifest, rel, list(chunks or []), None)
    return "; ".join(errs) if errs else None


def _hash_algo(m: Manifest) -> str:
    """The manifest's content hash algorithm (format v4), or "" (earlier versions: none)."""
    return m.content_hash if spec(m.version).content_hash else ""


def _check_header(storage: Any, m: Manifest, rel: str, chunks: List[Tuple[str, ChunkMeta]]) -> Tuple[List[str], List[Chunk]]:
    """One data file's safetensors header against the manifest: its problems, and the chunks whose bytes to check."""
    where = storage.url_of(rel)
    try:
        header, start = read_safetensors_header(storage, rel, m.files[rel].size)
    except CorruptCheckpointError as e:
        return [str(e)], []
    errs: List[str] = []
    good: List[Chunk] = []
    block_bytes = m.block_bytes if spec(m.version).block_checksums else 0
    for name, c in chunks:
        ent = header.get(c.key)
        if not isinstance(ent, dict) or ent.get("dtype") != m.tensors[name].dtype or ent.get("shape") != c.sizes or (
            start + ent["data_offsets"][0] != c.byte_offset
        ):
            errs.append(f"{where}: header entry {c.key!r} disagrees with the manifest")
            continue
        if c.nbytes == 0 and c.crc32c not in (None, 0):
            errs.append(f"{where}: chunk {c.key!r} of tensor {name!r} has crc32c 0x00000000, manifest says {c.crc32c:#010x}")
            continue
        good.append(Chunk.from_meta(name, c, block_bytes))
    return errs, good


def _damage_message(storage: Any, c: Chunk, bad: List[Tuple[int, Optional[int]]]) -> str:
    """The problem line of one damaged chunk: its CRC (v1), or its damaged blocks by file byte range (v2/v3)."""
    where = storage.url_of(c.file)
    if not c.blocked:
        crc = bad[0][1]
        if crc is None:
            return f"{where}: chunk {c.key!r} truncated"
        return f"{where}: chunk {c.key!r} of tensor {c.tensor!r} has crc32c {crc:#010x}, manifest says {c.crc32c:#010x}"
    bb = c.block_bytes
    blocks = sorted(b for b, _ in bad)
    shown = ", ".join(f"[{c.byte_offset + i * bb}, {c.byte_offset + min((i + 1) * bb, c.nbytes)})" for i in blocks[:5])
    more = f" and {len(blocks) - 5} more" if len(blocks) > 5 else ""
    return (
        f"{where}: chunk {c.key!r} of tensor {c.tensor!r}: crc32c of {plural(len(blocks), 'block')} differs from the "
        f"index (file bytes {shown}{more})"
    )
