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

import dataclasses
import json
from concurrent.futures import ThreadPoolExecutor
from typing import Any, Dict, List, Optional, Tuple

from .._geometry import shared_byte_ranges
from ..errors import (
    CheckpointNotFoundError,
    CorruptCheckpointError,
    UnsafeMetadataError,
    UnsupportedStateError,
    format_offenders,
)
from .header import read_safetensors_header
from .manifest import BlockScale, ChunkMeta, FileMeta, Manifest, TensorMeta, check_relpath
from .naming import HF_INDEX_NAME, MANIFEST_NAME

__all__ = [
    "SOURCE_SAFETENSORS", "MAX_INDEX_BYTES", "hf_manifest",
    "HF_CONFIG_NAME", "SCALE_SUFFIX", "DEFAULT_FP8_BLOCK", "FP8_QUANT_METHOD", "fp8_block_size", "scale_shape",
    "with_block_scales",
]

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


# --------------------------------------------------------------------------
# block-quantized FP8 weights (DeepSeek-V3 and the models that copied its layout)

#: The model's configuration beside its weights: ``quantization_config`` says how FP8 weights are scaled.
HF_CONFIG_NAME = "config.json"
#: A config.json is small; refuse absurd ones.
MAX_CONFIG_BYTES = 16 << 20
#: ``<weight>_scale_inv``: the per-block scales of an FP8 weight (DeepSeek's naming, kept by transformers).
SCALE_SUFFIX = "_scale_inv"
#: The block of DeepSeek-V3's checkpoints: what a directory with ``_scale_inv`` tensors and no config uses.
DEFAULT_FP8_BLOCK = (128, 128)
#: ``quantization_config.quant_method`` of block FP8 (transformers' ``FineGrainedFP8Config``).
FP8_QUANT_METHOD = "fp8"
_FP8_WEIGHT_DTYPE = "F8_E4M3"
_FP8_DTYPES = ("F8_E4M3", "F8_E5M2", "F8_E4M3FNUZ", "F8_E5M2FNUZ")
_SCALE_DTYPES = ("F32", "BF16", "F16")


def _config(storage: Any) -> Optional[Dict[str, Any]]:
    """``config.json`` beside the weights as a dict; None where there is none (or the source is one file)."""
    if _is_single_file(storage) or not storage.exists(HF_CONFIG_NAME):
        return None
    where = storage.url_of(HF_CONFIG_NAME)
    try:
        raw = json.loads(storage.read_bytes(HF_CONFIG_NAME, limit=MAX_CONFIG_BYTES).decode("utf-8"))
    except (UnicodeDecodeError, ValueError, RecursionError) as e:
        raise CorruptCheckpointError(f"{where}: not valid JSON ({e})") from None
    return raw if isinstance(raw, dict) else None


def fp8_block_size(quantization_config: Any, *, where: str) -> Optional[Tuple[int, int]]:
    """The ``(rows, cols)`` block of a ``quantization_config``; None when it is not a quantization at all.

    Raises:
        UnsupportedStateError: another quantization method, another FP8
            format than e4m3, or FP8 without ``weight_block_size`` (per-tensor
            or per-channel scales): shardckpt dequantizes block FP8 only.

    Example:
        >>> fp8_block_size({"quant_method": "fp8", "fmt": "e4m3", "weight_block_size": [128, 128]}, where="c")
        (128, 128)
    """
    if quantization_config is None:
        return None
    qc = quantization_config
    if not isinstance(qc, dict):
        raise CorruptCheckpointError(f"{where}: quantization_config must be an object, found {type(qc).__name__}")
    method = qc.get("quant_method")
    if method != FP8_QUANT_METHOD:
        raise UnsupportedStateError(
            f"{where}: quantization_config.quant_method is {method!r}; shardckpt dequantizes block FP8 weights only "
            f"(quant_method {FP8_QUANT_METHOD!r}, fmt 'e4m3', weight_block_size [128, 128]). Dequantize with the tool "
            "that made this checkpoint, or load with key_map= what is not quantized"
        )
    fmt = qc.get("fmt", "e4m3")
    block = qc.get("weight_block_size")
    if fmt != "e4m3":
        raise UnsupportedStateError(f"{where}: quantization_config.fmt is {fmt!r}; block FP8 loads support 'e4m3' only")
    if (not isinstance(block, (list, tuple)) or len(block) != 2
            or not all(isinstance(b, int) and not isinstance(b, bool) and 0 < b <= 1 << 20 for b in block)):
        raise UnsupportedStateError(
            f"{where}: quantization_config.weight_block_size is {block!r}; shardckpt dequantizes block FP8 "
            "(two positive ints, e.g. [128, 128]), not per-tensor or per-channel scales"
        )
    return int(block[0]), int(block[1])


