"""Hugging Face transformers / accelerate / DCP / torchtitan users, with the real libraries.

Tiny models are built from configs in the test (never downloaded): Llama
(untied embeddings), Qwen2 and GPT-2 (tied). One 2-rank gloo call trains
each under FSDP2 for a step and saves it with shardckpt and with DCP; the
parent converts as a user would offline and loads with transformers,
accelerate and shardckpt; a second 2-rank call loads the imports into FSDP2.
Logits are compared bit for bit with a reference model holding the saved
weights.

Tied models (GPT-2, Qwen2): ``save_pretrained`` omits ``lm_head.weight``,
and so do shardckpt's checkpoints and exports (the tied head is an alias of
the embedding); a strict load of such a directory fills both names.
"""

from __future__ import annotations

import json
import os

import pytest
import torch
from _dist import run_ranks

import shardckpt
from shardckpt import converters

FAMILIES = ("llama", "qwen2", "gpt2")
TIED = {"llama": False, "qwen2": True, "gpt2": True}
IDS = torch.tensor([[1, 5, 63, 0, 7, 7], [2, 30, 41, 12, 9, 3]])


def make_config(family: str):
    from transformers import GPT2Config, LlamaConfig, Qwen2Config

    small = dict(vocab_size=64, hidden_size=16, intermediate_size=32, num_hidden_layers=2, num_attention_heads=2,
                 num_key_value_heads=1, max_position_embeddings=32)
    if family == "llama":
        return LlamaConfig(tie_word_embeddings=False, **small)
    if family == "qwen2":
        return Qwen2Config(tie_word_embeddings=True, **small)
    return GPT2Config(vocab_size=64, n_embd=16, n_layer=2, n_head=2, n_positions=32, bos_token_id=0, eos_token_id=0)


def make_model(family: str, seed: int):
    from transformers import AutoModelForCausalLM

    torch.manual_seed(seed)
    model = AutoModelForCausalLM.from_config(make_config(family))
    model.eval()  # no dropout: logits are deterministic
    return model


def _layers(model):
    return model.transformer.h if hasattr(model, "transformer") else model.model.layers


def shard(model):
    from torch.distributed.fsdp import fully_shard

    for layer in _layers(model):
        fully_shard(layer)
    fully_shard(model)
    return model


def full_state(model) -> dict:
    out = {}
    for k, v in model.state_dict().items():
        if hasattr(v, "full_tensor"):
            v = v.full_tensor()
        out[k] = v.detach().cpu().clone()
    return out


def logits(model) -> torch.Tensor:
    with torch.no_grad():
        return model(input_ids=IDS).logits.detach().cpu().float()


def reference(family: str, state: dict):
    """A model holding exactly ``state`` (plain ``load_state_dict``), and its logits."""
    model = make_model(family, seed=99)
    model.load_state_dict(state)
    return model, logits(model)


def assert_bits_equal(a: torch.Tensor, b: torch.Tensor, what: str = "") -> None:
    assert a.dtype == b.dtype and a.shape == b.shape, what
    assert torch.equal(a.reshape(-1).view(torch.uint8), b.reshape(-1).view(torch.uint8)), what


def _train_and_save(rank, world, root):
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.state_dict import StateDictOptions, get_model_state_dict, get_optimizer_state_dict

    out = {}
    for fam in FAMILIES:
        model = shard(make_model(fam, seed=1))
        model.train()
        opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
        model(input_ids=IDS, labels=IDS).loss.backward()
        opt.step()
        opt.zero_grad()
        model.eval()
        shardckpt.save({"model": model, "optim": opt, "step": 1}, f"{root}/{fam}/native")
        # The DCP recipe (torch's docs): get_model_state_dict under "model".
        dcp.save({"model": get_model_state_dict(model)}, checkpoint_id=f"{root}/{fam}/dcp")
        # torchtitan's layout: model keys at the top, the optimizer flattened.
        tt = dict(get_model_state_dict(model))
        tt["optimizer"] = get_optimizer_state_dict(model, opt, options=StateDictOptions(flatten_optimizer_state_dict=True))
        tt["train_state"] = {"step": torch.tensor(1, dtype=torch.int32)}
        dcp.save(tt, checkpoint_id=f"{root}/{fam}/titan")
        out[fam] = full_state(model)
    return out


