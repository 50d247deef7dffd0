"""Every relative link in the README, the docs pages and the results folders' READMEs resolves: its file
exists and, where it names a heading (``page.md#heading``), that page has the heading, with its anchor made
as GitHub makes it (lowercase, punctuation dropped, spaces to hyphens, a repeated heading numbered)."""

from __future__ import annotations

import re
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[1]
PAGES = sorted(
    {
        REPO / "README.md",
        *(REPO / "docs").glob("*.md"),
        *(REPO / "benchmarks" / "results").glob("README.md"),
        *(REPO / "benchmarks" / "results").glob("*/README.md"),
        *(REPO / "analysis" / "examples").glob("*/README.md"),
    }
)
CODE_BLOCK = re.compile(r"^```.*?^```", re.S | re.M)
LINK = re.compile(r"\]\(([^)\s]+)\)")


def anchor(heading: str) -> str:
    """The anchor GitHub gives a Markdown heading's text."""
    text = re.sub(r"\[([^\]]*)\]\([^)]*\)", r"\1", heading)  # a link in a heading keeps its text
    text = re.sub(r"[^\w\- ]", "", text.strip().lower())
    return text.replace(" ", "-")


def anchors(page: Path) -> set[str]:
    """The anchors of a page's headings (outside code blocks), a repeated one numbered -1, -2, ..."""
    found: set[str] = set()
    seen: dict[str, int] = {}
    for line in CODE_BLOCK.sub("", page.read_text()).splitlines():
        heading = re.match(r"#{1,6} (.+)", line)
        if heading:
            name = anchor(heading.group(1))
            found.add(f"{name}-{seen[name]}" if name in seen else name)
            seen[name] = seen.get(name, 0) + 1
    return found


def broken_links(page: Path) -> list[str]:
    """The relative links of ``page`` whose file or heading does not exist."""
    broken = []
    for target in LINK.findall(CODE_BLOCK.sub("", page.read_text())):
        if re.match(r"[a-z]+:", target):  # https:, mailto:
            continue
        path, _, heading = target.partition("#")
        destination = (page.parent / path).resolve() if path else page
        if not destination.exists():
            broken.append(f"{target} (no such file)")
        elif heading and destination.suffix == ".md" and heading not in anchors(destination):
            broken.append(f"{target} (no such heading)")
    return broken


def test_anchors_are_made_as_github_makes_them(tmp_path):
    page = tmp_path / "page.md"
    headings = "# A page\n## 2026-12-07, morning: Intel Xeon with `amx_bf16` (AMX)\n## Times\n## Times\n"
    page.write_text(headings + "```\n# not a heading\n```\n")
    assert anchors(page) == {"a-page", "2026-12-07-morning-intel-xeon-with-amx_bf16-amx", "times", "times-1"}


def test_a_broken_link_is_found(tmp_path):
    (tmp_path / "other.md").write_text("## Here\n")
    page = tmp_path / "page.md"
    page.write_text("[ok](other.md#here) [gone](missing.md) [wrong](other.md#there) [web](https://example.com)\n")
    assert broken_links(page) == ["missing.md (no such file)", "other.md#there (no such heading)"]


@pytest.mark.parametrize("page", PAGES, ids=[str(page.relative_to(REPO)) for page in PAGES])
def test_every_relative_link_resolves(page):
    assert broken_links(page) == []
