"""Shapes no tensor can have are refused as damage when a checkpoint is opened, by every reader (issue 29, item 5).

A safetensors header holding ``[2**64, 0]`` (zero elements, so every byte
count matched) used to pass ``inspect``, ``verify`` and ``shardckpt import``
with exit 0, and ``load(None, ...)`` then failed with a foreign ``TypeError``
from ``torch.empty``. One check (``shape_problem``: every dimension fits
int64, and the elements of the non-zero dimensions times the item size fit
the int64 byte limit) runs in the native manifest parser (format 1 and 2+),
the safetensors header parser, DCP's metadata validation and the torch.save
importer; the CLI exits non-zero naming the tensor and the file.
"""

from __future__ import annotations

import json
import os
import pickle
import shutil
import struct
import subprocess
import sys
import warnings

import pytest
import torch

import shardckpt
from shardckpt import converters
from shardckpt._format import MAX_TENSOR_BYTES, shape_problem
from shardckpt._format.checksum import crc32c
from shardckpt._format.manifest import MANIFEST_CRC_FIELD, canonical_json
from shardckpt.errors import CorruptCheckpointError

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
GOLDEN_V1 = os.path.join(ROOT, "tests", "data", "v1_golden")

# Each holds no element or overflows int64 once multiplied out; none is a tensor.
IMPOSSIBLE = [[2**64, 0], [2**63, 0], [2**62, 2**62, 0], [2**40, 2**40], [2**61, 4]]


@pytest.mark.parametrize(
    "shape, item, bad",
    [
        ([], 4, False),
        ([0], 8, False),
        ([3, 0], 4, False),
        ([MAX_TENSOR_BYTES, 0], 1, False),  # torch.empty accepts it (zero elements)
        ([2**61 - 1], 4, False),
        ([2**61], 4, True),  # 2**63 bytes
        ([2**64, 0], 4, True),
        ([2**62, 2**62, 0], 4, True),
        ([-1], 1, True),
        ([True], 1, True),
        ([1.0], 1, True),
        ("12", 1, True),
    ],
)
def test_shape_problem_matches_what_torch_can_allocate(shape, item, bad):
    assert (shape_problem(shape, item) is not None) is bad
    if not bad:  # what passes, torch can describe (on the meta device: no bytes)
        torch.empty(shape, dtype={1: torch.uint8, 4: torch.float32, 8: torch.float64}[item], device="meta")


def _cli(*args):
    return subprocess.run([sys.executable, "-m", "shardckpt", *map(str, args)], capture_output=True, text=True, timeout=300)


def _assert_cli_refuses(p, *named):
    assert p.returncode != 0, (p.returncode, p.stdout, p.stderr)
    assert "Traceback" not in p.stderr and "TypeError" not in p.stderr, p.stderr
    assert "cannot be a tensor's" in p.stderr, p.stderr
    for n in named:
        assert n in p.stderr, (n, p.stderr)


def _resign(d: str, edit) -> None:
    path = os.path.join(d, "manifest.json")
    raw = json.loads(open(path, "rb").read())
    edit(raw)
    if raw.pop(MANIFEST_CRC_FIELD, None) is not None:  # format 1 has none
        raw[MANIFEST_CRC_FIELD] = crc32c(canonical_json(raw))
    with open(path, "wb") as f:
        f.write(canonical_json(raw))


@pytest.mark.parametrize("shape", IMPOSSIBLE)
def test_native_manifest_refuses_it(tmp_path, shape):
    d = str(tmp_path / "ck")
    shardckpt.save({"w": torch.ones(2), "z": torch.empty(3, 0)}, d)

    def edit(raw):
        raw["tensors"]["z"]["shape"] = shape

    _resign(d, edit)
    with pytest.raises(CorruptCheckpointError, match="'z'.*cannot be a tensor's"):
        shardckpt.inspect(d)
    with pytest.raises(CorruptCheckpointError, match="cannot be a tensor's"):
        shardckpt.load(None, d)
    with pytest.raises(CorruptCheckpointError, match="cannot be a tensor's"):
        shardckpt.load({"w": torch.zeros(2), "z": torch.empty(3, 0)}, d)
    if shape == IMPOSSIBLE[0]:  # the CLI once (a process each)
        for cmd in ("inspect", "verify"):
            _assert_cli_refuses(_cli(cmd, d), "'z'", "manifest.json")


