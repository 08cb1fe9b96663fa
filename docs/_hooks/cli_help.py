"""MkDocs hook: expands ``<!-- cli-help -->`` into the ``--help`` of every ``shardckpt`` subcommand.

The CLI reference is generated from the argparse parser itself, so it cannot
drift from the code (tests/e2e/test_docs_site.py builds the site strictly).
"""

from __future__ import annotations

import argparse
import os

MARKER = "<!-- cli-help -->"


def cli_help_markdown() -> str:
    """Markdown: the top-level help, then one section per subcommand with its help text."""
    from shardckpt._cli import _parser

    os.environ["COLUMNS"] = "100"  # argparse wraps to the terminal: a fixed width keeps the page the same everywhere
    parser = _parser()
    out = ["## shardckpt", "", "```text", parser.format_help().rstrip(), "```", ""]
    for action in parser._actions:
        if isinstance(action, argparse._SubParsersAction):
            for name, sub in action.choices.items():
                out += [f"## shardckpt {name}", "", "```text", sub.format_help().rstrip(), "```", ""]
    return "\n".join(out)


def on_page_markdown(markdown: str, page, config, files) -> str:  # noqa: ARG001 (MkDocs hook signature)
    if MARKER in markdown:
        markdown = markdown.replace(MARKER, cli_help_markdown())
    return markdown
