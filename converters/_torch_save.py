"""Import ``torch.save`` files; shared machinery for reading torch.save payloads by byte ranges.

A ``torch.save`` file is a zip: a pickle (``data.pkl``) describing the
structure and one uncompressed record per storage. ``torch.load(...,
map_location="meta", weights_only=True)`` runs torch's restricted unpickler
(only tensors, containers and plain values; anything that names another
global is refused before it runs) and reads no tensor bytes; each meta
storage then tells where its record's bytes start. The tensors are streamed
from those byte ranges, checked against the CRC-32 of their zip records.
"""

from __future__ import annotations

import io
import json
import os
import pickle
import struct
import zipfile
from dataclasses import replace
from typing import TYPE_CHECKING, Any, Callable, Dict, List, Optional, Tuple, Type

import torch

from shardckpt._format import check_relpath, checked_shape, dtype_name
from shardckpt._format.chunk import Chunk
from shardckpt._format.values import TAG, rename_refs, value_depth_problem
from shardckpt._hf import map_names, select_names
from shardckpt._state import flatten_for_save
from shardckpt._storage import Storage
from shardckpt.errors import (
    CheckpointNotFoundError,
    CorruptCheckpointError,
    UnsafeMetadataError,
    UnsupportedStateError,
    format_offenders,
)

from ._common import write_whole
from ._options import ConvertResult, Options, SelectOptions, check_apart, split_url
from ._safetensors import arrange_imported
from ._source import Source, SrcTensor

if TYPE_CHECKING:
    from typing_extensions import Unpack

__all__ = ["from_torch_save", "RangeFile", "load_meta", "chunk_of", "new_tensor", "source_from_state", "memory_chunk", "write_imported"]


class RangeFile(io.RawIOBase):
    """A read-only, seekable file over bytes ``[start, start + length)`` of a storage file."""

    def __init__(self, storage: Storage, rel: str, start: int, length: int):
        super().__init__()
        self.storage, self.rel, self.start, self.length = storage, rel, start, length
        self.pos = 0

    def readable(self) -> bool:
        return True

    def seekable(self) -> bool:
        return True

    def tell(self) -> int:
        return self.pos

    def seek(self, offset: int, whence: int = io.SEEK_SET) -> int:
        base = {io.SEEK_SET: 0, io.SEEK_CUR: self.pos, io.SEEK_END: self.length}[whence]
        self.pos = max(0, base + offset)
        return self.pos

    def readinto(self, b) -> int:
        n = max(0, min(len(b), self.length - self.pos))
        if n == 0:
            return 0
        data = self.storage.read_range(self.rel, self.start + self.pos, n)
        if len(data) != n:
            raise EOFError(f"{self.storage.url_of(self.rel)}: file ends before byte {self.start + self.pos + n}")
        memoryview(b).cast("B")[:n] = data
        self.pos += n
        return n


def _refusal(e: BaseException) -> str:
    msg = str(e)
    for line in msg.splitlines():
        if "Unsupported global" in line or "Unsupported operand" in line or "unsupported" in line.lower():
            return line.strip()
    return msg.splitlines()[0] if msg else type(e).__name__


#: What torch.load raises on malformed input (its zip reader and unpickler
#: assert, index and look up while parsing); all of it means "damaged file".
MALFORMED_ERRORS: Tuple[Type[BaseException], ...] = (
    RuntimeError, ValueError, EOFError, AssertionError, KeyError, IndexError, TypeError, AttributeError,
    RecursionError, OverflowError,
    # torch 2.11's weights-only unpickler unpacks lengths with struct and lets
    # a short read escape as struct.error (2.13 raises UnpicklingError).
    struct.error,
)


def weights_only_load(f: Any, *, where: str, map_location: str, corrupt: str, errors: Tuple[Type[BaseException], ...] = MALFORMED_ERRORS) -> Any:
    """``torch.load(f, weights_only=True)``, its refusals and failures as our errors.

    Raises UnsafeMetadataError when the pickle names anything outside torch's
    weights-only allowlist (nothing from it is run), CorruptCheckpointError
    ``"{where}: {corrupt} (why)"`` on ``errors``.
    """
    try:
        return torch.load(f, map_location=map_location, weights_only=True)
    except pickle.UnpicklingError as e:
        raise UnsafeMetadataError(
            f"{where}: refused to unpickle: {_refusal(e)}. Only tensors, containers and plain values are "
            "allowed (torch.load weights_only=True); nothing from the file was run"
        ) from None
    except errors as e:
        raise CorruptCheckpointError(f"{where}: {corrupt} ({str(e).splitlines()[0] if str(e) else type(e).__name__})") from None


