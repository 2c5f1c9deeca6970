"""The op tables of the docs are generated from the specs: every block equals what the specs render now.

A spec changed without its docs fails here with the command that regenerates them; the checker itself
is tested on tampered text, so a block edited by hand cannot pass.
"""

from __future__ import annotations

import shutil

import pytest

import conformance.targets.kernel_target as kernel_target
from conformance.ops import generated_docs
from conformance.ops.generated_docs import DOCS, REGENERATE, ROOT, blocks, check, regenerated, stale, write
from conformance.ops.tables import TABLES, composition_table
from conformance.targets.__main__ import main

# Where each table is embedded: the op table with its legend beside the contract, the compositions there
# (KernelTarget's section) and in the bring-up guide, the knobs with the cases.
PLACES = {"docs/targets.md": ["ops", "legend", "compositions"], "docs/bring-up.md": ["compositions"], "docs/cases.md": ["knobs"]}


def test_every_generated_block_of_the_docs_is_what_the_specs_render():
    problems = check()
    assert problems == [], "\n".join(problems) + f"\nregenerate them: {REGENERATE}"


def test_each_table_is_embedded_where_the_docs_need_it():
    assert set(PLACES) == set(DOCS)
    assert {doc: [m["name"] for m in blocks((ROOT / doc).read_text(), doc)] for doc in DOCS} == PLACES


def tampered(text: str, table: str) -> str:
    """``text`` with one row of its ``table`` block edited by hand."""
    (block,) = [m for m in blocks(text) if m["name"] == table]
    row = block["body"].splitlines()[2]
    return text.replace(row, row.replace("|", "| edited", 1), 1)


@pytest.mark.parametrize("table", TABLES)
def test_a_block_edited_by_hand_is_stale_and_regenerating_restores_it(table):
    doc = next(doc for doc, tables in PLACES.items() if table in tables)
    text = (ROOT / doc).read_text()
    edited = tampered(text, table)
    assert edited != text and stale(edited, doc) == [table]
    assert regenerated(edited, doc) == text


def test_the_check_names_the_doc_the_block_and_the_command_and_write_fixes_it(tmp_path):
    for doc in DOCS:
        (tmp_path / doc).parent.mkdir(parents=True, exist_ok=True)
        shutil.copy(ROOT / doc, tmp_path / doc)
    cases = tmp_path / "docs/cases.md"
    cases.write_text(tampered(cases.read_text(), "knobs"))
    assert check(tmp_path) == [f"docs/cases.md: the generated block 'knobs' differs from the specs; run {REGENERATE}"]
    assert write(tmp_path) == ["docs/cases.md"]
    assert check(tmp_path) == [] and cases.read_text() == (ROOT / "docs/cases.md").read_text()


def test_a_block_of_no_known_table_or_never_closed_is_an_error():
    with pytest.raises(ValueError, match="unknown tables"):
        blocks("<!-- generated: ops-table nonsense -->\n| a |\n<!-- end generated -->\n")
    with pytest.raises(ValueError, match="without its"):
        blocks("<!-- generated: ops-table ops -->\n| a |\n")


def test_the_command_prints_a_block_ready_to_paste(capsys):
    assert main(["ops-table", "compositions"]) == 0
    printed = capsys.readouterr().out
    assert printed == generated_docs.render_block("compositions") + "\n"
    assert stale(printed) == []
    assert main(["ops-table", "no-such-table"]) == 2


def test_kernel_targets_docstring_ends_with_the_composition_table():
    assert kernel_target.__doc__.endswith(composition_table())
