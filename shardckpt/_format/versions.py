"""Format versions: what each one holds, and the one place that dispatches on them (torch-free).

Readers and writers ask :func:`spec` what a manifest's version has
(``spec(m.version).block_checksums``) and parse or serialize it through the
entry's functions, or ask a capability by name (:func:`supports`:
``supports(m.version, "content_hash")``), the first version having one
(:func:`first_with`), or whether a version is past what this library knows
(:func:`is_newer`). No code outside this table compares version numbers
(``benchmarks/house_counts.py`` counts them: 0); a new feature is a field of
:class:`VersionSpec`. Adding a version
is one entry in :data:`VERSIONS` (and its parser and serializer, which the
implementing module installs with :func:`register`: the table imports none of
them, they import it); the newest entry is what ``save`` and the converters
write.

=======  ============================================================
version  what it adds
=======  ============================================================
1        chunk lists in the manifest, one CRC-32C per chunk
2        checksummed manifest; per-rank index files with block CRCs;
         chunks derived from layout records
3        the per-rank files in a compact table (``file_table``)
4        a content hash per chunk; references to sibling checkpoints
5        large states in compact tables: the regular tensors' records
         (``tensor_table``) and index files of many chunks (columns)
=======  ============================================================
"""

from __future__ import annotations

from dataclasses import dataclass, replace
from typing import Any, Callable, Dict, Iterable, Optional

__all__ = ["VersionSpec", "VERSIONS", "NEWEST", "spec", "supports", "first_with", "is_newer", "register", "parse_raw", "to_json"]


def _unregistered(*args: Any) -> Any:
    raise RuntimeError("no parser/serializer registered for this format version (import shardckpt._format)")


@dataclass(frozen=True)
class VersionSpec:
    """What a format version's manifest and files hold.

    Attributes:
        number: ``format_version``.
        chunk_lists: the manifest lists every chunk (else index files do).
        block_checksums: chunks carry block CRCs of ``block_bytes`` (index
            files).
        manifest_crc: the manifest carries the CRC-32C of its own bytes.
        file_table: the per-rank data and index files are a compact table.
        content_hash: chunks carry a content hash (index rows' ``hash``), and
            files may be references to sibling checkpoints (``_format.refs``).
        tensor_table: the manifest may hold its regular tensors' records in
            a compact ``tensor_table`` and index files may be columnar
            (index ``format_version`` 3; ``_format.table``).
        parse: ``(raw JSON object, where) -> Manifest``, validating.
        to_json: ``Manifest -> JSON object`` (before canonical encoding).
    """

    number: int
    chunk_lists: bool
    block_checksums: bool
    manifest_crc: bool
    file_table: bool
    content_hash: bool
    tensor_table: bool = False
    parse: Callable[..., Any] = _unregistered  # (raw, where, *, canonical=None) for versions with a manifest checksum
    to_json: Callable[[Any], Dict[str, Any]] = _unregistered


def register(numbers: Iterable[int], *, parse: Callable[..., Any], to_json: Callable[[Any], Dict[str, Any]]) -> None:
    """Install the parser and serializer of versions ``numbers`` (called by the module that implements them).

    The table sits below its parsers: ``manifest`` (v1) and ``_v2`` (v2 and
    later) ask it for features at import time, then register their functions
    here. ``shardckpt._format``'s package import loads both, so every entry
    has its functions before anything parses or serializes.
    """
    for n in numbers:
        VERSIONS[n] = replace(VERSIONS[n], parse=parse, to_json=to_json)


#: Every version this library reads, by number; the last one is written.
VERSIONS: Dict[int, VersionSpec] = {
    1: VersionSpec(1, chunk_lists=True, block_checksums=False, manifest_crc=False, file_table=False, content_hash=False),
    2: VersionSpec(2, chunk_lists=False, block_checksums=True, manifest_crc=True, file_table=False, content_hash=False),
    3: VersionSpec(3, chunk_lists=False, block_checksums=True, manifest_crc=True, file_table=True, content_hash=False),
    4: VersionSpec(4, chunk_lists=False, block_checksums=True, manifest_crc=True, file_table=True, content_hash=True),
    5: VersionSpec(5, chunk_lists=False, block_checksums=True, manifest_crc=True, file_table=True, content_hash=True, tensor_table=True),
}
#: The version ``save`` and the converters write.
NEWEST = max(VERSIONS)
#: The capabilities :func:`supports` answers: the boolean fields of :class:`VersionSpec`.
_FEATURES = frozenset(("chunk_lists", "block_checksums", "manifest_crc", "file_table", "content_hash", "tensor_table"))


def spec(version: int) -> VersionSpec:
    """The entry of ``version`` (a version of a ``Manifest`` already built or parsed).

    Raises:
        ValueError: a version this library does not know (parsing refuses
            those first, with ``NewerFormatError`` or ``CorruptCheckpointError``).

        >>> spec(1).block_checksums, spec(3).file_table
        (False, True)
    """
    try:
        return VERSIONS[version]
    except KeyError:
        raise ValueError(f"format_version {version} is not one this shardckpt knows ({sorted(VERSIONS)})") from None


def supports(version: int, feature: str) -> bool:
    """Whether format ``version`` has ``feature``, a capability field of :class:`VersionSpec` (``"content_hash"``...).

    Raises:
        ValueError: an unknown version (as :func:`spec`), or ``feature`` is
            not a capability of the table (a typo must not read as False).

        >>> supports(3, "file_table"), supports(3, "content_hash"), supports(5, "tensor_table")
        (True, False, True)
    """
    if feature not in _FEATURES:
        raise ValueError(f"{feature!r} is not a format capability ({', '.join(sorted(_FEATURES))})")
    return bool(getattr(spec(version), feature))


def first_with(feature: str) -> int:
    """The first version having ``feature`` (error messages: "new in version N").

        >>> first_with("content_hash"), first_with("tensor_table")
        (4, 5)
    """
    return min(n for n in VERSIONS if supports(n, feature))


def is_newer(version: int) -> bool:
    """Whether ``version`` was written by a newer shardckpt (past :data:`NEWEST`): the reader says "upgrade".

        >>> is_newer(NEWEST), is_newer(NEWEST + 1)
        (False, True)
    """
    return version > NEWEST


def parse_raw(raw: Dict[str, Any], version: int, where: str, *, canonical: Optional[bytes] = None) -> Any:
    """Parse a manifest's JSON object of a known ``version`` (checked by the caller) into a ``Manifest``.

    ``canonical``: the bytes ``raw`` was parsed from, when they hold nothing
    canonical JSON cannot (versions with a manifest checksum check it over
    them first, ``manifest.written_crc_matches``); None: re-encode ``raw``.
    """
    if canonical is None:
        return spec(version).parse(raw, where)
    return spec(version).parse(raw, where, canonical=canonical)


def to_json(m: Any) -> Dict[str, Any]:
    """A ``Manifest``'s JSON object, as its version lays it out."""
    return spec(m.version).to_json(m)
