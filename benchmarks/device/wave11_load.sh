#!/bin/bash
# Wave 11, issue 43 (the warm load: tmpfs pieces read straight into the CPU tensors, SHARDCKPT_LOAD_INTO):
# one call on one GPU host (16 CPUs), about 4 minutes.
# Wheels the device lacks (its Python is 3.12), in .whl/ at the repository root (git-ignored: pass ".whl" in `carry`):
#   crc32c-*-cp312-*.whl (required), fastsafetensors-*-cp312-*.whl (optional)
# STEPS (default "warm16 warm2 cold"), each writing under $OUT:
#   warm16  bench_byte_path, 1 GiB from /dev/shm, every core: memcpy, read(), load_file+copy, shardckpt (into: the
#           default; map: SHARDCKPT_LOAD_INTO=0; checksums off), the HF directory (into, map), and on the GPU
#           load_file(device="cuda"), fastsafetensors, shardckpt into CUDA tensors; save_file vs shardckpt.save
#           (~80 s)                                                                     -> warm16.json
#   warm2   the same CPU loads and saves under taskset -c 0,1 (issue 43's 2-core aims) (~70 s)  -> warm2.json
#   cold    shardckpt (into) vs shardckpt-map from /tmp, page cache dropped before every load, the raw disk
#           beside: files on disks are mapped either way, so the two should match (~80 s) -> cold.json
# TINY=1: tiny sizes, CPU only, no wheels (PYTHON= one with crc32c), fadvise drops: a dry run.
cd "$(dirname "$0")/../.."
OUT=${OUT:-/tmp/out}; mkdir -p "$OUT"
exec > >(tee "$OUT/wave11_load.log") 2>&1
PY=${PYTHON:-python3}
if [ -z "$TINY" ] && ls .whl/*.whl >/dev/null 2>&1; then
    $PY -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --target /tmp/site .whl/crc32c*.whl .whl/fastsafetensors*.whl || exit 1
fi
[ -n "$TINY" ] || [ -d shardckpt/converters ] || cp -r converters shardckpt/converters   # as an installed package has it (not in a worktree: TINY)
export PYTHONPATH=$PWD:/tmp/site PYTHONUNBUFFERED=1
STEPS=${STEPS:-"warm16 warm2 cold"}
LOADS=memcpy,read,safetensors,shardckpt,shardckpt-map,shardckpt-nocrc,shardckpt-hf,shardckpt-hf-map
if [ -n "$TINY" ]; then
    GIB=0.03; CGIB=0.03; RAW=0.05; REP=1; DROP="--drop-cache fadvise"; CUDA=--no-cuda; SCR=${SCRATCH:-/tmp}
else
    GIB=1; CGIB=1.5; RAW=3; REP=5; DROP=; CUDA=; SCR=/tmp
fi
date -u; nvidia-smi -L 2>/dev/null; nproc; free -g | head -2; df -h $SCR /dev/shm | tail -2; uname -r
grep -m1 "model name" /proc/cpuinfo; uptime
$PY -c "import torch, crc32c; print('torch', torch.__version__, 'crc32c hardware', crc32c.hardware_based)" || exit 1
git log --oneline -1 2>/dev/null
for s in $STEPS; do
case $s in
warm16)
    echo "=== warm16: 1 GiB from /dev/shm, every core, medians of $REP (~80 s)"
    timeout 200 $PY benchmarks/bench_byte_path.py --size-gib $GIB --repeat $REP $CUDA --loads $LOADS \
        --saves save_file,shardckpt --json "$OUT/warm16.json" || echo "warm16: exit $?";;
warm2)
    echo "=== warm2: the same under taskset -c 0,1 (~70 s)"
    timeout 200 taskset -c 0,1 $PY benchmarks/bench_byte_path.py --size-gib $GIB --repeat $REP --no-cuda --loads $LOADS \
        --saves save_file,shardckpt --json "$OUT/warm2.json" || echo "warm2: exit $?";;
cold)
    echo "=== cold: into vs map from $SCR, page cache dropped before every load, raw disk beside (~80 s)"
    D=$(mktemp -d $SCR/w11cold.XXXXXX)
    timeout 170 $PY benchmarks/bench_byte_path.py --dir "$D" --cold --size-gib $CGIB --raw-gb $RAW --repeat 1 --no-cuda --no-rss $DROP \
        --loads read,safetensors,shardckpt,shardckpt-map,shardckpt-hf --saves write --json "$OUT/cold.json" || echo "cold: exit $?"
    rm -rf "$D";;
esac
done
date -u
