"""The fuzz campaign's engine: valid checkpoints, mutators, and the properties every mutant must keep.

Shared by the bounded pytest run (``tests/fuzz/test_fuzz_*.py``, driven by
hypothesis) and the long run (``python -m tests.fuzz.long``, driven by seeds).
A mutator takes a ``random.Random`` so both drivers use the same code:
hypothesis hands it a shrinkable one.

Targets (each a valid checkpoint built once, copied per case):

- ``manifest``: ``manifest.json`` of a native checkpoint;
- ``header``: a native data file (its safetensors header, length prefix and data);
- ``hf_index``: ``model.safetensors.index.json`` of a two-file Hugging Face directory;
- ``dcp``: the ``.metadata`` pickle (and data) of a DCP directory, read by the restricted unpickler;
- ``torch_save``: a ``torch.save`` zip archive.

Properties checked on every case (:func:`check`):

1. only shardckpt's exception types come out (``CheckpointError``), with a
   message that says something;
2. nothing outside the checkpoint is opened (an audit hook watches every
   ``open``: the canary directory next to it and ``/dev/zero`` are off limits);
3. memory stays bounded (peak RSS grows by less than :data:`MAX_RSS_GROWTH_BYTES`);
4. a failed load leaves the live state unchanged;
5. a successful load of a checksummed checkpoint is bit-exact (tensors).
"""

from __future__ import annotations

import copy
import json
import os
import random
import resource
import shutil
import stat
import sys
import tempfile
import threading
import warnings
from dataclasses import dataclass, field
from typing import Any, Callable, Dict, List, Optional

import torch

import shardckpt
from shardckpt.errors import CheckpointError

TARGETS = ("manifest", "header", "hf_index", "dcp", "torch_save")
#: A case may raise the high-water mark of the process's memory by at most this.
MAX_RSS_GROWTH_BYTES = 768 << 20
#: Nodes of a JSON document a structured mutation picks among (bounds the walk).
MAX_JSON_NODES = 400

# -- the audit hook: no read outside the checkpoint ---------------------------

_watch = threading.local()
_hook_installed = False


def _audit(event: str, args: Any) -> None:
    if event != "open" or not getattr(_watch, "on", False):
        return
    path = args[0]
    if isinstance(path, int):
        return
    try:
        p = os.fsdecode(path)
        real = os.path.realpath(p)
    except Exception:
        return
    if real == "/dev/zero" or real.startswith(_watch.forbidden):
        _watch.violations.append(real)


def _install_hook() -> None:
    global _hook_installed
    if not _hook_installed:
        sys.addaudithook(_audit)  # cannot be removed: it is inert unless a case is running
        _hook_installed = True


# -- valid checkpoints -------------------------------------------------------


def _model_state() -> Dict[str, Any]:
    g = torch.Generator().manual_seed(1234)
    return {
        "model": {
            "w": torch.randn(4, 3, generator=g),
            "b": torch.arange(5, dtype=torch.int64),
            "h": torch.randn(6, generator=g).to(torch.bfloat16),
        },
        "step": 7,
        "lr": 1e-3,
        "cfg": {"name": "fuzz", "pair": (1, 2), "ok": True, "none": None},
    }


def _blank_state() -> Dict[str, Any]:
    return {
        "model": {"w": torch.zeros(4, 3), "b": torch.zeros(5, dtype=torch.int64), "h": torch.zeros(6, dtype=torch.bfloat16)},
        "step": -1,
        "lr": 0.0,
        "cfg": {"name": "", "pair": (0, 0), "ok": False, "none": None},
    }


@dataclass
class Templates:
    """Valid checkpoints, built once: ``dirs[target]`` is the directory a case copies."""

    root: str
    dirs: Dict[str, str] = field(default_factory=dict)
    expected: Dict[str, torch.Tensor] = field(default_factory=dict)

    def close(self) -> None:
        shutil.rmtree(self.root, ignore_errors=True)


