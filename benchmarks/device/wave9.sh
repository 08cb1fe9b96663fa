#!/bin/bash
# Wave 9 (issues 43 and 45): one call on one GPU host (16 CPUs), on the merged main, <= ~420 s.
# Wheels the device lacks (its Python is 3.12), in .whl/ at the repository root
# (git-ignored: pass ".whl" in `carry`):
#   crc32c-2.9.post0-cp312-cp312-manylinux1_x86_64.manylinux_2_28_x86_64.manylinux_2_5_x86_64.whl   (required)
#   fastsafetensors-0.5.0-cp312-cp312-manylinux_2_27_x86_64.manylinux_2_28_x86_64.whl              (optional: its CUDA case)
# Get them with:  pip download crc32c fastsafetensors --no-deps --only-binary=:all: \
#                   --python-version 3.12 --platform manylinux2014_x86_64 -d .whl
# Writes under $OUT:
#   tmpfs.json        bench_byte_path, 1 GiB from /dev/shm, every core (loads, saves, hf-export; CUDA loads)
#   tmpfs-2core.json  the same pinned to 2 cores (taskset -c 0,1), CPU only
#   cold.json         --cold from /tmp (the VM's disk), 2 GiB, page cache dropped, raw 8-stream disk speed;
#                     hf-export (converters.to_safetensors) beside the raw write
#   export.txt        hf-export GB/s / raw parallel write GB/s, from cold.json and tmpfs.json
#   moe_scale.json    bench_moe_scale.py at 16,384 simulated ranks (+ the real control-plane exchanges)
#   scale_fsdp.txt    bench_scale.py --ranks 16384 --tensors 50000 --layout fsdp (its report; last line the figures)
#   wave9.log         everything printed
# TINY=1: tiny sizes, CPU only, no wheels installed (PYTHON= one that has crc32c): a dry run of the whole script.
cd "$(dirname "$0")/../.."
OUT=${OUT:-/tmp/out}; mkdir -p "$OUT"
exec > >(tee "$OUT/wave9.log") 2>&1
PY=${PYTHON:-python3}
if [ -z "$TINY" ] && ls .whl/*.whl >/dev/null 2>&1; then
    $PY -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --target /tmp/site .whl/*.whl || exit 1
fi
[ -d shardckpt/converters ] || cp -r converters shardckpt/converters   # as an installed package has it
export PYTHONPATH=$PWD:/tmp/site PYTHONUNBUFFERED=1
export NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1
if [ -n "$TINY" ]; then
    GIB=0.03; COLD_GIB=0.05; RAW_GB=0.1; REP=1; RANKS=128; TENSORS=600; NOCUDA=--no-cuda
else
    GIB=1; COLD_GIB=${COLD_GIB:-2}; RAW_GB=${RAW_GB:-4}; REP=3; RANKS=16384; TENSORS=50000; NOCUDA=
fi
date -u; nvidia-smi -L 2>/dev/null; nproc; free -g | head -2; df -h /tmp /dev/shm | tail -2; git log --oneline -1 2>/dev/null
$PY -c "import torch, crc32c, safetensors; print('torch', torch.__version__, 'safetensors', safetensors.__version__)" || exit 1
$PY -c "import shardckpt.converters as c; print('converters from', c.__file__)"
$PY -c "import fastsafetensors; print('fastsafetensors', fastsafetensors.__version__)" 2>/dev/null || echo "no fastsafetensors"
# Timeouts sum to 405 s; 2026-12-06 runs of the same cases took ~60 + ~50 s (tmpfs) and ~160 s (cold, 4 GiB).
echo "=== tmpfs, all cores (~60 s)"
timeout 90 $PY benchmarks/bench_byte_path.py --size-gib $GIB --repeat $REP $NOCUDA --json "$OUT/tmpfs.json"
echo "=== tmpfs, 2 cores (taskset -c 0,1) (~50 s)"
timeout 70 taskset -c 0,1 $PY benchmarks/bench_byte_path.py --size-gib $GIB --repeat $REP --no-cuda --no-rss \
    --json "$OUT/tmpfs-2core.json"
echo "=== cold, /tmp (page cache dropped before every load), raw disk speed beside it (~90 s)"
COLD=$(mktemp -d /tmp/wave9-cold.XXXXXX)
timeout 110 $PY benchmarks/bench_byte_path.py --dir "$COLD" --cold --size-gib $COLD_GIB --raw-gb $RAW_GB --repeat 1 \
    --no-cuda --no-rss --json "$OUT/cold.json"
rm -rf "$COLD"
echo "=== HF export vs raw write"
$PY - "$OUT" <<'PYEOF' | tee "$OUT/export.txt"
import json, os, sys
out = sys.argv[1]
for name in ("tmpfs.json", "tmpfs-2core.json", "cold.json"):
    p = os.path.join(out, name)
    if not os.path.exists(p):
        print(f"{name}: missing")
        continue
    r = json.load(open(p))
    c = r.get("cases", {})
    hf = c.get("save:hf-export", {}).get("gbps")
    wr = c.get("save:write", {}).get("gbps")
    raw = (r.get("raw_disk") or {}).get("write_gbps")
    line = f"{name}: hf-export {hf} GB/s, os.write {wr} GB/s"
    if hf and wr:
        line += f", export/os.write {hf / wr:.0%}"
    if hf and raw:
        line += f", raw 8-stream write {raw:.2f} GB/s, export/raw write {hf / raw:.0%} (target >= 90%)"
    print(line)
PYEOF
echo "=== issue 45: bench_moe_scale.py at $RANKS simulated ranks, --control-plane (CPU only)"
timeout 75 $PY benchmarks/bench_moe_scale.py --ranks $RANKS --tensors $TENSORS --control-plane --json "$OUT/moe_scale.json" \
    || echo "bench_moe_scale: exit $?"
echo "=== issue 45: bench_scale.py --ranks $RANKS --tensors $TENSORS --layout fsdp (CPU only)"
timeout 60 $PY benchmarks/bench_scale.py --ranks $RANKS --tensors $TENSORS --layout fsdp > "$OUT/scale_fsdp.txt" 2>&1 \
    || echo "bench_scale: exit $?"
cat "$OUT/scale_fsdp.txt"
echo "=== issue 46: bench_fp8.py, a dequantizing load of a block-FP8 directory vs its bf16 twin (CPU live tensors)"
if [ -n "$TINY" ]; then FP8GB=0.02; else FP8GB=1; fi
timeout 90 $PY benchmarks/bench_fp8.py --gb $FP8GB --json "$OUT/fp8.json" || echo "bench_fp8: exit $?"
date -u
