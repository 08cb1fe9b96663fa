"""Import ``torch.distributed.checkpoint`` (DCP) directories without trusting their pickles.

DCP's ``.metadata`` is a pickle. It is read with :class:`DCPUnpickler`,
whose ``find_class`` admits only DCP's metadata dataclasses and the few torch
and stdlib types they hold (``torch.Size``, dtypes, layouts, paths); any
other global — ``os.system``, ``builtins.eval``, a ``__reduce__`` gadget —
is refused before it is called. The unpickled objects are then checked field
by field (types, relative paths, byte ranges inside the files).

Data files (``__0_0.distcp``...) hold one item per chunk at the byte range
the metadata names. Tensor items are ``torch.save`` payloads: their
structure is read with ``torch.load(weights_only=True, map_location="meta")``
and their bytes streamed by range (CRC-32 of the zip record checked).
Checkpoints written with DCP's safetensors serialization are read through
the safetensors headers. Non-tensor items (step counters, lists...) are
``torch.save`` payloads too, read with ``weights_only=True``.
"""

from __future__ import annotations

import contextlib
import io
import math
import pickle
from typing import TYPE_CHECKING, Any, Dict, Iterator, List, Optional, Tuple

import torch

from shardckpt._format import MAX_MANIFEST_BYTES, check_relpath, checked_shape, dtype_name, itemsize
from shardckpt._format.chunk import Chunk
from shardckpt._format.header import read_safetensors_header
from shardckpt._geometry import Box, check_cover
from shardckpt._storage import Storage
from shardckpt.errors import (
    CheckpointError,
    CheckpointNotFoundError,
    CorruptCheckpointError,
    UnsafeMetadataError,
    UnsupportedStateError,
    format_offenders,
)

from ._options import ConvertResult, Options, SelectOptions, check_apart
from ._safetensors import arrange_imported
from ._source import SrcTensor
from ._torch_save import chunk_of, load_meta, memory_chunk, source_from_state, weights_only_load, write_imported

if TYPE_CHECKING:
    from typing_extensions import Unpack

__all__ = ["from_dcp", "DCPUnpickler", "read_dcp_metadata", "check_pickle_bounds"]

METADATA_NAME = ".metadata"
#: A non-tensor item (a step count, a scheduler dict) is small; refuse huge ones.
MAX_BYTES_ITEM = 64 << 20

_DCP_MD = "torch.distributed.checkpoint.metadata"
_ALLOWED: Dict[str, set] = {
    _DCP_MD: {
        "Metadata",
        "TensorStorageMetadata",
        "BytesStorageMetadata",
        "ChunkStorageMetadata",
        "TensorProperties",
        "MetadataIndex",
        "StorageMeta",
        "_MEM_FORMAT_ENCODING",
    },
    "torch.distributed.checkpoint.filesystem": {"_StorageInfo", "_StoragePrefix"},
    "torch.serialization": {"_get_layout"},
    "torch": {"Size"},
    "pathlib": {"Path", "PosixPath", "PurePosixPath", "WindowsPath", "PureWindowsPath", "PurePath"},
    "pathlib._local": {"Path", "PosixPath", "PurePosixPath", "WindowsPath", "PureWindowsPath", "PurePath"},
    "collections": {"OrderedDict"},
    "builtins": {"set", "frozenset"},
}


#: Deepest nesting of objects a ``.metadata`` pickle may build (real ones: about 10).
MAX_PICKLE_DEPTH = 100
#: Objects a ``.metadata`` pickle may describe once shared references are
#: counted as copies (what a repr or a hash visits): this many per byte of
#: the pickle, plus a floor. Real metadata describes about 0.3 per byte; a
#: 1 KB "bomb" of tuples nested through memo references describes 2**150.
MAX_PICKLE_EXPANSION = 8
MIN_PICKLE_NODES = 1 << 20
_INPLACE_OPS = {"APPEND", "APPENDS", "SETITEM", "SETITEMS", "ADDITEMS", "BUILD"}


