"""The save/load benchmark still runs end to end (tiny size), so it cannot rot."""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
SCRIPT = os.path.join(ROOT, "benchmarks", "bench_save_load.py")
CASES = ["raw", "shardckpt", "shardckpt-nocrc", "dcp-t1", "dcp-t2", "safetensors"]


def _args(tmp_path, *extra):
    return ["--size-gb", "0.003", "--dir", str(tmp_path / "scratch"), "--drop-cache", "fadvise",
            "--json", str(tmp_path / "res.json"), "--markdown", str(tmp_path / "res.md"), *extra]


def _results(tmp_path):
    return json.loads((tmp_path / "res.json").read_text()), (tmp_path / "res.md").read_text()


def _run(tmp_path, *extra):
    """The script as a user runs it: a separate interpreter."""
    cmd = [sys.executable, SCRIPT, *_args(tmp_path, *extra)]
    proc = subprocess.run(cmd, cwd=ROOT, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, timeout=600)
    assert proc.returncode == 0, proc.stdout[-4000:]
    return _results(tmp_path)


def test_every_case_in_process(tmp_path, capsys):
    # All cases in this process (--no-isolate: no interpreter start per case,
    # so this stays fast). The values each load returns are checked against
    # what was saved inside the script; a mismatch raises.
    sys.path.insert(0, os.path.dirname(SCRIPT))
    try:
        import bench_save_load
    finally:
        sys.path.remove(os.path.dirname(SCRIPT))
    assert bench_save_load.main(_args(tmp_path, "--no-isolate")) == 0
    res, md = _results(tmp_path)
    for case in CASES:
        assert f"| {case} |" in md, case
        runs = res["results"][case]
        assert runs["save"][0]["seconds"] > 0 and runs["load"][0]["seconds"] > 0
        assert runs["save"][0]["nbytes"] == runs["load"][0]["nbytes"] > 2_000_000
    assert "checksum cost (save)" in md and "checksum cost (load)" in md
    assert "dropped with fadvise" in md
    assert res["machine"]["nproc"]
    assert not os.listdir(tmp_path / "scratch"), "checkpoints left behind"
    assert "| shardckpt |" in capsys.readouterr().out


@pytest.mark.slow
def test_isolated_case_reports_peak_rss(tmp_path):
    # The real mode: save and load each in a fresh process with its own peak RSS.
    res, md = _run(tmp_path, "--cases", "shardckpt")
    s, l = res["results"]["shardckpt"]["save"][0], res["results"]["shardckpt"]["load"][0]
    assert s["peak_rss"] > 50 << 20 and l["peak_rss"] > 50 << 20  # interpreter + torch at least
    assert "| shardckpt |" in md


@pytest.mark.slow
def test_two_ranks(tmp_path):
    # Ranks started as torchrun would; DTensors sharded over a gloo group.
    res, md = _run(tmp_path, "--ranks", "2", "--cases", "shardckpt")
    load = res["results"]["shardckpt"]["load"][0]
    assert load["nbytes"] > 2_000_000 and load["peak_rss"] > 50 << 20
    assert "2 rank(s)" in md


def test_bench_replicas_under_torchrun(tmp_path):
    """benchmarks/bench_replicas.py runs as documented (torchrun, gloo) and reports both modes and DCP."""
    import json
    import subprocess
    import sys

    root = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
    r = subprocess.run(
        [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", "2",
         os.path.join(root, "benchmarks", "bench_replicas.py"), "--params", "2e5", "--layers", "2", "--device", "cpu",
         "--dir", str(tmp_path / "b"), "--repeat", "1"],
        capture_output=True, text=True, timeout=300, env=dict(os.environ, CUDA_VISIBLE_DEVICES=""),
    )
    assert r.returncode == 0, r.stdout[-3000:] + r.stderr[-3000:]
    out = json.loads([line for line in r.stdout.splitlines() if line.startswith("{")][-1])
    assert out["mesh"] == [2, 1] and out["replicated_bytes_per_rank"] > 0
    assert len(out["runs_s"]["off"]) == len(out["runs_s"]["check"]) == len(out["runs_s"]["dcp"]) == 1
    assert os.listdir(tmp_path / "b") == []  # every checkpoint removed after its save


