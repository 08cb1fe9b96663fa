"""A commit racing another process's leftover removal (``remove_leftover``), interleaved on purpose.

Two managers under one root (unsupported, refused on the next save, see
test_fault_second_manager.py) can still race once: the retention of one sees
the other's step directory in flight (no manifest yet) and removes it as a
leftover, moving it aside first; finding a manifest there it puts it back. If
that move aside falls between the committer's manifest write and its second
file check, the committer used to see its files gone, declare the save failed
and remove its files, and the directory then came back committed with files
missing (seen once in CI as a step committed that no saver reported saved).
Here the move aside is placed exactly in that window, with real files and the
real ``remove_leftover``.
"""

from __future__ import annotations

import os
import threading
import time

import pytest
import torch

import shardckpt
from shardckpt._format import committed as _committed
from shardckpt._format.naming import MANIFEST_NAME, step_dir_name
from shardckpt._managed import retention
from shardckpt._storage import Storage
from shardckpt._storage._local import LocalStorage
from shardckpt.errors import SaveFailedError

#: How long the remover pauses between its move aside and its look for a manifest.
REMOVER_PAUSE_S = 0.5


def _state():
    g = torch.Generator().manual_seed(19)
    return {"w": torch.randn(64, 33, generator=g), "ids": torch.arange(100), "step": 19}


class _Remover(threading.Thread):
    """``remove_leftover`` of another process, pausing after its move aside (``put_back``: else it stops there, as if killed)."""

    def __init__(self, root: str, name: str, *, put_back: bool) -> None:
        super().__init__(daemon=True)
        self.root, self.name, self.put_back = root, name, put_back
        self.moved = threading.Event()
        self.error = None

    def run(self) -> None:
        storage = Storage(self.root)
        orig_exists = storage.exists

        def exists(rel: str) -> bool:
            if rel.startswith(retention.ASIDE_PREFIX):  # right after the move aside
                self.moved.set()
                time.sleep(REMOVER_PAUSE_S)
                if not self.put_back:
                    raise SystemExit  # the remover dies here, leaving the directory aside
            return orig_exists(rel)

        storage.exists = exists  # type: ignore[method-assign]
        try:
            retention.remove_leftover(storage, self.name)
        except SystemExit:
            pass
        except BaseException as e:  # pragma: no cover - reported by the test
            self.error = e


def _race_commit(monkeypatch, root: str, name: str, *, put_back: bool) -> _Remover:
    """Make the first manifest write under ``root/name`` be followed by another process moving the directory aside."""
    remover = _Remover(root, name, put_back=put_back)
    orig = LocalStorage.write_atomic

    def write_atomic(self, rel, data, **kw):
        orig(self, rel, data, **kw)
        if rel == MANIFEST_NAME and os.path.basename(self.root) == name and not remover.is_alive() and not remover.moved.is_set():
            remover.start()
            assert remover.moved.wait(30), "the remover never moved the directory aside"

    monkeypatch.setattr(LocalStorage, "write_atomic", write_atomic)
    return remover


def test_a_commit_whose_directory_is_moved_aside_and_back_stands(tmp_path, monkeypatch):
    root, name = str(tmp_path), step_dir_name(19)
    url = os.path.join(root, name)
    remover = _race_commit(monkeypatch, root, name, put_back=True)
    shardckpt.save(_state(), url)  # the second file check fails while the directory is aside: wait, then it checks out
    remover.join(30)
    assert remover.error is None, remover.error
    assert sorted(os.listdir(root)) == [name]  # put back, nothing left aside
    shardckpt.verify(url)
    got = {"w": torch.zeros(64, 33), "ids": torch.zeros(100, dtype=torch.int64), "step": -1}
    shardckpt.load(got, url)
    want = _state()
    assert torch.equal(got["w"], want["w"]) and torch.equal(got["ids"], want["ids"]) and got["step"] == 19


def test_a_commit_whose_directory_stays_aside_says_it_cannot_tell_and_keeps_its_files(tmp_path, monkeypatch):
    root, name = str(tmp_path), step_dir_name(19)
    url = os.path.join(root, name)
    monkeypatch.setattr(_committed, "MOVED_ASIDE_WAIT_S", 0.2)
    remover = _race_commit(monkeypatch, root, name, put_back=False)
    with pytest.raises(SaveFailedError, match="cannot tell whether") as ei:
        shardckpt.save(_state(), url)
    assert "vanished with its directory" in str(ei.value) and "files are kept" in str(ei.value)
    remover.join(30)
    (aside,) = os.listdir(root)
    assert aside.startswith(retention.ASIDE_PREFIX + name)
    os.rename(os.path.join(root, aside), url)  # what the remover would have done had it lived: the step is whole
    shardckpt.verify(url)
