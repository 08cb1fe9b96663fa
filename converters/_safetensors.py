"""Export to the Hugging Face safetensors layout; import from it."""

from __future__ import annotations

import dataclasses
import json
import os
import uuid
from typing import TYPE_CHECKING, Any, Dict, List, Optional, Sequence, Union, cast

from shardckpt._format import DATA_DIR, MANIFEST_NAME
from shardckpt._format.hf import hf_manifest
from shardckpt._format.values import TAG, tensor_ref
from shardckpt._hf import KeyMap, aliases_of, map_names, select_names
from shardckpt._storage import Storage, fsync_dir
from shardckpt.errors import CheckpointExistsError, CheckpointNotFoundError, StateMismatchError, format_offenders

from ._common import Reader, write_plain, write_whole
from ._options import ConvertResult, Options, SelectOptions, check_apart, out_dtype, parse_dtype, parse_size
from ._quantize import QUANTIZE_CHOICES, fp8_config, fp8_entries, not_converted, quantized
from ._source import OutEntry, Source, open_checkpoint, source_from_manifest, whole_entry

if TYPE_CHECKING:
    from typing_extensions import Unpack

__all__ = [
    "to_safetensors",
    "from_safetensors",
    "export_names",
    "nest_under",
    "arrange_imported",
    "unflatten_optimizer",
    "model_prefix",
    "BARE_PREFIX",
    "HF_COMPANION_FILES",
]

HF_SINGLE = "model.safetensors"
HF_INDEX = "model.safetensors.index.json"
#: Files of a Hugging Face model directory besides its weights that ``copy_from`` brings along.
HF_COMPANION_FILES = (
    "config.json",
    "generation_config.json",
    "tokenizer.json",
    "tokenizer_config.json",
    "special_tokens_map.json",
    "added_tokens.json",
    "vocab.json",
    "vocab.txt",
    "merges.txt",
    "tokenizer.model",
    "spiece.model",
    "sentencepiece.bpe.model",
    "chat_template.jinja",
    "chat_template.json",
    "preprocessor_config.json",
    "processor_config.json",
)
#: Companion files are small; refuse to copy a huge one by mistake.
MAX_COMPANION_BYTES = 256 << 20


class _AutoPrefix(str):
    """The default ``prefix`` of :func:`to_safetensors`: ``"model."``, or the one entry holding a model."""


#: ``to_safetensors``'s default: export the model entry (``"model"``, or the
#: only entry holding a model's tensors); refuse to guess between several.
AUTO_PREFIX = _AutoPrefix("model.")


#: ``to_safetensors(tied=...)``: write a tied weight under one name (as
#: ``save_pretrained`` does) or under all of its names.
TIED_CHOICES = ("one", "both")
DEFAULT_TIED = "one"


def _with_alias_tensors(source: Source) -> Source:
    """``source`` with each tied weight's other names listed as tensors too (same bytes)."""
    extra = {a: source.tensors[n] for a, n in aliases_of(source.values).items()
             if a not in source.tensors and n in source.tensors}
    if not extra:
        return source
    return dataclasses.replace(source, tensors={**source.tensors, **extra})


def is_weight_file(name: str) -> bool:
    """Whether an export replaces ``name`` in its target directory (weights and their index; never config/tokenizer files)."""
    return name.endswith(".safetensors") or name == HF_INDEX


def _optimizer_shaped(node: Any) -> bool:
    return isinstance(node, dict) and isinstance(node.get("state"), dict) and isinstance(node.get("param_groups"), list)


