"""Format v2 and v3 internals: the manifest's v2 fields, the v3 file table, per-rank index files, chunk resolution.

A v2 manifest lists no chunks: a tensor of a regular layout (placements over
a mesh, or plain replicated data) carries its layout record, from which every
chunk and its writer rank derive (``_geometry``); an irregular one names its
writer ranks. Each writing rank's index file lists the chunks it wrote with
their block checksums; the manifest records each index file's size and
CRC-32C, and its own CRC-32C covers all of it (a two-level tree).
"""

from __future__ import annotations

import json
import math
import operator
import re
from collections import Counter, deque
from itertools import accumulate, repeat
from typing import Any, Dict, List, NamedTuple, Optional, Sequence, Tuple, cast

from .. import _geometry
from ..errors import ChecksumMismatchError, CorruptCheckpointError, UnsafeMetadataError
from . import table as _table
from .checksum import HASH_ALGOS, check_hash_hex, crc32c, pack_crcs, unpack_crcs
from .chunk import Chunk, MetaCache
from .dtypes import DTYPES, checked_shape, itemsize
from .filetable import TableFiles, TableIndexes, disjoint_patterns
from .manifest import (
    FORMAT_NAME,
    MANIFEST_CRC_FIELD,
    ChunkMeta,
    FileMeta,
    IndexMeta,
    Manifest,
    TensorMeta,
    canonical_json,
    check_relpath,
    int_list_field,
    manifest_json_v2,
    paused_gc,
    required_field,
    tiling_problems,
    written_crc_matches,
)
from .naming import DATA_DIR, DATA_SUFFIX, INDEX_DIR, INDEX_SUFFIX, chunk_key, save_id_prefix
from .refs import REF_MARK, check_ref_paths
from .table import (
    ColumnKeys,
    TableKind,
    TableTensors,
    front_decode,
    index_columns,
    int_column,
    parse_index_columns,
    tensor_table_json,
)
from .versions import VERSIONS, first_with, register, spec, supports

INDEX_FORMAT = "shardckpt-index"
#: Largest index file read (one rank's chunk list).
MAX_INDEX_FILE_BYTES = 1 << 30
#: Largest block size a manifest may declare, and the smallest.
MAX_BLOCK_BYTES = 1 << 34
MIN_BLOCK_BYTES = 4096
_LISTED = 20
#: Shard coordinates a regular layout record may enumerate: at least this
#: many, or more when more ranks wrote index files. Reading a layout costs one
#: step per coordinate, so a 600-byte crafted record naming 2**24 shards must
#: be refused before anything enumerates it; a real save's coordinates are at
#: most its ranks, nearly all of which write an index file.
MIN_SHARD_BOUND = 1 << 16
SHARDS_PER_INDEX = 4


def _bad(where: str, what: str) -> CorruptCheckpointError:
    return CorruptCheckpointError(f"{where}: {what}")


