"""Cold local reads (issue 43): O_DIRECT (SHARDCKPT_LOAD_DIRECT), whole-range WILLNEED, and the page cache give the same verified bytes.

Which way a read goes is observed through the module's own helpers
(``_direct_into``: an O_DIRECT read; ``_will_need``: a readahead hint),
never by time. Where the test directory is not on a block device that takes
O_DIRECT (tmpfs /tmp on some CI machines), the tests assert the fallback:
the page cache, the same values.
"""

from __future__ import annotations

import os

import pytest
import torch

import shardckpt
from shardckpt import _knobs
from shardckpt._storage import LocalStorage, _local
from shardckpt.errors import ChecksumMismatchError

MIB = 1 << 20


def _state():
    g = torch.Generator().manual_seed(5)
    out = {f"big{i}": torch.randn((3 * MIB) // 4 + 123 * i, generator=g) for i in range(3)}  # ~3 MiB, unaligned ends
    out.update({f"small{i}": torch.randn(17 + i, generator=g) for i in range(20)})
    return out


#: Tries at bringing a file's pages out of the page cache before a cold read:
#: POSIX_FADV_DONTNEED is advisory (pages under I/O stay, e.g. readahead that
#: an earlier read or RWF_NOWAIT probe started), so a test whose point is an
#: uncached read repeats its setup until the engine's own probe saw one.
UNCACHE_TRIES = 5


def _probed(monkeypatch):
    """The answers of the engine's page-cache probe (``_local.is_cached``), in order."""
    seen = []
    real = _local.is_cached

    def wrapped(fd, offset):
        got = real(fd, offset)
        seen.append(got)
        return got

    monkeypatch.setattr(_local, "is_cached", wrapped)
    return seen


def _uncache(root):
    for d, _, files in os.walk(root):
        for n in files:
            fd = os.open(os.path.join(d, n), os.O_RDONLY)
            try:
                os.fsync(fd)
                os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
            finally:
                os.close(fd)


def _takes_direct(root) -> bool:
    """Whether files under ``root`` are on a block device that opens with O_DIRECT (what the engine requires)."""
    if not getattr(os, "O_DIRECT", 0) or not _local.queue_info(str(root)):
        return False
    p = os.path.join(str(root), "probe")
    with open(p, "wb") as f:
        f.write(b"x" * 4096)
    try:
        os.close(os.open(p, os.O_RDONLY | os.O_DIRECT))
        return True
    except OSError:
        return False
    finally:
        os.unlink(p)


def _count(monkeypatch, name):
    calls = []
    real = getattr(_local, name)

    def wrapped(*a, **kw):
        calls.append(a)
        return real(*a, **kw)

    monkeypatch.setattr(_local, name, wrapped)
    return calls


@pytest.mark.parametrize("mapped", [True, False])
@pytest.mark.parametrize("mode", ["1", "auto"])
def test_o_direct_reads_load_the_same_verified_values(tmp_path, monkeypatch, mapped, mode):
    """LOAD_DIRECT 1 / auto on uncached files: O_DIRECT reads (mapped pieces and buffered ranges alike), same values."""
    src = _state()
    shardckpt.save({"model": src}, str(tmp_path / "ck"))
    monkeypatch.setattr(_knobs, "LOAD_DIRECT", mode)
    monkeypatch.setattr(_knobs, "LOAD_MAP", mapped)
    direct = _count(monkeypatch, "_direct_into")
    seen = _probed(monkeypatch)
    for _ in range(UNCACHE_TRIES):
        _uncache(tmp_path / "ck")
        direct.clear(), seen.clear()
        live = {k: torch.zeros_like(v) for k, v in src.items()}
        shardckpt.load({"model": live}, str(tmp_path / "ck"))
        for k, v in src.items():
            assert torch.equal(live[k], v), k
        if direct or False in seen or not seen:  # an uncached range was seen (or none was asked: mode 1)
            break
    if _takes_direct(tmp_path):
        assert direct, f"no O_DIRECT read of uncached ranges of >= 1 MiB (probes said {seen})"
    else:
        assert not direct


def test_auto_reads_cached_ranges_through_the_page_cache(tmp_path, monkeypatch):
    """auto: a file just read (its pages cached) is not read again with O_DIRECT."""
    src = _state()
    shardckpt.save({"model": src}, str(tmp_path / "ck"))
    for d, _, files in os.walk(tmp_path / "ck"):
        for n in files:
            (tmp_path / "ck" / os.path.relpath(os.path.join(d, n), tmp_path / "ck")).read_bytes()
    monkeypatch.setattr(_knobs, "LOAD_DIRECT", "auto")
    direct = _count(monkeypatch, "_direct_into")
    live = {k: torch.zeros_like(v) for k, v in src.items()}
    shardckpt.load({"model": live}, str(tmp_path / "ck"))
    assert all(torch.equal(live[k], v) for k, v in src.items())
    assert not direct


def test_o_direct_is_never_used_on_tmpfs(monkeypatch):
    """/dev/shm has no block queue: LOAD_DIRECT=1 reads it through the page cache (O_DIRECT there would only copy twice)."""
    if not os.path.isdir("/dev/shm"):
        pytest.skip("no /dev/shm on this machine")
    import tempfile

    d = tempfile.mkdtemp(prefix="shardckpt-cold-", dir="/dev/shm")
    os.chmod(d, 0o700)
    try:
        src = _state()
        shardckpt.save({"model": src}, d + "/ck")
        monkeypatch.setattr(_knobs, "LOAD_DIRECT", "1")
        direct = _count(monkeypatch, "_direct_into")
        hints = _count(monkeypatch, "_will_need")
        live = {k: torch.zeros_like(v) for k, v in src.items()}
        shardckpt.load({"model": live}, d + "/ck")
        assert all(torch.equal(live[k], v) for k, v in src.items())
        assert not direct and not hints
    finally:
        import shutil

        shutil.rmtree(d, ignore_errors=True)


def test_a_damaged_block_read_with_o_direct_is_refused(tmp_path, monkeypatch):
    """A flipped byte read by O_DIRECT: ChecksumMismatchError (every delivered byte verified, whichever way it was read)."""
    src = _state()
    shardckpt.save({"model": src}, str(tmp_path / "ck"))
    data = max((tmp_path / "ck").rglob("*.safetensors"), key=lambda p: p.stat().st_size)
    raw = bytearray(data.read_bytes())
    raw[len(raw) // 2] ^= 0x10
    data.write_bytes(bytes(raw))
    _uncache(tmp_path / "ck")
    monkeypatch.setattr(_knobs, "LOAD_DIRECT", "1")
    for mapped in (True, False):
        monkeypatch.setattr(_knobs, "LOAD_MAP", mapped)
        live = {k: torch.zeros_like(v) for k, v in src.items()}
        with pytest.raises(ChecksumMismatchError):
            shardckpt.load({"model": live}, str(tmp_path / "ck"))


@pytest.mark.parametrize("mode", ["0", "1"])
def test_a_read_past_the_end_of_a_file_is_short_either_way(tmp_path, monkeypatch, mode):
    """O_DIRECT returns the file's unaligned tail and stops: a read past the end raises EOFError, as a buffered one does."""
    monkeypatch.setattr(_knobs, "LOAD_DIRECT", mode)
    body = os.urandom(3 * MIB + 1000)
    (tmp_path / "f").write_bytes(body)
    _uncache(tmp_path)
    st = LocalStorage(str(tmp_path))
    buf = bytearray(2 * MIB)
    st.read_into("f", [(MIB + 7, memoryview(buf))])  # an unaligned start, inside the file
    assert bytes(buf) == body[MIB + 7 : 3 * MIB + 7]
    with pytest.raises(EOFError):
        st.read_into("f", [(2 * MIB, memoryview(bytearray(2 * MIB)))])
    mm, at = st.map_range("f", MIB + 5, 3 * MIB + 1000)
    try:
        assert bytes(memoryview(mm)[at : at + 2 * MIB + 995]) == body[MIB + 5 :]
    finally:
        mm.close()


def test_an_uncached_range_wider_than_the_readahead_window_is_asked_whole(tmp_path, monkeypatch):
    """LOAD_DIRECT=0, a device whose readahead window (128 KiB here) is smaller than a read: a WILLNEED of the range
    first when its pages are not cached, none when they are; on a window of half the read (1 MiB), none at all."""
    monkeypatch.setattr(_knobs, "LOAD_DIRECT", "0")
    body = os.urandom(2 * MIB)
    (tmp_path / "f").write_bytes(body)
    st = LocalStorage(str(tmp_path))
    hints = _count(monkeypatch, "_will_need")
    seen = _probed(monkeypatch)
    block = bool(_local.queue_info(str(tmp_path)))
    for window in (128 << 10, MIB):
        monkeypatch.setattr(_local, "_readahead_window", lambda path, w=window: w)
        for cached in (False, True):
            for _ in range(1 if cached else UNCACHE_TRIES):
                if cached:
                    (tmp_path / "f").read_bytes()
                else:
                    _uncache(tmp_path)
                hints.clear(), seen.clear()
                buf = bytearray(2 * MIB)
                st.read_into("f", [(0, memoryview(buf))])
                assert bytes(buf) == body
                if not seen or False in seen:  # not probed (the window rule), or seen uncached
                    break
            fd = os.open(str(tmp_path / "f"), os.O_RDONLY)
            try:
                probes = _local.is_cached(fd, 0) is not None  # RWF_NOWAIT works on this filesystem
            finally:
                os.close(fd)
            want = block and probes and not cached and window * _local.HINT_WINDOW_RATIO < 2 * MIB
            assert bool(hints) == want, (window, cached, hints, seen)
