"""The layer order of docs/architecture.md, held as data and checked against every import.

Every module of the package (and of ``converters/``, installed as
``shardckpt.converters``) is parsed with ``ast``; every import it runs —
module-level or inside a function, but not under ``if TYPE_CHECKING:`` — is
an edge between two modules. The tests fail, naming file and line, on:

* an edge that runs up the layers (a lower layer importing a higher one);
* a circle between modules (any strongly connected group of two or more);
* a function-local import of one of our modules that is not listed in
  ``LOCAL_IMPORTS`` with its reason (a function-local import is for
  cheapness only — keeping torch, the converters or a backend out of a
  light import — never to hide a circle);
* docs/architecture.md's module map not listing exactly the modules that
  exist, each in the layer this table gives it.

Pure (no imports of the package, no subprocesses): well under a second.
A new module needs a row in ``LAYERS`` (or a package prefix already there)
and a row in docs/architecture.md's module map.
"""

from __future__ import annotations

import ast
import re
from pathlib import Path
from typing import Dict, Iterator, List, Optional, Set, Tuple

ROOT = Path(__file__).resolve().parents[2]
ARCHITECTURE = ROOT / "docs" / "architecture.md"

#: Layer of each module, by dotted name or package prefix (the longest match
#: wins); a module may import its own layer or lower ones (larger numbers),
#: never a higher one. The order and names are docs/architecture.md's.
LAYERS: Dict[str, int] = {
    # 0. the public face: lazy names, `python -m shardckpt`
    "shardckpt": 0,
    "shardckpt.__main__": 0,
    # 1. what users call
    "shardckpt._cli": 1,
    "shardckpt._manager": 1,
    "shardckpt.converters": 1,
    "shardckpt.integrations": 1,
    # 2. engine: save, load, async, inspect/verify
    "shardckpt._save": 2,
    "shardckpt._union": 2,
    "shardckpt._fingerprint": 2,
    "shardckpt._load": 2,
    "shardckpt._async": 2,
    "shardckpt._flush": 2,
    "shardckpt._writerproc": 2,
    "shardckpt._verify": 2,
    # (issues 23 and 24, landing in the same wave: the rows are ready for them)
    "shardckpt._incremental": 2,
    "shardckpt._memory": 2,
    # the manager's parts (retention, restore order, owners, memory glue): engine-level, so _flush may use them
    "shardckpt._managed": 2,
    "shardckpt._managed.exports": 1,  # calls the converters (users)
    # 3. state: app state <-> flat map of tensors and values
    "shardckpt._state": 3,
    "shardckpt._rng": 3,
    "shardckpt._runtimes": 3,
    "shardckpt._hf": 3,
    # 4. live layout: a live tensor -> the boxes this rank holds
    "shardckpt._layout": 4,
    # 5. tensor bytes: the one writer, the one verified reader, replicated reads
    "shardckpt._io": 5,
    "shardckpt._readers": 5,
    "shardckpt._replicas": 5,
    # 6. format (torch-free)
    "shardckpt._format": 6,
    # 7. geometry (pure ints)
    "shardckpt._geometry": 7,
    # 8. storage and cross-rank exchange
    "shardckpt._storage": 8,
    "shardckpt._collective": 8,
    # 9. importable from every layer
    "shardckpt._knobs": 9,
    "shardckpt.errors": 9,
    "shardckpt._version": 9,
}

#: The layer names of docs/architecture.md's module map, by number.
LAYER_NAMES = {
    0: "public",
    1: "users",
    2: "engine",
    3: "state",
    4: "layout",
    5: "bytes",
    6: "format",
    7: "geometry",
    8: "storage",
    9: "everywhere",
}

#: The function-local imports of our own modules that are allowed, with why:
#: (importer, imported) -> reason. Each one keeps something heavy (torch, the
#: converters, a storage backend) out of an import that must stay light.
LOCAL_IMPORTS: Dict[Tuple[str, str], str] = {
    # `shardckpt --help/--version` and `inspect`/`verify` load only what the subcommand needs (no torch).
    ("shardckpt._cli", "shardckpt._format"): "CLI start-up: format only for the subcommands that read",
    ("shardckpt._cli", "shardckpt._storage"): "CLI start-up: storage backends only when a URL is opened",
    ("shardckpt._cli", "shardckpt._verify"): "CLI start-up",
    ("shardckpt._cli", "shardckpt._format.refs"): "CLI start-up: format only for the subcommands that read",
    ("shardckpt._cli", "shardckpt._manager"): "CLI start-up: `gc` imports the manager (torch)",
    ("shardckpt._cli", "shardckpt.converters"): "CLI start-up: the converters import torch",
    ("shardckpt._cli", "shardckpt.converters._diff"): "CLI start-up: the converters import torch",
    # The storage package costs more to import than the whole format layer
    # (S3 clients): a caller passing a Storage never pays for it.
    ("shardckpt._format.committed", "shardckpt._storage"): "storage backends load only when a URL string is opened",
    ("shardckpt._verify", "shardckpt._storage"): "storage backends load only when a URL string is opened",
    # The converters import every converter (DCP's unpickler, torch.save's reader, ...).
    ("shardckpt._managed.exports", "shardckpt.converters"): "the converters load only for last_save_in_hf exports",
    ("shardckpt._managed.exports", "shardckpt.converters._options"): "the converters load only when export_dtype is given",
}

