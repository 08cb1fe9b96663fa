#!/bin/bash
# Issue 24 (NOT RUN: no device time was left this session): 2 GPUs as 2 "nodes", NCCL,
# memory-tier restore after losing node 1 vs storage restore vs DCP load, ~2.7 B params + AdamW
# (40 x 8192^2 fp32 = 2.7 B params; with exp_avg/exp_avg_sq ~32 GB of state over 2 ranks).
# Aim (issue 24): memory restore <= max(1 s, 1.25 x bytes node 1 receives / measured link bandwidth).
# Run from the repo root, as benchmarks/device/gpu3b.sh does (wheels in $WHL).
cd "$(dirname "$0")/../.."
WHL=${WHL:-.gpu-wt/whl}
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site $WHL/*.whl || exit 1
rm -rf /tmp/pkg && mkdir -p /tmp/pkg && cp -r shardckpt benchmarks /tmp/pkg/ && cp -r converters /tmp/pkg/shardckpt/converters
cd /tmp/pkg && export PYTHONPATH=/tmp/pkg:/tmp/site PYTHONUNBUFFERED=1
export NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1
OUT=${OUT:-/tmp/out}; mkdir -p $OUT
nvidia-smi -L; df -h /tmp /dev/shm | tail -2; nproc; free -g | head -2
echo "=== smoke (small) then the 2.7 B case"
python3 benchmarks/bench_memory_restore.py --world 2 --backend nccl --dim 1024 --layers 4 --dir /tmp/bench 2>&1 | tee $OUT/memtier_smoke.log | grep -v Warn
python3 benchmarks/bench_memory_restore.py --world 2 --backend nccl --dim 8192 --layers 40 --dir /tmp/bench --repeat 2 2>&1 | tee $OUT/memtier_2gpu.log | grep -v Warn
