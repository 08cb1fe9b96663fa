"""The parts of CheckpointManager alone (shardckpt._managed): no manager, no process group.

Retention and restore order are decisions over step numbers (ints, sets, a
``validate`` callable standing in for storage), tested with fake inventories;
the I/O helpers run on real checkpoints in a temporary directory.
"""

from __future__ import annotations

import errno
import logging
import os
import uuid

import pytest
import torch

import shardckpt
from shardckpt._format.naming import step_dir_name
from shardckpt._managed import exports, memory, owners, restore, retention
from shardckpt._managed.retention import RetentionPlan, plan_retention
from shardckpt._storage import Storage
from shardckpt.errors import (
    CheckpointNotFoundError,
    ConcurrentUseError,
    CorruptCheckpointError,
    LoadFailedError,
    NewerFormatError,
    StorageError,
    UsageError,
)

# --------------------------------------------------------------------------
# retention: pure decisions


def test_check_step_takes_integers_only():
    assert retention.check_step(5) == 5
    assert retention.check_step(torch.tensor(3)) == 3  # a 0-d int tensor is an index
    assert retention.check_step(retention.MAX_STEP) == retention.MAX_STEP
    for bad in (True, -1, 1.5, "3", None, retention.MAX_STEP + 1):
        with pytest.raises(UsageError, match="non-negative int"):
            retention.check_step(bad)
    with pytest.raises(UsageError, match="an int of 200 bits"):  # its repr is never printed whole
        retention.check_step(2**199)


@pytest.mark.parametrize(
    "committed, unfinished, kw, plan",
    [
        # keep_last=None keeps every committed step; leftovers below the newest still go
        ([1, 2, 3], [0], dict(keep_last=None, keep_every=None), RetentionPlan((), (0,), (1, 2, 3))),
        ([1, 2, 3, 4, 5], [], dict(keep_last=2, keep_every=None), RetentionPlan((1, 2, 3), (), (4, 5))),
        # milestones and the step just saved stay whatever keep_last says
        ([2, 3, 4, 5, 6], [], dict(keep_last=1, keep_every=2, protect=[5]), RetentionPlan((3,), (), (2, 4, 5, 6))),
        # a leftover newer than the newest committed step may be a save in flight: it stays
        ([3, 5], [4, 6, 1], dict(keep_last=5, keep_every=None), RetentionPlan((), (1, 4), (3, 5))),
        ([], [1, 2], dict(keep_last=1, keep_every=None), RetentionPlan((), (), ())),
        # duplicates and order in the listing do not matter
        ([5, 1, 5, 3], [], dict(keep_last=1, keep_every=None), RetentionPlan((1, 3), (), (5,))),
    ],
)
def test_plan_retention(committed, unfinished, kw, plan):
    got = plan_retention(committed, unfinished, **kw)
    assert got == plan
    assert got.empty == (not plan.drop and not plan.stale)
    assert list(got.drop) == retention.steps_to_delete(committed, **kw)
    assert list(got.stale) == retention.stale_leftovers(committed, unfinished)
    assert set(got.drop) | set(got.kept) == set(committed) and not set(got.drop) & set(got.kept)


def test_retention_plan_is_frozen():
    plan = plan_retention([1, 2], [], keep_last=1, keep_every=None)
    with pytest.raises(AttributeError):
        plan.drop = ()  # type: ignore[misc]


def test_stray_files_keep_what_any_manifest_names():
    present = [
        "manifest.json", "model.safetensors.index.json", "model-00001.safetensors", "data/own.safetensors",
        "data/replaced.safetensors", "data/referenced.safetensors", "data/.x.tmp", ".manifest.json.tmp",
        "data/notes.txt", "data/idx-r00000.json",
    ]
    live = {("step-00000001", "data/referenced.safetensors"), ("step-00000002", "data/replaced.safetensors")}
    got = retention.stray_files("step-00000001", present, ["data/own.safetensors", "data/idx-r00000.json"], live)
    # unlisted data (a crashed force save) and temporary files go; a file a later step references stays
    assert got == ["data/replaced.safetensors", "data/.x.tmp", ".manifest.json.tmp"]
    assert retention.stray_files("step-00000001", ["data/own.safetensors"], ["data/own.safetensors"], set()) == []


# --------------------------------------------------------------------------
# retention: I/O on a real root


def _step(root, step: int, *, value: float = 1.0) -> None:
    shardckpt.save({"w": torch.full((4, 3), value), "step": step}, str(root / step_dir_name(step)))


