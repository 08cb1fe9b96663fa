#!/bin/bash
# Wave 11: one call on one GPU host (16 CPUs), about 4 minutes; the device budget left was 8 minutes.
#   plan   issue 45: bench_scale (50,000 tensors, fsdp, 16,384 ranks) and bench_moe_scale (16,384 ranks, same
#          layout and resharded), this tree against the wave-10 tip copied as _old/ (its shardckpt/ and
#          benchmarks/), alternately in fresh processes, medians (~90 s)           -> plan.log, moe.log
#   load   issue 43: benchmarks/device/wave11_load.sh STEPS=warm16 (~80 s)          -> warm16.json
# Needs .whl/ (crc32c cp312, fastsafetensors cp312) in `carry`, and _old/ in the tree:
#   mkdir _old && git archive 2fe39b1 shardckpt benchmarks | tar -x -C _old
cd "$(dirname "$0")/../.."
OUT=${OUT:-/tmp/out}; mkdir -p "$OUT"
exec > >(tee "$OUT/wave11.log") 2>&1
PY=${PYTHON:-python3}
$PY -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --target /tmp/site .whl/crc32c*.whl .whl/fastsafetensors*.whl || exit 1
export PYTHONPATH=$PWD:/tmp/site PYTHONUNBUFFERED=1
date -u; nvidia-smi -L; nproc; grep -m1 "model name" /proc/cpuinfo; uptime; git log --oneline -1 2>/dev/null
for s in ${STEPS:-plan load}; do
case $s in
plan)
    echo "=== plan: bench_scale 50,000 tensors fsdp 16,384 ranks, new vs _old (wave-10 tip), 5 each"
    timeout 150 $PY benchmarks/bench_scale.py --ranks 16384 --tensors 50000 --layout fsdp --compare-with _old --repeat 5 2>&1 | tee "$OUT/plan.log" | tail -40
    echo "=== plan: bench_moe_scale 16,384 ranks, new vs _old, 3 each"
    timeout 120 $PY benchmarks/bench_moe_scale.py --ranks 16384 --compare-with _old --repeat 3 2>&1 | tee "$OUT/moe.log" | tail -40;;
load)
    OUT=$OUT STEPS=warm16 timeout 200 bash benchmarks/device/wave11_load.sh;;
esac
done
date -u
