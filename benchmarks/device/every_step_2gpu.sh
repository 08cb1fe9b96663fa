#!/bin/bash
# Issue 28: checkpoint every step into the memory tier on 2 GPUs as 2 "nodes" (NCCL), ~2.7 B params + AdamW
# (40 blocks of 8192^2 fp32 Linear = 2.68 B params; with exp_avg/exp_avg_sq 32.2 GB of state over 2 ranks),
# then lose node 1 and restore (same world, then 1 rank), against the cold storage restore and DCP's load.
# Targets (issue 28): blocking <= 1.1 x the D2H floor; median step +<= 5 % saving every step with overlap=True;
# restore >= 10 x faster than cold storage; bytes received by node 1's replacement <= 1.05 x its shard.
# Run from the repo root; the wheels the device lacks (crc32c) lie in $WHL (carried beside the tree).
# Logs and the JSON summary go to $OUT.
#
# Knobs (environment): LAYERS (default: 40, fewer if $SHM (default /dev/shm; /tmp when /dev/shm is a small
# container default and /tmp has more room) cannot hold 4 copies of the state: 2 ranks x 2 steps x (own + peer)),
# DIM (8192), ROWS (rows per rank per microbatch, 4096), ACCUM
# (microbatches per step, 16: a compute-bound step of a few seconds), STEPS (timed steps per mode, 4).
# The 1-rank restart holds the whole model + AdamW + activations of 2 x ROWS rows on one GPU (~64 GB at the
# defaults): lower ROWS (raise ACCUM) if it runs out of GPU memory. Whole run: about 6-8 minutes.
# TINY=1: the same script on CPU (gloo, a tiny model, no wheels, a private copy of the tree): a dry run
# (PY=/path/to/python with torch, e.g. TINY=1 PY=$PWD/.venv/bin/python OUT=/tmp/o benchmarks/device/every_step_2gpu.sh).
set -o pipefail
PY=${PY:-python3}
cd "$(dirname "$0")/../.."
OUT=${OUT:-/tmp/out}; mkdir -p "$OUT"
PKG=${PKG:-/tmp/pkg}
if [ -n "$TINY" ]; then
  PKG=$(mktemp -d /tmp/every-step-pkg-XXXXXX)
  BACKEND=gloo; DIM=${DIM:-64}; LAYERS=${LAYERS:-2}; ROWS=${ROWS:-8}; ACCUM=${ACCUM:-2}; STEPS=${STEPS:-2}
  SITE=""
else
  WHL=${WHL:-.gpu-wt/whl}
  $PY -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site $WHL/*.whl || exit 1
  BACKEND=nccl; DIM=${DIM:-8192}; ROWS=${ROWS:-4096}; ACCUM=${ACCUM:-16}; STEPS=${STEPS:-4}
  SITE=":/tmp/site"
fi
rm -rf "$PKG" && mkdir -p "$PKG" && cp -r shardckpt benchmarks "$PKG"/ && cp -r converters "$PKG"/shardckpt/converters || exit 1
cd "$PKG" && export PYTHONPATH="$PKG$SITE" PYTHONUNBUFFERED=1
export NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1 CUBLAS_WORKSPACE_CONFIG=:4096:8
[ -z "$TINY" ] && nvidia-smi -L
df -h /tmp /dev/shm | tail -2; nproc; free -g | head -2
$PY -c "import torch, crc32c; print('torch', torch.__version__, 'cuda', torch.cuda.is_available())" || exit 1
SHM=${SHM:-/dev/shm}
if [ -z "$LAYERS" ]; then
  # The tier holds, at most, 2 ranks x 2 steps x (own + peer shard) = 4 x the state; 12 bytes per param.
  PER_LAYER=$(( (DIM * DIM + DIM) * 12 ))
  AVAIL=$(df --output=avail -B1 "$SHM" | tail -1)
  LAYERS=$(( AVAIL * 95 / 100 / (4 * PER_LAYER) ))
  if [ "$LAYERS" -lt 37 ]; then
    # A small /dev/shm (a container's default): the tier's directories on /tmp instead (page cache, not tmpfs).
    # On /tmp the storage and DCP checkpoints sit beside the tier: 4 + 2 x the state.
    TMPAVAIL=$(df --output=avail -B1 /tmp | tail -1)
    TMPLAYERS=$(( TMPAVAIL * 90 / 100 / (6 * PER_LAYER) ))
    if [ "$TMPLAYERS" -gt "$LAYERS" ]; then
      echo "WARNING: $SHM has only $AVAIL bytes free; the memory tier's directories go under /tmp"
      SHM=/tmp/every-step-shm; mkdir -p -m 700 "$SHM"
      AVAIL=$TMPAVAIL; LAYERS=$TMPLAYERS
    fi
  fi
  [ "$LAYERS" -gt 40 ] && LAYERS=40
  [ "$LAYERS" -lt 1 ] && { echo "ERROR: no room for the memory tier (set LAYERS / SHM)"; exit 1; }
  echo "$SHM: $AVAIL bytes free -> $LAYERS layers ($(( LAYERS * (DIM * DIM + DIM) / 1000000 )) M params)"
  [ "$LAYERS" -lt 37 ] && echo "WARNING: not enough room for 2.5 B params; running $LAYERS layers"
fi
echo "=== smoke (small, same path) then the large case: dim $DIM x $LAYERS layers, $ROWS rows x $ACCUM microbatches"
$PY benchmarks/bench_every_step.py --backend $BACKEND --world 2 --dim 256 --layers 2 --rows 16 --steps 1 --more 1 \
  --dir /tmp --shm "$SHM" --json "$OUT/every_step_smoke.json" 2>&1 | tee "$OUT/every_step_smoke.log" | grep -v Warn || exit 1
$PY benchmarks/bench_every_step.py --backend $BACKEND --world 2 --dim $DIM --layers $LAYERS --rows $ROWS --accum $ACCUM \
  --steps $STEPS --more 3 --dir /tmp --shm "$SHM" --json "$OUT/every_step_2gpu.json" 2>&1 | tee "$OUT/every_step_2gpu.log" | grep -v Warn
rc=$?
[ -n "$TINY" ] && rm -rf "$PKG"
[ "$SHM" = /tmp/every-step-shm ] && rmdir "$SHM" 2>/dev/null
exit $rc