#: Memo indices may run this far past the entries stored so far (picklers
#: number them in order; a little slack for hand-made pickles).
MEMO_INDEX_SLACK = 1024


def check_pickle_bounds(data: bytes, *, where: str, max_depth: int = MAX_PICKLE_DEPTH) -> None:
    """Refuse a pickle whose objects nest too deep or expand too far, before anything is built.

    A dry run over the opcodes (``pickletools.genops``, linear in the
    bytes) tracks, for every object on the stack, its nesting depth and its
    size with shared (memo) references counted as copies. Unpickling,
    hashing or printing such an object costs that size, so a few hundred
    bytes of nested tuples would otherwise take minutes (or the stack).

    Raises:
        UnsafeMetadataError: too deep or too large (numbers in the message).
        CorruptCheckpointError: not a well-formed pickle.
    """
    import pickletools

    mark = object()
    stack: List[Any] = []
    memo: Dict[Any, List[int]] = {}
    limit = MIN_PICKLE_NODES + MAX_PICKLE_EXPANSION * len(data)
    try:
        for op, arg, _pos in pickletools.genops(data):
            name = op.name
            if name in ("PROTO", "FRAME"):
                continue
            if name == "STOP":
                break
            if name == "MARK":
                stack.append(mark)
            elif name in ("PUT", "BINPUT", "LONG_BINPUT"):
                # The C unpickler sizes its memo array by the index it is given, so
                # one LONG_BINPUT of 2**31 costs 16+ GiB; a pickler numbers its memo
                # entries 0, 1, 2, ... so an index past the entries so far is forged.
                if not isinstance(arg, int) or arg > len(memo) + MEMO_INDEX_SLACK:
                    raise UnsafeMetadataError(
                        f"{where}: refused: memo index {arg} with {len(memo)} entries stored so far "
                        "(a pickler numbers them in order; a larger index only allocates memory)"
                    )
                memo[arg] = stack[-1]
            elif name == "MEMOIZE":
                memo[len(memo)] = stack[-1]
            elif name in ("GET", "BINGET", "LONG_BINGET"):
                stack.append(memo[arg])
            elif name == "POP":
                stack.pop()
            elif name == "DUP":
                stack.append(stack[-1])
            elif name == "POP_MARK":
                while stack.pop() is not mark:
                    pass
            else:
                before = op.stack_before
                popped: List[List[int]] = []
                if pickletools.markobject in before:
                    while stack[-1] is not mark:
                        popped.append(stack.pop())
                    stack.pop()
                    extra = before.index(pickletools.markobject)
                else:
                    extra = len(before)
                for _ in range(extra):
                    popped.append(stack.pop())
                if any(p is mark for p in popped):
                    raise ValueError(f"{name} takes a mark as an argument")
                if name in _INPLACE_OPS:
                    target, args = popped[-1], popped[:-1]
                    target[0] += sum(a[0] for a in args)
                    target[1] = max([target[1]] + [a[1] + 1 for a in args])
                    rec = target
                elif op.stack_after:
                    rec = [1 + sum(a[0] for a in popped), 1 + max([a[1] for a in popped], default=0)]
                else:
                    continue
                stack.append(rec)
                if rec[1] > max_depth:
                    raise UnsafeMetadataError(
                        f"{where}: objects nested deeper than {max_depth} levels; refused before unpickling"
                        " (DCP metadata nests about 10 deep)"
                    )
                if rec[0] > limit:
                    raise UnsafeMetadataError(
                        f"{where}: {len(data)} bytes describe more than {limit} objects once shared references "
                        "are expanded (a pickle bomb); refused before unpickling"
                    )
    except UnsafeMetadataError:
        raise
    except (ValueError, IndexError, KeyError, TypeError) as e:
        raise CorruptCheckpointError(f"{where}: not a well-formed pickle ({type(e).__name__}: {e})") from None


#: What ``torch.<name>`` may resolve to, read from torch's module dict so that
#: no lazy submodule import (``torch._dynamo``, ``torch._inductor``,
#: ``torch.onnx``) runs on a pickle's request.
_TORCH_VALUES = (torch.dtype, torch.layout, torch.memory_format)