def _load_fsdp2(rank, world, jobs):
    """Load each ``(family, url, strict)`` into a fresh FSDP2 model; full state, logits, missing keys."""
    out = {}
    for fam, url, strict in jobs:
        model = shard(make_model(fam, seed=2))
        res = shardckpt.load({"model": model}, url, strict=strict)
        out[(fam, url)] = (full_state(model), logits(model), res.missing_keys)
    return out


@pytest.fixture(scope="module")
def saved(tmp_path_factory):
    root = str(tmp_path_factory.mktemp("interop"))
    states = run_ranks(2, _train_and_save, root)[0]
    return root, states


def _hub_files(path: str, family: str) -> dict:
    """What a Hub model directory holds besides weights: config, generation config, a real tokenizer."""
    from tokenizers import Tokenizer
    from tokenizers.models import WordLevel
    from tokenizers.pre_tokenizers import Whitespace
    from transformers import GenerationConfig, PreTrainedTokenizerFast

    os.makedirs(path, exist_ok=True)
    make_config(family).save_pretrained(path)
    GenerationConfig(max_new_tokens=3, do_sample=False).save_pretrained(path)
    vocab = {f"w{i}": i for i in range(62)}
    vocab.update({"<unk>": 62, "</s>": 63})
    tok = Tokenizer(WordLevel(vocab, unk_token="<unk>"))
    tok.pre_tokenizer = Whitespace()
    PreTrainedTokenizerFast(tokenizer_object=tok, unk_token="<unk>", eos_token="</s>").save_pretrained(path)
    return {n: open(os.path.join(path, n), "rb").read() for n in os.listdir(path)}


@pytest.mark.parametrize("family", FAMILIES)
def test_fsdp2_checkpoint_exports_to_from_pretrained_and_accelerate(saved, tmp_path, family):
    from accelerate import load_checkpoint_in_model
    from transformers import AutoModelForCausalLM, AutoTokenizer

    root, states = saved
    state = states[family]
    _, want = reference(family, state)
    hub = _hub_files(str(tmp_path / "hub"), family)
    assert {"config.json", "generation_config.json", "tokenizer.json", "tokenizer_config.json"} <= set(hub)
    export = str(tmp_path / "export")
    # The native checkpoint also holds the optimizer: only the model's weights go out.
    r = converters.to_safetensors(f"{root}/{family}/native", export, copy_from=str(tmp_path / "hub"), max_shard_size="20KB")
    assert "model.safetensors.index.json" in r.files
    index = json.load(open(os.path.join(export, "model.safetensors.index.json")))
    # Bare HF names, no optimizer moments; a tied head is written once, as save_pretrained does.
    assert set(index["weight_map"]) == set(state) - ({"lm_head.weight"} if TIED[family] else set())
    for name, data in hub.items():
        assert open(os.path.join(export, name), "rb").read() == data, name

    model = AutoModelForCausalLM.from_pretrained(export)
    assert type(model).__name__ == type(make_model(family, 0)).__name__
    assert_bits_equal(logits(model), want, "from_pretrained")
    # The tokenizer loads from the export as from the Hub directory (the files came along).
    text = "w1 w5 w9 </s>"
    hub_tok = AutoTokenizer.from_pretrained(str(tmp_path / "hub"))
    tok = AutoTokenizer.from_pretrained(export)
    assert type(tok) is type(hub_tok) and tok(text)["input_ids"] == hub_tok(text)["input_ids"]

    acc = make_model(family, seed=3)
    load_checkpoint_in_model(acc, export)
    assert_bits_equal(logits(acc), want, "accelerate.load_checkpoint_in_model")

    # Re-export into the published directory (config, tokenizer, a README
    # there): weights replaced, everything else kept byte for byte.
    with open(os.path.join(export, "README.md"), "w") as f:
        f.write("# tiny\n")
    converters.to_safetensors(f"{root}/{family}/native", export, overwrite=True)
    assert sorted(os.listdir(export)) == sorted(set(hub) | {"README.md", "model.safetensors"})
    assert_bits_equal(logits(AutoModelForCausalLM.from_pretrained(export)), want, "re-export")


