"""Key selection and renaming (shared by load and the converters), and reading parts of unchecked chunks.

Reading a Hugging Face safetensors directory or file as a checkpoint is part
of the format layer (``_format.hf``: ``hf_manifest``).
No torch import.
"""

from __future__ import annotations

import dataclasses
import fnmatch
import math
import sys
from typing import Any, Callable, Collection, Dict, Iterable, List, Mapping, Optional, Sequence, Union

from ._format import ChunkMeta, Manifest, TensorMeta, itemsize
from ._format.hf import SOURCE_SAFETENSORS
from ._format.values import TAG, is_tensor_ref, rename_refs
from .errors import StateMismatchError, format_offenders

__all__ = [
    "select_names",
    "map_names",
    "select_for_load",
    "narrow_unchecked",
    "aliases_of",
    "tree_paths",
    "select_paths",
    "with_aliases",
    "KeyMap",
]

KeyMap = Union[Mapping[str, str], Callable[[str], Optional[str]]]


# --------------------------------------------------------------------------
# key selection and renaming (shared by load and the converters)


def select_names(names: Iterable[str], patterns: Union[str, Sequence[str], None], *, what: str = "keys") -> List[str]:
    """Names matching any of ``patterns`` (exact names or ``fnmatch`` globs), in order.

    A pattern equal to one of ``names`` selects exactly that name, even when it
    holds ``[``, ``*`` or ``?`` (``"layers[0].w"`` is a name, not a character
    class): the exact match wins over the glob reading.

    Raises ``StateMismatchError`` naming every pattern that matches nothing,
    so a typo does not silently drop tensors.
    """
    names = list(names)
    if patterns is None:
        return names
    if isinstance(patterns, str):
        patterns = [patterns]
    patterns = list(patterns)
    if any(not isinstance(p, str) for p in patterns):
        raise TypeError(f"{what} must be a list of strings (names or glob patterns), got {patterns!r}")
    known = set(names)
    exact = {p for p in patterns if p in known or not any(ch in p for ch in "*?[")}
    globs = [p for p in patterns if p not in exact]
    hit = set()
    out = []
    for n in names:
        ok = n in exact
        if ok:
            hit.add(n)
        for g in globs:
            if fnmatch.fnmatchcase(n, g):
                hit.add(g)
                ok = True
        if ok:
            out.append(n)
    unmatched = [p for p in patterns if p not in hit]
    if unmatched:
        raise StateMismatchError(f"{what} pattern(s) match no tensor: {format_offenders(unmatched)}")
    return out


def map_names(names: Iterable[str], key_map: Optional[KeyMap]) -> Dict[str, str]:
    """``{old: new}`` after renaming; a callable may return ``None`` to drop a name.

    A dict renames the names it lists and keeps the others. Two names mapped
    to one raise ``StateMismatchError``.
    """
    out: Dict[str, str] = {}
    for n in names:
        if key_map is None:
            new: Optional[str] = n
        elif callable(key_map) and not isinstance(key_map, Mapping):
            new = key_map(n)
        elif isinstance(key_map, Mapping):
            new = key_map.get(n, n)
        else:
            raise TypeError(f"key_map must be a dict or a callable, got {type(key_map).__name__}")
        if new is None:
            continue
        if not isinstance(new, str) or not new:
            raise TypeError(f"key_map gave {new!r} for {n!r}; expected a non-empty str (or None to drop it)")
        out[n] = new
    seen: Dict[str, List[str]] = {}
    for old, new in out.items():
        seen.setdefault(new, []).append(old)
    clash = [f"{new} <- {', '.join(sorted(olds))}" for new, olds in seen.items() if len(olds) > 1]
    if clash:
        raise StateMismatchError(f"key_map maps several tensors to one name: {format_offenders(clash)}")
    return out


