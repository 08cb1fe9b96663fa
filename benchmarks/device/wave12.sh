#!/bin/bash
# Wave 12, issue 43 (cold loads at the disk's speed: the load's reads in lanes, SHARDCKPT_LOAD_LANES): ONE call on one
# H100 host (16 CPUs, /tmp on the virtio disk, /dev/shm tmpfs), about 8-9 minutes; every step has its own timeout.
# Wheels the device lacks (its Python is 3.12), in .whl/ at the repository root (git-ignored: pass ".whl" in `carry`):
#   crc32c-*-cp312-*.whl (required), fastsafetensors-*-cp312-*.whl (optional)
# STEPS (default "fsdp2 cold warm16 warmdisk", in priority order), each writing under $OUT:
#   fsdp2     the raw disk (8 streams, $RAW GB: write+fsync, then a cold read), then bench_fsdp2_load.py --cases
#             shardckpt (3.09 B + AdamW, 37 GB, defaults: a CUDA load's buffered ranges are read as before wave 12)
#             and the same checkpoint loaded again with SHARDCKPT_LOAD_LANES=0 (no lanes: the scheduling before wave 12),
#             diskstats (request size, queue depth) of each load, then the raw disk again (drift) (~200 s)
#                                                                         -> raw-before.json, fsdp2.json, raw-after.json
#   cold      bench_byte_path --cold, $CGIB GiB from /tmp, page cache dropped before every load, medians of $CREP:
#             read8 (the raw 8-stream read of the same bytes, same rounds), read(), load_file+copy, shardckpt
#             (weights only; lanes), @LOAD_LANES=0, @LOAD_LANES=map, the HF directory (lanes, @0), and into CUDA
#             load_file(device="cuda"), fastsafetensors, shardckpt (default, @LOAD_LANES=0); saves os.write, the HF export from
#             a warm source; the raw disk's write+fsync and read beside (~130 s)       -> cold.json, cold.md
#   warm16    bench_byte_path, 1 GiB from /dev/shm, every core, medians of 3: memcpy, load_file+copy, shardckpt,
#             the HF directory, DCP, and on the GPU load_file(device="cuda"), fastsafetensors, shardckpt (tmpfs has
#             no lanes: unchanged code, the regression check of the warm path) (~80 s)  -> warm16.json, warm16.md
#   warmdisk  bench_byte_path from /tmp without drops (page cache warm, files on the disk: lanes apply), shardckpt and
#             the HF directory, lanes vs @LOAD_LANES=0, medians of 3 (~40 s)          -> warmdisk.json, warmdisk.md
#   profile   (not by default) bench_cold_profile --parts load: an AdamW-like state ($PGB GB) into $DEV tensors, cold,
#             lanes $PLANES (CUDA: map,all; CPU: map,read,0), alternated x2: in flight, CRC, pool waits, diskstats -> profile.json
# Case lists (wave 13 reuses this script): FSDP2_CASES (bench_fsdp2_load --cases; default
# "shardckpt,shardckpt@LOAD_LANES=0"; "shardckpt:T:B:R" = T threads, B MiB of buffers, R MiB reads), WARM_LOADS (warm16's
# --loads), LANES_CPU (cold's CPU --loads), COLD_SAVES (cold's --saves), WARMDISK_LOADS (warmdisk's --loads).
# TINY=1: tiny sizes, CPU only, no wheels (PYTHON= one with crc32c), fadvise drops: a dry run (fsdp2 needs CUDA:
# its raw-disk parts run, and the profile step on CPU stands in for the 37 GB load).
cd "$(dirname "$0")/../.."
OUT=${OUT:-/tmp/out}; mkdir -p "$OUT"
exec > >(tee "$OUT/wave12.log") 2>&1
PY=${PYTHON:-python3}
if [ -z "$TINY" ] && ls .whl/*.whl >/dev/null 2>&1; then
    $PY -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --target /tmp/site .whl/crc32c*.whl .whl/fastsafetensors*.whl || exit 1
fi
[ -n "$TINY" ] || [ -d shardckpt/converters ] || cp -r converters shardckpt/converters   # as an installed package has it (not in a worktree: TINY)
export PYTHONPATH=$PWD:/tmp/site PYTHONUNBUFFERED=1
STEPS=${STEPS:-"fsdp2 cold warm16 warmdisk"}
if [ -n "$TINY" ]; then
    PLANES=map,read,0; RAW=0.1; CRAW=0.1; CGIB=0.03; CREP=1; GIB=0.03; REP=1; PGB=0.1; DEV=cpu; DROP="--drop-cache fadvise"; CUDA=--no-cuda
    SCR=${SCRATCH:-/tmp}; [ "$STEPS" = "fsdp2 cold warm16 warmdisk" ] && STEPS="fsdp2 profile cold warm16 warmdisk"
else
    PLANES=map,all; RAW=${RAW:-8}; CRAW=4; CGIB=${CGIB:-1.75}; CREP=${CREP:-2}; GIB=1; REP=3; PGB=${PGB:-8}; DEV=cuda; DROP=; CUDA=; SCR=/tmp
fi
date -u; nvidia-smi -L 2>/dev/null; nproc; free -g | head -2; df -h $SCR /dev/shm | tail -2; uname -r
grep -m1 "model name" /proc/cpuinfo; uptime
$PY -c "import torch, crc32c; print('torch', torch.__version__, 'crc32c hardware', crc32c.hardware_based)" || exit 1
$PY -c "from shardckpt._format.checksum import COPY_FUSED; print('one-pass copy+CRC kernel (COPY_FUSED)', COPY_FUSED)"
$PY -c "from shardckpt._storage._local import queue_info; import json; print('queue', json.dumps(queue_info('$SCR')))"
git log --oneline -1 2>/dev/null
# The raw disk alone: 8 files written in parallel (+ fsync), dropped, read back in parallel (bench_byte_path.raw_disk).
raw() {
    timeout 90 $PY -c "
import json, sys, tempfile, shutil
sys.path.insert(0, 'benchmarks')
from bench_byte_path import raw_disk
d = tempfile.mkdtemp(prefix='w12raw-', dir='$SCR')
try:
    r = raw_disk(d, int($RAW * 1e9), '${DROP:+fadvise}' or 'auto')
finally:
    shutil.rmtree(d, ignore_errors=True)
print('raw disk', json.dumps(r)); json.dump(r, open('$OUT/$1', 'w'))" || echo "raw $1: exit $?"
}
LANES_CPU=${LANES_CPU:-"read8,read,safetensors,shardckpt,shardckpt@LOAD_LANES=0,shardckpt@LOAD_LANES=map,shardckpt-hf,shardckpt-hf@LOAD_LANES=0"}
COLD_SAVES=${COLD_SAVES:-write,hf-export-warm}
WARMDISK_LOADS=${WARMDISK_LOADS:-"safetensors,shardckpt,shardckpt@LOAD_LANES=0,shardckpt-hf,shardckpt-hf@LOAD_LANES=0"}
FSDP2_CASES=${FSDP2_CASES:-"shardckpt,shardckpt@LOAD_LANES=0"}
WARM_LOADS=${WARM_LOADS:-"memcpy,safetensors,shardckpt,shardckpt@LOAD_INTO=1,shardckpt-hf,dcp"}
for s in $STEPS; do
case $s in
fsdp2)
    echo "=== fsdp2: the raw disk, the 3.09 B + AdamW cold load (defaults, then LOAD_LANES=0, same checkpoint), the raw disk again (~200 s)"
    raw raw-before.json
    if [ -n "$TINY" ]; then echo "fsdp2: the 37 GB load skipped (TINY: no CUDA; the profile step stands in)"; else
        timeout 300 $PY benchmarks/bench_fsdp2_load.py --dir $SCR/w12fsdp2 --cases "$FSDP2_CASES" --reuse \
            --json "$OUT/fsdp2.json" || echo "fsdp2: exit $?"
        rm -rf $SCR/w12fsdp2
    fi
    raw raw-after.json;;
profile)
    echo "=== profile: an AdamW-like state ($PGB GB) into $DEV tensors, cold, lanes $PLANES, alternated x2 (~90 s)"
    timeout 150 $PY benchmarks/bench_cold_profile.py --dir $SCR --parts load --load-gb $PGB --device $DEV --modes 0 \
        --lanes $PLANES --repeat 2 $DROP --json "$OUT/profile.json" || echo "profile: exit $?";;
cold)
    echo "=== cold: bench_byte_path from $SCR, $CGIB GiB, page cache dropped before every load, medians of $CREP (~130 s)"
    D=$(mktemp -d $SCR/w12cold.XXXXXX)
    EXTRA=; [ -z "$CUDA" ] && EXTRA=",shardckpt-cuda@LOAD_LANES=0"
    timeout 240 $PY benchmarks/bench_byte_path.py --dir "$D" --cold --size-gib $CGIB --raw-gb $CRAW --repeat $CREP $CUDA --no-rss $DROP \
        --loads "$LANES_CPU$EXTRA" --saves "$COLD_SAVES" --json "$OUT/cold.json" --markdown "$OUT/cold.md" \
        || echo "cold: exit $?"
    rm -rf "$D";;
warm16)
    echo "=== warm16: 1 GiB from /dev/shm, every core, medians of $REP (~80 s)"
    timeout 150 $PY benchmarks/bench_byte_path.py --size-gib $GIB --repeat $REP $CUDA --loads "$WARM_LOADS" \
        --saves save_file,shardckpt --json "$OUT/warm16.json" --markdown "$OUT/warm16.md" || echo "warm16: exit $?";;
warmdisk)
    echo "=== warmdisk: the page cache warm, files on $SCR (lanes apply), lanes vs LOAD_LANES=0, medians of $REP (~40 s)"
    D=$(mktemp -d $SCR/w12warm.XXXXXX)
    timeout 120 $PY benchmarks/bench_byte_path.py --dir "$D" --size-gib $GIB --repeat $REP --no-cuda --no-rss \
        --loads "$WARMDISK_LOADS" --saves write \
        --json "$OUT/warmdisk.json" --markdown "$OUT/warmdisk.md" || echo "warmdisk: exit $?"
    rm -rf "$D";;
esac
done
date -u
