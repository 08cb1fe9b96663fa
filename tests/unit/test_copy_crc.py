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


def _check_copy_model(src, lo, units, outs, step):
    """What check_copy must do, in Python: ``(crcs, delivered, {out index: bytes it holds after})``."""
    hi = lo + len(src)
    crcs = []
    got = {i: bytearray(dst) for i, (_, dst) in enumerate(outs)}
    at, i, damaged, delivered = lo, 0, False, lo
    while i < len(units) or at < hi:
        j = len(units) if step <= 0 else min(len(units), i + 1)
        while step > 0 and j < len(units) and units[j][1] - units[i][0] <= step:
            j += 1
        cut = hi if j >= len(units) else max(at, min(hi, units[j - 1][1]))
        for a0, b0, crc in units[i:j]:
            a, b = max(a0, lo), min(b0, hi)
            c = crc32c_package.crc32c(src[a - lo : b - lo]) if a < b else 0
            crcs.append(c)
            damaged |= c != crc or (a, b) != (a0, b0)
        if not damaged:
            for k, (start, dst) in enumerate(outs):
                a, b = max(start, at), min(start + len(dst), cut)
                if a < b:
                    got[k][a - start : b - start] = src[a - lo : b - lo]
            delivered = cut
        at, i = cut, j
        if i >= len(units) and at >= hi:
            break
    return crcs, delivered, got


@pytest.mark.parametrize("step", [0, 1, 4096, 10_000, 1 << 20])
def test_check_copy_checks_each_step_then_copies_it_and_stops_at_damage(step):
    # The kernel against a Python model: units of uneven sizes from byte 7
    # of the piece (bytes before and after lie in no unit), destinations
    # that leave gaps and overlap the piece's ends, streaming-size copies and
    # small ones; then each unit damaged in turn, and a unit cut by the
    # piece's end (never whole: damage).
    if not checksum.CHECK_COPIES:
        pytest.skip("the C kernel is not built here (or this CPU lacks SSE4.2/AVX2)")
    rng = random.Random(step)
    lo = 1000
    src = os.urandom(700_000)
    bounds = [lo + 7]
    while bounds[-1] < lo + 690_000:
        bounds.append(min(lo + 690_000, bounds[-1] + rng.choice([1, 100, 4096, 50_000, 300_000])))
    units = [(a, b, crc32c_package.crc32c(src[a - lo : b - lo])) for a, b in zip(bounds, bounds[1:])]
    cuts = sorted(rng.sample(range(lo - 50, lo + 700_050), 9))
    outs = [(a, bytearray(os.urandom(b - a))) for a, b in zip(cuts[::2], cuts[1::2])]
    for bad in [None] + list(range(len(units))):
        us = list(units)
        if bad is not None:
            a, b, c = us[bad]
            us[bad] = (a, b, c ^ 1)
        want_crcs, want_at, want = _check_copy_model(src, lo, us, outs, step)
        dsts = [(a, bytearray(d)) for a, d in outs]
        crcs, at = checksum.check_copy(src, lo, us, dsts, step=step)
        assert (crcs, at) == (want_crcs, want_at), bad
        assert all(bytes(d) == bytes(want[k]) for k, (_, d) in enumerate(dsts)), bad
        assert (at == lo + len(src)) == (bad is None)
    # A unit running past the piece: its part is checked, never counted whole.
    crcs, at = checksum.check_copy(src[:5000], lo, [(lo, lo + 6000, 0)], [(lo, bytearray(5000))], step=step)
    assert crcs == [crc32c_package.crc32c(src[:5000])] and at == lo


def test_check_copy_refuses_units_out_of_order_and_read_only_destinations():
    if not checksum.CHECK_COPIES:
        pytest.skip("the C kernel is not built here (or this CPU lacks SSE4.2/AVX2)")
    with pytest.raises(ValueError, match="out of order or overlaps"):
        checksum.check_copy(b"x" * 100, 0, [(50, 100, 0), (0, 50, 0)], [], step=0)
    with pytest.raises((TypeError, BufferError)):
        checksum.check_copy(b"x" * 100, 0, [], [(0, b"y" * 100)], step=0)
