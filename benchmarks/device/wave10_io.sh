#!/bin/bash
# Wave 10, issue 43 (the byte path's HF export and cold reads): one call on one GPU host (16 CPUs, a virtio disk).
# Wheels the device lacks (its Python is 3.12), in .whl/ at the repository root (git-ignored: pass ".whl" in `carry`):
#   crc32c-*-cp312-*.whl (required), fastsafetensors-*-cp312-*.whl (optional)
# STEPS (default "sweep profile cold cold0 tmpfs fsdp2"; also "sizes"), each writing under $OUT:
#   sweep     bench_cold_profile --parts sweep: the disk alone, buffered / WILLNEED / O_DIRECT / mmap reads,
#             1-16 threads, 1-64 MiB requests, diskstats (request size, queue depth)         -> sweep.json
#   sizes     the same 8- and 16-thread reads of 1.5 GB and of $BIG GB (12): does the raw figure depend on the size? -> sizes-*.json
#   profile   bench_cold_profile --parts load: an AdamW-like state into CUDA tensors, cold, once per
#             SHARDCKPT_LOAD_DIRECT mode (0, auto, 1), reads in flight, CRC, pool waits    -> profile.json
#   cold      bench_byte_path --cold from /tmp: loads, os.write, shardckpt.save, the HF export from a warm
#             and a cold source, placed and packed, the raw 8-stream disk beside them      -> cold.json
#   cold0     the same loads with SHARDCKPT_LOAD_DIRECT=0 (the page cache, read ahead whole)  -> cold0.json
#   tmpfs     the export from /dev/shm, 16 cores and 2 (taskset -c 0,1), vs os.write      -> tmpfs.json, tmpfs-2core.json
#   fsdp2     bench_fsdp2_load.py --cases shardckpt (3.09 B + AdamW, 37 GB, defaults)      -> fsdp2.json
# TINY=1: tiny sizes, CPU only, no wheels (PYTHON= one with crc32c), fadvise drops: a dry run.
cd "$(dirname "$0")/../.."
OUT=${OUT:-/tmp/out}; mkdir -p "$OUT"
exec > >(tee "$OUT/wave10_io.log") 2>&1
PY=${PYTHON:-python3}
if [ -z "$TINY" ] && ls .whl/*.whl >/dev/null 2>&1; then
    $PY -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --target /tmp/site .whl/crc32c*.whl .whl/fastsafetensors*.whl || exit 1
fi
[ -n "$TINY" ] || [ -d shardckpt/converters ] || cp -r converters shardckpt/converters   # as an installed package has it (not in a worktree: TINY)
export PYTHONPATH=$PWD:/tmp/site PYTHONUNBUFFERED=1
STEPS=${STEPS:-"sweep profile cold cold0 tmpfs fsdp2"}
if [ -n "$TINY" ]; then
    SW=0.1; TH=1,4; SZ=1,4; PGB=0.1; BIG=0.2; DEV=cpu; GIB=0.05; RAW=0.1; TGIB=0.03; REP=1; DROP="--drop-cache fadvise"; NOCUDA=--no-cuda
    SCR=${SCRATCH:-/tmp}
else
    SW=1.5; TH=1,4,16; SZ=1,4,16,64; PGB=${PGB:-12}; BIG=${BIG:-12}; DEV=cuda; GIB=2; RAW=4; TGIB=1; REP=3; DROP=; NOCUDA=--no-cuda
    SCR=/tmp
fi
date -u; nvidia-smi -L 2>/dev/null; nproc; free -g | head -2; df -h $SCR /dev/shm | tail -2; uname -r
$PY -c "import torch, crc32c; print('torch', torch.__version__)" || exit 1
$PY -c "from shardckpt._storage._local import queue_info; import json; print('queue', json.dumps(queue_info('$SCR')))"
grep -E " $SCR | / " /proc/mounts | head -3
for s in $STEPS; do
case $s in
sweep)
    echo "=== sweep: the disk alone (~90 s)"
    timeout 150 $PY benchmarks/bench_cold_profile.py --dir $SCR --parts sweep --sweep-gb $SW --threads $TH --sizes-mib $SZ \
        $DROP --json "$OUT/sweep.json" || echo "sweep: exit $?";;
sizes)
    echo "=== sizes: the same reads of 1.5 GB and of $BIG GB (is the raw figure a cache of the host's?) (~50 s)"
    for gb in 1.5 $BIG; do
        timeout 90 $PY benchmarks/bench_cold_profile.py --dir $SCR --parts sweep --sweep-gb $gb --threads 8,16 --sizes-mib 16 \
            --hows buffered,mmap $DROP --json "$OUT/sizes-$gb.json" || echo "sizes $gb: exit $?"
    done;;
profile)
    echo "=== profile: a cold load of an AdamW-like state ($PGB GB) into $DEV tensors, per LOAD_DIRECT mode (~60 s)"
    timeout 120 $PY benchmarks/bench_cold_profile.py --dir $SCR --parts load --load-gb $PGB --device $DEV --modes ${MODES:-0,auto,1} \
        $DROP --json "$OUT/profile.json" || echo "profile: exit $?";;
cold)
    echo "=== cold: bench_byte_path from $SCR, page cache dropped, raw disk beside (~90 s)"
    D=$(mktemp -d $SCR/w10cold.XXXXXX)
    timeout 150 $PY benchmarks/bench_byte_path.py --dir "$D" --cold --size-gib $GIB --raw-gb $RAW --repeat 1 $NOCUDA --no-rss $DROP \
        --loads read,safetensors,shardckpt,shardckpt-hf \
        --saves write,shardckpt,hf-export-warm,hf-export-cold,hf-export-packed,hf-export-packed-cold --json "$OUT/cold.json" \
        || echo "cold: exit $?"
    rm -rf "$D";;
cold0)
    echo "=== cold0: the same loads with SHARDCKPT_LOAD_DIRECT=0 (~40 s)"
    D=$(mktemp -d $SCR/w10cold0.XXXXXX)
    SHARDCKPT_LOAD_DIRECT=0 timeout 90 $PY benchmarks/bench_byte_path.py --dir "$D" --cold --size-gib $GIB --raw-gb $RAW --repeat 1 \
        $NOCUDA --no-rss $DROP --loads read,shardckpt,shardckpt-hf --saves write --json "$OUT/cold0.json" || echo "cold0: exit $?"
    rm -rf "$D";;
tmpfs)
    echo "=== tmpfs: the export vs os.write from /dev/shm, all cores then 2 (~40 s)"
    timeout 60 $PY benchmarks/bench_byte_path.py --size-gib $TGIB --repeat $REP --no-cuda --no-rss --loads memcpy \
        --saves write,save_file,hf-export,hf-export-packed --json "$OUT/tmpfs.json" || echo "tmpfs: exit $?"
    timeout 60 taskset -c 0,1 $PY benchmarks/bench_byte_path.py --size-gib $TGIB --repeat $REP --no-cuda --no-rss --loads memcpy \
        --saves write,save_file,hf-export,hf-export-packed --json "$OUT/tmpfs-2core.json" || echo "tmpfs-2core: exit $?";;
fsdp2)
    if [ -n "$TINY" ]; then echo "fsdp2: skipped (TINY)"; continue; fi
    echo "=== fsdp2: bench_fsdp2_load.py --cases shardckpt (3.09 B + AdamW, defaults) (~100 s)"
    timeout 170 $PY benchmarks/bench_fsdp2_load.py --dir $SCR/w10fsdp2 --cases shardckpt --json "$OUT/fsdp2.json" \
        || echo "fsdp2: exit $?"
    rm -rf $SCR/w10fsdp2;;
esac
done
date -u
