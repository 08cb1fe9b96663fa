"""Format v5's compact tables for large states: the manifest's tensor table and columnar index files (torch-free).

A mixture-of-experts state holds ~50,000 tensors per rank, nearly all of a
few layouts (every expert's ``w1`` is placed alike). One JSON object per
tensor in the manifest (~185 bytes) and one row per chunk in an index file
(~85 bytes), each parsed and checked one by one, made a 16,384-rank load of
such a state read 16.5 MB of metadata and plan for ~5 s. Here:

* **tensor table** (manifest): the distinct ``kinds`` (dtype, shape, layout
  record without its rotation) listed once; per tensor, in name order, its
  front-coded name, kind number and rotation. A kind is validated once, a
  tensor costs a few int checks.
* **columnar index** (index ``format_version`` 3): per row (sorted by tensor
  name, then offsets) the front-coded tensor name, file number, box number
  (the distinct boxes listed once), the gap from the end of the previous
  chunk of the same file, and every CRC (the chunk's, then its blocks') in
  one base64 string.

Both are written only for states of at least :data:`TABLE_MIN_ENTRIES`
entries: small checkpoints keep their readable per-tensor records and rows.
Readers accept either form from format v5 on; the checks are the same as the
row forms' (types, ranges, boxes inside the tensor, bytes inside the file,
no byte claimed twice, no duplicate key).

Front coding: names in sorted order, each written as the length of the prefix
it shares with the previous name and the rest (``["layers.0.w1", "layers.0.w2"]``
-> prefix ``[0, 10]``, suffix ``["layers.0.w1", "2"]``).
"""

from __future__ import annotations

import base64
import binascii
import math
import operator
import struct
from itertools import accumulate, repeat
from typing import Any, Dict, Iterator, KeysView, List, Mapping, MutableMapping, NamedTuple, Optional, Sequence, Tuple, cast

from ..errors import CorruptCheckpointError
from .checksum import check_hash_hex
from .chunk import chunk_of, chunks_of
from .dtypes import itemsize
from .manifest import ChunkMeta, TensorMeta

__all__ = ["TABLE_MIN_ENTRIES", "front_code", "front_decode", "pack_u32", "unpack_u32", "kind_key", "tensor_table_json", "index_columns", "parse_index_columns", "ColumnKeys", "ColumnTensors", "int_column",
           "TableKind", "TableTensors"]

_INT, _STR = {int}, {str}

#: Fewest regular tensors (manifest) or chunks (index file) written as a
#: table; below it, the per-tensor objects and per-chunk rows of format v2.
TABLE_MIN_ENTRIES = 1024


def _bad(where: str, what: str) -> CorruptCheckpointError:
    return CorruptCheckpointError(f"{where}: {what}")


def int_column(col: List[Any], lo: int, hi: Optional[int]) -> bool:
    """Whether every entry of ``col`` is an int (not a bool) in ``lo..hi-1`` (``hi`` None: no upper bound).

    A column of untrusted metadata checked in a few C-level passes; callers
    redo a failing column entry by entry to name the bad one.

    >>> int_column([0, 3, 2], 0, 4), int_column([0, True], 0, 4), int_column([-1], 0, None)
    (True, False, False)
    """
    if not col:
        return True
    if not set(map(type, col)) <= _INT:
        return False
    return min(col) >= lo and (hi is None or max(col) < hi)


def front_code(names: Sequence[str]) -> Tuple[List[int], List[str]]:
    """``(prefix lengths, suffixes)`` of ``names`` (sorted, repeats allowed), each against the one before.

    >>> front_code(["layers.0.w1", "layers.0.w2", "layers.0.w2"])
    ([0, 10, 11], ['layers.0.w1', '2', ''])
    """
    prefix: List[int] = []
    suffix: List[str] = []
    prev = ""
    for n in names:
        k = 0
        # Common prefix: compare from the start (names share most of it).
        lim = min(len(prev), len(n))
        if n[:lim] == prev[:lim]:
            k = lim
        else:
            lo, hi = 0, lim  # n[:lo] == prev[:lo], n[:hi] != prev[:hi]
            while hi - lo > 1:
                mid = (lo + hi) // 2
                if n[:mid] == prev[:mid]:
                    lo = mid
                else:
                    hi = mid
            k = lo
        prefix.append(k)
        suffix.append(n[k:])
        prev = n
    return prefix, suffix


