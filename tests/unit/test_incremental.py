"""Incremental checkpoints (format v4): content hashes, references, reference-safe retention, consolidate.

Pure level (names, liveness) first, then real saves into a local directory,
one process. Multi-rank cases are in tests/dist/test_incremental_dist.py.
"""

from __future__ import annotations

import os
import random

import pytest
import torch

import shardckpt
from shardckpt import _incremental, converters
from shardckpt._format import open_manifest
from shardckpt._format.checksum import content_hash, default_hash_algo
from shardckpt._format.refs import live_files, named_files, own_and_shared, ref_path, ref_target, removable
from shardckpt._manager import step_dir_name
from shardckpt._storage import Storage
from shardckpt.errors import ChecksumMismatchError, CorruptCheckpointError, UnsafeMetadataError, UsageError

# --------------------------------------------------------------------------
# pure: reference paths and liveness


def test_ref_paths_round_trip_and_stay_flat():
    assert ref_path("step-00000010", "data/a.safetensors") == "@step-00000010/data/a.safetensors"
    assert ref_target("@step-00000010/data/a.safetensors") == ("step-00000010", "data/a.safetensors")
    assert ref_path("step-00000020", "@step-00000010/data/a") == "@step-00000010/data/a"  # flat
    assert ref_target("data/a") is None
    for bad in ("@../x/y", "@./y", "@/y", "@a", "@a/", "@a b/c"):
        with pytest.raises(UnsafeMetadataError):
            ref_target(bad)


def test_liveness_with_ints():
    # Step dirs "s<n>"; s3 references s1 and s2; dropping s1 and s2 keeps exactly what s3 names.
    kept = {"s3": ["data/c", "@s1/data/a", "@s2/data/b1"]}
    live = live_files(kept)
    assert removable("s1", ["data/a", "data/a2", "data/idx.json"], live) == ["data/a2", "data/idx.json"]
    assert removable("s2", ["data/b1", "data/b2"], live) == ["data/b2"]
    assert removable("s3", ["data/c", "manifest.json"], live) == ["manifest.json"]
    assert named_files("s3", kept["s3"]) == live
    assert own_and_shared({"data/c": 5, "@s1/data/a": 100}) == (5, 100)


def test_liveness_property_never_frees_a_named_file():
    """Seeded: random chains of flat references; a file is removable iff no kept manifest names it."""
    rng = random.Random(23)
    for _ in range(1000):
        steps = list(range(rng.randint(1, 6)))
        owns = {s: [f"data/f{s}-{i}" for i in range(rng.randint(1, 3))] for s in steps}
        names = {}
        for s in steps:
            earlier = [ref_path(f"s{e}", f) for e in steps if e < s for f in owns[e]]
            names[f"s{s}"] = owns[s] + rng.sample(earlier, rng.randint(0, len(earlier)))
        kept = {d: fs for d, fs in names.items() if rng.random() < 0.5}
        live = live_files(kept)
        for s in steps:
            gone = set(removable(f"s{s}", owns[s], live))
            for d, fs in kept.items():
                for rel in fs:
                    tgt = ref_target(rel) or (d, rel)
                    assert not (tgt[0] == f"s{s}" and tgt[1] in gone)


# --------------------------------------------------------------------------
# real saves, one process


def _lora(seed: int = 0, n: int = 64):
    g = torch.Generator().manual_seed(seed)
    return {
        "base": torch.randn(n, n, generator=g),
        "emb": torch.randn(2 * n, 8, generator=g).to(torch.bfloat16),
        "lora_a": torch.randn(4, n, generator=g),
        "step": seed,
    }


def _data_bytes(path: str) -> int:
    d = os.path.join(path, "data")
    return sum(os.path.getsize(os.path.join(d, f)) for f in os.listdir(d) if f.endswith(".safetensors"))


def _load(url: str, like):
    out = {k: (torch.zeros_like(v) if isinstance(v, torch.Tensor) else 0) for k, v in like.items()}
    shardckpt.load(out, url)
    return out


