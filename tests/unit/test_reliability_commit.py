"""Nothing lost: the commit checks its files, never re-creates a vanished step, never lets retention eat the last good step.

Regression tests of issue 11 ("Data loss"): deterministic hooks between the
data writes and the commit, and a real race with a second process running
``cleanup()`` on the same root.
"""

from __future__ import annotations

import logging
import shutil
import subprocess
import sys
import textwrap
import time

import pytest
import torch

import shardckpt
from shardckpt import _save
from shardckpt._format import committed as _committed
from shardckpt._format.values import MAX_VALUE_DEPTH
from shardckpt._manager import step_dir_name
from shardckpt._storage import Storage
from shardckpt.errors import CheckpointError, CorruptCheckpointError, SaveFailedError, UnsupportedStateError

#: Saves the race test makes while another process cleans up (bounded: each is tiny).
RACE_SAVES = 25
#: Seconds the race test waits for its cleanup process to stop.
RACE_JOIN_S = 60


def _state(step: int):
    g = torch.Generator().manual_seed(step)
    return {"w": torch.randn(8, 5, generator=g), "b": torch.arange(7) * step, "step": step}


def _blank():
    return {"w": torch.zeros(8, 5), "b": torch.zeros(7, dtype=torch.int64), "step": -1}


def _same(a, b) -> bool:
    return torch.equal(a["w"], b["w"]) and torch.equal(a["b"], b["b"]) and a["step"] == b["step"]


@pytest.fixture
def vanish(monkeypatch):
    """``vanish(fn)``: run ``fn(storage)`` after every rank's data is written, before the commit."""

    def arm(fn):
        real = _save.write_files

        def write_files(storage, files, **kw):
            out = real(storage, files, **kw)
            fn(storage)
            return out

        monkeypatch.setattr(_save, "write_files", write_files)

    return arm


def test_commit_refuses_when_data_files_vanished_and_previous_step_survives(tmp_path, vanish):
    mgr = shardckpt.CheckpointManager(str(tmp_path), keep_last=1)
    mgr.save(1, _state(1))

    def drop_data(storage):
        for rel in storage.walk_files("data"):
            storage.remove(rel)

    vanish(drop_data)
    with pytest.raises(SaveFailedError, match="missing"):
        mgr.save(2, _state(2))
    # Retention never ran: the previous good step is still there and whole.
    assert mgr.steps() == [1]
    got = _blank()
    assert mgr.restore(got) == 1 and _same(got, _state(1))


def test_commit_never_recreates_a_removed_step_directory(tmp_path, vanish):
    mgr = shardckpt.CheckpointManager(str(tmp_path), keep_last=1)
    mgr.save(1, _state(1))
    vanish(lambda storage: shutil.rmtree(storage.root))
    with pytest.raises(SaveFailedError):
        mgr.save(2, _state(2))
    assert not (tmp_path / step_dir_name(2)).exists()
    assert mgr.steps() == [1]


def test_directory_removed_between_file_check_and_manifest_write_fails_the_commit(tmp_path, monkeypatch):
    # The narrowest window: the files were checked, then the directory went.
    real = _committed.check_files

    def check_then_remove(storage, expected):
        real(storage, expected)
        shutil.rmtree(storage.root)

    monkeypatch.setattr(_committed, "check_files", check_then_remove)
    with pytest.raises(SaveFailedError):
        shardckpt.save(_state(3), str(tmp_path / "ck"))
    assert not (tmp_path / "ck").exists()


def test_write_atomic_without_create_dirs_does_not_create_the_parent(tmp_path):
    st = Storage(str(tmp_path / "gone"))
    with pytest.raises(FileNotFoundError):
        st.write_atomic("manifest.json", b"{}", create_dirs=False)
    assert not (tmp_path / "gone").exists()
    st.write_atomic("manifest.json", b"{}")  # the default still creates parents
    assert (tmp_path / "gone" / "manifest.json").read_bytes() == b"{}"


def test_values_only_checkpoint_still_commits_into_a_new_directory(tmp_path):
    # No data file can vanish with the directory: the manifest may create it.
    shardckpt.save({"step": 4, "cfg": {"lr": 0.1}}, str(tmp_path / "vals"))
    got = {"step": 0, "cfg": {"lr": 0.0}}
    shardckpt.load(got, str(tmp_path / "vals"))
    assert got == {"step": 4, "cfg": {"lr": 0.1}}


def test_failed_manifest_write_leaves_no_hf_index_in_a_new_step(tmp_path, monkeypatch):
    real = Storage.write_atomic

    def failing(self, rel, data, **kw):
        if rel == "manifest.json":
            raise OSError(28, "No space left on device")
        return real(self, rel, data, **kw)

    monkeypatch.setattr(Storage, "write_atomic", failing)
    with pytest.raises(SaveFailedError, match="No space left"):
        shardckpt.save({"w": torch.ones(3)}, str(tmp_path / "new"))
    assert not (tmp_path / "new" / "model.safetensors.index.json").exists()
    assert not (tmp_path / "new" / "manifest.json").exists()


