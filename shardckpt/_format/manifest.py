"""The manifest (``manifest.json``): build, serialize, parse and validate.

``docs/format.md`` is the spec; this module is its implementation. Bytes read
from storage are untrusted: everything parsed here is bounded and checked
before the rest of the library sees it.
"""

from __future__ import annotations

import json
import math
import posixpath
import re
from dataclasses import dataclass, field
from typing import Any, Dict, List, Optional, Tuple, cast

from .._geometry import Box, check_cover, shared_byte_ranges
from .._version import __version__
from ..errors import CorruptCheckpointError, NewerFormatError, UnsafeMetadataError
from .checksum import crc32c, default_hash_algo
from .dtypes import DTYPES, checked_shape, itemsize
from .naming import MANIFEST_NAME
from .values import value_depth_problem
from .versions import NEWEST, VERSIONS, is_newer, parse_raw, register, spec, to_json

__all__ = [
    "IndexMeta",
    "V1",
    "canonical_json",
    "manifest_json_v2",
    "check_shared_bytes",
    "FORMAT_NAME",
    "FORMAT_VERSION",
    "MAX_MANIFEST_BYTES",
    "MAX_NDIM",
    "ChunkMeta",
    "TensorMeta",
    "BlockScale",
    "FileMeta",
    "Manifest",
    "manifest_to_bytes",
    "manifest_from_bytes",
    "check_relpath",
    "tiling_problems",
    "required_field",
    "int_list_field",
    "paused_gc",
    "written_crc_matches",
]

FORMAT_NAME = "shardckpt"
#: The newest version this library reads and writes (``save`` and the
#: converters write it): the last entry of ``versions.VERSIONS``, where each
#: version's features and parser are. A ``Manifest`` built without
#: ``version=`` is v1, whose bytes ``tests/data/manifest_golden.json`` pins.
FORMAT_VERSION = NEWEST
V1 = 1
#: Top-level field of a v2 manifest holding the CRC-32C of its own canonical
#: bytes without that field.
MANIFEST_CRC_FIELD = "manifest_crc32c"

#: Upper bounds on metadata read from storage (a hostile file cannot make us
#: allocate more than this before we have validated it).
MAX_MANIFEST_BYTES = 1 << 30
MAX_NDIM = 64
#: Tensor names a ``Manifest`` repr shows before "... (N more)".
REPR_TENSORS = 5


def plural(n: int, word: str) -> str:
    """``"1 file"``, ``"2 files"``."""
    return f"{n} {word}" if n == 1 else f"{n} {word}s"


@dataclass
class ChunkMeta:
    """One stored box of a tensor: where its bytes are and their checksum."""

    file: str
    key: str
    offsets: List[int]
    sizes: List[int]
    byte_offset: int  # absolute, from the start of the file
    nbytes: int
    # None only for chunks synthesized from foreign files without checksums
    # (Hugging Face safetensors, see _hf); manifest.json always has one.
    crc32c: Optional[int]
    # v2: CRC-32C of each ``Manifest.block_bytes`` slice of the chunk (from the
    # writer's index file); None for v1 chunks. Never in a v1 manifest's bytes.
    blocks: Optional[List[int]] = field(default=None, compare=False, repr=False)
    # v4: content hash of the chunk's bytes (hex, algorithm
    # ``Manifest.content_hash``), from the writer's index file; what
    # incremental saves compare chunks by. None before v4.
    hash: Optional[str] = field(default=None, compare=False, repr=False)

    def to_json(self) -> Dict[str, Any]:
        return {
            "file": self.file,
            "key": self.key,
            "offsets": list(self.offsets),
            "sizes": list(self.sizes),
            "byte_offset": self.byte_offset,
            "nbytes": self.nbytes,
            "crc32c": self.crc32c,
        }