def select_for_load(
    manifest: Manifest,
    state: Mapping[str, Any],
    *,
    keys: Union[str, Sequence[str], None] = None,
    key_map: Optional[KeyMap] = None,
) -> Manifest:
    """The manifest as ``load`` should see it: selected by ``keys``, renamed by ``key_map``.

    ``keys`` match checkpoint names; ``key_map`` maps checkpoint names to
    state names. A safetensors source holds a bare model state dict, so
    without a ``key_map`` its names are placed under the state's ``"model"``
    entry (or under its only entry when it has one).
    """
    names = select_names(sorted(manifest.tensors), keys)
    if keys is not None and manifest.values is not None:
        names = sorted(set(names) | set(optimizer_followers(manifest.values, names, manifest.tensors)))
    if key_map is None and manifest.extra.get("source") == SOURCE_SAFETENSORS and _bare_tensors(state, manifest):
        # {"w": t} from a file holding "w": the state's keys are the file's names.
        key_map = {}
    if key_map is None and manifest.extra.get("source") == SOURCE_SAFETENSORS:
        roots = list(state)
        root = roots[0] if len(roots) == 1 else ("model" if "model" in state else None)
        if root is None:
            raise StateMismatchError(
                "a safetensors checkpoint holds bare model keys; pass state={'model': model} "
                f"or a key_map (state has {format_offenders(roots)})"
            )
        key_map = lambda n, r=root: f"{r}.{n}"  # noqa: E731
    if keys is None and key_map is None:
        return manifest
    mapping = map_names(names, key_map)
    values = manifest.values
    if values is not None and keys is not None:
        values = prune_optimizers(values, set(names), set(manifest.tensors))
    if values is not None:
        values = map_optimizers(values, mapping, set(manifest.tensors))
    tensors = {mapping[n]: manifest.tensors[n] for n in names if n in mapping}
    if values is not None:
        values = rename_refs(values, mapping)
    # replace(), not a new Manifest: every other field (v2's block size,
    # meshes and index files) must survive, or the reader falls back to
    # whole-chunk checksums and reads past its buffer bound.
    return dataclasses.replace(manifest, tensors=tensors, values=values)


def _optimizer_node(node: Any) -> bool:
    """Whether a saved values node is torch's FQN-keyed optimizer state dict."""
    return (
        isinstance(node, dict)
        and TAG not in node
        and isinstance(node.get("state"), dict)
        and isinstance(node.get("param_groups"), list)
        and all(isinstance(g, dict) and isinstance(g.get("params"), list) for g in node["param_groups"])
    )


def _optimizer_models(values: Any, saved: set) -> Dict[str, tuple]:
    """``{optimizer key: (model key, its FQNs)}`` for each optimizer at the top of a values tree.

    The model is the top-level entry under which the most of the
    optimizer's FQNs are saved tensors (``<model>.<fqn>``).
    """
    out: Dict[str, tuple] = {}
    if not isinstance(values, dict):
        return out
    for o, node in values.items():
        if not _optimizer_node(node):
            continue
        fqns = [f for g in node["param_groups"] for f in g["params"] if isinstance(f, str)]
        hits = {m: sum(f"{m}.{f}" in saved for f in fqns) for m in values if m != o}
        model = max(hits, key=lambda m: hits[m], default=None)
        if fqns and model is not None and hits[model]:
            out[o] = (model, fqns)
    return out


def optimizer_followers(values: Any, selected: Iterable[str], saved_tensors: Iterable[str]) -> List[str]:
    """Optimizer state tensors of the parameters that ``selected`` (a ``keys=`` selection) picks.

    ``keys=["model.layers.0.*"]`` selects those parameters and, with them,
    ``optim.state.layers.0.….exp_avg`` of the optimizer saved beside the
    model: a partial load carries the optimizer entries of what it loads.

        >>> vals = {"model": {}, "optim": {"state": {}, "param_groups": [{"params": ["a", "b"]}]}}
        >>> optimizer_followers(vals, ["model.a"], ["model.a", "model.b", "optim.state.a.m", "optim.state.b.m"])
        ['optim.state.a.m']
    """
    saved = set(saved_tensors)
    picked = set(selected)
    out: List[str] = []
    for o, (model, fqns) in _optimizer_models(values, saved).items():
        want = {f for f in fqns if f"{model}.{f}" in picked}
        if not want:
            continue
        pre = f"{o}.state."
        for n in saved:
            if n.startswith(pre) and n[len(pre):].rpartition(".")[0] in want:
                out.append(n)
    return sorted(out)


def prune_optimizers(values: Any, selected: set, saved_tensors: set) -> Any:
    """The values tree with each optimizer's parameters that a ``keys=`` selection left out removed.

    A parameter whose saved state tensors were all left out is dropped from
    the optimizer's ``state`` and ``param_groups`` (its live state stays, and
    a non-strict load reports it missing), instead of reaching the optimizer
    as a state of ``None`` values.

        >>> vals = {"model": {}, "optim": {"state": {"a": {"m": {"__shardckpt__": "tensor", "name": "optim.state.a.m"}},
        ...     "b": {"m": {"__shardckpt__": "tensor", "name": "optim.state.b.m"}}}, "param_groups": [{"params": ["a", "b"]}]}}
        >>> prune_optimizers(vals, {"optim.state.a.m"}, {"model.a", "model.b", "optim.state.a.m", "optim.state.b.m"})["optim"]["param_groups"]
        [{'params': ['a']}]
    """
    if not isinstance(values, dict):
        return values
    out = dict(values)
    for o in _optimizer_models(values, saved_tensors):
        node = values[o]
        drop = set()
        for f, st in node["state"].items():
            refs = [r for r in _refs_in(st)]
            if refs and not any(r in selected for r in refs):
                drop.add(f)
        if not drop:
            continue
        groups = []
        for g in node["param_groups"]:
            g = dict(g)
            for key in ("params", "param_names"):
                if isinstance(g.get(key), list):
                    g[key] = [f for f in g[key] if f not in drop]
            groups.append(g)
        out[o] = {**node, "state": {f: v for f, v in node["state"].items() if f not in drop}, "param_groups": groups}
    return out


