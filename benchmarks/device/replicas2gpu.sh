#!/bin/bash
# Issue 34: what the replica check adds to a save, HSDP 2x1 (every tensor has 2 copies), 2.5 B params + AdamW,
# 2 GPUs, NCCL; replicas="check" vs "off" (alternating order), DCP beside, the check alone.
# Run from the repo root on a 2-GPU machine (wheels for the machine's Python in $WHL).
cd "$(dirname "$0")/../.."
WHL=${WHL:-.gpu-wt/whl}
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site $WHL/*.whl || exit 1
rm -rf /tmp/pkg && mkdir -p /tmp/pkg && cp -r shardckpt benchmarks /tmp/pkg/ && cp -r converters /tmp/pkg/shardckpt/converters
cd /tmp/pkg && export PYTHONPATH=/tmp/pkg:/tmp/site PYTHONUNBUFFERED=1
export NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1
OUT=${OUT:-/tmp/out}; mkdir -p $OUT
PARAMS=${PARAMS:-2.5e9}
nvidia-smi -L; df -h /tmp | tail -1; nproc; free -g | head -2; date -u
python3 -m torch.distributed.run --standalone --nproc-per-node 2 benchmarks/bench_replicas.py --params $PARAMS \
  --layers 40 --dir /tmp/bench-rep --repeat 2 2>&1 | grep -v Warn | tee $OUT/replicas_2gpu.log
