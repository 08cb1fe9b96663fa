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
from typing import Callable, Dict, List, Optional, Sequence, Tuple

import crc32c as _crc32c

__all__ = [
    "ALGOS", "checksum", "combine", "crc32c", "crc32c_combine", "BlockCrcs", "pack_crcs", "unpack_crcs",
    "HASH_ALGOS", "default_hash_algo", "hash_available", "new_hasher", "content_hash", "COPY_FUSED", "copy_crc32c",
    "COPY_STREAMS", "copy_out", "CHECK_COPIES", "check_copy",
]

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


_FUSED: Optional[Callable[..., int]] = None
_STREAM: Optional[Callable[..., None]] = None
_CHECK: Optional[Callable[..., Tuple[List[int], int]]] = None
try:  # the one-pass copy + CRC-32C (shardckpt/_format/_crccopy.c): a C extension built where a compiler was
    from ._crccopy import HARDWARE as _HARDWARE
    from ._crccopy import check_copy as _check_kernel
    from ._crccopy import copy_crc32c as _kernel
    from ._crccopy import copy_stream as _stream_kernel
except ImportError:
    pass
else:
    # None where this CPU lacks what the kernel needs (SSE4.2, AVX2).
    _FUSED = _kernel if _HARDWARE else None
    _STREAM = _stream_kernel if _HARDWARE else None
    _CHECK = _check_kernel if _HARDWARE else None
#: Whether :func:`copy_crc32c` reads its source once (the C kernel, x86-64
#: with SSE4.2 and AVX2) rather than twice (a copy, then the CRC).
COPY_FUSED = _FUSED is not None


def copy_crc32c(dst, src, keep=None, value: int = 0) -> int:
    """Copy ``src`` into ``dst`` (``dst``'s old bytes into ``keep`` first, when given); return ``crc32c(src, value)``.

    One pass over ``src`` where :data:`COPY_FUSED` (the C kernel); else a
    plain copy and :func:`crc32c`. ``keep`` lets a caller put back ``dst``'s
    bytes when the CRC is not the one expected: the bytes are written before
    they are known good, so a caller that must never show a damaged byte
    restores them before anyone can look (a load, before it returns).

    Args:
        dst: writable bytes-like, at least ``len(src)`` long.
        src: bytes-like.
        keep: writable bytes-like of at least ``len(src)``, or None.
        value: the CRC to continue from.

    Raises:
        ValueError: a buffer shorter than ``src``.

    Example:
        >>> dst, keep = bytearray(b"old!"), bytearray(4)
        >>> hex(copy_crc32c(dst, b"1234", keep)), bytes(dst), bytes(keep)
        ('0xf63af4ee', b'1234', b'old!')
    """
    if _FUSED is not None:
        return _FUSED(dst, src, keep, value)
    n = len(memoryview(src).cast("B"))
    with memoryview(dst).cast("B") as d:
        if len(d) < n or (keep is not None and len(memoryview(keep)) < n):
            raise ValueError(f"copy_crc32c: {n} source bytes into {len(d)}")
        if keep is not None:
            with memoryview(keep).cast("B") as k:
                k[:n] = d[:n]
        d[:n] = memoryview(src).cast("B")
    return _crc32c.crc32c(src, value)


#: Whether :func:`copy_out` can bypass the cache for large copies (the C
#: kernel, x86-64 with AVX2) rather than copying through it (NumPy).
COPY_STREAMS = _STREAM is not None


def copy_out(dst, src, *, streaming: bool = True) -> None:
    """Copy verified ``src`` into ``dst`` (not overlapping), bypassing the cache where the copy is large; the GIL released.

    The copy out of a reader's scratch (or a file's mapping) into the
    destination tensors: those bytes are not read again during the load,
    and a plain store first reads every destination line. With the C kernel
    (:data:`COPY_STREAMS`) and ``streaming``, copies of 256 KiB or more use
    streaming stores (16.6 against 11.3 GB/s for ``memcpy`` on the 2-core
    VM, 4 MiB pieces into 1 GiB); else NumPy's copy (which also releases
    the GIL), else a memoryview copy.

    Args:
        dst: writable bytes-like, at least ``len(src)`` long.
        src: bytes-like.
        streaming: False copies through the cache (``SHARDCKPT_LOAD_STREAM_COPY=0``).

    Raises:
        ValueError: ``dst`` shorter than ``src``.

    Example:
        >>> dst = bytearray(4)
        >>> copy_out(dst, b"1234"); bytes(dst)
        b'1234'
    """
    if streaming and _STREAM is not None:
        _STREAM(dst, src)
        return
    s = memoryview(src).cast("B")
    with memoryview(dst).cast("B") as d:
        if len(d) < len(s):
            raise ValueError(f"copy_out: {len(s)} source bytes into {len(d)}")
        try:
            import numpy as np  # noqa: PLC0415  (NumPy's copy releases the GIL)
        except ImportError:
            d[: len(s)] = s
        else:
            np.copyto(np.frombuffer(d, np.uint8, len(s)), np.frombuffer(s, np.uint8))