class DCPUnpickler(pickle.Unpickler):
    """An unpickler that builds only DCP metadata objects; every other global is refused.

    ``torch.<name>`` is admitted only when it is a dtype, layout or memory
    format object (plain values, not callables), looked up without
    importing anything. Other globals come from :data:`_ALLOWED` modules
    only. Persistent ids are refused. Run :func:`check_pickle_bounds` first:
    this class bounds what is built, not how much.
    """

    def find_class(self, module: str, name: str):
        if module == "torch" and name != "Size":
            val = vars(torch).get(name)
            if isinstance(val, _TORCH_VALUES):
                return val
        elif isinstance(name, str) and name in _ALLOWED.get(module, ()):
            import importlib

            return getattr(importlib.import_module(module), name)
        raise pickle.UnpicklingError(f"global {str(module)[:100]}.{str(name)[:100]} is not allowed in DCP metadata")

    def persistent_load(self, pid):
        raise pickle.UnpicklingError("persistent ids are not allowed in DCP metadata")


@contextlib.contextmanager
def _malformed(where: str) -> Iterator[None]:
    """Our error for DCP metadata whose objects are not what DCP writes (an int where an index goes, a path nested 100k deep).

    The restricted unpickler admits DCP's classes, but not the types of their
    fields: walking them may raise anything a wrong type raises.
    """
    try:
        yield
    except CheckpointError:
        raise
    except (TypeError, AttributeError, ValueError, KeyError, IndexError, RecursionError, OverflowError) as e:
        raise CorruptCheckpointError(f"{where}: malformed DCP metadata ({type(e).__name__}: {str(e)[:200]})") from None


def read_dcp_metadata(storage: Storage) -> Any:
    """Read and validate ``.metadata``; returns DCP's ``Metadata`` object.

    Raises:
        CorruptCheckpointError / UnsafeMetadataError: damaged, malformed or unsafe.
    """
    try:
        return _read_dcp_metadata(storage)
    except (AttributeError, TypeError, KeyError, IndexError, RecursionError, OverflowError) as e:
        # Objects the unpickler built without the attributes DCP's classes have.
        raise CorruptCheckpointError(
            f"{storage.url_of(METADATA_NAME)}: malformed DCP Metadata ({type(e).__name__}: {str(e)[:200]})"
        ) from None


