"""Incremental saves: find the chunks an earlier committed checkpoint already holds, byte for byte.

``save(..., incremental=BASE)`` (and ``CheckpointManager(incremental=True)``,
whose base is the newest committed step) asks, for each chunk this rank
writes, whether ``BASE`` holds a chunk of the same tensor with the same dtype,
global shape, box and **content hash** of the bytes being saved. Such a chunk
is not written: this save's index names it by a reference path
(``_format.refs``), with its byte range, CRC-32Cs and hash copied from
``BASE``'s index. Flags are never trusted: the bytes saved are hashed
(``requires_grad=False`` on a tensor that changed changes nothing).

Each rank decides for its own chunks and reads only the index files of the
ranks of ``BASE`` that wrote the boxes it saves; nothing is exchanged.

Hashing costs one pass over a chunk before its write. This process
remembers, per chunk, what its previous save into the root learnt, and
orders the work by it (``_MEMO``):

* ``lookup`` (nothing known, or unchanged last time): hash, compare with the
  base, reference on a match.
* ``changed`` (its CRC-32C differed from the save before): written straight
  away, not hashed at all: dense training pays no hash. Whether it changed
  this time is told by the CRC-32C the write pass computes anyway.
* ``hash-next`` (written without a hash, and its CRC-32C equalled the save
  before's): written once more, hashed in the write pass, so the save after
  can reference it.

A tensor that stops changing is thus written twice more, then referenced.
The memo only orders the work, never decides that bytes need not be saved:
a chunk is referenced only after its hash matched the base's, and a CRC
that matches by chance leads only to more hashing.

Not used, and why: skipping the hash of a tensor whose ``_version`` counter
and ``data_ptr`` did not move since the last save. ``p.data.add_(1)`` (and
``torch.from_numpy`` views, DLPack peers, ``untyped_storage()`` writes)
change the bytes without bumping ``p._version`` (tests/unit/
test_incremental.py::test_version_counter_misses_data_writes shows it), so
it is no proof.
"""

from __future__ import annotations

import posixpath
from dataclasses import replace
from typing import Any, Dict, List, Mapping, Optional, Tuple

from . import _knobs
from ._format import ChunkMeta, open_manifest
from ._format._v2 import tensor_chunks
from ._format.checksum import HASH_ALGOS, default_hash_algo, hash_available, new_hasher
from ._format.refs import follow, ref_path
from ._format.resolve import MetaCache
from ._format.versions import supports
from ._io import WriteItem, tensor_bytes
from .errors import UsageError

__all__ = ["base_name", "match_earlier", "note_written"]

LOOKUP, CHANGED, HASH_NEXT = "lookup", "changed", "hash-next"

#: This process's previous save into a root: root URL -> {(tensor name,
#: offsets): (CRC-32C, content hash or None, what to do next time: LOOKUP,
#: CHANGED or HASH_NEXT)}. Orders the work only (module docstring); never
#: decides whether bytes are saved.
_MEMO: Dict[str, Dict[Tuple[str, Tuple[int, ...]], Tuple[Optional[int], Optional[str], str]]] = {}


def base_name(url: str, base: str) -> str:
    """The directory name of ``base``, which must be a sibling of ``url`` (same parent), or a bare name.

    Raises:
        UsageError: ``base`` is ``url`` itself or lies elsewhere.

    Example:
        >>> base_name("run/step-00000020", "run/step-00000010")
        'step-00000010'
        >>> base_name("run/step-00000020", "step-00000010")
        'step-00000010'
    """
    b = str(base).rstrip("/")
    name = posixpath.basename(b)
    u = str(url).rstrip("/")
    parent_ok = "/" not in b or posixpath.dirname(b) == posixpath.dirname(u)
    if not parent_ok or not name or name == posixpath.basename(u):
        raise UsageError(
            f"incremental={base!r}: the earlier checkpoint must be another directory next to {url!r} "
            "(the same parent: references name a sibling directory)"
        )
    return name


def _hash(algo: str, it: WriteItem) -> str:
    assert it.tensor is not None  # match_earlier looks up only chunks with a tensor
    h = new_hasher(algo)
    mv = tensor_bytes(it.tensor)
    block = _knobs.WRITE_BLOCK_BYTES
    for off in range(0, len(mv), block):
        h.update(mv[off : off + block])
    return h.hexdigest()


