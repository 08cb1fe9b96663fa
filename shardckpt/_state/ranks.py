"""Plain values that differ across ranks: found at save, never silently dropped.

A multi-rank save writes one JSON tree of plain values (step counters,
scheduler state, a data loader's position), written by rank 0. Ranks may
hold different paths (pipeline stages each hold their optimizer's state):
the tree saved is their union. A path held by several ranks with different
values (a per-rank position under one key) would keep one rank's value and
lose the others', so it is refused naming the paths and the fix (wrap them
in :class:`shardckpt.PerRank`, which keeps one copy per rank).

A save is a rank-union (``_union``): rank 0 receives one value tree per
distinct tree and merges them with ``merge_values``; a path held by several
ranks must agree, a path held by some ranks only is kept.

Pure functions: ``merge_values`` (distinct trees -> the union and the paths
that differ), ``value_digests`` (one rank's tree -> path -> digest) and
``differing_paths`` (several ranks' digests -> the paths that differ).
"""

from __future__ import annotations

import hashlib
import json
from typing import Any, Dict, List, Optional, Sequence, Tuple

from .._format.values import TAG

__all__ = ["value_digests", "differing_paths", "merge_values", "DIGEST_DEPTH", "DIGEST_FANOUT"]

#: How deep into nested dicts a difference is located (deeper ones are named
#: by their ancestor at this depth).
DIGEST_DEPTH = 6
#: A dict with more keys than this is digested whole (bounds the digests sent).
DIGEST_FANOUT = 256


def _digest(node: Any) -> str:
    text = json.dumps(node, sort_keys=True, separators=(",", ":"), default=repr)
    return hashlib.blake2b(text.encode("utf-8", "surrogatepass"), digest_size=8).hexdigest()


def value_digests(tree: Any, *, depth: int = DIGEST_DEPTH, fanout: int = DIGEST_FANOUT) -> Dict[str, str]:
    """``path -> digest`` of the encoded value tree's nodes, down to ``depth`` levels of plain dicts.

    Dict key order does not count (ranks may build a state in different
    orders); lists, tuples and tagged values are digested whole.

    Example:
        >>> sorted(value_digests({"a": {"b": 1}, "c": [1, 2]}))
        ['a', 'a.b', 'c']
    """
    out: Dict[str, str] = {}

    def visit(node: Any, path: str, level: int) -> None:
        out[path] = _digest(node)
        if level < depth and isinstance(node, dict) and TAG not in node and len(node) <= fanout:
            for k, v in node.items():
                visit(v, f"{path}.{k}", level + 1)

    if isinstance(tree, dict):
        for k, v in tree.items():
            visit(v, str(k), 1)
    return out


def differing_paths(per_rank: Sequence[Optional[Dict[str, str]]]) -> List[str]:
    """The deepest paths whose digests (or presence) differ between ranks, sorted.

    Example:
        >>> differing_paths([{"a": "1", "a.x": "2"}, {"a": "3", "a.x": "4"}])
        ['a.x']
    """
    maps = [m for m in per_rank if m is not None]
    if len(maps) < 2:
        return []
    paths = set().union(*maps)
    absent = {p for p in paths if any(p not in m for m in maps)}
    differ = {p for p in paths - absent if len({m[p] for m in maps}) > 1}

    def ancestors(p: str):
        parts = p.split(".")
        return (".".join(parts[:i]) for i in range(1, len(parts)))

    # A subtree one rank lacks is named at its top; differing values at their
    # deepest node (an ancestor differs because of it).
    named = {p for p in absent if not any(a in absent for a in ancestors(p))}
    below = {a for p in differ | absent for a in ancestors(p)}
    named |= {p for p in differ if p not in below}
    return sorted(named)


class _Conflict(Exception):
    pass


def _is_group_list(node: Any) -> bool:
    """An optimizer's ``param_groups``: a list of dicts, each with a ``params`` list of names."""
    return isinstance(node, list) and all(
        isinstance(g, dict) and TAG not in g and isinstance(g.get("params"), list) for g in node
    )


def merge_values(trees: Sequence[Any]) -> Tuple[Any, List[str]]:
    """The union of several ranks' value trees, and the paths where they disagree.

    A rank-union save keeps a value held by some ranks only (a pipeline
    stage's optimizer state); a path held by several ranks must hold the same
    value. Dicts merge by key; an optimizer's ``param_groups`` (a list of
    dicts with a ``params`` list of names, as pipeline stages each hold for
    their own parameters) merge group by group: the hyperparameters must be
    equal, the ``params`` lists are joined in order. Anything else must be
    equal.

    Args:
        trees: the distinct encoded value trees (one per group of ranks).

    Returns:
        ``(merged tree, sorted differing paths)``; the tree is meaningless
        when paths are returned.

    Example:
        >>> merge_values([{"a": 1, "s": {"x": 1}}, {"a": 1, "s": {"y": 2}}])
        ({'a': 1, 's': {'x': 1, 'y': 2}}, [])
        >>> merge_values([{"a": 1}, {"a": 2}])[1]
        ['a']
    """
    bad: List[str] = []

    def same(nodes: Sequence[Any]) -> bool:
        first = _digest(nodes[0])
        return all(_digest(n) == first for n in nodes[1:])

    def merge(nodes: Sequence[Any], path: str) -> Any:
        if len(nodes) == 1 or same(nodes):
            return nodes[0]
        if all(isinstance(n, dict) and TAG not in n for n in nodes):
            out: Dict[str, Any] = {}
            for n in nodes:
                for k in n:
                    if k not in out:
                        out[k] = merge([m[k] for m in nodes if k in m], f"{path}.{k}" if path else str(k))
            return out
        if all(_is_group_list(n) for n in nodes) and len({len(n) for n in nodes}) == 1:
            groups = []
            for i in range(len(nodes[0])):
                gs = [n[i] for n in nodes]
                hyper = [{k: v for k, v in g.items() if k != "params"} for g in gs]
                if not same(hyper):
                    merge(hyper, f"{path}.{i}")  # names the differing hyperparameters
                    continue
                names: List[Any] = []
                seen = set()
                for g in gs:
                    for p in g["params"]:
                        key = json.dumps(p, sort_keys=True)
                        if key not in seen:
                            seen.add(key)
                            names.append(p)
                groups.append(dict(hyper[0], params=names))
            return groups
        bad.append(path)
        return nodes[0]

    if not trees:
        return {}, []
    merged = merge(list(trees), "")
    return merged, sorted(bad)