def test_failed_manifest_write_restores_the_replaced_steps_hf_index(tmp_path, monkeypatch):
    url = str(tmp_path / "ck")
    shardckpt.save({"w": torch.ones(3)}, url)
    index = (tmp_path / "ck" / "model.safetensors.index.json").read_bytes()
    real = Storage.write_atomic

    def failing(self, rel, data, **kw):
        if rel == "manifest.json":
            raise OSError(28, "No space left on device")
        return real(self, rel, data, **kw)

    monkeypatch.setattr(Storage, "write_atomic", failing)
    with pytest.raises(SaveFailedError):
        shardckpt.save({"w": torch.full((3,), 2.0)}, url, overwrite=True)
    monkeypatch.undo()
    assert (tmp_path / "ck" / "model.safetensors.index.json").read_bytes() == index
    got = {"w": torch.zeros(3)}
    shardckpt.load(got, url)
    assert torch.equal(got["w"], torch.ones(3))
    shardckpt.verify(url)


def test_values_nested_deeper_than_the_limit_are_refused_at_save(tmp_path):
    deep = 0
    for _ in range(MAX_VALUE_DEPTH + 5):
        deep = [deep]
    # Refused up front (issue 19), before any data file is written.
    with pytest.raises(UnsupportedStateError, match="nest more than"):
        shardckpt.save({"w": torch.ones(2), "deep": deep}, str(tmp_path / "deep"))
    assert not (tmp_path / "deep").exists() or not any((tmp_path / "deep").rglob("*.safetensors"))
    ok = 0
    for _ in range(MAX_VALUE_DEPTH - 5):
        ok = [ok]
    shardckpt.save({"deep": ok}, str(tmp_path / "ok"))
    got = {"deep": None}
    shardckpt.load(got, str(tmp_path / "ok"), strict=False)
    assert got["deep"] == ok


_CLEANER = textwrap.dedent(
    """
    import os, sys, time
    import shardckpt
    from shardckpt.errors import CheckpointError
    root, stop = sys.argv[1], sys.argv[2]
    mgr = shardckpt.CheckpointManager(root)
    rounds, bad = 0, []
    deadline = time.monotonic() + float(sys.argv[3])
    while True:
        try:
            mgr.cleanup()
        except CheckpointError:
            pass
        except BaseException as e:
            bad.append(f"{type(e).__name__}: {e}")
        rounds += 1
        if rounds == 1:
            open(stop + ".ready", "w").close()  # racing from now on
        if os.path.exists(stop) or time.monotonic() > deadline:
            break
    print(rounds, len(bad))
    for b in bad[:5]:
        print(b)
    """
)


def test_cleanup_in_another_process_racing_saves_never_loses_the_last_good_step(tmp_path):
    root = tmp_path / "run"
    root.mkdir()
    stop = tmp_path / "stop"
    mgr = shardckpt.CheckpointManager(str(root), keep_last=2)
    # A good step before the race: from here on there is always one to lose.
    mgr.save(0, _state(0))
    proc = subprocess.Popen(
        [sys.executable, "-c", _CLEANER, str(root), str(stop), str(RACE_JOIN_S)],
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
    )
    ready = tmp_path / "stop.ready"
    waited = 0.0
    while not ready.exists() and waited < RACE_JOIN_S and proc.poll() is None:
        time.sleep(0.05)
        waited += 0.05
    assert ready.exists(), proc.communicate(timeout=RACE_JOIN_S)
    good, failed, escaped = [0], 0, []
    try:
        for step in range(1, RACE_SAVES + 1):
            try:
                mgr.save(step, _state(step))
                good.append(step)
            except CheckpointError:
                failed += 1
            except BaseException as e:  # anything else is a defect: collect it, keep racing
                escaped.append(f"{type(e).__name__}: {e}")
            # Whatever happened, the newest successful save is restorable, bit-exact.
            got = _blank()
            assert mgr.restore(got) == good[-1], (step, good, mgr.steps())
            assert _same(got, _state(good[-1]))
    finally:
        stop.write_text("1")
        out, err = proc.communicate(timeout=RACE_JOIN_S)
    assert proc.returncode == 0, err
    rounds, cleaner_bad = out.split("\n", 1)[0].split()
    assert int(cleaner_bad) == 0, out
    assert not escaped, escaped
    assert int(rounds) > 0 and len(good) - 1 + failed == RACE_SAVES, (good, failed, rounds)


def test_restore_reports_damage_once_files_vanish_after_commit(tmp_path, caplog):
    # Files removed after a commit (an object lifecycle rule): restore skips the step.
    mgr = shardckpt.CheckpointManager(str(tmp_path))
    mgr.save(1, _state(1))
    mgr.save(2, _state(2))
    for f in (tmp_path / step_dir_name(2) / "data").iterdir():
        f.unlink()
    got = _blank()
    with caplog.at_level(logging.WARNING, logger="shardckpt"):
        assert mgr.restore(got) == 1
    assert _same(got, _state(1))
    assert "skipping step 2" in caplog.text and "missing" in caplog.text
    with pytest.raises(CorruptCheckpointError):
        mgr.restore(_blank(), step=2)


