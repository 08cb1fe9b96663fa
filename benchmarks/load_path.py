"""How far a reader follows ``url`` through the package during one ``shardckpt.load`` (issue 32's "load path").

Saves a small FSDP2 model on 2 gloo ranks, loads it on 2 ranks, and traces
rank 0's load with ``sys.setprofile`` (main thread; the reader threads are
left out). The trace becomes a calling-context tree of the package's
functions (each distinct call chain once, children in first-call order, so
the count does not grow with the number of tensors), pruned to the calls
that carry the URL — an argument or closure variable that is the URL string
or an object whose ``url`` is it (a ``Storage``) — and the calls leading to
them. Walking that tree depth-first gives the sequence of files a reader
enters; consecutive repeats are merged. Printed:

* ``files``: distinct files on the path;
* ``moves``: changes of file along the sequence;
* ``returns``: moves into a file already entered before;
* ``entered``: how often each file is entered (``_format/_v2.py`` and the others);

also with ``_storage/`` as one stop, and with ``_load`` (file or package) as one more.

Usage::

    python benchmarks/load_path.py            # the counts
    python benchmarks/load_path.py --show     # and the sequence of files
"""

from __future__ import annotations

import argparse
import os
import sys
import tempfile
from collections import Counter
from typing import Any, Dict, List, Optional, Tuple

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path[:0] = [os.path.join(ROOT, "tests")]


class _Node:
    __slots__ = ("key", "file", "carries", "children")

    def __init__(self, key: Tuple[str, str], file: str, carries: bool):
        self.key, self.file, self.carries = key, file, carries
        self.children: Dict[Tuple[str, str], "_Node"] = {}


def _carries(frame: Any, url: str) -> bool:
    """Whether a local of ``frame`` (argument, closure variable, assigned name) is the URL or has it as ``url``."""
    for v in frame.f_locals.values():
        if isinstance(v, str):
            if v.startswith(url):
                return True
            continue
        if isinstance(v, type):
            continue
        try:
            u = getattr(v, "url", None)  # a Storage, or a wrapper of one (refs.RefStorage)
        except Exception:  # noqa: BLE001 - any object may be a local
            u = None
        if isinstance(u, str) and u.startswith(url):
            return True
    return False


def trace_load(state: Dict[str, Any], url: str, **kw: Any) -> _Node:
    """Load ``state`` from ``url`` under the profiler; the calling-context tree of the package's calls."""
    import shardckpt

    pkg = os.path.dirname(os.path.abspath(shardckpt.__file__)) + os.sep
    root = _Node(("", ""), "", False)
    stack: List[Optional[_Node]] = [root]

    def prof(frame, event, arg):
        if event == "call":
            f = frame.f_code.co_filename
            parent = stack[-1]
            if f.startswith(pkg) and parent is not None and frame.f_code.co_name != "<module>":
                key = (f, frame.f_code.co_qualname if hasattr(frame.f_code, "co_qualname") else frame.f_code.co_name)
                node = parent.children.get(key)
                if node is None:
                    node = parent.children[key] = _Node(key, os.path.relpath(f, os.path.dirname(pkg)), _carries(frame, url))
                stack.append(node)
            elif frame.f_code.co_name == "<module>" and f.startswith(pkg):
                stack.append(None)  # a lazy import: not the load's path
            else:
                # Outside the package (torch, the standard library): calls back
                # into the package from there hang under the last package frame.
                stack.append(parent)
        elif event == "return":
            if len(stack) > 1:
                node = stack.pop()
                # Closure variables and names assigned inside count too (seen at return).
                if node is not None and node is not root and not node.carries and node.key[0] == frame.f_code.co_filename:
                    node.carries = _carries(frame, url)

    sys.setprofile(prof)
    try:
        shardckpt.load(state, url, **kw)
    finally:
        sys.setprofile(None)
    return root


def _keep(node: _Node) -> bool:
    """Prune to the calls that carry the URL and the calls leading to them (in place)."""
    node.children = {k: c for k, c in node.children.items() if _keep(c)}
    return node.carries or bool(node.children)


def path_of(root: _Node) -> List[str]:
    """Files entered, depth-first in first-call order, consecutive repeats merged."""
    _keep(root)
    out: List[str] = []

    def walk(n: _Node) -> None:
        if n.file and (not out or out[-1] != n.file):
            out.append(n.file)
        for c in n.children.values():
            walk(c)

    walk(root)
    return out


def counts(seq: List[str]) -> Dict[str, Any]:
    seen, returns = set(), 0
    for i, f in enumerate(seq):
        if i and f in seen:
            returns += 1
        seen.add(f)
    return {"files": len(seen), "moves": len(seq) - 1, "returns": returns, "entered": Counter(seq)}


def _save(rank: int, world: int, path: str) -> None:
    from models import build, shard_fsdp2

    import shardckpt

    shardckpt.save({"model": shard_fsdp2(build(seed=1)), "step": 11}, path)


def _load(rank: int, world: int, path: str) -> Optional[List[str]]:
    from models import build, shard_fsdp2

    state = {"model": shard_fsdp2(build(seed=2)), "step": 0}
    if rank:
        import shardckpt

        shardckpt.load(state, path)
        return None
    return path_of(trace_load(state, path))


def main(argv: Optional[List[str]] = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--show", action="store_true", help="print the sequence of files")
    args = ap.parse_args(argv)
    from _dist import run_ranks

    with tempfile.TemporaryDirectory() as d:
        path = os.path.join(d, "ckpt")
        run_ranks(2, _save, path)
        seq = run_ranks(2, _load, path)[0]
    if args.show:
        print(" -> ".join(seq))
    # Other views: the storage package as one stop (its backends' own calls
    # are not the load's path), and the load package as one stop too (the
    # one file _load.py was before issue 32).
    def merge(prefixes: Tuple[str, ...]) -> List[str]:
        out: List[str] = []
        for f in seq:
            f = next((p for p in prefixes if f.startswith(p)), f)
            if not out or out[-1] != f:
                out.append(f)
        return out

    views = (("all files", seq), ("storage as one stop", merge(("_storage/",))),
             ("storage and the load as one stop each", merge(("_storage/", "_load"))))
    for what, s in views:
        c = counts(s)
        print(f"{what}: files {c['files']}, moves {c['moves']}, returns to a file already entered {c['returns']}")
        print("  entered: " + ", ".join(f"{f} {n}" for f, n in c["entered"].most_common()))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
