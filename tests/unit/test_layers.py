"""The layer order of docs/architecture.md, held as data and checked against every import.

Every module of the package (and of ``converters/``, installed as
``shardckpt.converters``) is parsed with ``ast``; every import it has —
module-level, inside a function, or under ``if TYPE_CHECKING:`` (a type-only
import is still a dependency a reader must follow) — is an edge between two
modules. The tests fail, naming file and line, on:

* an edge that runs up the layers (a lower layer importing a higher one);
* a circle between modules (any strongly connected group of two or more),
  type-checking imports included;
* an import of another module's ``_private`` name (``from ._x import _name``,
  at module level, in a function or under ``TYPE_CHECKING``), or a use of one
  through an imported module of ours (``_x._name``): a name used across
  modules is public within the package (no underscore, in the module's
  ``__all__``) while the module itself stays private (``_x.py``);
* a use of another module's class's ``_private`` member (``tier._start()``
  on an object whose class another module defines; ``self.``/``cls.``/
  ``super().`` are the class's own business): by name, as a reader sees
  it: a private member name some class of another module defines, used
  here on anything but ``self``/``cls``, where no class of this module
  defines it; the few left are listed in ``MEMBER_USES`` with who removes
  them;
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
    "shardckpt._fp8": 5,  # block-FP8 math on streamed pieces (the load's dequantize, the export's quantize)
    # 6. format (torch-free)
    "shardckpt._format": 6,
    # 7. geometry (pure ints)
    "shardckpt._geometry": 7,
    # 8. storage and cross-rank exchange
    "shardckpt._storage": 8,
    "shardckpt._collective": 8,
    "shardckpt._p2p": 8,  # the wire: point-to-point tensors between ranks, with _collective's liveness
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

#: Uses of another module's class's private members not removed yet:
#: (module, member) -> who removes them. The test fails on any use not listed
#: here and on a listed one that is gone, so the list only shrinks.
MEMBER_USES: Dict[Tuple[str, str], str] = {
    ("shardckpt._memory.restore", "_start"): "issue 48 (the manager's one restore): the memory restore starts the tier through its API",
    ("shardckpt._memory.restore", "_node_key"): "issue 48 (the manager's one restore): the tier's node key becomes public or moves",
}

#: Circles not broken yet (type-checking imports included), each with who
#: breaks it. The test fails on any circle not listed here and on a listed one
#: that is gone, so the list only shrinks; it must end empty.
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
# C extensions (setup.py builds each shardckpt/**/x.c as the module beside it): in the module map, not in the import graph.
EXTENSIONS = {"shardckpt." + ".".join(f.relative_to(ROOT / "shardckpt").with_suffix("").parts): f for f in sorted((ROOT / "shardckpt").rglob("*.c"))}


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


def _source_of(node: ast.ImportFrom, module: str, is_pkg: bool) -> str:
    """The dotted module a ``from ... import`` reads from (relative levels resolved against ``module``)."""
    if not node.level:
        return node.module or ""
    base = module.split(".") if is_pkg else module.split(".")[:-1]
    base = base[: len(base) - (node.level - 1)]
    return ".".join(base + ([node.module] if node.module else []))


def _parse(path: Path) -> ast.AST:
    return ast.parse(path.read_text(encoding="utf-8"), filename=str(path))


def imports_of(module: str, tree: ast.AST, *, is_pkg: bool, type_only: bool = False) -> Iterator[Edge]:
    """Edges from ``module`` to our modules it imports: at run time, or (``type_only``) only under ``TYPE_CHECKING``."""
    tc, local = _type_checking_nodes(tree), _local_nodes(tree)
    for node in ast.walk(tree):
        if (id(node) in tc) != type_only:
            continue
        targets: List[str] = []
        if isinstance(node, ast.Import):
            targets = [a.name for a in node.names]
        elif isinstance(node, ast.ImportFrom):
            src = _source_of(node, module, is_pkg)
            # `from pkg import mod` imports the module; `from pkg import name` the package.
            targets = [f"{src}.{a.name}" if f"{src}.{a.name}" in MODULES else src for a in node.names]
        for t in dict.fromkeys(targets):
            # converters/ imports itself as shardckpt.converters; anything else outside is third-party.
            if t in MODULES and t != module:
                yield module, t, node.lineno, id(node) in local


TREES: Dict[str, ast.AST] = {m: _parse(p) for m, p in MODULES.items()}
EDGES: List[Edge] = [e for m, p in MODULES.items() for e in imports_of(m, TREES[m], is_pkg=p.name == "__init__.py")]
#: Imports under ``if TYPE_CHECKING:``: never run, but a reader follows them (circles count them).
TYPE_EDGES: List[Edge] = [
    e for m, p in MODULES.items() for e in imports_of(m, TREES[m], is_pkg=p.name == "__init__.py", type_only=True)
]


def _where(e: Edge) -> str:
    return f"{MODULES[e[0]].relative_to(ROOT)}:{e[2]} ({e[0]} -> {e[1]})"


def _is_private(name: str) -> bool:
    return name.startswith("_") and not name.startswith("__")


def private_uses(module: str, tree: ast.AST, *, is_pkg: bool) -> List[Tuple[int, str]]:
    """``(line, what)`` for each use in ``module`` of another module's ``_private`` name.

    Two kinds: ``from <ours> import _name`` (anywhere: module level, in a
    function, under ``TYPE_CHECKING``; importing a private *module*, ``from .
    import _x``, is fine), and ``<ours>._name`` where ``<ours>`` is a name the
    file binds to one of our modules (``from . import _x``, ``import
    shardckpt._x as y``, ``import shardckpt._x`` then ``shardckpt._x._name``).
    """
    out: List[Tuple[int, str]] = []
    bound: Dict[str, str] = {}  # local name -> our module it names (whole file: shadowing is not tracked)
    for node in ast.walk(tree):
        if isinstance(node, ast.ImportFrom):
            src = _source_of(node, module, is_pkg)
            for a in node.names:
                full = f"{src}.{a.name}"
                if full in MODULES:
                    bound[a.asname or a.name] = full
                elif src in MODULES and src != module and _is_private(a.name):
                    out.append((node.lineno, f"imports {a.name} from {src}"))
        elif isinstance(node, ast.Import):
            for a in node.names:
                if a.name in MODULES:
                    bound[a.asname or a.name.split(".")[0]] = a.name if a.asname else a.name.split(".")[0]

    def module_named(expr: ast.expr) -> Optional[str]:
        """The module of ours ``expr`` names (``_x``, ``shardckpt._format._v2``), or None."""
        if isinstance(expr, ast.Name):
            return bound.get(expr.id)
        if isinstance(expr, ast.Attribute):
            parent = module_named(expr.value)
            if parent is not None and f"{parent}.{expr.attr}" in MODULES:
                return f"{parent}.{expr.attr}"
        return None

    for node in ast.walk(tree):
        if isinstance(node, ast.Attribute) and _is_private(node.attr):
            owner = module_named(node.value)
            if owner is not None and owner != module and f"{owner}.{node.attr}" not in MODULES:
                out.append((node.lineno, f"uses {owner}.{node.attr}"))
    return sorted(out)


# --------------------------------------------------------------------------
# the checks


def test_every_module_has_a_layer():
    unknown = sorted(m for m in MODULES if layer_of(m) is None)
    assert not unknown, f"modules with no layer (add them to LAYERS here and to docs/architecture.md's module map): {unknown}"


def test_no_import_runs_up_the_layers():
    # (a module with no layer is reported by the test above)
    up = [e for e in EDGES + TYPE_EDGES if None not in (layer_of(e[0]), layer_of(e[1])) and layer_of(e[1]) < layer_of(e[0])]
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


def test_type_checking_imports_are_edges():
    # A type-only import is an edge of its own kind; the run-time edges leave it out.
    src = "from typing import TYPE_CHECKING\nif TYPE_CHECKING:\n    from .walk import FlatLoad\nfrom .base import Adapter\n"
    tree = ast.parse(src)
    runtime = list(imports_of("shardckpt._state.adapters", tree, is_pkg=False))
    typed = list(imports_of("shardckpt._state.adapters", tree, is_pkg=False, type_only=True))
    assert [e[1] for e in runtime] == ["shardckpt._state.base"]
    assert [(e[1], e[2]) for e in typed] == [("shardckpt._state.walk", 3)]


def test_no_import_circles():
    # Type-checking imports included: a type-only import is a dependency a reader follows all the same.
    all_found = circles(EDGES + TYPE_EDGES)
    gone = sorted(set(KNOWN_CIRCLES) - {tuple(g) for g in all_found})
    assert not gone, f"circles listed in KNOWN_CIRCLES are broken now (remove them from the list): {gone}"
    found = [g for g in all_found if tuple(g) not in KNOWN_CIRCLES]
    lines = []
    for group in found:
        inside = [(e, "function-local" if e[3] else "") for e in EDGES if e[0] in group and e[1] in group]
        inside += [(e, "type-checking") for e in TYPE_EDGES if e[0] in group and e[1] in group]
        lines.append(f"  {' <-> '.join(group)}:\n" + "\n".join(f"      {_where(e)}{f' ({why})' if why else ''}" for e, why in inside))
    assert not found, "import circles (move the shared piece down a layer, or invert the dependency):\n" + "\n".join(lines)


def test_private_use_detector_finds_each_kind():
    src = """
