"""``register_adapter``: a user adapter takes its kind of object through a real save and load, in the
order the adapter list documents (registered first, the built-ins, registered with ``first=False``)."""

from __future__ import annotations

import importlib

import pytest
import torch

import shardckpt

# The module (the package's name `adapters` is the function that lists them).
adapter_list = importlib.import_module("shardckpt._state.adapters")


@pytest.fixture(autouse=True)
def _fresh_registry(monkeypatch):
    # Registrations are process-wide: each test starts from (and leaves) the built-ins alone.
    monkeypatch.setattr(adapter_list, "_FIRST", [])
    monkeypatch.setattr(adapter_list, "_LAST", [])


class Counter:
    def __init__(self, n: int = 0):
        self.n = n
        self.table = torch.zeros(3)


class CounterAdapter(shardckpt.Adapter):
    def matches(self, obj):
        return isinstance(obj, Counter)

    def save(self, obj, path, walker):
        return {"n": obj.n, "table": obj.table}

    def load(self, obj, path, saved, walker):
        walker.target(f"{path}.table", obj.table)
        walker.flat.finalizers.append(lambda: setattr(obj, "n", saved["n"]))


class Stateful:
    """An object the built-in stateful adapter would take (it has state_dict/load_state_dict)."""

    def __init__(self, n: int = 0):
        self.n = n

    def state_dict(self):
        return {"n": self.n}

    def load_state_dict(self, sd):
        self.n = sd["n"]


class TaggingAdapter(shardckpt.Adapter):
    """Takes Stateful objects, saving their value plus 100 (so which adapter ran is visible)."""

    def matches(self, obj):
        return isinstance(obj, Stateful)

    def save(self, obj, path, walker):
        return {"n": obj.n + 100}

    def load(self, obj, path, saved, walker):
        walker.flat.finalizers.append(lambda: setattr(obj, "n", saved["n"]))


def test_registered_adapter_saves_and_loads_its_object(tmp_path):
    shardckpt.register_adapter(CounterAdapter())
    c = Counter(7)
    c.table = torch.arange(3.0)
    shardckpt.save({"c": c}, str(tmp_path / "ck"))
    back = Counter()
    shardckpt.load({"c": back}, str(tmp_path / "ck"))
    assert back.n == 7 and torch.equal(back.table, torch.arange(3.0))


def test_registered_first_goes_before_the_built_ins_and_last_after(tmp_path):
    assert adapter_list.adapter_for(Stateful()).__class__.__name__ == "StatefulAdapter"
    shardckpt.register_adapter(TaggingAdapter(), first=False)
    # A built-in takes Stateful objects: an adapter registered after them never sees one.
    assert adapter_list.adapter_for(Stateful()).__class__.__name__ == "StatefulAdapter"
    assert isinstance(adapter_list.adapters()[-1], TaggingAdapter)
    first = TaggingAdapter()
    shardckpt.register_adapter(first)
    assert adapter_list.adapter_for(Stateful()) is first
    shardckpt.save({"s": Stateful(1)}, str(tmp_path / "ck"))
    back = Stateful()
    shardckpt.load({"s": back}, str(tmp_path / "ck"))
    assert back.n == 101


def test_register_adapter_refuses_what_is_not_an_adapter():
    with pytest.raises(TypeError, match="shardckpt.Adapter"):
        shardckpt.register_adapter(object())  # type: ignore[arg-type]
    assert adapter_list.adapters()[0].__class__.__name__ == "PerRankAdapter"