@dataclass
class TensorMeta:
    """A global tensor: dtype, shape, optional saved layout, and its chunks."""

    dtype: str
    shape: List[int]
    chunks: List[ChunkMeta] = field(default_factory=list)
    layout: Optional[Dict[str, Any]] = None  # informational: how it was sharded
    # v2 only. ``regular``: {"mesh_shape", "placements", "mesh", "rotation"}:
    # chunks derive from it and live in the writers' index files. Otherwise
    # ``writers``: the ranks whose index files hold the tensor's chunks.
    regular: Optional[Dict[str, Any]] = None
    writers: Optional[List[int]] = None
    # Hugging Face block-FP8 sources only, in memory (never serialized): the
    # ``<name>_scale_inv`` tensor a load multiplies this FP8 weight by
    # (``hf.with_block_scales``).
    scale: Optional["BlockScale"] = field(default=None, compare=False, repr=False)

    @property
    def nbytes(self) -> int:
        return math.prod(self.shape) * itemsize(self.dtype)

    def to_json(self) -> Dict[str, Any]:
        out: Dict[str, Any] = {
            "dtype": self.dtype,
            "shape": list(self.shape),
            "chunks": [c.to_json() for c in sorted(self.chunks, key=lambda c: c.offsets)],
        }
        if self.layout is not None:
            out["layout"] = self.layout
        return out


@dataclass(frozen=True)
class BlockScale:
    """The block scales of a block-quantized FP8 weight (DeepSeek-V3's layout).

    ``meta``: the stored scale tensor ``name`` (one float per ``block`` =
    (rows, cols) block of the weight, edge blocks smaller: its shape is the
    ceil division of the weight's). A load dequantizes as
    ``weight.float() * scale[i // rows, j // cols]``.
    """

    name: str
    meta: TensorMeta
    block: Tuple[int, int]


@dataclass(slots=True)
class FileMeta:
    size: int

    def to_json(self) -> Dict[str, Any]:
        return {"size": self.size}


@dataclass(slots=True)
class IndexMeta:
    """v2: a writing rank's index file (its chunks and their block checksums), checksummed here."""

    rank: int
    size: int
    crc32c: int

    def to_json(self) -> Dict[str, Any]:
        return {"rank": self.rank, "size": self.size, "crc32c": self.crc32c}


@dataclass(repr=False)
class Manifest:
    """Everything ``manifest.json`` holds. Its presence is the commit."""

    world_size: int
    tensors: Dict[str, TensorMeta]
    files: Dict[str, FileMeta]
    values: Any = None
    save_id: str = ""
    library_version: str = ""
    extra: Dict[str, Any] = field(default_factory=dict)
    version: int = V1
    # v2 only: block size of the block checksums; rank lists of the meshes
    # regular layouts refer to ("iota": ranks 0..n-1); the index files.
    block_bytes: int = 0
    meshes: List[Any] = field(default_factory=list)
    indexes: Dict[str, IndexMeta] = field(default_factory=dict)
    # v4: the content hash algorithm of every chunk (``checksum.HASH_ALGOS``);
    # a writer's manifest gets the one ``_io.write_files`` hashes with.
    content_hash: str = field(default_factory=lambda: _default_hash_algo())

    @property
    def total_bytes(self) -> int:
        return sum(t.nbytes for t in self.tensors.values())

    @property
    def data_files(self) -> Dict[str, FileMeta]:
        """The safetensors data files (``files`` less the v2 index files)."""
        return {rel: f for rel, f in self.files.items() if rel not in self.indexes}

    @property
    def source(self) -> str:
        """``"shardckpt"``, or where a synthesized manifest came from (``"safetensors"``)."""
        src = self.extra.get("source") if isinstance(self.extra, dict) else None
        return src if isinstance(src, str) else FORMAT_NAME

    def __repr__(self) -> str:
        # A few lines whatever the size: the full metadata is in .tensors / .to_json().
        names = sorted(self.tensors)
        shown = ", ".join(names[:REPR_TENSORS]) + (f", ... ({len(names) - REPR_TENSORS} more)" if len(names) > REPR_TENSORS else "")
        chunks = sum(len(t.chunks) for t in self.tensors.values())
        saved = "safetensors files" if self.source != FORMAT_NAME else f"world_size={self.world_size}"
        return (
            f"Manifest({saved}, {plural(len(self.tensors), 'tensor')}, {plural(chunks, 'chunk')}, "
            f"{plural(len(self.data_files), 'file')}, total_bytes={self.total_bytes}, tensors=[{shown}])"
        )

    def to_json(self) -> Dict[str, Any]:
        """The manifest's JSON object, as its version lays it out (``versions.spec``)."""
        return to_json(self)


