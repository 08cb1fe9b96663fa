"""Damage a saved step on purpose: the tier tests' one way to find a rank's data file and flip a byte of it."""

from __future__ import annotations

import os


def data_file(node_dir: str, step: int, writer: int) -> str:
    """The data file rank ``writer`` wrote for ``step`` under ``node_dir`` (a root: ``step-N/data/...-r<writer>-00``)."""
    d = os.path.join(node_dir, f"step-{step:08d}", "data")
    return os.path.join(d, next(f for f in sorted(os.listdir(d)) if f.endswith(f"-r{writer:05d}-00.safetensors")))


def flip_last_byte(path: str) -> None:
    """Invert the last byte of ``path`` in place (its size stays: only a checksum can tell)."""
    with open(path, "r+b") as f:
        f.seek(-1, os.SEEK_END)
        b = f.read(1)
        f.seek(-1, os.SEEK_END)
        f.write(bytes([b[0] ^ 0xFF]))
