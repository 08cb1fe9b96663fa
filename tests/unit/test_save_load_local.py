"""The public API in one process (no process group): save, load, inspect, verify."""

from __future__ import annotations

import json
import math
import os
import uuid

import pytest
import torch

import shardckpt
from shardckpt import _save as _api
from shardckpt._storage import Storage
from shardckpt.errors import (
    CheckpointExistsError,
    CheckpointNotFoundError,
    SaveFailedError,
    StateMismatchError,
    UnsupportedStateError,
)


def _model(seed):
    torch.manual_seed(seed)
    m = torch.nn.Sequential(torch.nn.Linear(6, 5), torch.nn.ReLU(), torch.nn.Linear(5, 3, bias=False))
    m.register_buffer("steps", torch.tensor([seed], dtype=torch.int64))
    return m


def _nested(seed: int):
    g = torch.Generator().manual_seed(seed)
    return {
        "model": _model(seed),
        "emb": torch.randn(7, 3, generator=g),
        "opt": {"lr": 0.1 * seed, "betas": (0.9, 0.999), "groups": [{"wd": 0.0, "params": [0, 1]}, {"wd": 0.01, "params": [2]}]},
        "tensors": [torch.arange(4) + seed, {"deep": torch.full((2, 2), float(seed))}],
        "pair": (torch.ones(3) * seed, "label"),
        "by_id": {1: "one", 2: "two"},
        "floats": {"nan": math.nan, "inf": math.inf, "ninf": -math.inf, "zero": -0.0, "big": 1e308},
        "misc": {"none": None, "flag": True, "text": "héllo", "dtype": torch.bfloat16, "device": torch.device("cpu")},
        "step": 10 * seed,
    }


def _assert_same(a, b, path="state"):
    if isinstance(a, torch.nn.Module):
        _assert_same(a.state_dict(), b.state_dict(), path)
    elif isinstance(a, torch.Tensor):
        assert isinstance(b, torch.Tensor) and a.dtype == b.dtype and torch.equal(a, b), path
    elif isinstance(a, dict):
        assert set(a) == set(b), (path, set(a), set(b))
        for k in a:
            _assert_same(a[k], b[k], f"{path}.{k}")
    elif isinstance(a, (list, tuple)):
        assert type(a) is type(b) and len(a) == len(b), (path, a, b)
        for i, (x, y) in enumerate(zip(a, b)):
            _assert_same(x, y, f"{path}[{i}]")
    elif isinstance(a, float) and math.isnan(a):
        assert isinstance(b, float) and math.isnan(b), path
    else:
        assert a == b and type(a) is type(b), (path, a, b)
        if isinstance(a, float) and a == 0:
            assert math.copysign(1, a) == math.copysign(1, b), path


def test_nested_state_round_trip(tmp_path):
    path = str(tmp_path / "ck")
    saved = _nested(1)
    shardckpt.save(saved, path)
    live = _nested(2)
    params = {n: (p, p.data_ptr()) for n, p in live["model"].named_parameters()}
    res = shardckpt.load(live, path)
    assert res == shardckpt.LoadResult([], [])
    _assert_same(_nested(1), live)
    # In place: the same Parameter objects, the same storage.
    for n, p in live["model"].named_parameters():
        assert p is params[n][0] and p.data_ptr() == params[n][1]


def test_overwrite_refused_then_replaces(tmp_path):
    path = str(tmp_path / "ck")
    shardckpt.save({"w": torch.zeros(3), "v": 1}, path)
    with pytest.raises(CheckpointExistsError, match="manifest.json already exists; pass overwrite=True"):
        shardckpt.save({"w": torch.ones(3), "v": 2}, path)
    old_files = set(os.listdir(os.path.join(path, "data")))
    shardckpt.save({"w": torch.ones(3), "v": 2}, path, overwrite=True)
    state = {"w": torch.empty(3), "v": 0}
    shardckpt.load(state, path)
    assert state["v"] == 2 and torch.equal(state["w"], torch.ones(3))
    # Stale data files of the replaced checkpoint are gone, nothing else is left over.
    new_files = set(os.listdir(os.path.join(path, "data")))
    assert not (new_files & old_files)
    m = shardckpt.verify(path)
    assert new_files == {rel.split("/", 1)[1] for rel in m.files}
    assert not [f for f in os.listdir(path) if f.endswith(".tmp")]