def _refs_in(node: Any) -> List[str]:
    out: List[str] = []
    if isinstance(node, dict):
        if is_tensor_ref(node):
            name = node.get("name")
            return [name] if isinstance(name, str) else []
        for v in node.values():
            out.extend(_refs_in(v))
    elif isinstance(node, list):
        for v in node:
            out.extend(_refs_in(v))
    return out


def map_optimizers(values: Any, mapping: Dict[str, str], saved_tensors: Iterable[str]) -> Any:
    """Carry a model's renaming (``key_map``) over to the optimizers saved beside it; ``mapping`` is updated.

    An optimizer is saved by the FQNs of its parameters, relative to its
    model (``optim.state.<fqn>.exp_avg``, ``param_groups[i]["params"]``).
    For each optimizer at the top of ``values`` the model it belongs to is
    the top-level entry ``m`` under which its FQNs are saved tensors
    (``m.<fqn>``); where ``mapping`` renames ``m.<fqn>`` to ``m2.<new>``, the
    optimizer's state keys, ``params``/``param_names`` and state tensors
    (those ``mapping`` left unchanged) become ``<new>`` too. Linear in the
    number of names. Returns the new values tree (the input is not changed).

        >>> vals = {"model": {"a": 1}, "optim": {"state": {"a": {"m": {"__shardckpt__": "tensor",
        ...          "name": "optim.state.a.m"}}}, "param_groups": [{"params": ["a"]}]}}
        >>> mp = {"model.a": "model.b", "optim.state.a.m": "optim.state.a.m"}
        >>> map_optimizers(vals, mp, ["model.a", "optim.state.a.m"])["optim"]["param_groups"]
        [{'params': ['b']}]
        >>> mp["optim.state.a.m"]
        'optim.state.b.m'
    """
    if not isinstance(values, dict):
        return values
    out = dict(values)
    by_prefix: Dict[str, Dict[str, str]] = {}
    for o, (model, fqns) in _optimizer_models(values, set(saved_tensors)).items():
        node = values[o]
        fmap: Dict[str, str] = {}
        for f in fqns:
            new = mapping.get(f"{model}.{f}")
            if new is not None and "." in new:
                fmap[f] = new.split(".", 1)[1]
        if all(fmap.get(f, f) == f for f in fqns):
            continue
        state = {fmap.get(f, f): v for f, v in node["state"].items()}
        groups = []
        for g in node["param_groups"]:
            g = dict(g)
            for key in ("params", "param_names"):
                if isinstance(g.get(key), list):
                    g[key] = [fmap.get(f, f) if isinstance(f, str) else f for f in g[key]]
            groups.append(g)
        out[o] = {**node, "state": state, "param_groups": groups}
        by_prefix[f"{o}.state."] = fmap
    if by_prefix:
        for n, new in list(mapping.items()):
            if new != n:
                continue  # the key_map named this one itself
            for pre, fmap in by_prefix.items():
                if n.startswith(pre):
                    fqn, _, k = n[len(pre):].rpartition(".")
                    if fqn in fmap:
                        mapping[n] = f"{pre}{fmap[fqn]}.{k}"
                    break
    return out


def _bare_tensors(state: Mapping[str, Any], manifest: Manifest) -> bool:
    """Whether ``state`` maps names straight to tensors the safetensors source holds (no model entry)."""
    torch = sys.modules.get("torch")
    if torch is None or not state:
        return False
    return all(isinstance(v, torch.Tensor) for v in state.values()) and any(k in manifest.tensors for k in state)


def narrow_unchecked(meta: TensorMeta, boxes: Sequence[Any]) -> TensorMeta:
    """Cut checksum-less chunks at the dim-0 edges of ``boxes`` (objects with offsets/sizes).

    A checksummed chunk must be read whole to be verified; one without a
    checksum (safetensors sources) can be read in part. Rows of a chunk are
    contiguous bytes, so each piece is still one byte range — a rank then
    reads only the rows it holds.
    """
    if not meta.shape or all(c.crc32c is not None for c in meta.chunks):
        return meta
    cuts = set()
    for b in boxes:
        if b.sizes and b.sizes[0]:
            cuts.add(b.offsets[0])
            cuts.add(b.offsets[0] + b.sizes[0])
    out: List[ChunkMeta] = []
    isz = itemsize(meta.dtype)
    for c in meta.chunks:
        lo, n = c.offsets[0], c.sizes[0]
        if c.crc32c is not None or n == 0:
            out.append(c)
            continue
        row = math.prod(c.sizes[1:]) * isz
        edges = sorted({lo, lo + n} | {x for x in cuts if lo < x < lo + n})
        for a, b in zip(edges, edges[1:]):
            out.append(
                ChunkMeta(
                    file=c.file,
                    key=c.key,
                    offsets=[a] + list(c.offsets[1:]),
                    sizes=[b - a] + list(c.sizes[1:]),
                    byte_offset=c.byte_offset + (a - lo) * row,
                    nbytes=(b - a) * row,
                    crc32c=None,
                )
            )
    return TensorMeta(dtype=meta.dtype, shape=meta.shape, chunks=out, layout=meta.layout)



