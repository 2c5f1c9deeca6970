"""The README stays a front page, every doc is reachable from it, and no relative link is dead.

A doc the README does not link is a doc nobody finds; a link to a moved file is a reader lost. Code
spans and fenced blocks are not links (`reports/<target>` is a path a run writes, not a file here).
"""

from __future__ import annotations

import re
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
README = ROOT / "README.md"
DOCS = sorted((ROOT / "docs").glob("*.md"))
MAX_README_LINES = 160

FENCE = re.compile(r"^```.*?^```", re.MULTILINE | re.DOTALL)
CODE_SPAN = re.compile(r"`[^`\n]*`")
LINK = re.compile(r"\[[^\]\n]*\]\(([^)\s]+)(?:\s+\"[^\"]*\")?\)")


def relative_links(markdown: str) -> list[str]:
    """The targets of the markdown links that point into this repository, anchors dropped."""
    text = CODE_SPAN.sub("", FENCE.sub("", markdown))
    targets = [target.split("#")[0] for target in LINK.findall(text)]
    return [target for target in targets if target and not re.match(r"[a-z][a-z0-9+.-]*:", target)]  # not http:, mailto:


def test_relative_links_finds_links_and_skips_code_and_urls():
    text = (
        "See [a](docs/a.md), [b](b.md#part) and [c](https://example.com/c.md), [d](#here).\n"
        "`[not](a-link.md)`\n```\n[neither](block.md)\n```\n"
    )
    assert relative_links(text) == ["docs/a.md", "b.md"]


def test_the_readme_is_a_front_page():
    lines = len(README.read_text().splitlines())
    assert lines <= MAX_README_LINES, f"README.md has {lines} lines; move detail into docs/ and link it (at most {MAX_README_LINES})"


def test_every_doc_is_linked_from_the_readme():
    linked = {(README.parent / target).resolve() for target in relative_links(README.read_text())}
    unlinked = [doc.name for doc in DOCS if doc.resolve() not in linked]
    assert not unlinked, f"docs not linked from README.md (its 'The docs, by reader' section): {unlinked}"


@pytest.mark.parametrize("page", [README, *DOCS, *sorted((ROOT / "examples").glob("*/README.md"))], ids=lambda p: str(p.relative_to(ROOT)))
def test_relative_links_point_to_files_that_exist(page):
    dead = [target for target in relative_links(page.read_text()) if not (page.parent / target).exists()]
    assert not dead, f"{page.relative_to(ROOT)} links to what does not exist: {dead}"
