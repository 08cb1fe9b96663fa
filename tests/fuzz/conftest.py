"""Hypothesis profiles of the fuzz campaign, chosen by ``SHARDCKPT_FUZZ`` (default ``ci``).

- ``ci``: about 200 cases per property, derandomized (the same cases every
  run: a red CI run is a defect to fix, never a flake), the folder in under a
  minute on two cores;
- ``dev``: 25 cases per property, for a quick local check;
- ``long``: 20,000 cases per property (the long campaign proper is
  ``python -m tests.fuzz.long``, which runs seeds without hypothesis'
  bookkeeping).

``SHARDCKPT_FUZZ_EXAMPLES`` overrides the count of any profile.
"""

from __future__ import annotations

import os

import pytest
from hypothesis import HealthCheck, settings

from ._campaign import build_templates

#: A single case (mutate, inspect, verify, load) must finish within this; hangs never do.
CASE_DEADLINE_MS = 10_000

_COMMON = dict(
    deadline=CASE_DEADLINE_MS,
    database=None,
    suppress_health_check=[HealthCheck.too_slow, HealthCheck.function_scoped_fixture, HealthCheck.data_too_large],
    print_blob=True,
)
_COUNTS = {"ci": 200, "dev": 25, "long": 20_000}
for _name, _n in _COUNTS.items():
    settings.register_profile(
        _name,
        max_examples=int(os.environ.get("SHARDCKPT_FUZZ_EXAMPLES", _n)),
        derandomize=_name != "long",
        **_COMMON,
    )
_PROFILE = os.environ.get("SHARDCKPT_FUZZ", "ci")
if _PROFILE not in _COUNTS:
    raise ValueError(f"SHARDCKPT_FUZZ={_PROFILE!r}: expected one of {sorted(_COUNTS)}")
settings.load_profile(_PROFILE)


@pytest.fixture(scope="session")
def templates():
    t = build_templates()
    yield t
    t.close()
