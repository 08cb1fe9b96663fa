"""CRC arithmetic for streaming: checksum pieces in parallel, join them in order.

A chunk read in blocks by several threads gets one CRC per block, computed on
the thread that read it; joining them needs ``combine(crc(A), crc(B), len(B))
== crc(A + B)``. Both CRC-32 (zip records, what ``torch.save`` writes) and
CRC-32C (shardckpt manifests) are reflected CRCs with all-ones init and
final xor, for which

    crc(A + B) == Z_n(crc(A)) ^ crc(B),   n = len(B)

where ``Z_n`` is the (linear) effect of feeding ``n`` zero bytes to the raw
shift register. ``Z_n`` is applied as a product of precomputed ``Z_{2^k}``
matrices over GF(2), so a combine costs ~1k integer operations whatever ``n``.
"""

from __future__ import annotations

import threading
import zlib
from typing import List

import crc32c as _crc32c

__all__ = ["checksum", "combine", "ALGOS"]

_POLY = {"crc32c": 0x82F63B78, "crc32": 0xEDB88320}
ALGOS = tuple(_POLY)


def checksum(algo: str, data, value: int = 0) -> int:
    """CRC of ``data`` (bytes-like), continuing from ``value``."""
    if algo == "crc32c":
        return _crc32c.crc32c(data, value)
    if algo == "crc32":
        return zlib.crc32(data, value)
    raise ValueError(f"unknown checksum algorithm {algo!r}")


def _apply(mat: List[int], vec: int) -> int:
    out = 0
    i = 0
    while vec:
        if vec & 1:
            out ^= mat[i]
        vec >>= 1
        i += 1
    return out


def _square(mat: List[int]) -> List[int]:
    return [_apply(mat, col) for col in mat]


_POWERS: dict = {}
_LOCK = threading.Lock()


def _powers(algo: str, count: int) -> List[List[int]]:
    """``[Z_1, Z_2, Z_4, ...]`` (at least ``count``): zero-byte operators for 2^k bytes."""
    out = _POWERS.get(algo)
    if out is not None and len(out) >= count:
        return out
    with _LOCK:
        return _grow(algo, count)


def _grow(algo: str, count: int) -> List[List[int]]:
    out = _POWERS.get(algo)
    if out is None:
        poly = _POLY[algo]
        # One zero bit: shift right, xor the polynomial when the low bit falls out.
        byte = [(poly if i == 0 else 1 << (i - 1)) for i in range(32)]
        for _ in range(3):  # 8 bits
            byte = _square(byte)
        out = _POWERS[algo] = [byte]
    while len(out) < count:
        out.append(_square(out[-1]))
    return out


def combine(algo: str, crc_a: int, crc_b: int, len_b: int) -> int:
    """CRC of ``A + B`` from ``crc(A)``, ``crc(B)`` and ``len(B)``."""
    if len_b <= 0:
        return crc_a
    powers = _powers(algo, len_b.bit_length())
    k = 0
    while len_b:
        if len_b & 1:
            crc_a = _apply(powers[k], crc_a)
        len_b >>= 1
        k += 1
    return crc_a ^ crc_b