def _read_dcp_metadata(storage: Storage) -> Any:
    from torch.distributed.checkpoint.metadata import BytesStorageMetadata, Metadata, MetadataIndex, TensorStorageMetadata

    where = storage.url_of(METADATA_NAME)
    try:
        data = storage.read_bytes(METADATA_NAME, limit=MAX_MANIFEST_BYTES)
    except (FileNotFoundError, NotADirectoryError):
        raise CheckpointNotFoundError(f"no DCP checkpoint at {storage.url}: {METADATA_NAME} is missing") from None
    check_pickle_bounds(data, where=where)
    try:
        md = DCPUnpickler(io.BytesIO(data)).load()
    except pickle.UnpicklingError as e:
        raise UnsafeMetadataError(f"{where}: refused: {e}; nothing from the file was run") from None
    except Exception as e:  # truncated or garbage pickles raise all sorts
        raise CorruptCheckpointError(f"{where}: not a DCP metadata pickle ({type(e).__name__}: {str(e)[:200]})") from None
    if not isinstance(md, Metadata):
        raise CorruptCheckpointError(f"{where}: the pickle holds a {type(md).__name__}, not DCP's Metadata")
    for fld in ("state_dict_metadata", "storage_data"):
        if not isinstance(getattr(md, fld, None), dict):
            raise CorruptCheckpointError(
                f"{where}: Metadata.{fld} is a {type(getattr(md, fld, None)).__name__}, expected a dict"
                + (" (not written by FileSystemWriter?)" if fld == "storage_data" else "")
            )
    for fqn, smd in md.state_dict_metadata.items():
        w = f"{where}: entry {fqn!r}"
        if not isinstance(fqn, str):
            raise CorruptCheckpointError(f"{where}: key {fqn!r} is not a string")
        if isinstance(smd, TensorStorageMetadata):
            if not isinstance(smd.properties.dtype, torch.dtype):
                raise CorruptCheckpointError(f"{w}: dtype {smd.properties.dtype!r}")
            item_size = smd.properties.dtype.itemsize
            shape = checked_shape(_ints(smd.size, w + " size"), item_size, where=w)
            if not isinstance(smd.chunks, list):
                raise CorruptCheckpointError(f"{w}: chunks must be a list")
            for c in smd.chunks:
                if len(_ints(c.offsets, w + " chunk offsets")) != len(shape) or len(_ints(c.sizes, w + " chunk sizes")) != len(shape):
                    raise CorruptCheckpointError(f"{w}: chunk {c} does not match shape {shape}")
                checked_shape(list(c.sizes), item_size, where=f"{w} chunk at {list(c.offsets)}")
        elif not isinstance(smd, BytesStorageMetadata):
            raise CorruptCheckpointError(f"{w}: unknown storage metadata {type(smd).__name__}")
    for k, info in md.storage_data.items():
        if not isinstance(k, MetadataIndex) or not isinstance(getattr(k, "fqn", None), str):
            raise CorruptCheckpointError(f"{where}: storage_data key {k!r} is not a MetadataIndex")
        w = f"{where}: storage_data[{k.fqn!r}]"
        check_relpath(getattr(info, "relative_path", None), where=w)
        for fld in ("offset", "length"):
            v = getattr(info, fld, None)
            if not isinstance(v, int) or isinstance(v, bool) or v < 0:
                raise CorruptCheckpointError(f"{w}: {fld} must be a non-negative int, found {v!r}")
        if getattr(info, "transform_descriptors", None):
            raise UnsupportedStateError(
                f"{w}: item stored with transforms {list(info.transform_descriptors)!r} (e.g. compression); not supported"
            )
    return md


def _ints(v: Any, where: str) -> List[int]:
    if not isinstance(v, (tuple, list)) or any(not isinstance(x, int) or isinstance(x, bool) or x < 0 for x in v):
        raise CorruptCheckpointError(f"{where}: expected non-negative ints, found {v!r}")
    return list(v)


def _path_tree(md, leaves: Dict[str, Any]) -> Dict[str, Any]:
    """Rebuild the saved nesting from ``planner_data`` (fqn -> path) where DCP recorded it."""
    paths = md.planner_data if isinstance(md.planner_data, dict) else {}
    root: Dict[Any, Any] = {}
    for fqn, val in leaves.items():
        path = paths.get(fqn)
        if not (isinstance(path, (tuple, list)) and path and all(isinstance(p, (str, int)) and not isinstance(p, bool) for p in path)):
            path = (fqn,)
        node = root
        for p in path[:-1]:
            nxt = node.get(p)
            if not isinstance(nxt, dict):
                nxt = node[p] = {}
            node = nxt
        node[path[-1]] = val
    return _lists(root)


def _lists(node: Any) -> Any:
    # DCP flattens lists into int path parts; give them back their list shape.
    if isinstance(node, dict):
        node = {k: _lists(v) for k, v in node.items()}
        if node and all(isinstance(k, int) for k in node) and sorted(node) == list(range(len(node))):
            return [node[i] for i in range(len(node))]
    return node


