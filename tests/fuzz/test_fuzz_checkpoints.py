"""Property-based fuzzing of every parser a checkpoint reaches: mutated valid checkpoints never break a property.

One test per target (see ``_campaign``): the manifest, the safetensors
headers and data of a native checkpoint, the HF index, DCP ``.metadata``
through the restricted unpickler, and ``torch.save`` archives. Mutations:
flips, truncation, splices, insertions, enlarged lengths, wrong JSON types,
huge/negative/NaN numbers, duplicate keys, deep nesting, unicode, ``..``,
absolute paths, schemes, and files replaced by symlinks (out of the
checkpoint, to ``/dev/zero``, loops), FIFOs and directories.
"""

from __future__ import annotations

import pytest
from hypothesis import given
from hypothesis import strategies as st

from ._campaign import TARGETS, check


@pytest.mark.timeout(300)
@pytest.mark.parametrize("target", TARGETS)
@given(rnd=st.randoms(use_true_random=False))
def test_mutants_keep_every_property(templates, target, rnd):
    check(target, rnd, templates)