@pytest.mark.parametrize("family", FAMILIES)
def test_dcp_recipe_torchtitan_and_torch_save_import_and_load(saved, tmp_path, family):
    root, states = saved
    state = states[family]
    _, want = reference(family, state)
    converters.from_dcp(f"{root}/{family}/dcp", str(tmp_path / "from_dcp"))
    converters.from_dcp(f"{root}/{family}/titan", str(tmp_path / "from_titan"))
    torch.save(state, str(tmp_path / "sd.pt"))  # a bare state dict, both tied names as state_dict() gives them
    converters.from_torch_save(str(tmp_path / "sd.pt"), str(tmp_path / "from_pt"))
    for tag in ("from_dcp", "from_titan", "from_pt"):
        model = make_model(family, seed=4)
        res = shardckpt.load({"model": model}, str(tmp_path / tag))
        assert res.missing_keys == [], (tag, res.missing_keys)
        assert_bits_equal(logits(model), want, tag)
    # torchtitan's optimizer comes back under shardckpt's "optim".
    model = make_model(family, seed=5)
    opt = torch.optim.AdamW(model.parameters(), lr=0.5)
    shardckpt.load({"model": model, "optim": opt}, str(tmp_path / "from_titan"))
    assert opt.param_groups[0]["lr"] == 1e-2
    st = opt.state_dict()["state"]
    assert len(st) == len(list(model.parameters())) and all(float(s["step"]) == 1.0 for s in st.values())


def _legacy_bin_dir(path: str, state: dict, nshards: int = 3) -> None:
    """``pytorch_model-0000K-of-0000N.bin`` + index, as transformers < 5 wrote them (torch.save per shard)."""
    os.makedirs(path, exist_ok=True)
    keys = list(state)
    wm = {}
    for i in range(nshards):
        name = f"pytorch_model-{i + 1:05d}-of-{nshards:05d}.bin"
        part = {k: state[k] for k in keys[i::nshards]}
        torch.save(part, os.path.join(path, name))
        wm.update({k: name for k in part})
    total = sum(v.numel() * v.element_size() for v in state.values())
    with open(os.path.join(path, "pytorch_model.bin.index.json"), "w") as f:
        json.dump({"metadata": {"total_size": total}, "weight_map": wm}, f)


def test_hf_directories_import_and_load_into_fsdp2(saved, tmp_path):
    """save_pretrained (safetensors) and legacy sharded .bin dirs -> native -> FSDP2 on 2 ranks."""
    root, states = saved
    jobs, expect = [], {}
    for fam in FAMILIES:
        ref_model, want = reference(fam, states[fam])
        hf = str(tmp_path / fam / "hf")
        ref_model.save_pretrained(hf, max_shard_size="20KB")
        saved_names = set()
        for f in os.listdir(hf):
            if f.endswith(".safetensors"):
                from safetensors import safe_open

                with safe_open(os.path.join(hf, f), "pt") as sf:
                    saved_names |= set(sf.keys())
        # save_pretrained drops the tied head, exactly for the tied families.
        assert ("lm_head.weight" in saved_names) == (not TIED[fam]), fam
        legacy_state = {k: v for k, v in states[fam].items() if k in saved_names}
        _legacy_bin_dir(str(tmp_path / fam / "legacy"), legacy_state)
        converters.from_safetensors(hf, str(tmp_path / fam / "from_hf"))
        converters.from_torch_save(str(tmp_path / fam / "legacy"), str(tmp_path / fam / "from_bin"))
        for tag in ("from_hf", "from_bin"):
            url = str(tmp_path / fam / tag)
            jobs.append((fam, url, True))  # strict: a tied head is the embedding, not missing
            expect[(fam, url)] = want
    results = run_ranks(2, _load_fsdp2, jobs)
    for rank_out in results:
        for (fam, url), (state, got, missing) in rank_out.items():
            assert_bits_equal(got, expect[(fam, url)], f"{fam} {url}")
            for k, v in states[fam].items():
                assert_bits_equal(state[k], v, f"{fam} {url} {k}")
            assert missing == [], (fam, url, missing)
