"""The optional parts of a run: which are missing here, what the run does without each, how to install it.

A conformance run needs only pyproject's required dependencies (torch, numpy, packaging, safetensors,
hypothesis, pytest; ``.ci/run-minimal`` runs the smoke list in such an environment). Everything else
is optional, and a run without it still ends in a verdict, saying what it skipped:

* ``tokenizers`` (extra ``e2e``): the end-to-end reference tokenizes the fixtures' prompts with it
  (``conformance.e2e.checkpoint``); without it the end-to-end cases are *not supported*, with the reason
  (``conformance.levels.model``), never an error and never left out of the report. transformers and
  PEFT are not on the run path at all: they made the fixtures (``fixtures/make_fixtures.py``) and the
  project's own tests compare the suite's decoder with them;
* ``pytest-xdist`` (extra ``dev``): ``-n``; without it the cases run in the one pytest process;
* ``allure-pytest`` (extra ``reports``): only the ``--alluredir`` option; the Allure results are written
  from the results document by the suite's own writer (``conformance.report.allure_results``) either way;
* the Allure command-line generator (Node and the npm ``allure`` of ``report-tools/``): only
  ``python -m conformance.report allure DIR``, a step after the run, needs it.

Chromium is not on a run's path: only the project's own tests render the reports in it.

Each missing part becomes one ``optional.<name>`` entry of the run's environment fingerprint
(``conformance.report.fingerprint``), so results.json, report.html's environment table, junit.xml's
properties and Allure's ``environment.properties`` say it, and one ``skipped:`` line in report.html's run
section (``conformance.report.html``) and in the verdict in the terminal (``conformance.plugin``). Presence is looked up (``importlib.util.find_spec``), never
imported: importing transformers-sized packages to ask would cost seconds.
"""

from __future__ import annotations

import importlib.util
from dataclasses import dataclass

KEY_PREFIX = "optional."  # the environment fingerprint's keys for missing parts


@dataclass(frozen=True)
class OptionalPart:
    name: str  # the distribution (or tool) a user installs
    module: str | None  # the import name whose presence says it is installed; None for a tool
    without: str  # what a run does without it
    install: str | None  # the command that installs it; None for a tool, whose check names what to install

    def missing(self) -> str | None:
        """Why this part is absent here (with what to install), or None when it is present."""
        if self.module is not None:
            return None if module_present(self.module) else f"not installed: {self.without}; to install: {self.install}"
        return _allure_cli_missing(self.without)


TOKENIZERS = OptionalPart(
    "tokenizers", "tokenizers",
    "the end-to-end cases (level model, marker e2e) are not supported: their reference tokenizes the fixtures' prompts with it",
    "pip install 'lora-conformance[e2e]'",
)
PARTS = (
    TOKENIZERS,
    OptionalPart("pytest-xdist", "xdist", "-n is not an option: the cases run in this one pytest process", "pip install pytest-xdist"),
    OptionalPart(
        "allure-pytest", "allure_pytest",
        "--alluredir is not an option; allure-results/ is still written to the report dir (its writer needs no Allure)",
        "pip install 'lora-conformance[reports]'",
    ),
    OptionalPart("allure CLI", None, "the Allure HTML report (python -m conformance.report allure DIR) cannot be generated", None),
)


def module_present(name: str) -> bool:
    """Whether ``name`` can be imported here, found without importing it."""
    try:
        return importlib.util.find_spec(name) is not None
    except (ImportError, ValueError):  # a parent package that fails to import, or a broken __spec__: not usable
        return False


def _allure_cli_missing(without: str) -> str | None:
    from conformance.report.allure_html import AllureToolMissing, check_tools, default_tools_dir

    try:
        check_tools(default_tools_dir())
    except AllureToolMissing as exc:
        return f"not installed: {without}; {exc}"
    return None


def missing_parts() -> dict[str, str]:
    """``optional.<name>`` → why it is missing and what to install, for each part missing here (the fingerprint's entries)."""
    return {f"{KEY_PREFIX}{part.name}": reason for part in PARTS if (reason := part.missing()) is not None}


def skipped_parts(environment: dict) -> list[tuple[str, str]]:
    """``(name, why and what to install)`` of each missing part an environment fingerprint records."""
    return [(key.removeprefix(KEY_PREFIX), str(value)) for key, value in environment.items() if key.startswith(KEY_PREFIX)]


def skipped_lines(environment: dict) -> list[str]:
    """One ``skipped:`` line per missing part an environment fingerprint records (the verdict's, in the terminal)."""
    return [f"skipped: {name} {why}" for name, why in skipped_parts(environment)]


def e2e_missing_reason() -> str | None:
    """Why the end-to-end cases cannot run here (the package they need is missing), or None."""
    if module_present(TOKENIZERS.module):
        return None
    return (f"this environment lacks the package '{TOKENIZERS.name}', which the end-to-end reference needs to tokenize the "
            f"fixtures' prompts: {TOKENIZERS.install} (or pip install {TOKENIZERS.name})")