from typing import TYPE_CHECKING
from . import _writerproc
from . import _writerproc as wp
from ._writerproc import _WRITER, get_writer
from ._format import _v2
import shardckpt._writerproc
if TYPE_CHECKING:
    from ._collective import _Hidden
def f():
    from ._layout import _local
    return _writerproc._WRITER, wp._WRITER, shardckpt._writerproc._WRITER, _v2.read_index, wp.__name__, _own()
"""
    got = private_uses("shardckpt._async", ast.parse(src), is_pkg=False)
    assert got == [
        (5, "imports _WRITER from shardckpt._writerproc"),
        (9, "imports _Hidden from shardckpt._collective"),
        (11, "imports _local from shardckpt._layout"),
        (12, "uses shardckpt._writerproc._WRITER"),
        (12, "uses shardckpt._writerproc._WRITER"),
        (12, "uses shardckpt._writerproc._WRITER"),
    ], got
    # Its own private names, private modules, dunders and other packages' private names are fine.
    ok = "from ._format import _v2\nfrom torch.nn.modules.module import _EXTRA_STATE_KEY_SUFFIX\nfrom .optim import _x\n"
    assert private_uses("shardckpt._state.optim", ast.parse(ok), is_pkg=False) == []


def test_no_module_uses_another_modules_private_names():
    found = [
        f"  {MODULES[m].relative_to(ROOT)}:{line}: {what}"
        for m, p in MODULES.items()
        for line, what in private_uses(m, TREES[m], is_pkg=p.name == "__init__.py")
    ]
    assert not found, (
        f"{len(found)} uses of another module's _private name (make the name public within the package: drop the "
        "underscore, add it to the module's __all__, and keep the module private):\n" + "\n".join(found)
    )


def private_members(tree: ast.AST) -> Set[str]:
    """The ``_private`` member names the classes of a module define: methods, class attributes, ``self._x = ...``."""
    out: Set[str] = set()
    for cls in ast.walk(tree):
        if not isinstance(cls, ast.ClassDef):
            continue
        for st in cls.body:
            if isinstance(st, (ast.FunctionDef, ast.AsyncFunctionDef)):
                out.add(st.name)
            elif isinstance(st, ast.Assign):
                out.update(t.id for t in st.targets if isinstance(t, ast.Name))
            elif isinstance(st, ast.AnnAssign) and isinstance(st.target, ast.Name):
                out.add(st.target.id)
        for n in ast.walk(cls):
            if isinstance(n, ast.Attribute) and isinstance(n.ctx, ast.Store) and isinstance(n.value, ast.Name) and n.value.id in ("self", "cls"):
                out.add(n.attr)
    return {n for n in out if _is_private(n)}


def member_uses(module: str, tree: ast.AST, owners: Dict[str, Set[str]]) -> List[Tuple[int, str, str]]:
    """``(line, member, owner module)`` for each use in ``module`` of a private member another module's class defines.

    ``owners``: member name -> modules whose classes define it. A use on
    ``self``, ``cls`` or ``super()`` is the class's own; a name this module's
    classes define too is taken as this module's (a reader cannot tell the
    object's class from the name alone).
    """
    mine = private_members(tree)
    out = []
    for node in ast.walk(tree):
        if not (isinstance(node, ast.Attribute) and _is_private(node.attr)) or node.attr in mine:
            continue
        v = node.value
        if isinstance(v, ast.Name) and v.id in ("self", "cls"):
            continue
        if isinstance(v, ast.Call) and isinstance(v.func, ast.Name) and v.func.id == "super":
            continue
        others = sorted(owners.get(node.attr, set()) - {module})
        if others:
            out.append((node.lineno, node.attr, others[0]))
    return sorted(out)


def _owners() -> Dict[str, Set[str]]:
    owners: Dict[str, Set[str]] = {}
    for m, tree in TREES.items():
        for name in private_members(tree):
            owners.setdefault(name, set()).add(m)
    return owners


def test_member_use_detector_finds_another_modules_private_members():
    theirs = ast.parse("class Tier:\n    _ready = False\n    def _start(self):\n        self._key = 1\n")
    owners = {n: {"shardckpt._memory.tier"} for n in private_members(theirs)}
    assert set(owners) == {"_ready", "_start", "_key"}
    src = """
