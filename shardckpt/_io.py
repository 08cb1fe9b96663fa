"""Writing tensor bytes: the one checksummed writer (parallel files, block CRCs in the same pass).

Writes stream each chunk straight from tensor memory (a contiguous CPU tensor
is written without a copy; a GPU tensor goes through two pinned buffers, the
next block's device-to-host copy overlapping this block's write) in blocks,
updating the block CRC-32Cs (``_format.checksum.BlockCrcs``) as each block
goes out. Local files are written behind: see ``_storage.WRITEBACK_BYTES``.
Files are cut so no safetensors header passes ``SHARDCKPT_HEADER_BYTES_PER_FILE``.

Reads are not here: every read of saved bytes goes through the one verified
reader, ``_readers.read_verified``. See docs/performance.md.
"""

from __future__ import annotations

import functools
import json
import math
import threading
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from typing import Any, Callable, Dict, Iterable, List, Mapping, Optional, Sequence, Tuple, cast

import torch

from . import _knobs
from ._format import ChunkMeta, FileMeta, itemsize, safetensors_header
from ._format.checksum import BlockCrcs, crc32c, crc32c_combine, new_hasher
from ._format.header import MAX_HEADER_BYTES
from ._storage import Storage
from .errors import UnsupportedStateError

__all__ = [
    "WriteItem",
    "crc32c_combine",
    "write_files",
    "partition",
    "split_by_header",
    "split_files_by_header",
    "entry_header_bytes",
    "tensor_bytes",
    "byte_view",
    "host_empty",
    "crc32c",
    "data_file_header",
    "write_packed",
    "write_placed",
]

# Tunables live in ``_knobs`` (SHARDCKPT_* environment variables) and are
# read there at each use (``_knobs.WRITE_BLOCK_BYTES``...), never copied, so
# that an in-process override takes effect at the next call.


@functools.lru_cache(maxsize=None)
def _numpy_ok() -> bool:
    try:
        torch.zeros(1, dtype=torch.uint8).numpy()
        return True
    except RuntimeError:  # "Numpy is not available"
        return False


def host_empty(n: int) -> torch.Tensor:
    """An uninitialized flat uint8 CPU tensor of ``n`` bytes that :func:`byte_view` can view writably.

    With NumPy this is ``torch.empty``; without it the memory is a Python
    ``bytearray`` the tensor is built over (``torch.frombuffer``), so a
    writable view of it needs no pointer arithmetic.

        >>> len(byte_view(host_empty(3)))
        3
    """
    if n == 0 or _numpy_ok():
        return torch.empty(n, dtype=torch.uint8)
    buf = bytearray(n)
    t = torch.frombuffer(buf, dtype=torch.uint8)
    t._shardckpt_buf = buf  # type: ignore[attr-defined]  # byte_view finds the memory here (frombuffer also keeps it alive)
    return t


def _check_plain(t: torch.Tensor) -> None:
    """Refuse what has no plain bytes to view: a subclass, a lazy conj/neg view, another device."""
    if type(t) not in (torch.Tensor, torch.nn.Parameter):
        raise UnsupportedStateError(
            f"internal error: a {type(t).__module__}.{type(t).__qualname__} reached the byte writer; tensor "
            "subclasses are taken apart (or refused) by the state walk"
        )
    if t.is_conj() or t.is_neg():
        raise AssertionError("internal error: byte_view of a lazy conj/neg view (tensor_bytes resolves them)")
    if t.device.type != "cpu" or not t.is_contiguous():
        raise AssertionError("internal error: byte_view needs a contiguous CPU tensor")


