"""The documentation site builds in strict mode: a broken link, a missing name or a bad docstring fails CI.

Runs ``mkdocs build --strict`` (mkdocs.yml at the repository root) into a
temporary directory, offline, and checks that the generated reference holds
every public name and every CLI subcommand.
"""

import os
import re
import subprocess
import sys

import pytest

import shardckpt

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

@pytest.fixture(scope="module")
def site(tmp_path_factory):
    out = tmp_path_factory.mktemp("site")
    env = dict(os.environ, NO_MKDOCS_2_WARNING="1")
    p = subprocess.run([sys.executable, "-m", "mkdocs", "build", "--strict", "--site-dir", str(out)],
                       cwd=ROOT, capture_output=True, text=True, timeout=600, env=env)
    assert p.returncode == 0, "mkdocs build --strict failed:\n" + p.stdout + p.stderr
    warnings = [line for line in p.stderr.splitlines() if line.startswith(("WARNING", "ERROR"))]
    assert not warnings, "\n".join(warnings)
    return out


def _ids(html: str):
    return set(re.findall(r'id="([^"]+)"', html))


def test_reference_has_every_public_name(site):
    pages = {n: (site / "reference" / f"{n}.html").read_text() for n in ("api", "manager", "memory", "converters", "errors")}
    ids = set().union(*(_ids(h) for h in pages.values()))
    documented_elsewhere = {"converters", "errors", "__version__"}
    missing = []
    for name in shardckpt.__all__:
        if name in documented_elsewhere:
            continue
        if not any(i == name or i.endswith("." + name) for i in ids):
            missing.append(name)
    assert not missing, f"public names with no reference entry: {missing}"
    from shardckpt import converters

    for name in converters.__all__:
        assert f"converters.{name}" in ids, name
    for method in ("save", "restore", "save_to_memory", "should_save", "steps", "latest_step", "wait", "close"):
        assert f"shardckpt._manager.CheckpointManager.{method}" in ids or any(
            i.endswith(f"CheckpointManager.{method}") for i in ids), method


def test_reference_shows_the_public_api_only_with_roles_as_links_and_formatted_signatures(site):
    """Issue 47 item 6: no underscore members (``_scan``, ``_claim``...), no literal ``:meth:``, signatures one parameter a line."""
    import html as _html

    ref = site / "reference"
    for page in sorted(ref.glob("*.html")):
        text = page.read_text()
        private = sorted(i for i in _ids(text) if i.startswith(("shardckpt.", "converters.")) and i.rsplit(".", 1)[-1].startswith("_"))
        assert not private, f"{page.name} documents private members: {private[:10]}"
        roles = re.findall(r":(?:meth|func|attr|class|data|exc):`[^`]*`", _html.unescape(re.sub(r"<[^>]+>", "", text)))
        assert not roles, f"{page.name} prints Sphinx roles literally: {roles[:5]}"
    manager = (ref / "manager.html").read_text()
    # A role in CheckpointManager's docstrings is a link to the member's entry.
    assert re.search(r'<a class="autorefs autorefs-internal"[^>]*href="#shardckpt\.CheckpointManager\.restore"><code>restore</code>', manager)
    api = (ref / "api.html").read_text()
    sig = api.split('id="shardckpt.save"', 1)[1].split("doc-signature", 1)[1].split("</code>", 1)[0]
    sig = _html.unescape(re.sub(r"<[^>]+>", "", sig))
    assert "\n    state: Dict[str, Any],\n    url: Union[str, Storage],\n    *,\n" in sig, sig


def test_cli_reference_is_the_parsers_help(site):
    top = subprocess.run([sys.executable, "-m", "shardckpt", "--help"], capture_output=True, text=True, check=True).stdout
    section = top.split("\n  COMMAND\n", 1)[1].split("\n\n", 1)[0]
    names = re.findall(r"(?m)^    ([a-z][\w-]*)(?:\s|$)", section)
    assert {"inspect", "verify", "diff", "export", "import"} <= set(names)
    html = (site / "reference" / "cli.html").read_text()
    for name in names:
        assert f'id="shardckpt-{name}"' in html, name
    assert "--copy-from" in html


def test_every_docs_page_is_in_the_nav():
    """A page left out of mkdocs.yml's nav is unreachable from the site: list it or delete it."""
    text = open(os.path.join(ROOT, "mkdocs.yml")).read()
    nav = set(re.findall(r"([\w./-]+\.md)", text.split("\nnav:", 1)[1]))
    pages = set()
    for d, dirs, files in os.walk(os.path.join(ROOT, "docs")):
        dirs[:] = [x for x in dirs if not x.startswith(("_", "device-runs"))]
        pages |= {os.path.relpath(os.path.join(d, f), os.path.join(ROOT, "docs")) for f in files if f.endswith(".md")}
    assert pages - nav == set(), f"pages not in mkdocs.yml nav: {sorted(pages - nav)}"


def test_readme_what_works_table_names_tests_that_exist():
    """Each row of the README's "What works today" names the test files that prove it; they must exist."""
    text = open(os.path.join(ROOT, "README.md")).read()
    table = text.split("## What works today", 1)[1].split("\n## ", 1)[0]
    rows = [line for line in table.splitlines() if line.startswith("| ") and not line.startswith(("| what", "| ---"))]
    assert len(rows) >= 15, rows
    for row in rows:
        files = re.findall(r"`(tests/[\w/]+\.py)`", row)
        assert files, f"row names no test file: {row}"
        missing = [f for f in files if not os.path.isfile(os.path.join(ROOT, f))]
        assert not missing, f"{row}: {missing} do not exist"


def test_readme_starts_with_two_commands_and_the_cpu_build_before_them():
    """Issue 47 item 8: the CPU-build line comes before the two commands a newcomer pastes; CI runs the second one."""
    text = open(os.path.join(ROOT, "README.md")).read()
    head, fence = text.split("```bash\n", 1)
    commands = fence.split("```", 1)[0].strip().splitlines()
    assert len(commands) == 2 and "examples/quickstart.py" in commands[0] and "pytest" in commands[1], commands
    ci = open(os.path.join(ROOT, ".ci", "run")).read()
    assert commands[1] in ci.splitlines(), "the CI entry point must run the README's second command"
    cpu = "pip install torch==2.13.0 --index-url https://download.pytorch.org/whl/cpu"
    assert cpu in head and head.count("```") == 0, "the CPU-build step must come before the two commands"
    index = open(os.path.join(ROOT, "docs", "index.md")).read()
    install = index.split("## Install", 1)[1].split("\n## ", 1)[0]
    assert cpu in install and 'pip install -e ".[test]"' in install, install
