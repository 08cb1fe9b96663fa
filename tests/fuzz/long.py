"""The long fuzz campaign (outside CI): ``python -m tests.fuzz.long --cases 100000``.

Runs seeded cases round-robin over the targets with the same mutators and
properties as the bounded pytest run (``_campaign``), without hypothesis'
bookkeeping, and prints the figures docs/reliability.md quotes: cases run,
per target, the errors raised (by type), operations that succeeded, values
that changed silently, and every distinct property violation with the seed
that reproduces it (``--target T --seed S --cases 1``).

Exit status: 0 when no property was broken, 1 otherwise.
"""

from __future__ import annotations

import argparse
import collections
import json
import random
import sys
import time

from ._campaign import TARGETS, PropertyViolation, build_templates, check

#: Distinct violations printed in full.
SHOWN_VIOLATIONS = 20


def main(argv=None) -> int:
    p = argparse.ArgumentParser(prog="python -m tests.fuzz.long", description=__doc__.splitlines()[0])
    p.add_argument("--cases", type=int, default=100_000, help="cases in all (default 100000)")
    p.add_argument("--seed", type=int, default=0, help="first seed (case i uses seed + i)")
    p.add_argument("--target", choices=TARGETS, action="append", help="only these targets (repeatable)")
    p.add_argument("--minutes", type=float, default=None, help="stop after this long, whatever --cases says")
    p.add_argument("--json", default=None, help="write the figures to this file as JSON")
    args = p.parse_args(argv)
    targets = tuple(args.target or TARGETS)
    t = build_templates()
    per_target = collections.Counter()
    errors = collections.Counter()
    succeeded = collections.Counter()
    values_changed = 0
    violations = {}
    start = time.monotonic()
    deadline = start + args.minutes * 60 if args.minutes else None
    done = 0
    try:
        for i in range(args.cases):
            if deadline is not None and time.monotonic() > deadline:
                break
            target = targets[i % len(targets)]
            seed = args.seed + i
            try:
                out = check(target, random.Random(seed), t)
            except PropertyViolation as e:
                key = f"{target}: " + str(e).split("] ", 1)[-1][:160]
                if key not in violations:
                    print(f"VIOLATION (--target {target} --seed {seed} --cases 1): {str(e)[:500]}", flush=True)
                violations.setdefault(key, []).append(seed)
            else:
                errors.update(f"{target}.{op}:{name}" for op, name in out.errors.items())
                succeeded.update(f"{target}.{op}" for op in out.ok)
                values_changed += out.values_changed
            per_target[target] += 1
            done += 1
            if done % 5000 == 0:
                rate = done / (time.monotonic() - start)
                print(f"{done} cases, {rate:.0f}/s, {sum(len(v) for v in violations.values())} violations", flush=True)
    finally:
        t.close()
    elapsed = time.monotonic() - start
    figures = {
        "cases": done,
        "seconds": round(elapsed, 1),
        "per_target": dict(per_target),
        "errors": dict(errors.most_common()),
        "succeeded": dict(succeeded.most_common()),
        "values_changed_silently": values_changed,
        "violations": {k: {"count": len(v), "seeds": v[:5]} for k, v in violations.items()},
    }
    print(json.dumps({k: v for k, v in figures.items() if k != "errors"}, indent=1))
    print(f"{done} cases in {elapsed:.0f}s; {len(violations)} distinct violations")
    for key, seeds in list(violations.items())[:SHOWN_VIOLATIONS]:
        print(f"  {len(seeds)}x {key} (seeds {seeds[:5]})")
    if args.json:
        with open(args.json, "w") as f:
            json.dump(figures, f, indent=1)
    return 1 if violations else 0


if __name__ == "__main__":
    sys.exit(main())