def model_prefix(source: Source, model_key: Optional[str]) -> Optional[str]:
    """The state prefix of the model to export: ``model_key``'s, else the unambiguous model entry's.

    ``None``: the source's tensors are bare (top-level names, or a safetensors
    source) and are all exported.

    Raises:
        StateMismatchError: ``model_key`` names no model entry, or several
            top-level entries hold tensors and none is ``"model"`` (the
            message lists them and says to pass ``model_key=``).
    """
    values = source.values if isinstance(source.values, dict) else {}
    names = list(source.tensors)

    def holds_tensors(k: str) -> bool:
        return any(n.startswith(k + ".") for n in names)

    entries = {k: v for k, v in values.items() if isinstance(k, str) and isinstance(v, dict) and TAG not in v and holds_tensors(k)}
    models = [k for k, v in entries.items() if not _optimizer_shaped(v)]
    listing = ", ".join(f"{k!r} ({'optimizer' if _optimizer_shaped(v) else 'tensors'})" for k, v in entries.items())
    if model_key is not None:
        if model_key not in entries:
            raise StateMismatchError(
                f"{source.url}: model_key={model_key!r} names no top-level entry holding tensors; "
                f"entries with tensors: {listing or 'none'}"
            )
        if _optimizer_shaped(entries[model_key]):
            raise StateMismatchError(
                f"{source.url}: model_key={model_key!r} is an optimizer's state, not model weights; choose among: {listing}"
            )
        return model_key + "."
    if source.kind == "safetensors" or not entries:
        return None
    if "model" in models:
        return "model."
    if len(models) == 1:
        return models[0] + "."
    raise StateMismatchError(
        f"{source.url}: cannot tell which top-level entry holds the model to export: {listing}. "
        "Pass model_key='<entry>' (or prefix='<entry>.' / prefix=None for every tensor)"
    )


#: How many dotted levels :func:`existing_prefixes` lists.
PREFIX_LEVELS = 2


def existing_prefixes(names: Sequence[str], *, levels: int = PREFIX_LEVELS) -> List[str]:
    """The dotted prefixes (``"model."``, ``"model.layers."``) of ``names``, up to ``levels`` deep, sorted.

    Example:
        >>> existing_prefixes(["model.w", "optim.state.model.w.exp_avg"])
        ['model.', 'optim.', 'optim.state.']
    """
    found = set()
    for n in names:
        parts = n.split(".")[:-1]
        for depth in range(1, min(levels, len(parts)) + 1):
            found.add(".".join(parts[:depth]) + ".")
    return sorted(found)


def export_names(
    source: Source,
    *,
    prefix: Optional[str],
    keys: Union[str, Sequence[str], None],
    key_map: Optional[KeyMap],
) -> Dict[str, str]:
    """``{source name: output name}``: entries under ``prefix`` (stripped), selected, renamed.

    A safetensors source's (already bare) names are taken unchanged.
    ``keys`` match names after the prefix is stripped.

    Raises:
        StateMismatchError: no tensor lies under ``prefix`` (the message
            lists the prefixes that exist), or the selection is empty.
    """
    names = list(source.tensors)
    stripped = {n: n for n in names}
    # Safetensors sources hold bare model names already ("model.layers.0..."
    # is HF naming there, not a state prefix).
    if prefix and source.kind != "safetensors":
        under = {n: n[len(prefix) :] for n in names if n.startswith(prefix) and len(n) > len(prefix)}
        if not under:
            # Exporting everything instead would put optimizer moments in a
            # model directory without a word: a typo must be loud.
            raise StateMismatchError(
                f"{source.url}: no tensor lies under prefix {prefix!r}; prefixes that exist: "
                f"{format_offenders(existing_prefixes(names)) or 'none (the names are bare)'}. "
                "Pass one of them, or --no-prefix (prefix=None) to export every tensor under its full name"
            )
        stripped = under
    back = {v: k for k, v in stripped.items()}
    chosen = select_names(list(stripped.values()), keys)
    renamed = map_names(chosen, key_map)
    out = {back[s]: new for s, new in renamed.items()}
    if not out:
        raise StateMismatchError(f"{source.url}: no tensors to convert (after prefix/keys/key_map selection)")
    return out


