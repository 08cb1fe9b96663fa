#!/bin/bash
# Issue 21 on a 2-GPU host (nvidia-h100-x2): the GPU matrix at world size 2 and 1, the read-once load
# on NCCL, 2-GPU save/async/cold-load vs DCP (HSDP 2x1 and FSDP2 x2), the raw disk, and the one-GPU
# 3 B cold-load sweep. Run from the tree copied by `run` (this script lies in .gpu-wt/src/benchmarks/device):
#   STEPS="matrix smoke bench" bash .gpu-wt/src/benchmarks/device/gpu21.sh
# Steps: matrix (world size 2), matrix1 (world size 1), smoke, bench (2.4 B params, both layouts), raw (disk ceiling, 2/16 streams), sweep (one GPU, 3 B).
# The host has no package registry: the crc32c wheel for its Python lies in $WHL.
SRC="$(cd "$(dirname "$0")/../.." && pwd)"
WHL=${WHL:-$SRC/../whl}
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site $WHL/*.whl || exit 1
rm -rf /tmp/pkg && mkdir -p /tmp/pkg && cp -r "$SRC"/shardckpt "$SRC"/benchmarks "$SRC"/tests /tmp/pkg/ && cp -r "$SRC"/converters /tmp/pkg/shardckpt/converters
cd /tmp/pkg && export PYTHONPATH=/tmp/pkg:/tmp/site PYTHONUNBUFFERED=1
export NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1
OUT=${OUT:-/tmp/out}; mkdir -p $OUT
STEPS=${STEPS:-matrix matrix1 smoke bench}
date -u; nvidia-smi -L; nvidia-smi topo -m | head -4; df -h /tmp | tail -1; nproc; free -g | head -2
python3 -c "import torch, crc32c, fsspec; print('torch', torch.__version__, 'cuda', torch.version.cuda, 'nccl', torch.cuda.nccl.version())"
for s in $STEPS; do case $s in
matrix)
  echo "=== matrix, world size 2 (NCCL)"
  torchrun --standalone --nproc-per-node 2 tests/gpu/check_matrix.py --out /tmp/m2 --train 2>&1 | grep -v Warn | tee $OUT/matrix-w2.log | grep -v "^    "
  rm -rf /tmp/m2 ;;
matrix1)
  echo "=== matrix, world size 1"
  python3 tests/gpu/check_matrix.py --out /tmp/m1 2>&1 | grep -v Warn | tee $OUT/matrix-w1.log | grep -v "^    "
  rm -rf /tmp/m1 /tmp/m2 ;;
smoke)
  echo "=== replicated-load smoke (small), HSDP 2x1 and FSDP2 x2"
  for l in hsdp fsdp2; do torchrun --standalone --nproc-per-node 2 benchmarks/bench_replicated_load.py --layout $l --blocks 2 --dim 1024 --ff 4096 2>&1 | grep -v Warn; done ;;
bench)
  for l in ${LAYOUTS:-hsdp fsdp2}; do
    echo "=== 2 GPUs, $l, ${BLOCKS:-18} blocks of 4096x16384 (+ AdamW)"
    torchrun --standalone --nproc-per-node 2 benchmarks/bench_replicated_load.py --layout $l --blocks ${BLOCKS:-18} --libs ${LIBS:-shardckpt,dcp} --dir /tmp/brl --json $OUT/bench-$l.json 2>&1 | grep -v Warn | tee $OUT/bench-$l.log
  done ;;
raw)
  echo "=== raw disk: 16 files x 1.8 GB, written by 16 dd + fsync; dropped from the page cache; read by 16 and by 2 streams (bs 8M)"
  mkdir -p /tmp/raw; s=$(date +%s.%N)
  for i in $(seq 0 15); do (dd if=/dev/zero of=/tmp/raw/f$i bs=8M count=220 oflag=direct status=none) & done; wait; sync; e=$(date +%s.%N)
  python3 -c "print(f'raw write (O_DIRECT, 16 streams): {16*220*8*2**20/1e9/($e-$s):.2f} GB/s')"
  python3 -c "
import os
for n in os.listdir('/tmp/raw'):
    fd = os.open('/tmp/raw/' + n, os.O_RDONLY); os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED); os.close(fd)"
  s=$(date +%s.%N); for i in $(seq 0 15); do dd if=/tmp/raw/f$i of=/dev/null bs=8M status=none & done; wait; e=$(date +%s.%N)
  python3 -c "print(f'raw cold read, 16 streams: {16*220*8*2**20/1e9/($e-$s):.2f} GB/s')"
  python3 -c "
import os
for n in os.listdir('/tmp/raw'):
    fd = os.open('/tmp/raw/' + n, os.O_RDONLY); os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED); os.close(fd)"
  s=$(date +%s.%N); (for i in $(seq 0 7); do dd if=/tmp/raw/f$i of=/dev/null bs=8M status=none; done) & (for i in $(seq 8 15); do dd if=/tmp/raw/f$i of=/dev/null bs=8M status=none; done) & wait; e=$(date +%s.%N)
  python3 -c "print(f'raw cold read, 2 streams: {16*220*8*2**20/1e9/($e-$s):.2f} GB/s')"
  rm -rf /tmp/raw ;;
sweep)
  echo "=== one GPU, 3 B params + AdamW, cold load: ${CASES:-shardckpt,shardckpt:16:512:8:nocrc,shardckpt:32:1024:8,shardckpt:16:512:32,dcp}"
  CUDA_VISIBLE_DEVICES=0 python3 benchmarks/bench_fsdp2_load.py --reuse --dir /tmp/bench --cases ${CASES:-shardckpt,shardckpt:16:512:8:nocrc,shardckpt:32:1024:8,shardckpt:16:512:32,dcp} --json $OUT/sweep.json 2>&1 | grep -v Warn | tee $OUT/sweep.log ;;
esac; done
date -u
