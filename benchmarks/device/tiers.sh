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
if [ "${PART:-all}" = yield ]; then  # the flusher yielding to saves or not, 1 GiB, same run
  timeout 400 $PY benchmarks/bench_tiers.py --server-bin "$WEED" --server-dir /dev/shm --size-mb 1024 --steps 8 --step-s 2 \
    --cases tiers-delayed-noyield,tiers-delayed --json "$OUT/tiers_yield_1gb.json" > "$OUT/tiers_yield_1gb.log" 2>&1
  echo "rc=$?"
  $PY -c "import json, sys; [print(c['case'], c['median_s'], c['max_s'], c.get('median_vs_local'), c['blocked_s']) for c in json.load(open(sys.argv[1]))['cases']]" "$OUT/tiers_yield_1gb.json"
  exit 0
fi
echo "=== S3 server data in /dev/shm (the remote does not share the local tier disk), local tier in /tmp"
echo "=== 64 MiB, 12 steps of 0.5 s, S3 delayed 1 s / hung 120 s (the documented arguments)"
timeout 330 $PY benchmarks/bench_tiers.py --server-bin "$WEED" --server-dir /dev/shm --size-mb 64 --steps 12 --step-s 0.5 --stall-s 120 \
  --json "$OUT/tiers_64mb.json" > "$OUT/tiers_64mb.log" 2>&1; echo "rc=$?"
$PY - "$OUT/tiers_64mb.json" <<'PY'
import json, sys
d = json.load(open(sys.argv[1]))
for c in d["cases"]:
    print(c["case"], c["median_s"], c["max_s"], c.get("median_vs_local"), c.get("durable_at_loop_end"), c.get("wait_after_loop_s"), c.get("remote_steps"))
PY
echo "=== 1 GiB, 8 steps of 2 s, S3 delayed 1 s / hung 60 s"
timeout 240 $PY benchmarks/bench_tiers.py --server-bin "$WEED" --server-dir /dev/shm --size-mb 1024 --steps 8 --step-s 2 --stall-s 60 \
  --json "$OUT/tiers_1gb.json" > "$OUT/tiers_1gb.log" 2>&1; echo "rc=$?"
$PY - "$OUT/tiers_1gb.json" <<'PY'
import json, sys
d = json.load(open(sys.argv[1]))
for c in d["cases"]:
    print(c["case"], c["median_s"], c["max_s"], c.get("median_vs_local"), c.get("durable_at_loop_end"), c.get("wait_after_loop_s"), c.get("remote_steps"))
PY
tail -5 "$OUT/tiers_1gb.log"
