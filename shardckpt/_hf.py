"""Hugging Face safetensors as a checkpoint source, and key selection/renaming.

A directory of safetensors files (with ``model.safetensors.index.json`` or
without), or a single ``.safetensors`` file, is read as a checkpoint: a
:class:`~shardckpt._format.Manifest` is synthesized from the index and the
file headers, one whole-tensor chunk per entry. Such chunks carry no checksum
(``crc32c is None``): safetensors files have none, so reads from them are
checked for size and bounds only.

Headers are untrusted input and go through the same validation as native data
files (bounded header size, offsets inside the file, dtype x shape = bytes).
No torch import at module level.
"""

from __future__ import annotations

import fnmatch
import json
import math
import struct
from concurrent.futures import ThreadPoolExecutor
from typing import Any, Callable, Dict, Iterable, List, Mapping, Optional, Sequence, Union

from ._format import (
    HF_INDEX_NAME,
    MANIFEST_NAME,
    ChunkMeta,
    FileMeta,
    Manifest,
    TensorMeta,
    check_relpath,
    itemsize,
    parse_safetensors_header,
)
from ._storage import Storage
from .errors import CheckpointNotFoundError, CorruptCheckpointError, StateMismatchError, format_offenders

__all__ = [
    "SOURCE_SAFETENSORS",
    "hf_manifest",
    "read_safetensors_header",
    "select_names",
    "map_names",
    "select_for_load",
    "narrow_unchecked",
    "KeyMap",
]

#: ``Manifest.extra["source"]`` of a manifest synthesized from safetensors files.
SOURCE_SAFETENSORS = "safetensors"
#: The index of a sharded HF checkpoint is small; refuse absurd ones.
MAX_INDEX_BYTES = 64 << 20
#: Most headers fit in the first read; a bigger one costs a second read.
_HEAD_GUESS = 1 << 20

KeyMap = Union[Mapping[str, str], Callable[[str], Optional[str]]]


def read_safetensors_header(storage: Storage, rel: str, size: int):
    """Parse the header of ``rel`` (``size`` bytes): ``(entries, data_start)``."""
    where = storage.url_of(rel)
    head = storage.read_range(rel, 0, min(size, _HEAD_GUESS))
    if len(head) >= 8:
        (n,) = struct.unpack("<Q", head[:8])
        if len(head) < 8 + n <= size:
            head = storage.read_range(rel, 0, 8 + n)
    return parse_safetensors_header(head, file_size=size, where=where)


def _is_single_file(storage: Storage) -> bool:
    if not storage.url.endswith(".safetensors"):
        return False
    try:
        return storage.is_file()
    except OSError:
        return False


def hf_manifest(storage: Storage) -> Optional[Manifest]:
    """A manifest for safetensors files at ``storage``, or ``None`` if there are none.

    ``storage`` is a directory holding ``model.safetensors.index.json`` (its
    ``weight_map`` lists every tensor and its file) or, without an index, one
    or more top-level ``*.safetensors`` files; or it is a single
    ``.safetensors`` file (its chunks then name the file as ``""``, the
    storage root itself).

    Raises:
        CheckpointNotFoundError: the index belongs to a shardckpt save that
            never committed (its ``manifest.json`` is missing).
        CorruptCheckpointError / UnsafeMetadataError: bad index or header, a
            file listed by the index is missing, a key is in two files.
    """
    if _is_single_file(storage):
        files = {"": storage.size("")}
        wanted: Optional[Dict[str, str]] = None
    else:
        names = storage.listdir("")
        if HF_INDEX_NAME in names:
            wanted = _read_index(storage)
            files = {}
            for rel in sorted(set(wanted.values())):
                try:
                    files[rel] = storage.size(rel)
                except (FileNotFoundError, NotADirectoryError):
                    raise CorruptCheckpointError(
                        f"{storage.url_of(HF_INDEX_NAME)}: lists {rel!r}, which is missing"
                    ) from None
        else:
            rels = [n for n in names if n.endswith(".safetensors") and not n.startswith(".")]
            if not rels:
                return None
            files = {rel: storage.size(rel) for rel in rels}
            wanted = None

    def head(rel):
        return rel, read_safetensors_header(storage, rel, files[rel])

    if len(files) > 1 and storage.caps.high_latency:
        with ThreadPoolExecutor(max_workers=min(16, len(files)), thread_name_prefix="shardckpt-hf") as ex:
            headers = dict(ex.map(head, sorted(files)))
    else:
        headers = dict(map(head, sorted(files)))

    tensors: Dict[str, TensorMeta] = {}
    dup = []
    missing = []
    for rel in sorted(files):
        entries, start = headers[rel]
        for key, e in entries.items():
            if key == "__metadata__":
                continue
            if wanted is not None and wanted.get(key) != rel:
                continue  # not this file's per the index (extra entries are ignored)
            if key in tensors:
                dup.append(key)
                continue
            shape = list(e["shape"])
            tensors[key] = TensorMeta(
                dtype=e["dtype"],
                shape=shape,
                chunks=[
                    ChunkMeta(
                        file=rel,
                        key=key,
                        offsets=[0] * len(shape),
                        sizes=shape,
                        byte_offset=start + e["data_offsets"][0],
                        nbytes=e["data_offsets"][1] - e["data_offsets"][0],
                        crc32c=None,  # type: ignore[arg-type]  # safetensors has no checksums
                    )
                ],
            )
    if wanted is not None:
        missing = sorted(k for k in wanted if k not in tensors)
    if dup:
        raise CorruptCheckpointError(f"{storage.url}: tensors stored in more than one file: {format_offenders(dup)}")
    if missing:
        raise CorruptCheckpointError(
            f"{storage.url_of(HF_INDEX_NAME)}: weight_map names tensors its files do not hold: {format_offenders(missing)}"
        )
    return Manifest(
        world_size=1,
        tensors=tensors,
        files={rel: FileMeta(size) for rel, size in files.items()},
        values=None,
        extra={"source": SOURCE_SAFETENSORS},
    )