def to_safetensors(
    src: str,
    dst: str,
    *,
    dtype: Any = None,
    max_shard_size: Union[int, str] = "5GB",
    prefix: Optional[str] = AUTO_PREFIX,
    model_key: Optional[str] = None,
    copy_from: Optional[str] = None,
    tied: str = DEFAULT_TIED,
    quantize: Optional[str] = None,
    **options: Unpack[SelectOptions],
) -> ConvertResult:
    """Export a checkpoint's model as a Hugging Face safetensors directory.

    Writes ``model.safetensors`` when everything fits in one shard, else
    ``model-00001-of-0000N.safetensors``... plus ``model.safetensors.index.json``
    (``metadata.total_size``, ``weight_map``), the layout ``transformers``
    and ``safetensors.torch.load_file`` read. Streams: memory stays at a few
    16 MiB blocks whatever the model size; source checksums are verified on
    the way and a damaged source raises before anything is published.

    Args:
        src: a shardckpt checkpoint (any world size), or a safetensors
            directory/file (to re-shard, cast or rename it).
        dst: output directory (local path or fsspec URL).
        dtype: cast floating-point tensors (``torch.bfloat16``, ``"bf16"``...);
            integer and bool tensors keep their dtype.
        max_shard_size: bytes per file: an int, or ``"5GB"`` / ``"500MB"``
            (decimal, as huggingface_hub reads them) or ``"2GiB"`` (binary).
            A tensor larger than this gets a file of its own.
        prefix: state prefix to strip; only tensors under it are exported
            (none under it raises, listing the prefixes that exist).
            ``None``/``""``: all tensors.
            Default: the model entry: ``"model"``, else the only top-level
            entry holding tensors that is not an optimizer's state; several
            candidates raise (pass ``model_key``). Optimizer moments are
            never exported by default.
        model_key: the top-level entry holding the model (``"net"``,
            ``"policy"``); its prefix is stripped.
        copy_from: a Hugging Face model directory (local or fsspec URL) whose
            ``config.json``, ``generation_config.json`` and tokenizer files
            (:data:`HF_COMPANION_FILES`) are copied into ``dst``, so that
            ``from_pretrained(dst)`` works.
        tied: tied weights (one tensor under several names, e.g.
            ``lm_head.weight`` is ``embed_tokens.weight``): ``"one"``
            (default) writes the name shardckpt saved it under — the first in
            module order, which is the name ``save_pretrained`` keeps — as
            transformers and ``safetensors.torch.load_model(strict=True)``
            expect; ``"both"`` writes the data under every name.
        quantize: ``"fp8-block"`` writes each Linear weight (a 2-D
            floating-point ``*.weight``) as ``float8_e4m3fn`` with
            ``<name>_scale_inv`` (float32, one scale = amax / 448 per 128 x 128
            block, edge blocks smaller), DeepSeek-V3's layout that
            transformers, vLLM and SGLang load, and merges
            ``quantization_config`` into ``config.json`` (the ``copy_from``
            one, else the one ``dst`` holds; none is written when there is
            neither). Left as they are (``dtype`` applies): embeddings, norms,
            ``lm_head``, MoE routers (``*.gate``), the modules the source
            config's ``modules_to_not_convert`` lists, every 1-D or 3-D tensor
            (these modules are listed in the written ``modules_to_not_convert``).
            Each quantized weight is read twice (scales, then codes), block by
            block. ``docs/converters.md``, "Block FP8 out".
        **options: :class:`SelectOptions`: ``keys`` select tensors (matched
            after the prefix is stripped), ``key_map`` renames them;
            ``storage_options`` (for ``src`` and ``copy_from``),
            ``dst_storage_options``, ``overwrite`` (replace the weight files,
            ``*.safetensors`` and the index, of a ``dst`` that has some; its
            other files, config, tokenizer, README, are always kept),
            ``progress``, ``io_threads``.

    Returns:
        ConvertResult(url, files, tensors, nbytes, seconds).

    Raises:
        CheckpointNotFoundError: nothing committed at ``src``.
        CheckpointExistsError: ``dst`` holds weight files and ``overwrite`` is False.
        CheckpointNotFoundError: ``copy_from`` holds none of the companion files.
        UnsupportedStateError: ``quantize`` and a weight to quantize holds NaN or inf.
        StateMismatchError: the selection is empty, no tensor lies under
            ``prefix``, a pattern matches nothing,
            ``key_map`` maps two tensors to one name, or the model entry is
            ambiguous (the message lists the top-level entries).
        ChecksumMismatchError: the source is damaged (nothing published).

    Publication: on local disk the directory is built under a hidden
    sibling name (with the kept files of ``dst`` hard-linked or copied in)
    and renamed into place, so weights and index appear together, complete
    or not at all. On object stores each file appears whole when its upload
    completes and the index is written last; a reader that goes through the
    index never sees a partial export, but a crash can leave shard files
    without an index.

    Example:
        >>> from shardckpt import converters                      # doctest: +SKIP
        >>> converters.to_safetensors("ckpt/step-1000", "hf_out", dtype="bf16", max_shard_size="2GB")
    """
    opts = Options.of("to_safetensors", options, select=True)
    check_apart(src, dst)
    if tied not in TIED_CHOICES:
        raise ValueError(f"to_safetensors(tied={tied!r}): expected one of {', '.join(map(repr, TIED_CHOICES))}")
    if quantize is not None and quantize not in QUANTIZE_CHOICES:
        raise ValueError(f"to_safetensors(quantize={quantize!r}): expected None or one of {', '.join(map(repr, QUANTIZE_CHOICES))}")
    source = open_checkpoint(src, opts.storage_options)
    if tied == "both":
        source = _with_alias_tensors(source)
    if model_key is not None or prefix is AUTO_PREFIX:
        prefix = model_prefix(source, model_key)
    names = export_names(source, prefix=prefix, keys=opts.keys, key_map=opts.key_map)
    companions = _read_companions(copy_from, opts.storage_options) if copy_from is not None else {}
    cast = parse_dtype(dtype)
    limit = parse_size(max_shard_size)
    reader = Reader(source, threads=opts.io_threads)
    reader.check_source_files(list(names))
    if quantize is not None:
        companions = _with_fp8_config(dst, companions, names, source, opts)
    skip = not_converted(companions.get(HF_CONFIG)) if quantize is not None else []
    groups: List[List[OutEntry]] = []
    size = 0
    for name, out in names.items():
        t = source.tensors[name]
        # A quantized weight and its scales go together (one file, as the FP8 checkpoints on the Hub).
        ents = fp8_entries(reader, t, out, not_convert=skip) if quantize is not None else None
        ents = ents or [whole_entry(t, out, out_dtype(t.dtype, cast))]
        n = sum(e.nbytes for e in ents)
        if not groups or (groups[-1] and size + n > limit):
            groups.append([])
            size = 0
        groups[-1].extend(ents)
        size += n
    if len(groups) == 1:
        files = {HF_SINGLE: groups[0]}
        index = None
    else:
        n = len(groups)
        files = {f"model-{i + 1:05d}-of-{n:05d}.safetensors": g for i, g in enumerate(groups)}
        weight_map = {e.key: rel for rel, g in files.items() for e in g}
        total = sum(e.nbytes for g in groups for e in g)
        index = (
            json.dumps({"metadata": {"total_size": total}, "weight_map": dict(sorted(weight_map.items()))}, indent=2) + "\n"
        ).encode()
    return _publish_export(dst, files, reader, opts, index=index, companions=companions)