class Mine:
    def _own(self):
        return self._start(), super()._key
def f(tier, st, mine):
    tier._start()
    st.store.tier._key = 2
    mine._own()
    return tier.__class__, torch._C, cls._ready
"""
    got = member_uses("shardckpt._memory.restore", ast.parse(src), owners)
    assert got == [(6, "_start", "shardckpt._memory.tier"), (7, "_key", "shardckpt._memory.tier")], got
    # In the module that defines them, the same uses are its own.
    assert member_uses("shardckpt._memory.tier", ast.parse(src), owners) == []


def test_no_module_uses_another_modules_private_members():
    owners = _owners()
    found: Dict[Tuple[str, str], List[str]] = {}
    for m, tree in TREES.items():
        for line, name, owner in member_uses(m, tree, owners):
            found.setdefault((m, name), []).append(f"  {MODULES[m].relative_to(ROOT)}:{line}: uses {name} of a class in {owner}")
    new = [line for k, lines in sorted(found.items()) if k not in MEMBER_USES for line in lines]
    stale = sorted(k for k in MEMBER_USES if k not in found)
    assert not new, (
        f"{len(new)} uses of another module's class's _private member (give the class a public method for what the "
        "caller needs, or move the code into the class's module):\n" + "\n".join(new)
    )
    assert not stale, f"MEMBER_USES lists uses that are gone (remove them): {stale}"
    assert all(reason.strip() for reason in MEMBER_USES.values())


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
    missing = sorted((set(MODULES) | set(EXTENSIONS)) - set(documented))
    gone = sorted(set(documented) - set(MODULES) - set(EXTENSIONS))
    assert not missing, f"modules docs/architecture.md's module map does not list: {missing}"
    assert not gone, f"docs/architecture.md lists modules that do not exist: {gone}"
    wrong = {m: (doc, LAYER_NAMES[layer_of(m)]) for m, doc in documented.items() if doc != LAYER_NAMES[layer_of(m)]}
    assert not wrong, f"docs/architecture.md puts these modules in another layer than LAYERS (doc, test): {wrong}"


def test_architecture_doc_names_no_file_that_does_not_exist():
    # Every `something.py` the page mentions is a file of the package (or a test or benchmark it points to).
    names = {p.name for d in ("shardckpt", "converters", "tests", "benchmarks", "examples") for p in (ROOT / d).rglob("*.py")}
    names |= {p.name for p in ROOT.glob("*.py")}  # setup.py
    mentioned = set(re.findall(r"\b(_?\w+\.py)\b", ARCHITECTURE.read_text(encoding="utf-8")))
    assert not mentioned - names, f"docs/architecture.md names files that do not exist: {sorted(mentioned - names)}"


# --------------------------------------------------------------------------
# the format owns its grammar (issue 48): counted by benchmarks/house_counts.py


def _house_counts():
    import importlib.util

    spec = importlib.util.spec_from_file_location("house_counts", ROOT / "benchmarks" / "house_counts.py")
    assert spec is not None and spec.loader is not None
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


def test_no_regex_parses_checkpoint_file_names_outside_the_format():
    ours, _foreign = _house_counts().regex_file_name_parses(str(ROOT))
    assert not ours, f"file names parsed by a regex outside shardckpt/_format (use _format.naming's parse_*): {ours}"


def test_no_version_number_comparison_outside_the_version_table():
    found = _house_counts().version_comparisons(str(ROOT))
    assert not found, f"format versions compared by number outside _format/versions.py (ask versions.supports): {found}"


def test_the_house_counts_detectors_find_each_kind(tmp_path):
    hc = _house_counts()
    pkg = tmp_path / "shardckpt"
    (pkg / "_format").mkdir(parents=True)
    (pkg / "_x.py").write_text('import re\nR = re.compile(r"^data/[0-9a-f]+-r(\\d+)-\\d+\\.safetensors$")\n'
                               'def f(m):\n    return m.version >= 4\n')
    (pkg / "_format" / "naming.py").write_text('import re\nR = re.compile(r"^step-(\\d+)$")\n')
    (tmp_path / "converters").mkdir()
    assert hc.regex_file_name_parses(str(tmp_path)) == (["shardckpt/_x.py:2"], [])
    assert hc.version_comparisons(str(tmp_path)) == ["shardckpt/_x.py:4"]