def build_templates() -> Templates:
    _install_hook()
    root = tempfile.mkdtemp(prefix="shardckpt-fuzz-")
    t = Templates(root)
    state = _model_state()
    t.expected = {f"model.{k}": v.clone() for k, v in state["model"].items()}
    native = os.path.join(root, "native")
    shardckpt.save(state, native)
    t.dirs["manifest"] = t.dirs["header"] = native

    from safetensors.torch import save_file

    hf = os.path.join(root, "hf")
    os.makedirs(hf)
    tensors = {k: v.contiguous() for k, v in t.expected.items()}
    save_file({"model.w": tensors["model.w"]}, os.path.join(hf, "model-00001-of-00002.safetensors"))
    save_file({k: tensors[k] for k in ("model.b", "model.h")}, os.path.join(hf, "model-00002-of-00002.safetensors"))
    weight_map = {"model.w": "model-00001-of-00002.safetensors", "model.b": "model-00002-of-00002.safetensors",
                  "model.h": "model-00002-of-00002.safetensors"}
    with open(os.path.join(hf, "model.safetensors.index.json"), "w") as f:
        json.dump({"metadata": {"total_size": sum(v.nbytes for v in tensors.values())}, "weight_map": weight_map}, f)
    t.dirs["hf_index"] = hf

    import torch.distributed.checkpoint as dcp

    d = os.path.join(root, "dcp")
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        dcp.save({"model": dict(state["model"]), "step": torch.tensor(7)}, checkpoint_id=d)
    t.dirs["dcp"] = d

    ts = os.path.join(root, "ts")
    os.makedirs(ts)
    torch.save({"model": dict(state["model"]), "step": 7}, os.path.join(ts, "model.pt"))
    t.dirs["torch_save"] = ts
    return t


# -- mutators --------------------------------------------------------------------

_SENTINEL = "@@shardckpt-fuzz@@"

_JSON_VALUES: List[Callable[[random.Random], str]] = [
    lambda r: "null",
    lambda r: "true",
    lambda r: '""',
    lambda r: "[]",
    lambda r: "{}",
    lambda r: str(r.choice([2**63, 2**64 + 1, 10**30, -1, -(2**63), 0, 1])),
    lambda r: r.choice(["NaN", "Infinity", "-Infinity", "1e5000", "-0.0", "1.5", "1e-400"]),
    lambda r: "[" * r.choice([50, 500, 5000, 100000]) + "]" * 0,  # unbalanced: deep and broken
    lambda r: (lambda n: "[" * n + "1" + "]" * n)(r.choice([50, 300, 5000, 100000])),
    lambda r: (lambda n: '{"a":' * n + "1" + "}" * n)(r.choice([50, 300, 5000])),
    lambda r: json.dumps(r.choice(["../../etc/passwd", "/etc/passwd", "s3://bucket/x", "file:///etc/passwd",
                                   "data/../manifest.json", "data/./x", "data//x", "C:\\\\x", "\u202e\u0000x",
                                   "\ud800", "é" * 3, "x" * 5000, "data/" + "y" * 300 + ".safetensors"])),
    lambda r: '{"__shardckpt__":' + r.choice(['"float","value":"1e5000"}', '"float","value":"nan"}', '"tuple"}',
                                               '"dict","items":[[1]]}', '"tensor","name":"nope"}', '"dtype","value":"os"}',
                                               '"device","value":"cuda:99"}', '"bogus"}', '"tuple","items":7}']),
    lambda r: '"' + "\\u0000" * r.randint(1, 5) + '"',
]


def _nodes(doc: Any) -> List[tuple]:
    """Paths (tuples of keys/indices) of up to MAX_JSON_NODES nodes, breadth first."""
    out, queue = [], [()]
    while queue and len(out) < MAX_JSON_NODES:
        path = queue.pop(0)
        out.append(path)
        node = _get(doc, path)
        if isinstance(node, dict):
            queue.extend(path + (k,) for k in node)
        elif isinstance(node, list):
            queue.extend(path + (i,) for i in range(len(node)))
    return out


def _get(doc, path):
    for p in path:
        doc = doc[p]
    return doc


