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


def claim_shape(ckpt: str, name: str, shape) -> None:
    """Re-sign ``ckpt`` (format 2+, one writing rank) so that tensor ``name`` claims ``shape`` over its small file.

    A crafted, self-consistent manifest: the tensor's shape, its chunk in the
    index file (box, block CRCs), the index file's size and CRC and the data
    file's recorded size all agree with the claim; only the data file on
    disk is as it was (a few hundred bytes). What catches it is the check
    that the files hold the bytes the manifest claims.
    """
    import base64
    import glob
    import json
    import math

    from shardckpt._format.checksum import crc32c
    from shardckpt._format.manifest import MANIFEST_CRC_FIELD, canonical_json

    mpath = os.path.join(ckpt, "manifest.json")
    raw = json.loads(open(mpath, "rb").read())
    table = raw["file_table"]
    (idx,) = glob.glob(os.path.join(ckpt, "data", "*-index-r00000.json"))
    index = json.loads(open(idx, "rb").read())
    row = next(r for r in index["chunks"] if r[0] == name)
    item = {"F32": 4, "F64": 8, "BF16": 2, "F16": 2, "I64": 8}[raw["tensors"][name]["dtype"]]
    old = math.prod(row[3]) * item
    new = math.prod(shape) * item
    for other in index["chunks"]:  # the chunks after it in its file move up (no bytes shared)
        if other[1] == row[1] and other[4] > row[4]:
            other[4] += new - old
    row[3] = list(shape)
    row[6] = base64.b64encode(bytes(4 * -(-new // index["block_bytes"]))).decode()
    data = json.dumps(index, separators=(",", ":"), sort_keys=True).encode()
    with open(idx, "wb") as f:
        f.write(data)
    raw["tensors"][name]["shape"] = list(shape)
    table["index_files"] = [[len(data), crc32c(data)]]
    table["data_sizes"][0][row[1]] += new - old
    raw.pop(MANIFEST_CRC_FIELD, None)
    raw[MANIFEST_CRC_FIELD] = crc32c(canonical_json(raw))
    with open(mpath, "wb") as f:
        f.write(canonical_json(raw))
