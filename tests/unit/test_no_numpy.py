"""Single-process paths never need NumPy (byte views fall back to ctypes when torch has none)."""

import subprocess
import sys
import textwrap

SCRIPT = textwrap.dedent(
    """
    import sys
    sys.modules["numpy"] = None  # as if NumPy were not installed
    import warnings
    warnings.simplefilter("ignore")
    import torch
    try:
        torch.zeros(1).numpy()
        raise SystemExit("numpy still reachable")
    except RuntimeError:
        pass
    import shardckpt
    from shardckpt import converters

    d = sys.argv[1]
    model = torch.nn.Linear(5, 3)
    opt = torch.optim.AdamW(model.parameters())
    model(torch.randn(2, 5)).sum().backward()
    opt.step()
    state = {"model": model, "optim": opt, "step": 3, "x": torch.tensor(2.5).bfloat16()}
    shardckpt.save(state, d + "/ck")
    shardckpt.verify(d + "/ck")
    model2 = torch.nn.Linear(5, 3)
    opt2 = torch.optim.AdamW(model2.parameters())
    state2 = {"model": model2, "optim": opt2, "step": 0, "x": torch.tensor(0.0).bfloat16()}
    shardckpt.load(state2, d + "/ck")
    assert state2["step"] == 3 and state2["x"].item() == 2.5
    assert all(torch.equal(a, b) for a, b in zip(model.state_dict().values(), model2.state_dict().values()))
    mgr = shardckpt.CheckpointManager(d + "/run", async_save=True)
    mgr.save(1, state)
    mgr.wait()
    converters.to_safetensors(d + "/ck", d + "/hf")
    converters.to_full(d + "/ck", d + "/full.safetensors")
    print("OK")
    """
)


def test_save_load_convert_without_numpy(tmp_path):
    out = subprocess.run([sys.executable, "-c", SCRIPT, str(tmp_path)], capture_output=True, text=True, timeout=120)
    assert out.returncode == 0 and out.stdout.strip().endswith("OK"), out.stdout + out.stderr
