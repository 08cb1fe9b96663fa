"""Crafted inputs cost what their bytes are worth and fail with our errors (issue 20).

A re-signed manifest whose layout record enumerates millions of shards, entries
sharing one stored byte range in each foreign format (HF safetensors, DCP,
torch.save), a DCP ``.metadata`` with wrong types or a path nested 100k deep,
and a ``torch.save`` pickle nested 100k deep.
"""

from __future__ import annotations

import json
import os
import pickle
import struct
import time
import warnings
import zipfile

import pytest
import torch

import shardckpt
from shardckpt import converters
from shardckpt._format.checksum import crc32c
from shardckpt._format.manifest import MANIFEST_CRC_FIELD, canonical_json
from shardckpt.errors import CheckpointError, CorruptCheckpointError, UnsafeMetadataError


def _tree_bytes(d) -> int:
    return sum(os.path.getsize(os.path.join(p, f)) for p, _, fs in os.walk(d) for f in fs)


# -- a layout record enumerating 2**24 shards ---------------------------------------------------


def test_a_layout_record_of_two_to_the_24_shards_is_refused_before_enumerating(tmp_path):
    src, dst = str(tmp_path / "src"), str(tmp_path / "dst")
    shardckpt.save({"model": {"w": torch.arange(4096.0).reshape(64, 64)}}, src)
    converters.reshard(src, dst, world_size=2)
    path = os.path.join(dst, "manifest.json")
    raw = json.loads(open(path, "rb").read())
    # As a format v2 manifest (plain file maps): v3's file table would need an
    # entry per rank, so a v3 manifest cannot claim 2**24 ranks cheaply.
    from shardckpt._format.committed import open_manifest

    m = open_manifest(dst)
    raw.pop("file_table", None)
    raw["format_version"] = 2
    raw["files"] = {k: v.to_json() for k, v in m.files.items()}
    raw["indexes"] = {k: v.to_json() for k, v in m.indexes.items()}
    n = 1 << 24
    raw["world_size"] = n
    for t in raw["tensors"].values():
        t["regular"]["mesh_shape"] = [n]
    raw.pop(MANIFEST_CRC_FIELD)
    raw[MANIFEST_CRC_FIELD] = crc32c(canonical_json(raw))
    with open(path, "wb") as f:
        f.write(canonical_json(raw))
    for op in (shardckpt.inspect, shardckpt.verify):
        t0 = time.process_time()
        with pytest.raises(UnsafeMetadataError, match="16777216 shard coordinates"):
            op(dst)
        assert time.process_time() - t0 < 5  # bounded: not one step per shard (2**24 steps take minutes)
    # restore() skips it like damage.
    root = tmp_path / "run"
    os.makedirs(root)
    os.rename(dst, root / "step-00000002")
    mgr = shardckpt.CheckpointManager(str(root))
    mgr.save(1, {"model": {"w": torch.ones(64, 64)}})
    live = {"model": {"w": torch.zeros(64, 64)}}
    assert mgr.restore(live) == 1 and torch.equal(live["model"]["w"], torch.ones(64, 64))


# -- shared byte ranges --------------------------------------------------------------------------


def _safetensors_sharing_one_range(path: str, n: int) -> None:
    data = torch.arange(1024.0).numpy().tobytes()
    header = {f"t{i}": {"dtype": "F32", "shape": [1024], "data_offsets": [0, len(data)]} for i in range(n)}
    h = json.dumps(header).encode()
    h += b" " * (-len(h) % 8)
    with open(path, "wb") as f:
        f.write(struct.pack("<Q", len(h)) + h + data)


def test_hf_entries_sharing_one_range_are_refused(tmp_path):
    hf = tmp_path / "hf"
    hf.mkdir()
    _safetensors_sharing_one_range(str(hf / "model.safetensors"), 600)
    with pytest.raises(UnsafeMetadataError, match="share file bytes"):
        shardckpt.inspect(str(hf))
    with pytest.raises(UnsafeMetadataError, match="share file bytes"):
        shardckpt.load(None, str(hf))
    with pytest.raises(UnsafeMetadataError):
        converters.from_safetensors(str(hf), str(tmp_path / "out"))
    assert not (tmp_path / "out").exists()


def test_torch_save_one_tensor_under_many_names_imports_once(tmp_path):
    w = torch.randn(256, 256)
    src = str(tmp_path / "m.pt")
    torch.save({f"layer{i}.weight": w for i in range(50)} | {"views": [w[:] for _ in range(3)], "step": 7}, src)
    out = str(tmp_path / "out")
    converters.from_torch_save(src, out)
    assert _tree_bytes(out) < 2 * os.path.getsize(src)  # one copy, not 53
    live = shardckpt.load(None, out)
    model = live.get("model", live)
    for i in range(50):
        assert torch.equal(model[f"layer{i}.weight"], w)
    assert all(torch.equal(v, w) for v in model["views"]) and model["step"] == 7