def from_dcp(
    src: str,
    dst: str,
    *,
    prefix: Optional[str] = None,
    **options: Unpack[SelectOptions],
) -> ConvertResult:
    """Import a DCP checkpoint directory (``dcp.save`` output) as a native checkpoint.

    Names follow DCP's: ``dcp.save({"model": model.state_dict()})`` gives
    ``model.emb.weight``..., so ``shardckpt.load({"model": model}, dst)``
    loads it at any world size; a bare ``dcp.save(model.state_dict())``
    goes under ``model.`` the same way (the bare-dict rule shared with
    ``from_torch_save`` / ``from_safetensors``). torchtitan checkpoints
    (model keys at the top level, ``optimizer`` saved with
    ``flatten_optimizer_state_dict=True``, ``lr_scheduler``, ``train_state``)
    become ``{"model", "optim", "lr_scheduler", "train_state"}``, so
    ``shardckpt.load({"model": m, "optim": o}, dst)`` resumes model and
    optimizer. Non-tensor entries (steps, scheduler values) become the
    checkpoint's values. Streams; no pickle from the checkpoint can run code
    (see the module notes).

    Args:
        src: DCP directory (local path or fsspec URL) with ``.metadata``.
        dst: native checkpoint directory to create.
        prefix: dotted prefix to put everything under. Default (``None``):
            ``"model."`` for a bare model state dict, torchtitan's layout
            rearranged as above, anything else as saved (see
            ``arrange_imported`` in ``converters/_safetensors.py``).
        **options: :class:`SelectOptions`: ``keys`` select tensors by their
            final names, ``key_map`` renames them; ``storage_options`` for
            ``src``, ``dst_storage_options``, ``overwrite`` a committed
            checkpoint at ``dst``, ``progress``, ``io_threads``.

    Raises:
        CheckpointNotFoundError: no ``.metadata`` at ``src``.
        UnsafeMetadataError: a pickle names anything outside the allowlist.
        CorruptCheckpointError: inconsistent metadata, bad items, CRC mismatch.
        UnsupportedStateError: transformed (compressed) items; non-JSON-able
            values that cannot be represented.

    Limits: DCP stores no checksums of its own; tensor items are checked
    against the CRC-32 of their ``torch.save`` zip record, safetensors-format
    items are not checked. Non-contiguous items are read one at a time whole.

    Example:
        >>> converters.from_dcp("dcp_ckpt/", "native_ckpt/")     # doctest: +SKIP
    """
    opts = Options.of("from_dcp", options, select=True)
    check_apart(src, dst)
    from torch.distributed.checkpoint.metadata import TensorStorageMetadata

    storage = Storage(src, storage_options=opts.storage_options)
    md = read_dcp_metadata(storage)
    where = storage.url
    with _malformed(where):
        index: Dict[Tuple[str, Optional[Tuple[int, ...]]], Any] = {}
        for k, info in md.storage_data.items():
            off = tuple(k.offset) if k.offset is not None else None
            index[(k.fqn, off)] = info
        sizes: Dict[str, int] = {}
        formats: Dict[str, Any] = {}

        def file_info(rel: str, offset: Optional[int] = None):
            """Size of ``rel``, and how the item at ``offset`` is stored: "zip" or the file's safetensors header."""
            if rel not in sizes:
                try:
                    sizes[rel] = storage.size(rel)
                except (FileNotFoundError, NotADirectoryError):
                    raise CorruptCheckpointError(f"{storage.url_of(rel)}: data file is missing") from None
            if offset is None:
                return sizes[rel], None
            head = storage.read_range(rel, offset, min(4, max(0, sizes[rel] - offset)))
            if head == b"PK\x03\x04":
                return sizes[rel], "zip"
            # DCP's safetensors serialization: one safetensors file per rank,
            # items found by name in its header (the recorded offsets are not used).
            if rel not in formats:
                try:
                    formats[rel] = read_safetensors_header(storage, rel, sizes[rel])
                except CorruptCheckpointError as e:
                    raise UnsupportedStateError(
                        f"{storage.url_of(rel)}: neither torch.save items nor a safetensors file ({e}); "
                        "DCP's safetensors serialization with non-tensor items in the same file is not supported"
                    ) from None
            return sizes[rel], formats[rel]

        leaves: Dict[str, Any] = {}
        placeholders: Dict[int, SrcTensor] = {}
        missing = []
        for fqn, smd in md.state_dict_metadata.items():
            if isinstance(smd, TensorStorageMetadata):
                shape = tuple(smd.size)
                dtype = smd.properties.dtype
                tensor = SrcTensor(name=fqn, dtype=dtype_name(dtype, key=fqn), shape=shape, chunks=[])
                for c in smd.chunks:
                    info = index.get((fqn, tuple(c.offsets)))
                    if info is None:
                        missing.append(f"{fqn}@{list(c.offsets)}")
                        continue
                    _add_item(tensor, storage, tuple(c.offsets), tuple(c.sizes), dtype, info, file_info)
                why = check_cover(shape, [Box(c.offsets, c.sizes) for c in tensor.chunks])
                if why and not missing:
                    raise CorruptCheckpointError(f"{where}: {fqn}: chunks do not tile the tensor: {why}")
                ph = torch.empty(shape, dtype=dtype, device="meta")
                placeholders[id(ph)] = tensor
                leaves[fqn] = ph
            else:
                info = index.get((fqn, None))
                if info is None:
                    missing.append(fqn)
                    continue
                leaves[fqn] = _bytes_item(storage, fqn, info, file_info)
        if missing:
            raise CorruptCheckpointError(f"{where}: storage_data has no item for: {format_offenders(missing)}")
        state = arrange_imported(_path_tree(md, leaves), prefix)

    def chunk_for(name, t):
        got = placeholders.get(id(t))
        if got is not None:
            return got
        return memory_chunk(name, t)  # a tensor inside a non-tensor item

    source = source_from_state(state, chunk_for, url=where, storage=storage, kind="dcp", files=None)
    return write_imported(source, dst, opts, what="dcp")