def _read_index(storage: Storage) -> Dict[str, str]:
    where = storage.url_of(HF_INDEX_NAME)
    data = storage.read_bytes(HF_INDEX_NAME, limit=MAX_INDEX_BYTES)
    try:
        raw = json.loads(data.decode("utf-8"))
    except (UnicodeDecodeError, ValueError) as e:
        raise CorruptCheckpointError(f"{where}: not valid JSON ({e})") from None
    if not isinstance(raw, dict) or not isinstance(raw.get("weight_map"), dict):
        raise CorruptCheckpointError(f"{where}: no 'weight_map' object")
    meta = raw.get("metadata")
    if isinstance(meta, dict) and "shardckpt_save_id" in meta and not storage.exists(MANIFEST_NAME):
        # Native saves write this index just before manifest.json: without
        # the manifest, the save never finished.
        raise CheckpointNotFoundError(
            f"no committed checkpoint at {storage.url}: manifest.json is missing (a shardckpt save that never finished)"
        )
    out: Dict[str, str] = {}
    for key, rel in raw["weight_map"].items():
        if not isinstance(rel, str):
            raise CorruptCheckpointError(f"{where}: weight_map[{key!r}] must be a file name, found {rel!r}")
        out[key] = check_relpath(rel, where=f"{where}: weight_map[{key!r}]")
    return out


# --------------------------------------------------------------------------
# key selection and renaming (shared by load and the converters)


def select_names(names: Iterable[str], patterns: Union[str, Sequence[str], None], *, what: str = "keys") -> List[str]:
    """Names matching any of ``patterns`` (exact names or ``fnmatch`` globs), in order.

    Raises ``StateMismatchError`` naming every pattern that matches nothing,
    so a typo does not silently drop tensors.
    """
    names = list(names)
    if patterns is None:
        return names
    if isinstance(patterns, str):
        patterns = [patterns]
    patterns = list(patterns)
    if any(not isinstance(p, str) for p in patterns):
        raise TypeError(f"{what} must be a list of strings (names or glob patterns), got {patterns!r}")
    exact = {p for p in patterns if not any(ch in p for ch in "*?[")}
    globs = [p for p in patterns if p not in exact]
    hit = set()
    out = []
    for n in names:
        ok = n in exact
        if ok:
            hit.add(n)
        for g in globs:
            if fnmatch.fnmatchcase(n, g):
                hit.add(g)
                ok = True
        if ok:
            out.append(n)
    unmatched = [p for p in patterns if p not in hit]
    if unmatched:
        raise StateMismatchError(f"{what} pattern(s) match no tensor: {format_offenders(unmatched)}")
    return out