def load_meta(storage: Storage, rel: str, start: int, length: int, *, where: str) -> Tuple[Any, Dict[int, Tuple[int, int]]]:
    """Unpickle a torch.save payload with meta tensors; also ``{data offset: (crc32, size)}`` of its records.

    Raises UnsafeMetadataError when the pickle names anything outside torch's
    weights-only allowlist (nothing from it is run), CorruptCheckpointError
    when it is not a readable torch.save payload.
    """
    raw = RangeFile(storage, rel, start, length)
    f = io.BufferedReader(raw, buffer_size=64 << 10)
    obj = weights_only_load(f, where=where, map_location="meta", corrupt="not a readable torch.save payload",
                            errors=MALFORMED_ERRORS + (zipfile.BadZipFile,))
    return obj, _zip_records(f, where)


def _zip_records(f, where: str) -> Dict[int, Tuple[int, int]]:
    out: Dict[int, Tuple[int, int]] = {}
    try:
        f.seek(0)
        with zipfile.ZipFile(f) as z:
            for zi in z.infolist():
                if "/data/" not in zi.filename or zi.compress_type != zipfile.ZIP_STORED:
                    continue
                f.seek(zi.header_offset)
                local = f.read(30)
                if len(local) < 30 or local[:4] != b"PK\x03\x04":
                    continue
                n, m = struct.unpack("<HH", local[26:30])
                out[zi.header_offset + 30 + n + m] = (zi.CRC, zi.file_size)
    except (zipfile.BadZipFile, OSError, ValueError, EOFError, NotImplementedError, struct.error):
        # zipfile raises NotImplementedError for odd versions, struct.error for short records.
        return {}  # offsets come from torch; CRCs are a bonus check
    return out


def chunk_of(
    into: SrcTensor,
    t: torch.Tensor,
    storage: Storage,
    rel: str,
    start: int,
    length: int,
    records: Dict[int, Tuple[int, int]],
    *,
    where: str,
    offsets: Optional[Tuple[int, ...]] = None,
    key: Optional[str] = None,
) -> None:
    """Add to ``into`` the chunk whose bytes the meta tensor ``t`` from :func:`load_meta` has (``start``: payload offset in ``rel``).

    A contiguous tensor is a byte range, checked by its zip record's CRC-32
    when it is the whole record; a strided view gets a loader (its storage
    read whole, then copied). ``offsets`` / ``key``: the chunk's place in
    ``into`` and its key (default: all of ``into``, under its name).
    """
    name = into.name
    st = t.untyped_storage()
    off = getattr(st, "_checkpoint_offset", None)
    if off is None:
        raise UnsupportedStateError(f"{where}: this torch does not report storage offsets (torch >= 2.6 needed)")
    isz = t.element_size()
    snb = st.nbytes()
    if off < 0 or off + snb > length:
        raise CorruptCheckpointError(f"{where}: tensor {name!r} storage [{off}, {off + snb}) lies outside the payload of {length} bytes")
    # torch's unpickler refuses most impossible shapes itself; the one shape
    # check every reader applies still runs, so the rule lives in one place.
    shape = tuple(checked_shape(tuple(t.shape), isz, where=f"{where}: tensor {name!r}"))
    nbytes = t.numel() * isz
    if t.numel() and (t.storage_offset() + _span(t)) * isz > snb:
        raise CorruptCheckpointError(f"{where}: tensor {name!r} reaches past its storage")
    box = (0,) * len(shape) if offsets is None else offsets
    key = name if key is None else key
    if t.is_contiguous():
        rec = records.get(off)
        crc = None
        if rec is not None and rec[1] == snb and t.storage_offset() == 0 and nbytes == snb and (rec[0] or not nbytes):
            crc = rec[0]
        into.add(Chunk(file=rel, byte_offset=start + off + t.storage_offset() * isz, nbytes=nbytes, offsets=box, sizes=shape,
                       tensor=name, key=key), zip_crc=crc)
        return
    size, stride, soff, dtype = tuple(t.shape), tuple(t.stride()), t.storage_offset(), t.dtype
    url = storage.url_of(rel)

    def load() -> torch.Tensor:
        data = storage.read_range(rel, start + off, snb)
        if len(data) != snb:
            raise CorruptCheckpointError(f"{url}: truncated storage of {name!r}")
        base = torch.frombuffer(bytearray(data), dtype=torch.uint8).view(dtype)
        return base.as_strided(size, stride, soff).contiguous()

    into.add(Chunk(file=rel, byte_offset=start + off, nbytes=nbytes, offsets=box, sizes=shape, tensor=name, key=key), loader=load)


