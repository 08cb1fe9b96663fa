"""Package discovery and the one C extension (everything else is in pyproject.toml).

The package list is found, never written: every directory with an
``__init__.py`` under shardckpt/ ships, and converters/ ships as
``shardckpt.converters`` (with any subpackage it grows). A hand-written list
once left out ``shardckpt._memory`` and the built wheel could not make a
``CheckpointManager`` (issue 29); tests/e2e/test_wheel.py builds the wheel and
imports every module from it.
"""

from setuptools import Extension, find_packages, setup

CONVERTERS = "shardckpt.converters"

packages = find_packages(include=["shardckpt", "shardckpt.*"])
packages += [CONVERTERS] + [f"{CONVERTERS}.{sub}" for sub in find_packages("converters")]

# The one-pass copy + CRC-32C of verified loads (shardckpt/_format/_crccopy.c).
# optional=True: without a C compiler the package installs all the same and
# loads take their two-pass path (shardckpt._format.checksum.COPY_FUSED says which).
crccopy = Extension("shardckpt._format._crccopy", ["shardckpt/_format/_crccopy.c"], optional=True, extra_compile_args=["-O2"])

setup(packages=packages, package_dir={CONVERTERS: "converters"}, ext_modules=[crccopy])
