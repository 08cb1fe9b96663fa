"""Write the committed v1 golden fixtures (run once; the outputs are committed).

    .venv/bin/python tests/data/make_golden.py

* ``manifest_golden.json``: ``manifest_to_bytes`` of :func:`golden_manifest`,
  byte for byte. If serialization changes, the format changed: bump
  ``FORMAT_VERSION`` instead of regenerating this file.
* ``v1_golden/``: a real checkpoint saved on 2 gloo ranks from
  :func:`golden_state`, values computed without randomness so any later
  version of the library (and torch) can recompute and compare them. Never
  regenerate it to make a failing test pass: old checkpoints must keep loading.
"""

from __future__ import annotations

import math
import os
import shutil
import sys

HERE = os.path.dirname(os.path.abspath(__file__))
GOLDEN_DIR = os.path.join(HERE, "v1_golden")
MANIFEST_GOLDEN = os.path.join(HERE, "manifest_golden.json")
SHARDED_SHAPE = (5, 3)


def golden_tensors():
    """The tensors of the golden checkpoint, as full plain tensors."""
    import torch

    return {
        "bf16": (torch.arange(15, dtype=torch.float32).reshape(3, 5) / 7 - 1).to(torch.bfloat16),
        "i64": torch.arange(6, dtype=torch.int64) * (2**40) - 3,
        "flag": torch.tensor([True, False, True, True]),
        "scalar": torch.tensor(3.25, dtype=torch.float32),
        "empty": torch.zeros(0, 4, dtype=torch.float16),
        "sharded": torch.arange(15, dtype=torch.float32).reshape(SHARDED_SHAPE) / 4 - 0.5,
    }


def golden_values():
    """The plain (JSON) values of the golden checkpoint."""
    return {
        "step": 42,
        "meta": {"name": "golden", "lr": 1e-3, "nan": float("nan"), "inf": -math.inf, "pair": (1, 2), "none": None},
        "items": [1, "a", True],
    }


def golden_manifest():
    """A hand-built Manifest exercising every field (serialized byte for byte)."""
    from shardckpt._format import ChunkMeta, FileMeta, Manifest, TensorMeta

    f0, f1 = "data/abc-r00000-00.safetensors", "data/abc-r00001-00.safetensors"
    return Manifest(
        world_size=2,
        tensors={
            "w": TensorMeta(
                dtype="BF16",
                shape=[4, 3],
                # out of order on purpose: serialization sorts chunks by offsets
                chunks=[
                    ChunkMeta(f1, "w@2,0", [2, 0], [2, 3], 200, 12, 4294967295),
                    ChunkMeta(f0, "w@0,0", [0, 0], [2, 3], 200, 12, 0),
                ],
                layout={"mesh_shape": [2], "mesh_dim_names": None, "placements": ["S(0)"]},
            ),
            "b": TensorMeta(dtype="F32", shape=[], chunks=[ChunkMeta(f0, "b", [], [], 216, 4, 123456789)]),
        },
        files={f1: FileMeta(212), f0: FileMeta(220)},
        values={"step": 7, "name": "é", "nested": [1.5, {"__shardckpt__": "tensor", "name": "w"}]},
        save_id="0123456789abcdef0123456789abcdef",
        library_version="0.1.0",
        extra={"note": "golden"},
    )


def _save_rank(rank, world, path):
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import Shard, distribute_tensor

    import shardckpt

    mesh = init_device_mesh("cpu", (world,))
    state = dict(golden_tensors())
    state["sharded"] = distribute_tensor(state["sharded"], mesh, [Shard(0)])
    state.update(golden_values())
    shardckpt.save(state, path)
    return True


def main():
    sys.path.insert(0, os.path.dirname(HERE))  # tests/ for _dist
    from _dist import run_ranks

    from shardckpt._format import manifest_to_bytes

    with open(MANIFEST_GOLDEN, "wb") as f:
        f.write(manifest_to_bytes(golden_manifest()))
    shutil.rmtree(GOLDEN_DIR, ignore_errors=True)
    run_ranks(2, _save_rank, GOLDEN_DIR, fresh=True)
    print("wrote", MANIFEST_GOLDEN, "and", GOLDEN_DIR)


if __name__ == "__main__":
    main()