def _default_hash_algo() -> str:
    return default_hash_algo()


def manifest_v1_json(m: Manifest) -> Dict[str, Any]:
    """Format v1's JSON object: every chunk listed."""
    return {
        "format": FORMAT_NAME,
        "format_version": m.version,
        "library_version": m.library_version,
        "save_id": m.save_id,
        "world_size": m.world_size,
        "checksum": "crc32c",
        "tensors": {k: m.tensors[k].to_json() for k in sorted(m.tensors)},
        "files": {k: m.files[k].to_json() for k in sorted(m.files)},
        "values": m.values,
        "extra": m.extra,
    }


def paused_gc(fn: Any) -> Any:
    """``fn`` run with the cyclic garbage collector paused (re-enabled after, if it was on).

    Parsing a large manifest or index allocates ~10 containers per tensor,
    none of them cyclic garbage; the collector's passes over a big live heap
    (a loaded model, the parsed metadata) took ~40% of a 50,000-tensor parse.
    """
    import functools
    import gc

    @functools.wraps(fn)
    def run(*args: Any, **kwargs: Any) -> Any:
        was = gc.isenabled()
        gc.disable()
        try:
            return fn(*args, **kwargs)
        finally:
            if was:
                gc.enable()

    return run


def canonical_json(obj: Any) -> bytes:
    """The one canonical JSON encoding of metadata: sorted keys, compact, trailing newline, no NaN."""
    return (json.dumps(obj, sort_keys=True, separators=(",", ":"), allow_nan=False) + "\n").encode()


#: v2 fields holding the user's values: their objects keep the saved order
#: (a user dict's insertion order), every other object's keys are sorted.
ORDERED_FIELDS = ("values", "extra")


def manifest_json_v2(body: Dict[str, Any]) -> bytes:
    """The v2 manifest encoding of ``body``: canonical, except that ``values``/``extra`` keep their key order.

    Plain dicts of a saved state come back in the order they were built
    (``{"b": 1, "a": 2}`` stays ``["b", "a"]``), so those two fields are
    written as given; everything else is sorted as :func:`canonical_json`
    does. Deterministic: the same state (same insertion orders) gives the
    same bytes. A reader re-encodes the parsed object (``json`` keeps the
    file's key order) to check ``manifest_crc32c``; a v2 manifest written
    fully sorted (before this rule) re-encodes to its own bytes too.

    Raises:
        ValueError: NaN/Infinity or an overflowing number (not JSON).
        TypeError: a value JSON cannot hold.

    Example:
        >>> manifest_json_v2({"z": 1, "values": {"b": 1, "a": {"y": 0, "x": 0}}})
        b'{"values":{"b":1,"a":{"y":0,"x":0}},"z":1}\n'
    """
    # Field by field, each with the C encoder (sort_keys where sorted): the
    # same bytes as one dumps of the re-sorted tree, without rebuilding it
    # in Python (a 16,384-rank manifest's file table is 50k small lists).
    parts = [
        json.dumps(k) + ":" + json.dumps(body[k], sort_keys=k not in ORDERED_FIELDS, separators=(",", ":"), allow_nan=False)
        for k in sorted(body)
    ]
    return ("{" + ",".join(parts) + "}\n").encode()


@paused_gc
def manifest_to_bytes(m: Manifest) -> bytes:
    """The manifest's bytes: compact separators, trailing newline, no NaN.

    v1: canonical JSON (every key sorted; ``tests/data`` pins these bytes).
    From v2 on, keys are sorted except inside ``values`` and ``extra``, which
    keep the saved order (:func:`manifest_json_v2`), and the manifest carries
    ``manifest_crc32c``: the CRC-32C of these bytes without that field, so any
    change to them (key order in ``values`` included) is detected on open.
    """
    body = m.to_json()
    if not spec(m.version).manifest_crc:
        return canonical_json(body)
    body[MANIFEST_CRC_FIELD] = crc32c(manifest_json_v2(body))
    return manifest_json_v2(body)


