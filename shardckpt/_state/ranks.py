"""Plain values that differ across ranks: found at save, never silently dropped.

A multi-rank save writes the JSON tree of plain values (step counters,
scheduler state, a data loader's position) from rank 0 only: the other ranks
are assumed to hold the same values, as they do for global state. Values that
are not the same (torchtitan's per-rank data loader state under
``dp_rank_<r>``) would be lost on every rank but 0, and a resume would keep
their live values with no error. So every rank digests its tree, the digests
meet through the save's first agreement, and a difference is refused naming
the paths and the fix (wrap them in :class:`shardckpt.PerRank`, which keeps
one copy per rank).

Pure functions: ``value_digests`` (one rank's tree -> path -> digest) and
``differing_paths`` (every rank's digests -> the paths that differ).
"""

from __future__ import annotations

import hashlib
import json
from typing import Any, Dict, List, Optional, Sequence

from .values import TAG

__all__ = ["value_digests", "differing_paths", "DIGEST_DEPTH", "DIGEST_FANOUT"]

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