def byte_view(t: torch.Tensor) -> memoryview:
    """Flat memoryview of a contiguous CPU tensor's bytes, without a copy where that is safe.

    Only through safe interfaces, never a raw pointer: NumPy's buffer when
    torch has NumPy (writable, no copy). Without NumPy: a tensor from
    :func:`host_empty` is viewed through its ``bytearray`` (writable, no
    copy); any other tensor's bytes are copied into a new buffer and the
    view is read-only (so a writer into it fails loudly instead of losing
    the bytes).

    Raises:
        UnsupportedStateError: a tensor subclass (it has no bytes of its own).
        AssertionError: a lazy conj/neg view, a non-contiguous or non-CPU
            tensor (callers resolve those first).

    Example:
        >>> bytes(byte_view(torch.tensor([1, 2], dtype=torch.uint8)))
        b'\\x01\\x02'
    """
    n = t.numel() * t.element_size()
    if n == 0:
        return memoryview(bytearray(0))
    _check_plain(t)
    # as_strided: a contiguous tensor with a size-1 dim may report any stride
    # there (a [1] slice of a [256] tensor has stride 256), which view() refuses.
    flat = t.detach().as_strided((t.numel(),), (1,)).view(torch.uint8)
    try:
        return memoryview(cast(Any, flat.numpy())).cast("B")
    except RuntimeError:  # "Numpy is not available"
        pass
    base = t if t._base is None else t._base
    buf = getattr(base, "_shardckpt_buf", None)
    if buf is not None:
        start = (t.storage_offset() - base.storage_offset()) * t.element_size()
        return memoryview(buf)[start : start + n]
    out = bytearray(n)
    torch.frombuffer(out, dtype=torch.uint8).copy_(flat)
    return memoryview(out).toreadonly()


def tensor_bytes(t: torch.Tensor) -> memoryview:
    """A tensor's bytes as a flat memoryview (copies only if it must: another device, not contiguous, lazy view).

    A lazy conjugate or negative view (``x.conj()``, ``x.neg()`` of a
    complex view) is resolved first, so the bytes are the values the tensor
    shows, as every writer (sync, async thread, writer process) stores them.
    """
    t = t.detach()
    if t.is_conj() or t.is_neg():
        t = t.resolve_conj().resolve_neg()
    if t.device.type != "cpu":
        t = t.cpu()
    if not t.is_contiguous():
        t = t.contiguous()
    flat = t.reshape(-1)
    if flat.numel() == 0:
        return memoryview(b"")
    return byte_view(flat)


#: Piece of a CPU chunk that is checksummed and then written at once (at most
#: ``SHARDCKPT_WRITE_BLOCK_BYTES``): small enough to be still in cache for the
#: write, large enough that a write call costs nothing beside its bytes.
FUSED_WRITE_BYTES = 2 << 20


@dataclass
class WriteItem:
    """One chunk to write: ``tensor`` holds exactly the box ``offsets``/``sizes``.

    ``stream`` (the converters): instead of a tensor, a callable returning
    the chunk's bytes as an iterable of byte pieces, in order, pulled while
    the file is written (bounded memory for chunks read from another file).
    """

    name: str
    key: str
    dtype: str
    offsets: Tuple[int, ...]
    sizes: Tuple[int, ...]
    tensor: Optional[torch.Tensor]
    stream: Optional[Callable[[], Iterable[memoryview]]] = None
    #: The chunk's content hash when already known (an incremental save hashed
    #: it to look for an earlier copy): the write pass then does not hash again;
    #: "": not hashed at all (a chunk an incremental run knows is changing).
    hash: Optional[str] = None

    @property
    def nbytes(self) -> int:
        return math.prod(self.sizes) * itemsize(self.dtype)


#: Header bytes of a data file besides its entries (``__metadata__``'s fixed
#: fields, braces, the 8-byte length and padding), rounded up.
HEADER_BASE_BYTES = 256
#: Widest ``data_offsets`` value (20 digits), for the header estimate.
_MAX_OFFSET = 2**64 - 1


def entry_header_bytes(key: str, name: str, dtype: str, sizes: Sequence[int], offsets: Sequence[int]) -> int:
    """Upper bound of the bytes one chunk adds to its data file's safetensors header.

    Its tensor entry (offsets counted at their widest) plus its record in
    ``__metadata__["shardckpt"]``, a JSON text inside the JSON header whose
    quotes and backslashes are escaped again (counted twice).

    Example:
        >>> entry_header_bytes("w", "w", "F32", [2, 3], [0, 0]) < 200
        True
    """
    entry = json.dumps({key: {"dtype": dtype, "shape": list(sizes), "data_offsets": [_MAX_OFFSET, _MAX_OFFSET]}}, separators=(",", ":"))
    meta = json.dumps({key: {"tensor": name, "offsets": list(offsets)}}, separators=(",", ":"))
    return len(entry) + 2 * len(meta)


