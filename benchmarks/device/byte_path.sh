#!/bin/bash
# Issue 43: the byte path on one GPU host, one call. From the repo root, with the
# wheels the device lacks (crc32c, fastsafetensors for its Python 3.12) in .whl/
# (git-ignored; pass it in `carry`). Writes under $OUT:
#   tmpfs.json      bench_byte_path, 1 GiB from /dev/shm, every core, CPU and CUDA loads
#   tmpfs-2core.json  the same pinned to 2 cores (taskset -c 0,1), CPU loads
#   cold.json       --cold from /tmp (the VM's disk), page cache dropped, raw 8-stream disk speed
#   fsdp2_3b.json   (SKIP_3B unset) bench_fsdp2_load.py, 3 B params + AdamW, shardckpt, cold
#   byte_path.log   everything printed
cd "$(dirname "$0")/../.."
OUT=${OUT:-/tmp/out}; mkdir -p "$OUT"
exec > >(tee "$OUT/byte_path.log") 2>&1
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --target /tmp/site .whl/*.whl || exit 1
[ -d shardckpt/converters ] || cp -r converters shardckpt/converters   # as an installed package has it
export PYTHONPATH=$PWD:/tmp/site PYTHONUNBUFFERED=1
export NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1
date -u; nvidia-smi -L; nproc; free -g | head -2; df -h /tmp /dev/shm | tail -2
python3 -c "import torch, crc32c, safetensors; print('torch', torch.__version__, 'safetensors', safetensors.__version__)"
python3 -c "import fastsafetensors; print('fastsafetensors', fastsafetensors.__version__)" || true
echo "=== tmpfs, all cores"
timeout 200 python3 benchmarks/bench_byte_path.py --repeat ${REPEAT:-3} --json "$OUT/tmpfs.json"
echo "=== tmpfs, 2 cores (taskset -c 0,1)"
timeout 150 taskset -c 0,1 python3 benchmarks/bench_byte_path.py --repeat ${REPEAT2:-5} --no-cuda --json "$OUT/tmpfs-2core.json"
echo "=== cold, /tmp (page cache dropped before every load)"
mkdir -p /tmp/bytepath
timeout 280 python3 benchmarks/bench_byte_path.py --dir /tmp/bytepath --cold --size-gib ${COLD_GIB:-4} --raw-gb 8 --repeat 2 \
    --no-rss --json "$OUT/cold.json"
rm -rf /tmp/bytepath
if [ -z "$SKIP_3B" ]; then
echo "=== 3 B + AdamW, cold, shardckpt"
timeout ${T3B:-200} python3 benchmarks/bench_fsdp2_load.py --dir /tmp/bench --cases shardckpt --json "$OUT/fsdp2_3b.json" 2>&1 | grep -v Warn
rm -rf /tmp/bench
fi
date -u
