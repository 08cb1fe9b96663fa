"""The replica fingerprint and its comparison, alone (no process group): bits, rows, ranks."""

from __future__ import annotations

import pytest
import torch

from shardckpt import _fingerprint as F
from shardckpt._layout import layout_of


@pytest.mark.parametrize(
    "dtype,n",
    [(torch.float32, 1), (torch.float32, F.FP_ROW_WORDS + 3), (torch.bfloat16, 2 * F.FP_ROW_WORDS + 1),
     (torch.int64, 7), (torch.bool, 13), (torch.uint8, 4 * F.FP_ROW_WORDS), (torch.float16, 5)],
)
def test_every_single_bit_flip_is_caught(dtype, n):
    g = torch.Generator().manual_seed(n)
    t = (torch.randn(n, generator=g) * 1000).to(dtype)
    ref = F.fingerprint(t)
    b = t.clone()
    raw = b.view(-1).view(torch.uint8)
    step = max(1, raw.numel() // 300)  # every bit of ~300 bytes spread over the tensor, the last byte included
    for i in list(range(0, raw.numel(), step)) + [raw.numel() - 1]:
        for bit in range(8):
            raw[i] ^= 1 << bit
            assert not torch.equal(F.fingerprint(b), ref), (dtype, n, i, bit)
            raw[i] ^= 1 << bit
    assert torch.equal(F.fingerprint(b), ref)


def test_rows_that_trade_places_are_caught():
    t = torch.arange(4 * F.FP_ROW_WORDS, dtype=torch.int32)
    swapped = t.view(4, -1)[[1, 0, 2, 3]].reshape(-1)
    assert F.fingerprint(t)[0] == F.fingerprint(swapped)[0]  # same sum...
    assert not torch.equal(F.fingerprint(t), F.fingerprint(swapped))  # ...caught by the row weights


def test_views_and_offsets_fingerprint_their_own_bytes():
    base = torch.arange(30, dtype=torch.float32).view(5, 6)
    col = base[:, 1:3]  # not contiguous
    assert torch.equal(F.fingerprint(col), F.fingerprint(col.contiguous()))
    odd = torch.arange(9, dtype=torch.bfloat16)[1:]  # storage offset of 2 bytes
    assert torch.equal(F.fingerprint(odd), F.fingerprint(odd.clone()))


def test_compare_groups_versions_and_ranks():
    k1, k2 = ("a", (0,), (4,)), ("b", (4, 0), (4, 2))
    groups = [([0, 2], {k1: (1, 1), k2: (5, 5)}), ([1], {k1: (1, 1), k2: (6, 6)}), ([3], {k1: (2, 2)})]
    got = F.compare(groups)
    assert got == [(k1, [((1, 1), [0, 1, 2]), ((2, 2), [3])]), (k2, [((5, 5), [0, 2]), ((6, 6), [1])])]
    assert F.compare([([0, 1, 2, 3], {k1: (1, 1)})]) == []
    text = F.describe(got)
    assert text.splitlines() == [
        "a chunk [0:4]: ranks 0, 1, 2 hold version A, rank 3 holds version B",
        "b chunk [4:8, 0:2]: ranks 0, 2 hold version A, rank 1 holds version B",
    ]


def test_describe_is_capped():
    many = [((f"t{i}", (0,), (1,)), [((1, 1), [0]), ((2, 2), [1])]) for i in range(30)]
    text = F.describe(many, limit=5)
    assert len(text.splitlines()) == 6 and text.endswith("... and 25 more diverged chunks")


def test_only_boxes_with_copies_are_fingerprinted():
    w, s = torch.ones(4, 3), torch.tensor(7)
    # World of 2: plain tensors are replicated over it (held by both ranks).
    lays = {n: layout_of(n, t, rank=0, world_size=2) for n, t in {"w": w, "s": s}.items()}
    assert [k for k, _ in F.replicated_parts(lays)] == [("s", (), ()), ("w", (0, 0), (4, 3))]
    alone = {n: layout_of(n, t, rank=0, world_size=1) for n, t in {"w": w}.items()}
    assert F.replicated_parts(alone) == []
    fps = F.local_fingerprints(lays)
    assert set(fps) == {("s", (), ()), ("w", (0, 0), (4, 3))} and all(len(v) == 2 for v in fps.values())


def test_modes():
    assert F.replicas_mode("warn") == "warn"
    with pytest.raises(Exception, match="expected one of 'check', 'warn', 'off'"):
        F.replicas_mode("strict")