# --------------------------------------------------------------------------
# validation of untrusted metadata


_SCHEME = re.compile(r"^[A-Za-z][A-Za-z0-9+.-]*:")


def check_relpath(path: Any, *, where: str) -> str:
    """Accept only a plain relative POSIX path inside the checkpoint."""
    if not isinstance(path, str) or not path:
        raise UnsafeMetadataError(f"{where}: file path must be a non-empty string, found {path!r}")
    if (
        path.startswith(("/", "\\"))
        or "\\" in path
        or "\x00" in path
        or _SCHEME.match(path)
        or any(part in ("", ".", "..") for part in path.split("/"))
        or posixpath.normpath(path) != path
    ):
        raise UnsafeMetadataError(
            f"{where}: file path {path!r} is not a plain relative path inside the checkpoint "
            "(no '..', no leading '/', no URL scheme, no backslashes)"
        )
    return path


def required_field(obj: Dict[str, Any], key: str, typ: Any, where: str) -> Any:
    """``obj[key]``, checked to be a ``typ`` (an int is never a bool); the parsers of every JSON the format reads use it.

    Raises:
        CorruptCheckpointError: ``obj`` is no dict, lacks ``key``, or holds another type there (``where`` names the place).
    """
    if not isinstance(obj, dict) or key not in obj:
        raise CorruptCheckpointError(f"{where}: missing field {key!r}")
    val = obj[key]
    if typ is int:
        ok = isinstance(val, int) and not isinstance(val, bool)
    else:
        ok = isinstance(val, typ)
    if not ok:
        name = getattr(typ, "__name__", str(typ))
        raise CorruptCheckpointError(f"{where}: field {key!r} must be {name}, found {type(val).__name__} {val!r:.80}")
    return val


def int_list_field(obj, key, where, *, n=None) -> List[int]:
    """``obj[key]`` as a list of at most ``MAX_NDIM`` non-negative ints (exactly ``n`` of them if given).

    Raises:
        CorruptCheckpointError: missing, not such a list, or of another length (``where`` names the place).
    """
    val = required_field(obj, key, list, where)
    if len(val) > MAX_NDIM or any(not isinstance(v, int) or isinstance(v, bool) or v < 0 for v in val):
        raise CorruptCheckpointError(f"{where}: field {key!r} must be a list of non-negative ints, found {val!r:.120}")
    if n is not None and len(val) != n:
        raise CorruptCheckpointError(f"{where}: field {key!r} has {len(val)} entries, expected {n}")
    return val


def tiling_problems(tensors: Dict[str, TensorMeta]) -> List[str]:
    """Why the chunks of each tensor fail to tile it exactly (sorted; empty when all do)."""
    bad = []
    for name, t in tensors.items():
        why = check_cover(t.shape, [Box(tuple(c.offsets), tuple(c.sizes)) for c in t.chunks])
        if why:
            bad.append(f"{name!r}: {why}")
    return sorted(bad)


def check_shared_bytes(tensors: Dict[str, TensorMeta], where: str) -> None:
    """Refuse chunks that claim the same file bytes (O(n log n) for n chunks).

    Raises:
        CorruptCheckpointError: naming the clashing chunks (first
            ``DEFAULT_OFFENDER_LIMIT``).
    """
    clashes = shared_byte_ranges(
        (c.file, c.byte_offset, c.nbytes, f"{name!r} chunk {c.key!r}") for name, t in tensors.items() for c in t.chunks
    )
    if clashes:
        listed = "; ".join(f"{k.file} bytes [{k.start}, {k.stop}) claimed by {k.first} and {k.second}" for k in clashes)
        raise CorruptCheckpointError(f"{where}: chunks share file bytes (a damaged or crafted checkpoint): {listed}")


