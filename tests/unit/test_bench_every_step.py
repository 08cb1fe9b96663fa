"""The every-step benchmark (issue 28) still runs end to end on CPU: correctness and bytes, never timings."""

from __future__ import annotations

import json
import os
import sys

import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
SCRIPT = os.path.join(ROOT, "benchmarks", "bench_every_step.py")


@pytest.mark.slow
def test_every_step_then_lose_a_node(tmp_path):
    sys.path.insert(0, os.path.dirname(SCRIPT))
    try:
        import bench_every_step
    finally:
        sys.path.remove(os.path.dirname(SCRIPT))
    out = tmp_path / "summary.json"
    shm = tmp_path / "shm"
    shm.mkdir()
    argv = ["--backend", "gloo", "--world", "2", "--dim", "64", "--layers", "2", "--rows", "8", "--steps", "2",
            "--more", "2", "--dir", str(tmp_path), "--shm", str(shm), "--json", str(out), "--timeout", "600"]
    assert bench_every_step.main(argv) == 0
    s = json.loads(out.read_text())
    saved = s["saved_step"]
    assert saved == 1 + 2 + 2 + (1 + 2) + (1 + 2)  # warm-up, baseline, ideal, then each saving mode's first and timed steps
    assert s["first_save"]["mode"] == "blocking" and s["first_save"]["step_s"] > 0
    assert set(s["window_s"]) == {"baseline", "ideal", "blocking", "overlap"} and all(w > 0 for w in s["window_s"].values())
    same, smaller = s["restore_same_world"], s["restore_smaller_world"]
    # The replacement of node 1 restored the last memory step and trains on bit for bit.
    assert same["from"] == [f"memory:{saved}"] and same["losses_identical"]
    assert smaller["from"] == [f"memory:{saved}"] and smaller["world"] == 1
    assert smaller["losses_max_abs_diff"] < 1e-4  # the same global batch over fewer ranks: reduction order only
    # Node 1's replacement received its shard from node 0 (not from storage), and little more.
    assert all(shard <= got <= 1.05 * shard for got, shard in zip(same["replacement_bytes_received"], same["replacement_shard_bytes"]))
    # The survivor checked its own shard once (not the copy it sent); the replacement got what its load needs.
    assert all(x <= 1.05 for x in same["survivor_verified_over_own"]) and same["survivor_verified_over_own"], same
    assert [x["role"] for x in same["per_rank"]] == ["survivor", "replacement"] and same["link_gbps"] > 0
    assert same["per_rank"][1]["read_bytes"] == 0 and same["per_rank"][0]["sent_bytes"] > 0
    # The tier's host memory stays within its stated bound: two steps of (own + peer) files.
    assert all(0 < h <= b for h, b in zip(s["host_bytes_per_rank"], s["host_bytes_bound_per_rank"]))
    for mode in ("baseline", "ideal", "blocking", "overlap"):
        assert s["step_s"][mode]["n"] == 2
    assert not os.listdir(shm), "memory directories left behind"
