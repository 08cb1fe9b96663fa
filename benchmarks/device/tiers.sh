#!/bin/bash
# Local first, then remote (issue 33) on a quiet many-CPU host: benchmarks/bench_tiers.py as docs/manager.md runs it,
# then a bigger state. Run from the repo root; wheels the device lacks (crc32c, blake3, obstore, s3fs and its
# dependencies) in $WHL, SeaweedFS's weed binary xz-compressed in $WEED_XZ (the carry's size limit: 64 MiB).
set -o pipefail
PY=${PY:-python3}
WHL=${WHL:-.gpu-wt/whl}
OUT=${OUT:-/tmp/out}; mkdir -p "$OUT"
$PY -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site $WHL/*.whl || exit 1
export PYTHONPATH="$PWD:/tmp/site" PYTHONUNBUFFERED=1
WEED=/tmp/weed
$PY -c "import lzma, shutil, sys; shutil.copyfileobj(lzma.open(sys.argv[1]), open(sys.argv[2], 'wb'))" "${WEED_XZ:-.gpu-wt/weed.xz}" $WEED || exit 1
chmod +x "$WEED"
nproc; uptime; $PY -c "import torch, sys; print(sys.version.split()[0], torch.__version__)"; df -h /tmp /dev/shm | tail -2
# One line per case: name, median and max blocking s, median vs local-only, durable step at the loop's end,
# the final wait() s, the remote's steps, each save's blocking s.
show() {
  $PY -c "import json, sys; [print(c['case'], c['median_s'], c['max_s'], c.get('median_vs_local'), c.get('durable_at_loop_end'),
    c.get('wait_after_loop_s'), c.get('remote_steps'), c['blocked_s']) for c in json.load(open(sys.argv[1]))['cases']]" "$1"
}
# bench NAME TIMEOUT ARGS...: one bench_tiers run, the S3 server's data in /dev/shm (off the local tier's disk in /tmp).
bench() {
  local name=$1 limit=$2; shift 2
  timeout "$limit" $PY benchmarks/bench_tiers.py --server-bin "$WEED" --server-dir /dev/shm "$@" --json "$OUT/$name.json" \
    > "$OUT/$name.log" 2>&1
  echo "rc=$?"; show "$OUT/$name.json"
}
if [ "${PART:-all}" = yield ]; then  # the flusher yielding to saves or not, 1 GiB, same run
  bench tiers_yield_1gb 400 --size-mb 1024 --steps 8 --step-s 2 --cases tiers-delayed-noyield,tiers-delayed
  exit 0
fi
echo "=== 64 MiB, 12 steps of 0.5 s, S3 delayed 1 s / hung 120 s (the documented arguments)"
bench tiers_64mb 330 --size-mb 64 --steps 12 --step-s 0.5 --stall-s 120
echo "=== 1 GiB, 8 steps of 2 s, S3 delayed 1 s / hung 60 s"
bench tiers_1gb 240 --size-mb 1024 --steps 8 --step-s 2 --stall-s 60
