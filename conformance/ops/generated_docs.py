"""The generated blocks of the docs: op tables rendered from the specs, checked and rewritten, never edited.

A block in a markdown file is::

    <!-- generated: ops-table NAME -->
    (the table NAME of conformance.ops.tables.TABLES)
    <!-- end generated -->

``python -m conformance.targets ops-table --write`` renders every block of :data:`DOCS` anew and
``--check`` lists the stale ones; tests/ops/test_generated_docs.py runs the check, so a spec changed
without its docs fails with the command that fixes it.
"""

from __future__ import annotations

import re
from pathlib import Path

from .tables import TABLES

REGENERATE = "python -m conformance.targets ops-table --write"
ROOT = Path(__file__).resolve().parents[2]  # the checkout the docs live in
DOCS = ("docs/targets.md", "docs/bring-up.md", "docs/cases.md")

BEGIN = "<!-- generated: ops-table {name} -->"
END = "<!-- end generated -->"
_BLOCK = re.compile(r"(?P<begin><!-- generated: ops-table (?P<name>[\w-]+) -->\n)(?P<body>.*?)(?P<end><!-- end generated -->)", re.S)


def render_block(name: str) -> str:
    """A whole block, markers included: what ``ops-table NAME`` prints, ready to paste into a doc."""
    return f"{BEGIN.format(name=name)}\n{TABLES[name]()}{END}"


def blocks(text: str, where: str = "the text") -> list[re.Match]:
    """The generated blocks of ``text``; a block of no known table, or one never closed, is an error."""
    found = list(_BLOCK.finditer(text))
    if len(found) != text.count("<!-- generated: ops-table "):
        raise ValueError(f"{where}: a '<!-- generated: ops-table NAME -->' line without its '{END}'")
    unknown = [m["name"] for m in found if m["name"] not in TABLES]
    if unknown:
        raise ValueError(f"{where}: generated blocks of unknown tables {unknown}; the tables are {', '.join(TABLES)}")
    return found


def regenerated(text: str, where: str = "the text") -> str:
    """``text`` with the body of every generated block rendered anew from the specs."""
    blocks(text, where)
    return _BLOCK.sub(lambda m: m["begin"] + TABLES[m["name"]]() + m["end"], text)


def stale(text: str, where: str = "the text") -> list[str]:
    """The names of the blocks of ``text`` whose body is not what the specs render now."""
    return [m["name"] for m in blocks(text, where) if m["body"] != TABLES[m["name"]]()]


def check(root: Path = ROOT) -> list[str]:
    """One line per stale block of the docs, naming the command that regenerates them; empty when all are current."""
    return [
        f"{doc}: the generated block '{name}' differs from the specs; run {REGENERATE}"
        for doc in DOCS
        for name in stale((root / doc).read_text(), doc)
    ]


def write(root: Path = ROOT) -> list[str]:
    """Render every block of the docs anew; the docs that changed."""
    changed = []
    for doc in DOCS:
        path = root / doc
        text = path.read_text()
        new = regenerated(text, doc)
        if new != text:
            path.write_text(new)
            changed.append(doc)
    return changed