@pytest.mark.slow
def test_bench_tiers_runs_as_documented(tmp_path):
    """benchmarks/bench_tiers.py (SeaweedFS behind the fault proxy) runs end to end, tiny, and its remote steps verify."""
    pytest.importorskip("obstore")
    out = tmp_path / "tiers.json"
    cmd = [sys.executable, os.path.join(ROOT, "benchmarks", "bench_tiers.py"), "--size-mb", "1", "--steps", "3",
           "--step-s", "0", "--delay-s", "0.2", "--stall-s", "4", "--json", str(out)]
    proc = subprocess.run(cmd, cwd=ROOT, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, timeout=600)
    assert proc.returncode == 0, proc.stdout[-4000:]
    res = json.loads(out.read_text())
    cases = {c["case"]: c for c in res["cases"]}
    assert set(cases) == {"local-only", "tiers-delayed", "tiers-stalled", "direct-delayed"}
    for name in ("tiers-delayed", "tiers-stalled", "direct-delayed"):
        assert cases[name]["remote_steps"][-1] == 3 and cases[name]["remote_verified"], cases[name]
    assert cases["tiers-stalled"]["proxy"].get("stall", 0) >= 1


def test_suite_memory_sums_the_whole_process_tree(tmp_path):
    """benchmarks/suite_memory.py (issue 47 item 3): a process and its grandchild, each holding 200 MB, are summed."""
    hold = "b = bytearray(200 << 20)\nb[::4096] = bytes(len(b[::4096]))\nimport time\ntime.sleep(3)\n"
    (tmp_path / "hold.py").write_text(hold)
    (tmp_path / "child.py").write_text(f"import subprocess, sys\nsubprocess.run([sys.executable, {str(tmp_path / 'hold.py')!r}])\n")
    (tmp_path / "outer.py").write_text(
        f"import subprocess, sys\np = subprocess.Popen([sys.executable, {str(tmp_path / 'child.py')!r}])\n{hold}p.wait()\nsys.exit(3)\n")
    cmd = [sys.executable, os.path.join(ROOT, "benchmarks", "suite_memory.py"), "--interval", "0.2", "--json", str(tmp_path / "m.json"),
           "--cmd", f"{sys.executable} {tmp_path / 'outer.py'}"]
    proc = subprocess.run(cmd, cwd=ROOT, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, timeout=300)
    assert proc.returncode == 3, proc.stdout  # the command's exit code
    line = proc.stdout.splitlines()[0]
    assert line.startswith("peak summed RSS: ") and "peak summed PSS: " in line, proc.stdout
    got = json.loads((tmp_path / "m.json").read_text())
    assert got["peak_rss"] > 400 << 20, (got["peak_rss"], proc.stdout)  # both holders at once: more than either alone


def test_bench_byte_path_runs_as_documented(tmp_path):
    """benchmarks/bench_byte_path.py (issue 43): every CPU case, tiny, cold from a directory; values checked inside."""
    scratch = tmp_path / "scratch"
    scratch.mkdir()
    cmd = [sys.executable, os.path.join(ROOT, "benchmarks", "bench_byte_path.py"), "--size-gib", "0.01", "--repeat", "1",
           "--dir", str(scratch), "--cold", "--drop-cache", "fadvise", "--raw-gb", "0.02", "--no-cuda",
           "--json", str(tmp_path / "res.json")]
    proc = subprocess.run(cmd, cwd=ROOT, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, timeout=600)
    assert proc.returncode == 0, proc.stdout[-4000:]
    res = json.loads((tmp_path / "res.json").read_text())
    loads = {"memcpy", "read", "safetensors", "shardckpt", "shardckpt-map", "shardckpt-nocrc", "shardckpt-hf", "shardckpt-hf-map", "dcp"}
    saves = {"write", "save_file", "shardckpt", "dcp", "hf-export"}
    assert set(res["cases"]) == {f"load:{c}" for c in loads} | {f"save:{c}" for c in saves}, res.get("skipped")
    assert res["drop"] == ["fadvise"] and res["raw_disk"]["read_gbps"] > 0
    assert 0 <= res["shardckpt_load_extra_rss"] < 256 << 20
    assert os.listdir(scratch) == []  # everything removed
