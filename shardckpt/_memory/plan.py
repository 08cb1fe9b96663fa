"""Pure decisions of the memory tier: who holds whose copy, which step to restore, who sends what.

Everything here takes ints, strings and dicts and does no I/O, so it is
tested with plain values (``tests/unit/test_memory_plan.py``); the tier
(``_memory/tier.py``) feeds it what the ranks report and executes its answer.

Words: a *node* is one shared-memory directory (one host; in tests, one
directory per simulated host); a *holder* of a file is a live rank whose
node's directory holds it; a *copy* of rank r is the files r wrote for a
step (its data files and index file; rank 0 also the manifest).
"""

from __future__ import annotations

from typing import Dict, Iterable, List, Mapping, Optional, Sequence, Set, Tuple

from .._format.naming import parse_data_file_name

__all__ = [
    "default_peer",
    "peer_map",
    "senders_to",
    "writer_of",
    "files_by_writer",
    "Inventory",
    "choose_step",
    "holders_of",
    "assign_sources",
    "ranks_without_copy",
]

def default_peer(rank: int, world: int, ranks_per_node: int) -> Optional[int]:
    """Rank that keeps ``rank``'s copy: the same local rank on the next node, ``(rank + ranks_per_node) % world``.

    None when that is ``rank`` itself (one node: no other node to copy to).

    Example:
        >>> [default_peer(r, 4, 2) for r in range(4)]
        [2, 3, 0, 1]
        >>> default_peer(0, 2, 2) is None
        True
    """
    if world < 1 or ranks_per_node < 1:
        raise ValueError(f"world ({world}) and ranks_per_node ({ranks_per_node}) must be positive")
    p = (rank + ranks_per_node) % world
    return None if p == rank else p


def peer_map(world: int, ranks_per_node: int, custom: Optional[Mapping[int, int]] = None) -> Dict[int, Optional[int]]:
    """``rank -> peer rank (or None)`` for every rank: ``custom`` where given, else :func:`default_peer`.

    Raises:
        ValueError: a custom peer outside ``0..world-1``.
    """
    out: Dict[int, Optional[int]] = {}
    for r in range(world):
        if custom is not None and r in custom:
            p = custom[r]
            if p is not None and not (isinstance(p, int) and 0 <= p < world):
                raise ValueError(f"memory tier: peer of rank {r} is {p!r}, not a rank of 0..{world - 1}")
            out[r] = None if p == r else p
        else:
            out[r] = default_peer(r, world, ranks_per_node)
    return out


def senders_to(rank: int, peers: Mapping[int, Optional[int]]) -> List[int]:
    """Ranks whose copy ``rank`` keeps (the inverse of the peer map), ascending."""
    return sorted(r for r, p in peers.items() if p == rank)


def writer_of(rel: str, index_ranks: Mapping[str, int], manifest_name: str = "manifest.json") -> int:
    """The rank that wrote file ``rel`` of a checkpoint: from the data file name, the index table, or 0 (the manifest, anything else)."""
    if rel in index_ranks:
        return int(index_ranks[rel])
    name = parse_data_file_name(rel)
    return 0 if name is None else name.rank


def files_by_writer(files: Iterable[str], index_ranks: Mapping[str, int], manifest_name: str = "manifest.json") -> Dict[int, List[str]]:
    """``writer rank -> its files`` (sorted); the manifest goes with rank 0.

    Example:
        >>> files_by_writer(["data/ab-r00001-00.safetensors", "data/ab-index-r1.json", "manifest.json"], {"data/ab-index-r1.json": 1})
        {0: ['manifest.json'], 1: ['data/ab-index-r1.json', 'data/ab-r00001-00.safetensors']}
    """
    out: Dict[int, List[str]] = {}
    for rel in files:
        out.setdefault(writer_of(rel, index_ranks, manifest_name), []).append(rel)
    return {r: sorted(v) for r, v in sorted(out.items())}


def ranks_without_copy(peers: Mapping[int, Optional[int]], node_of: Mapping[int, str]) -> List[int]:
    """Ranks whose copy has no second holder: no peer, or a peer on their own node (one node: every rank).

    Example:
        >>> ranks_without_copy({0: None, 1: 0}, {0: "n0", 1: "n0"}), ranks_without_copy({0: 1, 1: 0}, {0: "n0", 1: "n1"})
        ([0, 1], [])
    """
    return sorted(r for r, p in peers.items() if p is None or node_of.get(p) == node_of.get(r))


#: What one rank reports: ``step -> (save_id, {file: size} the step needs, set of those files its node holds at that size)``.
Inventory = Dict[int, Tuple[str, Dict[str, int], Set[str]]]


