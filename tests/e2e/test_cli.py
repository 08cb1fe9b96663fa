"""The installed ``shardckpt`` console script: outputs and exit codes, as a user runs it."""

import json
import os
import subprocess
import sys

import _zygote
import pytest
import torch
from safetensors.torch import load_file

import shardckpt

BIN = os.path.join(os.path.dirname(sys.executable), "shardckpt")


def sh(*args, check=None, real=False):
    """The console script with ``args``: a process of its own, as a fork of a server that imported torch
    (tests/_zygote.py: ``python <script> args`` without the 2 s torch import each time), or with
    ``real=True`` the installed script itself through its shebang (a few tests here keep that)."""
    argv = [BIN, *map(str, args)]
    if real:
        p = subprocess.run(argv, capture_output=True, text=True, timeout=300)
    else:
        code, out, err = _zygote.run(argv, cwd=os.getcwd(), env=dict(os.environ), timeout=300)
        p = subprocess.CompletedProcess(argv, code, out, err)
    if check is not None:
        assert p.returncode == check, (args, p.returncode, p.stdout, p.stderr)
    return p


def _state(seed=0):
    g = torch.Generator().manual_seed(seed)
    return {
        "model": {"emb.weight": torch.randn(37, 7, generator=g), "ids": torch.arange(5), "mask": torch.tensor([True, False])},
        "step": 7,
    }


@pytest.fixture(scope="module")
def ck(tmp_path_factory):
    root = tmp_path_factory.mktemp("cli")
    shardckpt.save(_state(), str(root / "ck"))
    return root


def test_script_is_installed():
    assert os.path.exists(BIN), "pip install -e . installs the shardckpt console script"


def test_inspect_table_and_json(ck):
    p = sh("inspect", ck / "ck", check=0, real=True)
    lines = p.stdout.splitlines()
    assert "3 tensors" in lines[0] and "world size 1" in lines[0]
    assert lines[1].split() == ["name", "dtype", "shape", "chunks", "bytes"]
    row = next(l for l in lines if l.startswith("model.emb.weight"))
    assert row.split()[1:] == ["F32", "[37,", "7]", "1", str(37 * 7 * 4)]
    j = json.loads(sh("inspect", ck / "ck", "--json", check=0, real=True).stdout)
    assert j["tensors"]["model.ids"]["dtype"] == "I64" and j["total_bytes"] == 37 * 7 * 4 + 5 * 8 + 2
    assert j["values"]["step"] == 7


def test_verify_ok_then_damage_named(ck, tmp_path):
    p = sh("verify", ck / "ck", check=0, real=True)
    assert p.stdout.startswith("OK ") and "every checksum matches" in p.stdout
    bad = tmp_path / "bad"
    shardckpt.save(_state(), str(bad))
    c = shardckpt.inspect(str(bad)).tensors["model.emb.weight"].chunks[0]
    path = bad / c.file
    raw = bytearray(path.read_bytes())
    raw[c.byte_offset + 3] ^= 1
    path.write_bytes(bytes(raw))
    p = sh("verify", bad, check=1, real=True)
    assert c.file in p.stderr and "model.emb.weight" in p.stderr and "crc32c" in p.stderr
    assert "Traceback" not in p.stderr


def test_diff_same_and_different(ck, tmp_path):
    shardckpt.converters.reshard(str(ck / "ck"), str(tmp_path / "rs"), world_size=3)
    p = sh("diff", ck / "ck", tmp_path / "rs", check=0)
    assert p.stdout.strip().splitlines()[-1].startswith("same: 3 tensors identical")
    st = _state()
    st["model"]["emb.weight"][3, 4] += 0.5
    st["model"]["extra"] = torch.ones(1)
    del st["model"]["mask"]
    st["step"] = 8
    shardckpt.save(st, str(tmp_path / "other"))
    p = sh("diff", ck / "ck", tmp_path / "other", check=1)
    out = p.stdout
    assert "- model.mask" in out and "+ model.extra" in out
    assert "~ model.emb.weight: 1 of 259 elements differ, max |a-b| = 0.5" in out
    assert "~ value step: 7 -> 8" in out
    j = json.loads(sh("diff", ck / "ck", tmp_path / "other", "--json", check=1).stdout)
    assert j["same"] is False and j["changed"][0]["max_abs_diff"] == pytest.approx(0.5)


