"""Save and load work grows linearly in the number of keys (issue 18 item 3).

A load once rebuilt a set of the live keys for every saved key: 5.2 s at
10,000 keys, 788 s at 100,000. Timing ratios are fragile on a shared
machine, so these tests count work instead: the Python lines executed inside
``shardckpt`` (``sys.settrace`` line events, this thread), which is
deterministic for a given state. A loop over the keys inside a loop over the
keys shows as ~100x the lines for 10x the keys; linear code stays near 10x.
Counting stops once a budget (the linear bound) is passed, so quadratic code
fails fast instead of being traced to the end.

Work inside C (``x in list``, sorting) is not counted; the slow test at the
end bounds the CPU time of the same calls with a generous ratio for that.
"""

from __future__ import annotations

import os
import sys
import time

import pytest
import torch

import shardckpt

PKG = os.path.dirname(os.path.abspath(shardckpt.__file__)) + os.sep

#: Lines executed for 10x the keys may be at most this many times those for
#: 1x (linear code measures ~10; the quadratic load measured ~100).
MAX_RATIO = 15


class _Budget(Exception):
    pass


def count_lines(fn, budget=None) -> int:
    """Python line events executed in shardckpt's own files while ``fn()`` runs (this thread).

    Past ``budget`` lines counting stops (the rest runs untraced) and
    ``budget + 1`` is returned.
    """
    n = 0
    ours = {}
    over = False

    def local(frame, event, arg):
        nonlocal n, over
        if event == "line":
            n += 1
            if budget is not None and n > budget:
                over = True
                sys.settrace(None)
                return None
        return local

    def glob(frame, event, arg):
        if over:
            return None
        code = frame.f_code
        mine = ours.get(code)
        if mine is None:
            mine = ours[code] = code.co_filename.startswith(PKG)
        return local if mine else None

    prev = sys.gettrace()
    sys.settrace(glob)
    try:
        fn()
    finally:
        sys.settrace(prev)
    return n


def _grows_linearly(make, small: int, big: int, what: str) -> None:
    """``make(n)`` returns ``[(label, fn)]``; each fn's lines at ``big`` keys stay within MAX_RATIO x ``big/small`` of ``small``."""
    assert big == 10 * small
    for _, fn in make(3):  # first calls import and set up; not counted
        fn()
    small_runs = [(label, count_lines(fn)) for label, fn in make(small)]
    for (label, lines), (_, fn) in zip(small_runs, make(big)):
        budget = MAX_RATIO * lines
        got = count_lines(fn, budget)
        assert got <= budget, (
            f"{what} {label}: more than {budget:,} lines of shardckpt code at {big:,} keys, "
            f"{lines:,} at {small:,}: super-linear in the number of keys"
        )


def _dict_case(tmp_path, n):
    d = str(tmp_path / f"dict{n}")
    state = {"model": {f"layers.{i}.w": torch.full((4,), float(i)) for i in range(n)}}
    live = {"model": {f"layers.{i}.w": torch.zeros(4) for i in range(n)}}

    def load():
        shardckpt.load(live, d)
        assert torch.equal(live["model"][f"layers.{n - 1}.w"], state["model"][f"layers.{n - 1}.w"])

    return [("save", lambda: shardckpt.save(state, d)), ("load", load)]


@pytest.mark.slow
def test_one_dict_save_and_load_linear_2000_to_20000_keys(tmp_path):
    # 100,000 tensors in one dict (unfused MoE experts) must not take minutes.
    _grows_linearly(lambda n: _dict_case(tmp_path, n), 2_000, 20_000, "one dict")