def mutate_json(data: bytes, r: random.Random) -> bytes:
    """A structured mutation of a JSON document: one node replaced, removed, renamed or duplicated."""
    try:
        doc = json.loads(data)
    except Exception:
        return mutate_bytes(data, r)
    paths = _nodes(doc)
    path = r.choice(paths)
    op = r.choice(["replace", "replace", "replace", "delete", "rename", "duplicate", "wrap"])
    if not path:
        op = "replace"
    parent = _get(doc, path[:-1]) if path else None
    raw = _JSON_VALUES[r.randrange(len(_JSON_VALUES))](r)
    if op == "delete" and parent is not None:
        del parent[path[-1]]
        return json.dumps(doc).encode()
    if op == "rename" and isinstance(parent, dict):
        v = parent.pop(path[-1])
        parent[r.choice(["", "__metadata__", "x" * 300, str(path[-1]) + "\u0301", "../" + str(path[-1])])] = v
        return json.dumps(doc).encode()
    if op == "duplicate" and isinstance(parent, dict):
        # JSON objects with duplicate keys: the text holds both, parsers keep one.
        parent[path[-1]] = _SENTINEL
        text = json.dumps(doc)
        return text.replace(json.dumps(_SENTINEL), raw + ', ' + json.dumps(str(path[-1])) + ': ' + raw, 1).encode()
    if op == "wrap":
        raw = "[" + json.dumps(_get(doc, path)) + "]"
    if not path:
        return raw.encode()
    parent[path[-1]] = _SENTINEL
    return json.dumps(doc).replace(json.dumps(_SENTINEL), raw, 1).encode()


def mutate_bytes(data: bytes, r: random.Random, *, region: Optional[tuple] = None) -> bytes:
    """A byte-level mutation: flips, truncation, splice, insertion, a number made huge."""
    b = bytearray(data)
    lo, hi = region if region else (0, len(b))
    hi = max(lo + 1, min(hi, len(b)))
    op = r.choice(["flip", "flip", "truncate", "splice", "insert", "number", "zero"])
    if not b:
        return bytes(r.randbytes(r.randint(1, 64)))
    if op == "flip":
        for _ in range(r.randint(1, 8)):
            i = r.randrange(lo, hi)
            b[i] ^= 1 << r.randrange(8)
    elif op == "truncate":
        del b[r.randrange(0, len(b)) :]
    elif op == "splice":
        n = r.randint(1, 64)
        a, c = r.randrange(len(b)), r.randrange(lo, hi)
        b[c : c + n] = b[a : a + n]
    elif op == "insert":
        i = r.randrange(lo, hi)
        b[i:i] = r.randbytes(r.randint(1, 32))
    elif op == "zero":
        i = r.randrange(lo, hi)
        b[i : i + r.randint(1, 64)] = bytes(min(64, len(b) - i))
    else:  # a run of digits becomes a huge, negative or odd number
        digits = [i for i in range(lo, hi) if 48 <= b[i] <= 57 and (i == 0 or not 48 <= b[i - 1] <= 57)]
        if not digits:
            b[r.randrange(lo, hi)] ^= 0xFF
        else:
            i = r.choice(digits)
            j = i
            while j < len(b) and 48 <= b[j] <= 57:
                j += 1
            b[i:j] = r.choice([b"99999999999999999999", b"18446744073709551615", b"-1", b"1e5000", b"NaN", b"0"])
    return bytes(b)


def _fs_mutation(path: str, r: random.Random, outside: str) -> str:
    """Replace the file at ``path`` by something that is not a regular file inside the checkpoint."""
    kind = r.choice(["fifo", "dev_zero", "outside_copy", "loop", "dir", "missing", "dangling"])
    copy_of = None
    if kind == "outside_copy":
        copy_of = os.path.join(outside, os.path.basename(path))
        shutil.copy(path, copy_of)
    os.unlink(path)
    if kind == "fifo":
        os.mkfifo(path)
    elif kind == "dev_zero":
        os.symlink("/dev/zero", path)
    elif kind == "outside_copy":
        os.symlink(copy_of, path)
    elif kind == "loop":
        os.symlink(os.path.basename(path), path)
    elif kind == "dir":
        os.mkdir(path)
    elif kind == "dangling":
        os.symlink(os.path.join(outside, "nothing-here"), path)
    return kind