def split_by_header(costs: Sequence[int], limit: int) -> List[Tuple[int, int]]:
    """Cut a file's entries (header bytes ``costs``, in file order) into runs whose headers stay within ``limit``.

    Pure planning on ints: returns ``[(start, stop), ...]`` covering
    ``range(len(costs))`` in order, each run's ``HEADER_BASE_BYTES + sum``
    at most ``limit``. An entry too big for any file alone gets a run of its
    own (its file's header then exceeds the limit; only a name of megabytes
    does that).

    Example:
        >>> split_by_header([100, 100, 100], HEADER_BASE_BYTES + 200)
        [(0, 2), (2, 3)]
    """
    runs: List[Tuple[int, int]] = []
    start, used = 0, HEADER_BASE_BYTES
    for i, c in enumerate(costs):
        if i > start and used + c > limit:
            runs.append((start, i))
            start, used = i, HEADER_BASE_BYTES
        used += c
    if costs:
        runs.append((start, len(costs)))
    return runs


def split_files_by_header(files: Dict[str, Sequence[Any]], *, header_limit: Optional[int] = None) -> Dict[str, List[Any]]:
    """Planned files (tag -> entries in file order) with each file whose header would pass the limit cut in several.

    For writers that plan their own files (the converters): an entry needs
    ``key``, ``name``, ``dtype``, ``offsets`` and ``sizes`` (or ``shape``). A
    file that fits keeps its tag; a cut one becomes ``<tag>-h000``,
    ``<tag>-h001``, ... (default limit ``_knobs.HEADER_BYTES_PER_FILE``).

    Example:
        >>> split_files_by_header({"00": []})
        {}
    """
    limit = header_limit if header_limit is not None else _knobs.HEADER_BYTES_PER_FILE
    out: Dict[str, List[Any]] = {}
    for tag, ents in files.items():
        ents = list(ents)
        costs = [entry_header_bytes(e.key, e.name, e.dtype, getattr(e, "sizes", None) or e.shape, e.offsets) for e in ents]
        runs = split_by_header(costs, limit)
        for j, (a, b) in enumerate(runs):
            out[tag if len(runs) == 1 else f"{tag}-h{j:03d}"] = ents[a:b]
    return out


def partition(
    items: Sequence[WriteItem], parts: int, *, header_limit: Optional[int] = None
) -> List[List[WriteItem]]:
    """Split items into files: at most ``parts`` groups of balanced bytes, each cut so its header stays small.

    Bytes decide the groups (one per I/O thread above ``_knobs.MIN_BYTES_PER_FILE``);
    a group whose estimated header (:func:`entry_header_bytes`) exceeds
    ``header_limit`` (default ``_knobs.HEADER_BYTES_PER_FILE``) becomes
    several files (:func:`split_by_header`): safetensors readers refuse
    headers over 100 MB, which a rank of many small tensors would otherwise
    write. Order is kept inside a file.
    """
    limit = header_limit if header_limit is not None else _knobs.HEADER_BYTES_PER_FILE
    out: List[List[WriteItem]] = []
    for g in _balance(items, parts):
        costs = [entry_header_bytes(it.key, it.name, it.dtype, it.sizes, it.offsets) for it in g]
        out.extend(g[a:b] for a, b in split_by_header(costs, limit))
    return out


def _balance(items: Sequence[WriteItem], parts: int) -> List[List[WriteItem]]:
    """Items in at most ``parts`` groups of balanced bytes (order kept inside a group)."""
    total = sum(it.nbytes for it in items)
    parts = max(1, min(parts, math.ceil(total / _knobs.MIN_BYTES_PER_FILE) if total else 1, len(items) or 1))
    groups: List[List[WriteItem]] = [[] for _ in range(parts)]
    load = [0] * parts
    for idx in sorted(range(len(items)), key=lambda i: (-items[i].nbytes, i)):
        g = min(range(parts), key=lambda j: (load[j], j))
        groups[g].append(items[idx])
        load[g] += items[idx].nbytes
    for group in groups:
        # Widest dtypes first (as safetensors does): with the header padded to
        # 8 bytes, every chunk then starts aligned to its element size, so a
        # reader can view the bytes as the dtype without a copy.
        group.sort(key=lambda it: (-itemsize(it.dtype), it.name, it.offsets))
    return [g for g in groups if g]


