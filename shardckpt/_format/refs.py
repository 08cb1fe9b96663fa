"""References between checkpoints of one root (format v4): paths, reading through them, liveness.

An incremental save (``save(..., incremental=...)``, ``CheckpointManager(
incremental=True)``) does not rewrite a chunk whose bytes an earlier committed
checkpoint next to it already holds: its index row names the earlier file by a
**reference path** ``@<dir>/<path>``, read as ``<path>`` inside the sibling
directory ``<dir>`` (same parent: the run root). The row copies the chunk's
byte range, CRC-32Cs and content hash, so every read is checked exactly as a
read of the step's own bytes. References are flat: a chunk referenced from a
step that itself referenced it names the step that wrote the bytes.

Three mechanisms live here, torch-free:

* paths: :func:`ref_target` / :func:`ref_path` / :func:`check_ref_paths`;
* reading: :func:`follow` wraps a checkpoint's storage so that every read of
  a reference path goes to the sibling (``Storage.sibling``), so the readers
  (load, inspect, verify, the converters, ``check_files``) need no change;
* liveness (pure, on names): :func:`live_files` (the files the kept
  manifests name, their own and referenced) and :func:`removable` (what a
  cleanup may delete). Retention deletes only files no kept manifest names,
  which is what keeps every kept step whole at every point of a cleanup;
  docs/manager.md ("Retention with incremental steps") has the argument.
"""

from __future__ import annotations

import operator
import re
from typing import Any, Collection, Dict, Iterable, List, Mapping, Optional, Sequence, Set, Tuple

from ..errors import UnsafeMetadataError

__all__ = [
    "REF_MARK", "ref_target", "ref_path", "check_ref_paths", "follow", "RefStorage",
    "named_files", "live_files", "removable", "own_and_shared",
]

#: First character of a reference path's first segment.
REF_MARK = "@"
#: A sibling directory a reference may name: one plain path component.
_DIR_RE = re.compile(r"[A-Za-z0-9_][A-Za-z0-9._-]{0,254}\Z")


def ref_target(rel: str) -> Optional[Tuple[str, str]]:
    """``(sibling dir, path inside it)`` of a reference path, None for a path of the checkpoint's own.

    Example:
        >>> ref_target("@step-00000010/data/ab-r00000-00.safetensors")
        ('step-00000010', 'data/ab-r00000-00.safetensors')
        >>> ref_target("data/x.safetensors") is None
        True
    """
    if not rel.startswith(REF_MARK):
        return None
    head, sep, rest = rel[1:].partition("/")
    if not sep or not rest or not _DIR_RE.match(head) or head in (".", ".."):
        raise UnsafeMetadataError(
            f"reference path {rel[:200]!r} must be '@<sibling directory>/<path>' with a plain directory name"
        )
    return head, rest


def ref_path(holder: str, rel: str) -> str:
    """How a checkpoint next to ``holder`` names file ``rel`` of ``holder`` (a reference stays as it is: flat).

    Example:
        >>> ref_path("step-00000010", "data/x.safetensors")
        '@step-00000010/data/x.safetensors'
        >>> ref_path("step-00000020", "@step-00000010/data/x.safetensors")
        '@step-00000010/data/x.safetensors'
    """
    if rel.startswith(REF_MARK):
        return rel
    if not _DIR_RE.match(holder) or holder in (".", ".."):
        raise ValueError(f"cannot reference files of {holder!r}: not a plain directory name")
    return f"{REF_MARK}{holder}/{rel}"


def check_ref_paths(files: Iterable[str], where: str) -> None:
    """Refuse a manifest whose reference paths are malformed (checked with the other paths, on open).

    Raises:
        UnsafeMetadataError: naming the path.
    """
    marked = operator.methodcaller("startswith", REF_MARK)
    # A C-level pass first: a manifest of 32,768 per-rank files usually has no reference.
    files = files if isinstance(files, Collection) else list(files)  # iterated twice
    if not any(map(marked, files)):
        return
    for rel in files:
        if rel.startswith(REF_MARK):
            try:
                ref_target(rel)
            except UnsafeMetadataError as e:
                raise UnsafeMetadataError(f"{where}: {e}") from None


# --------------------------------------------------------------------------
# reading through references