def _files(root) -> list:
    return sorted(os.path.relpath(os.path.join(d, f), root) for d, _, fs in os.walk(root) for f in fs)


def test_scan_tells_committed_from_unfinished(tmp_path):
    for s in (1, 3):
        _step(tmp_path, s)
    (tmp_path / step_dir_name(2) / "data").mkdir(parents=True)  # a save that never committed
    (tmp_path / "notes").mkdir()
    (tmp_path / "step-00000003-hf").mkdir()
    assert retention.scan(Storage(str(tmp_path))) == ([1, 3], [(2, "step-00000002")])


def test_uncommit_then_clear_keeps_files_a_kept_step_names(tmp_path):
    root = Storage(str(tmp_path))
    _step(tmp_path, 1)
    _step(tmp_path, 2)
    name = step_dir_name(1)
    own = [f for f in _files(tmp_path / name) if f.endswith(".safetensors")]
    retention.uncommit(root, name)
    retention.uncommit(root, name)  # gone already: nothing to do
    assert retention.scan(root)[0] == [2]
    # Pretend step 2 references step 1's data file: it must survive the clear.
    live = {(name, own[0])}
    removed = retention.clear_dir(root, name, live)
    assert removed and all(r.startswith(name + "/") for r in removed) and f"{name}/{own[0]}" not in removed
    assert os.path.exists(tmp_path / name / own[0])
    # Unknown liveness (a kept manifest unreadable): a directory with data stays whole.
    assert retention.clear_dir(root, name, None) == []
    # Nothing live: the directory goes (moved aside first on a local disk), and nothing is left aside.
    assert retention.clear_dir(root, name, set(), dry_run=True) == [name]
    assert os.path.isdir(tmp_path / name)
    assert retention.clear_dir(root, name, set()) == [name]
    assert sorted(os.listdir(tmp_path)) == [step_dir_name(2)]
    retention.clear_dir(root, "step-00000009")  # no such directory: nothing happens
    assert sorted(os.listdir(tmp_path)) == [step_dir_name(2)]


def test_live_files_of_reads_kept_manifests_and_says_unknown(tmp_path, caplog):
    root = Storage(str(tmp_path))
    _step(tmp_path, 1)
    _step(tmp_path, 2)
    live = retention.live_files_of(root, [1, 2, 7])  # 7: deleted since the scan, names nothing
    assert live is not None and {d for d, _ in live} == {step_dir_name(1), step_dir_name(2)}
    (tmp_path / step_dir_name(2) / "manifest.json").write_text("{ torn")
    with caplog.at_level(logging.WARNING, logger="shardckpt"):
        assert retention.live_files_of(root, [1, 2]) is None
    assert "kept this time" in caplog.text
    assert retention.referenced_files(root, 1) is None  # step 2 unreadable: keep every replaced file


def test_remove_leftover_puts_back_a_step_committed_meanwhile(tmp_path):
    root = Storage(str(tmp_path))
    _step(tmp_path, 4)
    retention.remove_leftover(root, step_dir_name(4))  # it has a manifest: moved aside, found committed, put back
    assert retention.scan(root)[0] == [4] and sorted(os.listdir(tmp_path)) == [step_dir_name(4)]
    retention.remove_leftover(root, step_dir_name(5))  # gone already
    retention.uncommit(root, step_dir_name(4))
    retention.remove_leftover(root, step_dir_name(4))
    assert os.listdir(tmp_path) == []


def test_collect_garbage_removes_only_leftovers(tmp_path):
    root = Storage(str(tmp_path))
    for s in (1, 3):
        _step(tmp_path, s)
    (tmp_path / step_dir_name(2) / "data").mkdir(parents=True)
    (tmp_path / step_dir_name(2) / "data" / "x.safetensors").write_bytes(b"partial")
    (tmp_path / step_dir_name(5)).mkdir()  # newer than every committed step: maybe a save in flight
    aside = f"{retention.ASIDE_PREFIX}{step_dir_name(0)}-{uuid.uuid4().hex[:12]}"
    (tmp_path / aside).mkdir()
    stray = tmp_path / step_dir_name(3) / "data" / "crashed-r00000-00.safetensors"
    stray.write_bytes(b"x")
    (tmp_path / step_dir_name(1) / ".manifest.json.tmp").write_bytes(b"x")
    before = _files(tmp_path)
    expected = sorted([aside, step_dir_name(2), f"{step_dir_name(3)}/data/{stray.name}", f"{step_dir_name(1)}/.manifest.json.tmp"])
    assert retention.collect_garbage(root, dry_run=True) == expected
    assert _files(tmp_path) == before
    assert retention.collect_garbage(root) == expected
    assert sorted(os.listdir(tmp_path)) == [step_dir_name(1), step_dir_name(3), step_dir_name(5)]
    assert retention.collect_garbage(root) == []
    for s in (1, 3):
        shardckpt.verify(str(tmp_path / step_dir_name(s)))


