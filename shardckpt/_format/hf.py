"""Hugging Face safetensors as a checkpoint source: a Manifest from a directory, an index or one file.

A directory of safetensors files (with ``model.safetensors.index.json`` or
without), or a single ``.safetensors`` file, reads as a checkpoint: a
:class:`Manifest` is synthesized from the index and the file headers, one
whole-tensor chunk per entry. Such chunks carry no checksum (``crc32c is
None``): safetensors files have none, so reads from them are checked for size
and bounds only.

Headers are untrusted input and go through the same validation as native data
files (bounded header size, offsets inside the file, dtype x shape = bytes).
"""

from __future__ import annotations

import json
from concurrent.futures import ThreadPoolExecutor
from typing import Any, Dict, Optional

from .._geometry import shared_byte_ranges
from ..errors import CheckpointNotFoundError, CorruptCheckpointError, UnsafeMetadataError, format_offenders
from .header import read_safetensors_header
from .manifest import ChunkMeta, FileMeta, Manifest, TensorMeta, check_relpath
from .naming import HF_INDEX_NAME, MANIFEST_NAME

__all__ = ["SOURCE_SAFETENSORS", "MAX_INDEX_BYTES", "hf_manifest"]

#: ``Manifest.extra["source"]`` of a manifest synthesized from safetensors files.
SOURCE_SAFETENSORS = "safetensors"
#: The index of a sharded HF checkpoint is small; refuse absurd ones.
MAX_INDEX_BYTES = 64 << 20
#: Parallel header reads on object stores.
HEADER_READ_THREADS = 16


def _is_single_file(storage: Any) -> bool:
    if not storage.url.endswith(".safetensors"):
        return False
    try:
        return storage.is_file()
    except OSError:
        return False


def hf_manifest(storage: Any) -> Optional[Manifest]:
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
        with ThreadPoolExecutor(max_workers=min(HEADER_READ_THREADS, len(files)), thread_name_prefix="shardckpt-hf") as ex:
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
                        crc32c=None,  # safetensors has no checksums
                    )
                ],
            )
    if wanted is not None:
        missing = sorted(k for k in wanted if k not in tensors)
    # Entries sharing bytes would import (and load) as copies of one range: a
    # small file allocating hundreds of times its size. The safetensors
    # library refuses them too.
    clashes = shared_byte_ranges(
        (c.file, c.byte_offset, c.nbytes, repr(name)) for name, t in tensors.items() for c in t.chunks
    )
    if clashes:
        listed = "; ".join(f"{k.file} bytes [{k.start}, {k.stop}) claimed by {k.first} and {k.second}" for k in clashes)
        raise UnsafeMetadataError(f"{storage.url}: safetensors entries share file bytes (a damaged or crafted file): {listed}")
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


def _read_index(storage: Any) -> Dict[str, str]:
    where = storage.url_of(HF_INDEX_NAME)
    data = storage.read_bytes(HF_INDEX_NAME, limit=MAX_INDEX_BYTES)
    try:
        raw = json.loads(data.decode("utf-8"))
    except (UnicodeDecodeError, ValueError, RecursionError) as e:  # RecursionError: absurdly deep nesting
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
