"""MkDocs hook: expands ``<!-- cli-help -->`` into the ``--help`` of every ``shardckpt`` subcommand.

The CLI reference is generated from the command itself (``python -m
shardckpt [COMMAND] --help``), so it cannot drift from the code
(tests/e2e/test_docs_site.py builds the site strictly).
"""

from __future__ import annotations

import os
import re
import subprocess
import sys
from typing import List

MARKER = "<!-- cli-help -->"
#: argparse wraps to the terminal: a fixed width keeps the page the same everywhere.
HELP_COLUMNS = "100"


def cli_help(*args: str) -> str:
    """``python -m shardckpt ARGS --help``, as a user sees it."""
    env = dict(os.environ, COLUMNS=HELP_COLUMNS)
    p = subprocess.run([sys.executable, "-m", "shardckpt", *args, "--help"], capture_output=True, text=True,
                       env=env, timeout=120, check=True)
    return p.stdout.rstrip()


def subcommands(top_help: str) -> List[str]:
    """The subcommands the top-level help lists under ``COMMAND`` (one per line, indented 4)."""
    section = top_help.split("\n  COMMAND\n", 1)[-1].split("\n\n", 1)[0]
    names = re.findall(r"(?m)^    ([a-z][\w-]*)(?:\s|$)", section)
    if not names:
        raise RuntimeError("shardckpt --help lists no subcommands")
    return names


def cli_help_markdown() -> str:
    """Markdown: the top-level help, then one section per subcommand with its help text."""
    top = cli_help()
    out = ["## shardckpt", "", "```text", top, "```", ""]
    for name in subcommands(top):
        out += [f"## shardckpt {name}", "", "```text", cli_help(name), "```", ""]
    return "\n".join(out)


def on_page_markdown(markdown: str, page, config, files) -> str:  # noqa: ARG001 (MkDocs hook signature)
    if MARKER in markdown:
        markdown = markdown.replace(MARKER, cli_help_markdown())
    return markdown
