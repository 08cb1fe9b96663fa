"""Slot space is reserved when a slot file is made (issue 42, case 4): ``posix_fallocate``, else zeros written.

A mapped file whose pages are not allocated gets them at the first write, and
a full filesystem then kills the writer with SIGBUS; ``reserve`` allocates them
up front so a full filesystem is an ``OSError`` (``ENOSPC``) instead. The
fallback (no ``posix_fallocate``, as on macOS, or a filesystem that refuses
it) is played here by taking ``os.posix_fallocate`` away or making it refuse;
the full-tmpfs case itself runs in ``tests/dist/test_memory_promises.py``.
"""

import errno
import os

import pytest

from shardckpt._memory import snapshot

SIZE = (3 << 20) + 5  # not a multiple of the zero buffer or of a page


def _allocated(path):
    st = os.stat(path)
    return st.st_size, st.st_blocks * 512


@pytest.mark.parametrize("how", ["fallocate", "refused", "missing"])
def test_reserve_allocates_every_page(tmp_path, monkeypatch, how):
    if how == "refused":
        def refuse(fd, offset, length):
            raise OSError(errno.EOPNOTSUPP, "Operation not supported")
        monkeypatch.setattr(os, "posix_fallocate", refuse, raising=False)
    elif how == "missing":
        monkeypatch.delattr(os, "posix_fallocate", raising=False)
    elif not hasattr(os, "posix_fallocate"):
        pytest.skip("no posix_fallocate on this platform")
    path = str(tmp_path / "slot")
    fd = os.open(path, os.O_RDWR | os.O_CREAT, 0o600)
    try:
        os.ftruncate(fd, SIZE)
        assert _allocated(path)[1] < SIZE  # sparse: nothing allocated yet
        snapshot.reserve(fd, SIZE)
    finally:
        os.close(fd)
    size, allocated = _allocated(path)
    assert size == SIZE and allocated >= SIZE
    with open(path, "rb") as f:
        assert f.read() == bytes(SIZE)  # the file reads as zeros either way


def test_no_space_is_an_error_naming_the_slot(tmp_path, monkeypatch):
    def full(fd, offset, length):
        raise OSError(errno.ENOSPC, "No space left on device")

    monkeypatch.setattr(os, "posix_fallocate", full, raising=False)
    path = str(tmp_path / ".slot-r00000-p1-tag-token-own0-0")
    with pytest.raises(OSError) as ei:
        snapshot._ShmFile(path, SIZE, pin=False)
    assert ei.value.errno == errno.ENOSPC and path in str(ei.value) and str(SIZE) in str(ei.value)
    assert not os.path.exists(path)  # nothing left behind