class _Pass:
    """The checksums of one chunk's write pass: block CRC-32Cs and, when asked, the content hash."""

    def __init__(self, block_bytes: int, hasher: Any):
        self.crcs = BlockCrcs(block_bytes, enabled=_knobs.CHECKSUMS)
        self.hasher = hasher

    def update(self, data) -> None:
        self.crcs.update(data)
        if self.hasher is not None:
            self.hasher.update(data)


def data_file_header(items: Sequence[WriteItem], *, chunk_metadata: bool = True) -> Tuple[bytes, List[int]]:
    """A data file's safetensors header and each chunk's absolute byte offset, for ``items`` in file order.

    The one layout of a data file: :func:`write_files` writes it, and the
    memory tier (``_memory/snapshot.py``) copies each chunk straight to its
    offset in a shared-memory file laid out by it.

    Example:
        >>> import torch
        >>> it = WriteItem("w", "w", "F32", (0,), (4,), torch.zeros(4))
        >>> header, starts = data_file_header([it]); starts == [len(header)]
        True
    """
    chunks_md = {it.key: {"tensor": it.name, "offsets": list(it.offsets)} for it in items} if chunk_metadata else None
    return safetensors_header([(it.key, it.dtype, it.sizes, it.nbytes) for it in items], chunks=chunks_md)


def _checked_header(storage: Storage, rel: str, items: Sequence[WriteItem], chunk_metadata: bool) -> Tuple[bytes, List[int]]:
    header, starts = data_file_header(items, chunk_metadata=chunk_metadata)
    if len(header) - 8 > MAX_HEADER_BYTES:
        # Planning keeps headers far below this (``partition``); a writer must
        # still never leave a file that safetensors' readers (and verify) refuse.
        raise UnsupportedStateError(
            f"{storage.url_of(rel)}: its safetensors header would be {len(header) - 8} bytes, over the "
            f"{MAX_HEADER_BYTES} that safetensors readers accept; split the chunks over more files "
            "(SHARDCKPT_HEADER_BYTES_PER_FILE) or shorten the tensor names"
        )
    return header, starts


def _write_one(
    storage: Storage, rel: str, items: Sequence[WriteItem], block_bytes: int, chunk_metadata: bool = True,
    hash_algo: Optional[str] = None,
) -> Tuple[List[ChunkMeta], FileMeta]:
    header, starts = _checked_header(storage, rel, items, chunk_metadata)
    out: List[ChunkMeta] = []
    w = storage.open_write(rel)
    try:
        w.write(header)
        size = len(header)
        bounce: List[torch.Tensor] = []  # pinned buffers for GPU chunks, reused across them
        for it, start in zip(items, starts):
            # The block CRCs (v2) and the content hash (v4) are computed as
            # the bytes go out; the chunk's CRC (v1's one number) is joined
            # from the blocks. A hash known already is not computed again.
            crcs = _Pass(block_bytes, new_hasher(hash_algo) if hash_algo and it.hash is None else None)
            if it.stream is not None:
                _write_stream(w, it, crcs)
            elif cast(torch.Tensor, it.tensor).device.type == "cuda" and it.nbytes > 0:
                _write_cuda(w, it, bounce, crcs)
            else:
                mv = tensor_bytes(cast(torch.Tensor, it.tensor))
                if len(mv) != it.nbytes:
                    raise AssertionError(f"{it.key}: {len(mv)} bytes, expected {it.nbytes}")
                # CRC then write each piece while it is in this thread's cache:
                # one pass over the tensor's memory, not two.
                step = max(1, min(_knobs.WRITE_BLOCK_BYTES, FUSED_WRITE_BYTES))
                for off in range(0, len(mv), step):
                    block = mv[off : off + step]
                    crcs.update(block)
                    w.write(block)
                del mv
            blocks = crcs.crcs.finish()
            size += it.nbytes
            out.append(
                ChunkMeta(
                    file=rel,
                    key=it.key,
                    offsets=list(it.offsets),
                    sizes=list(it.sizes),
                    byte_offset=start,
                    nbytes=it.nbytes,
                    crc32c=crcs.crcs.crc,
                    blocks=blocks,
                    hash=(it.hash or None) if crcs.hasher is None else crcs.hasher.hexdigest(),
                )
            )
        w.close()
    except BaseException:
        w.abort()
        raise
    return out, FileMeta(size)