def _add_item(into: SrcTensor, storage, offsets, sizes, dtype, info, file_info) -> None:
    """Add the chunk of ``into`` at ``offsets`` that the DCP item ``info`` holds (a torch.save payload or a safetensors entry)."""
    fqn, st_dtype = into.name, into.dtype
    key = f"{fqn}@{list(offsets)}"
    rel = info.relative_path
    size, fmt = file_info(rel, info.offset)
    w = f"{storage.url_of(rel)}: item {fqn}@{list(offsets)}"
    nbytes = math.prod(sizes) * itemsize(st_dtype)
    if fmt == "zip":
        if info.offset + info.length > size:
            raise CorruptCheckpointError(f"{w}: bytes [{info.offset}, {info.offset + info.length}) lie outside the {size}-byte file")
        obj, records = load_meta(storage, rel, info.offset, info.length, where=w)
        if not isinstance(obj, torch.Tensor):
            raise CorruptCheckpointError(f"{w}: item is a {type(obj).__name__}, expected a tensor")
        if tuple(obj.shape) != tuple(sizes) or obj.dtype != dtype:
            raise CorruptCheckpointError(f"{w}: item is {obj.dtype} {list(obj.shape)}, metadata says {dtype} {list(sizes)}")
        chunk_of(into, obj, storage, rel, info.offset, info.length, records, where=w, offsets=offsets, key=key)
        return
    entries, start = fmt
    e = entries.get(fqn)
    if not isinstance(e, dict) or e.get("dtype") != st_dtype or list(e.get("shape", [])) != list(sizes):
        raise CorruptCheckpointError(f"{w}: safetensors entry {fqn!r} missing or not {st_dtype} {list(sizes)}")
    into.add(Chunk(file=rel, byte_offset=start + e["data_offsets"][0], nbytes=nbytes, offsets=offsets, sizes=sizes,
                   tensor=fqn, key=key))


def _bytes_item(storage, fqn, info, file_info) -> Any:
    rel = info.relative_path
    size, _ = file_info(rel)
    w = f"{storage.url_of(rel)}: item {fqn!r}"
    if info.length > MAX_BYTES_ITEM:
        raise UnsafeMetadataError(f"{w}: {info.length} bytes exceeds the {MAX_BYTES_ITEM}-byte limit for a non-tensor item")
    if info.offset + info.length > size:
        raise CorruptCheckpointError(f"{w}: bytes [{info.offset}, {info.offset + info.length}) lie outside the {size}-byte file")
    data = storage.read_range(rel, info.offset, info.length)
    return weights_only_load(io.BytesIO(data), where=w, map_location="cpu", corrupt="not a torch.save payload")