def test_failed_overwrite_keeps_the_old_checkpoint(tmp_path, monkeypatch):
    path = str(tmp_path / "ck")
    shardckpt.save({"w": torch.zeros(3), "v": 1}, path)
    before = sorted(os.listdir(os.path.join(path, "data")))
    real = Storage.write_atomic
    seen = {}

    def failing_commit(self, rel, data, **kw):
        if rel == "manifest.json":
            # The new data files are on disk now, and the old manifest still rules.
            seen["data"] = sorted(os.listdir(os.path.join(path, "data")))
            state = {"w": torch.empty(3), "v": 0}
            shardckpt.load(state, path)
            seen["loaded"] = (state["v"], state["w"].clone())
            raise OSError("disk full")
        return real(self, rel, data, **kw)

    monkeypatch.setattr(Storage, "write_atomic", failing_commit)
    with pytest.raises(SaveFailedError, match="nothing was committed.*disk full"):
        shardckpt.save({"w": torch.ones(3), "v": 2}, path, overwrite=True)
    monkeypatch.undo()
    assert len(seen["data"]) > len(before)
    assert seen["loaded"][0] == 1 and torch.equal(seen["loaded"][1], torch.zeros(3))
    # The failed save cleaned up its own files; the old checkpoint is intact,
    # its HF index too (it names the old files, not the removed new ones).
    assert sorted(os.listdir(os.path.join(path, "data"))) == before
    with open(os.path.join(path, "model.safetensors.index.json")) as f:
        assert sorted(set(json.load(f)["weight_map"].values())) == [f"data/{n}" for n in before if n.endswith(".safetensors")]
    shardckpt.verify(path)
    state = {"w": torch.empty(3), "v": 0}
    shardckpt.load(state, path)
    assert state["v"] == 1 and torch.equal(state["w"], torch.zeros(3))


def test_strict_key_mismatch_lists_sorted_keys(tmp_path):
    path = str(tmp_path / "ck")
    shardckpt.save({"model": _model(1), "b": torch.ones(2), "a": torch.ones(2), "n": 3}, path)
    live = {"model": torch.nn.Linear(6, 5), "z": torch.zeros(2), "y": torch.zeros(2), "b": torch.zeros(2), "m": 1, "n": 0}
    snap = {k: v.clone() for k, v in live["model"].state_dict().items()}
    with pytest.raises(StateMismatchError) as ei:
        shardckpt.load(live, path)
    msg = str(ei.value)
    assert "missing from the checkpoint: m, model.bias, model.weight, y, z" in msg
    assert "in the checkpoint but not in the state: model.0.bias, model.0.weight, model.2.weight, model.steps" in msg
    assert "strict=False" in msg
    assert "a" not in msg.split("not in the state:")[1].split(",")  # top-level keys the state does not name are fine
    for k, v in live["model"].state_dict().items():
        assert torch.equal(v, snap[k])
    assert torch.equal(live["b"], torch.zeros(2)) and live["n"] == 0


def test_non_strict_load_reports_and_loads_the_common_part(tmp_path):
    path = str(tmp_path / "ck")
    shardckpt.save({"a": torch.ones(2), "b": torch.full((2,), 2.0), "n": 3}, path)
    live = {"a": torch.zeros(2), "c": torch.zeros(2), "n": 0, "extra": "keep"}
    res = shardckpt.load(live, path, strict=False)
    assert res.missing_keys == ["c", "extra"] and res.unexpected_keys == []
    assert torch.equal(live["a"], torch.ones(2)) and live["n"] == 3 and live["extra"] == "keep"
    assert torch.equal(live["c"], torch.zeros(2))