def new_tensor(name: str, t: torch.Tensor) -> SrcTensor:
    """A source tensor of ``t``'s dtype and shape, without chunks yet."""
    return SrcTensor(name=name, dtype=dtype_name(t.dtype, key=name), shape=tuple(t.shape), chunks=[])


def _span(t: torch.Tensor) -> int:
    return 1 + sum((n - 1) * s for n, s in zip(t.shape, t.stride()) if n > 0)


#: Views of one storage (transposes, slices: each imported as its own tensor)
#: may claim its bytes at most this many times over (beyond the slack below).
MAX_SHARED_VIEWS = 8
SHARED_VIEWS_SLACK_BYTES = 1 << 20


def source_from_state(
    state: Dict[str, Any],
    tensor_for: Callable[[str, torch.Tensor], SrcTensor],
    *,
    url: str,
    storage: Storage,
    kind: str,
    files: Optional[Dict[str, int]] = None,
) -> Source:
    """Flatten a structure holding (meta) tensors into a Source, as a save of it would name them.

    ``tensor_for(name, t)``: where ``t``'s bytes are (its chunks, with their
    zip CRCs or loaders); the tensor is renamed ``name``.

    Names that hold the same stored bytes (one tensor under N names, DCP
    entries naming one stored item) become one tensor and references to it,
    as a save of tied weights writes them: an import never writes (nor a
    load allocates) N copies of one range. Views of one storage (a
    transpose, a slice) stay tensors of their own, up to
    ``MAX_SHARED_VIEWS`` times the stored bytes.

    Raises:
        CorruptCheckpointError: the structure nests deeper than ``MAX_VALUE_DEPTH``.
        UnsafeMetadataError: views claim one storage's bytes more than ``MAX_SHARED_VIEWS`` times over.
    """
    deep = value_depth_problem(state)
    if deep:  # every walker of the tree recurses: refuse before any does
        raise CorruptCheckpointError(f"{url}: {deep}")
    flat = flatten_for_save(state)
    tensors = {}
    for name in sorted(flat.tensors):
        t = flat.tensors[name]
        if not isinstance(t, torch.Tensor) or t.layout != torch.strided or t.is_sparse or t.is_quantized:
            raise UnsupportedStateError(f"{url}: {name}: only dense tensors can be imported, found {type(t).__name__} {getattr(t, 'layout', '')}")
        tensors[name] = replace(tensor_for(name, t), name=name)
    values = _share_stored_bytes(tensors, flat.tree, url)
    return Source(url=url, storage=storage, tensors=tensors, values=values, kind=kind, files=files)


def _share_stored_bytes(tensors: Dict[str, SrcTensor], tree: Any, url: str) -> Any:
    """Keep one tensor per stored byte range (the others become references to it in ``tree``); refuse partial overlaps.

    ``tensors`` is edited in place; returns the tree with references renamed.
    """
    first: Dict[Any, str] = {}
    alias: Dict[str, str] = {}
    for name in sorted(tensors):
        t = tensors[name]
        if t.loaders:
            continue  # a strided view: its bytes are not one range (checked for overlaps below)
        sig = (t.dtype, t.shape, tuple((c.file, c.byte_offset, c.nbytes, c.offsets, c.sizes) for c in t.chunks))
        if not t.chunks or not any(c.nbytes for c in t.chunks):
            continue
        if sig in first:
            alias[name] = first[sig]
        else:
            first[sig] = name
    for name in alias:
        del tensors[name]
    # Views of one storage (a transpose, a slice) legitimately share bytes;
    # hundreds of them over one range is an amplification, not a state dict.
    claims: Dict[str, List[Tuple[int, int]]] = {}
    for t in tensors.values():
        for c in t.chunks:
            if c.file and c.nbytes:
                claims.setdefault(c.file, []).append((c.byte_offset, c.byte_offset + c.nbytes))
    for file, ranges in sorted(claims.items()):
        claimed, covered, end = sum(b - a for a, b in ranges), 0, -1
        for a, b in sorted(ranges):
            covered += max(0, b - max(a, end))
            end = max(end, b)
        if claimed > MAX_SHARED_VIEWS * covered and claimed - covered > SHARED_VIEWS_SLACK_BYTES:
            raise UnsafeMetadataError(
                f"{url}: tensors claim {claimed} bytes of the {covered} bytes stored in {file} (views of one storage, "
                f"more than {MAX_SHARED_VIEWS} times over): an import would write every copy. Save each tensor with "
                "its own storage (.clone()) to import it"
            )
    if not alias:
        return tree
    # Rename references to the dropped names (iterative: the depth was checked, but stay flat anyway).
    root = [tree]
    stack: List[Any] = [root]
    while stack:
        node = stack.pop()
        items = node.items() if isinstance(node, dict) else enumerate(node)
        for k, v in list(items):
            if isinstance(v, dict) and v.get(TAG) == "tensor" and v.get("name") in alias:
                node[k] = dict(v, name=alias[v["name"]])
            elif isinstance(v, (dict, list)):
                stack.append(v)
    return root[0]