def test_export_convert_reshard(ck, tmp_path):
    p = sh("export", ck / "ck", tmp_path / "hf", "--max-shard-size", "500B", check=0)
    assert p.stdout.startswith("wrote ") and p.stderr == ""  # not a terminal: no progress bar
    files = sorted(os.listdir(tmp_path / "hf"))
    assert files[-1] == "model.safetensors.index.json" and len(files) >= 3
    got = {}
    for f in files[:-1]:
        got.update(load_file(str(tmp_path / "hf" / f)))
    ref = _state()["model"]
    assert set(got) == set(ref) and all(torch.equal(got[k], ref[k]) for k in ref)
    sh("convert", ck / "ck", tmp_path / "full.pt", "--dtype", "bf16", "-q", check=0)
    pt = torch.load(str(tmp_path / "full.pt"), weights_only=True)
    assert pt["model"]["emb.weight"].dtype == torch.bfloat16 and pt["model"]["ids"].dtype == torch.int64
    # --storage-option goes to fsspec (file:// with options takes the fsspec path).
    sh("reshard", f"file://{ck / 'ck'}", tmp_path / "rs", "--world-size", "2", "--storage-option", "auto_mkdir=true", "-q", check=0)
    m = shardckpt.inspect(str(tmp_path / "rs"))
    assert m.world_size == 2 and len(m.tensors["model.emb.weight"].chunks) == 2


def test_import_detects_sources(ck, tmp_path):
    import torch.distributed.checkpoint as dcp

    ref = _state()
    dcp.save(ref, checkpoint_id=str(tmp_path / "dcp"), no_dist=True)
    torch.save(ref["model"], str(tmp_path / "sd.pt"))
    shardckpt.converters.to_safetensors(str(ck / "ck"), str(tmp_path / "hf"))
    for src in ["dcp", "sd.pt", "hf"]:
        sh("import", tmp_path / src, tmp_path / f"n_{src}", "-q", check=0)
        live = {"model": {k: torch.zeros_like(v) for k, v in ref["model"].items()}}
        shardckpt.load(live, str(tmp_path / f"n_{src}"), strict=False)
        assert all(torch.equal(live["model"][k], ref["model"][k]) for k in ref["model"]), src
    assert shardckpt.inspect(str(tmp_path / "n_dcp")).values["step"] == 7


def test_errors_are_one_line_with_status_2(tmp_path):
    p = sh("inspect", tmp_path / "missing", check=2, real=True)
    assert p.stderr.startswith("shardckpt: error: no committed checkpoint") and p.stderr.count("\n") == 1
    assert "Traceback" not in p.stderr
    p = sh("export", tmp_path / "missing", tmp_path / "x", "--storage-option", "novalue", check=2, real=True)
    assert "key=value" in p.stderr
    p = sh("reshard", tmp_path, tmp_path / "y", check=2, real=True)  # argparse: --world-size is required
    assert "--world-size" in p.stderr
    p = subprocess.run([sys.executable, "-m", "shardckpt", "inspect", str(tmp_path / "missing")], capture_output=True, text=True)
    assert p.returncode == 2 and "no committed checkpoint" in p.stderr


# --------------------------------------------------------------------------
# --json, -q, wording


def test_every_command_takes_json(ck, tmp_path):
    j = json.loads(sh("verify", ck / "ck", "--json", check=0).stdout)
    assert j["ok"] is True and j["tensors"] == 3 and j["files"] == 1 and j["checksums"] is True
    j = json.loads(sh("export", ck / "ck", tmp_path / "hf", "--json", check=0).stdout)
    assert j["tensors"] == 3 and j["files"] == ["model.safetensors"] and j["bytes"] == 37 * 7 * 4 + 5 * 8 + 2
    j = json.loads(sh("reshard", ck / "ck", tmp_path / "rs", "--world-size", "2", "--json", check=0).stdout)
    assert j["tensors"] == 3 and len(j["files"]) == 2
    j = json.loads(sh("import", tmp_path / "hf", tmp_path / "back", "--json", check=0).stdout)
    assert j["tensors"] == 3 and j["url"] == str(tmp_path / "back")
    j = json.loads(sh("convert", ck / "ck", tmp_path / "full.safetensors", "--json", check=0).stdout)
    assert j["files"] == ["full.safetensors"]
    j = json.loads(sh("diff", ck / "ck", tmp_path / "rs", "--json", check=0).stdout)
    assert j["same"] is True and j["identical"] == 3
    j = json.loads(sh("inspect", tmp_path / "hf", "--json", check=0).stdout)
    assert j["source"] == "safetensors"