def _same(a, b):
    for k, v in a.items():
        if isinstance(v, torch.Tensor):
            assert torch.equal(v, b[k]), k
        else:
            assert v == b[k], k


def test_incremental_save_references_unchanged_chunks(tmp_path):
    s1, s2 = str(tmp_path / "step-1"), str(tmp_path / "step-2")
    state = _lora()
    shardckpt.save(state, s1, content_hash=True)
    full = _data_bytes(s1)
    state["lora_a"] = state["lora_a"] + 1
    state["step"] = 2
    shardckpt.save(state, s2, incremental=s1)
    m = open_manifest(s2)
    assert m.version == 5 and m.content_hash == default_hash_algo()
    assert any(rel.startswith("@step-1/") for rel in m.files)
    # Only lora_a (4x64 fp32 = 1 KiB) plus a header is written.
    assert _data_bytes(s2) < 4 * 64 * 4 + 1024 < full
    _same(_load(s2, state), state)
    shardckpt.verify(s2)
    own, shared = own_and_shared({r: f.size for r, f in m.data_files.items()})
    assert shared == full and own == _data_bytes(s2)
    # Hashes are what the write pass computed.
    ck = [c for c in m.tensors["lora_a"].chunks][0]
    with open(os.path.join(s2, ck.file), "rb") as f:
        f.seek(ck.byte_offset)
        assert content_hash(m.content_hash, f.read(ck.nbytes)) == ck.hash


def test_a_base_saved_without_hashes_is_compared_with_nothing(tmp_path):
    # Hashing is opt-in (it costs CPU time in the write pass): a plain save
    # records no hashes, so an incremental save on top of it writes every
    # chunk again, and is whole on its own.
    s1, s2 = str(tmp_path / "step-1"), str(tmp_path / "step-2")
    state = _lora()
    shardckpt.save(state, s1)
    m1 = open_manifest(s1)
    assert all(c.hash is None for t in m1.tensors.values() for c in t.chunks)
    state["step"] = 2
    shardckpt.save(state, s2, incremental=s1)
    m2 = open_manifest(s2)
    assert not any(rel.startswith("@") for rel in m2.files)
    assert _data_bytes(s2) == _data_bytes(s1)
    assert all(c.hash for t in m2.tensors.values() for c in t.chunks)  # the next one can build on it
    _same(_load(s2, state), state)


def test_frozen_flag_lie_is_saved(tmp_path):
    s1, s2 = str(tmp_path / "a"), str(tmp_path / "b")
    p = torch.nn.Parameter(torch.randn(32, 32), requires_grad=False)
    shardckpt.save({"p": p}, s1, content_hash=True)
    with torch.no_grad():
        p[3, 4] += 1  # "frozen", yet changed
    shardckpt.save({"p": p}, s2, incremental="a")
    out = {"p": torch.zeros(32, 32)}
    shardckpt.load(out, s2)
    assert torch.equal(out["p"], p)
    assert not any(rel.startswith("@") for rel in open_manifest(s2).files)


def test_version_counter_misses_data_writes():
    """Why the save hashes instead of trusting ``_version``: ``.data`` writes do not bump it."""
    p = torch.nn.Parameter(torch.zeros(4))
    v = p._version
    p.data.add_(1)
    assert p._version == v and p.sum().item() == 4


def test_incremental_base_must_be_a_sibling(tmp_path):
    shardckpt.save({"w": torch.ones(2)}, str(tmp_path / "x" / "a"))
    with pytest.raises(UsageError, match="next to"):
        shardckpt.save({"w": torch.ones(2)}, str(tmp_path / "y" / "b"), incremental=str(tmp_path / "x" / "a"))