@paused_gc
def manifest_from_bytes(data: bytes, *, url: str = "") -> Manifest:
    """Parse and validate ``manifest.json``; raise on anything unsafe or inconsistent."""
    where = f"{url.rstrip('/')}/{MANIFEST_NAME}" if url else MANIFEST_NAME
    if len(data) > MAX_MANIFEST_BYTES:
        raise UnsafeMetadataError(f"{where}: {len(data)} bytes exceeds the {MAX_MANIFEST_BYTES}-byte limit")
    finite = [True]  # no NaN, Infinity or overflowing number: what canonical JSON can hold
    try:
        raw = json.loads(data.decode("utf-8"), parse_float=_float_seen(finite), parse_constant=_constant_seen(finite))
    except (UnicodeDecodeError, ValueError, RecursionError) as e:  # RecursionError: absurdly deep nesting
        raise CorruptCheckpointError(f"{where}: not valid JSON ({e})") from None
    deep = value_depth_problem(raw.get("values")) if isinstance(raw, dict) else None
    if deep:  # every walker of the tree recurses: refuse before any does
        raise CorruptCheckpointError(f"{where}: {deep}")
    if not isinstance(raw, dict) or raw.get("format") != FORMAT_NAME:
        raise CorruptCheckpointError(f"{where}: not a shardckpt manifest (format={raw.get('format') if isinstance(raw, dict) else None!r})")
    version = required_field(raw, "format_version", int, where)
    if is_newer(version):
        raise NewerFormatError(
            f"{where}: format_version {version} was written by a newer shardckpt "
            f"({str(raw.get('library_version', '?'))[:40]}); this one ({__version__}) reads versions 1..{FORMAT_VERSION}: "
            "upgrade shardckpt"
        )
    if version not in VERSIONS:
        raise CorruptCheckpointError(
            f"{where}: format_version {version} is not supported by this shardckpt "
            f"(reads versions 1..{FORMAT_VERSION}); upgrade shardckpt"
        )
    # The bytes themselves, when they may be the writer's canonical encoding:
    # the manifest's checksum is then checked over them (``written_crc_matches``)
    # instead of over a re-encoding of the parsed object.
    return parse_raw(raw, version, where, canonical=data if finite[0] and spec(version).manifest_crc else None)


def _float_seen(finite: List[bool]) -> Any:
    """``json.loads``' ``parse_float``: ``float``, noting in ``finite`` a literal that overflows (``1e999``)."""
    def parse(text: str) -> float:
        v = float(text)
        if not math.isfinite(v):
            finite[0] = False
        return v
    return parse


def _constant_seen(finite: List[bool]) -> Any:
    """``json.loads``' ``parse_constant`` (``NaN``, ``Infinity``, ``-Infinity``, parsed as by default), noted in ``finite``."""
    def parse(text: str) -> float:
        finite[0] = False
        return float(text)
    return parse


def written_crc_matches(data: Optional[bytes], want: Any) -> bool:
    """Whether ``data`` (a manifest's bytes) less its ``manifest_crc32c`` field has the CRC-32C ``want``.

    A writer's bytes are ``manifest_json_v2`` of the manifest with that field
    in its sorted place (never first: ``block_bytes`` sorts before it), so
    cutting ``,"manifest_crc32c":<want>`` out gives the bytes it checksummed:
    the same check as re-encoding the parsed object, without the re-encoding
    (~40 ms for a 50,000-tensor manifest). False (the caller re-encodes and
    compares, naming any mismatch) for bytes that are not canonical (written
    by hand, pretty-printed), that hold the field's text elsewhere first, or
    that are damaged.

        >>> body = manifest_json_v2({"a": 1, "z": [2]})
        >>> data = manifest_json_v2({"a": 1, MANIFEST_CRC_FIELD: crc32c(body), "z": [2]})
        >>> written_crc_matches(data, crc32c(body)), written_crc_matches(data, crc32c(body) ^ 1)
        (True, False)
    """
    if data is None or type(want) is not int:
        return False
    cut = data.replace(b',"%s":%d' % (MANIFEST_CRC_FIELD.encode(), want), b"", 1)
    return len(cut) < len(data) and crc32c(cut) == want