def test_quiet_prints_nothing(ck, tmp_path):
    for args in (
        ("verify", ck / "ck"),
        ("export", ck / "ck", tmp_path / "hf"),
        ("reshard", ck / "ck", tmp_path / "rs", "--world-size", "2"),
        ("import", tmp_path / "hf", tmp_path / "back"),
        ("diff", ck / "ck", tmp_path / "rs"),
    ):
        p = sh(*args, "-q", check=0)
        assert p.stdout == "" and p.stderr == "", args
    bad = tmp_path / "bad"
    shardckpt.save(_state(), str(bad))
    c = shardckpt.inspect(str(bad)).tensors["model.ids"].chunks[0]
    raw = bytearray((bad / c.file).read_bytes())
    raw[c.byte_offset] ^= 1
    (bad / c.file).write_bytes(bytes(raw))
    p = sh("verify", bad, "-q", check=1)  # the status says it
    assert p.stdout == "" and p.stderr == ""
    j = json.loads(sh("verify", bad, "--json", check=1).stdout)
    assert j["ok"] is False and j["error"] == "ChecksumMismatchError" and "model.ids" in j["message"]


def test_plurals_units_and_hf_wording(ck, tmp_path):
    shardckpt.save({"w": torch.ones(2)}, str(tmp_path / "one"))
    p = sh("verify", tmp_path / "one", check=0)
    assert "1 tensor, 1 chunk, 1 file, 8 B" in p.stdout
    p = sh("export", tmp_path / "one", tmp_path / "hf", check=0)
    assert "1 tensor, 1 file, 8 B in " in p.stdout and "GB/s" not in p.stdout  # a rate of 8 bytes says nothing
    first = sh("inspect", tmp_path / "hf", check=0).stdout.splitlines()[0]
    assert "Hugging Face safetensors" in first and "world size" not in first and "1 tensor," in first
    bad = tmp_path / "bad"
    shardckpt.save({"w": torch.ones(2)}, str(bad))
    c = shardckpt.inspect(str(bad)).tensors["w"].chunks[0]
    raw = bytearray((bad / c.file).read_bytes())
    raw[c.byte_offset] ^= 1
    (bad / c.file).write_bytes(bytes(raw))
    assert "(1 problem)" in sh("verify", bad, check=1).stderr


def test_overwrite_advice_names_the_flag(ck, tmp_path):
    sh("reshard", ck / "ck", tmp_path / "rs", "--world-size", "2", "-q", check=0)
    p = sh("reshard", ck / "ck", tmp_path / "rs", "--world-size", "2", check=2)
    assert "--overwrite" in p.stderr and "overwrite=True" not in p.stderr
    p = sh("export", ck / "ck", tmp_path / "rs", check=2)
    assert "--overwrite" in p.stderr and "overwrite=True" not in p.stderr
    sh("reshard", ck / "ck", tmp_path / "rs", "--world-size", "3", "--overwrite", "-q", check=0)
    assert shardckpt.verify(str(tmp_path / "rs")).world_size == 3


def test_inspect_values_leaves_tensor_references_out(ck):
    out = sh("inspect", ck / "ck", "--values", check=0).stdout
    assert '"step": 7' in out and "__shardckpt__" not in out and '"tensor"' not in out
    j = json.loads(sh("inspect", ck / "ck", "--values", "--json", check=0).stdout)
    assert j["plain_values"] == {"step": 7}