#: Circles not broken yet, each with who breaks it (issue 22's other parts
#: restructure these very modules). The test fails on any circle not listed
#: here and on a listed one that is gone, so the list only shrinks.
KNOWN_CIRCLES: Dict[Tuple[str, ...], str] = {}


# --------------------------------------------------------------------------
# the modules and their imports


def _modules() -> Dict[str, Path]:
    """Every module of the package: dotted name -> file (converters/ is shardckpt.converters)."""
    out = {}
    for base, prefix in ((ROOT / "shardckpt", "shardckpt"), (ROOT / "converters", "shardckpt.converters")):
        for f in sorted(base.rglob("*.py")):
            parts = list(f.relative_to(base).with_suffix("").parts)
            if parts[-1] == "__init__":
                parts = parts[:-1]
            out[".".join([prefix] + parts)] = f
    return out


MODULES = _modules()


def layer_of(module: str) -> Optional[int]:
    """The layer of ``module``: its own row of LAYERS, else its longest package prefix's (None: unknown)."""
    parts = module.split(".")
    for n in range(len(parts), 0, -1):
        got = LAYERS.get(".".join(parts[:n]))
        if got is not None and (n == len(parts) or n > 1):
            return got
    return None


def _type_checking_nodes(tree: ast.AST) -> Set[int]:
    """ids of import nodes under ``if TYPE_CHECKING:`` (never run)."""
    out: Set[int] = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.If):
            t = node.test
            name = t.id if isinstance(t, ast.Name) else t.attr if isinstance(t, ast.Attribute) else None
            if name == "TYPE_CHECKING":
                for n in node.body:
                    out.update(id(x) for x in ast.walk(n))
    return out


def _local_nodes(tree: ast.AST) -> Set[int]:
    """ids of nodes inside a function body (function-local imports)."""
    out: Set[int] = set()
    for node in ast.walk(tree):
        if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef, ast.Lambda)):
            out.update(id(x) for x in ast.walk(node) if x is not node)
    return out


Edge = Tuple[str, str, int, bool]  # importer, imported, line, function-local


def imports_of(module: str, path: Path) -> Iterator[Edge]:
    """Edges from ``module`` to our modules it imports at run time."""
    tree = ast.parse(path.read_text(encoding="utf-8"), filename=str(path))
    skip, local = _type_checking_nodes(tree), _local_nodes(tree)
    is_pkg = path.name == "__init__.py"
    for node in ast.walk(tree):
        if id(node) in skip:
            continue
        targets: List[str] = []
        if isinstance(node, ast.Import):
            targets = [a.name for a in node.names]
        elif isinstance(node, ast.ImportFrom):
            if node.level:
                base = module.split(".") if is_pkg else module.split(".")[:-1]
                base = base[: len(base) - (node.level - 1)]
                src = ".".join(base + ([node.module] if node.module else []))
            else:
                src = node.module or ""
            # `from pkg import mod` imports the module; `from pkg import name` the package.
            targets = [f"{src}.{a.name}" if f"{src}.{a.name}" in MODULES else src for a in node.names]
        for t in dict.fromkeys(targets):
            # converters/ imports itself as shardckpt.converters; anything else outside is third-party.
            if t in MODULES and t != module:
                yield module, t, node.lineno, id(node) in local


EDGES: List[Edge] = [e for m, p in MODULES.items() for e in imports_of(m, p)]


def _where(e: Edge) -> str:
    return f"{MODULES[e[0]].relative_to(ROOT)}:{e[2]} ({e[0]} -> {e[1]})"


# --------------------------------------------------------------------------
# the checks


def test_every_module_has_a_layer():
    unknown = sorted(m for m in MODULES if layer_of(m) is None)
    assert not unknown, f"modules with no layer (add them to LAYERS here and to docs/architecture.md's module map): {unknown}"


def test_no_import_runs_up_the_layers():
    # (a module with no layer is reported by the test above)
    up = [e for e in EDGES if None not in (layer_of(e[0]), layer_of(e[1])) and layer_of(e[1]) < layer_of(e[0])]
    assert not up, "imports that run up the layers (import from a lower layer, or move the shared piece down):\n" + "\n".join(
        f"  {_where(e)}: layer {layer_of(e[0])} {LAYER_NAMES[layer_of(e[0])]} imports layer {layer_of(e[1])} {LAYER_NAMES[layer_of(e[1])]}"
        for e in up
    )