HF_CONFIG = "config.json"


def _with_fp8_config(dst_url: str, companions: Dict[str, bytes], names: Dict[str, str], source: Source,
                     opts: Options) -> Dict[str, bytes]:
    """``companions`` with ``config.json`` (``copy_from``'s, else ``dst``'s own) given block FP8's quantization_config.

    The modules whose 2-D floating-point weights stay unquantized are listed
    in ``modules_to_not_convert``. Nothing is added when neither has a config.
    """
    config = companions.get(HF_CONFIG)
    where = "copy_from"
    if config is None:
        dst = Storage(dst_url, storage_options=opts.dst_storage_options)
        if not (dst.exists("") and dst.exists(HF_CONFIG)):
            return companions
        config, where = dst.read_bytes(HF_CONFIG, limit=MAX_COMPANION_BYTES), dst.url
    skip = not_converted(config)
    kept = sorted(
        out[: -len(".weight")] for name, out in names.items()
        if out.endswith(".weight") and len(source.tensors[name].shape) == 2 and source.tensors[name].dtype in ("F32", "BF16", "F16", "F64")
        and not quantized(out, source.tensors[name].dtype, source.tensors[name].shape, skip)
    )
    return {**companions, HF_CONFIG: fp8_config(config, kept, where=where)}


def _read_companions(url: str, storage_options: Optional[Dict[str, Any]]) -> Dict[str, bytes]:
    """``{name: bytes}`` of the :data:`HF_COMPANION_FILES` present in the directory ``url``."""
    storage = Storage(url, storage_options=storage_options)
    out = {}
    for name in HF_COMPANION_FILES:
        if storage.exists(name):
            out[name] = storage.read_bytes(name, limit=MAX_COMPANION_BYTES)
    if not out:
        raise CheckpointNotFoundError(
            f"copy_from={url!r}: none of the files a Hugging Face model directory holds besides its weights "
            f"({', '.join(HF_COMPANION_FILES[:5])}...) is there; pass the directory holding config.json"
        )
    return out


