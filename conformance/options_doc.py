"""The options the pytest plugin registers, read from the plugin itself, and docs/options.md made from them.

    python -m conformance.options_doc > docs/options.md

The help texts in ``conformance.plugin.pytest_addoption`` are the one source: this module calls that
function with a stand-in for pytest's parser that only records, so the page cannot drift from
``pytest --help``, and the project's tests check the committed page against what it prints.
"""

from __future__ import annotations

import sys
from dataclasses import dataclass, field

COMMAND = "python -m conformance.options_doc > docs/options.md"


@dataclass(frozen=True)
class Option:
    """One ``addoption`` call as the plugin made it: its names and argparse keywords."""

    names: tuple[str, ...]
    settings: dict = field(default_factory=dict)

    @property
    def name(self) -> str:
        return next(name for name in self.names if name.startswith("--"))

    @property
    def dest(self) -> str:
        return self.settings.get("dest") or self.name.removeprefix("--").replace("-", "_")

    @property
    def is_flag(self) -> bool:
        return self.settings.get("action") in ("store_true", "store_false")

    @property
    def argument(self) -> str:
        """What follows the option, as ``pytest --help`` shows it: the choices, the metavar or the dest."""
        if self.is_flag:
            return ""
        if "choices" in self.settings:
            return "|".join(str(choice) for choice in self.settings["choices"])
        return self.settings.get("metavar") or self.dest.upper()

    @property
    def default(self):
        return self.settings.get("default", False if self.is_flag else None)

    @property
    def help(self) -> str:
        text = self.settings.get("help", "")
        # argparse fills %(default)s and the like in from the keywords; so does this page
        return text % {**self.settings, "default": self.default, "dest": self.dest} if "%(" in text else text


class _RecordingParser:
    """Enough of pytest's parser for ``pytest_addoption``: groups are one list, options are recorded.

    Any other parser method the plugin starts to use fails here by name, so this stays honest."""

    def __init__(self) -> None:
        self.options: list[Option] = []

    def getgroup(self, name: str, description: str = "", after: str | None = None) -> _RecordingParser:
        return self

    def addoption(self, *names: str, **settings) -> None:
        self.options.append(Option(tuple(names), dict(settings)))


def plugin_options() -> list[Option]:
    """Every option ``conformance.plugin`` registers, in its order."""
    from conformance.plugin import pytest_addoption

    parser = _RecordingParser()
    pytest_addoption(parser)
    return parser.options


def _default_text(option: Option) -> str:
    if option.is_flag:
        return "off"
    if option.default is None:
        return "—"  # the option has no default of its own: its meaning says what a run does without it
    if isinstance(option.default, float) and option.default.is_integer():
        return f"`{int(option.default)}`"
    return f"`{option.default}`"


def _pipes_escaped(text: str) -> str:
    return text.replace("|", "\\|")  # a pipe would end the table cell, even inside a code span


def _cell(text: str) -> str:
    """One table cell: on one line, its pipes escaped, and ``<target>`` kept as text rather than read as HTML."""
    return _pipes_escaped(" ".join(text.split())).replace("<", "\\<").replace(">", "\\>")


def render() -> str:
    """docs/options.md."""
    lines = [
        "# Options of `pytest conformance` and `lora-conformance run`",
        "",
        f"Generated from `conformance/plugin.py` (`pytest_addoption`) by `{COMMAND}`; edit the help texts there, not this page.",
        "",
        "Every option the suite adds to pytest. pytest's own options work as usual (`-k`, `-m`, `-x`, `--junitxml`), "
        "and so do pytest-xdist's (`-n`) and allure-pytest's (`--alluredir`). A default of — means the option has none of "
        "its own: its meaning says what a run does without it.",
        "",
        "| option | argument | default | meaning |",
        "|---|---|---|---|",
    ]
    for option in plugin_options():
        argument = f"`{_pipes_escaped(option.argument)}`" if option.argument else ""  # a code span: no other escapes
        lines.append(f"| `{option.name}` | {argument} | {_default_text(option)} | {_cell(option.help)} |")
    return "\n".join(lines) + "\n"


def main() -> int:
    sys.stdout.write(render())
    return 0


if __name__ == "__main__":
    sys.exit(main())
