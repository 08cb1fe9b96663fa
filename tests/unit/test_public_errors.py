"""One public error list: ``errors.__all__``, re-exported as ``shardckpt.X``; every error the docs name resolves (issue 29)."""

import builtins
import os
import re

import pytest

import shardckpt
from shardckpt import errors

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
DOCS = sorted(
    [os.path.join(ROOT, "README.md")]
    + [os.path.join(ROOT, "docs", f) for f in os.listdir(os.path.join(ROOT, "docs")) if f.endswith(".md")]
)
# Errors the docs name that belong to other libraries (storage clients), not to shardckpt.
FOREIGN = {"GenericError", "InternalError", "NoCredentialsError"}

ERROR_CLASSES = [n for n in errors.__all__ if isinstance(getattr(errors, n), type) and issubclass(getattr(errors, n), Exception)]


def _docs_text():
    for path in DOCS:
        with open(path, encoding="utf-8") as f:
            yield os.path.relpath(path, ROOT), f.read()


@pytest.mark.parametrize("name", ERROR_CLASSES)
def test_every_error_class_is_public_on_the_package(name):
    assert getattr(shardckpt, name) is getattr(errors, name)
    assert name in shardckpt.__all__
    assert name in dir(shardckpt)


def test_the_package_exports_no_error_that_errors_py_does_not():
    exported = {n for n in shardckpt.__all__ if n.endswith("Error")}
    assert exported == set(ERROR_CLASSES)


def test_every_error_name_in_the_docs_resolves():
    bad = []
    qualified = re.compile(r"\bshardckpt\.(?:errors\.)?([A-Z]\w*)")
    bare = re.compile(r"`([A-Z]\w*Error)`")
    seen = set()
    for where, text in _docs_text():
        for m in qualified.finditer(text):
            seen.add(m.group(1))
            if not hasattr(shardckpt, m.group(1)):
                bad.append((where, m.group(0)))
            elif m.group(0).startswith("shardckpt.errors.") and not hasattr(errors, m.group(1)):
                bad.append((where, m.group(0)))
        for m in bare.finditer(text):
            name = m.group(1)
            if hasattr(builtins, name) or name in FOREIGN:
                continue
            seen.add(name)
            if name not in ERROR_CLASSES or not hasattr(shardckpt, name):
                bad.append((where, name))
    assert not bad, f"names the docs use that do not resolve as shardckpt.X / shardckpt.errors.X: {bad}"
    assert "NewerFormatError" in seen and "CheckpointManager" in seen, sorted(seen)