def _publish_export(dst_url, files, reader, opts: Options, *, index, companions) -> ConvertResult:
    """Write the weight files into ``dst``, keeping its other files; ``companions`` are added (replacing same-named ones)."""
    dst = Storage(dst_url, storage_options=opts.dst_storage_options)
    existing = [n for n in (dst.listdir("") if dst.exists("") else []) if not n.startswith(".")]
    # A native checkpoint there (manifest + data/) counts as weights too: an
    # export must not turn it into a half-native, half-HF directory.
    weights = [n for n in existing if is_weight_file(n) or n in (MANIFEST_NAME, DATA_DIR)]
    if weights and not opts.overwrite:
        raise CheckpointExistsError(
            f"{dst.url} already holds weight files ({format_offenders(weights, limit=5)}); pass overwrite=True to "
            "replace them (its other files, e.g. config.json and tokenizer files, are kept either way)"
        )
    kept = [n for n in existing if n not in weights]
    if not dst.is_local:
        # Object stores: no directory rename. Weights first, index last (the
        # shared writer), stale weight files removed after; kept files are
        # never touched. Companions go in once the weights are complete.
        res = write_plain(dst, files, reader, opts, index=index, index_name=HF_INDEX, desc="to_safetensors")
        for n in existing:
            # Stale weights and a stale index only: never the user's config/tokenizer files.
            if (n.endswith(".safetensors") and n not in files) or (n == HF_INDEX and index is None):
                dst.remove(n)
        for name, data in companions.items():
            dst.write_atomic(name, data)
        return res._replace(files=sorted(set(res.files) | set(companions)))
    # Local disk: build the complete directory under a hidden sibling name
    # (new weights + index from the shared writer, kept files linked in,
    # companions written) and swap it in with two renames, so weights and
    # index are published together and nothing of the user's is lost.
    root = os.path.abspath(cast(Any, dst).root)  # local disk here
    parent, base = os.path.dirname(root), os.path.basename(root)
    stage = os.path.join(parent, f".{base}.{uuid.uuid4().hex[:12]}.export")
    old = None
    try:
        staged = Storage(stage)
        staged.makedirs("")
        res = write_plain(staged, files, reader, opts, index=index, index_name=HF_INDEX, desc="to_safetensors")
        for name in kept:
            if name not in companions:
                _link_or_copy(os.path.join(root, name), os.path.join(stage, name))
        for name, data in companions.items():
            staged.write_atomic(name, data)
        fsync_dir(stage)
        if os.path.exists(root):
            old = os.path.join(parent, f".{base}.{uuid.uuid4().hex[:12]}.old")
            os.rename(root, old)
        os.rename(stage, root)
        fsync_dir(parent)
    except BaseException:
        if old is not None and not os.path.exists(root):
            os.rename(old, root)
            old = None
        if os.path.exists(stage):
            Storage(stage).remove_tree("")
        raise
    if old is not None:
        Storage(old).remove_tree("")
    return ConvertResult(dst.url, sorted(set(res.files) | set(companions)), res.tensors, res.nbytes, res.seconds)


def _link_or_copy(src: str, dst: str) -> None:
    """Hard-link ``src`` (a file or a directory tree) to ``dst``; copy where links are not possible."""
    import shutil

    def link(a: str, b: str) -> None:
        try:
            os.link(a, b, follow_symlinks=False)
        except OSError:
            shutil.copy2(a, b, follow_symlinks=False)

    if os.path.isdir(src) and not os.path.islink(src):
        shutil.copytree(src, dst, symlinks=True, copy_function=link)
    else:
        link(src, dst)


