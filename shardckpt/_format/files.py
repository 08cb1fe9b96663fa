"""The data files a manifest lists: present, with the recorded sizes."""

from __future__ import annotations

from concurrent.futures import ThreadPoolExecutor
from typing import Any, Dict

from ..errors import CorruptCheckpointError, UnreadableFileError, format_offenders

__all__ = ["check_files", "STAT_THREADS"]

#: Parallel size queries on object stores (one round trip each).
STAT_THREADS = 16
#: Above this many files, remote size queries run in parallel.
_PARALLEL_STAT_FILES = 4


def check_files(storage: Any, expected: Dict[str, int]) -> None:
    """Check every file ``{relative path: size}`` exists with its size; lists all offenders at once.

    One size query per file (in parallel on high-latency storage). The commit
    runs it right before writing the manifest, ``restore`` before picking a
    step, ``verify`` and ``load`` before reading: one mechanism for "the
    files are there".

    Raises:
        CorruptCheckpointError: naming each missing, truncated, grown or
            unreadable file (a directory, a symlink out of the checkpoint...).

    Example:
        >>> check_files(storage, {rel: f.size for rel, f in manifest.files.items()})   # doctest: +SKIP
    """
    problems = []

    def stat(rel):
        try:
            # Asked of the storage itself, never of a listing cache: files
            # removed under us (cleanup(), a lifecycle rule) must be seen.
            return rel, storage.stat_sizes([rel])[rel]
        except (FileNotFoundError, NotADirectoryError):  # a path through a file names nothing
            return rel, None
        except UnreadableFileError as e:
            return rel, e

    if len(expected) > _PARALLEL_STAT_FILES and storage.caps.high_latency:
        with ThreadPoolExecutor(max_workers=STAT_THREADS) as ex:
            sizes = list(ex.map(stat, sorted(expected)))
    else:
        sizes = [stat(rel) for rel in sorted(expected)]
    for rel, size in sizes:
        if size is None:
            problems.append(f"{rel} is missing")
        elif isinstance(size, UnreadableFileError):
            problems.append(f"{rel} cannot be read: {size}")
        elif size != expected[rel]:
            what = "truncated" if size < expected[rel] else "has extra bytes"
            problems.append(f"{rel} {what}: {size} bytes, manifest says {expected[rel]}")
    if problems:
        raise CorruptCheckpointError(f"{storage.url}: " + format_offenders(problems, sep="; "))
