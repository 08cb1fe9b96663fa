"""Sphinx-style roles in docstrings (``:meth:`save```, ``:func:`~shardckpt.load```) as links in the reference.

The docstrings are Google style and read well in ``help()``; their
cross-references are Sphinx roles, which mkdocstrings prints literally. This
griffe extension (mkdocs.yml: the python handler's ``extensions``) rewrites
each role into an autorefs tag: the target is resolved where the docstring
lives (its class, its module, then the package), and the tag is *optional*,
so a target with no reference entry (a private helper) renders as code,
never as a broken link.
"""

from __future__ import annotations

import re
from typing import Any, Iterator, Optional

import griffe

#: ``:role:`target``` or ``:role:`~a.b.c``` (the tilde shows only the last part).
ROLE = re.compile(r":(?:py:)?(meth|func|attr|class|data|exc|mod|obj|const):`(~?)([\w.]+)(\(\))?`")


def _objects(obj: Any) -> Iterator[Any]:
    yield obj
    for member in obj.members.values():
        if not member.is_alias:
            yield from _objects(member)


def _lookup(collection: Any, path: str) -> Optional[Any]:
    try:
        return collection[path]
    except (KeyError, ValueError, griffe.AliasResolutionError, griffe.CyclicAliasError):
        return None


def _resolve(obj: Any, target: str, collection: Any) -> Optional[str]:
    """The path of the object ``target`` names, seen from ``obj``'s docstring, or None."""
    scopes = []
    if obj.is_class:
        scopes.append(obj.path)
    parent = obj.parent
    while parent is not None:
        scopes.append(parent.path)
        parent = parent.parent
    scopes.append("")
    for scope in scopes:
        path = f"{scope}.{target}" if scope else target
        found = _lookup(collection, path)
        if found is not None:
            return path
    return None


def rewrite(text: str, resolve) -> str:
    """``text`` with every role made an optional autorefs link (``resolve(target)`` -> path or None)."""

    def one(m: "re.Match[str]") -> str:
        tilde, target, call = m.group(2), m.group(3).lstrip("."), m.group(4) or ""
        shown = (target.rsplit(".", 1)[-1] if tilde else target) + call
        path = resolve(target)
        if path is None:
            return f"`{shown}`"
        return f'<autoref identifier="{path}" optional><code>{shown}</code></autoref>'

    return ROLE.sub(one, text)


class SphinxRoles(griffe.Extension):
    """Rewrite the package's docstrings once it is loaded."""

    def on_package(self, *, pkg: Any, loader: Any, **kwargs: Any) -> None:
        collection = loader.modules_collection
        for obj in _objects(pkg):
            if obj.docstring is not None and ":" in obj.docstring.value:
                obj.docstring.value = rewrite(obj.docstring.value, lambda t, o=obj: _resolve(o, t, collection))