def match_earlier(
    storage: Any, base: str, items: List[WriteItem], shapes: Mapping[str, Tuple[int, ...]]
) -> Tuple[List[WriteItem], List[Tuple[str, ChunkMeta]], Dict[str, int]]:
    """Split this rank's chunks into those to write and those ``base`` holds already.

    A chunk that changed at this process's previous save of the root is
    written without a lookup (hashed in the write pass); the base is opened
    only when some chunk needs a lookup.

    Args:
        storage: the checkpoint being written (its sibling ``base`` is read).
        base: directory name of the earlier committed checkpoint (:func:`base_name`).
        items: this rank's chunks.
        shapes: global shape of each tensor saved.

    Returns:
        ``(to write, [(tensor, referencing chunk)], {reference path: file size})``.

    Raises:
        CheckpointNotFoundError / CorruptCheckpointError: ``base`` is not a
            committed, readable checkpoint.
    """
    memo = _MEMO.get(root_key(storage), {})
    write: List[WriteItem] = []
    lookup: List[WriteItem] = []
    for it in items:
        seen = memo.get((it.name, tuple(it.offsets)))
        todo = LOOKUP if seen is None else seen[2]
        if it.tensor is None or it.nbytes == 0 or todo == HASH_NEXT:
            write.append(it)
        elif todo == CHANGED:
            write.append(replace(it, hash=""))  # "": not hashed in the write pass either
        else:
            lookup.append(it)
    refs: List[Tuple[str, ChunkMeta]] = []
    sizes: Dict[str, int] = {}
    if not lookup:
        return write, refs, sizes
    base_st = follow(storage.sibling(base))
    m = open_manifest(base_st, chunks=False)
    algo = m.content_hash if supports(m.version, "content_hash") else ""
    if algo not in HASH_ALGOS or not hash_available(algo):
        return write + lookup, refs, sizes  # nothing to compare with: these are written
    cache = MetaCache()
    for it in lookup:
        t = m.tensors.get(it.name)
        if t is None or t.dtype != it.dtype or tuple(t.shape) != tuple(shapes[it.name]):
            write.append(it)
            continue
        earlier = [c for c in tensor_chunks(m, base_st, it.name, [(it.offsets, it.sizes)], cache)
                   if tuple(c.offsets) == tuple(it.offsets) and tuple(c.sizes) == tuple(it.sizes) and c.hash is not None]
        if not earlier:
            write.append(it)
            continue
        c = earlier[0]
        h = _hash(algo, it)
        if h != c.hash:
            write.append(replace(it, hash=h) if algo == default_hash_algo() else it)
            continue
        rel = ref_path(base, c.file)
        refs.append((it.name, ChunkMeta(file=rel, key=it.key, offsets=list(it.offsets), sizes=list(it.sizes),
                                         byte_offset=c.byte_offset, nbytes=c.nbytes, crc32c=c.crc32c, blocks=c.blocks, hash=c.hash)))
        sizes[rel] = m.files[c.file].size
    return write, refs, sizes


def note_written(storage: Any, named: List[Tuple[str, ChunkMeta]], referenced: List[Tuple[str, ChunkMeta]]) -> None:
    """Remember, per chunk of this save into ``storage``'s root, what the next save does first (module docstring).

    Changed: written, and its CRC-32C (or hash) differs from what this
    process saved for it last time. Referenced chunks did not change.
    """
    key = root_key(storage)
    last = _MEMO.get(key, {})
    ref_keys = {(n, tuple(c.offsets)) for n, c in referenced}
    memo: Dict[Tuple[str, Tuple[int, ...]], Tuple[Optional[int], Optional[str], str]] = {}
    for n, c in named:
        k = (n, tuple(c.offsets))
        prev = last.get(k)
        if k in ref_keys or prev is None:
            todo = LOOKUP  # unchanged, or no history in this process: hash and compare next time
        elif prev[0] != c.crc32c or (c.hash and prev[1] and c.hash != prev[1]):
            todo = CHANGED
        else:
            todo = LOOKUP if c.hash else HASH_NEXT
        memo[k] = (c.crc32c, c.hash, todo)
    _MEMO.clear()  # one root remembered: a manager's run
    _MEMO[key] = memo


def root_key(storage: Any) -> str:
    """The memo's key for a checkpoint: its parent URL (the run root)."""
    url = str(storage.url).rstrip("/")
    return posixpath.dirname(url) or url
