"""Pure tier: the README is a front page and the topic pages hang from it. README.md stays under 200 lines and links
every page of docs/; every relative link of README.md, docs/*.md and benchmarks/README.md names a file that exists
(and a heading that exists, when it names one); the generated reliability table has its one place, where
tests/faults.py --readme writes it.
"""
from __future__ import annotations

import re
import sys
from pathlib import Path

from helpers.launch import REPO

LINK = re.compile(r"\]\(([^)\s]+)\)")


def pages() -> list[Path]:
    return [REPO / "README.md", REPO / "benchmarks" / "README.md", *sorted((REPO / "docs").glob("*.md"))]


def anchor(heading: str) -> str:
    """GitHub's anchor for a heading: lower case, punctuation dropped, spaces to '-'."""
    return re.sub(r"[^a-z0-9 _-]", "", heading.strip().lower()).replace(" ", "-")


def anchors(page: Path) -> set[str]:
    text = re.sub(r"^```.*?^```", "", page.read_text(encoding="utf-8"), flags=re.S | re.M)  # no '#' of a code block
    return {anchor(h) for h in re.findall(r"^#+ (.*)$", text, re.M)}


def test_readme_is_a_front_page_linking_every_topic() -> None:
    readme = (REPO / "README.md").read_text(encoding="utf-8")
    assert len(readme.splitlines()) < 200
    linked = set(LINK.findall(readme))
    missing = [p.name for p in sorted((REPO / "docs").glob("*.md")) if f"docs/{p.name}" not in linked]
    assert not missing, f"README.md links no docs/ page named {missing}"
    assert "benchmarks/README.md" in linked
    first = re.search(r"```sh\n(.*?)```", readme, re.S)
    commands = [line.split()[:2] for line in first.group(1).splitlines()] if first else []
    assert commands == [["make", "submit"], ["make", "test"]], "the first two commands are make submit, make test"


def test_every_relative_link_resolves() -> None:
    broken = []
    for page in pages():
        for target in LINK.findall(page.read_text(encoding="utf-8")):
            if re.match(r"[a-z]+:", target):
                continue  # a URL
            path, _, frag = target.partition("#")
            dest = (page.parent / path).resolve() if path else page
            if not dest.exists():
                broken.append(f"{page.relative_to(REPO)}: {target} (no such file)")
            elif frag and dest.suffix == ".md" and frag not in anchors(dest):
                broken.append(f"{page.relative_to(REPO)}: {target} (no such heading)")
    assert not broken, "\n".join(broken)


def test_reliability_table_lives_in_its_page() -> None:
    sys.path.insert(0, str(REPO / "tests"))
    import faults

    assert faults.PAGE == REPO / "docs" / "reliability.md"
    text = faults.PAGE.read_text(encoding="utf-8")
    assert text.count(faults.BEGIN) == 1 and text.count(faults.END) == 1
    assert "| fault injected | tier | outcome asserted | time to exit (s) |" in text
    readme = (REPO / "README.md").read_text(encoding="utf-8")
    assert faults.BEGIN not in readme and "<!-- bench:begin -->" not in readme