def test_shape_and_dtype_mismatch(tmp_path):
    path = str(tmp_path / "ck")
    shardckpt.save({"model": _model(1)}, path)
    wrong = torch.nn.Sequential(torch.nn.Linear(6, 4), torch.nn.ReLU(), torch.nn.Linear(4, 3, bias=False))
    wrong.register_buffer("steps", torch.tensor([0], dtype=torch.int32))
    before = {k: v.clone() for k, v in wrong.state_dict().items()}
    with pytest.raises(StateMismatchError) as ei:
        shardckpt.load({"model": wrong}, path)
    msg = str(ei.value)
    assert "model.0.weight: checkpoint shape [5, 6], live shape [4, 6]" in msg
    assert "model.2.weight: checkpoint shape [3, 5], live shape [3, 4]" in msg
    assert "model.steps: checkpoint dtype I64, live dtype I32" in msg
    assert msg.index("model.0.bias") < msg.index("model.0.weight") < msg.index("model.steps")
    for k, v in wrong.state_dict().items():
        assert torch.equal(v, before[k]), k


def test_unsupported_values_are_named(tmp_path):
    with pytest.raises(UnsupportedStateError, match=r"opt\.fn: values of type builtins\.function"):
        shardckpt.save({"opt": {"fn": lambda: 0}}, str(tmp_path / "a"))
    with pytest.raises(UnsupportedStateError, match="state must be a dict"):
        shardckpt.save([torch.ones(1)], str(tmp_path / "b"))
    with pytest.raises(UnsupportedStateError, match="complex128 has no safetensors encoding"):
        shardckpt.save({"c": torch.zeros(2, dtype=torch.complex128)}, str(tmp_path / "c"))
    assert not os.path.exists(tmp_path / "a" / "manifest.json")


def test_inspect_fields(tmp_path):
    path = str(tmp_path / "ck")
    state = {"model": _model(3), "x": torch.zeros(4, 2, dtype=torch.float16), "step": 5}
    shardckpt.save(state, path)
    m = shardckpt.inspect(path)
    assert m.world_size == 1 and m.version == shardckpt._format.FORMAT_VERSION and len(m.save_id) == 32
    assert m.library_version == shardckpt.__version__
    assert sorted(m.tensors) == ["model.0.bias", "model.0.weight", "model.2.weight", "model.steps", "x"]
    assert m.tensors["x"].dtype == "F16" and m.tensors["x"].shape == [4, 2]
    assert m.tensors["model.0.weight"].dtype == "F32" and m.tensors["model.0.weight"].shape == [5, 6]
    (c,) = m.tensors["x"].chunks
    assert c.offsets == [0, 0] and c.sizes == [4, 2] and c.nbytes == 16 and c.key == "x"
    assert m.total_bytes == (30 + 5 + 15) * 4 + 8 + 16
    assert sum(f.size for f in m.files.values()) == sum(
        os.path.getsize(os.path.join(path, rel)) for rel in m.files
    )
    assert m.values["step"] == 5
    with pytest.raises(CheckpointNotFoundError):
        shardckpt.inspect(str(tmp_path / "none"))


def test_file_url(tmp_path):
    url = "file://" + str(tmp_path / "ck")
    shardckpt.save({"w": torch.arange(5.0), "s": "x"}, url)
    assert os.path.exists(tmp_path / "ck" / "manifest.json")
    state = {"w": torch.zeros(5), "s": ""}
    shardckpt.load(state, url)
    assert torch.equal(state["w"], torch.arange(5.0)) and state["s"] == "x"
    assert shardckpt.verify(url).world_size == 1
    # the same with storage options (goes through fsspec's local filesystem)
    state = {"w": torch.zeros(5), "s": ""}
    shardckpt.load(state, url, storage_options={"auto_mkdir": True})
    assert torch.equal(state["w"], torch.arange(5.0))