def write_packed(storage: Storage, rel: str, items: Sequence[WriteItem], pieces: Iterable[memoryview]) -> FileMeta:
    """Write a plain safetensors file (no chunk metadata, no checksums) whose data comes from ``pieces``.

    ``pieces``: the items' bytes concatenated in file order, cut anywhere
    (large pieces make large ``write`` calls: a producer packs many small
    tensors into one). For files nothing verifies later (Hugging Face
    exports); the bytes are the caller's, verified when they were read.
    ``items`` give the header only (their ``tensor``/``stream`` are unused).

    Raises:
        AssertionError: ``pieces`` hold a different number of bytes than ``items``.
        OSError / StorageError: a write failed (the partial file is aborted).

    Example:
        >>> write_packed(storage, "model.safetensors", shells, (byte_view(b) for b in buffers))   # doctest: +SKIP
    """
    header, _ = _checked_header(storage, rel, items, False)
    want = sum(it.nbytes for it in items)
    w = storage.open_write(rel)
    try:
        w.write(header)
        n = 0
        for piece in pieces:
            w.write(piece)
            n += len(piece)
        if n != want:
            raise AssertionError(f"internal error: {rel}: {n} data bytes written, expected {want}")
        w.close()
    except BaseException:
        w.abort()
        raise
    return FileMeta(len(header) + want)


def write_placed(storage: Storage, rel: str, items: Sequence[WriteItem], fill: Callable[[Callable[[int, Any], None]], None]) -> FileMeta:
    """Write a plain safetensors file whose data bytes ``fill`` places at their offsets, from any threads.

    The header is written first; then ``fill(put)`` runs, and ``put(pos,
    data)`` writes ``data`` at byte ``pos`` of the data section (after the
    header) with ``pwrite``: the threads that read and verified the bytes
    write them themselves, no buffer between, and each written range is
    handed to writeback at once (many writes of one file in flight). For a
    storage whose writers take ``write_at`` (``caps.positional_write``);
    ``fill`` must cover every data byte exactly once. Like
    :func:`write_packed`: no chunk metadata, no checksums (the caller's bytes
    were verified when read).

    Raises:
        AssertionError: ``fill`` placed another number of bytes than ``items`` hold.
        OSError / StorageError: a write failed; whatever ``fill`` raises (the partial file is aborted).

    Example:
        >>> write_placed(storage, "model.safetensors", shells, lambda put: put(0, data))   # doctest: +SKIP
    """
    header, _ = _checked_header(storage, rel, items, False)
    want = sum(it.nbytes for it in items)
    w = storage.open_write(rel)
    base = len(header)
    lock = threading.Lock()
    placed = [0]

    def put(pos: int, data: Any) -> None:
        n = w.write_at(data, base + pos)
        with lock:
            placed[0] += n

    try:
        w.write(header)
        fill(put)
        if placed[0] != want:
            raise AssertionError(f"internal error: {rel}: {placed[0]} data bytes placed, expected {want}")
        w.close()
    except BaseException:
        w.abort()
        raise
    return FileMeta(base + want)


def _write_stream(w, it: WriteItem, crcs: _Pass) -> None:
    """Write a chunk whose bytes come from ``it.stream`` (pieces of any size, in order)."""
    n = 0
    for piece in it.stream():  # type: ignore[misc]
        crcs.update(piece)
        w.write(piece)
        n += len(piece)
    if n != it.nbytes:
        raise AssertionError(f"internal error: {it.key}: streamed {n} bytes, expected {it.nbytes}")


