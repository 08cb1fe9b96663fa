"""Every tunable of the engine, in one place, each overridable from the environment.

A knob's value is read once, when this module is first imported: set the
environment variable before the first ``import shardckpt`` work (or assign the
attribute of this module in-process, as the benchmarks do). A value that does
not parse raises ``ValueError`` naming the variable.

==================================  ==========  ===========================================
environment variable                default     what it sets
==================================  ==========  ===========================================
``SHARDCKPT_IO_THREADS``            4           parallel writers/readers per rank (the
                                                ``io_threads=`` default of every call)
``SHARDCKPT_WRITE_BLOCK_BYTES``     32 MiB      bytes per ``write`` call and CRC update
``SHARDCKPT_READ_BLOCK_BYTES``      32 MiB      a coalesced read range is split into
                                                blocks of this size, read in parallel
``SHARDCKPT_COALESCE_GAP_BYTES``    1 MiB       neighbouring chunks closer than this in
                                                a file are fetched in one request
``SHARDCKPT_MIN_BYTES_PER_FILE``    64 MiB      a rank's data is split over several files
                                                (one per I/O thread) above this size
``SHARDCKPT_COLLECTIVE_TIMEOUT_S``  1800        bound of every cross-rank exchange of
                                                save/load/async_save/the manager (the
                                                ``collective_timeout_s=`` default)
``SHARDCKPT_REGISTER_MIN_BYTES``    1 MiB       CUDA staging buffers at least this big are
                                                ``cudaHostRegister``-ed (exact size)
``SHARDCKPT_CHECKSUMS``             1           0: skip CRC-32C on write (records 0) and
                                                on read. Benchmarks only: a checkpoint
                                                written so fails verification, as it should
==================================  ==========  ===========================================

Sizes accept plain integers or a unit suffix (``KiB``, ``MiB``, ``GiB``, ``KB``,
``MB``, ``GB``): ``SHARDCKPT_WRITE_BLOCK_BYTES=8MiB``.
"""

from __future__ import annotations

import os
import re

__all__ = [
    "IO_THREADS",
    "WRITE_BLOCK_BYTES",
    "READ_BLOCK_BYTES",
    "COALESCE_GAP_BYTES",
    "MIN_BYTES_PER_FILE",
    "COLLECTIVE_TIMEOUT_S",
    "REGISTER_MIN_BYTES",
    "CHECKSUMS",
    "ENV_PREFIX",
]

ENV_PREFIX = "SHARDCKPT_"

_UNITS = {"": 1, "b": 1, "kb": 10**3, "mb": 10**6, "gb": 10**9, "kib": 1 << 10, "mib": 1 << 20, "gib": 1 << 30}


def _env(name: str) -> str | None:
    v = os.environ.get(ENV_PREFIX + name)
    return None if v is None or not v.strip() else v.strip()


def _bad(name: str, raw: str, want: str) -> ValueError:
    return ValueError(f"environment variable {ENV_PREFIX}{name}={raw!r} is not {want}; unset it or fix the value")


def _int(name: str, default: int, *, minimum: int = 1) -> int:
    raw = _env(name)
    if raw is None:
        return default
    m = re.fullmatch(r"(\d+)\s*([a-zA-Z]*)", raw)
    if not m or m.group(2).lower() not in _UNITS:
        raise _bad(name, raw, "an integer (optionally with KiB/MiB/GiB/KB/MB/GB)")
    value = int(m.group(1)) * _UNITS[m.group(2).lower()]
    if value < minimum:
        raise _bad(name, raw, f"at least {minimum}")
    return value


def _float(name: str, default: float) -> float:
    raw = _env(name)
    if raw is None:
        return default
    try:
        value = float(raw)
    except ValueError:
        raise _bad(name, raw, "a number") from None
    if not value > 0:
        raise _bad(name, raw, "a positive number")
    return value


def _bool(name: str, default: bool) -> bool:
    raw = _env(name)
    if raw is None:
        return default
    low = raw.lower()
    if low in ("1", "true", "yes", "on"):
        return True
    if low in ("0", "false", "no", "off"):
        return False
    raise _bad(name, raw, "a boolean (1/0, true/false)")


#: I/O threads per rank for writes and reads. Writes and CRC32C release the GIL.
IO_THREADS = _int("IO_THREADS", 4)
#: Bytes handed to one ``write`` call (and one CRC update).
WRITE_BLOCK_BYTES = _int("WRITE_BLOCK_BYTES", 32 << 20)
#: Reads of a coalesced range are split into pieces of this size, read (and
#: checksummed) in parallel.
READ_BLOCK_BYTES = _int("READ_BLOCK_BYTES", 32 << 20)
#: Neighbouring chunks closer than this in a file are fetched in one request.
COALESCE_GAP_BYTES = _int("COALESCE_GAP_BYTES", 1 << 20, minimum=0)
#: A rank's data is split into several files (one per I/O thread) above this size.
MIN_BYTES_PER_FILE = _int("MIN_BYTES_PER_FILE", 64 << 20)
#: Bound of every cross-rank exchange of one save/load. An exchange waits for
#: the slowest rank to arrive, so it must exceed the longest write (or read)
#: of one rank's shard; a rank that never calls is named after this long.
COLLECTIVE_TIMEOUT_S = _float("COLLECTIVE_TIMEOUT_S", 1800.0)
#: CUDA staging buffers at least this big are registered host memory (exact
#: size); smaller ones come from torch's pinned allocator (power-of-two sizes).
REGISTER_MIN_BYTES = _int("REGISTER_MIN_BYTES", 1 << 20, minimum=0)
#: Checksum on write and verify on read. Only benchmarks turn it off, to
#: measure the checksum's cost; never the library.
CHECKSUMS = _bool("CHECKSUMS", True)