def front_decode(prefix: Any, suffix: Any, *, strict: bool, where: str,
                 known: Optional[Tuple[List[Any], List[Any], List[str]]] = None) -> List[str]:
    """Inverse of :func:`front_code`, validating untrusted input.

    Args:
        strict: names must be distinct (the manifest's tensors); an index's
            rows repeat a name per chunk (their keys are checked instead).
        known: ``(prefix, suffix, names)`` decoded before (with ``strict``
            or without): when ``prefix`` and ``suffix`` equal those lists, a
            copy of ``names`` is returned without decoding again (a name
            list that passed ``strict`` passes either check).

    Raises:
        CorruptCheckpointError: not two lists of the same length, a prefix
            that is not an int in ``0..len(previous name)``, a suffix that is
            not a string, or (``strict``) a name twice.
    """
    if not isinstance(prefix, list) or not isinstance(suffix, list) or len(prefix) != len(suffix):
        raise _bad(where, "'prefix' and 'suffix' must be lists of the same length")
    # ``==`` takes True and 1.0 for 1: the types are checked as a decode would.
    if known is not None and known[0] == prefix and known[1] == suffix and int_column(prefix, 0, None):
        return list(known[2])
    out: List[str] = []
    append = out.append
    prev = ""
    if int_column(prefix, 0, None) and set(map(type, suffix)) <= _STR:
        # Types and signs checked over the whole columns: per name, the bound.
        for k, s in zip(prefix, suffix):
            if k > len(prev):
                break
            prev = prev[:k] + s
            append(prev)
    if len(out) < len(prefix):
        for k, s in zip(prefix[len(out):], suffix[len(out):]):
            if type(k) is not int or not 0 <= k <= len(prev) or type(s) is not str:
                raise _bad(where, f"name {len(out)}: prefix {k!r:.20} must be an int in 0..{len(prev)} and suffix a string")
            prev = prev[:k] + s
            append(prev)
    if strict and len(set(out)) != len(out):
        seen: set = set()
        twice = next(n for n in out if n in seen or seen.add(n))  # type: ignore[func-returns-value]
        raise _bad(where, f"name {twice!r:.120} is listed twice")
    return out


def pack_u32(values: Sequence[int]) -> str:
    """``values`` as base64 of little-endian u32 (the columnar index's CRC column)."""
    return base64.b64encode(struct.pack(f"<{len(values)}I", *values)).decode("ascii")


def unpack_u32(text: Any, *, where: str) -> Tuple[int, ...]:
    """Inverse of :func:`pack_u32`.

    Raises:
        CorruptCheckpointError: not a string of strict base64 of a whole number of u32.
    """
    if not isinstance(text, str):
        raise _bad(where, f"must be a base64 string, found {type(text).__name__}")
    try:
        raw = base64.b64decode(text, validate=True)
    except (binascii.Error, ValueError) as e:
        raise _bad(where, f"not base64 ({e})") from None
    if len(raw) % 4:
        raise _bad(where, f"{len(raw)} bytes, not a whole number of u32")
    return struct.unpack(f"<{len(raw) // 4}I", raw)


def kind_key(t: Any) -> Tuple[Any, ...]:
    """What tensors of one kind share: dtype, shape, informational layout, layout record without its rotation."""
    reg = t.regular
    return (t.dtype, tuple(t.shape), repr(t.layout), reg["mesh"], tuple(reg["mesh_shape"]), tuple(reg["placements"]))


def tensor_table_json(tensors: Dict[str, Any]) -> Tuple[Optional[Dict[str, Any]], List[str]]:
    """``(tensor_table or None, names left as per-tensor objects)``: the table holds every regular tensor.

    Deterministic: kinds are numbered in the order their first tensor comes
    by name. None (everything stays per tensor) below :data:`TABLE_MIN_ENTRIES`
    regular tensors.
    """
    names = sorted(tensors)
    regular = [n for n in names if tensors[n].regular is not None]
    if len(regular) < TABLE_MIN_ENTRIES:
        return None, names
    kinds: List[Dict[str, Any]] = []
    ids: Dict[Tuple[Any, ...], int] = {}
    kind_col: List[int] = []
    rot_col: List[int] = []
    for n in regular:
        t = tensors[n]
        key = kind_key(t)
        k = ids.get(key)
        if k is None:
            k = ids[key] = len(kinds)
            reg = t.regular
            kj: Dict[str, Any] = {
                "dtype": t.dtype,
                "shape": list(t.shape),
                "mesh": reg["mesh"],
                "mesh_shape": list(reg["mesh_shape"]),
                "placements": list(reg["placements"]),
            }
            if t.layout is not None:
                kj["layout"] = t.layout
            kinds.append(kj)
        kind_col.append(k)
        rot_col.append(t.regular["rotation"])
    prefix, suffix = front_code(regular)
    table = {"kinds": kinds, "prefix": prefix, "suffix": suffix, "kind": kind_col, "rotation": rot_col}
    taken = set(regular)
    return table, [n for n in names if n not in taken]