def circles(edges: List[Edge]) -> List[List[str]]:
    """Strongly connected groups of two or more modules (Tarjan, iterative), each sorted."""
    graph: Dict[str, Set[str]] = {}
    for a, b, _, _ in edges:
        graph.setdefault(a, set()).add(b)
        graph.setdefault(b, set())
    index: Dict[str, int] = {}
    low: Dict[str, int] = {}
    stack: List[str] = []
    on: Set[str] = set()
    out: List[List[str]] = []
    for root in sorted(graph):
        if root in index:
            continue
        work = [(root, iter(sorted(graph[root])))]
        index[root] = low[root] = len(index)
        stack.append(root)
        on.add(root)
        while work:
            v, it = work[-1]
            w = next(it, None)
            if w is not None:
                if w not in index:
                    index[w] = low[w] = len(index)
                    stack.append(w)
                    on.add(w)
                    work.append((w, iter(sorted(graph[w]))))
                elif w in on:
                    low[v] = min(low[v], index[w])
                continue
            work.pop()
            if work:
                low[work[-1][0]] = min(low[work[-1][0]], low[v])
            if low[v] == index[v]:
                group = []
                while True:
                    w = stack.pop()
                    on.discard(w)
                    group.append(w)
                    if w == v:
                        break
                if len(group) > 1:
                    out.append(sorted(group))
    return sorted(out)


def test_circles_finds_a_circle():
    # The detector itself: a -> b -> c -> a is one circle; d hangs off it.
    edges = [("a", "b", 1, False), ("b", "c", 1, True), ("c", "a", 1, False), ("c", "d", 1, False)]
    assert circles(edges) == [["a", "b", "c"]]
    assert circles(edges[:2]) == []


def _in_known_circle(e: Edge) -> bool:
    return any(e[0] in group and e[1] in group for group in KNOWN_CIRCLES)


def test_no_import_circles():
    all_found = circles(EDGES)
    gone = sorted(set(KNOWN_CIRCLES) - {tuple(g) for g in all_found})
    assert not gone, f"circles listed in KNOWN_CIRCLES are broken now (remove them from the list): {gone}"
    found = [g for g in all_found if tuple(g) not in KNOWN_CIRCLES]
    lines = []
    for group in found:
        inside = [e for e in EDGES if e[0] in group and e[1] in group]
        lines.append(f"  {' <-> '.join(group)}:\n" + "\n".join(f"      {_where(e)}{' (function-local)' if e[3] else ''}" for e in inside))
    assert not found, "import circles (move the shared piece down a layer, or invert the dependency):\n" + "\n".join(lines)


def test_function_local_imports_are_listed_with_their_reason():
    local = {}
    for e in EDGES:
        if e[3] and not _in_known_circle(e):
            local.setdefault((e[0], e[1]), []).append(e)
    unlisted = [es[0] for k, es in sorted(local.items()) if k not in LOCAL_IMPORTS]
    stale = sorted(k for k in LOCAL_IMPORTS if k not in local)
    assert not unlisted, (
        "function-local imports of our modules not listed in LOCAL_IMPORTS (import at module level; "
        "keep one local only to keep something heavy out of a light import, and list it with why):\n"
        + "\n".join(f"  {_where(e)}" for e in unlisted)
    )
    assert not stale, f"LOCAL_IMPORTS lists imports that no longer exist (remove them): {stale}"
    assert all(reason.strip() for reason in LOCAL_IMPORTS.values())


# --------------------------------------------------------------------------
# the map is the territory


def documented_modules(text: str) -> Dict[str, str]:
    """docs/architecture.md's module map: ``| `dotted.name` | layer | role |`` rows -> layer name."""
    out = {}
    for m in re.finditer(r"^\|\s*`(shardckpt[\w.]*)`\s*\|\s*([\w-]+)\s*\|", text, re.M):
        out[m.group(1)] = m.group(2)
    return out


def test_architecture_doc_lists_exactly_the_modules_that_exist():
    documented = documented_modules(ARCHITECTURE.read_text(encoding="utf-8"))
    missing = sorted(set(MODULES) - set(documented))
    gone = sorted(set(documented) - set(MODULES))
    assert not missing, f"modules docs/architecture.md's module map does not list: {missing}"
    assert not gone, f"docs/architecture.md lists modules that do not exist: {gone}"
    wrong = {m: (doc, LAYER_NAMES[layer_of(m)]) for m, doc in documented.items() if doc != LAYER_NAMES[layer_of(m)]}
    assert not wrong, f"docs/architecture.md puts these modules in another layer than LAYERS (doc, test): {wrong}"


def test_architecture_doc_names_no_file_that_does_not_exist():
    # Every `something.py` the page mentions is a file of the package (or a test or benchmark it points to).
    names = {p.name for d in ("shardckpt", "converters", "tests", "benchmarks", "examples") for p in (ROOT / d).rglob("*.py")}
    mentioned = set(re.findall(r"\b(_?\w+\.py)\b", ARCHITECTURE.read_text(encoding="utf-8")))
    assert not mentioned - names, f"docs/architecture.md names files that do not exist: {sorted(mentioned - names)}"