def map_names(names: Iterable[str], key_map: Optional[KeyMap]) -> Dict[str, str]:
    """``{old: new}`` after renaming; a callable may return ``None`` to drop a name.

    A dict renames the names it lists and keeps the others. Two names mapped
    to one raise ``StateMismatchError``.
    """
    out: Dict[str, str] = {}
    for n in names:
        if key_map is None:
            new: Optional[str] = n
        elif callable(key_map) and not isinstance(key_map, Mapping):
            new = key_map(n)
        elif isinstance(key_map, Mapping):
            new = key_map.get(n, n)
        else:
            raise TypeError(f"key_map must be a dict or a callable, got {type(key_map).__name__}")
        if new is None:
            continue
        if not isinstance(new, str) or not new:
            raise TypeError(f"key_map gave {new!r} for {n!r}; expected a non-empty str (or None to drop it)")
        out[n] = new
    seen: Dict[str, List[str]] = {}
    for old, new in out.items():
        seen.setdefault(new, []).append(old)
    clash = [f"{new} <- {', '.join(sorted(olds))}" for new, olds in seen.items() if len(olds) > 1]
    if clash:
        raise StateMismatchError(f"key_map maps several tensors to one name: {format_offenders(clash)}")
    return out


def _rename_refs(node: Any, mapping: Dict[str, str]) -> Any:
    """Rewrite tensor references in a saved values tree; drop refs to unselected tensors."""
    from ._state import TAG

    if isinstance(node, dict):
        if node.get(TAG) == "tensor":
            name = node.get("name")
            return None if name not in mapping else {TAG: "tensor", "name": mapping[name]}
        return {k: _rename_refs(v, mapping) for k, v in node.items()}
    if isinstance(node, list):
        return [_rename_refs(v, mapping) for v in node]
    return node


def select_for_load(
    manifest: Manifest,
    state: Mapping[str, Any],
    *,
    keys: Union[str, Sequence[str], None] = None,
    key_map: Optional[KeyMap] = None,
) -> Manifest:
    """The manifest as ``load`` should see it: selected by ``keys``, renamed by ``key_map``.

    ``keys`` match checkpoint names; ``key_map`` maps checkpoint names to
    state names. A safetensors source holds a bare model state dict, so
    without a ``key_map`` its names are placed under the state's ``"model"``
    entry (or under its only entry when it has one).
    """
    names = select_names(sorted(manifest.tensors), keys)
    if key_map is None and manifest.extra.get("source") == SOURCE_SAFETENSORS:
        roots = list(state)
        root = roots[0] if len(roots) == 1 else ("model" if "model" in state else None)
        if root is None:
            raise StateMismatchError(
                "a safetensors checkpoint holds bare model keys; pass state={'model': model} "
                f"or a key_map (state has {format_offenders(roots)})"
            )
        key_map = lambda n, r=root: f"{r}.{n}"  # noqa: E731
    if keys is None and key_map is None:
        return manifest
    mapping = map_names(names, key_map)
    tensors = {mapping[n]: manifest.tensors[n] for n in names if n in mapping}
    values = manifest.values
    if values is not None:
        values = _rename_refs(values, mapping)
    return Manifest(
        world_size=manifest.world_size,
        tensors=tensors,
        files=manifest.files,
        values=values,
        save_id=manifest.save_id,
        library_version=manifest.library_version,
        extra=manifest.extra,
        version=manifest.version,
    )


def narrow_unchecked(meta: TensorMeta, boxes: Sequence[Any]) -> TensorMeta:
    """Cut checksum-less chunks at the dim-0 edges of ``boxes`` (objects with offsets/sizes).

    A checksummed chunk must be read whole to be verified; one without a
    checksum (safetensors sources) can be read in part. Rows of a chunk are
    contiguous bytes, so each piece is still one byte range — a rank then
    reads only the rows it holds.
    """
    if not meta.shape or all(c.crc32c is not None for c in meta.chunks):
        return meta
    cuts = set()
    for b in boxes:
        if b.sizes and b.sizes[0]:
            cuts.add(b.offsets[0])
            cuts.add(b.offsets[0] + b.sizes[0])
    out: List[ChunkMeta] = []
    isz = itemsize(meta.dtype)
    for c in meta.chunks:
        lo, n = c.offsets[0], c.sizes[0]
        if c.crc32c is not None or n == 0:
            out.append(c)
            continue
        row = math.prod(c.sizes[1:]) * isz
        edges = sorted({lo, lo + n} | {x for x in cuts if lo < x < lo + n})
        for a, b in zip(edges, edges[1:]):
            out.append(
                ChunkMeta(
                    file=c.file,
                    key=c.key,
                    offsets=[a] + list(c.offsets[1:]),
                    sizes=[b - a] + list(c.sizes[1:]),
                    byte_offset=c.byte_offset + (a - lo) * row,
                    nbytes=(b - a) * row,
                    crc32c=None,  # type: ignore[arg-type]
                )
            )
    return TensorMeta(dtype=meta.dtype, shape=meta.shape, chunks=out, layout=meta.layout)