def memory_chunk(name: str, t: torch.Tensor) -> SrcTensor:
    """``t`` (held in memory) as a source tensor of one chunk, its bytes given by a loader."""
    data = t.detach().contiguous()
    out = new_tensor(name, data)
    out.add(Chunk(file="", byte_offset=0, nbytes=data.numel() * data.element_size(), offsets=(0,) * data.dim(),
                  sizes=tuple(data.shape), tensor=name, key=name), loader=lambda: data)
    return out


#: The index of a sharded legacy Hugging Face checkpoint (``pytorch_model-00001-of-0000N.bin``...).
BIN_INDEX = "pytorch_model.bin.index.json"
#: The single-file legacy Hugging Face checkpoint name.
BIN_SINGLE = "pytorch_model.bin"
#: The index lists a few names per tensor; refuse absurd ones before parsing.
MAX_INDEX_BYTES = 64 << 20


def _torch_save_files(src: str, storage_options) -> Tuple[Storage, List[str]]:
    """``(storage, [file, ...])`` to import: one torch.save file, or a legacy HF directory's shards (from its index)."""
    if src.endswith(".index.json"):
        parent, index = split_url(src)
        storage = Storage(parent, storage_options=storage_options)
    else:
        storage = Storage(src, storage_options=storage_options)
        index = BIN_INDEX if storage.exists(BIN_INDEX) else None  # type: ignore[assignment]
        if index is None:
            if storage.exists(BIN_SINGLE):
                return storage, [BIN_SINGLE]
            if storage.is_local and os.path.isdir(storage.root):
                raise CheckpointNotFoundError(
                    f"{storage.url} is a directory without {BIN_SINGLE} or {BIN_INDEX}; pass a torch.save file, "
                    "or use from_safetensors / from_dcp for safetensors / DCP directories"
                )
            parent, base = split_url(src)
            return Storage(parent, storage_options=storage_options), [base]
    where = storage.url_of(index)
    try:
        raw = storage.read_bytes(index, limit=MAX_INDEX_BYTES)
    except (FileNotFoundError, NotADirectoryError):
        raise CheckpointNotFoundError(f"no index at {where}") from None
    try:
        doc = json.loads(raw)
    except (ValueError, RecursionError) as e:
        raise CorruptCheckpointError(f"{where}: not JSON ({type(e).__name__}: {e})") from None
    wm = doc.get("weight_map") if isinstance(doc, dict) else None
    if not isinstance(wm, dict) or not wm or not all(isinstance(v, str) for v in wm.values()):
        raise CorruptCheckpointError(f"{where}: 'weight_map' must map tensor names to file names")
    bases = sorted(set(wm.values()))
    for b in bases:
        check_relpath(b, where=f"{where}: weight_map")
    return storage, bases


def _read_torch_file(storage: Storage, base: str):
    """``(object with meta tensors, chunk_for, size)`` of one torch.save file (weights_only)."""
    try:
        size = storage.size(base)
    except (FileNotFoundError, NotADirectoryError, IsADirectoryError):
        raise CheckpointNotFoundError(f"no file at {storage.url_of(base)}") from None
    where = storage.url_of(base)
    head = storage.read_range(base, 0, 4)
    if head[:4] == b"PK\x03\x04":
        obj, records = load_meta(storage, base, 0, size, where=where)

        def chunk_for(name, t):
            out = new_tensor(name, t)
            chunk_of(out, t, storage, base, 0, size, records, where=where)
            return out
    else:
        # Legacy format: no byte ranges to stream from. Still weights_only.
        obj = weights_only_load(io.BytesIO(storage.read_bytes(base)), where=where, map_location="cpu", corrupt="not a torch.save file")

        def chunk_for(name, t):
            return memory_chunk(name, t)

    return obj, chunk_for, size


