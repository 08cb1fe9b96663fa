"""Format v2 keeps the key order of the user's plain dicts through save -> load (docs/format.md, "Key order")."""

from __future__ import annotations

import json
import os

import pytest
import torch

import shardckpt
from shardckpt._format import manifest_from_bytes, manifest_to_bytes
from shardckpt._format.checksum import crc32c
from shardckpt._format.manifest import MANIFEST_CRC_FIELD, canonical_json
from shardckpt.errors import CorruptCheckpointError

DATA = os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "data")


def _order(d):
    """Key order of ``d`` and of every dict nested in it (lists walked), as nested lists."""
    if isinstance(d, dict):
        return [[k, _order(v)] for k, v in d.items()]
    if isinstance(d, (list, tuple)):
        return [_order(v) for v in d]
    return None


def _cfg():
    return {"b": 1, "a": 2, "nested": {"z": [{"y": 1, "x": 2}], "c": {"q": 0, "p": 1}}, 2: "two", 1: "one"}


def test_plain_dict_order_round_trips(tmp_path):
    state = {"zz": {"b": 1, "a": 2}, "cfg": _cfg(), "w": torch.ones(3), "aa": 0}
    shardckpt.save(state, str(tmp_path))
    live = {"zz": {"a": 0, "b": 0}, "cfg": {}, "w": torch.zeros(3), "aa": 1}
    shardckpt.load(live, str(tmp_path))
    assert list(live["zz"]) == ["b", "a"]
    assert live["cfg"] == _cfg() and _order(live["cfg"]) == _order(_cfg())
    # The file says so too: the values tree is written in the user's order.
    raw = json.loads((tmp_path / "manifest.json").read_bytes())
    assert list(raw["values"]) == ["zz", "cfg", "w", "aa"] and list(raw["values"]["zz"]) == ["b", "a"]
    shardckpt.verify(str(tmp_path))


def test_optimizer_param_groups_and_state_keep_their_order(tmp_path):
    torch.manual_seed(0)
    model = torch.nn.Linear(3, 2)
    opt = torch.optim.Adam(model.parameters(), lr=0.1)
    opt.param_groups[0]["schedule"] = {"warmup": 10, "decay": {"z": 1, "a": 2}}
    model(torch.ones(1, 3)).sum().backward()
    opt.step()
    opt.state[model.weight]["extra"] = {"y": 1, "x": [2, {"k": 1, "j": 0}]}
    want_state_keys = list(opt.state[model.weight])
    shardckpt.save({"model": model, "optim": opt}, str(tmp_path))

    model2 = torch.nn.Linear(3, 2)
    opt2 = torch.optim.Adam(model2.parameters(), lr=0.1)
    opt2.param_groups[0]["schedule"] = {"decay": {"a": 0, "z": 0}, "warmup": 0}
    shardckpt.load({"model": model2, "optim": opt2}, str(tmp_path))
    got = opt2.param_groups[0]["schedule"]
    assert _order(got) == _order({"warmup": 10, "decay": {"z": 1, "a": 2}}) and got["decay"] == {"z": 1, "a": 2}
    st = opt2.state[model2.weight]
    assert list(st) == want_state_keys  # step, exp_avg, exp_avg_sq, extra: as the optimizer had them
    assert _order(st["extra"]) == _order({"y": 1, "x": [2, {"k": 1, "j": 0}]})


def test_per_rank_values_keep_their_order(tmp_path):
    shardckpt.save({"loader": shardckpt.PerRank({"pos": 3, "epoch": 1, "buf": {"n": 1, "m": 2}})}, str(tmp_path))
    got: dict = {}
    shardckpt.load({"loader": shardckpt.PerRank(got)}, str(tmp_path))  # a dict is filled in place
    assert got == {"pos": 3, "epoch": 1, "buf": {"n": 1, "m": 2}}
    assert list(got) == ["pos", "epoch", "buf"] and list(got["buf"]) == ["n", "m"]


def test_the_manifest_checksum_covers_the_order_and_is_deterministic(tmp_path):
    state = {"cfg": {"b": 1, "a": 2}, "w": torch.ones(2)}
    shardckpt.save(state, str(tmp_path))
    path = tmp_path / "manifest.json"
    data = path.read_bytes()
    m = manifest_from_bytes(data)
    # Same state, same bytes: re-encoding the parsed manifest gives the file back exactly.
    assert manifest_to_bytes(m) == data == manifest_to_bytes(manifest_from_bytes(manifest_to_bytes(m)))
    assert list(m.values["cfg"]) == ["b", "a"]
    # Swapping the two keys (the same keys and values, another order) is damage, not a silent reorder.
    swapped = data.replace(b'"cfg":{"b":1,"a":2}', b'"cfg":{"a":2,"b":1}')
    assert swapped != data and len(swapped) == len(data)
    with pytest.raises(CorruptCheckpointError, match="checksum mismatch"):
        manifest_from_bytes(swapped)


def test_a_v2_manifest_written_fully_sorted_still_opens(tmp_path):
    # Manifests written before this rule sorted every key, values too (checksum over those bytes).
    state = {"cfg": {"b": 1, "a": 2}, "w": torch.arange(4.0)}
    shardckpt.save(state, str(tmp_path))
    raw = json.loads((tmp_path / "manifest.json").read_bytes())
    raw.pop(MANIFEST_CRC_FIELD)
    raw[MANIFEST_CRC_FIELD] = crc32c(canonical_json(raw))
    (tmp_path / "manifest.json").write_bytes(canonical_json(raw))
    live = {"cfg": {}, "w": torch.zeros(4)}
    shardckpt.load(live, str(tmp_path))
    assert live["cfg"] == {"a": 2, "b": 1} and list(live["cfg"]) == ["a", "b"]  # sorted, as written then
    assert torch.equal(live["w"], torch.arange(4.0))
    shardckpt.verify(str(tmp_path))


def test_v1_golden_manifest_bytes_are_unchanged():
    # v1 stays canonical (every key sorted): the golden bytes re-encode to themselves.
    path = os.path.join(DATA, "v1_golden", "manifest.json")
    data = open(path, "rb").read()
    m = manifest_from_bytes(data)
    assert m.version == 1 and manifest_to_bytes(m) == data
