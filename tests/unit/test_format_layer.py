"""The format layer (``shardckpt._format``): torch-free verify/inspect, the one commit, open_manifest's not-found advice.

Checkpoints are written by the real engine; the torch-free checks run in a
fresh interpreter where ``import torch`` fails, as on a machine without it.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest
import torch

import shardckpt
from shardckpt import _format
from shardckpt._format import committed as commit_mod
from shardckpt._format.values import TAG, plain_values, tensor_ref
from shardckpt._storage import Storage
from shardckpt.errors import (
    CheckpointError,
    CheckpointNotFoundError,
    ChecksumMismatchError,
    CorruptCheckpointError,
)

NO_TORCH = "import sys; sys.modules['torch'] = None\n"


def _no_torch(code: str) -> subprocess.CompletedProcess:
    """Run ``code`` in a fresh interpreter in which ``import torch`` raises."""
    env = dict(os.environ, PYTHONWARNINGS="ignore")
    return subprocess.run([sys.executable, "-c", NO_TORCH + code], capture_output=True, text=True, timeout=300, env=env)


def _state(seed=0):
    g = torch.Generator().manual_seed(seed)
    return {"model": {"w": torch.randn(16, 8, generator=g), "b": torch.zeros(8)}, "step": 3, "lr": float("nan")}


@pytest.fixture()
def ck(tmp_path):
    d = tmp_path / "ck"
    shardckpt.save(_state(), str(d))
    return d


def _flip_a_byte(d, tensor="model.w"):
    c = shardckpt.inspect(str(d)).tensors[tensor].chunks[0]
    path = d / c.file
    raw = bytearray(path.read_bytes())
    raw[c.byte_offset + 5] ^= 0x10
    path.write_bytes(bytes(raw))
    return c.file


# --------------------------------------------------------------------------
# torch-free verify / inspect


def test_verify_and_inspect_run_without_torch(ck):
    p = _no_torch(
        "import shardckpt\n"
        f"m = shardckpt.verify({str(ck)!r}, no_dist=True)\n"
        f"i = shardckpt.inspect({str(ck)!r}, no_dist=True)\n"
        "print(m.world_size, sorted(m.tensors), i.total_bytes, i.values['step'])\n"
        "assert sys.modules['torch'] is None\n"
    )
    assert p.returncode == 0, p.stderr
    assert p.stdout.split() == ["1", "['model.b',", "'model.w']", str((16 * 8 + 8) * 4), "3"]


def test_verify_without_torch_finds_damage(ck):
    rel = _flip_a_byte(ck)
    p = _no_torch(
        "import shardckpt\n"
        "from shardckpt.errors import ChecksumMismatchError\n"
        "try:\n"
        f"    shardckpt.verify({str(ck)!r})\n"
        "except ChecksumMismatchError as e:\n"
        "    print('CAUGHT', e)\n"
    )
    assert p.returncode == 0, p.stderr
    assert p.stdout.startswith("CAUGHT") and rel in p.stdout and "'model.w'" in p.stdout and "1 problem)" in p.stdout


def test_cli_verify_and_inspect_without_torch(ck):
    p = _no_torch(f"from shardckpt._cli import main; sys.exit(main(['verify', {str(ck)!r}]))")
    assert p.returncode == 0 and p.stdout.startswith("OK ") and "2 tensors, 2 chunks, 1 file," in p.stdout, p.stderr
    p = _no_torch(f"from shardckpt._cli import main; sys.exit(main(['inspect', {str(ck)!r}, '--values']))")
    assert p.returncode == 0 and "model.w" in p.stdout and '"step": 3' in p.stdout, p.stderr
    _flip_a_byte(ck)
    p = _no_torch(f"from shardckpt._cli import main; sys.exit(main(['verify', {str(ck)!r}]))")
    assert p.returncode == 1 and "DAMAGED" in p.stderr and "model.w" in p.stderr


def test_verify_damage_report_is_capped(tmp_path):
    d = tmp_path / "many"
    shardckpt.save({f"t{i:02d}": torch.full((4,), float(i)) for i in range(25)}, str(d))
    for i in range(25):
        _flip_a_byte(d, f"t{i:02d}")
    with pytest.raises(ChecksumMismatchError) as e:
        shardckpt.verify(str(d))
    msg = str(e.value)
    assert "(25 problems)" in msg and "... (5 more)" in msg and msg.count("crc32c") == 20


def test_reprs_are_short(tmp_path):
    d = tmp_path / "big"
    shardckpt.save({"model": {f"layer{i}.weight": torch.zeros(3) for i in range(300)}, "step": 1}, str(d))
    for m in (shardckpt.inspect(str(d)), shardckpt.verify(str(d))):
        r = repr(m)
        assert len(r) < 400 and r.count("\n") == 0, r
        assert "300 tensors" in r and "1 file" in r and "(295 more)" in r and "world_size=1" in r


# --------------------------------------------------------------------------
# values codec


def test_values_codec_round_trip_and_plain_view():
    from shardckpt._format.values import decode_value, encode_value

    assert decode_value(encode_value(float("-inf"), "x")) == float("-inf")
    assert decode_value(encode_value(torch.bfloat16, "x")) is torch.bfloat16
    assert decode_value(encode_value(torch.device("cpu"), "x")) == torch.device("cpu")
    tree = {
        "model": {"w": tensor_ref("model.w")},
        "opt": {"param_groups": [{"lr": {TAG: "float", "value": "nan"}, "params": [tensor_ref("a"), tensor_ref("b")]}]},
        "dims": {TAG: "tuple", "items": [1, 2]},
        "ids": {TAG: "dict", "items": [[1, "one"], [2, tensor_ref("t")]]},
        "step": 7,
    }
    assert plain_values(tree) == {"opt": {"param_groups": [{"lr": "nan"}]}, "dims": [1, 2], "ids": {"1": "one"}, "step": 7}
    assert plain_values({"model": {"w": tensor_ref("w")}}) is None


def test_values_codec_imports_no_torch_until_a_dtype_is_decoded():
    p = _no_torch(
        "from shardckpt._format.values import decode_value, encode_value, plain_values\n"
        "assert decode_value({'__shardckpt__': 'tuple', 'items': [1, {'__shardckpt__': 'float', 'value': 'nan'}]})[0] == 1\n"
        "assert plain_values({'__shardckpt__': 'dtype', 'value': 'bfloat16'}) == 'torch.bfloat16'\n"
        "try:\n"
        "    encode_value(object(), 'x.y')\n"
        "except TypeError as e:\n"
        "    assert 'x.y' in str(e)\n"
        "else:\n"
        "    raise SystemExit('no error')\n"
    )
    assert p.returncode == 0, p.stderr


# --------------------------------------------------------------------------
# commit


def test_failed_commit_puts_the_old_index_back(ck, monkeypatch):
    old_index = (ck / _format.HF_INDEX_NAME).read_bytes()
    old_manifest = (ck / _format.MANIFEST_NAME).read_bytes()
    real = Storage.write_atomic

    def fail_on_manifest(self, rel, data, **kw):
        if rel == _format.MANIFEST_NAME:
            raise OSError("disk full")
        return real(self, rel, data, **kw)

    monkeypatch.setattr(Storage, "write_atomic", fail_on_manifest)
    with pytest.raises(shardckpt.SaveFailedError, match="disk full"):
        shardckpt.save({"other": torch.ones(3)}, str(ck), overwrite=True)
    monkeypatch.undo()
    assert (ck / _format.HF_INDEX_NAME).read_bytes() == old_index
    assert (ck / _format.MANIFEST_NAME).read_bytes() == old_manifest
    state = {k: v for k, v in _state(seed=1).items()}
    shardckpt.load(state, str(ck))
    assert torch.equal(state["model"]["w"], _state()["model"]["w"])
    shardckpt.verify(str(ck))


def test_replacing_commit_removes_stale_files(ck):
    before = set(os.listdir(ck / "data"))
    shardckpt.save({"x": torch.ones(2)}, str(ck), overwrite=True)
    after = set(os.listdir(ck / "data"))
    assert after and not (after & before), "the replaced checkpoint's data files are gone"
    assert shardckpt.verify(str(ck)).tensors.keys() == {"x"}
    index = json.loads((ck / _format.HF_INDEX_NAME).read_text())
    assert set(index["weight_map"]) == {"x"}


def test_converters_commit_through_the_format_layer(ck, tmp_path, monkeypatch):
    calls = []
    real = commit_mod.commit

    def spy(storage, manifest, *, replace=False):
        calls.append((storage.url, replace))
        return real(storage, manifest, replace=replace)

    import shardckpt.converters._common as common

    monkeypatch.setattr(common, "commit", spy)
    out = tmp_path / "rs"
    shardckpt.converters.reshard(str(ck), str(out), world_size=2)
    assert calls == [(str(out), False)]
    assert shardckpt.verify(str(out)).world_size == 2


# --------------------------------------------------------------------------
# not found: say what is there


def _not_found(url) -> str:
    with pytest.raises(CheckpointNotFoundError) as e:
        shardckpt.inspect(str(url))
    assert isinstance(e.value, CheckpointError) and isinstance(e.value, FileNotFoundError)
    return str(e.value)


def test_not_found_names_what_is_there(tmp_path):
    mgr = shardckpt.CheckpointManager(str(tmp_path / "run"))
    for step in (10, 20):
        mgr.save(step, {"w": torch.ones(2)})
    msg = _not_found(tmp_path / "run")
    assert "step-00000010" in msg and "step-00000020" in msg and "CheckpointManager" in msg

    import torch.distributed.checkpoint as dcp

    dcp.save({"w": torch.ones(2)}, checkpoint_id=str(tmp_path / "dcp"), no_dist=True)
    assert "converters.from_dcp" in _not_found(tmp_path / "dcp")

    torch.save({"w": torch.ones(2)}, str(tmp_path / "model.pt"))
    torch.save({"w": torch.ones(2)}, str(tmp_path / "weights.data"))  # zip by content, not by name
    torch.save({"w": torch.ones(2)}, str(tmp_path / "old.bin"), _use_new_zipfile_serialization=False)
    for f in ("model.pt", "weights.data", "old.bin"):
        assert "converters.from_torch_save" in _not_found(tmp_path / f), f

    (tmp_path / "notes.txt").write_text("hello")
    msg = _not_found(tmp_path / "notes.txt")
    assert "is a file" in msg and "from_torch_save" not in msg

    other = tmp_path / "other"
    other.mkdir()
    for i in range(8):
        (other / f"f{i}.txt").write_text("x")
    msg = _not_found(other)
    assert "f0.txt" in msg and "(3 more)" in msg

    (tmp_path / "empty").mkdir()
    assert "empty" in _not_found(tmp_path / "empty")

    msg = _not_found(tmp_path / "rnu")
    assert "does not exist" in msg and "manifest.json is missing" in msg and str(tmp_path / "run") in msg


def test_not_found_from_load_and_a_path_below_a_file(tmp_path):
    torch.save({"w": torch.ones(2)}, str(tmp_path / "model.pt"))
    with pytest.raises(CheckpointNotFoundError, match="from_torch_save"):
        shardckpt.load({"w": torch.zeros(2)}, str(tmp_path / "model.pt"))
    # Below a file: NotADirectoryError must not escape.
    with pytest.raises(CheckpointNotFoundError, match="does not exist"):
        shardckpt.inspect(str(tmp_path / "model.pt" / "step-1"))


def test_unfinished_save_is_named(ck):
    os.remove(ck / _format.MANIFEST_NAME)
    with pytest.raises(CheckpointNotFoundError, match="never finished"):
        shardckpt.inspect(str(ck))


def test_not_found_without_torch(tmp_path):
    (tmp_path / "run" / "step-00000001").mkdir(parents=True)
    p = _no_torch(
        "from shardckpt._cli import main\n"
        f"sys.exit(main(['verify', {str(tmp_path / 'run')!r}]))"
    )
    assert p.returncode == 2 and "step-00000001" in p.stderr and p.stderr.count("\n") == 1, p.stderr


def test_header_limit_does_not_break_hf(tmp_path):
    from safetensors.torch import save_file

    save_file({"a": torch.ones(3)}, str(tmp_path / "m.safetensors"))
    m = shardckpt.inspect(str(tmp_path / "m.safetensors"))
    assert m.source == _format.SOURCE_SAFETENSORS and "safetensors files" in repr(m)
    assert json.loads(json.dumps(m.to_json()))["tensors"]["a"]["shape"] == [3]
    with pytest.raises(CorruptCheckpointError):
        (tmp_path / "bad.safetensors").write_bytes(b"\xff" * 16)
        shardckpt.inspect(str(tmp_path / "bad.safetensors"))


# -- the version table and the one manifest builder (pure) -------------------------------


def test_every_version_is_one_table_entry_and_the_newest_is_written():
    from shardckpt._format import FORMAT_VERSION
    from shardckpt._format.versions import NEWEST, VERSIONS, spec

    assert FORMAT_VERSION == NEWEST == max(VERSIONS)
    assert [v for v in VERSIONS if spec(v).chunk_lists] == [1]
    assert all(spec(v).block_checksums == spec(v).manifest_crc for v in VERSIONS)
    with pytest.raises(ValueError, match="format_version 99"):
        spec(99)


def test_the_manifest_builder_files_each_ranks_output_and_refuses_a_gap():
    from shardckpt._format import ChunkMeta, TensorMeta, manifest_from_bytes, manifest_to_bytes
    from shardckpt._format.build import RankOutput, build_manifest

    def chunk(rel, row):
        return ChunkMeta(rel, f"w@{row}", [row, 0], [1, 2], 8, 8, 0)

    outs = [RankOutput(1, [("w", chunk("b", 1))], {"b": 16}, ("i1", 10, 7)), RankOutput(0, [("w", chunk("a", 0))], {"a": 16})]
    m = build_manifest({"w": TensorMeta("F32", [2, 2])}, outs, world_size=2, values={"w": tensor_ref("w")},
                       save_id="s", block_bytes=1 << 20)
    assert m.tensors["w"].writers == [0, 1] and sorted(m.files) == ["a", "b", "i1"] and m.indexes["i1"].rank == 1
    assert manifest_from_bytes(manifest_to_bytes(m)).tensors["w"].writers == [0, 1]
    with pytest.raises(AssertionError, match="do not tile"):
        build_manifest({"w": TensorMeta("F32", [2, 2])}, outs[:1], world_size=2, values=None, save_id="s", block_bytes=1 << 20)
