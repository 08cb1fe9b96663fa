"""The async writer child imports nothing from the current directory (issue 20).

``python -c`` puts the current directory first on ``sys.path``: a ``torch.py``
or ``shardckpt.py`` in a training job's working directory would run in the
child. A real process, its working directory holding such files.
"""

from __future__ import annotations

import os
import subprocess
import sys
import textwrap


def test_writer_child_does_not_import_from_the_working_directory(tmp_path):
    work = tmp_path / "work"
    work.mkdir()
    for mod in ("torch", "shardckpt", "safetensors"):
        (work / f"{mod}.py").write_text(
            f"open({str(tmp_path / 'RAN')!r} + '-{mod}', 'w').close()\nraise SystemExit('imported {mod}.py from the cwd')\n"
        )
    script = tmp_path / "train.py"  # outside the working directory: the parent imports the real packages
    script.write_text(textwrap.dedent(f"""
        import torch, shardckpt
        from shardckpt import _writerproc
        state = {{"w": torch.arange(1 << 16, dtype=torch.float32), "step": 1}}
        h = shardckpt.async_save(state, {str(tmp_path / 'ck')!r})
        h.result()
        assert _writerproc.current_writer() is not None and _writerproc.current_writer().pid is not None, "no writer child ran"
        live = {{"w": torch.zeros(1 << 16), "step": 0}}
        shardckpt.load(live, {str(tmp_path / 'ck')!r})
        assert torch.equal(live["w"], state["w"])
        print("OK")
    """))
    env = dict(os.environ, SHARDCKPT_ASYNC_WRITER="process", CUDA_VISIBLE_DEVICES="")
    # tests/conftest.py's PYTHONPATH ends in an empty entry (the current directory): not a user's setting.
    env.pop("PYTHONPATH", None)
    p = subprocess.run([sys.executable, str(script)], cwd=str(work), env=env, capture_output=True, text=True, timeout=300)
    assert p.returncode == 0 and "OK" in p.stdout, p.stdout + p.stderr
    assert not [n for n in os.listdir(tmp_path) if n.startswith("RAN")], "a module of the working directory ran"
