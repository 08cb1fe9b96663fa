"""A manifest's file table answered from its columns (format v3 and later; torch-free).

Format v3 lists the per-rank files as two name patterns and two columns
(``file_table``: ``data_sizes``, ``index_files``); at 16,384 ranks that is
32,768 paths. Building every path, ``FileMeta`` and ``IndexMeta`` on each
parse cost a loading rank ~50-90 ms, though a load asks for a few dozen of
them (the index files it reads and their data files). Here, for the table a
save writes (one data file and one index file per rank), ``Manifest.files``
and ``Manifest.indexes`` are mappings over the checked columns:

* a lookup matches the path against the pattern (``_v2._pattern_regex``),
  checks that the rank's canonical name is the path itself, and builds that
  one record (kept: a second lookup gives the same object);
* length and the rank -> index path answer from the columns;
* iterating, or changing, builds the whole dict once (what the parse built
  before) and works on it from then on.

The parse (``_v2.manifest_v2_from_raw``) checks every column entry before it
makes one of these, and makes one only when no two table paths can be equal
(:func:`disjoint_patterns`); anything else it expands as before.
"""

from __future__ import annotations

import re
from itertools import repeat
from typing import Any, Callable, Dict, Iterator, List, MutableMapping, Optional, Sequence, TypeVar

from .manifest import FileMeta, IndexMeta

__all__ = ["TableFiles", "TableIndexes", "disjoint_patterns"]

_DIGITS = re.compile(r"\d*\Z")
#: Most digits of a table rank (``MAX_TABLE_RANKS`` = 2**24 has 8): a longer
#: run is no table rank (and ``int`` of thousands of digits is refused).
_RANK_DIGITS = 9


def disjoint_patterns(data: str, index: str, rank_field: str, file_field: str) -> bool:
    """Whether the names of ``data`` (over ranks and files) and ``index`` (over ranks) are all distinct.

    True when neither pattern's literal head (before its first placeholder)
    starts the other's, or neither literal tail (after its last) ends the
    other's — then no name fits both — and the text between ``data``'s two
    placeholders holds a non-digit, so its digits split one way only. False
    means "not shown" (the caller expands every name and compares).

    >>> disjoint_patterns("d/r{rank}-{i}.st", "d/index-r{rank}.json", "{rank}", "{i}")
    True
    >>> disjoint_patterns("d/{rank}{i}.st", "d/x{rank}.json", "{rank}", "{i}")
    False
    """
    dr, df, ir = data.find(rank_field), data.find(file_field), index.find(rank_field)
    if min(dr, df, ir) < 0:
        return False
    lo, hi = sorted(((dr, rank_field), (df, file_field)))
    between = data[lo[0] + len(lo[1]) : hi[0]]
    if _DIGITS.match(between):
        return False
    dhead, dtail = data[: lo[0]], data[hi[0] + len(hi[1]) :]
    ihead, itail = index[:ir], index[ir + len(rank_field) :]
    heads_differ = not (dhead.startswith(ihead) or ihead.startswith(dhead))
    tails_differ = not (dtail.endswith(itail) or itail.endswith(dtail))
    return heads_differ or tails_differ


def _table_rank(m: Optional["re.Match[str]"], world: int) -> int:
    """The rank a pattern match names, or -1 (no match, too many digits, outside the world)."""
    if m is None:
        return -1
    digits = m.group("rank")
    if len(digits) > _RANK_DIGITS:
        return -1
    r = int(digits)
    return r if r < world else -1


_V = TypeVar("_V")


class _Lazy(MutableMapping[str, _V]):
    """The mapping both tables share: lookups answered from columns, anything else on the whole dict (``_whole``)."""

    __slots__ = ()
    # Each table's own slots: the manifest's plain records, those built on
    # lookup, and the whole dict once something needed it.
    _plain: Dict[str, _V]
    _built: Dict[str, _V]
    _full: Optional[Dict[str, _V]]

    def _whole(self) -> Dict[str, _V]:
        raise NotImplementedError  # each table builds its own

    def _make(self, path: Any) -> Optional[_V]:
        """The record of a table ``path`` built from the columns; None: not one of the table's."""
        raise NotImplementedError  # each table builds its own

    def __getitem__(self, path: str) -> _V:
        if self._full is not None:
            return self._full[path]
        got = self._plain.get(path)
        if got is None:
            got = self._built.get(path)
        if got is None:
            got = self._make(path)
            if got is None:
                raise KeyError(path)
            self._built[path] = got
        return got

    def __setitem__(self, path: str, meta: _V) -> None:
        self._whole()[path] = meta

    def __delitem__(self, path: str) -> None:
        del self._whole()[path]

    def __iter__(self) -> Iterator[str]:
        return iter(self._whole())

    def copy(self) -> Dict[str, _V]:
        """A plain dict of every record (records built so far shared, as ``dict.copy``)."""
        return dict(self._whole())

    def __reduce__(self) -> Any:
        return dict, (dict(self._whole()),)


