"""The data files a manifest lists: present, with the recorded sizes.

One listing per directory where the storage lists consistently
(``Capabilities.consistent_listing``), one size query per file elsewhere and
for whatever the listing does not confirm.
"""

from __future__ import annotations

import collections
import posixpath
from concurrent.futures import ThreadPoolExecutor
from typing import Any, Dict, List, Optional

from ..errors import CorruptCheckpointError, UnreadableFileError, format_offenders

__all__ = ["check_files", "listing_prefixes", "STAT_THREADS", "LIST_MIN_FILES", "LIST_PAGE", "RECHECK_REMOTE"]

#: Parallel size queries on object stores (one round trip each).
STAT_THREADS = 16
#: Above this many files, remote size queries run in parallel.
_PARALLEL_STAT_FILES = 4
#: From this many files in one directory on, their sizes come from a listing
#: (one request a 1,000 files on S3) rather than one size query each.
LIST_MIN_FILES = 4
#: On high-latency storage, at most this many files the listing did not
#: confirm are asked about one by one (for the exact reason: unreadable,
#: truncated...); beyond that the listing's answer stands, so that an emptied
#: bucket costs one listing, not one HEAD per file, before the error.
RECHECK_REMOTE = 64
#: Keys one S3 listing page returns (ListObjectsV2's maximum): on high-latency
#: storage, a listing prefix covers at most this many expected files, so each
#: listing is one request and they run concurrently.
LIST_PAGE = 1000


def listing_prefixes(paths, *, per_listing: Optional[int] = None) -> Dict[str, List[str]]:
    """Plan the listings that cover ``paths``: ``{listing prefix: [paths it covers]}``.

    Pure. Each directory's paths share one prefix, the directory plus its
    names' common start (a save's files share ``data/<save id>-``, so on S3
    its listing returns no file of another save). With ``per_listing``, a
    prefix covering more paths is split by the names' next character until
    each covers at most that many (or cannot be split: a name that is itself
    the prefix), so that the listings, one page each, can run concurrently
    instead of as one chain of pages: 32,768 names ``index-r00000`` ...
    ``r16383-00`` become 34 prefixes (``data/<save>-index-r00`` ...).

    Example:
        >>> listing_prefixes(["data/ab-r0.st", "data/ab-r1.st", "m.json"])
        {'data/ab-r': ['data/ab-r0.st', 'data/ab-r1.st'], 'm.json': ['m.json']}
        >>> list(listing_prefixes(["d/x0", "d/x1", "d/y0"], per_listing=2))
        ['d/x', 'd/y0']
    """
    by_dir: Dict[str, List[str]] = {}
    for p in sorted(paths):
        by_dir.setdefault(posixpath.dirname(p), []).append(p)
    out: Dict[str, List[str]] = {}
    for d, ps in by_dir.items():
        cut = len(d) + 1 if d else 0
        todo = [ps]
        while todo:
            group = todo.pop()
            common = posixpath.commonprefix([p[cut:] for p in group])
            n = len(common)
            if per_listing is None or len(group) <= per_listing or any(len(p) - cut == n for p in group):
                out[(d + "/" if d else "") + common] = group
                continue
            parts: Dict[str, List[str]] = {}
            for p in group:
                parts.setdefault(p[cut + n], []).append(p)
            todo.extend(parts.values())
    return dict(sorted(out.items()))


def _listed_sizes(storage: Any, expected: Dict[str, int]) -> Dict[str, Optional[int]]:
    """``{path: listed size, or None if the listing lacks it}`` for the expected files a listing covered.

    Files of a directory that was not listed (too few files, listing not
    possible or refused) are absent from the result: only a stat can say.
    On high-latency storage the listings (one page each) run concurrently.
    """
    if not getattr(storage.caps, "consistent_listing", False) or not hasattr(storage, "list_sizes"):
        return {}
    remote = storage.caps.high_latency
    per_dir = collections.Counter(posixpath.dirname(p) for p in expected)
    plan = [(prefix, rels) for prefix, rels in listing_prefixes(expected, per_listing=LIST_PAGE if remote else None).items()
            if per_dir[posixpath.dirname(rels[0])] >= LIST_MIN_FILES]

    def one(prefix: str) -> Optional[Dict[str, int]]:
        try:
            return storage.list_sizes(prefix)
        except (OSError, UnreadableFileError):
            # Listing refused (no s3:ListBucket permission), failed after its
            # retries, or the directory is a symlink out of the root: every
            # file of it gets its own size query, which says exactly why.
            return None

    if remote and len(plan) > 1:
        with ThreadPoolExecutor(max_workers=min(STAT_THREADS, len(plan))) as ex:
            results = list(ex.map(one, [prefix for prefix, _ in plan]))
    else:
        results = [one(prefix) for prefix, _ in plan]
    out: Dict[str, Optional[int]] = {}
    for (_, rels), listed in zip(plan, results):
        if listed is not None:
            for rel in rels:
                out[rel] = listed.get(rel)
    return out