def test_a_top_level_tensor_named_metadata_is_refused_at_save(tmp_path):
    # It would replace the safetensors header's __metadata__ entry: no safetensors reader could open the file.
    with pytest.raises(shardckpt.UnsupportedStateError, match="__metadata__.*reserves"):
        shardckpt.save({"__metadata__": torch.ones(2), "w": torch.ones(3)}, str(tmp_path / "ck"))
    assert not (tmp_path / "ck" / "manifest.json").exists()
    # Nested under another key it is an ordinary name, and the files stay readable by safetensors.
    shardckpt.save({"m": {"__metadata__": torch.ones(2)}}, str(tmp_path / "ok"))
    from safetensors.torch import load_file

    files = [f for f in (tmp_path / "ok" / "data").iterdir() if f.suffix == ".safetensors"]  # v2 index files sit beside them
    assert torch.equal(load_file(str(files[0]))["m.__metadata__"], torch.ones(2))


def test_keys_selects_an_exact_name_holding_glob_characters(tmp_path):
    from shardckpt._hf import select_names

    names = ["layers[0].w", "layers0.w", "a*b", "axb", "q?", "qq"]
    # Exact names win over their glob reading; true globs still glob.
    assert select_names(names, ["layers[0].w"]) == ["layers[0].w"]
    assert select_names(names, ["a*b"]) == ["a*b"]
    assert select_names(names, ["q?"]) == ["q?"]
    assert select_names(names, ["layers*"]) == ["layers[0].w", "layers0.w"]
    url = str(tmp_path / "ck")
    shardckpt.save({"layers[0].w": torch.ones(2), "layers0.w": torch.full((2,), 2.0)}, url)
    got = {"layers[0].w": torch.zeros(2), "layers0.w": torch.zeros(2)}
    shardckpt.load(got, url, keys=["layers[0].w"], strict=False)
    assert torch.equal(got["layers[0].w"], torch.ones(2)) and not got["layers0.w"].any()


def test_async_save_whose_files_vanish_fails_and_retention_keeps_the_previous_step(tmp_path, vanish):
    mgr = shardckpt.CheckpointManager(str(tmp_path), keep_last=1, async_save=True)
    mgr.save(1, _state(1))
    mgr.wait()

    def drop_data(storage):
        for rel in storage.walk_files("data"):
            storage.remove(rel)

    vanish(drop_data)
    handle = mgr.save(2, _state(2))
    with pytest.raises(SaveFailedError, match="missing"):
        handle.result()
    assert mgr.steps() == [1]
    got = _blank()
    assert mgr.restore(got) == 1 and _same(got, _state(1))
    mgr.close()


def test_file_removed_while_the_manifest_is_written_takes_the_commit_back(tmp_path, monkeypatch):
    # Issue 42: the window after the commit's first check. A re-save (overwrite) over a good checkpoint: the
    # previous manifest is put back, the save fails naming the file, the previous checkpoint still loads.
    url = str(tmp_path / "ck")
    shardckpt.save(_state(1), url)
    real = Storage.write_atomic
    gone = []

    def remove_then_write(self, rel, data, **kw):
        if rel == "manifest.json" and not gone:
            victim = sorted(f for f in self.walk_files("data") if f.endswith(".safetensors") and f not in before)[0]
            self.remove(victim)
            gone.append(victim)
        return real(self, rel, data, **kw)

    before = set(Storage(url).walk_files("data"))
    monkeypatch.setattr(Storage, "write_atomic", remove_then_write)
    with pytest.raises(SaveFailedError, match=gone[0].split("/")[-1] if gone else "missing") as e:
        shardckpt.save(_state(2), url, overwrite=True)
    monkeypatch.undo()
    assert gone and gone[0].split("/")[-1] in str(e.value), e.value
    got = _blank()
    shardckpt.load(got, url)
    assert _same(got, _state(1))
    shardckpt.verify(url)


def test_commit_checks_referenced_files_in_their_sibling_directory(tmp_path):
    # The flusher's remote commit and an incremental save name files of an earlier step (@step-.../...):
    # one missing there means no commit (nothing written), whatever the step's own files say.
    root = tmp_path / "root"
    shardckpt.save(_state(1), str(root / "step-00000001"))
    m1 = shardckpt.inspect(str(root / "step-00000001"))
    files = {f"@step-00000001/{rel}": f.size for rel, f in m1.files.items()}
    step2 = Storage(str(root / "step-00000002"))
    step2.makedirs("")
    _committed.commit_bytes(step2, b'{"not": "read"}', files)  # every reference present: committed
    assert step2.exists("manifest.json")
    step2.remove("manifest.json")
    victim = sorted(rel for rel in m1.files if rel.endswith(".safetensors"))[0]
    (root / "step-00000001" / victim).unlink()
    with pytest.raises(CorruptCheckpointError, match=f"@step-00000001/{victim} is missing"):
        _committed.commit_bytes(step2, b'{"not": "read"}', files)
    assert not step2.exists("manifest.json")
