"""Cases the fuzz campaign found, replayed by seed: each broke a property before its fix.

The seeds drive ``_campaign.check`` exactly as ``python -m tests.fuzz.long
--target T --seed S --cases 1`` does; the comment says what came out before.
"""

from __future__ import annotations

import random

import pytest

from ._campaign import check

FOUND = [
    ("hf_index", 43),  # RecursionError: index JSON nested 100,000 deep
    ("torch_save", 60),  # AssertionError from torch.load: expected key '0'
    ("torch_save", 152),  # IndexError from torch.load: pop from empty list
    ("torch_save", 1001534),  # NotImplementedError from zipfile: zip file version 6.4
    ("dcp", 105),  # AttributeError: TensorStorageMetadata without properties
    ("dcp", 1014753),  # NotImplementedError from zipfile on a damaged DCP data file
    ("hf_index", 1007937),  # UnicodeEncodeError: a file name with a lone surrogate reached realpath
]


@pytest.mark.parametrize("target,seed", FOUND, ids=[f"{t}-{s}" for t, s in FOUND])
def test_found_case_keeps_every_property(templates, target, seed):
    # check() raises PropertyViolation when a property breaks; the mutant may
    # be refused (our type) or, where the damage is harmless, converted.
    out = check(target, random.Random(seed), templates)
    assert out.errors or out.ok, out