class TableFiles(_Lazy[FileMeta]):
    """``Manifest.files`` of a file table of one data and one index file per rank: records built on lookup.

    Args:
        plain: the manifest's ``files`` map (checked), listed first as the parse did.
        data_name, index_name: ``(rank, i) -> path`` of the two patterns.
        data_rx, index_rx: the patterns' regexes (groups ``rank``, ``i``).
        data_sizes: per rank its data file's size; index_sizes: its index file's.

    Limits: not a ``dict``; iterating or changing it builds every record
    once (the cost it saves a load). Pickles as the plain dict.
    """

    __slots__ = ("_plain", "_data_name", "_index_name", "_data_rx", "_index_rx", "_data_sizes", "_index_sizes", "_built", "_full")

    def __init__(self, plain: Dict[str, FileMeta], data_name: Callable[..., str], index_name: Callable[..., str],
                 data_rx: "re.Pattern[str]", index_rx: "re.Pattern[str]", data_sizes: Sequence[int], index_sizes: Sequence[int]) -> None:
        self._plain, self._data_name, self._index_name = plain, data_name, index_name
        self._data_rx, self._index_rx = data_rx, index_rx
        self._data_sizes, self._index_sizes = data_sizes, index_sizes
        self._built: Dict[str, FileMeta] = {}
        self._full: Optional[Dict[str, FileMeta]] = None

    @property
    def plain(self) -> Dict[str, FileMeta]:
        """The files listed outside the table (the manifest's ``files`` map)."""
        return self._plain

    def table_size(self, path: str) -> Optional[int]:
        """The size the table lists for ``path`` (None: not a table path)."""
        world = len(self._data_sizes)
        m = self._data_rx.match(path)
        if m is not None:
            r = _table_rank(m, world)
            if r >= 0 and m.group("i") == "00" and self._data_name(r, 0) == path:
                return self._data_sizes[r]
            return None
        r = _table_rank(self._index_rx.match(path), world)
        if r >= 0 and self._index_name(r, 0) == path:
            return self._index_sizes[r]
        return None

    def _whole(self) -> Dict[str, FileMeta]:
        if self._full is None:
            world = range(len(self._data_sizes))
            full = dict(self._plain)
            full.update(zip(map(self._data_name, world, repeat(0)), map(FileMeta, self._data_sizes)))
            full.update(zip(map(self._index_name, world, repeat(0)), map(FileMeta, self._index_sizes)))
            full.update(self._built)  # records handed out keep their identity
            self._full = full
        return self._full

    def _make(self, path: Any) -> Optional[FileMeta]:
        size = self.table_size(path) if type(path) is str else None
        return None if size is None else FileMeta(size)

    def __contains__(self, path: object) -> bool:
        if self._full is not None:
            return path in self._full
        return path in self._plain or (type(path) is str and self.table_size(path) is not None)

    def __len__(self) -> int:
        if self._full is not None:
            return len(self._full)
        return len(self._plain) + 2 * len(self._data_sizes)

    def __repr__(self) -> str:
        return f"TableFiles({len(self)} files)"


class TableIndexes(_Lazy[IndexMeta]):
    """``Manifest.indexes`` of a file table of one index file per rank: ``IndexMeta`` built on lookup.

    Args:
        plain: the manifest's ``indexes`` map (checked; ranks outside the table).
        index_name, index_rx: as :class:`TableFiles`'.
        sizes, crcs: per rank its index file's size and CRC-32C (checked).

    Iteration order as the parse's dict: the table's ranks, then ``plain``.
    """

    __slots__ = ("_plain", "_index_name", "_index_rx", "_sizes", "_crcs", "_built", "_full", "_plain_ranks")

    def __init__(self, plain: Dict[str, IndexMeta], index_name: Callable[..., str], index_rx: "re.Pattern[str]",
                 sizes: List[int], crcs: List[int]) -> None:
        self._plain, self._index_name, self._index_rx = plain, index_name, index_rx
        self._sizes, self._crcs = sizes, crcs
        self._built: Dict[str, IndexMeta] = {}
        self._full: Optional[Dict[str, IndexMeta]] = None
        self._plain_ranks = {im.rank: rel for rel, im in plain.items()}

    def path_of_rank(self, rank: int) -> Optional[str]:
        """The index file of ``rank`` (None: none listed)."""
        if self._full is not None:  # changed since the parse: as the dict says now
            return {im.rank: rel for rel, im in self._full.items()}.get(rank)
        if 0 <= rank < len(self._sizes):
            return self._index_name(rank, 0)
        return self._plain_ranks.get(rank)

    def _whole(self) -> Dict[str, IndexMeta]:
        if self._full is None:
            world = range(len(self._sizes))
            full = dict(zip(map(self._index_name, world, repeat(0)), map(IndexMeta, world, self._sizes, self._crcs)))
            full.update(self._plain)
            full.update(self._built)
            self._full = full
        return self._full

    def _make(self, path: Any) -> Optional[IndexMeta]:
        r = _table_rank(self._index_rx.match(path), len(self._sizes)) if type(path) is str else -1
        if r < 0 or self._index_name(r, 0) != path:
            return None
        return IndexMeta(r, self._sizes[r], self._crcs[r])

    def __contains__(self, path: object) -> bool:
        try:
            self[path]  # type: ignore[index]
        except KeyError:
            return False
        return True

    def __len__(self) -> int:
        if self._full is not None:
            return len(self._full)
        return len(self._plain) + len(self._sizes)

    def __repr__(self) -> str:
        return f"TableIndexes({len(self)} index files)"
