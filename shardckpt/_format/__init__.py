"""The on-disk format, v1, v2 and v3 (``docs/format.md`` is the spec): the one place that knows the bytes.

- :mod:`.naming`: the file grammar, each name with its inverse (``manifest.json``, the HF index, ``data/``, a rank's
  data files and index file, step and staging directories, chunk keys);
- :mod:`.dtypes`: safetensors dtype names and item sizes, and the one check of a stored shape (``checked_shape``);
- :mod:`.manifest`: the manifest, built, serialized, parsed and validated;
- :mod:`.header`: safetensors headers, built and parsed (bounded, checked);
- :mod:`.values`: the JSON codec of non-tensor values (tags, tensor references);
- :mod:`.checksum`: CRC-32C (and CRC-32) with ``combine`` for blocks checksummed apart;
- :mod:`.hf`: a Manifest from a Hugging Face safetensors directory or file;
- :mod:`.committed`: :func:`commit` / :func:`commit_bytes` (the one commit sequence, files checked before and after the manifest write) and :func:`open_manifest`;
- :mod:`.files`: ``check_files``, every file present with its recorded size;
- :mod:`._v2`: v2/v3 manifests, the v3 file table, per-rank index files;
- :mod:`.resolve`: :func:`resolve_chunks`, the chunks a loading rank reads.

Imports no torch (``tests/unit/test_imports.py`` pins it): ``shardckpt
verify`` and ``shardckpt inspect`` run where torch is not installed.
"""

from __future__ import annotations

from .checksum import ALGOS, checksum, combine, crc32c, crc32c_combine
from .chunk import Chunk
from .committed import TORCH_SAVE_SUFFIXES, commit, commit_bytes, hf_index_bytes, open_manifest
from .dtypes import DTYPES, MAX_TENSOR_BYTES, checked_shape, dtype_name, itemsize, shape_problem, torch_dtype
from .header import MAX_HEADER_BYTES, parse_safetensors_header, read_safetensors_header, safetensors_header
from .hf import MAX_INDEX_BYTES, SOURCE_SAFETENSORS, hf_manifest, with_block_scales
from .manifest import (
    FORMAT_NAME,
    FORMAT_VERSION,
    MAX_MANIFEST_BYTES,
    MAX_NDIM,
    BlockScale,
    ChunkMeta,
    FileMeta,
    IndexMeta,
    Manifest,
    TensorMeta,
    check_relpath,
    manifest_from_bytes,
    manifest_to_bytes,
    plural,
    tiling_problems,
)
from .naming import (
    DATA_DIR,
    DATA_SUFFIX,
    HF_INDEX_NAME,
    INDEX_DIR,
    MANIFEST_NAME,
    chunk_key,
    data_file_name,
    index_file_name,
    parse_data_file_name,
    rank_file_name,
    save_id_prefix,
)
from .resolve import MetaCache, Reads, resolve_chunks, resolve_many, resolve_reads
from .values import TAG, decode_value, encode_value, is_tensor_ref, plain_values, rename_refs, tensor_ref

__all__ = [
    "ALGOS", "checksum", "combine", "crc32c", "crc32c_combine",
    "TORCH_SAVE_SUFFIXES", "commit", "commit_bytes", "hf_index_bytes", "open_manifest",
    "DTYPES", "dtype_name", "itemsize", "torch_dtype", "MAX_TENSOR_BYTES", "checked_shape", "shape_problem",
    "MAX_HEADER_BYTES", "parse_safetensors_header", "read_safetensors_header", "safetensors_header",
    "MAX_INDEX_BYTES", "SOURCE_SAFETENSORS", "hf_manifest", "with_block_scales", "BlockScale",
    "FORMAT_NAME", "FORMAT_VERSION", "MAX_MANIFEST_BYTES", "MAX_NDIM",
    "ChunkMeta", "FileMeta", "IndexMeta", "Manifest", "TensorMeta",
    "check_relpath", "manifest_from_bytes", "manifest_to_bytes", "plural", "tiling_problems",
    "DATA_DIR", "DATA_SUFFIX", "HF_INDEX_NAME", "INDEX_DIR", "MANIFEST_NAME", "chunk_key", "data_file_name",
    "index_file_name", "parse_data_file_name", "rank_file_name", "save_id_prefix",
    "Chunk", "MetaCache", "resolve_chunks", "resolve_many", "Reads", "resolve_reads",
    "TAG", "decode_value", "encode_value", "is_tensor_ref", "plain_values", "rename_refs", "tensor_ref",
]
