"""Hostile files never hang, never read unboundedly, never lead outside the checkpoint; only our types come out.

Regression tests of issue 11 ("Hangs and resource exhaustion", "Wrong
exception types"): ``manifest.json`` / ``model.safetensors.index.json`` as a
FIFO, a link to ``/dev/zero``, a directory, a symlink loop; the CLI exits 1
for a damaged checkpoint.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import threading

import pytest
import torch
from safetensors.torch import save_file

import shardckpt
from shardckpt._storage import Storage
from shardckpt.errors import CheckpointError, CorruptCheckpointError, StorageError, UnreadableFileError

#: A call on a hostile file must give up within this many seconds (a hang never does).
BOUND_S = 20


def _bounded(fn):
    """``fn()``'s exception (or None), failing the test if it does not return within BOUND_S."""
    out = {}

    def run():
        try:
            fn()
            out["exc"] = None
        except BaseException as e:  # noqa: BLE001 - the test inspects it
            out["exc"] = e

    t = threading.Thread(target=run, daemon=True)
    t.start()
    t.join(BOUND_S)
    assert not t.is_alive(), f"{fn} did not return within {BOUND_S}s (a hang)"
    return out["exc"]


def _unblock(path):
    """Open a FIFO's write end (non-blocking) so a reader stuck on it, if any, wakes up."""
    try:
        os.close(os.open(path, os.O_WRONLY | os.O_NONBLOCK))
    except OSError:
        pass


@pytest.fixture
def ck(tmp_path):
    url = tmp_path / "ck"
    shardckpt.save({"w": torch.arange(6.0), "step": 3}, str(url))
    return url


def _hf_dir(tmp_path):
    d = tmp_path / "hf"
    d.mkdir()
    save_file({"w": torch.ones(2)}, str(d / "model-00001-of-00001.safetensors"))
    (d / "model.safetensors.index.json").write_text(json.dumps({"weight_map": {"w": "model-00001-of-00001.safetensors"}}))
    return d


CALLS = {
    "inspect": lambda url: shardckpt.inspect(str(url)),
    "verify": lambda url: shardckpt.verify(str(url)),
    "load": lambda url: shardckpt.load({"w": torch.zeros(6), "step": 0}, str(url), strict=False),
}


@pytest.mark.parametrize("call", sorted(CALLS))
def test_manifest_as_a_fifo_never_hangs(ck, call):
    (ck / "manifest.json").unlink()
    os.mkfifo(ck / "manifest.json")
    try:
        exc = _bounded(lambda: CALLS[call](ck))
    finally:
        _unblock(ck / "manifest.json")
    assert isinstance(exc, CorruptCheckpointError) and "FIFO" in str(exc), repr(exc)


@pytest.mark.parametrize("call", sorted(CALLS))
def test_manifest_linked_to_dev_zero_is_never_read(ck, call):
    (ck / "manifest.json").unlink()
    os.symlink("/dev/zero", ck / "manifest.json")
    exc = _bounded(lambda: CALLS[call](ck))
    assert isinstance(exc, UnreadableFileError) and "out of the checkpoint" in str(exc), repr(exc)


def test_hf_index_as_a_fifo_never_hangs(tmp_path):
    d = _hf_dir(tmp_path)
    (d / "model.safetensors.index.json").unlink()
    os.mkfifo(d / "model.safetensors.index.json")
    try:
        exc = _bounded(lambda: shardckpt.inspect(str(d)))
    finally:
        _unblock(d / "model.safetensors.index.json")
    assert isinstance(exc, CorruptCheckpointError), repr(exc)


def test_hf_index_linked_to_dev_zero_is_never_read(tmp_path):
    d = _hf_dir(tmp_path)
    (d / "model.safetensors.index.json").unlink()
    os.symlink("/dev/zero", d / "model.safetensors.index.json")
    exc = _bounded(lambda: shardckpt.inspect(str(d)))
    assert isinstance(exc, CorruptCheckpointError), repr(exc)


def test_read_bytes_reads_at_most_the_limit_whatever_the_size_says(tmp_path):
    # A FIFO reports size 0; with a writer holding more than the limit, a
    # read that trusted st_size would not stop. It is refused before any byte.
    st = Storage(str(tmp_path))
    os.mkfifo(tmp_path / "pipe")
    exc = _bounded(lambda: st.read_bytes("pipe", limit=10))
    _unblock(tmp_path / "pipe")
    assert isinstance(exc, UnreadableFileError)
    (tmp_path / "big").write_bytes(b"x" * 100)
    with pytest.raises(shardckpt.UnsafeMetadataError, match="10-byte limit"):
        st.read_bytes("big", limit=10)


def test_storage_read_errors_are_ours_and_still_oserrors(tmp_path):
    st = Storage(str(tmp_path))
    os.symlink("loop", tmp_path / "loop")
    (tmp_path / "d").mkdir()
    for rel in ("loop", "d", "x" * 400):
        with pytest.raises(OSError) as ei:
            st.read_bytes(rel, limit=100)
        assert isinstance(ei.value, (UnreadableFileError, FileNotFoundError)), repr(ei.value)
        if not isinstance(ei.value, FileNotFoundError):
            assert isinstance(ei.value, CheckpointError) and rel[:20] in str(ei.value)
    with pytest.raises(FileNotFoundError):
        st.read_bytes("missing", limit=10)
    # A path through a regular file names nothing: missing, as before.
    (tmp_path / "f").write_text("x")
    with pytest.raises(NotADirectoryError):
        st.size("f/inner")


def test_unreadable_for_other_reasons_is_a_storage_error(tmp_path):
    if os.geteuid() == 0:
        pytest.skip("root reads files whatever their mode")
    (tmp_path / "secret").write_text("x")
    os.chmod(tmp_path / "secret", 0)
    with pytest.raises(StorageError):
        Storage(str(tmp_path)).read_bytes("secret", limit=10)


def _cli(*args):
    return subprocess.run(
        [sys.executable, "-m", "shardckpt", *map(str, args)], capture_output=True, text=True, timeout=120
    )


def test_cli_verify_exits_1_for_damage_in_the_manifest(ck):
    (ck / "manifest.json").unlink()
    os.mkfifo(ck / "manifest.json")
    p = _cli("verify", ck)
    assert p.returncode == 1, p.stderr
    assert "DAMAGED" in p.stderr and "FIFO" in p.stderr and "Traceback" not in p.stderr


def test_cli_verify_exits_1_for_a_deeply_nested_manifest(ck):
    (ck / "manifest.json").write_text('{"values":' + "[" * 100000 + "]" * 100000 + "}")
    p = _cli("verify", ck)
    assert p.returncode == 1, p.stderr
    assert "Recursion" not in p.stderr and "Traceback" not in p.stderr


class NoCredentialsError(Exception):
    """Stands for botocore's (same name, not an OSError): what s3fs raises without credentials."""


def test_a_backends_own_exception_becomes_a_storage_error_with_a_credentials_hint(tmp_path, monkeypatch):
    from shardckpt._storage import _local

    def no_credentials(self, path, start, end):
        raise NoCredentialsError("Unable to locate credentials")

    monkeypatch.setattr(_local.LocalStorage, "_read", no_credentials)
    with pytest.raises(StorageError, match="storage_options") as ei:
        shardckpt.inspect(str(tmp_path))
    assert "Unable to locate credentials" in str(ei.value)