def nest_under(prefix: str, leaves: Dict[str, Any]) -> Any:
    """The values tree that puts ``leaves`` under the dotted ``prefix`` (``"model."`` -> ``{"model": leaves}``)."""
    tree: Any = leaves
    for part in reversed([p for p in (prefix or "").split(".") if p]):
        tree = {part: tree}
    return tree


# --------------------------------------------------------------------------
# The bare-dict rule and torchtitan's layout, shared by every importer.

#: Where a bare model state dict goes on import, so ``load({"model": m}, dst)`` finds it.
BARE_PREFIX = "model."
#: Top-level entries of a torchtitan checkpoint besides the model's (flattened) keys.
TORCHTITAN_ENTRIES = ("optimizer", "lr_scheduler", "dataloader", "train_state")
#: Where torchtitan's ``optimizer`` entry goes: shardckpt's ``{"model": m, "optim": o}`` convention.
OPTIM_KEY = "optim"
_FLAT_STATE = "state."
_FLAT_GROUPS = "param_groups."


def _is_tensor_leaf(v: Any) -> bool:
    import torch

    return isinstance(v, torch.Tensor)


def arrange_imported(tree: Any, prefix: Optional[str]) -> Any:
    """Place an imported tree the way ``shardckpt.load({"model": m, "optim": o, ...})`` expects it.

    The one rule for ``from_dcp``, ``from_torch_save`` and ``from_safetensors``:

    * ``prefix`` given (``""`` included): the tree goes under it, as is.
    * ``prefix=None`` (the default of the first two; safetensors files are
      always bare, so ``from_safetensors`` simply defaults to ``"model."``):
      a flat dict of tensors (a bare ``model.state_dict()``) goes under
      ``"model."``; torchtitan's layout (model keys at the top level next to
      ``optimizer``, ``lr_scheduler``, ``dataloader``, ``train_state``) gets its
      model keys under ``"model"`` and its ``optimizer`` under ``"optim"``;
      anything else (``{"model": ..., "optimizer": ..., "step": 3}``) keeps its keys.

    In every case an optimizer state dict saved with
    ``flatten_optimizer_state_dict=True`` (``state.<fqn>.exp_avg``,
    ``param_groups.<fqn>.lr``) is rebuilt as ``{"state": {fqn: {...}},
    "param_groups": [{..., "params": [fqn, ...]}]}``, what shardckpt's
    optimizer support reads.
    """
    if isinstance(tree, dict):
        tree = {k: unflatten_optimizer(v) for k, v in tree.items()}
        tree = unflatten_optimizer(tree)
    if prefix is not None:
        return nest_under(prefix, tree)
    if not isinstance(tree, dict) or not tree:
        return tree
    tops = [k for k, v in tree.items() if _is_tensor_leaf(v)]
    if len(tops) == len(tree):
        return nest_under(BARE_PREFIX, tree)
    model_key = BARE_PREFIX.rstrip(".")
    if tops and model_key not in tree and OPTIM_KEY not in tree and all(
        k in TORCHTITAN_ENTRIES for k in tree if k not in tops
    ):
        out: Dict[str, Any] = {model_key: {k: tree[k] for k in tops}}
        for k, v in tree.items():
            if k not in tops:
                out[OPTIM_KEY if k == "optimizer" else k] = v
        return out
    return tree


def _is_flat_optimizer(d: Any) -> bool:
    return (
        isinstance(d, dict)
        and bool(d)
        and all(isinstance(k, str) and k.startswith((_FLAT_STATE, _FLAT_GROUPS)) for k in d)
        and any(k.startswith(_FLAT_GROUPS) for k in d)
    )


def _same(a: Any, b: Any) -> bool:
    import torch

    if isinstance(a, torch.Tensor) or isinstance(b, torch.Tensor):
        return isinstance(a, torch.Tensor) and isinstance(b, torch.Tensor) and a.shape == b.shape and bool(torch.equal(a, b))
    if isinstance(a, dict) and isinstance(b, dict):
        return a.keys() == b.keys() and all(_same(a[k], b[k]) for k in a)
    if isinstance(a, (list, tuple)) and isinstance(b, (list, tuple)):
        return type(a) is type(b) and len(a) == len(b) and all(_same(x, y) for x, y in zip(a, b))
    return type(a) is type(b) and a == b