@pytest.mark.parametrize("damage", ["missing", "truncated", "flipped", "grown"])
def test_damaged_referenced_file_names_the_step(tmp_path, damage):
    s1, s2 = str(tmp_path / "step-1"), str(tmp_path / "step-2")
    state = _lora()
    shardckpt.save(state, s1, content_hash=True)
    state["lora_a"] = state["lora_a"] * 2
    shardckpt.save(state, s2, incremental=s1)
    ref = [r for r in open_manifest(s2).files if r.startswith("@")][0]
    path = os.path.join(str(tmp_path), ref[1:])
    size = os.path.getsize(path)
    if damage == "missing":
        os.remove(path)
    elif damage == "truncated":
        os.truncate(path, size - 8)
    elif damage == "grown":
        with open(path, "ab") as f:
            f.write(b"x")
    else:
        with open(path, "r+b") as f:
            f.seek(size - 5)
            b = f.read(1)
            f.seek(size - 5)
            f.write(bytes([b[0] ^ 1]))
    with pytest.raises((CorruptCheckpointError, ChecksumMismatchError)) as e:
        _load(s2, state)
    assert "step-1" in str(e.value)
    with pytest.raises((CorruptCheckpointError, ChecksumMismatchError)) as e:
        shardckpt.verify(s2)
    assert "step-1" in str(e.value)


def _frozen_run(root: str, steps, **kw):
    """A LoRA-like run: base frozen, adapter changes each step; returns the state saved at each step."""
    saved = {}
    state = _lora()
    with shardckpt.CheckpointManager(root, incremental=True, **kw) as mgr:
        for s in steps:
            state["lora_a"] = state["lora_a"] + s
            state["step"] = s
            mgr.save(s, state)
            saved[s] = {k: (v.clone() if isinstance(v, torch.Tensor) else v) for k, v in state.items()}
    return saved


def test_manager_retention_keeps_referenced_files(tmp_path):
    root = str(tmp_path / "run")
    saved = _frozen_run(root, [1, 2, 3, 4], keep_last=2)
    mgr = shardckpt.CheckpointManager(root)
    assert mgr.steps() == [3, 4]
    # step-1 is uncommitted, yet holds the base bytes steps 3 and 4 reference.
    s1 = os.path.join(root, step_dir_name(1))
    assert not os.path.exists(os.path.join(s1, "manifest.json"))
    assert os.listdir(os.path.join(s1, "data"))
    assert not os.path.exists(os.path.join(root, step_dir_name(2)))  # held nothing referenced
    for s in (3, 4):
        _same(_load(mgr.step_url(s), saved[s]), saved[s])
        shardckpt.verify(mgr.step_url(s))
    # gc keeps them; restore picks step 4.
    assert mgr.cleanup(dry_run=True) == mgr.cleanup() == []
    out = {k: (torch.zeros_like(v) if isinstance(v, torch.Tensor) else 0) for k, v in saved[4].items()}
    assert mgr.restore(out) == 4
    _same(out, saved[4])


def test_consolidate_is_standalone(tmp_path):
    root = str(tmp_path / "run")
    saved = _frozen_run(root, [1, 2], keep_last=1)
    mgr = shardckpt.CheckpointManager(root)
    dst = str(tmp_path / "standalone")
    converters.consolidate(mgr.step_url(2), dst)
    assert not any(r.startswith("@") for r in open_manifest(dst).files)
    Storage(root).remove_tree("")
    _same(_load(dst, saved[2]), saved[2])
    shardckpt.verify(dst)


def test_restore_skips_a_step_whose_referenced_file_is_gone(tmp_path):
    root = str(tmp_path / "run")
    state = _lora()
    with shardckpt.CheckpointManager(root, incremental=True) as mgr:
        mgr.save(1, state)
        state["lora_a"] = state["lora_a"] + 1
        mgr.save(2, state)
        _incremental._MEMO.clear()  # a restarted job: no memo of what changed at step 2 (it only orders work)
        mgr.save(3, state)  # nothing changed: all references, the adapter's to step 2
    m3 = open_manifest(mgr.step_url(3))
    assert not [r for r in m3.data_files if not r.startswith("@")]  # wrote no data file
    (ref,) = sorted(r for r in m3.files if r.startswith("@step-00000002/"))
    os.remove(os.path.join(root, ref[1:]))
    out = {k: (torch.zeros_like(v) if isinstance(v, torch.Tensor) else 0) for k, v in state.items()}
    assert shardckpt.CheckpointManager(root).restore(out) == 1  # steps 3 and 2 lack the adapter's bytes