#: Whether :func:`check_copy` is here (the C kernel, x86-64 with SSE4.2 and
#: AVX2); without it, callers check and copy in Python.
CHECK_COPIES = _CHECK is not None


def check_copy(src, lo: int, units: Sequence[Tuple[int, int, int]], outs: Sequence[Tuple[int, object]], *, step: int,
               streaming: bool = True) -> Tuple[List[int], int]:
    """Check file bytes ``src`` (from offset ``lo``) against ``units``, copying them into ``outs`` a verified step at a time.

    In steps of whole units (at most ``step`` bytes, one unit at least; 0:
    the whole of ``src``): the step's CRC-32Cs, then, if every unit so far
    matched and lies whole in ``src``, the step's bytes copied into the
    ``outs`` they fall in while the step is in cache (streaming stores for
    copies of 256 KiB or more, as :func:`copy_out`). The steps partition
    ``src``: bytes outside every unit go with the step they lie in. After a
    damaged unit nothing more is copied, and the rest is still checked. The
    GIL is released once for all of it.

    Args:
        src: bytes-like: file bytes ``[lo, lo + len(src))``.
        lo: the file offset of ``src``.
        units: ``(start, stop, crc)`` checksum units, file offsets, sorted, not overlapping.
        outs: ``(start, dst)``: ``dst`` (writable bytes-like) takes file bytes
            ``[start, start + len(dst))``, the part of them in ``src``.
        step: bytes a step (0: one step).
        streaming: False copies through the cache.

    Returns:
        Each unit's CRC-32C of its part in ``src``, and the file offset up to
        which bytes were copied (``lo + len(src)``: all of them).

    Raises:
        ValueError: units out of order or overlapping; no kernel here
            (:data:`CHECK_COPIES` False).

    Example:
        >>> dst = bytearray(4)
        >>> check_copy(b"1234", 8, [(8, 12, 0xf63af4ee)], [(8, dst)], step=0) if CHECK_COPIES else ([0xf63af4ee], 12)
        ([4131058926], 12)
    """
    if _CHECK is None:
        raise ValueError("check_copy: the C kernel is not built here (CHECK_COPIES is False)")
    return _CHECK(src, lo, units, outs, step, streaming)


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


class BlockCrcs:
    """CRC-32C of each ``block_bytes`` slice of a byte stream fed in pieces of any size.

    The writer's one pass over a chunk: ``update`` with each piece as it goes
    out, ``finish`` for the list (format v2 block checksums, the last block
    short). ``crc`` is the whole stream's CRC (v1's per-chunk value), joined
    from the blocks with :func:`crc32c_combine`.

    Example:
        >>> b = BlockCrcs(4); b.update(b"abcdef"); b.update(b"gh"); b.finish() == [crc32c(b"abcd"), crc32c(b"efgh")]
        True
    """

    def __init__(self, block_bytes: int, *, enabled: bool = True):
        if block_bytes < 1:
            raise ValueError(f"block_bytes must be >= 1, found {block_bytes}")
        self.block_bytes = block_bytes
        self.enabled = enabled
        self.crcs: List[int] = []
        self.nbytes = 0
        self._fill = 0
        self._cur = 0

    def update(self, data) -> None:
        mv = memoryview(data).cast("B") if not isinstance(data, memoryview) or data.format != "B" else data
        pos, n = 0, len(mv)
        while pos < n:
            take = min(self.block_bytes - self._fill, n - pos)
            if self.enabled:
                self._cur = _crc32c.crc32c(mv[pos : pos + take], self._cur)
            self._fill += take
            pos += take
            if self._fill == self.block_bytes:
                self.crcs.append(self._cur)
                self._cur, self._fill = 0, 0
        self.nbytes += n

    def finish(self) -> List[int]:
        if self._fill:
            self.crcs.append(self._cur)
            self._cur, self._fill = 0, 0
        return self.crcs

    @property
    def crc(self) -> int:
        """CRC-32C of everything fed (call after :meth:`finish`)."""
        crc = 0
        for i, b in enumerate(self.crcs):
            crc = crc32c_combine(crc, b, min(self.block_bytes, self.nbytes - i * self.block_bytes))
        return crc