def test_torch_save_many_views_of_one_storage_are_refused(tmp_path):
    w = torch.randn(1 << 18)  # 1 MiB
    src = str(tmp_path / "m.pt")
    torch.save({f"v{i}": w[i : i + (1 << 17)] for i in range(40)}, src)  # 40 overlapping windows: 20 MiB from 1
    with pytest.raises(UnsafeMetadataError, match="views of one storage"):
        converters.from_torch_save(src, str(tmp_path / "out"))
    assert not (tmp_path / "out").exists()


def _dcp(tmp_path, state):
    import torch.distributed.checkpoint as dcp

    d = str(tmp_path / "dcp")
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        dcp.save(state, checkpoint_id=d)
    return d


def _edit_metadata(d, edit):
    path = os.path.join(d, ".metadata")
    with open(path, "rb") as f:
        md = pickle.load(f)
    edit(md)
    with open(path, "wb") as f:
        pickle.dump(md, f)


def test_dcp_entries_naming_one_stored_item_import_once(tmp_path):
    state = {f"w{i}": torch.full((128, 128), float(i)) for i in range(20)}
    d = _dcp(tmp_path, state)

    def point_all_at_w0(md):
        infos = {k.fqn: (k, v) for k, v in md.storage_data.items()}
        for k, _ in infos.values():
            md.storage_data[k] = infos["w0"][1]

    _edit_metadata(d, point_all_at_w0)
    out = str(tmp_path / "out")
    converters.from_dcp(d, out)
    assert _tree_bytes(out) < 3 * 128 * 128 * 4  # one copy of w0's bytes, not 20
    live = shardckpt.load(None, out)
    assert all(torch.equal(v, torch.zeros(128, 128)) for v in live["model"].values())


def test_dcp_metadata_with_wrong_types_is_our_error(tmp_path):
    d = _dcp(tmp_path, {"w": torch.ones(4), "v": torch.ones(4)})

    def int_where_an_index_goes(md):
        k, v = next(iter(md.storage_data.items()))
        k.__dict__["offset"] = 7  # MetadataIndex.offset: a tuple of ints, here an int
        md.state_dict_metadata[k.fqn].chunks[0].__dict__["offsets"] = 7

    _edit_metadata(d, int_where_an_index_goes)
    with pytest.raises(CorruptCheckpointError):
        converters.from_dcp(d, str(tmp_path / "out"))


def test_dcp_planner_path_nested_100k_deep_is_our_error(tmp_path):
    d = _dcp(tmp_path, {"w": torch.ones(4)})

    def deep(md):
        md.planner_data = {"w": tuple(f"p{i}" for i in range(100_000))}

    _edit_metadata(d, deep)
    with pytest.raises(CorruptCheckpointError):
        converters.from_dcp(d, str(tmp_path / "out"))


def test_torch_save_pickle_nested_100k_deep_is_our_error(tmp_path):
    ok = str(tmp_path / "ok.pt")
    torch.save({"a": 1}, ok)
    n = 100_000
    body = b"\x80\x02" + b"}X\x01\x00\x00\x00a" * n + b"}" + b"s" * n + b"."
    deep = str(tmp_path / "deep.pt")
    with zipfile.ZipFile(ok) as zin, zipfile.ZipFile(deep, "w", zipfile.ZIP_STORED) as zout:
        for info in zin.infolist():
            zout.writestr(info, body if info.filename.endswith("data.pkl") else zin.read(info.filename))
    with pytest.raises(CheckpointError, match="nest"):
        converters.from_torch_save(deep, str(tmp_path / "out"))


def test_load_does_not_follow_the_hf_index_out_of_the_directory(tmp_path):
    from safetensors.torch import save_file

    from shardckpt.errors import UnreadableFileError

    ck, outside = tmp_path / "ck", tmp_path / "outside"
    ck.mkdir()
    outside.mkdir()
    save_file({"a": torch.ones(3)}, str(ck / "model-00001-of-00001.safetensors"))
    (outside / "idx.json").write_text(json.dumps({"metadata": {}, "weight_map": {"a": "model-00001-of-00001.safetensors"}}))
    os.symlink(str(outside / "idx.json"), str(ck / "model.safetensors.index.json"))
    with pytest.raises(UnreadableFileError, match="leading out of the checkpoint"):
        shardckpt.load(None, str(ck))
