"""The one-pass copy + CRC-32C (``shardckpt/_format/_crccopy.c``, ``checksum.copy_crc32c``), issue 43.

Checked against the crc32c package (the CRC the format stores) over lengths
around the kernel's three-lane split and its 32-byte steps, unaligned
buffers, continued CRCs and the bytes kept aside; the Python fallback gives
the same results; the kernel is built wherever the install had a compiler.
"""

from __future__ import annotations

import importlib
import os
import platform
import random
import shutil

import crc32c as crc32c_package
import pytest

checksum = importlib.import_module("shardckpt._format.checksum")

LENGTHS = [0, 1, 7, 8, 9, 31, 32, 33, 95, 96, 97, 191, 192, 193, 1000, 4095, 4096, 65536 + 13, (1 << 20) - 1, 1 << 20, (1 << 20) + 5]


@pytest.fixture(params=["kernel", "fallback"])
def impl(request, monkeypatch):
    if request.param == "kernel":
        if not checksum.COPY_FUSED:
            pytest.skip("the C kernel is not built here (or this CPU lacks SSE4.2/AVX2)")
    else:
        monkeypatch.setattr(checksum, "_FUSED", None)
    return checksum.copy_crc32c


@pytest.mark.parametrize("n", LENGTHS)
def test_copies_keeps_and_returns_the_crc32c_of_the_source(impl, n):
    rng = random.Random(n)
    for keep_on in (False, True):
        src = bytes(rng.getrandbits(8) for _ in range(min(n, 4096))) * (n // 4096 + 1)
        src = src[:n]
        dst = bytearray(os.urandom(n + 3))
        old = bytes(dst)
        keep = bytearray(n) if keep_on else None
        value = rng.getrandbits(32)
        got = impl(dst, src, keep, value)
        assert got == crc32c_package.crc32c(src, value), (n, keep_on)
        assert bytes(dst[:n]) == src and bytes(dst[n:]) == old[n:]  # nothing past the source's length
        if keep_on:
            assert bytes(keep) == old[:n]


def test_unaligned_memoryviews_of_larger_buffers(impl):
    base = bytearray(os.urandom((1 << 20) + 64))
    out = bytearray((1 << 20) + 64)
    keep = bytearray((1 << 20) + 64)
    for a in (0, 1, 3, 17, 31):
        src = memoryview(base)[a : a + (1 << 19) + a]
        dst = memoryview(out)[7 : 7 + len(src)]
        before = bytes(dst)
        assert impl(dst, src, memoryview(keep)[5 : 5 + len(src)]) == crc32c_package.crc32c(src)
        assert bytes(dst) == bytes(src) and bytes(memoryview(keep)[5 : 5 + len(src)]) == before


def test_a_crc_continued_over_pieces_equals_the_whole(impl):
    data = os.urandom(300_001)
    dst = bytearray(len(data))
    crc, at = 0, 0
    for n in (1, 96, 4097, 100_000, 195_807):
        crc = impl(memoryview(dst)[at : at + n], data[at : at + n], None, crc)
        at += n
    assert at == len(data) and crc == crc32c_package.crc32c(data) and bytes(dst) == data


def test_short_buffers_are_refused_and_nothing_is_written(impl):
    dst = bytearray(b"\x07" * 10)
    with pytest.raises(ValueError):
        impl(dst, b"x" * 11)
    with pytest.raises(ValueError):
        impl(bytearray(20), b"x" * 11, bytearray(10))
    assert dst == b"\x07" * 10
    with pytest.raises(TypeError):
        impl(b"read-only", b"x")  # a destination must be writable


def test_the_kernel_is_built_where_a_compiler_was():
    # setup.py builds it as optional: a broken build would install silently
    # and every load would take the two-pass path. On x86-64 Linux with a C
    # compiler (this project's CI), it must be there.
    if platform.machine() != "x86_64" or not any(shutil.which(c) for c in ("cc", "gcc", "clang")):
        pytest.skip("not x86-64 with a C compiler")
    from shardckpt._format import _crccopy

    flags = open("/proc/cpuinfo").read() if os.path.exists("/proc/cpuinfo") else ""
    assert bool(_crccopy.HARDWARE) == (" sse4_2" in flags and " avx2" in flags)
    assert checksum.COPY_FUSED == bool(_crccopy.HARDWARE)


def test_a_page_aligned_keep_takes_the_streaming_stores_and_holds_every_old_byte(impl):
    # The kernel stores the kept bytes with streaming (non-temporal) stores
    # where keep is 32-byte aligned (the reader's keep buffer, a mapping):
    # the same bytes must come back, for every length around its steps.
    import mmap

    m = mmap.mmap(-1, 2 << 20)
    try:
        for n in (32, 96, 97, 1000, 65536 + 13, (1 << 20) + 5):
            src = os.urandom(n)
            dst = bytearray(os.urandom(n))
            old = bytes(dst)
            with memoryview(m) as keep:
                assert impl(dst, src, keep[:n]) == crc32c_package.crc32c(src)
                assert bytes(keep[:n]) == old and bytes(dst) == src
    finally:
        m.close()


# -- the streaming copy (copy_stream in the kernel, checksum.copy_out) ------------------------------------------


@pytest.fixture(params=["kernel", "numpy"])
def copy_out(request, monkeypatch):
    if request.param == "kernel" and not checksum.COPY_STREAMS:
        pytest.skip("the C kernel is not built here (or this CPU lacks AVX2)")
    return lambda dst, src: checksum.copy_out(dst, src, streaming=request.param == "kernel")


@pytest.mark.parametrize("n", LENGTHS + [256 << 10, (256 << 10) + 77, 3 << 20])
def test_copy_out_copies_exactly_the_source(copy_out, n):
    # Sizes around the kernel's threshold (256 KiB: streaming stores above),
    # destinations at every offset within a 32-byte line (the stores need
    # 32-byte alignment: the head is copied plainly), nothing written past n.
    src = os.urandom(n)
    for a in (0, 1, 13, 31):
        out = bytearray(os.urandom(n + 64))
        old = bytes(out)
        copy_out(memoryview(out)[a : a + n + 5], src)
        assert bytes(out[a : a + n]) == src and bytes(out[:a]) == old[:a] and bytes(out[a + n :]) == old[a + n :], (n, a)


def test_copy_out_refuses_a_short_or_read_only_destination(copy_out):
    with pytest.raises(ValueError):
        copy_out(bytearray(10), b"x" * 11)
    with pytest.raises((TypeError, BufferError, ValueError)):
        copy_out(b"y" * 20, b"x" * 11)
