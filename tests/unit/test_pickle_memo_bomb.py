"""Pickle memory bombs found by the long fuzz run on a 16-core box (torch 2.11).

A DCP ``.metadata`` whose ``LONG_BINPUT`` names memo slot ~2**31 made the C
unpickler allocate a 16+ GiB memo array (23-29 GiB peak seen) before any of
our checks ran; torch 2.11's weights-only unpickler let ``struct.error`` out on
a short length field. Both now come out as our errors, in bounded memory.
"""

from __future__ import annotations

import pickle
import resource
import struct
import subprocess
import sys
import textwrap

import pytest
import torch
from shardckpt.converters._dcp import check_pickle_bounds

import shardckpt
from shardckpt.errors import CheckpointError, UnsafeMetadataError


def _with_memo_bomb(data: bytes, index: int) -> bytes:
    # After the PROTO header: push None, store it in memo slot ``index``, pop it.
    assert data[:1] == pickle.PROTO
    return data[:2] + pickle.NONE + pickle.LONG_BINPUT + struct.pack("<I", index) + pickle.POP + data[2:]


def test_memo_index_far_past_the_stored_entries_is_refused_before_unpickling():
    data = _with_memo_bomb(pickle.dumps({"a": [1, 2, 3]}, protocol=2), 2**31 - 1)
    with pytest.raises(UnsafeMetadataError, match="memo index 2147483647 with 0 entries"):
        check_pickle_bounds(data, where="x/.metadata")


def test_memo_indices_a_pickler_writes_pass():
    obj = {"k": [("t", i) for i in range(300)], "shared": [1] * 3}
    for proto in (2, 3, 4, 5):
        check_pickle_bounds(pickle.dumps(obj, protocol=proto), where="x")


@pytest.mark.slow
def test_dcp_metadata_memo_bomb_is_refused_in_bounded_memory(tmp_path):
    import torch.distributed.checkpoint as dcp

    src = tmp_path / "dcp"
    dcp.save({"w": torch.arange(8.0)}, checkpoint_id=str(src), no_dist=True)
    meta = src / ".metadata"
    meta.write_bytes(_with_memo_bomb(meta.read_bytes(), 1_562_732_692))
    code = textwrap.dedent(
        f"""
        import resource, shardckpt.converters as c
        from shardckpt.errors import UnsafeMetadataError
        before = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
        try:
            c.from_dcp({str(src)!r}, {str(tmp_path / "out")!r})
        except UnsafeMetadataError as e:
            print("refused:", e)
        grown = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss - before
        print("grown_kib", grown)
        """
    )
    def cap():  # an address-space cap makes the unfixed code fail fast instead of eating the machine
        resource.setrlimit(resource.RLIMIT_AS, (6 << 30, 6 << 30))

    r = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=300, preexec_fn=cap)
    assert "refused:" in r.stdout and "memo index 1562732692" in r.stdout, r.stdout + r.stderr
    grown_kib = int(r.stdout.split("grown_kib")[1].split()[0])
    assert grown_kib < 256 * 1024, grown_kib
    assert not (tmp_path / "out").exists()


def test_truncated_torch_save_pickle_is_our_error(tmp_path):
    path = tmp_path / "model.pt"
    torch.save({"w": torch.arange(4.0)}, path, _use_new_zipfile_serialization=False)
    data = path.read_bytes()
    # Cut inside the legacy pickle stream: the unpickler meets a short length field.
    for cut in range(len(data) // 2, len(data) // 2 + 64, 7):
        path.write_bytes(data[:cut])
        with pytest.raises(CheckpointError):
            shardckpt.converters.from_torch_save(str(path), str(tmp_path / f"out{cut}"))
