"""Every python/bash block of README.md and docs/ runs (tests/snippets.py): a snippet cannot drift from the code."""

import os
import textwrap

import pytest
import snippets

PAGES = [p for p in snippets.doc_files() if snippets.page_blocks(p)]


#: A ratchet, not a target: 9 of these need GPUs, run benchmarks or the test
#: suite itself, 2 install packages; the rest need a bucket, two hosts,
#: torchtitan or legacy Hub files, or are fragments of a trainer's script
#: (Lightning) whose whole run is a test. Lower it when a block becomes
#: runnable (the QLoRA recipe and the README's CPU-build line did: 26 -> 24).
MAX_SKIPPED = 24


def test_every_block_is_runnable_or_says_why_not():
    """Parsing every page checks the markers (a skip needs a reason); skips stay few."""
    blocks = [b for p in snippets.doc_files() for b in snippets.page_blocks(p)]
    skipped = [b for b in blocks if "skip" in b.options]
    assert len(blocks) > 40, "snippets not found"
    assert len(skipped) <= MAX_SKIPPED, [f"{b.where}: {b.options['skip']}" for b in skipped]


@pytest.mark.slow
@pytest.mark.parametrize("page", PAGES)
def test_page_snippets_run(page, tmp_path):
    skipped = snippets.run_page(page, str(tmp_path))
    for note in skipped:
        print("skipped", note)


def test_a_skip_without_reason_and_an_unknown_option_are_refused():
    with pytest.raises(ValueError, match="reason"):
        snippets.extract("<!-- snippet: skip -->\n```python\npass\n```\n", "x.md")
    with pytest.raises(ValueError, match="unknown snippet option"):
        snippets.extract("<!-- snippet: torchrn=2 -->\n```python\npass\n```\n", "x.md")


# docs/manager.md's memory-tier snippet as it stood before issue 31 (storage
# root made local): the loop restarts at the restored step and re-saves it, and
# `step % 500 == 0` saves step 0. The runner must catch it.
OLD_MANAGER_SNIPPET = '''
```python
mgr = shardckpt.CheckpointManager("run-42", keep_last=3,
                                  memory=shardckpt.MemoryTier(max_bytes=64 << 30))  # or memory=True
start = mgr.restore(state)            # newest step in memory (any node) or storage
for step in range(start or 0, total):
    train_step(...)
    mgr.save_to_memory(step, state)   # every step (or every few): shared memory + peer copy
    if step % 500 == 0:
        mgr.save(step, state)         # storage, on its own interval, as before
```
'''


def test_runner_fails_on_the_old_manager_snippet(tmp_path):
    (block,) = snippets.extract(OLD_MANAGER_SNIPPET, "old-manager.md")
    with pytest.raises(AssertionError, match="CheckpointExistsError") as e:
        snippets.run_block(block, str(tmp_path))
    assert "the resume" in str(e.value)
    assert sorted(os.listdir(tmp_path / "run-42")) == ["step-00000000"]  # what the old loop saved: step 0


def test_runner_runs_a_fixed_loop_twice(tmp_path):
    text = textwrap.dedent('''
        ```python
        mgr = shardckpt.CheckpointManager("run", save_interval=2)
        start = mgr.restore(state) or 0
        for step in range(start + 1, total + 1):
            train_step()
            if mgr.should_save(step):
                mgr.save(step, state)
        mgr.close()
        ```
    ''')
    (block,) = snippets.extract(text, "fixed.md")
    snippets.run_block(block, str(tmp_path))
    assert sorted(os.listdir(tmp_path / "run")) == ["step-00000002", "step-00000004", "step-00000006"]
