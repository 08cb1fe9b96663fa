"""Issue 37 item 1 on 2 gloo ranks: a stateful object refusing its state on one rank fails the load on every rank.

Rank 1's data loader refuses its saved state (a version check) after the tensors are in; every rank must raise
the same ``StateMismatchError`` naming rank 1, the object and the tensors already loaded, instead of rank 1
raising a foreign ``ValueError`` while rank 0 returns as if the load had succeeded.
"""

from __future__ import annotations

from _dist import run_ranks


class _Loader:
    def __init__(self, version: int):
        self.version, self.pos = version, 0

    def state_dict(self):
        return {"version": self.version, "pos": self.pos}

    def load_state_dict(self, sd):
        if sd["version"] != self.version:
            raise ValueError(f"data loader state version {sd['version']} != {self.version}")
        self.pos = sd["pos"]


def _save_then_load(rank: int, world: int, path: str):
    import torch

    import shardckpt
    from shardckpt.errors import CheckpointError

    torch.manual_seed(0)
    model = torch.nn.Linear(4, 3)
    shardckpt.save({"model": model, "loader": _Loader(1)}, path)
    live = torch.nn.Linear(4, 3)
    try:
        shardckpt.load({"model": live, "loader": _Loader(2 if rank == 1 else 1)}, path, collective_timeout_s=60)
    except CheckpointError as e:
        return type(e).__name__, str(e), type(e.__cause__).__name__ if rank == 1 else None
    except Exception as e:  # noqa: BLE001 - a foreign error is the bug
        return "foreign " + type(e).__name__, str(e), None
    return None


def test_a_user_object_refusing_on_one_rank_fails_the_load_on_every_rank(tmp_path):
    got = run_ranks(2, _save_then_load, str(tmp_path / "ck"))
    assert all(g is not None for g in got), got  # no rank returns as if loaded
    (k0, m0, _), (k1, m1, cause1) = got
    assert k0 == k1 == "StateMismatchError" and m0 == m1, got
    assert "rank 1" in m0 and "_Loader.load_state_dict" in m0 and "version 1 != 2" in m0
    assert "model.weight" in m0 and "model.bias" in m0
    assert cause1 == "ValueError"  # the object's own exception, on the rank that raised it