def _safetensors_regions(data: bytes):
    n = int.from_bytes(data[:8], "little") if len(data) >= 8 else 0
    return (0, 8), (8, min(len(data), 8 + n)), (min(len(data), 8 + n), len(data))


def mutate_case(target: str, case_dir: str, outside: str, r: random.Random) -> str:
    """Mutate the copy of ``target``'s checkpoint at ``case_dir``; returns what was done."""
    if target == "manifest":
        files = ["manifest.json"]
    elif target == "header":
        files = sorted(os.path.join("data", f) for f in os.listdir(os.path.join(case_dir, "data")))
    elif target == "hf_index":
        files = ["model.safetensors.index.json"] * 3 + ["model-00001-of-00002.safetensors"]
    elif target == "dcp":
        files = [".metadata"] * 3 + sorted(f for f in os.listdir(case_dir) if f.endswith(".distcp"))
    else:
        files = ["model.pt"]
    rel = r.choice(files)
    path = os.path.join(case_dir, rel)
    how = r.random()
    if how < 0.08:
        return f"{rel}: {_fs_mutation(path, r, outside)}"
    with open(path, "rb") as f:
        data = f.read()
    if rel.endswith(".json") and how < 0.6:
        out, what = mutate_json(data, r), "json"
    elif rel.endswith(".safetensors"):
        length, header, body = _safetensors_regions(data)
        pick = r.random()
        if pick < 0.2:  # the length prefix: enlarged, shrunk, absurd
            n = int.from_bytes(data[:8], "little")
            new = r.choice([n + r.randint(1, 64), max(0, n - r.randint(1, 8)), 2**63 - 1, 2**64 - 1, 10**8, 0, len(data)])
            out, what = new.to_bytes(8, "little") + data[8:], f"length {new}"
        elif pick < 0.6 and header[1] > header[0]:
            head = data[header[0] : header[1]]
            new_head = mutate_json(head, r)
            out = len(new_head).to_bytes(8, "little") + new_head + data[header[1] :]
            what = "header json"
        else:
            region = body if pick < 0.8 and body[1] > body[0] else None
            out, what = mutate_bytes(data, r, region=region), "bytes"
    else:
        out, what = mutate_bytes(data, r), "bytes"
    with open(path, "wb") as f:
        f.write(out)
    return f"{rel}: {what}"


# -- operations and properties ------------------------------------------------------


@dataclass
class Outcome:
    """What one case did: which operations failed (with our types), which succeeded."""

    mutation: str
    errors: Dict[str, str] = field(default_factory=dict)
    ok: List[str] = field(default_factory=list)
    values_changed: bool = False


class PropertyViolation(AssertionError):
    """A mutant broke a property: a foreign exception, a read outside, unbounded memory, a wrong load."""


def _snapshot(state):
    return copy.deepcopy(state)


def _equal_state(a, b) -> bool:
    if isinstance(a, torch.Tensor):
        # Bit-exact: compare the bytes (NaN payloads and -0.0 included).
        return (
            isinstance(b, torch.Tensor) and a.dtype == b.dtype and a.shape == b.shape
            and torch.equal(a.contiguous().view(-1).view(torch.uint8), b.contiguous().view(-1).view(torch.uint8))
        )
    if isinstance(a, dict):
        return isinstance(b, dict) and a.keys() == b.keys() and all(_equal_state(a[k], b[k]) for k in a)
    if isinstance(a, (list, tuple)):
        return type(a) is type(b) and len(a) == len(b) and all(_equal_state(x, y) for x, y in zip(a, b))
    return a == b or (a != a and b != b)


def _ops(target: str, case_dir: str, work: str, t: Templates) -> Dict[str, Callable[[], Any]]:
    if target in ("manifest", "header", "hf_index"):
        ops: Dict[str, Callable[[], Any]] = {"inspect": lambda: shardckpt.inspect(case_dir)}
        if target != "hf_index":
            ops["verify"] = lambda: shardckpt.verify(case_dir)
        ops["load"] = lambda: None  # run by check() itself: it compares states
        return ops
    if target == "dcp":
        return {"from_dcp": lambda: shardckpt.converters.from_dcp(case_dir, os.path.join(work, "out"))}
    return {"from_torch_save": lambda: shardckpt.converters.from_torch_save(os.path.join(case_dir, "model.pt"), os.path.join(work, "out"))}