def pack_crcs(crcs: List[int]) -> str:
    """Block CRCs as base64 of little-endian u32 (4 bytes a block; how index files store them)."""
    import base64
    import struct

    return base64.b64encode(struct.pack(f"<{len(crcs)}I", *crcs)).decode("ascii")


def unpack_crcs(text: str, count: int) -> List[int]:
    """Inverse of :func:`pack_crcs`; ``ValueError`` unless ``text`` holds exactly ``count`` CRCs."""
    import base64
    import binascii
    import struct

    if not isinstance(text, str) or len(text) != 4 * -(-4 * count // 3):
        raise ValueError(f"block checksums: expected base64 of {count} u32, found {len(text) if isinstance(text, str) else type(text).__name__}")
    try:
        raw = base64.b64decode(text, validate=True)
    except (binascii.Error, ValueError) as e:
        raise ValueError(f"block checksums are not base64 ({e})") from None
    if len(raw) != 4 * count:
        raise ValueError(f"block checksums: {len(raw)} bytes, expected {4 * count}")
    return list(struct.unpack(f"<{count}I", raw))


# --------------------------------------------------------------------------
# content hashes (format v4): what incremental saves compare chunks by


#: Content hash algorithms a manifest may name (``content_hash``), strongest
#: first. BLAKE3 (the ``blake3`` package, a dependency) is what writers use;
#: SHA-256 (hashlib) is what a writer falls back to without it, and both read.
HASH_ALGOS = ("blake3", "sha256")
#: Hex digits of a content hash (32 bytes, both algorithms).
HASH_HEX_DIGITS = 64


def _blake3():
    try:
        import blake3  # noqa: PLC0415  (only writers and verify need it: keep `import shardckpt` cheap)
    except ImportError:
        return None
    return blake3.blake3


def default_hash_algo() -> str:
    """The algorithm a writer uses: ``"blake3"`` when importable, else ``"sha256"``."""
    return "blake3" if _blake3() is not None else "sha256"


def hash_available(algo: str) -> bool:
    """Whether this process can compute ``algo`` (``blake3`` needs its package)."""
    return algo == "sha256" or (algo == "blake3" and _blake3() is not None)


def new_hasher(algo: str):
    """A fresh hash object (``update(bytes)``, ``hexdigest()``) of ``algo`` in :data:`HASH_ALGOS`.

    Raises:
        ValueError: an unknown algorithm, or ``blake3`` without the package
            (``pip install blake3``).

    Example:
        >>> h = new_hasher("sha256"); h.update(b"abc"); h.hexdigest()[:8]
        'ba7816bf'
    """
    if algo == "blake3":
        b3 = _blake3()
        if b3 is None:
            raise ValueError("content hash 'blake3' needs the blake3 package: pip install blake3")
        return b3()
    if algo == "sha256":
        import hashlib

        return hashlib.sha256()
    raise ValueError(f"unknown content hash {algo!r}; known: {', '.join(HASH_ALGOS)}")


def content_hash(algo: str, data) -> str:
    """Hex content hash of ``data`` (bytes-like) with ``algo``.

    Example:
        >>> content_hash("blake3", b"") == content_hash("blake3", memoryview(b""))
        True
    """
    h = new_hasher(algo)
    h.update(data)
    return h.hexdigest()


def check_hash_hex(value, where: str) -> str:
    """``value`` if it is a content hash as index files hold it (64 lowercase hex digits); ValueError otherwise."""
    if not isinstance(value, str) or len(value) != HASH_HEX_DIGITS or value.strip("0123456789abcdef"):
        raise ValueError(f"{where}: content hash must be {HASH_HEX_DIGITS} lowercase hex digits, found {value!r:.80}")
    return value
