"""The README is a user's guide and docs/ holds the rest: every relative link resolves, every doc says what it is for.

Static: the markdown files are read, nothing is imported or run.
"""

from __future__ import annotations

import re
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
PAGES = [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md"))]
# [text](target) outside inline code; the target up to the first space or closing parenthesis.
LINK = re.compile(r"(?<!`)\[[^\]\n]*\]\(([^)\s]+)\)")
FENCE = re.compile(r"^```.*?^```", flags=re.M | re.S)


def _links(page: Path) -> list[str]:
    text = FENCE.sub("", page.read_text())
    text = re.sub(r"`[^`\n]*`", "", text)
    return LINK.findall(text)


def _anchors(page: Path) -> set[str]:
    """GitHub's anchors of a page's headings: lower case, punctuation dropped, spaces to hyphens."""
    anchors = set()
    for heading in re.findall(r"^#+ (.+)$", FENCE.sub("", page.read_text()), flags=re.M):
        slug = re.sub(r"[^\w\- ]", "", heading.strip().lower()).replace(" ", "-")
        anchors.add(slug)
    return anchors


@pytest.mark.parametrize("page", PAGES, ids=lambda p: str(p.relative_to(ROOT)))
def test_every_relative_link_resolves(page):
    broken = []
    for target in _links(page):
        if re.match(r"^[a-z]+:", target):  # https:, mailto:
            continue
        path, _, anchor = target.partition("#")
        dest = (page.parent / path).resolve() if path else page
        if not dest.exists():
            broken.append(target)
        elif anchor and dest.suffix == ".md" and anchor not in _anchors(dest):
            broken.append(target)
    assert broken == [], f"{page.relative_to(ROOT)} links to what does not exist: {broken}"


def test_the_readme_is_a_guide_of_at_most_250_lines_that_links_every_doc():
    readme = (ROOT / "README.md").read_text()
    assert len(readme.splitlines()) <= 250
    linked = {Path(t.partition("#")[0]).name for t in _links(ROOT / "README.md")}
    unlinked = [p.name for p in PAGES[1:] if p.name not in linked]
    assert unlinked == [], f"README.md does not link {unlinked}"


@pytest.mark.parametrize("page", PAGES[1:], ids=lambda p: p.name)
def test_every_doc_opens_with_a_title_and_a_paragraph(page):
    lines = page.read_text().splitlines()
    assert lines[0].startswith("# "), lines[0]
    assert lines[1] == "" and lines[2] and not lines[2].startswith(("#", "|", "```", "-")), lines[:3]
