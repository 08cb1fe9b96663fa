"""A name in a checkpoint's values tree imports nothing (issue 29, item 2: the values half).

A dtype node ``{"__shardckpt__": "dtype", "value": "onnx"}`` used to resolve
through ``getattr(torch, name)``, which walks torch's lazy ``__getattr__``:
``load(None, ck)`` imported ``torch.onnx`` (hundreds of modules, seconds) before
refusing, and the template path raised a bare ``ValueError``. Each case here
runs in a fresh interpreter, warmed by loading the same checkpoint unaltered,
and compares ``sys.modules`` before and after loading the hostile one, by
both load paths (a live state, and ``load(None, ...)``).
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys

import torch

import shardckpt
from shardckpt._format.checksum import crc32c
from shardckpt._format.manifest import MANIFEST_CRC_FIELD, canonical_json

HOSTILE = [("dt", "dtype", v) for v in ["onnx", "_inductor", "_dynamo", "distributions", "__class__", "Tensor", 5, None, ["float32"], "float32\x00"]]
# Device strings torch cannot parse (parsing imports nothing; the error is ours).
HOSTILE += [("dev", "device", v) for v in ["onnx", "cuda:x", 5]]

PROBE = r"""
import json, sys
import torch
import shardckpt
from shardckpt.errors import CheckpointError

good, bad_dirs = sys.argv[1], json.loads(sys.argv[2])

def live():
    return {"model": {"w": torch.zeros(2)}, "cfg": {"dt": torch.float64, "dev": torch.device("cpu")}}

# Warm: everything a load of this checkpoint imports, by both paths.
assert shardckpt.load(None, good)["cfg"]["dt"] is torch.float32
shardckpt.load(live(), good)
out = []
for d in bad_dirs:
    for how in ("template", "live"):
        before = set(sys.modules)
        try:
            shardckpt.load(None, d) if how == "template" else shardckpt.load(live(), d)
            err = None
        except CheckpointError as e:
            err = [type(e).__name__, str(e)]
        except BaseException as e:
            err = ["FOREIGN " + type(e).__name__, str(e)]
        out.append({"dir": d, "how": how, "new": sorted(set(sys.modules) - before), "err": err})
print(json.dumps(out))
"""


def _with_value(src: str, dst: str, key: str, tag: str, value) -> None:
    shutil.copytree(src, dst)
    path = os.path.join(dst, "manifest.json")
    raw = json.loads(open(path, "rb").read())
    raw["values"]["cfg"][key] = {"__shardckpt__": tag, "value": value}
    raw.pop(MANIFEST_CRC_FIELD)
    raw[MANIFEST_CRC_FIELD] = crc32c(canonical_json(raw))
    with open(path, "wb") as f:
        f.write(canonical_json(raw))


def test_a_dtype_or_device_name_in_a_checkpoint_imports_nothing_and_is_our_error(tmp_path):
    good = str(tmp_path / "good")
    shardckpt.save({"model": {"w": torch.ones(2)}, "cfg": {"dt": torch.float32, "dev": torch.device("cpu")}}, good)
    bad, keys = [], {}
    for i, (key, tag, value) in enumerate(HOSTILE):
        d = str(tmp_path / f"bad{i}")
        _with_value(good, d, key, tag, value)
        bad.append(d)
        keys[d] = key
    p = subprocess.run(
        [sys.executable, "-c", PROBE, good, json.dumps(bad)], capture_output=True, text=True, timeout=300, cwd=tmp_path
    )
    assert p.returncode == 0, p.stderr[-4000:]
    results = json.loads(p.stdout.strip().splitlines()[-1])
    assert len(results) == 2 * len(HOSTILE)
    imported = {(r["dir"], r["how"]): r["new"][:5] for r in results if r["new"]}
    assert not imported, f"loading a hostile checkpoint imported modules: {imported}"
    wrong = [(r["dir"], r["how"], r["err"]) for r in results if not r["err"] or r["err"][0] != "CorruptCheckpointError"]
    assert not wrong, wrong
    for r in results:  # the message names where: the saved path of the value
        assert f"cfg.{keys[r['dir']]}" in r["err"][1], r


def test_every_dtype_round_trips_through_the_values_tree(tmp_path):
    dtypes = sorted({v for v in vars(torch).values() if isinstance(v, torch.dtype)}, key=str)
    assert torch.bfloat16 in dtypes and torch.float8_e4m3fn in dtypes
    shardckpt.save({"dts": list(dtypes)}, str(tmp_path / "ck"))
    assert shardckpt.load(None, str(tmp_path / "ck"))["dts"] == dtypes
    live = {"dts": [torch.float32] * len(dtypes)}
    shardckpt.load(live, str(tmp_path / "ck"))
    assert live["dts"] == dtypes