class RefStorage:
    """A checkpoint's storage whose reads of ``@<dir>/<path>`` go to the sibling ``<dir>``.

    Everything else is the wrapped storage's (writes included: nothing
    writes through a reference). Made by :func:`follow`.
    """

    def __init__(self, inner: Any):
        self._inner = inner
        self._siblings: Dict[str, Any] = {}
        # The plain attributes every reader asks for, fixed when the wrapped
        # storage was made: held here, so that asking is no detour through
        # ``__getattr__``.
        for name in ("url", "caps"):
            if hasattr(inner, name):
                setattr(self, name, getattr(inner, name))

    def __getattr__(self, name: str) -> Any:
        return getattr(self._inner, name)

    def __repr__(self) -> str:
        return f"RefStorage({self._inner!r})"

    def _route(self, rel: str) -> Tuple[Any, str]:
        tgt = ref_target(rel) if rel.startswith(REF_MARK) else None
        if tgt is None:
            return self._inner, rel
        d, rest = tgt
        st = self._siblings.get(d)
        if st is None:
            st = self._siblings.setdefault(d, self._inner.sibling(d))
        return st, rest

    def url_of(self, rel: str) -> str:
        st, r = self._route(rel)
        return st.url_of(r)

    def exists(self, rel: str) -> bool:
        st, r = self._route(rel)
        return st.exists(r)

    def path(self, rel: str) -> str:
        st, r = self._route(rel)
        return st.path(r)

    def is_file(self, rel: str = "") -> bool:
        st, r = self._route(rel)
        return st.is_file(r)

    def size(self, rel: str) -> int:
        st, r = self._route(rel)
        return st.size(r)

    def read_bytes(self, rel: str, *, limit: Optional[int] = None) -> bytes:
        st, r = self._route(rel)
        return st.read_bytes(r, limit=limit)

    def read_range(self, rel: str, start: int, length: int) -> bytes:
        st, r = self._route(rel)
        return st.read_range(r, start, length)

    def map_range(self, rel: str, start: int, stop: int) -> Optional[Tuple[Any, int]]:
        # Routed like every read: the mapped load path (``Storage.map_range``) reads referenced files too.
        st, r = self._route(rel)
        return st.map_range(r, start, stop)

    def open_hot(self, rel: str, start: int, stop: int) -> Optional[Any]:
        # Routed as map_range: the cached pieces of referenced files are read straight into the tensors too.
        st, r = self._route(rel)
        return st.open_hot(r, start, stop)

    def read_into(self, rel: str, ranges: Sequence[Tuple[int, memoryview]]) -> None:
        st, r = self._route(rel)
        st.read_into(r, ranges)

    def stat_sizes(self, rels: Iterable[str]) -> Dict[str, Optional[int]]:
        groups: Dict[int, Tuple[Any, Dict[str, str]]] = {}
        for rel in rels:
            st, r = self._route(rel)
            groups.setdefault(id(st), (st, {}))[1][r] = rel
        out: Dict[str, Optional[int]] = {}
        for st, names in groups.values():
            for r, size in st.stat_sizes(list(names)).items():
                out[names[r]] = size
        return out

    def list_sizes(self, prefix: str) -> Dict[str, int]:
        st, r = self._route(prefix)
        if st is self._inner:
            return st.list_sizes(r)
        head = prefix[: len(prefix) - len(r)]
        return {head + k: v for k, v in st.list_sizes(r).items()}


def follow(storage: Any) -> Any:
    """``storage`` that follows reference paths (:class:`RefStorage`); the same object when it already does.

    Example:
        >>> st = follow(Storage("run/step-00000020"))            # doctest: +SKIP
        >>> st.size("@step-00000010/data/ab-r00000-00.safetensors")   # doctest: +SKIP
    """
    return storage if isinstance(storage, RefStorage) else RefStorage(storage)


# --------------------------------------------------------------------------
# liveness (pure)


def named_files(own_dir: str, files: Iterable[str]) -> Set[Tuple[str, str]]:
    """``(directory, path)`` of every file a manifest in ``own_dir`` names: its own and those it references.

    Example:
        >>> sorted(named_files("s2", ["data/b", "@s1/data/a"]))
        [('s1', 'data/a'), ('s2', 'data/b')]
    """
    out = set()
    for rel in files:
        tgt = ref_target(rel)
        out.add(tgt if tgt is not None else (own_dir, rel))
    return out


def live_files(kept: Mapping[str, Iterable[str]]) -> Set[Tuple[str, str]]:
    """Files a cleanup must keep: everything the kept manifests name (``{dir: files of its manifest}``).

    Example:
        >>> sorted(live_files({"s2": ["data/b", "@s1/data/a"]}))
        [('s1', 'data/a'), ('s2', 'data/b')]
    """
    live: Set[Tuple[str, str]] = set()
    for d, files in kept.items():
        live |= named_files(d, files)
    return live


def removable(directory: str, present: Iterable[str], live: Set[Tuple[str, str]]) -> List[str]:
    """Files of ``directory`` a cleanup may delete: those present that no kept manifest names (sorted).

    Example:
        >>> removable("s1", ["data/a", "data/c", "manifest.json"], {("s1", "data/a")})
        ['data/c', 'manifest.json']
    """
    return sorted(rel for rel in present if (directory, rel) not in live)


def own_and_shared(files: Mapping[str, int]) -> Tuple[int, int]:
    """``(own bytes, referenced bytes)`` of a manifest's files (``{path: size}``): what ``inspect`` shows.

    Referenced bytes count each referenced file's size once (the file; the
    chunks used may be a part of it).

    Example:
        >>> own_and_shared({"data/a": 10, "@s1/data/b": 90})
        (10, 90)
    """
    own = sum(n for rel, n in files.items() if not rel.startswith(REF_MARK))
    return own, sum(files.values()) - own
