"""The house's structural counts (issue 48): rerun after any change to see where the code stands.

Static (``ast`` over the source, imports nothing of shardckpt, runs in a
second): ``python benchmarks/house_counts.py [repo root] [--json]``.

Counts:

- ``CheckpointManager``: lines of the class, methods defined in its body,
  constructor keywords (parameters of ``__init__`` but ``self`` and the
  positional ``root_url``).
- longest function/method of the manager's family (``_manager.py``,
  ``_managed/``, ``_flush.py``, ``_memory/``): lines from ``def`` to its end.
- regex parses of checkpoint file names outside ``shardckpt/_format``: calls
  of ``re.compile/match/fullmatch/search`` whose pattern literal mentions a
  piece of the file grammar (``safetensors``, ``step-``, ``index-r``,
  ``data/``, ``restore-r``, ``manifest``). ``integrations/`` parse other
  libraries' names (torchtitan's DCP ``step-N``, Accelerate's
  ``checkpoint_N``): listed apart, as foreign grammars.
- direct comparisons of format version numbers outside the version table
  (``shardckpt/_format/versions.py``): an ordering comparison (``<``,
  ``<=``, ``>``, ``>=``) one side of which is named ``version``,
  ``format_version`` or ``.version``, or a ``V_*`` constant.
- files to touch to add a storage backend: files of the package that name
  a backend class of their own (``if``-chains on schemes); with the
  registry, a backend is one module of the user's (``tests/_dirstore.py``
  shows it, ``tests/unit/test_extending.py`` registers it): 0 package
  files, 1 file in all.
"""

from __future__ import annotations

import ast
import json
import os
import sys
from typing import Any, Dict, List, Tuple

FAMILY = ["shardckpt/_manager.py", "shardckpt/_managed", "shardckpt/_flush.py", "shardckpt/_memory"]
GRAMMAR = ("safetensors", "step-", "index-r", "data/", "restore-r", "manifest")
REGEX_CALLS = {"compile", "match", "fullmatch", "search"}
VERSION_NAMES = {"version", "format_version"}


def _py_files(root: str, rel: str) -> List[str]:
    path = os.path.join(root, rel)
    if os.path.isfile(path):
        return [rel]
    out = []
    for d, _, names in os.walk(path):
        out += [os.path.relpath(os.path.join(d, n), root) for n in names if n.endswith(".py")]
    return sorted(out)


def _tree(root: str, rel: str) -> ast.Module:
    with open(os.path.join(root, rel), encoding="utf-8") as f:
        return ast.parse(f.read(), rel)


def manager_counts(root: str) -> Dict[str, Any]:
    """Lines, methods and constructor keywords of ``CheckpointManager``."""
    for node in _tree(root, "shardckpt/_manager.py").body:
        if isinstance(node, ast.ClassDef) and node.name == "CheckpointManager":
            methods = [n for n in node.body if isinstance(n, (ast.FunctionDef, ast.AsyncFunctionDef))]
            init = next(m for m in methods if m.name == "__init__")
            keywords = [a.arg for a in init.args.args[2:] + init.args.kwonlyargs]
            one_statement = [m.name for m in methods if len(m.body) - (1 if ast.get_docstring(m) else 0) == 1]
            assert node.end_lineno is not None
            return {"lines": node.end_lineno - node.lineno + 1, "methods": len(methods), "keywords": len(keywords),
                    "one_statement_methods": len(one_statement)}
    raise SystemExit("CheckpointManager not found")


def longest_family_method(root: str) -> Tuple[int, str]:
    """``(lines, "file:qualified name")`` of the longest function of the manager's family."""
    best = (0, "")
    for rel in [f for part in FAMILY for f in _py_files(root, part)]:
        def visit(node: ast.AST, prefix: str, rel: str = rel) -> None:
            nonlocal best
            for child in ast.iter_child_nodes(node):
                if isinstance(child, (ast.FunctionDef, ast.AsyncFunctionDef)):
                    assert child.end_lineno is not None
                    n = child.end_lineno - child.lineno + 1
                    if n > best[0]:
                        best = (n, f"{rel}:{prefix}{child.name}")
                    visit(child, f"{prefix}{child.name}.")
                elif isinstance(child, ast.ClassDef):
                    visit(child, f"{prefix}{child.name}.")
        visit(_tree(root, rel), "")
    return best