# --------------------------------------------------------------------------
# restore order: fake inventories


def _validator(damage: dict):
    """A ``validate`` that raises ``damage[step]`` (an exception) for the steps listed, records every call."""
    seen = []

    def validate(step: int) -> None:
        seen.append(step)
        if step in damage:
            raise damage[step]

    validate.seen = seen  # type: ignore[attr-defined]
    return validate


def _choose(committed, step=None, damage=None, **kw):
    v = _validator(damage or {})
    return restore.choose_step(committed, step, v, root_url="mem://run", step_url=lambda s: f"mem://run/{s}", **kw), v.seen


def test_choose_newest_undamaged_step():
    assert _choose([1, 2, 3]) == (3, [3])
    damage = {3: CorruptCheckpointError("torn"), 2: FileNotFoundError(errno.ENOENT, "gone"),
              1: OSError(errno.EISDIR, "manifest is a directory")}
    assert _choose([0, 1, 2, 3], damage=damage) == (0, [3, 2, 1, 0])
    assert _choose([1, 2], damage={2: ValueError("bad json")}) == (1, [2, 1])
    assert _choose([]) == (None, [])


def test_choose_every_step_damaged(caplog):
    damage = {1: CorruptCheckpointError("a"), 2: CheckpointNotFoundError("b")}
    with caplog.at_level(logging.WARNING, logger="shardckpt"):
        assert _choose([1, 2], damage=damage) == (None, [2, 1])
    assert "skipping step 2" in caplog.text and "skipping step 1" in caplog.text
    # A run started from initial weights never silently starts over.
    with pytest.raises(CorruptCheckpointError, match=r"initial_load_path='hf://w'.*step 2: CheckpointNotFoundError"):
        _choose([1, 2], damage=damage, initial_load_path="hf://w")
    assert _choose([], initial_load_path="hf://w") == (None, [])  # nothing committed: a fresh run


def test_choose_stops_on_what_is_not_damage():
    with pytest.raises(NewerFormatError, match=r"step 3 under mem://run .*restore\(state, step=N\)"):
        _choose([1, 2, 3], damage={3: NewerFormatError("format 9")})
    with pytest.raises(StorageError, match="cannot read step 3 under mem://run: PermissionError"):
        _choose([1, 2, 3], damage={3: PermissionError(errno.EACCES, "denied")})
    with pytest.raises(LoadFailedError, match="rank 1 died"):  # our own type, not damage: raised as it is
        _choose([1, 2, 3], damage={3: LoadFailedError("rank 1 died")})


def test_choose_a_given_step():
    assert _choose([1, 2, 3], step=2) == (2, [2])
    with pytest.raises(CheckpointNotFoundError, match=r"step 5 is not committed at mem://run/5; committed steps: .*1.*3"):
        _choose([1, 3], step=5)
    with pytest.raises(CheckpointNotFoundError, match="no step is committed there"):
        _choose([], step=5)
    with pytest.raises(CorruptCheckpointError):  # asked for by number: never another one instead
        _choose([1, 2], step=2, damage={2: CorruptCheckpointError("torn")})


@pytest.mark.parametrize(
    "e, damage",
    [
        (CorruptCheckpointError("x"), True), (CheckpointNotFoundError("x"), True), (StorageError("x"), False),
        (FileNotFoundError(), True), (NotADirectoryError(), True),
        (OSError(errno.ENAMETOOLONG, "long"), True), (OSError(errno.EIO, "io"), False),
        (PermissionError(errno.EACCES, "no"), False), (KeyError("k"), True), (UnicodeDecodeError("utf-8", b"\xff", 0, 1, "x"), True),
        (RuntimeError("x"), False),
    ],
)
def test_is_damage(e, damage):
    assert restore.is_damage(e) is damage


def test_pick_again_only_for_a_step_deleted_meanwhile():
    assert [restore.pick_again(gone=True, step_given=False, attempt=a) for a in range(restore.RESTORE_ATTEMPTS)] == [True] * (
        restore.RESTORE_ATTEMPTS - 1) + [False]
    assert not restore.pick_again(gone=False, step_given=False, attempt=0)
    assert not restore.pick_again(gone=True, step_given=True, attempt=0)