def index_columns(chunks: Sequence[Tuple[str, Any]], files: Sequence[str], hashed: bool) -> Dict[str, Any]:
    """The columnar body of an index file (without its header fields), rows sorted by (name, offsets)."""
    fid = {f: i for i, f in enumerate(files)}
    rows = sorted(chunks, key=lambda nc: (nc[0], nc[1].offsets))
    boxes: List[List[List[int]]] = []
    box_ids: Dict[Tuple[Tuple[int, ...], Tuple[int, ...]], int] = {}
    file_col: List[int] = []
    box_col: List[int] = []
    gap_col: List[int] = []
    crcs: List[int] = []
    hashes: List[Optional[str]] = []
    ends = [0] * len(files)
    for _, c in rows:
        f = fid[c.file]
        key = (tuple(c.offsets), tuple(c.sizes))
        b = box_ids.get(key)
        if b is None:
            b = box_ids[key] = len(boxes)
            boxes.append([list(c.offsets), list(c.sizes)])
        file_col.append(f)
        box_col.append(b)
        gap_col.append(c.byte_offset - ends[f])
        ends[f] = c.byte_offset + c.nbytes
        crcs.append(c.crc32c)
        crcs.extend(c.blocks or [])
        hashes.append(c.hash)
    prefix, suffix = front_code([n for n, _ in rows])
    cols: Dict[str, Any] = {"prefix": prefix, "suffix": suffix, "file": file_col, "box": box_col, "gap": gap_col, "crcs": pack_u32(crcs)}
    if hashed:
        cols["hash"] = hashes
    return {"boxes": boxes, "columns": cols}


def parse_index_columns(raw: Dict[str, Any], m: Any, files: List[str], *, hashed: bool, where: str) -> Tuple[Mapping[str, Any], Mapping[str, List[Any]], List[Any]]:
    """A columnar index's chunks, each checked as a row of the row form is.

    Returns ``(keys, by_tensor, claims)``: ``{key: (name, ChunkMeta)}``,
    ``{name: [ChunkMeta]}`` and the ``(file, start, nbytes, label)`` claims
    for the shared-bytes check (the caller's). Every row is checked here, in
    bulk over the columns (:func:`_bulk_rows`); the ``ChunkMeta`` of a row is
    built only when asked for (:class:`ColumnKeys`): a loading rank asks for
    the rows of the tensors it holds, not for its TP peers' other rows. An
    index that fails a bulk check is parsed again row by row
    (:func:`_rows_one_by_one`), which raises the error naming the row.

    Raises:
        CorruptCheckpointError: a column of the wrong type or length, a field
            out of range (file or box number, a box outside its tensor, bytes
            outside the file), CRCs short or left over, a key twice.
    """
    boxes = raw.get("boxes")
    cols = raw.get("columns")
    if isinstance(boxes, list) and isinstance(cols, dict):
        fast = _bulk_rows(boxes, cols, m, files, hashed=hashed)
        if fast is not None:
            return fast
    return _rows_one_by_one(raw, m, files, hashed=hashed, where=where)


