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

Hashing costs one pass over a chunk before its write. A chunk that was
written (changed) at this process's previous save of the same root is
written straight away instead, hashed in the write pass (no second pass:
dense training pays no extra hashing); its hash is then compared with
``BASE``'s after the fact, and a chunk found unchanged that way is looked up
again at the next save. This memo only decides the order of work, never
whether bytes are saved: a chunk is referenced only after its hash matched.

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
from typing import Any, Dict, List, Mapping, Set, Tuple

from ._format import ChunkMeta
from ._format.checksum import HASH_ALGOS, default_hash_algo, hash_available, new_hasher
from ._format.refs import follow, ref_path
from ._io import WRITE_BLOCK_BYTES, WriteItem, tensor_bytes
from .errors import UsageError

__all__ = ["base_name", "match_earlier", "note_written"]

#: Chunks written (changed) at the previous save of a root in this process:
#: root URL -> {(tensor name, offsets)}. Decides only whether a chunk is
#: hashed before its write or in it (see the module docstring).
_CHANGED: Dict[str, Set[Tuple[str, Tuple[int, ...]]]] = {}


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
    h = new_hasher(algo)
    mv = tensor_bytes(it.tensor)
    for off in range(0, len(mv), WRITE_BLOCK_BYTES):
        h.update(mv[off : off + WRITE_BLOCK_BYTES])
    return h.hexdigest()


def match_earlier(
    storage: Any, base: str, items: List[WriteItem], shapes: Mapping[str, Tuple[int, ...]]
) -> Tuple[List[WriteItem], List[Tuple[str, ChunkMeta]], Dict[str, int], Dict[Tuple[str, Tuple[int, ...]], str]]:
    """Split this rank's chunks into those to write and those ``base`` holds already.

    Args:
        storage: the checkpoint being written (its sibling ``base`` is read).
        base: directory name of the earlier committed checkpoint (:func:`base_name`).
        items: this rank's chunks.
        shapes: global shape of each tensor saved.

    Returns:
        ``(to write, [(tensor, referencing chunk)], {reference path: file size},
        {(tensor, offsets): base hash}`` of the chunks written without a
        lookup, for :func:`note_written`).

    Raises:
        CheckpointNotFoundError / CorruptCheckpointError: ``base`` is not a
            committed, readable checkpoint.
    """
    from ._format import open_manifest
    from ._format._v2 import tensor_chunks
    from ._format.resolve import MetaCache

    base_st = follow(storage.sibling(base))
    m = open_manifest(base_st, chunks=False)
    algo = m.content_hash if m.version >= 4 else ""
    if algo not in HASH_ALGOS or not hash_available(algo):
        return list(items), [], {}, {}  # nothing to compare with: a full save
    changed = _CHANGED.get(root_key(storage), set())
    cache = MetaCache()
    write: List[WriteItem] = []
    refs: List[Tuple[str, ChunkMeta]] = []
    sizes: Dict[str, int] = {}
    later: Dict[Tuple[str, Tuple[int, ...]], str] = {}
    for it in items:
        t = m.tensors.get(it.name)
        if t is None or t.dtype != it.dtype or tuple(t.shape) != tuple(shapes[it.name]) or it.tensor is None or it.nbytes == 0:
            write.append(it)
            continue
        earlier = [c for c in tensor_chunks(m, base_st, it.name, [(it.offsets, it.sizes)], cache)
                   if tuple(c.offsets) == tuple(it.offsets) and tuple(c.sizes) == tuple(it.sizes) and c.hash is not None]
        if not earlier:
            write.append(it)
            continue
        c = earlier[0]
        if (it.name, tuple(it.offsets)) in changed and algo == default_hash_algo():
            later[(it.name, tuple(it.offsets))] = c.hash  # type: ignore[assignment]
            write.append(it)  # changed last time: hashed in the write pass, compared after
            continue
        h = _hash(algo, it)
        if h != c.hash:
            write.append(replace(it, hash=h) if algo == default_hash_algo() else it)
            continue
        rel = ref_path(base, c.file)
        refs.append((it.name, ChunkMeta(file=rel, key=it.key, offsets=list(it.offsets), sizes=list(it.sizes),
                                         byte_offset=c.byte_offset, nbytes=c.nbytes, crc32c=c.crc32c, blocks=c.blocks, hash=c.hash)))
        sizes[rel] = m.files[c.file].size
    return write, refs, sizes, later


def note_written(storage: Any, named: List[Tuple[str, ChunkMeta]], referenced: List[Tuple[str, ChunkMeta]],
                 later: Dict[Tuple[str, Tuple[int, ...]], str]) -> None:
    """Remember which chunks changed at this save into ``storage``'s root (see the module docstring)."""
    ref_keys = {(n, tuple(c.offsets)) for n, c in referenced}
    changed = set()
    for n, c in named:
        k = (n, tuple(c.offsets))
        if k in ref_keys:
            continue
        if k in later and later[k] == c.hash:
            continue  # written without a lookup, found unchanged: look it up next time
        changed.add(k)
    _CHANGED.clear()  # one root remembered: a manager's run
    _CHANGED[root_key(storage)] = changed


def root_key(storage: Any) -> str:
    """The memo's key for a checkpoint: its parent URL (the run root)."""
    url = str(storage.url).rstrip("/")
    return posixpath.dirname(url) or url
