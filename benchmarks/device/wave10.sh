#!/bin/bash
# Wave 10 (issues 43, 44, 45, 46): one call on one GPU host (16 CPUs), on the merged main, <= ~560 s.
# Wheels the device lacks (its Python is 3.12), in .whl/ at the repository root (git-ignored: pass ".whl" in
# `carry`): crc32c-*-cp312 (required), fastsafetensors-*-cp312 (optional). Get them with
#   pip download crc32c fastsafetensors --no-deps --only-binary=:all: --python-version 3.12 \
#       --platform manylinux2014_x86_64 -d .whl
# STEPS (default "tmpfs tmpfs2 fp8 scale moe every"), each writing under $OUT:
#   tmpfs     bench_byte_path, 1 GiB from /dev/shm, every core: loads (native, HF directory, DCP, CUDA), saves,
#             the HF export                                                     -> tmpfs.json
#   tmpfs2    the same pinned to 2 cores (taskset -c 0,1), CPU only              -> tmpfs-2core.json
#   fp8       bench_fp8.py --gb 1: a dequantizing load of block-FP8 vs its bf16 twin, into CPU tensors and
#             into CUDA tensors                                                  -> fp8-cpu.json, fp8-cuda.json
#   fp8k      bench_fp8_kernels.py: the host FP8 kernels' CPU ns per element in 1-16 threads (printed only)
#   scale     bench_scale.py --ranks 16384 --tensors 50000 --layout fsdp         -> scale_fsdp.txt
#   moe       bench_moe_scale.py at 16,384 simulated ranks, --control-plane      -> moe_scale.json
#   every     bench_every_step.py, one H100/H200, 1.545 B params + AdamW, a ~2.3 s step, 10 steps a mode
#             (benchmarks/device/every_step_1gpu.sh, its first case only)        -> every_step_1gpu_accum16.json
#   io        benchmarks/device/wave10_io.sh with STEPS=$IO_STEPS (default "cold fsdp2": the cold loads and
#             HF export beside the raw disk, then the 3.09 B + AdamW cold load)  -> io/*
#   wave10.log  everything printed
# TINY=1: tiny sizes, CPU only, no wheels installed (PYTHON= one that has crc32c): a dry run of the script.
cd "$(dirname "$0")/../.."
OUT=${OUT:-/tmp/out}; mkdir -p "$OUT"
exec > >(tee "$OUT/wave10.log") 2>&1
PY=${PYTHON:-python3}
if [ -z "$TINY" ] && ls .whl/*.whl >/dev/null 2>&1; then
    $PY -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --target /tmp/site .whl/*.whl || exit 1
fi
[ -n "$TINY" ] || [ -d shardckpt/converters ] || cp -r converters shardckpt/converters   # as an installed package has it
export PYTHONPATH=$PWD:/tmp/site PYTHONUNBUFFERED=1
export NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1
STEPS=${STEPS:-"tmpfs tmpfs2 fp8 scale moe every"}
if [ -n "$TINY" ]; then
    GIB=0.03; REP=1; RANKS=128; TENSORS=600; NOCUDA=--no-cuda; FP8GB=0.02; FP8DEV=cpu
else
    GIB=1; REP=3; RANKS=16384; TENSORS=50000; NOCUDA=; FP8GB=1; FP8DEV="cpu cuda"
fi
date -u; nvidia-smi -L 2>/dev/null; nproc; free -g | head -2; df -h /tmp /dev/shm | tail -2; uptime
git log --oneline -1 2>/dev/null
$PY -c "import torch, crc32c, safetensors; print('torch', torch.__version__, 'safetensors', safetensors.__version__)" || exit 1
$PY -c "import fastsafetensors; print('fastsafetensors', fastsafetensors.__version__)" 2>/dev/null || echo "no fastsafetensors"
for s in $STEPS; do
echo "=== $s ($(date -u +%H:%M:%S), ${SECONDS} s in)"
case $s in
tmpfs)
    timeout 150 $PY benchmarks/bench_byte_path.py --size-gib $GIB --repeat $REP $NOCUDA --json "$OUT/tmpfs.json" \
        || echo "tmpfs: exit $?";;
tmpfs2)
    timeout 80 taskset -c 0,1 $PY benchmarks/bench_byte_path.py --size-gib $GIB --repeat $REP --no-cuda --no-rss \
        --json "$OUT/tmpfs-2core.json" || echo "tmpfs2: exit $?";;
fp8)
    for dev in $FP8DEV; do
        timeout 90 $PY benchmarks/bench_fp8.py --gb $FP8GB --device $dev --json "$OUT/fp8-$dev.json" || echo "bench_fp8 $dev: exit $?"
    done;;
fp8k)
    timeout 60 $PY benchmarks/bench_fp8_kernels.py --threads 1,4,8,16 --repeat 10 || echo "bench_fp8_kernels: exit $?";;
scale)
    timeout 60 $PY benchmarks/bench_scale.py --ranks $RANKS --tensors $TENSORS --layout fsdp > "$OUT/scale_fsdp.txt" 2>&1 \
        || echo "bench_scale: exit $?"
    cat "$OUT/scale_fsdp.txt";;
moe)
    timeout 75 $PY benchmarks/bench_moe_scale.py --ranks $RANKS --tensors $TENSORS --control-plane \
        --json "$OUT/moe_scale.json" || echo "bench_moe_scale: exit $?";;
every)
    if [ -n "$TINY" ]; then
        STEPS=10 TINY=1 PY=$PY OUT="$OUT" SECOND_BEFORE=0 bash benchmarks/device/every_step_1gpu.sh || echo "every: exit $?"
    else
        STEPS=10 PY=$PY OUT="$OUT" SECOND_BEFORE=0 timeout 240 bash benchmarks/device/every_step_1gpu.sh || echo "every: exit $?"
    fi;;
io)
    mkdir -p "$OUT/io"
    STEPS="${IO_STEPS:-cold fsdp2}" OUT="$OUT/io" PYTHON=$PY bash benchmarks/device/wave10_io.sh || echo "io: exit $?";;
esac
done
echo "=== done ($(date -u +%H:%M:%S), ${SECONDS} s)"