def choose_step(inventories: Sequence[Inventory], storage_step: Optional[int]) -> Optional[Tuple[int, str]]:
    """The memory step to restore: ``(step, save_id)``, or None to restore ``storage_step`` from storage.

    A memory step is complete when the union of the live ranks' nodes holds
    every file of it (copies of one save: same step and save id). The
    newest complete one wins if it is at least as new as ``storage_step``
    (at the same step, memory is the cheaper source).

    Example:
        >>> a = {5: ("s5", {"m": 1, "d0": 4, "d1": 4}, {"m", "d0"})}
        >>> b = {5: ("s5", {"m": 1, "d0": 4, "d1": 4}, {"d1"})}
        >>> choose_step([a, b], storage_step=0), choose_step([a], storage_step=0), choose_step([a, b], 10)
        ((5, 's5'), None, None)
    """
    need: Dict[Tuple[int, str], Dict[str, int]] = {}
    have: Dict[Tuple[int, str], Set[str]] = {}
    for inv in inventories:
        for step, (sid, files, held) in inv.items():
            key = (int(step), sid)
            if key in need and need[key] != files:
                continue  # two manifests of one save disagree: one is damaged; the copies that agree decide
            need.setdefault(key, dict(files))
            have.setdefault(key, set()).update(f for f in held if f in need[key])
    complete = [k for k in need if have.get(k, set()) >= set(need[k])]
    if not complete:
        return None
    best = max(complete)  # newest step; among two saves of one step, any (save ids order them arbitrarily)
    if storage_step is not None and best[0] < storage_step:
        return None
    return best


def holders_of(inventories: Sequence[Inventory], step: int, save_id: str) -> Tuple[Dict[str, List[int]], Dict[str, int]]:
    """Who holds each file of one save of ``step``: ``({file: [ranks whose node holds it]}, {file: size})``.

    ``inventories[r]`` is rank ``r``'s report; a report of another save of
    the step (or none) contributes nothing. The step is whole when every
    file of ``sizes`` has a holder (:func:`choose_step` decides that).

    Example:
        >>> a = {5: ("s5", {"m": 1, "d0": 4, "d1": 4}, {"m", "d0"})}
        >>> b = {5: ("s5", {"m": 1, "d0": 4, "d1": 4}, {"m", "d1"})}
        >>> holders_of([a, a, b, {}], 5, "s5")
        ({'d0': [0, 1], 'm': [0, 1, 2], 'd1': [2]}, {'m': 1, 'd0': 4, 'd1': 4})
    """
    holders: Dict[str, List[int]] = {}
    sizes: Dict[str, int] = {}
    for r, inv in enumerate(inventories):
        entry = inv.get(step)
        if entry is None or entry[0] != save_id:
            continue
        sizes.update(entry[1])
        for rel in sorted(entry[2]):
            holders.setdefault(rel, []).append(r)
    return holders, sizes


def assign_sources(
    needs: Mapping[int, Iterable[str]],
    holders: Mapping[str, Sequence[int]],
    node_of: Mapping[int, str],
    sizes: Mapping[str, int],
    bad: Iterable[Tuple[str, str]] = (),
) -> Tuple[List[Tuple[int, int, str]], Dict[int, List[str]]]:
    """Who sends each file a rank still needs: ``([(src, dst, file)] in send order, {dst: files nobody can send})``.

    Args:
        needs: rank -> files it lacks (its own node's copy is missing or bad).
        holders: file -> live ranks whose node holds it.
        node_of: rank -> its node (directory) name; a node is one copy.
        sizes: file -> bytes (to spread the sending work).
        bad: ``(node, file)`` copies found damaged: never chosen again.

    A holder on the needing rank's own node is never chosen (that copy is the
    one that is missing or bad); among the others, the one with the fewest
    bytes to send so far (ties: lowest rank), so the work spreads over the
    holders. Deterministic: every rank computes the same answer.

    Example:
        >>> assign_sources({2: ["a"], 3: ["b"]}, {"a": [0, 1], "b": [0, 1]}, {0: "n0", 1: "n0", 2: "n1", 3: "n1"}, {"a": 4, "b": 4})
        ([(0, 2, 'a'), (1, 3, 'b')], {})
    """
    bad_set = set(bad)
    load: Dict[int, int] = {}
    sends: List[Tuple[int, int, str]] = []
    missing: Dict[int, List[str]] = {}
    for dst in sorted(needs):
        for rel in sorted(set(needs[dst])):
            own = node_of.get(dst)
            cands = [
                h for h in holders.get(rel, ())
                if h != dst and node_of.get(h) != own and (node_of.get(h), rel) not in bad_set
            ]
            if not cands:
                missing.setdefault(dst, []).append(rel)
                continue
            src = min(cands, key=lambda h: (load.get(h, 0), h))
            load[src] = load.get(src, 0) + int(sizes.get(rel, 0))
            sends.append((src, dst, rel))
    return sends, missing