def test_initial_target():
    state = {"model": torch.nn.Linear(2, 2), "optim": {}}
    assert restore.initial_target(state, model_only=False) is state
    assert restore.initial_target(state, model_only=True) == {"model": state["model"]}
    with pytest.raises(UsageError, match=r"no 'model' entry \(it has .*optim"):
        restore.initial_target({"optim": {}}, model_only=True)


def test_validate_step_on_storage(tmp_path):
    root = Storage(str(tmp_path))
    _step(tmp_path, 1)
    restore.validate_step(root, 1)
    # A directory renamed by hand holds another step's state.
    mgr = shardckpt.CheckpointManager(str(tmp_path / "m"))
    mgr.save(6, {"w": torch.ones(2)})
    os.rename(tmp_path / "m" / step_dir_name(6), tmp_path / "m" / step_dir_name(8))
    with pytest.raises(CorruptCheckpointError, match="holds the checkpoint of step 6"):
        restore.validate_step(Storage(str(tmp_path / "m")), 8)
    # A missing data file: damage with files=True, unseen without.
    data = [f for f in _files(tmp_path / step_dir_name(1)) if f.endswith(".safetensors")]
    os.remove(tmp_path / step_dir_name(1) / data[0])
    restore.validate_step(root, 1, files=False)
    with pytest.raises(Exception) as info:
        restore.validate_step(root, 1)
    assert restore.is_damage(info.value)


def test_say_why_empty_warns_only_for_a_missing_root(tmp_path, caplog):
    calls = []

    def nearby(st):
        calls.append(st.url)
        return " (did you mean x?)"

    with caplog.at_level(logging.WARNING, logger="shardckpt"):
        restore.say_why_empty(Storage(str(tmp_path)), nearby=nearby)
        assert not caplog.text and not calls
        restore.say_why_empty(Storage(str(tmp_path / "typo")), nearby=nearby)
    assert "does not exist" in caplog.text and "(did you mean x?)" in caplog.text and len(calls) == 1


# --------------------------------------------------------------------------
# owners, memory glue, exports


def test_owners():
    assert owners.not_ours([1, 2, 3, 4], known={1, 2}, saved_here={3}) == [4]
    assert owners.not_ours([4, 1], known=()) == [1, 4]
    root = f"mem://owners-{uuid.uuid4().hex}"
    assert owners.saved_in_process(root) == frozenset() and not owners.taken_over(root, "a")
    owners.record_save(root, "a", 1)
    assert not owners.taken_over(root, "a") and owners.taken_over(root, "b")
    owners.record_save(root, "b", 2)
    assert owners.saved_in_process(root) == {1, 2} and owners.taken_over(root, "a")
    assert isinstance(owners.refuse_taken_over(3, root), ConcurrentUseError)
    e = owners.refuse_foreign(3, root, [7, 9])
    assert isinstance(e, ConcurrentUseError) and "7" in str(e) and root in str(e)


def test_memory_glue_off():
    assert memory.open_memory(None, "/r") is None and memory.open_memory(False, "/r") is None
    assert memory.save_to_memory(None, 1, {}, comm=None) is False  # type: ignore[arg-type]
    with pytest.raises(UsageError, match="options are dir"):
        memory.open_memory({"nope": 1}, "/r")


def test_memory_glue_opens_a_tier(tmp_path):
    store = memory.open_memory({"dir": str(tmp_path / "shm")}, "/some/root")
    assert store is not None and store.dir == str(tmp_path / "shm")


def test_model_only_state_casts_once_per_tied_tensor():
    lin = torch.nn.Linear(3, 3)
    sd = {"a": lin.weight, "tied": lin.weight, "b": lin.bias, "n": torch.arange(3), "v": 7}
    out = exports.model_only_state({"model": sd, "optim": {}}, exports.parse_export_dtype(torch.bfloat16))
    assert list(out) == ["a", "b", "n", "v"]  # the tie kept under its first name, as save_pretrained
    assert out["a"].dtype == torch.bfloat16 and out["n"].dtype == torch.int64 and out["v"] == 7
    mod_out = exports.model_only_state({"model": lin}, "BF16")
    assert set(mod_out) == {"weight", "bias"} and mod_out["weight"].dtype == torch.bfloat16
    assert exports.model_only_state({"model": sd}, None) is sd
    assert exports.parse_export_dtype(None) is None and exports.parse_export_dtype("bf16") == "BF16"
    with pytest.raises(UsageError, match="no 'model' entry"):
        exports.model_only_state({"optim": {}}, None)
    with pytest.raises(UsageError, match="module or a dict"):
        exports.model_only_state({"model": [1]}, "BF16")