def nblocks(nbytes: int, block_bytes: int) -> int:
    return -(-nbytes // block_bytes) if nbytes else 0


# --------------------------------------------------------------------------
# manifest v2: parse (serialization is in manifest.py)


@paused_gc
def manifest_v2_from_raw(raw: Dict[str, Any], where: str, *, canonical: Optional[bytes] = None) -> Manifest:
    """Validate a parsed v2 manifest; its own checksum first, so nothing damaged is interpreted.

    ``canonical``: the bytes ``raw`` was parsed from, when they hold no
    non-finite number; the checksum is checked over them when they are the
    writer's encoding, else over ``raw`` re-encoded (the same verdict).
    """
    # Paths first: one escaping the checkpoint is refused as unsafe whatever
    # else is wrong. Checked here once each (not again below: O(ranks) paths).
    for key in ("files", "indexes"):
        for path in (raw.get(key) or {}) if isinstance(raw.get(key), dict) else ():
            check_relpath(path, where=f"{where}: {key}")
    version: Any = raw.get("format_version")
    table = spec(version).file_table
    if table:
        _check_table_paths(raw, where)
    elif "file_table" in raw:
        since = first_with("file_table")
        raise _bad(where, f"a format_version {version} manifest carries 'file_table' (new in version {since}): damaged")
    if MANIFEST_CRC_FIELD not in raw:
        raise _bad(where, f"missing field {MANIFEST_CRC_FIELD!r} (the manifest's own checksum)")
    want = raw.pop(MANIFEST_CRC_FIELD)
    if written_crc_matches(canonical, want):
        got = want
    else:
        try:
            got = crc32c(manifest_json_v2(raw))
        except (ValueError, TypeError, RecursionError):  # NaN/Infinity tokens, absurd nesting
            raise _bad(where, "holds values canonical JSON cannot (NaN, Infinity or overflowing numbers): damaged") from None
    if got != want:
        raise _bad(
            where,
            f"checksum mismatch: {MANIFEST_CRC_FIELD} says {want!r:.20}, the manifest's bytes give {got}; "
            "the manifest is damaged (restore it from a copy, or use an older checkpoint)",
        )
    world_size = required_field(raw, "world_size", int, where)
    if world_size < 1:
        raise _bad(where, f"world_size must be >= 1, found {world_size}")
    block_bytes = required_field(raw, "block_bytes", int, where)
    if not MIN_BLOCK_BYTES <= block_bytes <= MAX_BLOCK_BYTES:
        raise _bad(where, f"block_bytes {block_bytes} outside [{MIN_BLOCK_BYTES}, {MAX_BLOCK_BYTES}]")
    files: Dict[str, FileMeta] = {}
    for path, fm in required_field(raw, "files", dict, where).items():
        size = required_field(fm, "size", int, f"{where}: files[{path!r}]")
        if size < 0:
            raise _bad(where, f"files[{path!r}].size is negative")
        files[path] = FileMeta(size)
    listed_indexes = []  # (path, meta, where): the plain map's, then the table's
    for path, im in required_field(raw, "indexes", dict, where).items():
        iw = f"{where}: indexes[{path!r}]"
        listed_indexes.append((path, IndexMeta(required_field(im, "rank", int, iw), required_field(im, "size", int, iw), required_field(im, "crc32c", int, iw)), iw))
    indexes: Dict[str, IndexMeta] = {}
    cols: Optional[_TableColumns] = None
    if table:
        expanded = _expand_table(raw, world_size, where)
        if isinstance(expanded, _TableColumns):
            # One data and one index file per rank, every entry checked over
            # the columns: records built on lookup (``filetable``), none here.
            cols = expanded
            for path in files:
                if cols.files.table_size(path) is not None:
                    raise _bad(where, f"file {path!r} is listed twice (file_table and files)")
            cols.files.plain.update(files)
            files = cast(Dict[str, FileMeta], cols.files)
        else:
            table_data, table_indexes = expanded
            npaths = len(files) + len(table_data) + len(table_indexes)
            files.update(zip(map(operator.itemgetter(0), table_data), map(FileMeta, map(operator.itemgetter(1), table_data))))
            files.update(zip(map(operator.itemgetter(0), table_indexes),
                             map(FileMeta, map(operator.attrgetter("size"), map(operator.itemgetter(1), table_indexes)))))
            if len(files) != npaths:  # a name twice: find it
                seen = {path for path, _ in required_field(raw, "files", dict, where).items()}
                for path in [p for p, _ in table_data] + [p for p, _ in table_indexes]:
                    if path in seen:
                        raise _bad(where, f"file {path!r} is listed twice (file_table and files)")
                    seen.add(path)
            # The table's index files: ranks 0.. in order, each once, sizes as in
            # 'files' by construction; checked in bulk (below, one by one, only
            # what the plain 'indexes' map lists).
            sizes = [meta.size for _, meta in table_indexes]
            crcs = [meta.crc32c for _, meta in table_indexes]
            if int_column(sizes, 0, MAX_INDEX_FILE_BYTES + 1) and int_column(crcs, 0, 2**32):
                indexes.update(table_indexes)
            else:
                listed_indexes.extend((path, meta, "") for path, meta in table_indexes)
    ranks_seen: Dict[int, str] = {im.rank: rel for rel, im in indexes.items()}
    table_ranks = world_size if cols is not None else 0  # ranks 0.. each with the table's index file
    for path, meta, iw in listed_indexes:
        iw = iw or f"{where}: file_table.index_files[{meta.rank}]"
        if not 0 <= meta.rank < world_size or meta.rank in ranks_seen or meta.rank < table_ranks:
            raise _bad(iw, f"rank {meta.rank} outside 0..{world_size - 1} or listed twice")
        if not 0 <= meta.size <= MAX_INDEX_FILE_BYTES or not 0 <= meta.crc32c < 2**32:
            raise _bad(iw, f"size {meta.size} or crc32c {meta.crc32c} out of range")
        if path not in files or files[path].size != meta.size:
            raise _bad(iw, "must be listed in 'files' with the same size")
        ranks_seen[meta.rank] = path
        indexes[path] = meta
    if cols is not None:
        indexes = cast(Dict[str, IndexMeta], TableIndexes(indexes, cols.index_name, cols.index_rx, cols.index_sizes, cols.index_crcs))
    meshes = required_field(raw, "meshes", list, where)
    for i, mesh in enumerate(meshes):
        if mesh != "iota" and not (
            isinstance(mesh, list) and all(isinstance(r, int) and not isinstance(r, bool) and 0 <= r < world_size for r in mesh)
        ):
            raise _bad(where, f"meshes[{i}] must be 'iota' or a list of ranks in 0..{world_size - 1}")
    tensors: Dict[str, TensorMeta] = {}
    memo: Dict[Any, Any] = {}  # distinct layout records, validated once
    for name, tm in required_field(raw, "tensors", dict, where).items():
        tw = f"{where}: tensor {name!r}"
        dt = required_field(tm, "dtype", str, tw)
        if dt not in DTYPES:
            raise _bad(tw, f"unknown dtype {dt!r}")
        shape = checked_shape(int_list_field(tm, "shape", tw), itemsize(dt), where=tw)
        layout = tm.get("layout")
        t = TensorMeta(dtype=dt, shape=shape, chunks=[], layout=layout if isinstance(layout, dict) else None)
        if "regular" in tm:
            reg = required_field(tm, "regular", dict, tw)
            lay = _checked_regular(reg, shape, meshes, world_size, len(indexes), memo, tw)
            rot = required_field(reg, "rotation", int, tw)
            if not 0 <= rot < lay.world:
                raise _bad(tw, f"rotation {rot} outside 0..{lay.world - 1}")
            t.regular = reg
            t.__dict__["_regular_layout"] = lay
        else:
            writers = required_field(tm, "writers", list, tw)
            if any(not isinstance(r, int) or isinstance(r, bool) or not 0 <= r < world_size for r in writers):
                raise _bad(tw, f"writers must be ranks in 0..{world_size - 1}")
            t.writers = list(writers)
        tensors[name] = t
    if "tensor_table" in raw:
        if not spec(version).tensor_table:
            since = first_with("tensor_table")
            raise _bad(where, f"a format_version {version} manifest carries 'tensor_table' (new in version {since}): damaged")
        tensors = _tensor_table(raw["tensor_table"], tensors, meshes, world_size, len(indexes), memo, f"{where}: tensor_table")
    content_hash = ""
    if supports(version, "content_hash"):
        content_hash = required_field(raw, "content_hash", str, where)
        if content_hash not in HASH_ALGOS:
            raise _bad(where, f"content_hash {content_hash!r:.40} is not one of {', '.join(HASH_ALGOS)} (a newer shardckpt? upgrade)")
        check_ref_paths(cols.files.plain if cols is not None else files, where)  # table paths: no reference (checked)
    extra = raw.get("extra") or {}
    return Manifest(
        content_hash=content_hash,
        world_size=world_size,
        tensors=tensors,
        files=files,
        values=raw.get("values"),
        save_id=str(raw.get("save_id", "")),
        library_version=str(raw.get("library_version", "")),
        extra=extra if isinstance(extra, dict) else {},
        version=raw["format_version"],
        block_bytes=block_bytes,
        meshes=meshes,
        indexes=indexes,
    )


def _checked_regular(reg: Any, shape: List[int], meshes: List[Any], world_size: int, nindexes: int, memo: Dict[Any, Any], tw: str):
    """A tensor's layout record (without its rotation) checked against the manifest; memoized per distinct record."""
    try:
        key: Any = (tuple(shape), reg.get("mesh"), tuple(reg.get("mesh_shape")), tuple(reg.get("placements")))
        hit = memo.get(key)
    except TypeError:  # unhashable junk: checked (and refused) below
        key, hit = None, None
    if hit is not None:
        return hit
    lay = _regular_of(reg, shape, tw)
    mesh = required_field(reg, "mesh", int, tw)
    if not 0 <= mesh < len(meshes):
        raise _bad(tw, f"mesh {mesh} is not one of the {len(meshes)} meshes")
    n = lay.world
    if meshes[mesh] == "iota" and n > world_size or meshes[mesh] != "iota" and len(meshes[mesh]) != n:
        raise _bad(tw, f"mesh {mesh} does not have the {n} ranks of mesh shape {list(lay.mesh_shape)}")
    shards, bound = _shard_count(lay), max(MIN_SHARD_BOUND, SHARDS_PER_INDEX * nindexes)
    if shards > bound:
        raise UnsafeMetadataError(
            f"{tw}: its layout record has {shards} shard coordinates, more than the {bound} allowed for "
            f"{nindexes} index files (a crafted manifest; reading it would take one step per coordinate)"
        )
    if key is not None:
        memo[key] = lay
    return lay


def _tensor_table(table: Any, tensors: Dict[str, TensorMeta], meshes: List[Any], world_size: int, nindexes: int,
                  memo: Dict[Any, Any], where: str) -> Dict[str, TensorMeta]:
    """Format v5's ``tensor_table`` (``_format.table``) added to ``tensors``: each kind checked once, each tensor's ints.

    Returns the manifest's tensors: a :class:`TableTensors` over ``tensors``
    and the table when every column checks in bulk (no per-tensor object
    until one is asked for), else ``tensors`` with every record added.
    """
    if not isinstance(table, dict):
        raise _bad(where, "must be an object")
    kinds = required_field(table, "kinds", list, where)
    checked = []
    for k, kj in enumerate(kinds):
        kw = f"{where}: kinds[{k}]"
        dt = required_field(kj, "dtype", str, kw)
        if dt not in DTYPES:
            raise _bad(kw, f"unknown dtype {dt!r}")
        shape = checked_shape(int_list_field(kj, "shape", kw), itemsize(dt), where=kw)
        reg = {"mesh_shape": kj.get("mesh_shape"), "placements": kj.get("placements"), "mesh": kj.get("mesh")}
        lay = _checked_regular(reg, shape, meshes, world_size, nindexes, memo, kw)
        layout = kj.get("layout")
        checked.append((dt, shape, layout if isinstance(layout, dict) else None, reg, lay, lay.world))
    prefix, suffix = table.get("prefix"), table.get("suffix")
    # Distinct names checked by the name -> row map's size below (strictly
    # again, naming the name, when it falls short).
    names = front_decode(prefix, suffix, strict=False, where=where)
    kind_col, rot_col = table.get("kind"), table.get("rotation")
    if not isinstance(kind_col, list) or not isinstance(rot_col, list) or not len(kind_col) == len(rot_col) == len(names):
        raise _bad(where, f"'kind' and 'rotation' must be lists of {len(names)} entries (one per name)")
    nkinds = len(checked)
    worlds = [c[5] for c in checked]
    if int_column(kind_col, 0, nkinds) and int_column(rot_col, 0, None) and (
        not rot_col or max(rot_col) < min(worlds) or all(map(operator.lt, rot_col, map(worlds.__getitem__, kind_col)))
    ):  # every rotation below the smallest world: no per-tensor comparison
        # Every kind number and rotation checked over the whole columns: a
        # tensor's record is built when first asked for (``TableTensors``).
        # Typed as the dict it stands for (every mapping operation, built on demand).
        got = TableTensors(tensors, names, [TableKind(*c[:5]) for c in checked], kind_col, rot_col, (prefix, suffix, names))
        if len(got) == len(tensors) + len(names):  # no name twice, none also a per-tensor record
            return cast(Dict[str, TensorMeta], got)
    names = front_decode(prefix, suffix, strict=True, where=where)  # a name twice in the table: refused, named
    for name, k, rot in zip(names, kind_col, rot_col):
        if type(k) is not int or not 0 <= k < nkinds:
            raise _bad(where, f"tensor {name!r}: kind {k!r:.20} is not one of the {nkinds} kinds")
        dt, shape, layout, reg, lay, world = checked[k]
        if type(rot) is not int or not 0 <= rot < world:
            raise _bad(where, f"tensor {name!r}: rotation {rot!r:.20} outside 0..{world - 1}")
        if name in tensors:
            raise _bad(where, f"tensor {name!r} is listed twice (tensor_table and tensors)")
        t = TensorMeta(dt, list(shape), [], layout, {**reg, "rotation": rot})
        t.__dict__["_regular_layout"] = lay
        tensors[name] = t
    return tensors


def _regular_of(reg: Dict[str, Any], shape: List[int], where: str):
    try:
        return _geometry.layout_from_json({"shape": list(shape), "mesh_shape": reg.get("mesh_shape"), "placements": reg.get("placements")})
    except ValueError as e:
        raise _bad(where, f"invalid layout record: {e}") from None


def _shard_count(lay) -> int:
    return _geometry.shard_count(lay)


def regular_of(t: TensorMeta):
    """The ``_geometry.RegularLayout`` of a v2 regular tensor (memoized on the TensorMeta)."""
    lay = t.__dict__.get("_regular_layout")
    if lay is None:
        lay = _regular_of(cast(Dict[str, Any], t.regular), t.shape, "tensor")
        t.__dict__["_regular_layout"] = lay
    return lay


def mesh_rank(m: Manifest, t: TensorMeta, coord: Sequence[int]) -> int:
    """Global rank at mesh ``coord`` of a regular tensor's mesh."""
    return _rank_at(m, regular_of(t), cast(Dict[str, Any], t.regular)["mesh"], coord)


def _rank_at(m: Manifest, lay: Any, mesh: int, coord: Sequence[int]) -> int:
    flat = 0
    for c, n in zip(coord, lay.mesh_shape):
        flat = flat * n + c
    ranks = m.meshes[mesh]
    return flat if ranks == "iota" else ranks[flat]



# --------------------------------------------------------------------------
# v3: the compact per-rank file table


#: Placeholders of the table's name patterns: the rank, zero-padded to 5
#: digits, and the file number within the rank, zero-padded to 2 (Python
#: ``f"{rank:05d}"``, ``f"{i:02d}"``: wider numbers are written in full).
RANK_FIELD, FILE_FIELD = "{rank}", "{i}"
#: Bounds checked before a table is expanded (a hostile table of a few bytes
#: per file must not make us build millions of paths): files in the table,
#: files per rank, and ranks.
MAX_TABLE_FILES = 1 << 22
MAX_FILES_PER_RANK = 1 << 12
MAX_TABLE_RANKS = 1 << 24


def table_patterns(save_id: str) -> Tuple[str, str]:
    """The name patterns ``save`` and the converters use: ``(data, index)``, with ``{rank}`` and ``{i}``.

    Example:
        >>> table_patterns("0123456789abcdef")
        ('data/0123456789ab-r{rank}-{i}.safetensors', 'data/0123456789ab-index-r{rank}.json')
    """
    pre = save_id_prefix(save_id)
    return f"{DATA_DIR}/{pre}r{RANK_FIELD}-{FILE_FIELD}{DATA_SUFFIX}", f"{INDEX_DIR}/{pre}index-r{RANK_FIELD}{INDEX_SUFFIX}"


def expand_name(pattern: str, rank: int, i: int = 0) -> str:
    """A table name: ``pattern`` with ``{rank}`` and ``{i}`` replaced (digits only, so a valid pattern gives a valid path)."""
    return _namer(pattern)(rank, i)


def _namer(pattern: str):
    """``pattern``'s names as a ``str.format`` (C speed); the pattern has no braces but its placeholders (checked)."""
    return pattern.replace(RANK_FIELD, "{0:05d}").replace(FILE_FIELD, "{1:02d}").format


def _pattern_regex(pattern: str) -> "re.Pattern[str]":
    """Matches exactly the names ``expand_name`` writes for ``pattern`` (groups: rank, then i if present)."""
    out, rest = "", pattern
    while rest:
        r, f = rest.find(RANK_FIELD), rest.find(FILE_FIELD)
        cands = [(p, fld) for p, fld in ((r, RANK_FIELD), (f, FILE_FIELD)) if p >= 0]
        if not cands:
            out += re.escape(rest)
            break
        p, fld = min(cands)
        out += re.escape(rest[:p]) + (r"(?P<rank>\d{5,})" if fld == RANK_FIELD else r"(?P<i>\d{2,})")
        rest = rest[p + len(fld) :]
    return re.compile(out + r"\Z")


def check_table_pattern(pattern: Any, *, fields: Tuple[str, ...], where: str) -> str:
    """Refuse a name pattern that is not a safe relative path with exactly ``fields`` once each.

    Raises:
        UnsafeMetadataError: not a string; another placeholder or brace; a
            placeholder missing or repeated; the expanded name not a plain
            relative path (``manifest.check_relpath``).
    """
    if not isinstance(pattern, str) or not pattern:
        raise UnsafeMetadataError(f"{where}: a file name pattern must be a non-empty string, found {pattern!r:.80}")
    bare = pattern
    for fld in (RANK_FIELD, FILE_FIELD):
        n = pattern.count(fld)
        if n != (1 if fld in fields else 0):
            raise UnsafeMetadataError(f"{where}: file name pattern {pattern!r:.200} must hold {' and '.join(fields)} once each, nothing else in braces")
        bare = bare.replace(fld, "")
    if "{" in bare or "}" in bare:
        raise UnsafeMetadataError(f"{where}: file name pattern {pattern!r:.200} holds braces other than {' and '.join(fields)}")
    # Placeholders become digits: a pattern whose sample name is a plain
    # relative path gives plain relative paths for every rank and file.
    check_relpath(pattern.replace(RANK_FIELD, "00000").replace(FILE_FIELD, "00"), where=where)
    return pattern


def file_table_json(m: Manifest) -> Tuple[Dict[str, Any], Dict[str, FileMeta], Dict[str, IndexMeta]]:
    """``(file_table, other files, other indexes)`` of a v3 manifest: per-rank files as patterns + sizes.

    Pure. A data file named ``data/<save>-r<rank>-<i>.safetensors`` (as
    ``table_patterns`` writes it, rank < world size) goes into the table as
    ``data_sizes[rank][i]``; a rank's index file as ``index_files[rank] =
    [size, crc32c]``; any other file stays in the plain maps. Deterministic.
    """
    data_pat, index_pat = table_patterns(m.save_id)
    try:
        check_table_pattern(data_pat, fields=(RANK_FIELD, FILE_FIELD), where="save id")
        check_table_pattern(index_pat, fields=(RANK_FIELD,), where="save id")
        usable = m.world_size <= MAX_TABLE_RANKS
    except UnsafeMetadataError:  # a save id no writer of ours makes: list every file plainly
        usable = False
    world = m.world_size if usable else 0
    data_rx, data_name, index_name = _pattern_regex(data_pat), _namer(data_pat), _namer(index_pat)
    sizes: List[List[Optional[int]]] = [[] for _ in range(world)]
    index_files: List[Optional[List[int]]] = [None] * world
    other_files: Dict[str, FileMeta] = {}
    other_indexes: Dict[str, IndexMeta] = {}
    for rel, im in m.indexes.items():
        if usable and 0 <= im.rank < world and index_files[im.rank] is None and rel == index_name(im.rank, 0):
            index_files[im.rank] = [im.size, im.crc32c]
        else:
            other_indexes[rel] = im
            other_files[rel] = m.files[rel]
    for rel, fm in m.files.items():
        if rel in m.indexes:
            continue
        hit = data_rx.match(rel) if usable else None
        if hit is not None:
            r, i = int(hit.group("rank")), int(hit.group("i"))
            if r < world and i < MAX_FILES_PER_RANK and data_name(r, i) == rel:
                row = sizes[r]
                if len(row) <= i:
                    row.extend([None] * (i + 1 - len(row)))
                row[i] = fm.size
                continue
        other_files[rel] = fm
    table = {"data": data_pat, "index": index_pat, "data_sizes": sizes, "index_files": index_files}
    return table, other_files, other_indexes


@paused_gc
def manifest_v2_json(m: Manifest) -> Dict[str, Any]:
    """Format v2/v3's JSON object: layouts and writers instead of chunks; v3's file table."""
    tensors = {}
    table, listed = tensor_table_json(m.tensors) if spec(m.version).tensor_table else (None, sorted(m.tensors))
    for name in listed:
        t = m.tensors[name]
        tj: Dict[str, Any] = {"dtype": t.dtype, "shape": list(t.shape)}
        if t.layout is not None:
            tj["layout"] = t.layout
        if t.regular is not None:
            tj["regular"] = t.regular
        else:
            tj["writers"] = sorted(t.writers or [])
        tensors[name] = tj
    out = {
        "format": FORMAT_NAME,
        "format_version": m.version,
        "library_version": m.library_version,
        "save_id": m.save_id,
        "world_size": m.world_size,
        "checksum": "crc32c",
        "block_bytes": m.block_bytes,
        "meshes": m.meshes,
        "tensors": tensors,
        "values": m.values,
        "extra": m.extra,
    }
    if supports(m.version, "content_hash"):
        out["content_hash"] = m.content_hash
    if table is not None:
        out["tensor_table"] = table
    files, indexes = m.files, m.indexes
    if spec(m.version).file_table:
        out["file_table"], files, indexes = file_table_json(m)
    out["files"] = {k: files[k].to_json() for k in sorted(files)}
    out["indexes"] = {k: indexes[k].to_json() for k in sorted(indexes)}
    return out


def _check_table_paths(raw: Dict[str, Any], where: str) -> None:
    """The table's patterns, checked with every other path, before anything else of the manifest."""
    table = raw.get("file_table")
    if not isinstance(table, dict):
        raise _bad(where, "missing field 'file_table' (a format_version 3 manifest lists its per-rank files there)")
    check_table_pattern(table.get("data"), fields=(RANK_FIELD, FILE_FIELD), where=f"{where}: file_table.data")
    check_table_pattern(table.get("index"), fields=(RANK_FIELD,), where=f"{where}: file_table.index")


class _TableColumns(NamedTuple):
    """A file table of one data and one index file per rank, checked over its columns (``filetable``)."""

    files: TableFiles
    index_name: Any
    index_rx: Any
    index_sizes: List[int]
    index_crcs: List[int]


def _expand_table(raw: Dict[str, Any], world_size: int, where: str) -> Any:
    """The table's ``(data path, size)`` and ``(index path, IndexMeta)``; bounded before a single path is built.

    Returns :class:`_TableColumns` instead (no path built) for a table of one
    data and one index file per rank whose every entry checks and whose
    paths cannot clash (``filetable.disjoint_patterns``).
    """
    tw = f"{where}: file_table"
    table = raw["file_table"]
    sizes = required_field(table, "data_sizes", list, tw)
    index_files = required_field(table, "index_files", list, tw)
    if world_size > MAX_TABLE_RANKS:
        raise UnsafeMetadataError(f"{tw}: world_size {world_size} exceeds the {MAX_TABLE_RANKS}-rank limit of a file table")
    if len(sizes) != world_size or len(index_files) != world_size:
        raise _bad(tw, f"data_sizes and index_files must have one entry per rank ({world_size}), found {len(sizes)} and {len(index_files)}")
    if sizes and set(map(type, sizes)) == {list} and max(map(len, sizes)) <= MAX_FILES_PER_RANK:  # over the column
        total = world_size + sum(map(len, sizes))
    else:  # one by one, naming the bad entry
        total = world_size
        for r, row in enumerate(sizes):
            if not isinstance(row, list):
                raise _bad(tw, f"data_sizes[{r}] must be a list of sizes, found {type(row).__name__}")
            if len(row) > MAX_FILES_PER_RANK:
                raise UnsafeMetadataError(f"{tw}: data_sizes[{r}] lists {len(row)} files, over the limit of {MAX_FILES_PER_RANK} per rank")
            total += len(row)
    if total > MAX_TABLE_FILES:
        raise UnsafeMetadataError(f"{tw}: expands to {total} files, over the limit of {MAX_TABLE_FILES}: refused before expanding")
    data_name, index_name = _namer(table["data"]), _namer(table["index"])
    if (
        world_size and set(map(len, sizes)) == {1} and int_column(col := list(map(operator.itemgetter(0), sizes)), 0, None)
        and set(map(type, index_files)) == {list} and set(map(len, index_files)) == {2}
    ):
        # One data file and one index file per rank (what a save writes):
        # every field checked over the columns. When every index size and CRC
        # is in range, no two table paths can be equal and none is a
        # reference, no path is made here at all.
        isz, icrc = list(map(operator.itemgetter(0), index_files)), list(map(operator.itemgetter(1), index_files))
        in_range = int_column(isz, 0, MAX_INDEX_FILE_BYTES + 1) and int_column(icrc, 0, 2**32)
        if (
            in_range and disjoint_patterns(table["data"], table["index"], RANK_FIELD, FILE_FIELD)
            and not table["data"].startswith(REF_MARK) and not table["index"].startswith(REF_MARK)
        ):
            index_rx = _pattern_regex(table["index"])
            tf = TableFiles({}, data_name, index_name, _pattern_regex(table["data"]), index_rx, col, isz)
            return _TableColumns(tf, index_name, index_rx, isz, icrc)
        if in_range or (int_column(isz, -(1 << 62), None) and int_column(icrc, -(1 << 62), None)):
            ranks = range(world_size)
            return (list(zip(map(data_name, ranks, repeat(0)), col)),
                    list(zip(map(index_name, ranks, repeat(0)), map(IndexMeta, ranks, isz, icrc))))
    data: List[Tuple[str, int]] = []
    for r, row in enumerate(sizes):
        for i, n in enumerate(row):
            if n is None:
                continue
            # ``type(n) is int``: JSON true/false parse as bool, refused here.
            if type(n) is not int or n < 0:
                raise _bad(tw, f"data_sizes[{r}][{i}] must be a non-negative int or null, found {n!r:.40}")
            data.append((data_name(r, i), n))
    indexes: List[Tuple[str, IndexMeta]] = []
    for r, rec in enumerate(index_files):
        if rec is None:
            continue
        if type(rec) is not list or len(rec) != 2 or type(rec[0]) is not int or type(rec[1]) is not int:
            raise _bad(tw, f"index_files[{r}] must be [size, crc32c] or null, found {rec!r:.60}")
        indexes.append((index_name(r, 0), IndexMeta(r, rec[0], rec[1])))
    return data, indexes

# --------------------------------------------------------------------------
# index files


#: Fields of one chunk row of an index file, in order (rows, not objects: an
#: index costs ~100 bytes a chunk). ``key`` and ``nbytes`` derive from them.
INDEX_ROW = ("tensor", "file", "offsets", "sizes", "byte_offset", "crc32c", "blocks")
#: Format v4 rows: one more column, the chunk's content hash (hex, or null
#: for a chunk written without one); the algorithm is the manifest's
#: ``content_hash``.
INDEX_ROW_V4 = INDEX_ROW + ("hash",)
#: An index file's ``format_version`` when its chunks are columns (format v5
#: manifests, indexes of at least ``table.TABLE_MIN_ENTRIES`` chunks); rows: 2.
INDEX_COLUMNAR = 3


def index_bytes(save_id: str, rank: int, block_bytes: int, chunks: Sequence[Tuple[str, ChunkMeta]]) -> bytes:
    """A rank's index file: ``(tensor name, chunk)`` for every chunk it wrote, with block CRCs."""
    files = sorted({c.file for _, c in chunks})
    fid = {f: i for i, f in enumerate(files)}
    hashed = any(c.hash is not None for _, c in chunks)
    if len(chunks) >= _table.TABLE_MIN_ENTRIES:
        # Format v5's columnar index (``_format.table``): ~25 bytes a chunk.
        return canonical_json({
            "format": INDEX_FORMAT, "format_version": INDEX_COLUMNAR, "save_id": save_id, "rank": rank,
            "block_bytes": block_bytes, "files": files, **index_columns(chunks, files, hashed),
        })
    rows = []
    for name, c in sorted(chunks, key=lambda nc: (nc[0], nc[1].offsets)):
        row = [name, fid[c.file], list(c.offsets), list(c.sizes), c.byte_offset, c.crc32c, pack_crcs(c.blocks or [])]
        rows.append(row + [c.hash] if hashed else row)
    body = {
        "format": INDEX_FORMAT,
        "format_version": 2,
        "save_id": save_id,
        "rank": rank,
        "block_bytes": block_bytes,
        "files": files,
        "rows": list(INDEX_ROW_V4 if hashed else INDEX_ROW),
        "chunks": rows,
    }
    return canonical_json(body)


def read_index(m: Manifest, storage: Any, rank: int, cache: MetaCache) -> Dict[str, Any]:
    """Rank ``rank``'s index, checked against the manifest: ``{"keys": {key: (name, chunk)}, "tensors": {name: [chunk]}}``."""
    headers = cast(Dict[Any, Any], cache.headers)  # keyed by tuples here
    got = headers.get(("index", rank))
    if got is not None:
        return got
    idx = m.indexes
    rel = idx.path_of_rank(rank) if type(idx) is TableIndexes else _index_of_rank(m).get(rank)
    if rel is None:
        raise CorruptCheckpointError(f"{storage.url}: the manifest lists no index file for rank {rank}, whose chunks are needed")
    where = storage.url_of(rel)
    try:
        data = storage.read_bytes(rel, limit=MAX_INDEX_FILE_BYTES)
    except FileNotFoundError:
        raise CorruptCheckpointError(f"{where}: index file is missing") from None
    with cache.lock:
        cache.bytes_read += len(data)
    parsed = check_index(m, data, rel, where)
    with cache.lock:
        headers[("index", rank)] = parsed
    return parsed


@paused_gc
def check_index(m: Manifest, data: bytes, rel: str, where: str) -> Dict[str, Any]:
    """Index file ``rel``'s bytes checked against the manifest (size, CRC-32C) and parsed.

    Returns ``{"keys": {key: (name, chunk)}, "tensors": {name: [chunk]}}``,
    every chunk with its block CRCs.

    Raises:
        ChecksumMismatchError / CorruptCheckpointError: the bytes are not the index the manifest names.
    """
    meta = m.indexes[rel]
    if len(data) != meta.size or crc32c(data) != meta.crc32c:
        what = "truncated" if len(data) < meta.size else "has extra bytes" if len(data) > meta.size else "damaged"
        cls = ChecksumMismatchError if len(data) == meta.size else CorruptCheckpointError
        raise cls(
            f"{where}: index file {what} ({len(data)} bytes, crc32c {crc32c(data):#010x}; "
            f"the manifest says {meta.size} bytes, crc32c {meta.crc32c:#010x})"
        )
    return _parse_index(m, data, meta.rank, where)


def _index_of_rank(m: Manifest) -> Dict[int, str]:
    got = m.__dict__.get("_index_of_rank")
    if got is None:
        got = {im.rank: rel for rel, im in m.indexes.items()}
        m.__dict__["_index_of_rank"] = got
    return got


def _parse_index(m: Manifest, data: bytes, rank: int, where: str) -> Dict[str, Any]:
    try:
        raw = json.loads(data.decode("utf-8"))
    except (UnicodeDecodeError, ValueError, RecursionError) as e:
        raise _bad(where, f"not valid JSON ({e})") from None
    if not isinstance(raw, dict) or raw.get("format") != INDEX_FORMAT or raw.get("rank") != rank:
        raise _bad(where, f"not the shardckpt index of rank {rank}")
    if raw.get("save_id") != m.save_id or raw.get("block_bytes") != m.block_bytes:
        raise _bad(where, "belongs to another save (save_id or block_bytes differ from the manifest)")
    files = required_field(raw, "files", list, where)
    for f in files:
        if not isinstance(f, str) or f not in m.files:
            raise _bad(where, f"file {f!r:.80} is not listed in the manifest")
    if raw.get("format_version") == INDEX_COLUMNAR and spec(m.version).tensor_table:
        return _parse_columns(m, raw, files, where)
    row_kinds = [list(INDEX_ROW)] + ([list(INDEX_ROW_V4)] if supports(m.version, "content_hash") else [])
    if raw.get("rows") not in row_kinds:
        raise _bad(where, f"field 'rows' must be {' or '.join(str(k) for k in row_kinds)}")
    columns = tuple(raw["rows"])
    keys: Dict[str, Tuple[str, ChunkMeta]] = {}
    by_tensor: Dict[str, List[ChunkMeta]] = {}
    claims = []
    for i, row in enumerate(required_field(raw, "chunks", list, where)):
        cw = f"{where} chunk {i}"
        if not isinstance(row, list) or len(row) != len(columns):
            raise _bad(cw, f"must be a list of {len(columns)} fields {list(columns)}")
        rec = dict(zip(columns, row))
        name = required_field(rec, "tensor", str, cw)
        t = m.tensors.get(name)
        if t is None:
            raise _bad(cw, f"tensor {name!r} is not in the manifest")
        fi = required_field(rec, "file", int, cw)
        if not 0 <= fi < len(files):
            raise _bad(cw, f"file number {fi} outside the index's {len(files)} files")
        offsets = int_list_field(rec, "offsets", cw, n=len(t.shape))
        sizes = int_list_field(rec, "sizes", cw, n=len(t.shape))
        c = ChunkMeta(
            file=files[fi],
            key=chunk_key(name, offsets, list(sizes) == list(t.shape)),
            offsets=offsets,
            sizes=sizes,
            byte_offset=required_field(rec, "byte_offset", int, cw),
            nbytes=math.prod(sizes) * itemsize(t.dtype),
            crc32c=required_field(rec, "crc32c", int, cw),
        )
        file = c.file
        if c.byte_offset < 0 or c.byte_offset + c.nbytes > m.files[file].size:
            raise _bad(cw, f"bytes [{c.byte_offset}, {c.byte_offset + c.nbytes}) lie outside {file!r} of {m.files[file].size} bytes")
        if any(o + n > s for o, n, s in zip(c.offsets, c.sizes, t.shape)):
            raise _bad(cw, f"box {c.offsets}+{c.sizes} lies outside tensor shape {t.shape}")
        if not 0 <= cast(int, c.crc32c) < 2**32:
            raise _bad(cw, f"crc32c {c.crc32c} is not a 32-bit value")
        try:
            c.blocks = unpack_crcs(cast(str, rec.get("blocks")), nblocks(c.nbytes, m.block_bytes))
            if rec.get("hash") is not None:
                c.hash = check_hash_hex(rec["hash"], "hash")
        except ValueError as e:
            raise _bad(cw, str(e)) from None
        if c.key in keys:
            raise _bad(cw, f"chunk key {c.key!r} listed twice")
        keys[c.key] = (name, c)
        by_tensor.setdefault(name, []).append(c)
        claims.append((c.file, c.byte_offset, c.nbytes, f"{name!r} chunk {c.key!r}"))
    return _checked_index(keys, by_tensor, claims, where)


def _checked_index(keys, by_tensor, claims, where: str) -> Dict[str, Any]:
    # A data file is written by one rank, so its index holds every claim on it.
    clashes = _geometry.shared_byte_ranges(claims)
    if clashes:
        listed = "; ".join(f"{k.file} bytes [{k.start}, {k.stop}) claimed by {k.first} and {k.second}" for k in clashes)
        raise _bad(where, f"chunks share file bytes (a damaged or crafted checkpoint): {listed}")
    return {"keys": keys, "tensors": by_tensor}


def _parse_columns(m: Manifest, raw: Dict[str, Any], files: List[str], where: str) -> Dict[str, Any]:
    """A columnar index (format v5, ``_format.table``): the same result and checks as the row form."""
    keys, by_tensor, claims = parse_index_columns(raw, m, files, hashed=supports(m.version, "content_hash"), where=where)
    return _checked_index(keys, by_tensor, claims, where)


# --------------------------------------------------------------------------
# resolution


def _regular_chunks(m: Manifest, storage: Any, name: str, t: TensorMeta, boxes, cache: MetaCache) -> List[ChunkMeta]:
    """Saved chunks of a regular tensor meeting ``boxes`` (all chunks when ``boxes`` is None)."""
    lay = regular_of(t)
    rot = cast(Dict[str, Any], t.regular)["rotation"]
    wanted: Dict[Tuple[int, ...], Tuple[int, _geometry.Box]] = {}
    if any(n == 0 for n in t.shape):
        # One empty chunk, held by all; written by the rotation's replica.
        wanted[(0,) * len(t.shape)] = (0, _geometry.Box((0,) * len(t.shape), tuple(t.shape)))
    elif boxes is None:
        for s, bs in _geometry.layout_chunks(lay):
            for b in bs:
                wanted[b.offsets] = (s, b)
    else:
        for offs, sizes in boxes:
            if not t.shape:  # 0-d: the one chunk
                wanted[()] = (0, _geometry.Box((), ()))
                continue
            for s, b in _geometry.chunks_overlapping(lay, _geometry.Box(tuple(offs), tuple(sizes))):
                wanted[b.offsets] = (s, b)
    out = []
    writers = _writer_memo(m)
    mesh = cast(Dict[str, Any], t.regular)["mesh"]
    shape = tuple(t.shape)
    for offs in sorted(wanted):
        s, box = wanted[offs]
        # The writer of box s depends on the layout, the mesh and (rot + s) % replicas only.
        wkey = (lay, mesh, rot, s)
        rank = writers.get(wkey)
        if rank is None:
            rank = writers[wkey] = mesh_rank(m, t, _geometry.writer_coord(lay, rot, s))
        idx = read_index(m, storage, rank, cache)
        key = chunk_key(name, box.offsets, box.sizes == shape)
        hit = idx["keys"].get(key)
        if hit is None or hit[0] != name or tuple(hit[1].sizes) != tuple(box.sizes) or tuple(hit[1].offsets) != tuple(box.offsets):
            raise CorruptCheckpointError(
                f"{storage.url}: tensor {name!r}: the index of rank {rank} lacks chunk {key!r} "
                f"(box {list(box.offsets)}+{list(box.sizes)}) that its layout record says that rank wrote"
            )
        out.append(hit[1])
    return out


def _writer_memo(m: Manifest) -> Dict[Any, int]:
    """Per manifest: the writer rank of ``(layout, mesh, rotation, shard)`` (50,000 tensors share a few layouts)."""
    got = m.__dict__.get("_writer_memo")
    if got is None:
        got = m.__dict__["_writer_memo"] = {}
    return got


def _explicit_chunks(m: Manifest, storage: Any, name: str, t: TensorMeta, cache: MetaCache) -> List[ChunkMeta]:
    key = ("explicit", name)
    headers = cast(Dict[Any, Any], cache.headers)  # keyed by tuples here
    got = headers.get(key)
    if got is not None:
        return got
    chunks: List[ChunkMeta] = []
    for r in sorted(set(t.writers or [])):
        chunks.extend(read_index(m, storage, r, cache)["tensors"].get(name, []))
    chunks.sort(key=lambda c: c.offsets)
    bad = tiling_problems({name: TensorMeta(t.dtype, t.shape, chunks)})
    if bad:
        raise CorruptCheckpointError(f"{storage.url}: chunks do not tile their tensor: {bad[0]}")
    with cache.lock:
        headers[key] = chunks
    return chunks


def tensor_chunks(m: Manifest, storage: Any, name: str, boxes=None, cache: Optional[MetaCache] = None) -> List[ChunkMeta]:
    """The chunks (with block CRCs for v2) of ``name`` meeting ``boxes`` (None: all of them)."""
    t = m.tensors[name]
    if spec(m.version).chunk_lists or t.chunks:
        if boxes is None:
            return list(t.chunks)
        return [c for c in t.chunks if _meets(c.offsets, c.sizes, boxes)]
    cache = cache if cache is not None else MetaCache()
    if t.regular is not None:
        return _regular_chunks(m, storage, name, t, boxes, cache)
    chunks = _explicit_chunks(m, storage, name, t, cache)
    return chunks if boxes is None else [c for c in chunks if _meets(c.offsets, c.sizes, boxes)]


def materialize(m: Manifest, storage: Any, cache: Optional[MetaCache] = None) -> Manifest:
    """Fill every v2 tensor's ``chunks`` from the index files (for whole-checkpoint tools: verify, inspect, converters).

    Reads every index file once; also checks each index holds nothing the
    layouts do not account for. A v1 manifest is returned as is.
    """
    if spec(m.version).chunk_lists:
        return m
    cache = cache if cache is not None else MetaCache()
    for name in sorted(m.tensors):
        t = m.tensors[name]
        if not t.chunks:
            t.chunks = tensor_chunks(m, storage, name, None, cache)
    expected = {(name, c.key) for name, t in m.tensors.items() for c in t.chunks}
    stray = []
    for rank in sorted(_index_of_rank(m)):
        for key, (name, _) in read_index(m, storage, rank, cache)["keys"].items():
            if (name, key) not in expected:
                stray.append(f"rank {rank}: {key!r}")
    if stray:
        more = f" ... ({len(stray) - _LISTED} more)" if len(stray) > _LISTED else ""
        raise CorruptCheckpointError(f"{storage.url}: index files list chunks no layout accounts for: {', '.join(stray[:_LISTED])}{more}")
    return m


def _meets(offsets: Sequence[int], sizes: Sequence[int], boxes) -> bool:
    for bo, bs in boxes:
        if len(bo) != len(offsets):
            continue
        if not offsets:  # 0-d: the one element
            return True
        if all(min(o + n, p + k) > max(o, p) for o, n, p, k in zip(offsets, sizes, bo, bs)):
            return True
    return False


def resolve(manifest: Any, storage: Any, name: str, boxes, cache: MetaCache) -> List[Chunk]:
    """``resolve_chunks`` for every version: the non-empty chunks of ``name`` meeting ``boxes``, by offsets."""
    boxes = [(tuple(o), tuple(s)) for o, s in boxes]
    block_bytes = manifest.block_bytes if spec(manifest.version).block_checksums else 0
    out = [Chunk.from_meta(name, c, block_bytes) for c in tensor_chunks(manifest, storage, name, boxes, cache) if c.nbytes]
    out.sort(key=lambda c: c.offsets)
    return out


class Reads(NamedTuple):
    """One tensor's resolution: its saved chunks (by offsets) and, per wanted box, the pieces that fill it."""

    chunks: Tuple[Chunk, ...]
    #: ``pieces[j]``: ``_geometry.plan_box_reads`` of the chunks' boxes and
    #: wanted box ``j`` (pieces index ``chunks``).
    pieces: Tuple[Tuple[_geometry.Piece, ...], ...]


class _Group:
    """The tensors of one resolution question (layout, mesh, rotation, wanted boxes): what they share.

    ``hits``: per saved chunk, ``(box, writer rank, key tail, whole)``;
    ``members``: the positions (in ``wants``) of its tensors.
    """

    __slots__ = ("hits", "boxes", "members")

    def __init__(self, hits: List[Tuple[_geometry.Box, int, str, bool]], boxes: Tuple[Any, ...]) -> None:
        self.hits = hits
        self.boxes = boxes
        self.members: List[int] = []


def _pieces(name: str, chunks: Sequence[Any], boxes) -> Tuple[Tuple[_geometry.Piece, ...], ...]:
    """Per wanted box, the pieces of ``chunks`` that fill it (``_geometry.plan_box_reads``).

    Raises:
        CorruptCheckpointError: the chunks leave part of a box uncovered.
    """
    saved = [_geometry.Box(tuple(c.offsets), tuple(c.sizes)) for c in chunks]
    try:
        return tuple(_geometry.plan_box_reads(saved, _geometry.Box(tuple(o), tuple(z))) for o, z in boxes)
    except ValueError as e:
        raise CorruptCheckpointError(f"{name}: the checkpoint's chunks do not cover what this rank holds: {e}") from None


def _lacks(storage: Any, name: str, rank: int, key: str, box: _geometry.Box) -> CorruptCheckpointError:
    return CorruptCheckpointError(
        f"{storage.url}: tensor {name!r}: the index of rank {rank} lacks chunk {key!r} "
        f"(box {list(box.offsets)}+{list(box.sizes)}) that its layout record says that rank wrote"
    )


def resolve_many(manifest: Any, storage: Any, wants: Sequence[Tuple[str, Any]], cache: MetaCache) -> List[List[Chunk]]:
    """:func:`resolve` of many tensors at once (:func:`resolve_reads` without the read pieces)."""
    return cast(List[List[Chunk]], _resolve(manifest, storage, wants, cache, False))


def resolve_reads(manifest: Any, storage: Any, wants: Sequence[Tuple[str, Any]], cache: MetaCache) -> List[Reads]:
    """:func:`resolve` of many tensors at once, with the read pieces of each wanted box (:class:`Reads`)."""
    return cast(List[Reads], _resolve(manifest, storage, wants, cache, True))


@paused_gc
def _resolve(manifest: Any, storage: Any, wants: Sequence[Tuple[str, Any]], cache: MetaCache, pieces: bool) -> List[Any]:
    """Many tensors resolved at once: the geometry, the index lookups and the read pieces per group, not per tensor.

    A 50,000-tensor state has a few dozen distinct (layout, rotation,
    wanted boxes): which saved boxes a wanted box meets, which rank wrote
    each, and the pieces that fill it are computed once per group
    (:class:`_Group`); the group's tensors' chunk keys are then looked up
    in the writer's index in one pass over its columns
    (``ColumnKeys.chunks_for``: the same checks as :func:`resolve`), which
    also builds their ``Chunk`` objects. A tensor of a manifest's tensor
    table is grouped by its row (``TableTensors.row``) without building its
    ``TensorMeta``.
    """
    version_lists = spec(manifest.version).chunk_lists
    writers = _writer_memo(manifest)
    groups: Dict[Any, _Group] = {}
    tensors = manifest.tensors
    table = tensors if not version_lists and isinstance(tensors, TableTensors) else None
    row = table.row if table is not None else None
    # Per table kind: (layout, mesh, shape) when its tensors resolve here (a
    # non-empty shape of at least one dim), else None (``resolve``).
    kinds = [(k.lay, k.regular["mesh"], tuple(k.shape)) if k.shape and 0 not in k.shape else None
             for k in (table.kinds if table is not None else ())]
    out: List[Any] = [None] * len(wants)
    all_names = list(map(operator.itemgetter(0), wants))
    # Every tensor in table order (one list comparison): a member's position
    # is its table row, and its row in an index of the table's tensors in
    # order (``chunks_for``); no lookup per name.
    in_order = table is not None and table.in_table_order(all_names)
    if table is not None and _group_rows(table, kinds, wants, groups, manifest, writers, all_names, in_order):
        wants_left: Sequence[Tuple[str, Any]] = ()
    else:
        wants_left = wants
    # Pass 1: each tensor into its group (or resolved alone: v1 lists, irregular, 0-d, empty).
    for i, (name, boxes) in enumerate(wants_left):
        got = row(name) if row is not None else None
        if got is not None and kinds[got[0]] is not None:
            k, rot = got
            gkey: Any = (k, rot)
        else:
            t = tensors[name]
            if version_lists or t.regular is None or t.chunks or not t.shape or 0 in t.shape:
                chunks = resolve(manifest, storage, name, boxes, cache)
                out[i] = _tuple_new(Reads, (tuple(chunks), _pieces(name, chunks, boxes))) if pieces else chunks
                continue
            k, rot = None, t.regular["rotation"]
            gkey = (regular_of(t), t.regular["mesh"], tuple(t.shape), rot)
        try:
            bkey = tuple(boxes)
            gkey = (gkey, bkey)
            g = groups.get(gkey)
        except TypeError:  # lists inside: the same question as tuples
            bkey = tuple((tuple(o), tuple(z)) for o, z in boxes)
            gkey = (gkey[0], bkey)
            g = groups.get(gkey)
        if g is None:
            lay, mesh, shape = cast(Tuple[Any, int, Tuple[int, ...]], kinds[k] if k is not None else gkey[0][:3])
            g = groups[gkey] = _Group(_hits(manifest, lay, mesh, rot, shape, bkey, writers), bkey)
        g.members.append(i)
    # Pass 2: per group, each saved chunk's rows for all its tensors at once.
    ordered = in_order and not wants_left
    for g in groups.values():
        names = all_names if len(g.members) == len(wants) else list(map(all_names.__getitem__, g.members))
        rows = g.members if ordered else None
        per_hit = [_group_chunks(manifest, storage, cache, names, hit, rows) for hit in g.hits]
        empty = any(None in cs for cs in per_hit)
        if pieces and not empty and per_hit and g.members:
            shared = _pieces(names[0], tuple(cs[0] for cs in per_hit), g.boxes)
            # ``out[i] = Reads(<its chunks, a tuple>, shared)`` for every
            # member, by C-level maps (no list of the tuples in between).
            deque(map(out.__setitem__, g.members, map(_tuple_new, repeat(Reads), zip(zip(*per_hit), repeat(shared)))), maxlen=0)
            continue
        # Per tensor the tuple of its chunks (tuples: no list a tensor, and
        # the collector untracks tuples of plain values).
        lists: List[Any] = list(zip(*per_hit))
        if empty:  # an empty chunk: nothing to read, left out
            lists = [tuple(c for c in cs if c is not None) for cs in lists]
        if not pieces:
            for i, cs in zip(g.members, lists):
                out[i] = list(cs)
            continue
        for i, name, cs in zip(g.members, names, lists):  # empty chunks left out: pieces per tensor
            out[i] = _tuple_new(Reads, (cs, _pieces(name, cs, g.boxes)))
    return out


_tuple_new = tuple.__new__


def _group_rows(table: TableTensors, kinds: List[Any], wants: Sequence[Tuple[str, Any]], groups: Dict[Any, _Group],
                m: Manifest, writers: Dict[Any, int], names: List[str], in_order: bool) -> bool:
    """Pass 1 of :func:`_resolve` over the columns, when every wanted tensor is a table row of a plain kind.

    ``names``: the wanted names; ``in_order``: they are the table's, in its
    order (``TableTensors.in_table_order``): rows by position.

    Fills ``groups`` (keyed as the per-tensor pass keys them) and returns
    True; returns False, with ``groups`` untouched, when any tensor needs
    the per-tensor pass (a built record, an empty or 0-d kind, boxes given
    as lists).
    """
    got = table.columns() if in_order else table.rows(names)
    if got is None:
        return False
    ks, rots = got
    if any(kinds[k] is None for k in set(ks)):
        return False
    boxes = list(map(operator.itemgetter(1), wants))
    n = len(boxes)
    # Group numbers over the columns, keyed by the boxes' object ids (C-level
    # hashes of ints: tensors placed alike share one boxes object when the
    # caller made them with ``_geometry.held_boxes``); by value when most
    # tensors bring their own boxes objects. Parts of equal value merge below.
    # One hash a tensor: each key numbered by the position of its first tensor.
    first: Dict[Any, int] = {}
    gid = list(map(first.setdefault, zip(ks, rots, map(id, boxes)), range(n)))
    if len(first) > max(64, n // 8):
        try:
            first = {}
            gid = list(map(first.setdefault, zip(ks, rots, map(tuple, boxes)), range(n)))
        except TypeError:  # lists inside the boxes
            return False
    if len(first) > 1:
        order = sorted(range(n), key=gid.__getitem__)  # stable: each part in wants order, parts by first tensor
        counts = Counter(gid)
        bounds = list(accumulate(map(counts.__getitem__, first.values()), initial=0))
        parts = [order[bounds[j] : bounds[j + 1]] for j in range(len(first))]
    else:
        parts = [list(range(n))]
    found: Dict[Any, List[int]] = {}
    for (k, rot, _), idx in zip(first, parts):
        try:
            gkey = ((k, rot), tuple(boxes[idx[0]]))
            got_members = found.get(gkey)
        except TypeError:  # lists inside the boxes
            return False
        if got_members is None:
            found[gkey] = idx
        else:
            got_members.extend(idx)
    for gkey, idx in found.items():
        (k, rot), bkey = gkey
        lay, mesh, shape = kinds[k]
        g = groups[gkey] = _Group(_hits(m, lay, mesh, rot, shape, bkey, writers), bkey)
        g.members = idx
    return True


def _group_chunks(m: Manifest, storage: Any, cache: MetaCache, names: List[str], hit: Tuple[_geometry.Box, int, str, bool],
                  rows: Optional[List[int]] = None) -> List[Any]:
    """The ``Chunk`` (None: empty) of saved box ``hit`` of each of ``names``, from its writer's index, checked.

    ``rows``: the names' table rows, when the wanted tensors are the whole
    table in order (``ColumnKeys.chunks_for``'s hint).
    """
    box, rank, tail, whole = hit
    idx = cast(Dict[Any, Any], cache.headers).get(("index", rank))
    if idx is None:
        idx = read_index(m, storage, rank, cache)
    keys = idx["keys"]
    block_bytes = m.block_bytes
    if type(keys) is ColumnKeys:  # a columnar index: every row in one pass over its columns
        got = keys.chunks_for(names, "" if whole else tail, box, block_bytes, rows)
        if type(got) is int:
            name = names[got]
            raise _lacks(storage, name, rank, name if whole else name + tail, box)
        return cast(List[Any], got)
    out: List[Any] = []
    for name in names:
        key = name if whole else name + tail
        row = keys.get(key)
        if row is None or row[0] != name or tuple(row[1].sizes) != box.sizes or tuple(row[1].offsets) != box.offsets:
            raise _lacks(storage, name, rank, key, box)
        out.append(Chunk.from_meta(name, row[1], block_bytes) if row[1].nbytes else None)
    return out


def _hits(m: Manifest, lay: Any, mesh: int, rot: int, shape: Tuple[int, ...], boxes: Tuple[Any, ...],
          writers: Dict[Any, int]) -> List[Tuple[_geometry.Box, int, str, bool]]:
    """A group's saved chunks meeting ``boxes``, by offsets: ``(box, writer rank, key tail, whole)``."""
    wanted: Dict[Tuple[int, ...], Tuple[int, _geometry.Box]] = {}
    for offs, sizes in boxes:
        for sh, b in _geometry.chunks_overlapping(lay, _geometry.Box(tuple(offs), tuple(sizes))):
            wanted[b.offsets] = (sh, b)
    hits = []
    for offs in sorted(wanted):
        sh, box = wanted[offs]
        wkey = (lay, mesh, rot, sh)
        rank = writers.get(wkey)
        if rank is None:
            rank = writers[wkey] = _rank_at(m, lay, mesh, _geometry.writer_coord(lay, rot, sh))
        hits.append((box, rank, chunk_key("", box.offsets, False), box.sizes == shape))
    return hits


# Format v2 and later parse and serialize through this module (``versions.register``).
register([v for v, s in VERSIONS.items() if not s.chunk_lists], parse=manifest_v2_from_raw, to_json=manifest_v2_json)
