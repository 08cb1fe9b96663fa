#!/bin/bash
# The NCCL peer-copy race (issue 28) on 2 GPUs, then the every-step smoke with the NCCL peer copy.
# Run from the repo root on a 2-GPU machine; wheels the device lacks (crc32c, blake3) in $WHL.
set -o pipefail
PY=${PY:-python3}
WHL=${WHL:-.gpu-wt/whl}
OUT=${OUT:-/tmp/out}; mkdir -p "$OUT"
$PY -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site $WHL/*.whl || exit 1
export PYTHONPATH="$PWD:/tmp/site" PYTHONUNBUFFERED=1 NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1
nvidia-smi -L
echo "=== p2p race: old staging vs move_tensors, a training thread alongside"
timeout 300 $PY -m torch.distributed.run --standalone --nproc-per-node 2 benchmarks/device/p2p_race.py 2>&1 | grep --line-buffered -v Warn | tee "$OUT/p2p_race.log"
echo "=== every-step smoke, NCCL peer copy"
SHARDCKPT_MEMORY_PEER_BACKEND=nccl $PY benchmarks/bench_every_step.py --backend nccl --world 2 --dim 256 --layers 2 \
  --rows 16 --steps 2 --more 2 --dir /tmp --json "$OUT/every_step_smoke_nccl.json" 2>&1 | tail -3 | cut -c1-3000