def test_a_tensor_that_stops_changing_is_referenced_again(tmp_path):
    """The write-order memo: a chunk that changed is written unhashed while its CRC keeps changing, hashed once its CRC
    stands still, then referenced."""
    root = str(tmp_path / "run")
    state = _lora()
    _incremental._MEMO.clear()
    with shardckpt.CheckpointManager(root, incremental=True) as mgr:
        for step in (1, 2, 3, 4, 5):
            if step == 2:
                state["lora_a"] = state["lora_a"] + 1
            mgr.save(step, state)
    manifests = {s: open_manifest(mgr.step_url(s)) for s in (2, 3, 4, 5)}
    own = {s: [r for r in m.data_files if not r.startswith("@")] for s, m in manifests.items()}
    # Step 2 found the adapter changed (hashed, looked up); step 3 wrote it unhashed (its CRC equalled step 2's);
    # step 4 wrote it hashed; step 5 referenced it.
    assert own[2] and own[3] and own[4] and not own[5]
    hashes = {s: [c.hash for c in m.tensors["lora_a"].chunks] for s, m in manifests.items()}
    assert all(h is None for h in hashes[3]) and all(hashes[4]) and hashes[5] == hashes[4]


def test_dense_training_in_an_incremental_run_hashes_nothing_once_known_to_change(tmp_path):
    # Every tensor changes before every save: after the first lookup, the CRC the write pass computes anyway
    # tells each save that the chunk changed again, so no content hash is computed (dense pays no hash).
    root = str(tmp_path / "run")
    state = _lora()
    _incremental._MEMO.clear()
    with shardckpt.CheckpointManager(root, incremental=True) as mgr:
        for step in (1, 2, 3, 4):
            state = {k: (v + 1 if isinstance(v, torch.Tensor) else step) for k, v in state.items()}
            mgr.save(step, state)
    for s in (3, 4):
        m = open_manifest(mgr.step_url(s))
        assert not any(r.startswith("@") for r in m.files)
        assert all(c.hash is None for t in m.tensors.values() for c in t.chunks), s
    _same(_load(mgr.step_url(4), state), state)


def test_cli_gc_inspect_consolidate(tmp_path, capsys):
    import json

    from shardckpt._cli import main

    root = str(tmp_path / "run")
    saved = _frozen_run(root, [1, 2, 3], keep_last=1)
    junk = os.path.join(root, step_dir_name(1), "data", "junk.safetensors")
    open(junk, "wb").write(b"x")
    capsys.readouterr()
    assert main(["gc", root, "--dry-run", "--json"]) == 0
    assert json.loads(capsys.readouterr().out)["removed"] == [f"{step_dir_name(1)}/data/junk.safetensors"]
    assert os.path.exists(junk)
    assert main(["gc", root, "-q"]) == 0 and not os.path.exists(junk)
    step3 = os.path.join(root, step_dir_name(3))
    assert main(["inspect", step3, "--json"]) == 0
    got = json.loads(capsys.readouterr().out)
    assert got["shared_bytes"] > 0 and got["own_bytes"] > 0
    dst = str(tmp_path / "copy")
    assert main(["consolidate", step3, dst, "-q"]) == 0
    assert not any(r.startswith("@") for r in open_manifest(dst).files)
    _same(_load(dst, saved[3]), saved[3])


def test_async_manager_saves_incrementally(tmp_path):
    root = str(tmp_path / "run")
    state = _lora()
    with shardckpt.CheckpointManager(root, incremental=True, async_save=True) as mgr:
        mgr.save(1, state)
        state["lora_a"] = state["lora_a"] - 1  # after staging: step 1 keeps the old adapter
        mgr.save(2, state).result()
    m = open_manifest(mgr.step_url(2))
    assert {c.file[:15] for c in m.tensors["base"].chunks} == {"@step-00000001/"}
    _same(_load(mgr.step_url(2), state), state)