def test_memory_url():
    url = f"memory://shardckpt-tests/{uuid.uuid4().hex}/ck"
    saved = _nested(4)
    shardckpt.save(saved, url)
    live = _nested(5)
    shardckpt.load(live, url)
    _assert_same(_nested(4), live)
    m = shardckpt.verify(url)
    assert m.world_size == 1
    with pytest.raises(CheckpointExistsError):
        shardckpt.save(saved, url)
    shardckpt.save({"w": torch.ones(1)}, url, overwrite=True)
    st = Storage(url)
    m = shardckpt.inspect(url)
    assert sorted(st.walk_files()) == sorted({"manifest.json", "model.safetensors.index.json", *m.files, *m.indexes})
    # damaged bytes are caught on this path too
    rel = next(iter(shardckpt.inspect(url).files))
    data = bytearray(st.read_bytes(rel))
    data[-1] ^= 0xFF
    st.write_atomic(rel, bytes(data))
    with pytest.raises(shardckpt.ChecksumMismatchError):
        shardckpt.load({"w": torch.zeros(1)}, url)
    st.remove_tree()


def test_save_is_cheap_to_import():
    import subprocess
    import sys

    code = "import sys, shardckpt; sys.exit(1 if 'torch' in sys.modules else 0)"
    assert subprocess.run([sys.executable, "-c", code]).returncode == 0, "import shardckpt imported torch"


def test_load_into_tensor_keeps_dtype_and_identity(tmp_path):
    path = str(tmp_path / "ck")
    shardckpt.save({"w": torch.arange(6.0).reshape(2, 3)}, path)
    # a non-contiguous live tensor (a transposed view) is filled in place
    base = torch.zeros(3, 2)
    live = {"w": base.t()}
    shardckpt.load(live, path)
    assert torch.equal(base.t(), torch.arange(6.0).reshape(2, 3))
    assert _api.DATA_DIR == "data"


# -- bounded, well-aimed messages (issue 12) ---------------------------------------


def test_shape_and_dtype_mismatches_share_the_offender_cap(tmp_path):
    from shardckpt.errors import MAX_OFFENDERS

    d = str(tmp_path / "c")
    n = 300
    shardckpt.save({f"t{i:03d}": torch.zeros(2, 3) for i in range(n)}, d)
    live = {f"t{i:03d}": torch.zeros(3, 3) if i % 2 else torch.zeros(2, 3, dtype=torch.int32) for i in range(n)}
    with pytest.raises(StateMismatchError) as ei:
        shardckpt.load(live, d)
    msg = str(ei.value)
    assert f"{n} tensor(s) differ" in msg
    assert f"... ({n - MAX_OFFENDERS} more)" in msg
    assert "t000: checkpoint dtype F32, live dtype I32" in msg and "t001: checkpoint shape [2, 3], live shape [3, 3]" in msg
    assert len(msg) < 2000, len(msg)
    assert all(torch.count_nonzero(v) == 0 for v in live.values())  # nothing loaded


def test_no_dist_in_a_single_process_and_its_argument_checks(tmp_path):
    d = str(tmp_path / "c")
    shardckpt.save({"w": torch.arange(3.0)}, d, no_dist=True, collective_timeout_s=1)
    s = {"w": torch.zeros(3)}
    shardckpt.load(s, d, no_dist=True)
    assert s["w"].tolist() == [0.0, 1.0, 2.0]
    for bad in (0, -1, "5", True):
        with pytest.raises(shardckpt.UsageError, match="collective_timeout_s must be a positive number"):
            shardckpt.save({"w": torch.ones(1)}, str(tmp_path / "x"), collective_timeout_s=bad)


def test_knobs_come_from_the_environment(tmp_path):
    import subprocess
    import sys

    code = "from shardckpt import _knobs as k; print(k.IO_THREADS, k.WRITE_BLOCK_BYTES, k.COLLECTIVE_TIMEOUT_S, k.CHECKSUMS)"
    env = dict(os.environ, SHARDCKPT_IO_THREADS="7", SHARDCKPT_WRITE_BLOCK_BYTES="8MiB", SHARDCKPT_COLLECTIVE_TIMEOUT_S="12.5", SHARDCKPT_CHECKSUMS="0")
    out = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, timeout=120)
    assert out.stdout.split() == ["7", str(8 << 20), "12.5", "False"], out.stderr
    env = dict(os.environ, SHARDCKPT_IO_THREADS="many")
    out = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, timeout=120)
    assert out.returncode != 0 and "SHARDCKPT_IO_THREADS='many'" in out.stderr