def _top_level_case(tmp_path, n):
    # Every tensor a top-level key: n roots to check each saved name against.
    d = str(tmp_path / f"top{n}")
    state = {f"t{i}": torch.full((2,), float(i)) for i in range(n)}
    live = {f"t{i}": torch.zeros(2) for i in range(n)}
    part = {f"t{i}": torch.zeros(2) for i in range(n // 2)}
    return [
        ("save", lambda: shardckpt.save(state, d)),
        ("load", lambda: shardckpt.load(live, d)),
        ("non-strict load of half", lambda: shardckpt.load(part, d, strict=False)),
    ]


def _keymap_case(tmp_path, n):
    # Selection and renaming (the path HF checkpoints take), and a load
    # without a template picking a glob's outermost paths.
    d = str(tmp_path / f"km{n}")
    shardckpt.save({"model": {f"t{i}": torch.full((2,), float(i)) for i in range(n)}}, d)
    live = {"net": {f"u{i}": torch.zeros(2) for i in range(n)}}
    km = {f"model.t{i}": f"net.u{i}" for i in range(n)}
    keys = [f"model.t{i}" for i in range(n)]
    return [
        ("load with key_map and keys", lambda: shardckpt.load(live, d, key_map=km, keys=keys)),
        ("load(None, keys=['model.*'])", lambda: shardckpt.load(None, d, keys=["model.*"])),
    ]


def _hf_case(tmp_path, n):
    from safetensors.torch import save_file

    d = tmp_path / f"hf{n}"
    d.mkdir()
    save_file({f"model.layers.{i}.w": torch.full((2,), float(i)) for i in range(n)}, str(d / "model.safetensors"))
    live = {"model": {"model": {"layers": {str(i): {"w": torch.zeros(2)} for i in range(n)}}}}
    flat = {"m": {f"x{i}": torch.zeros(2) for i in range(n)}}
    return [
        ("load from an HF file", lambda: shardckpt.load(live, str(d))),
        ("load from an HF file with a key_map callable", lambda: shardckpt.load(flat, str(d), key_map=lambda k: "m.x" + k.split(".")[2])),
    ]


def _adamw_case(tmp_path, n):
    d = str(tmp_path / f"adamw{n}")

    def pair(step):
        torch.manual_seed(0)
        m = torch.nn.ModuleDict({f"l{i}": torch.nn.Linear(2, 2) for i in range(n // 2)})
        o = torch.optim.AdamW(m.parameters(), lr=1e-3)
        if step:
            for p in m.parameters():
                p.grad = torch.ones_like(p)
            o.step()
        return {"model": m, "optim": o}

    saved, stepped, fresh = pair(True), pair(True), pair(False)
    return [
        ("save", lambda: shardckpt.save(saved, d)),
        ("load into a stepped optimizer", lambda: shardckpt.load(stepped, d)),
        ("load into a fresh optimizer", lambda: shardckpt.load(fresh, d)),
    ]


@pytest.mark.parametrize("case", [_dict_case, _top_level_case, _keymap_case, _hf_case], ids=lambda c: c.__name__[1:-5])
def test_each_path_linear_200_to_2000_keys(tmp_path, case):
    # One dict, top-level keys, renaming/selection, HF files: each path's
    # per-key matching must stay linear (the same check as above, smaller).
    _grows_linearly(lambda n: case(tmp_path, n), 200, 2_000, case.__name__[1:-5])


def test_module_and_adamw_linear_100_to_1000_parameters(tmp_path):
    # The optimizer adapter pairs every state with its parameter by FQN.
    _grows_linearly(lambda n: _adamw_case(tmp_path, n), 100, 1_000, "model + AdamW")


@pytest.mark.slow
def test_cpu_time_grows_at_most_linearly(tmp_path):
    # What line counting cannot see (a loop inside C, e.g. ``x in list``):
    # the CPU time of this process, best of two, with a generous bound
    # (quadratic would be ~100x for 10x the keys; linear ~10x).
    def best(fn, runs=2):
        out = []
        for _ in range(runs):
            t = time.process_time()
            fn()
            out.append(time.process_time() - t)
        return min(out)

    small, big = _dict_case(tmp_path, 2_000), _dict_case(tmp_path, 20_000)
    # Saves refuse an existing checkpoint: time the save once, the load twice.
    for (label, fa), (_, fb) in zip(small, big):
        runs = 1 if label == "save" else 2
        ta, tb = best(fa, runs), best(fb, runs)
        assert tb <= 25 * ta, f"{label}: {tb:.2f} s CPU at 20,000 keys, {ta:.2f} s at 2,000"


def test_bench_many_tensors_runs(tmp_path):
    # The benchmark of these costs still runs end to end (tiny sizes, one
    # process), values checked inside it, so it cannot rot.
    root = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
    sys.path.insert(0, os.path.join(root, "benchmarks"))
    try:
        import bench_many_tensors
    finally:
        sys.path.pop(0)
    out = tmp_path / "res.json"
    argv = ["--tensors", "3,20", "--no-isolate", "--dir", str(tmp_path / "scratch"), "--json", str(out),
            "--markdown", str(tmp_path / "res.md")]
    assert bench_many_tensors.main(argv) == 0
    import json

    res = json.loads(out.read_text())["results"]
    for n in ("3", "20"):
        for case in ("shardckpt", "dcp", "torch.save"):
            assert res[n][case]["save"][0]["seconds"] > 0 and res[n][case]["load"][0]["cpu_seconds"] >= 0
    assert "| 20 | dcp |" in (tmp_path / "res.md").read_text()


def test_a_load_runs_without_the_cyclic_gc_and_restores_it(tmp_path):
    # Thousands of small tensors set off thousands of collections, each full
    # one walking the whole heap (40-50% of a 20,000-tensor load's CPU, and a
    # count that varied from run to run): the load pauses the collector and
    # leaves it as it found it, also when it fails or the caller had it off.
    import gc

    n = 5_000
    d = str(tmp_path / "c")
    shardckpt.save({"model": {f"k{i}": torch.full((2,), float(i)) for i in range(n)}}, d)
    live = {"model": {f"k{i}": torch.zeros(2) for i in range(n)}}
    seen = []

    def count(phase, info):
        if phase == "start":
            seen.append(info["generation"])

    gc.callbacks.append(count)
    try:
        assert gc.isenabled()
        shardckpt.load(live, d)
        during = len(seen)
        assert torch.equal(live["model"][f"k{n - 1}"], torch.full((2,), float(n - 1)))
        assert gc.isenabled()
        assert during <= 2, f"{during} collections during a load of {n} tensors"
        with pytest.raises(shardckpt.errors.CheckpointError):
            shardckpt.load(live, str(tmp_path / "missing"))
        assert gc.isenabled()
        gc.disable()
        try:
            shardckpt.load(live, d)
            assert not gc.isenabled()  # the caller's choice stands
        finally:
            gc.enable()
    finally:
        gc.callbacks.remove(count)
