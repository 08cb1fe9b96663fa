"""``benchmarks/load_path.py`` (issue 32's load-path count) still runs and sees the whole load.

Two gloo ranks (the fork-server pool) save and load a small FSDP2 model;
rank 0's load is traced. The path must start at ``load`` and pass through
the plan, the format, the storage and the stream: a tracer that lost the
stream or the plan would report a shorter path than the real one.
"""

from __future__ import annotations

import os
import sys

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


def _tool():
    """The script as a module (in the test process and in each rank)."""
    bench = os.path.join(ROOT, "benchmarks")
    sys.path.insert(0, bench)
    try:
        import load_path
    finally:
        sys.path.remove(bench)
    return load_path


def _save(rank, world, path):
    _tool()._save(rank, world, path)


def _trace(rank, world, path):
    return _tool()._load(rank, world, path)


def test_load_path_counts_the_files_a_load_crosses(tmp_path):
    from _dist import run_ranks

    load_path = _tool()
    path = str(tmp_path / "ckpt")
    run_ranks(2, _save, path)
    seq = run_ranks(2, _trace, path)[0]
    assert seq[0] == "_load/pipeline.py"  # load() itself
    for f in ("_load/plan.py", "_load/stream.py", "_format/committed.py", "_format/_v2.py", "_storage/_local.py", "_collective.py"):
        assert f in seq, (f, seq)
    c = load_path.counts(seq)
    assert c["moves"] == len(seq) - 1 and c["files"] == len(set(seq)) and 0 < c["returns"] < c["moves"]
    assert load_path.counts(["a", "b", "a", "c", "b"]) == {"files": 3, "moves": 4, "returns": 2,
                                                         "entered": {"a": 2, "b": 2, "c": 1}}