def _rows_one_by_one(raw: Dict[str, Any], m: Any, files: List[str], *, hashed: bool, where: str) -> Tuple[Dict[str, Any], Dict[str, List[Any]], List[Any]]:
    """:func:`parse_index_columns` one row at a time: the reference checks, and the errors that name the row."""
    boxes = raw.get("boxes")
    cols = raw.get("columns")
    if not isinstance(boxes, list) or not isinstance(cols, dict):
        raise _bad(where, "a columnar index needs 'boxes' (a list) and 'columns' (an object)")
    names = front_decode(cols.get("prefix"), cols.get("suffix"), strict=False, where=f"{where} columns")
    n = len(names)
    for key in ("file", "box", "gap") + (("hash",) if "hash" in cols else ()):
        if not isinstance(cols.get(key), list) or len(cols[key]) != n:
            raise _bad(where, f"column {key!r} must be a list of {n} entries")
    if not hashed and "hash" in cols:
        raise _bad(where, "column 'hash' in an index of a manifest without content hashes")
    crcs = unpack_u32(cols.get("crcs"), where=f"{where} column 'crcs'")
    checked_boxes: List[Tuple[Tuple[int, ...], Tuple[int, ...], int, str]] = []
    for j, b in enumerate(boxes):
        if (
            not isinstance(b, list) or len(b) != 2 or not all(isinstance(v, list) for v in b) or len(b[0]) != len(b[1])
            or any(type(x) is not int or x < 0 for v in b for x in v)
        ):
            raise _bad(where, f"boxes[{j}] must be [offsets, sizes]: two lists of non-negative ints of one length")
        checked_boxes.append((tuple(b[0]), tuple(b[1]), math.prod(b[1]), "@" + ",".join(str(o) for o in b[0])))
    file_col, box_col, gap_col = cols["file"], cols["box"], cols["gap"]
    hash_col = cols.get("hash")
    nfiles, nboxes = len(files), len(checked_boxes)
    sizes_of = [m.files[f].size for f in files]
    block_bytes = m.block_bytes
    ends = [0] * nfiles
    pos = 0
    ncrc = len(crcs)
    keys: Dict[str, Any] = {}
    by_tensor: Dict[str, List[Any]] = {}
    claims: List[Any] = []
    inside: Dict[Tuple[int, Tuple[int, ...]], bool] = {}  # (box number, shape) -> the box lies inside
    prev_name = None
    shape: Tuple[int, ...] = ()
    isz = 0
    mine: List[Any] = []
    for i in range(n):
        name = names[i]
        if name != prev_name:
            t = m.tensors.get(name)
            if t is None:
                raise _bad(f"{where} chunk {i}", f"tensor {name!r} is not in the manifest")
            isz = itemsize(t.dtype)
            shape = tuple(t.shape)
            mine = by_tensor.setdefault(name, [])
            prev_name = name
        f, b, gap = file_col[i], box_col[i], gap_col[i]
        if type(f) is not int or not 0 <= f < nfiles or type(b) is not int or not 0 <= b < nboxes or type(gap) is not int:
            raise _bad(f"{where} chunk {i}", f"file {f!r:.20} / box {b!r:.20} / gap {gap!r:.20} out of range")
        offsets, sizes, numel, tail = checked_boxes[b]
        ok = inside.get((b, shape))
        if ok is None:
            ok = inside[(b, shape)] = len(offsets) == len(shape) and all(o + k <= s for o, k, s in zip(offsets, sizes, shape))
        if not ok:
            raise _bad(f"{where} chunk {i}", f"box {list(offsets)}+{list(sizes)} lies outside tensor {name!r}'s shape {list(shape)}")
        nbytes = numel * isz
        start = ends[f] + gap
        if start < 0 or start + nbytes > sizes_of[f]:
            raise _bad(f"{where} chunk {i}", f"bytes [{start}, {start + nbytes}) lie outside {files[f]!r} of {sizes_of[f]} bytes")
        ends[f] = start + nbytes
        nb = -(-nbytes // block_bytes) if nbytes else 0
        if pos + 1 + nb > ncrc:
            raise _bad(where, f"column 'crcs' ends at chunk {i} ({ncrc} CRCs)")
        key = name if sizes == shape else name + tail
        c = ChunkMeta(files[f], key, list(offsets), list(sizes), start, nbytes, crcs[pos])
        c.blocks = list(crcs[pos + 1 : pos + 1 + nb])
        pos += 1 + nb
        if hash_col is not None and hash_col[i] is not None:
            try:
                c.hash = check_hash_hex(hash_col[i], "hash")
            except ValueError as e:
                raise _bad(f"{where} chunk {i}", str(e)) from None
        if key in keys:
            raise _bad(f"{where} chunk {i}", f"chunk key {key!r} listed twice")
        keys[key] = (name, c)
        mine.append(c)
        claims.append((c.file, start, nbytes, key))
    if pos != ncrc:
        raise _bad(where, f"column 'crcs' holds {ncrc} CRCs, the chunks need {pos}")
    return keys, by_tensor, claims




def _bulk_rows(boxes: List[Any], cols: Dict[str, Any], m: Any, files: List[str], *, hashed: bool) -> Optional[Tuple["ColumnKeys", "ColumnTensors", List[Any]]]:
    """The checks of :func:`_rows_one_by_one`, over whole columns; None when any fails (or the input is odd).

    Cost per row: a few C-level passes (type sets, min/max, one comprehension
    of byte counts, one running sum per file) instead of ~30 interpreted
    operations and a ``ChunkMeta``. What a row's check needs is the same:
    file and box numbers in range, the box inside its tensor, its bytes inside
    its file, no byte claimed twice, CRCs neither short nor left over, no key
    twice, hashes well formed.
    """
    try:
        names = front_decode(cols.get("prefix"), cols.get("suffix"), strict=False, where="", known=getattr(m.tensors, "coded", None))
    except CorruptCheckpointError:
        return None
    n = len(names)
    for key in ("file", "box", "gap") + (("hash",) if "hash" in cols else ()):
        if not isinstance(cols.get(key), list) or len(cols[key]) != n:
            return None
    file_col: List[Any] = cols["file"]
    box_col: List[Any] = cols["box"]
    gap_col: List[Any] = cols["gap"]
    hash_col: Optional[List[Any]] = cols.get("hash")
    if (not hashed and "hash" in cols) or not isinstance(cols.get("crcs"), str):
        return None
    try:
        crcs = unpack_u32(cols["crcs"], where="")
    except CorruptCheckpointError:
        return None
    geo: List[Tuple[Tuple[int, ...], Tuple[int, ...], int, str]] = []
    for b in boxes:
        if (
            not isinstance(b, list) or len(b) != 2 or not all(isinstance(v, list) for v in b) or len(b[0]) != len(b[1])
            or any(type(x) is not int or x < 0 for v in b for x in v)
        ):
            return None
        geo.append((tuple(b[0]), tuple(b[1]), math.prod(b[1]), "@" + ",".join(str(o) for o in b[0])))
    nfiles = len(files)
    if len(set(files)) != nfiles:  # one file under two numbers: its claims must be compared by name
        return None
    if not (int_column(file_col, 0, nfiles) and int_column(box_col, 0, len(geo)) and int_column(gap_col, -(1 << 62), None)):
        return None
    # Per row its kind: a distinct (dtype, shape), numbered; per kind its
    # shape and item size; per distinct (kind, box): inside, whole. Over the
    # columns (C-level maps) when every name is a row of the manifest's
    # tensor table; else per distinct name.
    # An index whose rows are the manifest table's tensors in table order,
    # one each (an FSDP rank writes a chunk of every tensor): row i is
    # tensor i, and the rows of a load in table order need no lookup.
    table_order = isinstance(m.tensors, TableTensors) and m.tensors.in_table_order(names)
    got = _row_kinds(m.tensors, names)
    if got is None:
        return None
    kidx, kshape, kisz = got
    tails: Dict[Tuple[int, int], str] = {}
    for k, b in set(zip(kidx, box_col)):
        offsets, sizes, _, tail = geo[b]
        shape = kshape[k]
        if len(offsets) != len(shape) or not all(o + z <= s for o, z, s in zip(offsets, sizes, shape)):
            return None
        tails[(k, b)] = "" if sizes == shape else tail
    numel = [g[2] for g in geo]
    nbytes = list(map(operator.mul, map(numel.__getitem__, box_col), map(kisz.__getitem__, kidx)))
    # Bytes: each chunk starts ``gap`` after the end of the file's previous one.
    starts: List[int]
    if nfiles == 1:  # one data file (a save's rank writes one): running sums
        ends_all = list(accumulate(map(operator.add, gap_col, nbytes)))
        starts = list(map(operator.sub, ends_all, nbytes))
        ends = [ends_all[-1] if ends_all else 0]
    else:
        ends = [0] * nfiles
        starts = []
        append = starts.append
        for f, gap, nb in zip(file_col, gap_col, nbytes):
            st = ends[f] + gap
            append(st)
            ends[f] = st + nb
    if starts and min(starts) < 0:
        return None
    sizes_of = [m.files[f].size for f in files]
    if not gap_col or min(gap_col) >= 0:
        # Every chunk starts at or after the end of its file's previous one:
        # no byte claimed twice, and the last chunk of a file ends furthest.
        if any(e > s for e, s in zip(ends, sizes_of)):
            return None
    else:
        # A file's chunks out of name order (a file holds larger items
        # first): by file and start, each non-empty one must start at or
        # after the end of the one before (as ``_geometry.shared_byte_ranges``
        # decides, which the row-by-row parse runs to name a clash).
        prev_f, reach = -1, 0
        for f, st, nb in sorted(zip(file_col, starts, nbytes)):
            if f != prev_f:
                prev_f, reach = f, 0
            if st + nb > sizes_of[f]:
                return None
            if nb:
                if st < reach:
                    return None
                reach = st + nb
    bb = m.block_bytes
    if type(bb) is not int or bb <= 0:
        return None
    # A chunk's CRCs: its own, then one per block (ceil(nbytes / bb)).
    lo_nb, hi_nb = (min(nbytes), max(nbytes)) if nbytes else (0, 0)
    stride = 0
    if -(-lo_nb // bb) == -(-hi_nb // bb):  # every chunk has as many blocks (say, all shards of one block): a stride
        stride = 1 + -(-hi_nb // bb)
        pos = list(range(0, stride * n + 1, stride))
    else:
        pos = list(accumulate(map(operator.sub, repeat(1), map(operator.floordiv, map(operator.neg, nbytes), repeat(bb))), initial=0))
    if pos[-1] != len(crcs):
        return None
    keys: Optional[List[str]] = None
    row_of: Optional[Dict[str, int]] = None
    if not table_order or "@" in "".join(cols["suffix"]):
        keys = list(map(operator.add, names, map(tails.__getitem__, zip(kidx, box_col))))
        row_of = dict(zip(keys, range(n)))
        if len(row_of) != n:
            return None
    # Else no key twice without looking: the names are distinct (the
    # table's) and hold no "@", and a key is its name or name + "@offsets".
    if hash_col is not None:
        try:
            for h in hash_col:
                if h is not None:
                    check_hash_hex(h, "hash")
        except ValueError:
            return None
    cols_ = _Columns(names, keys, file_col, box_col, starts, nbytes, pos, crcs, hash_col, files, geo, (kidx, tails), stride)
    return ColumnKeys(cols_, row_of, table_order), ColumnTensors(cols_), []  # bytes checked above


def _row_kinds(tensors: Any, names: List[str]) -> Optional[Tuple[List[int], List[Tuple[int, ...]], List[int]]]:
    """``(kind number per row, shape per kind, item size per kind)`` of an index's rows; None: a name the manifest lacks.

    Rows of a manifest's tensor table (not built yet) are numbered by their
    table kind over the whole column; any other name by its distinct
    ``(dtype, shape)``, one lookup per distinct name.
    """
    if isinstance(tensors, TableTensors):
        if tensors.in_table_order(names):  # row i is names[i]: the kind column as it is
            kinds = tensors._kinds
            return list(tensors._kind), [tuple(k.shape) for k in kinds], [itemsize(k.dtype) for k in kinds]
        rows: List[Any] = list(map(tensors._items.get, names))
        if set(map(type, rows)) <= _INT:
            kinds = tensors._kinds
            return (list(map(tensors._kind.__getitem__, rows)), [tuple(k.shape) for k in kinds],
                    [itemsize(k.dtype) for k in kinds])
    kind_of: Dict[str, int] = {}
    ids: Dict[Tuple[str, Tuple[int, ...]], int] = {}
    kshape: List[Tuple[int, ...]] = []
    kisz: List[int] = []
    for name in dict.fromkeys(names):
        t = tensors.get(name)
        if t is None:
            return None
        key = (t.dtype, tuple(t.shape))
        k = ids.get(key)
        if k is None:
            k = ids[key] = len(kshape)
            kshape.append(key[1])
            kisz.append(itemsize(t.dtype))
        kind_of[name] = k
    return list(map(kind_of.__getitem__, names)), kshape, kisz


class _Columns:
    """A checked columnar index's rows, and the ``ChunkMeta`` of a row built once, when first asked for."""

    __slots__ = ("names", "_keys", "file", "box", "start", "nbytes", "pos", "crcs", "hash", "files", "geo", "built", "_tails", "stride",
                 "_by_row", "asked")

    def __init__(self, names, keys, file, box, start, nbytes, pos, crcs, hash, files, geo, tails=None, stride=0) -> None:  # noqa: A002
        self.names, self._keys, self.file, self.box, self.start, self.nbytes = names, keys, file, box, start, nbytes
        self.pos, self.crcs, self.hash, self.files, self.geo = pos, crcs, hash, files, geo
        self.built: Dict[int, Tuple[str, ChunkMeta]] = {}
        self._tails = tails  # (kind per row, {(kind, box number): key tail}): the keys, made when first asked for
        #: CRCs a row (its own and its blocks') when every row has as many, else 0.
        self.stride = stride
        self._by_row: Optional[Tuple[Tuple[int, ...], List[Tuple[int, ...]]]] = None
        self.asked = 0  # rows asked for by ``ColumnKeys.chunks_for`` so far

    def by_row(self) -> Tuple[Tuple[int, ...], List[Tuple[int, ...]]]:
        """``(CRC of each row, block CRCs of each row)`` of an index with a :attr:`stride`: one pass, not a slice a row."""
        if self._by_row is None:
            s, crcs = self.stride, self.crcs
            blocks: List[Tuple[int, ...]] = list(zip(*(crcs[j::s] for j in range(1, s)))) if s > 1 else [()] * len(self.names)
            by_row = (tuple(crcs[0::s]), blocks)
            self._by_row = by_row
            return by_row
        return self._by_row

    @property
    def keys(self) -> List[str]:
        """Each row's chunk key (its name, or name + "@offsets" for a part)."""
        if self._keys is None:
            kidx, tails = self._tails
            self._keys = list(map(operator.add, self.names, map(tails.__getitem__, zip(kidx, self.box))))
        return self._keys

    def row(self, i: int) -> Tuple[str, ChunkMeta]:
        got = self.built.get(i)
        if got is None:
            offsets, sizes, _, _ = self.geo[self.box[i]]
            p, q = self.pos[i], self.pos[i + 1]
            c = ChunkMeta(self.files[self.file[i]], self.keys[i], list(offsets), list(sizes), self.start[i], self.nbytes[i], self.crcs[p])
            c.blocks = list(self.crcs[p + 1 : q])
            if self.hash is not None:
                c.hash = self.hash[i]
            got = self.built[i] = (self.names[i], c)
        return got


class ColumnKeys(Mapping[str, Tuple[str, ChunkMeta]]):
    """``{key: (name, ChunkMeta)}`` of a checked columnar index (what the row form's ``keys`` dict holds), built lazily."""

    __slots__ = ("_cols", "_keys_rows", "table_order")

    def __init__(self, cols: _Columns, row_of: Optional[Dict[str, int]], table_order: bool = False) -> None:
        self._cols, self._keys_rows = cols, row_of
        #: Row i is tensor i of the manifest's tensor table, one row each.
        self.table_order = table_order

    @property
    def _row_of(self) -> Dict[str, int]:
        """key -> row, made when first asked for (keys distinct: checked by the parse)."""
        if self._keys_rows is None:
            self._keys_rows = dict(zip(self._cols.keys, range(len(self._cols.names))))
        return self._keys_rows

    def __getitem__(self, key: str) -> Tuple[str, ChunkMeta]:
        return self._cols.row(self._row_of[key])

    def get(self, key: str, default: Any = None) -> Any:
        i = self._row_of.get(key)
        return default if i is None else self._cols.row(i)

    def chunk(self, key: str, name: str, box: Any, block_bytes: int) -> Any:
        """The reader's ``Chunk`` of row ``key`` (``Chunk.from_meta`` of ``self[key]``, without the ``ChunkMeta``).

        False when the index has no such key or its row is not tensor
        ``name``'s chunk at ``box`` (``offsets``, ``sizes``); None for an
        empty chunk (nothing to read).
        """
        i = self._row_of.get(key)
        c = self._cols
        if i is None or c.names[i] != name:
            return False
        offsets, sizes, _, _ = c.geo[c.box[i]]
        if sizes != box.sizes or offsets != box.offsets:
            return False
        nbytes = c.nbytes[i]
        if not nbytes:
            return None
        p, q = c.pos[i], c.pos[i + 1]
        blocks = c.crcs[p + 1 : q] if block_bytes > 0 else ()
        h = c.hash[i] if c.hash is not None else None
        return chunk_of(c.files[c.file[i]], c.start[i], nbytes, offsets, sizes, c.crcs[p], block_bytes if blocks else 0, blocks, name,
                        key, h or "")

    def chunks_for(self, names: List[str], tail: str, box: Any, block_bytes: int, rows: Optional[List[int]] = None) -> Any:
        """:meth:`chunk` of ``name + tail`` for every name of ``names`` at one ``box``, over the columns.

        ``rows``: where the caller expects the names (their positions among
        all the table's tensors, for an index in :attr:`table_order`): then
        no key is looked up, and the rows' names and boxes are checked as a
        lookup's would be.

        Returns the list of ``Chunk`` (None for an empty one), or the
        position in ``names`` of the first name whose row is missing or not
        its chunk at ``box`` (the caller names it in its error).
        """
        c = self._cols
        keys = list(map(operator.add, names, repeat(tail))) if tail else names
        if rows is None or not self.table_order:
            rows = cast(List[int], list(map(self._row_of.get, keys)))  # None where a key is missing: checked next
        at = (box.offsets, box.sizes)
        good = {j for j, g in enumerate(c.geo) if (g[0], g[1]) == at}
        if None in rows or list(map(c.names.__getitem__, rows)) != names or not set(map(c.box.__getitem__, rows)) <= good:
            for j, i in enumerate(rows):
                if i is None or c.names[i] != names[j] or c.box[i] not in good:
                    return j
        nbytes = list(map(c.nbytes.__getitem__, rows))
        if 0 in nbytes:
            return [self.chunk(k, n, box, block_bytes) for k, n in zip(keys, names)]
        c.asked += len(rows)
        # Each row's CRCs by position, no slice a row, once a quarter of the
        # rows are asked for (a peer's index read for a few rows: slices).
        if c.stride and 4 * c.asked >= len(c.names):
            row_crc, row_blocks = c.by_row()
            crc = map(row_crc.__getitem__, rows)
            blocks: Any = map(row_blocks.__getitem__, rows) if block_bytes > 0 else repeat(())
        elif block_bytes > 0:
            p = list(map(c.pos.__getitem__, rows))
            crc = map(c.crcs.__getitem__, p)
            blocks = map(c.crcs.__getitem__, map(slice, map(operator.add, p, repeat(1)), map(c.pos.__getitem__, map(operator.add, rows, repeat(1)))))
        else:
            crc = map(c.crcs.__getitem__, map(c.pos.__getitem__, rows))
            blocks = repeat(())
        hashes: Any = repeat("")
        if c.hash is not None:
            hashes = [h or "" for h in map(c.hash.__getitem__, rows)]
        # One data file (a save's rank writes one): the same name for every row.
        files: Any = repeat(c.files[0]) if len(c.files) == 1 else map(c.files.__getitem__, map(c.file.__getitem__, rows))
        return chunks_of(len(rows), zip(files, map(c.start.__getitem__, rows), nbytes, repeat(box.offsets), repeat(box.sizes), crc,
                                        repeat(block_bytes if block_bytes > 0 else 0), blocks, names, keys, hashes))

    def __contains__(self, key: object) -> bool:
        return key in self._row_of

    def __iter__(self) -> Iterator[str]:
        return iter(self._row_of)

    def __len__(self) -> int:
        return len(self._row_of)


class ColumnTensors(Mapping[str, List[ChunkMeta]]):
    """``{name: [ChunkMeta]}`` of a checked columnar index, rows in index order; the name -> rows map built on first use."""

    __slots__ = ("_cols", "_rows")

    def __init__(self, cols: _Columns) -> None:
        self._cols = cols
        self._rows: Optional[Dict[str, List[int]]] = None

    def _by_name(self) -> Dict[str, List[int]]:
        if self._rows is None:
            rows: Dict[str, List[int]] = {}
            for i, name in enumerate(self._cols.names):
                rows.setdefault(name, []).append(i)
            self._rows = rows
        return self._rows

    def __getitem__(self, name: str) -> List[ChunkMeta]:
        return [self._cols.row(i)[1] for i in self._by_name()[name]]

    def __iter__(self) -> Iterator[str]:
        return iter(self._by_name())

    def __len__(self) -> int:
        return len(self._by_name())


class TableKind(NamedTuple):
    """One checked kind of a tensor table: what its tensors share (their layout record without the rotation)."""

    dtype: str
    shape: List[int]
    layout: Optional[Dict[str, Any]]  # informational, as saved
    regular: Dict[str, Any]  # {"mesh_shape", "placements", "mesh"}
    lay: Any  # its ``_geometry.RegularLayout``


class TableTensors(MutableMapping[str, TensorMeta]):
    """``Manifest.tensors`` of a manifest with a tensor table: a tensor's ``TensorMeta`` is built when first asked for.

    A 50,000-tensor table parses to a name -> row dict and its two int
    columns; each ``TensorMeta`` (five objects) is built on first access,
    then kept (mutations stick, as in a dict). Names, membership and length
    never build anything; :meth:`row` gives a row's kind and rotation
    without building it, which is how ``_v2.resolve_many`` resolves a whole
    state. Every mapping operation works; iterating ``values()`` or
    ``items()`` builds every record (what a dict held from the start).

    Limits: not a ``dict`` (``isinstance(m.tensors, dict)`` is False); the
    per-tensor records given at construction come first in iteration order,
    then the table's in name order, as the parse built the dict.
    """

    __slots__ = ("_items", "_kinds", "_kind", "_rot", "coded", "_pristine")

    def __init__(self, tensors: Mapping[str, TensorMeta], names: Sequence[str], kinds: Sequence[TableKind],
                 kind_col: Sequence[int], rot_col: Sequence[int],
                 coded: Optional[Tuple[Any, Any, List[str]]] = None) -> None:
        # name -> TensorMeta, or the row number (an int) of a record not built yet.
        items: Dict[str, Any] = dict(tensors)
        items.update(zip(names, range(len(names))))
        self._items = items
        self._kinds, self._kind, self._rot = list(kinds), kind_col, rot_col
        #: ``(prefix, suffix, names)``: the table's name columns as read and
        #: what they decode to, so an index whose name columns are the same
        #: lists (an FSDP rank writes a chunk of every tensor, in name order)
        #: is not decoded again (:func:`front_decode`'s ``known``).
        self.coded = coded
        # Every name a row, in table order, none built, set or deleted: the
        # name -> row map is then ``coded``'s names in order (``in_table_order``).
        self._pristine = not tensors and coded is not None and coded[2] is names

    @property
    def kinds(self) -> List[TableKind]:
        """The table's kinds (what :meth:`row`'s kind numbers index)."""
        return self._kinds

    def row(self, name: str) -> Optional[Tuple[int, int]]:
        """``(kind number, rotation)`` of ``name``'s row while its record is not built; None once it is.

        Raises:
            KeyError: ``name`` is not a tensor.
        """
        v = self._items[name]
        if type(v) is not int:
            return None
        return self._kind[v], self._rot[v]

    def in_table_order(self, names: Sequence[str]) -> bool:
        """Whether ``names`` are every tensor, in the table's order, and no record is built, set or deleted yet.

        Then row ``i`` is ``names[i]``: what a rank loading all tensors in
        name order asks for (one list comparison, no lookup per name).
        """
        return self._pristine and len(names) == len(self._kind) and names == cast(Tuple[Any, Any, List[str]], self.coded)[2]

    def columns(self) -> Tuple[List[int], List[int]]:
        """``(kind numbers, rotations)`` of every row, in table order (copies of the checked columns)."""
        return list(self._kind), list(self._rot)

    def rows(self, names: Sequence[str]) -> Optional[Tuple[List[int], List[int]]]:
        """``(kind numbers, rotations)`` of ``names`` over the columns, or None when any record is built already.

        The lists are not to be changed (for names in table order they are
        the columns themselves).

        Raises:
            KeyError: a name is not a tensor.
        """
        if self.in_table_order(names):
            return self.columns()
        got: List[Any] = list(map(self._items.__getitem__, names))
        if not set(map(type, got)) <= _INT:
            return None
        return list(map(self._kind.__getitem__, got)), list(map(self._rot.__getitem__, got))

    def dtype_shape(self, name: str) -> Optional[Tuple[str, Sequence[int]]]:
        """``(dtype, shape)`` of ``name`` without building its record (None: not a tensor); the shape is not to be changed."""
        v = self._items.get(name)
        if v is None:
            return None
        if type(v) is int:
            k = self._kinds[self._kind[v]]
            return k.dtype, k.shape
        return v.dtype, v.shape

    def _build(self, i: int) -> TensorMeta:
        k = self._kinds[self._kind[i]]
        t = TensorMeta(k.dtype, list(k.shape), [], k.layout, {**k.regular, "rotation": self._rot[i]})
        t.__dict__["_regular_layout"] = k.lay
        return t

    def __getitem__(self, name: str) -> TensorMeta:
        v = self._items[name]
        if type(v) is int:
            v = self._items[name] = self._build(v)
            self._pristine = False
        return v

    def __setitem__(self, name: str, t: TensorMeta) -> None:
        self._items[name] = t
        self._pristine = False

    def __delitem__(self, name: str) -> None:
        del self._items[name]
        self._pristine = False

    def __contains__(self, name: object) -> bool:
        return name in self._items

    def __iter__(self) -> Iterator[str]:
        return iter(self._items)

    def __len__(self) -> int:
        return len(self._items)

    def keys(self) -> KeysView[str]:
        return self._items.keys()

    def copy(self) -> "TableTensors":
        """A shallow copy (records built so far shared, as ``dict.copy``)."""
        out = TableTensors({}, (), self._kinds, self._kind, self._rot, self.coded)
        out._items = dict(self._items)
        out._pristine = False
        return out

    def __repr__(self) -> str:
        return f"TableTensors({len(self._items)} tensors)"