def manifest_v1_from_raw(raw: Dict[str, Any], where: str) -> Manifest:
    """Format v1: the manifest's JSON object (format and version checked) into a validated ``Manifest``."""
    version = raw["format_version"]
    if MANIFEST_CRC_FIELD in raw:
        raise CorruptCheckpointError(f"{where}: a format_version 1 manifest carries {MANIFEST_CRC_FIELD!r}: damaged")
    world_size = required_field(raw, "world_size", int, where)
    if world_size < 1:
        raise CorruptCheckpointError(f"{where}: world_size must be >= 1, found {world_size}")
    files: Dict[str, FileMeta] = {}
    for path, fm in required_field(raw, "files", dict, where).items():
        check_relpath(path, where=f"{where}: files")
        size = required_field(fm, "size", int, f"{where}: files[{path!r}]")
        if size < 0:
            raise CorruptCheckpointError(f"{where}: files[{path!r}].size is negative")
        files[path] = FileMeta(size)
    tensors: Dict[str, TensorMeta] = {}
    for name, tm in required_field(raw, "tensors", dict, where).items():
        tw = f"{where}: tensor {name!r}"
        dt = required_field(tm, "dtype", str, tw)
        if dt not in DTYPES:
            raise CorruptCheckpointError(f"{tw}: unknown dtype {dt!r}")
        shape = checked_shape(int_list_field(tm, "shape", tw), itemsize(dt), where=tw)
        chunks = []
        for i, cm in enumerate(required_field(tm, "chunks", list, tw)):
            cw = f"{tw} chunk {i}"
            file = check_relpath(required_field(cm, "file", str, cw), where=cw)
            if file not in files:
                raise CorruptCheckpointError(f"{cw}: file {file!r} is not listed in 'files'")
            c = ChunkMeta(
                file=file,
                key=required_field(cm, "key", str, cw),
                offsets=int_list_field(cm, "offsets", cw, n=len(shape)),
                sizes=int_list_field(cm, "sizes", cw, n=len(shape)),
                byte_offset=required_field(cm, "byte_offset", int, cw),
                nbytes=required_field(cm, "nbytes", int, cw),
                crc32c=required_field(cm, "crc32c", int, cw),
            )
            if c.nbytes != math.prod(c.sizes) * itemsize(dt):
                raise CorruptCheckpointError(
                    f"{cw}: nbytes {c.nbytes} does not match sizes {c.sizes} x {itemsize(dt)} bytes ({dt})"
                )
            if c.byte_offset < 0 or c.byte_offset + c.nbytes > files[file].size:
                raise CorruptCheckpointError(
                    f"{cw}: bytes [{c.byte_offset}, {c.byte_offset + c.nbytes}) lie outside "
                    f"{file!r} of {files[file].size} bytes"
                )
            if not 0 <= cast(int, c.crc32c) < 2**32:
                raise CorruptCheckpointError(f"{cw}: crc32c {c.crc32c} is not a 32-bit value")
            chunks.append(c)
        layout = tm.get("layout")
        tensors[name] = TensorMeta(dtype=dt, shape=shape, chunks=chunks, layout=layout if isinstance(layout, dict) else None)
    bad = tiling_problems(tensors)
    if bad:
        raise CorruptCheckpointError(f"{where}: chunks do not tile their tensors: " + "; ".join(sorted(bad)[:20]))
    check_shared_bytes(tensors, where)
    extra = raw.get("extra") or {}
    return Manifest(
        world_size=world_size,
        tensors=tensors,
        files=files,
        values=raw.get("values"),
        save_id=str(raw.get("save_id", "")),
        library_version=str(raw.get("library_version", "")),
        extra=extra if isinstance(extra, dict) else {},
        version=version,
        content_hash="",
    )


# Format v1 parses and serializes through this module (``versions.register``;
# v2 and later: ``_v2``).
register([v for v, s in VERSIONS.items() if s.chunk_lists], parse=manifest_v1_from_raw, to_json=manifest_v1_json)