def regex_file_name_parses(root: str) -> Tuple[List[str], List[str]]:
    """``(ours, foreign)``: ``file:line`` of regex calls on file-name grammar outside ``_format``."""
    ours, foreign = [], []
    for rel in _py_files(root, "shardckpt"):
        if rel.startswith("shardckpt/_format/"):
            continue
        for node in ast.walk(_tree(root, rel)):
            if not (isinstance(node, ast.Call) and isinstance(node.func, ast.Attribute) and node.func.attr in REGEX_CALLS
                    and isinstance(node.func.value, ast.Name) and node.func.value.id == "re" and node.args):
                continue
            pat = node.args[0]
            text = pat.value if isinstance(pat, ast.Constant) and isinstance(pat.value, str) else ""
            if any(g in text.replace("\\", "") for g in GRAMMAR):
                (foreign if rel.startswith("shardckpt/integrations/") else ours).append(f"{rel}:{node.lineno}")
    return ours, foreign


def _is_version(node: ast.AST) -> bool:
    if isinstance(node, ast.Name):
        return node.id in VERSION_NAMES or node.id.startswith("V_")
    if isinstance(node, ast.Attribute):
        return node.attr in VERSION_NAMES or node.attr.startswith("V_")
    return False


def version_comparisons(root: str) -> List[str]:
    """``file:line`` of ordering comparisons of format version numbers outside the version table."""
    out = []
    for rel in _py_files(root, "shardckpt") + _py_files(root, "converters"):
        if rel == "shardckpt/_format/versions.py":
            continue
        for node in ast.walk(_tree(root, rel)):
            if isinstance(node, ast.Compare) and any(isinstance(op, (ast.Lt, ast.LtE, ast.Gt, ast.GtE)) for op in node.ops):
                if any(_is_version(x) for x in [node.left, *node.comparators]):
                    out.append(f"{rel}:{node.lineno}")
    return out


def backend_files(root: str) -> Dict[str, Any]:
    """Package files naming a backend in a scheme ``if``-chain, and the files of the test backend."""
    chains = []
    for rel in _py_files(root, "shardckpt/_storage"):
        with open(os.path.join(root, rel), encoding="utf-8") as f:
            src = f.read()
        if "S3Storage(" in src and ("if proto" in src or "if scheme" in src):
            chains.append(rel)
    example = os.path.isfile(os.path.join(root, "tests/_dirstore.py"))
    return {"package_files": len(chains), "files_in_all": len(chains) + (1 if example else 0),
            "shown_by": "tests/unit/test_extending.py with tests/_dirstore.py" if example else None}


def counts(root: str) -> Dict[str, Any]:
    """Every count, as one dict."""
    lines, where = longest_family_method(root)
    ours, foreign = regex_file_name_parses(root)
    versions = version_comparisons(root)
    return {
        "manager": manager_counts(root),
        "longest_family_method": {"lines": lines, "where": where},
        "regex_file_name_parses": {"count": len(ours), "where": ours, "foreign_grammars": foreign},
        "version_comparisons": {"count": len(versions), "where": versions},
        "storage_backend": backend_files(root),
    }


def main(argv: List[str]) -> None:
    args = [a for a in argv if not a.startswith("--")]
    root = args[0] if args else os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    c = counts(root)
    if "--json" in argv:
        print(json.dumps(c, indent=1))
        return
    m = c["manager"]
    print(f"CheckpointManager: {m['lines']} lines, {m['methods']} methods ({m['one_statement_methods']} of one statement), "
          f"{m['keywords']} constructor keywords")
    lf = c["longest_family_method"]
    print(f"longest method of the manager family: {lf['lines']} lines ({lf['where']})")
    r = c["regex_file_name_parses"]
    print(f"regex parses of file names outside _format: {r['count']} {r['where']} (foreign grammars: {r['foreign_grammars']})")
    v = c["version_comparisons"]
    print(f"version-number comparisons outside the version table: {v['count']} {v['where']}")
    b = c["storage_backend"]
    print(f"files to touch to add a storage backend: {b['files_in_all']} ({b['package_files']} of the package; shown by {b['shown_by']})")


if __name__ == "__main__":
    main(sys.argv[1:])
