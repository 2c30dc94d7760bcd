"""The README and docs/ as a newcomer walks them: every link to a file or a heading lands, and every
`meshrl` command shown in them is one the command line takes (`train` commands: their config and
every override load; `study` commands: a dry run, which loads every run's; other commands: their
options parse, through `--help`)."""

import re
import shlex
from pathlib import Path

import pytest

from meshrl.configs.named import load_config
from meshrl.tools.cli import main

ROOT = Path(__file__).resolve().parent.parent
PAGES = [ROOT / "README.md", ROOT / "tests" / "README.md", *sorted((ROOT / "docs").rglob("*.md"))]  # the study reports in docs/studies/ too
LINK = re.compile(r"\]\((?!https?:)([^)\s]+)\)")


def slug(heading: str) -> str:
    """The anchor GitHub gives a heading."""
    return re.sub(r"[^\w\- ]", "", heading.strip().lstrip("#").strip().lower()).replace(" ", "-")


def prose(page: Path) -> list[str]:
    """The page's lines outside code blocks."""
    lines, in_code = [], False
    for line in page.read_text().splitlines():
        if line.startswith("```"):
            in_code = not in_code
        elif not in_code:
            lines.append(line)
    return lines


def commands(page: Path) -> list[list[str]]:
    """The `meshrl` command lines of the page's bash blocks (continuation lines joined, comments cut)."""
    found, block, in_bash = [], [], False
    for line in page.read_text().splitlines():
        if line.startswith("```"):
            in_bash = line.strip() == "```bash" and not in_bash
            continue
        if in_bash:
            block.append(line)
    text = "\n".join(block).replace("\\\n", " ")
    for line in text.splitlines():
        if line.strip().startswith(("meshrl ", ".venv/bin/meshrl ")):
            found.append(shlex.split(line, comments=True)[1:])
    return found


@pytest.mark.parametrize("page", PAGES, ids=lambda p: str(p.relative_to(ROOT)))
def test_every_link_lands_on_a_file_and_heading(page):
    for line in prose(page):
        for target in LINK.findall(line):
            path, _, anchor = target.partition("#")
            file = (page.parent / path).resolve() if path else page
            assert file.exists(), f"{page.name}: {target} (no such file)"
            if anchor:
                headings = {slug(h) for h in prose(file) if h.startswith("#")}
                assert anchor in headings, f"{page.name}: {target} (no such heading)"


@pytest.mark.parametrize("page", PAGES, ids=lambda p: str(p.relative_to(ROOT)))
def test_every_command_shown_is_one_the_command_line_takes(page, capsys):
    for words in commands(page):
        if words[0] == "train" and "--config" in words:
            i = words.index("--config")
            overrides = [w for j, w in enumerate(words[1:], 1)
                         if j not in (i, i + 1) and w not in ("--dry-run", "--plan-only")
                         and not (j > 0 and words[j - 1] == "--run-dir")
                         and w != "--run-dir"]
            load_config(words[i + 1], overrides)  # raises on an unknown config or override
            continue
        if words[0] == "study" and "--list" not in words:  # its runs' configs and overrides load; nothing starts
            assert main([*words, "--dry-run"]) == 0, f"{page.name}: meshrl {' '.join(words)}"
            continue
        subcommand = [w for w in words if not w.startswith("-")][:2 if words[0] == "bench" else 1]
        try:
            code = main([*subcommand, "--help"])
        except SystemExit as e:  # argparse's help
            code = e.code
        assert code == 0, f"{page.name}: meshrl {' '.join(words)}"
    capsys.readouterr()


def test_the_docs_show_commands_to_check():
    assert sum(len(commands(page)) for page in PAGES) >= 15


def test_the_test_inventory_names_every_test():
    """tests/README.md: every test function of tests/ has its row (as file::name), and no row names a
    test that is gone."""
    inventory = (ROOT / "tests" / "README.md").read_text()
    tests = {f"{path.name}::{name}" for path in (ROOT / "tests").glob("test_*.py")
             for name in re.findall(r"^def (test_\w+)", path.read_text(), re.M)}
    named = set(re.findall(r"(test_\w+\.py::test_\w+)", inventory))
    assert not tests - named, sorted(tests - named)
    assert not named - tests, sorted(named - tests)
