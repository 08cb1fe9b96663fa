"""The memory tier's slots (issue 42, case 4): their space reserved when made; which files each rank's slots need.

Slot space is reserved when a slot file is made: ``posix_fallocate``, else zeros written.

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


def _facts(sizes_by_rank):
    """Probe facts as ``Snapshots.save`` exchanges them: (node, own, free, mapped, why, sizes, pin)."""
    return [(f"n{r // 2}", sum(sz), 1 << 40, 0, None, tuple(sz), r == 3) for r, sz in enumerate(sizes_by_rank)]


def test_slot_files_follow_the_peer_map_and_the_receive_order():
    many = list(range(1000, 1000 + 101))  # 101 files: "-100" sorts before "-11", as the background receives them
    facts = _facts([[10, 11], [20], [30], many])
    node_of = {r: f[0] for r, f in enumerate(facts)}
    peers = {0: 2, 1: 3, 2: 0, 3: 0}  # rank 0 keeps the copies of ranks 2 and 3 (node n1)
    got = snapshot._slot_files(facts, peers, node_of)
    names = sorted(range(101), key=lambda i: f"{i:02d}")
    assert names[:13] == [*range(11), 100, 11]  # 00 .. 10, 100, 11, ...
    assert got[0] == ((10, 11), (30, *[many[i] for i in names]), False)
    assert got[1] == ((20,), (), False)  # its peer (rank 3) keeps its copy; nobody sends to it
    assert got[2] == ((30,), (10, 11), False)
    assert got[3] == (tuple(many), (20,), True)
    # A peer on the same node is no second copy: nothing kept for it.
    assert snapshot._slot_files(facts, {0: 1, 1: 0, 2: 3, 3: 2}, node_of)[0] == ((10, 11), (), False)
