"""Package discovery (everything else is in pyproject.toml).

The package list is found, never written: every directory with an
``__init__.py`` under shardckpt/ ships, and converters/ ships as
``shardckpt.converters`` (with any subpackage it grows). A hand-written list
once left out ``shardckpt._memory`` and the built wheel could not make a
``CheckpointManager`` (issue 29); tests/e2e/test_wheel.py builds the wheel and
imports every module from it.
"""

from setuptools import find_packages, setup

CONVERTERS = "shardckpt.converters"

packages = find_packages(include=["shardckpt", "shardckpt.*"])
packages += [CONVERTERS] + [f"{CONVERTERS}.{sub}" for sub in find_packages("converters")]

setup(packages=packages, package_dir={CONVERTERS: "converters"})