def unflatten_optimizer(d: Any) -> Any:
    """``{"state.<fqn>.<k>": v, "param_groups.<fqn>.<k>": v}`` -> torch's FQN-keyed optimizer state dict; else ``d``.

    The state and hyperparameter names themselves hold no dots (``exp_avg``,
    ``lr``, ``betas``), so the FQN is everything between the first and the
    last dot. Parameters with equal hyperparameters form one group, in
    order of first appearance (a group's members are matched by name on
    load, so their order does not matter).
    """
    if not _is_flat_optimizer(d):
        return d
    state: Dict[str, Dict[str, Any]] = {}
    hyper: Dict[str, Dict[str, Any]] = {}
    for key, v in d.items():
        flat, into = (key[len(_FLAT_STATE) :], state) if key.startswith(_FLAT_STATE) else (key[len(_FLAT_GROUPS) :], hyper)
        fqn, _, name = flat.rpartition(".")
        if not fqn or not name:
            return d  # not torch's flattening after all: keep it as it is
        into.setdefault(fqn, {})[name] = v
    groups: List[Dict[str, Any]] = []
    for fqn, hp in hyper.items():
        hp = {k: v for k, v in hp.items() if k not in ("params", "param_names")}
        for g in groups:
            if _same({k: v for k, v in g.items() if k != "params"}, hp):
                g["params"].append(fqn)
                break
        else:
            groups.append({**hp, "params": [fqn]})
    return {"state": state, "param_groups": groups}


def from_safetensors(
    src: str,
    dst: str,
    *,
    prefix: str = "model.",
    **options: Unpack[SelectOptions],
) -> ConvertResult:
    """Import safetensors weights (an HF directory, sharded with an index or not, or one file) as a native checkpoint.

    Tensor names get ``prefix`` (default ``"model."``), so the result loads
    with ``shardckpt.load({"model": model}, dst)`` at any world size. Every
    chunk gets a CRC-32C computed while streaming.

    Args:
        src: safetensors directory or ``.safetensors`` file (local or fsspec URL).
        dst: native checkpoint directory to create.
        prefix: prepended to every (renamed) name; ``""`` for none.
        **options: :class:`SelectOptions`: ``keys`` select tensors (HF
            names, before renaming), ``key_map`` renames them (before the
            prefix); ``storage_options`` for ``src``, ``dst_storage_options``,
            ``overwrite`` a committed checkpoint at ``dst``, ``progress``, ``io_threads``.

    Raises:
        CheckpointNotFoundError: no safetensors files at ``src``.
        CorruptCheckpointError: a bad index or header (named).
        CheckpointExistsError: ``dst`` holds a checkpoint and ``overwrite`` is False.

    Safetensors files carry no checksums: the bytes imported are what the
    files hold (sizes and header bounds are checked).

    Example:
        >>> converters.from_safetensors("Llama-3-8B/", "s3://b/llama-native")   # doctest: +SKIP
    """
    opts = Options.of("from_safetensors", options, select=True)
    check_apart(src, dst)
    storage = Storage(src, storage_options=opts.storage_options)
    m = hf_manifest(storage)
    if m is None:
        raise CheckpointNotFoundError(f"no safetensors files at {storage.url}")
    source = source_from_manifest(storage, m)
    chosen = select_names(list(source.tensors), opts.keys)
    renamed = map_names(chosen, opts.key_map)
    final = {old: (prefix or "") + new for old, new in renamed.items()}
    if not final:
        raise StateMismatchError(f"{storage.url}: no tensors to import")
    values = nest_under(prefix, {new: tensor_ref(final[old]) for old, new in renamed.items()})
    # hf_manifest has just listed every file's size: no second check.
    return write_whole(source, dst, final, opts, values=values, extra={"converted_from": "safetensors"}, check_sizes=False,
                       desc="from_safetensors")