# --------------------------------------------------------------------------
# tied weights: one tensor saved once, referenced under several names


def aliases_of(values: Any) -> Dict[str, str]:
    """``{alias: saved name}`` of a values tree: references whose name is not their own path.

    Tied parameters are saved once, under the first name in module order;
    every other name is a tensor reference to it (``docs/format.md``).

        >>> aliases_of({"model": {"a": {"__shardckpt__": "tensor", "name": "model.a"},
        ...                       "b": {"__shardckpt__": "tensor", "name": "model.a"}}})
        {'model.b': 'model.a'}
    """
    out: Dict[str, str] = {}

    def walk(node: Any, path: str) -> None:
        if isinstance(node, dict):
            if is_tensor_ref(node):
                name = node.get("name")
                if isinstance(name, str) and path and name != path:
                    out[path] = name
                return
            if TAG in node:
                return
            for k, v in node.items():
                walk(v, f"{path}.{k}" if path else str(k))
        elif isinstance(node, list):
            for i, v in enumerate(node):
                walk(v, f"{path}.{i}" if path else str(i))

    walk(values, "")
    return out


#: In-memory only (never saved): alias name -> the stored tensor it stands for.
ALIAS_OF_KEY = "_alias_of"


def with_aliases(manifest: Manifest) -> Manifest:
    """The manifest with each alias also listed as a tensor (the same chunks as the tensor it names).

    Lets an untied live model, a template-less load or ``keys=`` find a tied
    weight under either name. The manifest is returned as is when it has no
    aliases.
    """
    extra = {a: manifest.tensors[n] for a, n in aliases_of(manifest.values).items()
             if a not in manifest.tensors and n in manifest.tensors}
    if not extra:
        return manifest
    # v2 resolves a tensor's chunks by its stored name (index rows are keyed
    # by it): remember which stored tensor each alias stands for.
    alias_of = {a: n for a, n in aliases_of(manifest.values).items() if a in extra}
    return dataclasses.replace(
        manifest, tensors={**manifest.tensors, **extra}, extra={**manifest.extra, ALIAS_OF_KEY: alias_of}
    )


# --------------------------------------------------------------------------
# reading by path without a live state


def tree_paths(values: Any) -> Dict[str, Any]:
    """Every node of a values tree by its dotted path (string-keyed dicts and lists), root excluded."""
    out: Dict[str, Any] = {}

    def walk(node: Any, path: str) -> None:
        if path:
            out[path] = node
        if isinstance(node, dict) and TAG not in node:
            for k, v in node.items():
                walk(v, f"{path}.{k}" if path else str(k))
        elif isinstance(node, list):
            for i, v in enumerate(node):
                walk(v, f"{path}.{i}" if path else str(i))

    walk(values, "")
    return out


def select_paths(manifest: Manifest, keys: Union[str, Sequence[str], None]) -> Dict[str, Any]:
    """``{path: node}`` that ``keys`` ask of a checkpoint: tensor names and paths into its values tree.

    ``None`` asks for the top-level entries. A tensor name outside the tree
    (safetensors sources have no tree) maps to a reference to itself. Paths
    are matched like ``select_names`` (exact or glob; one matching nothing
    raises ``StateMismatchError``); a glob keeps only its outermost matches.
    """
    nodes = tree_paths(manifest.values)
    for name in manifest.tensors:
        nodes.setdefault(name, {TAG: "tensor", "name": name})
    if keys is None:
        tops = {p: n for p, n in nodes.items() if "." not in p or p in manifest.tensors and not _inside(p, nodes)}
        return tops
    picked = select_names(list(nodes), keys, what="keys")
    keep = set(picked)
    # "model.*" matches a module's entries and their sub-paths: keep the
    # outermost (each path's dotted prefixes looked up: linear in the paths).
    return {p: nodes[p] for p in picked if not _inside(p, keep)}


def _inside(path: str, nodes: Collection[str]) -> bool:
    """Whether a proper dotted prefix of ``path`` is in ``nodes`` (a set or dict: O(dots in the path))."""
    head = path
    while "." in head:
        head = head.rpartition(".")[0]
        if head in nodes:
            return True
    return False