def test_delete_keeps_what_later_steps_reference_and_converters_follow(tmp_path):
    root = str(tmp_path / "run")
    saved = _frozen_run(root, [1, 2])
    mgr = shardckpt.CheckpointManager(root)
    mgr.delete(1)
    assert mgr.steps() == [2]
    _same(_load(mgr.step_url(2), saved[2]), saved[2])
    hf = str(tmp_path / "hf")
    converters.to_safetensors(mgr.step_url(2), hf, prefix="")
    from safetensors.torch import load_file

    got = {}
    for f in os.listdir(hf):
        if f.endswith(".safetensors"):
            got.update(load_file(os.path.join(hf, f)))
    assert torch.equal(got["base"], saved[2]["base"]) and torch.equal(got["lora_a"], saved[2]["lora_a"])


def test_verify_checks_the_content_hash(tmp_path):
    import json

    from shardckpt._format import IndexMeta, manifest_to_bytes
    from shardckpt._format.checksum import crc32c

    d = str(tmp_path / "ck")
    shardckpt.save({"w": torch.arange(64.0)}, d, content_hash=True)
    m = open_manifest(d, chunks=False)
    rel = next(iter(m.indexes))
    idx = json.loads(open(os.path.join(d, rel), "rb").read())
    at = idx["rows"].index("hash")
    idx["chunks"][0][at] = "0" * 64  # CRCs still match the bytes; the hash does not
    body = (json.dumps(idx, sort_keys=True, separators=(",", ":")) + "\n").encode()
    open(os.path.join(d, rel), "wb").write(body)
    m.indexes[rel] = IndexMeta(rank=0, size=len(body), crc32c=crc32c(body))
    m.files[rel].size = len(body)
    open(os.path.join(d, "manifest.json"), "wb").write(manifest_to_bytes(m))
    with pytest.raises(CorruptCheckpointError, match="content hash"):
        shardckpt.verify(d)


@pytest.mark.parametrize("async_save", [False, True])
def test_force_resave_keeps_the_files_later_steps_reference(tmp_path, async_save):
    """Issue 29 item 4: ``save(step, force=True)`` of a step later incremental steps reference wrote new files and
    deleted the old ones, so steps 2 and 3 lost their base bytes and ``restore()`` went back to the re-saved step 1."""
    root = str(tmp_path / "run")
    saved = _frozen_run(root, [1, 2, 3])
    mgr = shardckpt.CheckpointManager(root, incremental=True, async_save=async_save)
    old = sorted(r for r in open_manifest(mgr.step_url(3)).files if r.startswith("@step-00000001/"))
    assert old  # step 3 reads the frozen base from step 1's files
    resaved = {k: (v * 2 if isinstance(v, torch.Tensor) else v) for k, v in saved[1].items()}
    mgr.save(1, resaved, force=True)
    mgr.wait()
    # The re-save holds the new bytes in new files; the files steps 2 and 3 name are all still there.
    m1 = open_manifest(mgr.step_url(1))
    assert not set(m1.files) & {r.split("/", 1)[1] for r in old}
    for rel in old:
        assert os.path.exists(os.path.join(root, rel[1:])), rel
    _same(_load(mgr.step_url(1), resaved), resaved)
    for s in (2, 3):
        shardckpt.verify(mgr.step_url(s))
        _same(_load(mgr.step_url(s), saved[s]), saved[s])
    out = {k: (torch.zeros_like(v) if isinstance(v, torch.Tensor) else 0) for k, v in saved[3].items()}
    assert shardckpt.CheckpointManager(root).restore(out) == 3
    _same(out, saved[3])
    # gc keeps them while a kept step names them, and removes them once none does.
    assert mgr.cleanup() == []
    mgr.delete(3)
    mgr.delete(2)
    gone = mgr.cleanup()
    assert sorted(gone) == sorted(r[1:] for r in old)
    shardckpt.verify(mgr.step_url(1))
    _same(_load(mgr.step_url(1), resaved), resaved)
