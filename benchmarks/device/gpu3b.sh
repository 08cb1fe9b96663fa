#!/bin/bash
# Issue 9: one H200, 3 B-parameter FSDP2 + AdamW cold load, shardckpt vs DCP, plus the disk's own cold-read ceiling.
# Run from the repo root on a machine with no package registry: the wheels the
# device lacks (crc32c for its Python) lie in $WHL (carried beside the tree).
cd "$(dirname "$0")/../.."
WHL=${WHL:-.gpu-wt/whl}
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site $WHL/*.whl || exit 1
rm -rf /tmp/pkg && mkdir -p /tmp/pkg && cp -r shardckpt benchmarks /tmp/pkg/ && cp -r converters /tmp/pkg/shardckpt/converters
cd /tmp/pkg && export PYTHONPATH=/tmp/pkg:/tmp/site PYTHONUNBUFFERED=1
export NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1
OUT=${OUT:-/tmp/out}; mkdir -p $OUT
nvidia-smi -L; df -h /tmp | tail -1; nproc; free -g | head -2
python3 -c "import torch, crc32c, fsspec; print('torch', torch.__version__)"
if [ -n "$RAW" ]; then
echo "=== raw disk ceiling: 8 files x 4.6 GB written, fsync, dropped from the page cache, read back by 8 parallel dd (bs 8M)"
mkdir -p /tmp/raw; for i in 0 1 2 3 4 5 6 7; do dd if=/dev/urandom of=/tmp/raw/f$i bs=8M count=550 status=none & done; wait
python3 - <<'PY'
import os
for n in os.listdir("/tmp/raw"):
    fd = os.open("/tmp/raw/" + n, os.O_RDONLY); os.fsync(fd); os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED); os.close(fd)
PY
s=$(date +%s.%N); for i in 0 1 2 3 4 5 6 7; do dd if=/tmp/raw/f$i of=/dev/null bs=8M status=none & done; wait; e=$(date +%s.%N)
python3 -c "b=sum(os.path.getsize('/tmp/raw/'+n) for n in os.listdir('/tmp/raw')); t=$e-$s; print(f'raw cold read: {b/1e9:.1f} GB in {t:.1f} s = {b/1e9/t:.2f} GB/s')" 2>/dev/null || python3 -c "import os; b=sum(os.path.getsize('/tmp/raw/'+n) for n in os.listdir('/tmp/raw')); t=$e-$s; print(f'raw cold read: {b/1e9:.1f} GB in {t:.1f} s = {b/1e9/t:.2f} GB/s')"
rm -rf /tmp/raw
fi
echo "=== 3B cases: ${CASES:-shardckpt,dcp}"
python3 benchmarks/bench_fsdp2_load.py --dir /tmp/bench --cases ${CASES:-shardckpt,dcp} --json $OUT/fsdp2_3b.json 2>&1 | tee $OUT/fsdp2_3b.log | grep -v Warn
