#!/bin/bash
# Issue 36 on a 4-GPU host (nvidia-h100-x4 / nvidia-h200-x4), NCCL: save / async stall / cold load against DCP
# in the same call, FSDP2 over 4 GPUs (shardckpt first) and HSDP 2x2 (DCP first: both orders in the call),
# read-once on and off, the raw disk ceiling; STEPS="matrix" runs the GPU matrix with --train at world size 4.
# Run from the repo root (wheels for the machine's Python in $WHL):  STEPS="raw bench" bash benchmarks/device/gpu4.sh
cd "$(dirname "$0")/../.."
WHL=${WHL:-.gpu-wt/whl}
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site $WHL/*.whl || exit 1
rm -rf /tmp/pkg && mkdir -p /tmp/pkg && cp -r shardckpt benchmarks tests /tmp/pkg/ && cp -r converters /tmp/pkg/shardckpt/converters
cd /tmp/pkg && export PYTHONPATH=/tmp/pkg:/tmp/site PYTHONUNBUFFERED=1
export NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1
OUT=${OUT:-/tmp/out}; mkdir -p $OUT
STEPS=${STEPS:-raw bench}
BLOCKS=${BLOCKS:-18}
date -u; nvidia-smi -L; df -h /tmp | tail -1; nproc; free -g | head -2
python3 -c "import torch; print('torch', torch.__version__, 'cuda', torch.version.cuda, 'nccl', torch.cuda.nccl.version())"
for s in $STEPS; do case $s in
raw)
  echo "=== raw disk: 8 files x 1.8 GB, written by 8 dd (O_DIRECT), dropped from the page cache, read by 8 streams (bs 8M)"
  mkdir -p /tmp/raw; s0=$(date +%s.%N)
  for i in $(seq 0 7); do (dd if=/dev/zero of=/tmp/raw/f$i bs=8M count=220 oflag=direct status=none) & done; wait; sync; e0=$(date +%s.%N)
  python3 -c "print(f'raw write (O_DIRECT, 8 streams): {8*220*8*2**20/1e9/($e0-$s0):.2f} GB/s')"
  python3 -c "
import os
for n in os.listdir('/tmp/raw'):
    fd = os.open('/tmp/raw/' + n, os.O_RDONLY); os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED); os.close(fd)"
  s0=$(date +%s.%N); for i in $(seq 0 7); do dd if=/tmp/raw/f$i of=/dev/null bs=8M status=none & done; wait; e0=$(date +%s.%N)
  python3 -c "print(f'raw cold read, 8 streams: {8*220*8*2**20/1e9/($e0-$s0):.2f} GB/s')"
  rm -rf /tmp/raw ;;
bench)
  echo "=== 4 GPUs, FSDP2 x4, $BLOCKS blocks of 4096x16384 (+ AdamW), shardckpt then DCP"
  torchrun --standalone --nproc-per-node 4 benchmarks/bench_replicated_load.py --layout fsdp2 --blocks $BLOCKS --libs shardckpt,dcp --dir /tmp/brl --json $OUT/bench4-fsdp2.json 2>&1 | grep -v Warn | tee $OUT/bench4-fsdp2.log
  echo "=== 4 GPUs, HSDP 2x2, $BLOCKS blocks, DCP then shardckpt"
  torchrun --standalone --nproc-per-node 4 benchmarks/bench_replicated_load.py --layout hsdp --replicate 2 --blocks $BLOCKS --libs dcp,shardckpt --dir /tmp/brl --json $OUT/bench4-hsdp2x2.json 2>&1 | grep -v Warn | tee $OUT/bench4-hsdp2x2.log ;;
matrix)
  echo "=== matrix with --train, world size 4 (NCCL)"
  torchrun --standalone --nproc-per-node 4 tests/gpu/check_matrix.py --out /tmp/m4 --train 2>&1 | grep -v Warn | tee $OUT/matrix-w4-train.log | grep -E "FAIL|TOTAL|train/"
  rm -rf /tmp/m4 ;;
esac; done
date -u