def _name_problem(e: BaseException) -> bool:
    return len(str(e).strip()) >= 10


def check(target: str, r: random.Random, t: Templates) -> Outcome:
    """Run one case: copy ``target``'s template, mutate it, run every operation, check every property.

    Raises:
        PropertyViolation: naming the mutation and the property broken.
    """
    work = tempfile.mkdtemp(prefix="case-", dir=t.root)
    case_dir = os.path.join(work, "ck")
    outside = os.path.join(work, "outside")
    os.makedirs(outside)
    try:
        shutil.copytree(t.dirs[target], case_dir, symlinks=True)
        mutation = mutate_case(target, case_dir, outside, r)
        out = Outcome(mutation)
        rss0 = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024
        _watch.forbidden = outside.rstrip(os.sep) + os.sep
        _watch.violations = []
        _watch.on = True
        try:
            for name, op in _ops(target, case_dir, work, t).items():
                if name == "load":
                    _check_load(target, case_dir, out, t)
                    continue
                try:
                    op()
                    out.ok.append(name)
                except CheckpointError as e:
                    if not _name_problem(e):
                        raise PropertyViolation(f"[{mutation}] {name}: {type(e).__name__} with an empty message") from e
                    out.errors[name] = type(e).__name__
                except PropertyViolation:
                    raise
                except BaseException as e:  # noqa: BLE001 - the property under test
                    raise PropertyViolation(
                        f"[{mutation}] {name} raised {type(e).__module__}.{type(e).__name__}, not a shardckpt error: {str(e)[:300]}"
                    ) from e
        finally:
            _watch.on = False
        if _watch.violations:
            raise PropertyViolation(f"[{mutation}] opened files outside the checkpoint: {sorted(set(_watch.violations))[:3]}")
        grown = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024 - rss0
        if grown > MAX_RSS_GROWTH_BYTES:
            raise PropertyViolation(f"[{mutation}] peak memory grew by {grown >> 20} MiB")
        return out
    finally:
        _unblock_fifos(work)
        shutil.rmtree(work, ignore_errors=True)


def _check_load(target: str, case_dir: str, out: Outcome, t: Templates) -> None:
    live = _blank_state() if target != "hf_index" else {"model": _blank_state()["model"]}
    before = _snapshot(live)
    try:
        shardckpt.load(live, case_dir)
    except CheckpointError as e:
        if not _name_problem(e):
            raise PropertyViolation(f"[{out.mutation}] load: {type(e).__name__} with an empty message") from e
        if not _equal_state(live, before):
            raise PropertyViolation(f"[{out.mutation}] load failed ({type(e).__name__}: {str(e)[:200]}) but changed the live state") from e
        out.errors["load"] = type(e).__name__
        return
    except BaseException as e:  # noqa: BLE001
        raise PropertyViolation(
            f"[{out.mutation}] load raised {type(e).__module__}.{type(e).__name__}, not a shardckpt error: {str(e)[:300]}"
        ) from e
    out.ok.append("load")
    for name, want in t.expected.items():
        got = live["model"][name.split(".", 1)[1]]
        if not _equal_state(got, want):
            raise PropertyViolation(f"[{out.mutation}] load succeeded with different bytes in {name}")
    if target != "hf_index":
        ref = _model_state()
        out.values_changed = any(not _equal_state(live[k], ref[k]) for k in ("step", "lr", "cfg"))


def _unblock_fifos(work: str) -> None:
    """Wake any reader still blocked on a FIFO of this case (there should be none)."""
    for dirpath, dirnames, files in os.walk(work):
        for f in files + dirnames:
            p = os.path.join(dirpath, f)
            try:
                if stat.S_ISFIFO(os.lstat(p).st_mode):
                    os.close(os.open(p, os.O_WRONLY | os.O_NONBLOCK))
            except OSError:
                pass