def from_torch_save(
    src: str,
    dst: str,
    *,
    prefix: Optional[str] = None,
    **options: Unpack[SelectOptions],
) -> ConvertResult:
    """Import a ``torch.save`` file (``.pt``/``.pth``/``.bin``) or a legacy HF ``.bin`` directory as a native checkpoint, safely.

    The file is read with ``torch.load(weights_only=True)``: a pickle that
    names any other callable (``os.system``, ``__reduce__`` tricks...) is
    refused with :class:`~shardckpt.UnsafeMetadataError` and nothing from it
    runs. Tensors are streamed from their zip records by byte ranges and
    checked against the records' CRC-32; plain values (step, lr...) become
    the checkpoint's values.

    Args:
        src: the file (local path or fsspec URL); or a Hugging Face
            directory of ``pytorch_model.bin`` or sharded
            ``pytorch_model-0000K-of-0000N.bin`` files with
            ``pytorch_model.bin.index.json`` (or the index file itself).
        dst: native checkpoint directory to create.
        prefix: put the loaded dict under this dotted prefix. Default
            (``None``): ``"model."`` when the file is a flat dict of tensors
            (a bare state dict, so ``shardckpt.load({"model": model}, dst)``
            works), else nothing (a training checkpoint like
            ``{"model": ..., "optimizer": ..., "step": 3}`` keeps its keys);
            the rule shared by every importer (``arrange_imported``).
        **options: :class:`SelectOptions`: ``keys`` select tensors by their
            final names (plain values are kept as they are), ``key_map``
            renames them; ``storage_options`` for ``src``,
            ``dst_storage_options``, ``overwrite`` a committed checkpoint at
            ``dst``, ``progress``, ``io_threads``.

    Raises:
        UnsafeMetadataError: the pickle asks for anything beyond tensors and plain data.
        CorruptCheckpointError: not a torch.save file, or a record's CRC-32 mismatch.
        UnsupportedStateError: the top level is not a dict; sparse/quantized tensors.

    Limits: files in the legacy (pre-zip, torch < 1.6) format, and tensors
    that are non-contiguous views, are read whole (one tensor at a time for
    views; the whole file for legacy files).

    Example:
        >>> converters.from_torch_save("model.pt", "ckpt-native")     # doctest: +SKIP
    """
    opts = Options.of("from_torch_save", options, select=True)
    storage, bases = _torch_save_files(src, opts.storage_options)
    check_apart(src, dst)
    obj: Dict[str, Any] = {}
    located: Dict[int, Callable[[str, torch.Tensor], Any]] = {}
    files: Dict[str, int] = {}
    for base in bases:
        part, chunk_for_part, size = _read_torch_file(storage, base)
        files[base] = size
        if len(bases) == 1:
            obj = part
            break
        if not isinstance(part, dict) or not all(isinstance(v, torch.Tensor) for v in part.values()):
            raise UnsupportedStateError(f"{storage.url_of(base)}: a shard of a sharded .bin checkpoint must be a flat dict of tensors")
        dup = sorted(set(part) & set(obj))
        if dup:
            raise CorruptCheckpointError(f"{storage.url_of(base)}: tensors also found in another shard: {format_offenders(dup)}")
        for t in part.values():
            located[id(t)] = chunk_for_part
        obj.update(part)
    if len(bases) == 1:
        chunk_for = chunk_for_part
    else:

        def chunk_for(name, t):
            return located[id(t)](name, t)

    where = storage.url_of(bases[0]) if len(bases) == 1 else storage.url
    if isinstance(obj, torch.Tensor) or not isinstance(obj, dict):
        raise UnsupportedStateError(f"{where}: the top level is a {type(obj).__name__}; from_torch_save imports a dict (a state dict or a training checkpoint)")
    state = arrange_imported(obj, prefix)
    if not isinstance(state, dict) or not state:
        raise UnsupportedStateError(f"{where}: nothing to import")
    source = source_from_state(state, chunk_for, url=where, storage=storage, kind="torch_save", files=files)
    return write_imported(source, dst, opts, what="torch_save")


def write_imported(source: Source, dst: str, opts: Options, *, what: str) -> ConvertResult:
    """Write an imported Source as a native checkpoint (whole tensors, balanced files): ``opts.keys`` selected, ``opts.key_map`` renamed."""
    chosen = select_names(list(source.tensors), opts.keys)
    renamed = map_names(chosen, opts.key_map)
    if not renamed:
        raise UnsupportedStateError(f"{source.url}: no tensors to import")
    values = source.values
    if opts.keys is not None or opts.key_map is not None:
        values = rename_refs(values, renamed)
    return write_whole(source, dst, renamed, opts, values=values, extra={"converted_from": what}, desc=f"from_{what}")

