#!/bin/bash
# Issue 44: the memory tier's every-step cost on ONE GPU, measured as training sees it (one rank, one node:
# no peer copy). FSDP2 + AdamW, 23 blocks of 8192^2 fp32 Linear = 1.545 B params (18.5 GB of params + AdamW
# state on the rank). bench_every_step.py --only-first: each step timed on the training stream, one window of
# STEPS steps per mode (device synced only at its ends): no saves, the ideal side-stream copy into preallocated
# pinned buffers, save_to_memory blocking, save_to_memory(overlap=True); the first save_to_memory on its own.
# Targets (issue 44): overlap window <= +1% vs no saves; first save's step within 2x a steady one; the
# overlap call <= 15 ms.
# Two cases: ACCUM microbatches per step (16: a ~2 s step), then ACCUM2 (4: a ~0.5 s step) if time is left.
# Run from the repo root; the crc32c wheel for the device's Python lies in $WHL (default .whl, carried).
# Logs and JSON summaries go to $OUT. Host memory: the tier's 2 slots (37 GB, on $SHM) + the ideal's pinned
# buffers (18.5 GB) + the floor's buffer (18.5 GB, freed before).
# TINY=1: the same script on CPU (gloo, a tiny model, no wheels): a dry run
# (TINY=1 PY=/work/main/.venv/bin/python OUT=/tmp/o benchmarks/device/every_step_1gpu.sh).
set -o pipefail
PY=${PY:-python3}
cd "$(dirname "$0")/../.."
OUT=${OUT:-/tmp/out}; mkdir -p "$OUT"
if [ -n "$TINY" ]; then
  BACKEND=gloo; DIM=${DIM:-64}; LAYERS=${LAYERS:-2}; ROWS=${ROWS:-8}; ACCUM=${ACCUM:-2}; ACCUM2=${ACCUM2:-1}; STEPS=${STEPS:-10}
  export PYTHONPATH="$PWD"
else
  WHL=${WHL:-.whl}
  $PY -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site $WHL/crc32c*.whl || exit 1
  BACKEND=nccl; DIM=${DIM:-8192}; LAYERS=${LAYERS:-23}; ROWS=${ROWS:-4096}; ACCUM=${ACCUM:-16}; ACCUM2=${ACCUM2:-4}; STEPS=${STEPS:-10}
  export PYTHONPATH="$PWD:/tmp/site"
  nvidia-smi -L
fi
export PYTHONUNBUFFERED=1 NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1 CUBLAS_WORKSPACE_CONFIG=:4096:8
df -h /tmp /dev/shm | tail -2; nproc; free -g | head -2
$PY -c "import torch, crc32c; print('torch', torch.__version__, 'cuda', torch.cuda.is_available())" || exit 1
$PY -c "import shardckpt; print('shardckpt from', shardckpt.__file__)" || exit 1
SHM=${SHM:-/dev/shm}
NEED=$(( 2 * LAYERS * (DIM * DIM + DIM) * 12 + (1 << 30) ))
AVAIL=$(df --output=avail -B1 "$SHM" | tail -1)
echo "$SHM: $AVAIL bytes free, the tier needs $NEED"
[ "$AVAIL" -lt "$NEED" ] && { echo "ERROR: $SHM too small for the tier's two slots (set SHM or LAYERS)"; exit 1; }
git log --oneline -1 2>/dev/null
run() {  # $1: name, $2: accum
  echo "=== $1: dim $DIM x $LAYERS layers, $ROWS rows x $2 microbatches, $STEPS steps per mode ($(date -u +%H:%M:%S))"
  $PY benchmarks/bench_every_step.py --backend $BACKEND --world 1 --dim $DIM --layers $LAYERS --rows $ROWS --accum $2 \
    --steps $STEPS --warmup 2 --only-first --dir /tmp --shm "$SHM" --json "$OUT/$1.json" --timeout 400 2>&1 \
    | tee "$OUT/$1.log" | grep -v Warn
}
run every_step_1gpu_accum$ACCUM $ACCUM || exit 1
if [ "$SECONDS" -lt "${SECOND_BEFORE:-330}" ]; then
  run every_step_1gpu_accum$ACCUM2 $ACCUM2
else
  echo "=== no time left for the ACCUM=$ACCUM2 case ($SECONDS s used)"
fi