def check_files(storage: Any, expected: Dict[str, int]) -> None:
    """Check every file ``{relative path: size}`` exists with its size; lists all offenders at once.

    Where the storage lists consistently (``caps.consistent_listing``: local
    disk, S3, GCS, Azure, ``memory://``), one listing per directory
    (``Storage.list_sizes``: on S3 one ListObjectsV2 request a 1,000 files,
    instead of one HEAD per file) confirms the files whose listed size is
    right; every other file (absent from the listing, of another size, a
    symlink or special file, or all of them where listing is not possible)
    gets one size query of its own, in parallel on high-latency storage
    (there, of the files a listing contradicts, at most ``RECHECK_REMOTE``;
    the listing's answer stands for the rest).
    The commit runs it right before writing the manifest, ``restore`` before
    picking a step, ``verify`` and ``load`` before reading: one mechanism for
    "the files are there".

    Args:
        storage: a ``Storage`` (``caps``, ``list_sizes``, ``stat_sizes``, ``url``).
        expected: relative path -> exact size in bytes.

    Raises:
        CorruptCheckpointError: naming each missing, truncated, grown or
            unreadable file (a directory, a symlink out of the checkpoint...),
            the first ``errors.MAX_OFFENDERS`` of them and how many more.

    Example:
        >>> check_files(storage, {rel: f.size for rel, f in manifest.files.items()})   # doctest: +SKIP

    Limits: a listing is only as fresh as the storage's consistency; backends
    without ``consistent_listing`` are never listed.
    """
    listed = _listed_sizes(storage, expected)
    sizes: Dict[str, Any] = {}
    unlisted, contradicted = [], []
    for rel in sorted(expected):
        if rel not in listed:
            unlisted.append(rel)  # no listing covered it: stat it
        elif listed[rel] != expected[rel]:
            contradicted.append(rel)
    remote = storage.caps.high_latency
    if remote and len(contradicted) > RECHECK_REMOTE:
        # Many files a listing contradicts (an emptied bucket): its answer
        # stands for all but the first few.
        for rel in contradicted[RECHECK_REMOTE:]:
            sizes[rel] = listed[rel]
        contradicted = contradicted[:RECHECK_REMOTE]
    suspects = unlisted + contradicted

    def stat(rel):
        try:
            # Asked of the storage itself, never of a listing cache: files
            # removed under us (cleanup(), a lifecycle rule) must be seen.
            return rel, storage.stat_sizes([rel])[rel]
        except (FileNotFoundError, NotADirectoryError):  # a path through a file names nothing
            return rel, None
        except UnreadableFileError as e:
            return rel, e

    if len(suspects) > _PARALLEL_STAT_FILES and remote:
        with ThreadPoolExecutor(max_workers=STAT_THREADS) as ex:
            sizes.update(ex.map(stat, suspects))
    else:
        sizes.update(stat(rel) for rel in suspects)
    problems = []
    for rel in sorted(sizes):
        size: Optional[Any] = sizes[rel]
        if size is None:
            problems.append(f"{rel} is missing")
        elif isinstance(size, UnreadableFileError):
            problems.append(f"{rel} cannot be read: {size}")
        elif size != expected[rel]:
            what = "truncated" if size < expected[rel] else "has extra bytes"
            problems.append(f"{rel} {what}: {size} bytes, manifest says {expected[rel]}")
    if problems:
        raise CorruptCheckpointError(f"{storage.url}: " + format_offenders(problems, sep="; "))
