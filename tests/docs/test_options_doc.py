"""docs/options.md is what the plugin's options say, and the plugin's options are what pytest has."""

from __future__ import annotations

from pathlib import Path

from conformance import options_doc

ROOT = Path(__file__).resolve().parents[2]


def test_the_committed_page_is_the_generated_one():
    committed = (ROOT / "docs" / "options.md").read_text()
    assert committed == options_doc.render(), (
        f"docs/options.md is not what conformance/plugin.py's options say; regenerate it: .venv/bin/{options_doc.COMMAND}"
    )


def test_the_recorded_options_are_those_pytest_registered(pytestconfig):
    # this process loaded the plugin through its pytest11 entry point, as a vendor's pytest does
    options = options_doc.plugin_options()
    assert len(options) >= 17
    for option in options:
        pytestconfig.getoption(option.name)  # ValueError when pytest has no option of that name
        assert option.help.strip(), f"{option.name} has no help text"


def test_each_option_is_one_row_with_its_argument_and_default():
    rows = [line for line in options_doc.render().splitlines() if line.startswith("| `--")]
    assert [row.split("`")[1] for row in rows] == [option.name for option in options_doc.plugin_options()]
    by_name = {row.split("`")[1]: row for row in rows}
    assert "| `release\\|smoke\\|standard` | — |" in by_name["--profile"]  # choices; the default is in the help text
    assert "| `process\\|none` | `process` |" in by_name["--isolation"]
    assert "| `SECONDS` | `30` |" in by_name["--progress-every"] and "default 30.0" in by_name["--progress-every"]
    assert "|  | off |" in by_name["--shrink"]
    assert "reports/\\<target\\>" in by_name["--report-dir"]  # not swallowed as an HTML tag