def _write_cuda(w, it: WriteItem, bounce: List[torch.Tensor], crcs: _Pass) -> None:
    """Stream a GPU chunk through two pinned buffers: block k+1 copies while block k is written."""
    src = cast(torch.Tensor, it.tensor).detach()
    if src.is_conj() or src.is_neg():
        src = src.resolve_conj().resolve_neg()
    if not src.is_contiguous():
        src = src.contiguous()
    flat = src.reshape(-1).view(torch.uint8)
    if len(flat) != it.nbytes:
        raise AssertionError(f"{it.key}: {len(flat)} bytes, expected {it.nbytes}")
    block = _knobs.WRITE_BLOCK_BYTES
    if not bounce or len(bounce[0]) < min(block, it.nbytes):
        bounce[:] = [torch.empty(min(block, max(it.nbytes, 1)), dtype=torch.uint8, pin_memory=True) for _ in range(2)]
    size = len(bounce[0])
    stream = torch.cuda.Stream(device=src.device)
    # The chunk may still be being produced on the current stream.
    stream.wait_stream(torch.cuda.current_stream(src.device))
    done = [torch.cuda.Event(), torch.cuda.Event()]
    offs = list(range(0, it.nbytes, size))

    def issue(k: int) -> None:
        off = offs[k]
        n = min(size, it.nbytes - off)
        with torch.cuda.stream(stream):
            bounce[k % 2][:n].copy_(flat[off : off + n], non_blocking=True)
            done[k % 2].record(stream)

    issue(0)
    for k, off in enumerate(offs):
        if k + 1 < len(offs):
            # Buffer (k+1) % 2 last held block k-1, already written out.
            issue(k + 1)
        done[k % 2].synchronize()
        n = min(size, it.nbytes - off)
        mv = byte_view(bounce[k % 2][:n])
        crcs.update(mv)
        w.write(mv)


def write_files(
    storage: Storage,
    files: Mapping[str, Sequence[WriteItem]],
    *,
    threads: Optional[int] = None,
    block_bytes: Optional[int] = None,
    chunk_metadata: bool = True,
    hash_algo: Optional[str] = None,
) -> Tuple[List[ChunkMeta], Dict[str, FileMeta]]:
    """Write each file in parallel (safetensors, checksummed in the same pass); return chunk metadata and file sizes.

    The one checksummed writer: ``save`` and every converter write tensor
    bytes through it. Each returned chunk carries its CRC-32C and the CRC-32C
    of every ``block_bytes`` slice (``blocks``, format v2); the caller
    commits with :func:`shardckpt._format.commit`.

    Args:
        storage: destination.
        files: relative path -> chunks to write into it, in order.
        threads: files written in parallel (default ``SHARDCKPT_IO_THREADS``, read now).
        block_bytes: block checksum size (default ``_knobs.BLOCK_BYTES``).
        chunk_metadata: describe each chunk (tensor, offsets) in the file's
            ``__metadata__`` (native files); False for plain safetensors
            (Hugging Face exports).
        hash_algo: content hash of each chunk (format v4, ``ChunkMeta.hash``),
            in the same pass (``checksum.HASH_ALGOS``); default none: it
            costs CPU time, and only incremental saves need it.

    Raises:
        OSError / StorageError: a write failed (the caller removes the files).

    Example:
        >>> chunks, sizes = write_files(storage, {"data/x.safetensors": items})   # doctest: +SKIP
    """
    bb = block_bytes or _knobs.BLOCK_BYTES
    threads = _knobs.IO_THREADS if threads is None else threads
    hash_algo = hash_algo or ""
    chunks: List[ChunkMeta] = []
    metas: Dict[str, FileMeta] = {}
    if not files:
        return chunks, metas
    if len(files) == 1 or threads <= 1:
        results = [(rel, _write_one(storage, rel, items, bb, chunk_metadata, hash_algo)) for rel, items in files.items()]
    else:
        with ThreadPoolExecutor(max_workers=min(threads, len(files)), thread_name_prefix="shardckpt-w") as ex:
            futs = {rel: ex.submit(_write_one, storage, rel, items, bb, chunk_metadata, hash_algo) for rel, items in files.items()}
            results = [(rel, f.result()) for rel, f in futs.items()]
    for rel, (c, fm) in results:
        chunks.extend(c)
        metas[rel] = fm
    storage.fsync_dirs({rel.rsplit("/", 1)[0] if "/" in rel else "" for rel in files})
    return chunks, metas