def scale_shape(shape: Any, block: Tuple[int, int]) -> List[int]:
    """The scale grid of a 2-D weight: one scale per block, edge blocks smaller (ceil division).

        >>> scale_shape([300, 128], (128, 128))
        [3, 1]
    """
    return [-(-int(shape[0]) // block[0]), -(-int(shape[1]) // block[1])]


def with_block_scales(manifest: Manifest, storage: Any) -> Manifest:
    """A Hugging Face source's manifest with each block-FP8 weight paired with its ``_scale_inv`` tensor.

    The pairs come from the ``<weight>_scale_inv`` naming; the block from
    ``config.json``'s ``quantization_config.weight_block_size`` (128 x 128
    when the source has no config). Each paired weight's ``TensorMeta``
    gets its :class:`BlockScale` (a load dequantizes it while streaming) and
    the scale tensors leave ``tensors`` (consumed: never "unexpected").
    Other manifests come back as they are.

    Raises:
        UnsupportedStateError: config.json names another quantization (and
            the files hold ``_scale_inv`` tensors), another FP8 format, or no
            block size; a scaled weight that is not a 2-D e4m3 tensor.
        CorruptCheckpointError: a scale whose shape is not the weight's block
            grid or whose dtype is not a float; config.json says block FP8 and
            a 2-D FP8 weight has no scale (all offenders in one error).

    Example:
        >>> m = with_block_scales(open_manifest("DeepSeek-V3/"), Storage("DeepSeek-V3/"))   # doctest: +SKIP
        >>> m.tensors["model.layers.0.mlp.down_proj.weight"].scale.block                     # doctest: +SKIP
        (128, 128)
    """
    if manifest.extra.get("source") != SOURCE_SAFETENSORS:
        return manifest
    tensors = manifest.tensors
    pairs = {n[: -len(SCALE_SUFFIX)]: n for n in tensors if n.endswith(SCALE_SUFFIX) and n[: -len(SCALE_SUFFIX)] in tensors}
    pairs = {w: s for w, s in pairs.items() if tensors[w].dtype in _FP8_DTYPES}
    config = _config(storage)
    qc = config.get("quantization_config") if config is not None else None
    where = storage.url_of(HF_CONFIG_NAME)
    if qc is None and not pairs:
        return manifest
    if qc is not None and not pairs and isinstance(qc, dict) and qc.get("quant_method") != FP8_QUANT_METHOD:
        return manifest  # another quantization whose tensors load as stored (or are refused by dtype)
    block = fp8_block_size(qc, where=where) or DEFAULT_FP8_BLOCK
    unsupported, corrupt = [], []
    for w, s in sorted(pairs.items()):
        wm, sm = tensors[w], tensors[s]
        if wm.dtype != _FP8_WEIGHT_DTYPE or len(wm.shape) != 2:
            unsupported.append(f"{w} ({wm.dtype} {list(wm.shape)}; block FP8 weights are 2-D F8_E4M3)")
        elif sm.dtype not in _SCALE_DTYPES:
            corrupt.append(f"{s}: dtype {sm.dtype}, expected one of {', '.join(_SCALE_DTYPES)}")
        elif list(sm.shape) != scale_shape(wm.shape, block):
            corrupt.append(
                f"{s}: shape {list(sm.shape)}, but {w} {list(wm.shape)} in {block[0]}x{block[1]} blocks needs "
                f"{scale_shape(wm.shape, block)}"
            )
    if qc is not None:
        unscaled = sorted(n for n, t in tensors.items() if t.dtype == _FP8_WEIGHT_DTYPE and len(t.shape) == 2 and n not in pairs
                          and t.scale is None)
        if unscaled:
            corrupt.append(f"FP8 weights without a {SCALE_SUFFIX} tensor: {format_offenders(unscaled)}")
    if unsupported:
        raise UnsupportedStateError(f"{storage.url}: cannot dequantize: {format_offenders(unsupported, sep='; ')}")
    if corrupt:
        raise CorruptCheckpointError(
            f"{storage.url}: block FP8 scales do not match their weights ({block[0]}x{block[1]} blocks, from "
            f"{where if qc is not None else 'the default: no config.json'}): {format_offenders(corrupt, sep='; ')}"
        )
    out = {n: t for n, t in tensors.items() if n not in set(pairs.values())}
    for w, s in pairs.items():
        out[w] = dataclasses.replace(tensors[w], scale=BlockScale(s, tensors[s], block))
    return dataclasses.replace(manifest, tensors=out)
