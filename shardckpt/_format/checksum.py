"""Checksums: CRC-32C of a chunk's bytes, and joining the CRCs of consecutive pieces.

The one implementation of the checksum arithmetic: the engine (writes, ranged
reads, ``verify``) and the converters (CRC-32C of native chunks, CRC-32 of the
zip records ``torch.save`` writes) all use it.

A chunk read in blocks by several threads gets one CRC per block; joining them
needs ``combine(crc(A), crc(B), len(B)) == crc(A + B)``. Both CRCs are
reflected, with equal initial value and final xor (all ones), so the
conditioning cancels and

    crc(A + B) == crc(A) * x^(8 * len(B))  mod P   xor  crc(B)

with polynomials held bit-reflected (bit 31 is x^0). ``x^(8n)`` is a product
of precomputed ``x^(8 * 2^k)``, so a combine costs a few hundred integer
operations whatever ``n``.
"""

from __future__ import annotations

import zlib
from typing import Dict, List

import crc32c as _crc32c

__all__ = ["ALGOS", "checksum", "combine", "crc32c", "crc32c_combine"]

_POLY_REFLECTED = {"crc32c": 0x82F63B78, "crc32": 0xEDB88320}
ALGOS = tuple(_POLY_REFLECTED)
_X0 = 1 << 31  # the polynomial 1, bit-reflected
#: Powers x^(8n) kept per algorithm: the block size repeats, odd tails need not stay.
_CACHE_ENTRIES = 4096


def crc32c(data, value: int = 0) -> int:
    """CRC-32C (Castagnoli) of ``data`` (bytes-like), continuing from ``value``.

    Hardware accelerated (SSE4.2 / ARMv8) and releases the GIL.

    Example:
        >>> hex(crc32c(b"123456789"))
        '0xe3069283'
    """
    return _crc32c.crc32c(data, value)


def checksum(algo: str, data, value: int = 0) -> int:
    """CRC of ``data`` continuing from ``value``; ``algo`` is ``"crc32c"`` or ``"crc32"`` (zip)."""
    if algo == "crc32c":
        return _crc32c.crc32c(data, value)
    if algo == "crc32":
        return zlib.crc32(data, value)
    raise ValueError(f"unknown checksum algorithm {algo!r}; known: {', '.join(ALGOS)}")


def _mulmod(a: int, b: int, poly: int) -> int:
    """``a * b mod P`` for bit-reflected 32-bit polynomials."""
    p = 0
    while a:
        if a & _X0:
            p ^= b
        a = (a << 1) & 0xFFFFFFFF
        b = (b >> 1) ^ poly if b & 1 else b >> 1
    return p


class _Powers:
    """``x^(8n) mod P`` for one polynomial."""

    def __init__(self, poly: int):
        self.poly = poly
        table = [_X0 >> 8]  # x^8: one byte
        for _ in range(63):
            table.append(_mulmod(table[-1], table[-1], poly))
        self.pow2: List[int] = table  # x^(8 * 2^k)
        self.cache: Dict[int, int] = {}

    def x8n(self, n: int) -> int:
        got = self.cache.get(n)
        if got is None:
            got, k, m = _X0, 0, n
            while m:
                if m & 1:
                    got = _mulmod(got, self.pow2[k], self.poly)
                m >>= 1
                k += 1
            if len(self.cache) < _CACHE_ENTRIES:
                self.cache[n] = got  # dict writes are atomic under the GIL: threads may share it
        return got


_POWERS = {algo: _Powers(poly) for algo, poly in _POLY_REFLECTED.items()}


def combine(algo: str, crc_a: int, crc_b: int, len_b: int) -> int:
    """CRC of ``A + B`` from ``crc(A)``, ``crc(B)`` and ``len(B)``, for ``algo`` in :data:`ALGOS`.

    Lets the blocks of one chunk be checksummed in parallel, in any order.

    Example:
        >>> a, b = b"hello ", b"world"
        >>> combine("crc32", zlib.crc32(a), zlib.crc32(b), len(b)) == zlib.crc32(a + b)
        True
    """
    if len_b <= 0:
        return crc_a
    if crc_a == 0:  # 0 * anything: skip computing the power
        return crc_b
    powers = _POWERS[algo]
    return _mulmod(crc_a, powers.x8n(len_b), powers.poly) ^ crc_b


def crc32c_combine(crc_a: int, crc_b: int, len_b: int) -> int:
    """CRC-32C of ``A + B`` from ``crc32c(A)``, ``crc32c(B)`` and ``len(B)``.

    Example:
        >>> a, b = b"hello ", b"world"
        >>> crc32c_combine(crc32c(a), crc32c(b), len(b)) == crc32c(a + b)
        True
    """
    return combine("crc32c", crc_a, crc_b, len_b)