def test_diff_json_is_objects(ck, tmp_path):
    st = _state()
    st["model"]["emb.weight"][0, 0] += 1.0
    st["model"]["ids"] = torch.arange(6)
    st["step"] = 9
    st["note"] = "x"
    shardckpt.save(st, str(tmp_path / "other"))
    j = json.loads(sh("diff", ck / "ck", tmp_path / "other", "--json", check=1).stdout)
    by = {c["name"]: c for c in j["changed"]}
    assert by["model.emb.weight"]["what"] == "values" and by["model.emb.weight"]["differing"] == 1
    assert by["model.ids"]["what"] == "shape" and by["model.ids"]["a"] == [5] and by["model.ids"]["b"] == [6]
    vals = {v["path"]: v for v in j["value_changes"]}
    assert vals["step"] == {"path": "step", "what": "changed", "a": 7, "b": 9}
    assert vals["note"] == {"path": "note", "what": "only_in_b", "b": "x"}
    text = sh("diff", ck / "ck", tmp_path / "other", check=1).stdout
    assert "2 values differ" in text and "~ value step: 7 -> 9" in text


def test_not_found_through_the_script(tmp_path):
    (tmp_path / "run" / "step-00000004").mkdir(parents=True)
    p = sh("verify", tmp_path / "run", check=2, real=True)
    assert "step-00000004" in p.stderr and "CheckpointManager" in p.stderr
    torch.save({"w": torch.ones(1)}, str(tmp_path / "w.pt"))
    p = sh("inspect", tmp_path / "w.pt", check=2, real=True)
    assert "from_torch_save" in p.stderr and "NotADirectoryError" not in p.stderr


def test_export_copy_from_makes_a_from_pretrained_directory(tmp_path):
    """``export --copy-from``: config, generation config and tokenizer beside the weights; ``from_pretrained`` loads it."""
    from tokenizers import Tokenizer
    from tokenizers.models import WordLevel
    from transformers import AutoModelForCausalLM, AutoTokenizer, GenerationConfig, LlamaConfig, PreTrainedTokenizerFast

    config = LlamaConfig(vocab_size=64, hidden_size=16, intermediate_size=32, num_hidden_layers=2, num_attention_heads=2,
                         num_key_value_heads=1, max_position_embeddings=32, tie_word_embeddings=False)
    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_config(config).eval()
    hub = tmp_path / "hub"
    config.save_pretrained(hub)
    GenerationConfig(max_new_tokens=3, do_sample=False).save_pretrained(hub)
    tok = Tokenizer(WordLevel({**{f"w{i}": i for i in range(62)}, "<unk>": 62, "</s>": 63}, unk_token="<unk>"))
    PreTrainedTokenizerFast(tokenizer_object=tok, unk_token="<unk>", eos_token="</s>").save_pretrained(hub)
    shardckpt.save({"model": model, "step": 3}, str(tmp_path / "ck"))

    out = tmp_path / "hf"
    p = sh("export", tmp_path / "ck", out, "--copy-from", hub, check=0)
    assert p.stdout.startswith(f"wrote {out}"), p.stdout
    for name in ("config.json", "generation_config.json", "tokenizer.json", "tokenizer_config.json", "model.safetensors"):
        assert (out / name).exists(), name
    assert (out / "config.json").read_bytes() == (hub / "config.json").read_bytes()
    loaded = AutoModelForCausalLM.from_pretrained(out, dtype=torch.float32).eval()
    ids = torch.tensor([[1, 5, 63, 0, 7]])
    with torch.no_grad():
        want = model(ids).logits
        got = loaded(ids).logits
    assert torch.equal(got, want)
    assert AutoTokenizer.from_pretrained(out)("w1 w5")["input_ids"] == AutoTokenizer.from_pretrained(hub)("w1 w5")["input_ids"]

    # Without it, the directory holds weights only; --copy-from is refused where it cannot apply.
    sh("export", tmp_path / "ck", tmp_path / "bare", check=0)
    assert not (tmp_path / "bare" / "config.json").exists()
    bad = sh("export", tmp_path / "ck", tmp_path / "one.safetensors", "--copy-from", hub, check=2)
    assert "--copy-from" in bad.stderr and "--to full" in bad.stderr
    bad = sh("export", tmp_path / "ck", tmp_path / "r", "--world-size", "2", "--copy-from", hub, check=2)
    assert "--copy-from" in bad.stderr
    empty = tmp_path / "empty"
    empty.mkdir()
    bad = sh("export", tmp_path / "ck", tmp_path / "e", "--copy-from", empty, check=2)
    assert "config.json" in bad.stderr
