#!/bin/bash
# Long fuzz campaign (issue 11) on the device's 16 cores: 15 seeded processes, disjoint seed ranges.
# Run from the repo root on a machine with no package registry: the wheels the
# device lacks (crc32c for its Python) lie in $WHL (carried beside the tree).
cd "$(dirname "$0")/../.."
WHL=${WHL:-.gpu-wt/whl}
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site $WHL/*.whl || exit 1
git log -1 --oneline 2>/dev/null || true
rm -rf /tmp/pkg && mkdir -p /tmp/pkg && cp -r shardckpt /tmp/pkg/ && cp -r converters /tmp/pkg/shardckpt/converters && cp -r tests /tmp/pkg/
# run from the staged copy: the repo root would shadow it (sys.path[0]) and lacks shardckpt.converters
cd /tmp/pkg
export PYTHONPATH=/tmp/pkg:/tmp/site PYTHONUNBUFFERED=1
OUT=${OUT:-/tmp/out}; mkdir -p $OUT
python3 -c "import torch, crc32c, sys; print('python', sys.version.split()[0], 'torch', torch.__version__); print('cpus', __import__('os').cpu_count())"
rm -f /tmp/fz-*; N=${N:-15}; CASES=${CASES:-9000}; MIN=${MIN:-6}
for k in $(seq 0 $((N-1))); do
  python3 -m tests.fuzz.long --cases $CASES --seed $((20000000 + k*1000000)) --minutes $MIN --json /tmp/fz-$k.json > /tmp/fz-$k.log 2>&1 &
done
wait
python3 - "$OUT" <<'PY'
import json, sys, glob, collections
out = sys.argv[1]; tot = 0; per = collections.Counter(); errs = collections.Counter(); ok = collections.Counter(); vals = 0; viol = {}; secs = 0
for f in sorted(glob.glob("/tmp/fz-*.json")):
    d = json.load(open(f)); tot += d["cases"]; secs = max(secs, d["seconds"]); per.update(d["per_target"]); errs.update(d["errors"]); ok.update(d["succeeded"]); vals += d["values_changed_silently"]
    for k, v in d["violations"].items(): viol.setdefault(k, []).extend(v["seeds"])
by_type = collections.Counter()
for k, n in errs.items(): by_type[k.rsplit(":", 1)[-1]] += n
summary = {"processes": len(glob.glob("/tmp/fz-*.json")), "cases": tot, "wall_s": secs, "per_target": dict(per), "errors_by_type": dict(by_type.most_common()), "ops_succeeded": sum(ok.values()), "values_changed_silently": vals, "violations": viol}
print(json.dumps(summary, indent=1)); json.dump(summary, open(out + "/fuzz-summary.json", "w"), indent=1)
PY
grep -h VIOLATION /tmp/fz-*.log | head -20; tail -n 3 /tmp/fz-*.log > $OUT/fuzz-tails.log