def test_format_1_manifest_refuses_it(tmp_path):
    d = str(tmp_path / "v1")
    shutil.copytree(GOLDEN_V1, d)
    raw = json.loads(open(os.path.join(d, "manifest.json"), "rb").read())
    name = sorted(raw["tensors"])[0]

    def edit(raw):
        t = raw["tensors"][name]
        t["shape"] = [2**64] + [0] * len(t["shape"])
        for c in t["chunks"]:
            c["offsets"], c["sizes"], c["nbytes"] = [0] * len(t["shape"]), list(t["shape"]), 0

    _resign(d, edit)
    with pytest.raises(CorruptCheckpointError, match="cannot be a tensor's"):
        shardckpt.inspect(d)
    _assert_cli_refuses(_cli("verify", d), repr(name))


def _hf_file(path: str, shape) -> None:
    h = json.dumps({"ok": {"dtype": "F32", "shape": [2], "data_offsets": [0, 8]}, "w": {"dtype": "F32", "shape": shape, "data_offsets": [8, 8]}}).encode()
    with open(path, "wb") as f:
        f.write(struct.pack("<Q", len(h)) + h + b"\0" * 8)


@pytest.mark.parametrize("shape", [[2**64, 0], [2**62, 2**62, 0]])
def test_hf_safetensors_header_refuses_it(tmp_path, shape):
    d = tmp_path / "hf"
    d.mkdir()
    _hf_file(str(d / "model.safetensors"), shape)
    with pytest.raises(CorruptCheckpointError, match="'w'.*cannot be a tensor's"):
        shardckpt.inspect(str(d))
    with pytest.raises(CorruptCheckpointError, match="cannot be a tensor's"):
        shardckpt.load(None, str(d))
    if shape != [2**64, 0]:
        return  # the CLI once (a process each)
    for cmd in ("inspect", "verify"):
        _assert_cli_refuses(_cli(cmd, d), "'w'", "model.safetensors")
    _assert_cli_refuses(_cli("import", d / "model.safetensors", tmp_path / "out"), "'w'", "model.safetensors")
    assert not os.path.exists(tmp_path / "out" / "manifest.json")


def test_dcp_metadata_refuses_it_at_open(tmp_path):
    import torch.distributed.checkpoint as dcp

    d = str(tmp_path / "dcp")
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        dcp.save({"w": torch.ones(4), "z": torch.empty(3, 0)}, checkpoint_id=d)
    path = os.path.join(d, ".metadata")
    with open(path, "rb") as f:
        md = pickle.load(f)
    md.state_dict_metadata["z"].size = (2**64, 0)
    md.state_dict_metadata["z"].chunks[0].sizes = (2**64, 0)
    with open(path, "wb") as f:
        pickle.dump(md, f)
    with pytest.raises(CorruptCheckpointError, match=r"\.metadata: entry 'z'.*cannot be a tensor's"):
        converters.from_dcp(d, str(tmp_path / "out"))
    _assert_cli_refuses(_cli("import", d, tmp_path / "out2"), "'z'", ".metadata")


class _ImpossibleTensor:
    """Pickles as torch's own tensor record, with a size no tensor has."""

    def __init__(self, size, stride):
        self.t, self.size, self.stride = torch.zeros(4), size, stride

    def __reduce_ex__(self, proto):
        import collections

        return (torch._utils._rebuild_tensor_v2, (self.t.untyped_storage(), 0, self.size, self.stride, False, collections.OrderedDict()))


@pytest.mark.parametrize("size, stride", [((2**64, 0), (0, 1)), ((2**62, 2**62, 0), (0, 0, 1))])
def test_torch_save_refuses_it(tmp_path, size, stride):
    # torch's unpickler itself refuses these (the tensor is never built, so
    # its name is not known yet): our error, naming the file, exit non-zero.
    path = str(tmp_path / "bad.pt")
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        torch.save({"w": torch.ones(2), "z": _ImpossibleTensor(size, stride)}, path)
    with pytest.raises(CorruptCheckpointError, match="bad.pt"):
        converters.from_torch_save(path, str(tmp_path / "out"))
    p = _cli("import", path, tmp_path / "out2")
    assert p.returncode == 2 and "bad.pt" in p.stderr and "Traceback" not in p.stderr, p.stderr
