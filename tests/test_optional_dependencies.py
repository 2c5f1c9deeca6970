"""Optional means optional: a run where the optional packages cannot be imported still ends in a verdict
and says what it skipped (``conformance.optional``).

The run is a real ``pytest conformance`` in a subprocess whose ``sitecustomize`` makes allure, allure-pytest,
transformers, PEFT, tokenizers and pytest-xdist unimportable and hides their distributions from pytest's
plugin loader, as if they were not installed: the environment ``.ci/run-minimal`` builds for real, in
seconds instead of minutes. A few cases of the shipped smoke list run: one op case, which must pass, and
every end-to-end case, which must be *not supported* naming the missing package and its install command
(before ``conformance.optional`` they were errors: "the end-to-end cases need the 'tokenizers' package").
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

pytestmark = pytest.mark.integration  # a whole run of the suite in a subprocess

ROOT = Path(__file__).resolve().parents[1]
BLOCKED_MODULES = ("allure", "allure_pytest", "allure_commons", "transformers", "peft", "tokenizers", "xdist")
BLOCKED_DISTRIBUTIONS = ("allure-pytest", "allure-python-commons", "transformers", "peft", "tokenizers", "pytest-xdist")
OP_CASE = "op:add_lora_linear:dtype=bf16;slices=1;rank=1;family=t1"

# Imported by the interpreter at start-up from PYTHONPATH: raises ModuleNotFoundError for the blocked
# modules (as a missing one does) and leaves their distributions out of importlib.metadata, where pytest
# finds its plugins' entry points (allure-pytest's and xdist's would otherwise load and fail to import).
SITECUSTOMIZE = textwrap.dedent(f"""
    import importlib.metadata as metadata
    import sys

    BLOCKED = {BLOCKED_MODULES!r}
    HIDDEN = {BLOCKED_DISTRIBUTIONS!r}


    class NotInstalled:
        def find_spec(self, name, path=None, target=None):
            if name.partition(".")[0] in BLOCKED:
                raise ModuleNotFoundError(f"No module named {{name!r}} (made unimportable by the test)", name=name)
            return None


    sys.meta_path.insert(0, NotInstalled())
    _distributions = metadata.distributions


    def distributions(**kwargs):
        return (d for d in _distributions(**kwargs) if (d.metadata["Name"] or "").lower().replace("_", "-") not in HIDDEN)


    metadata.distributions = distributions
""")


@pytest.fixture(scope="module")
def blocked_env(tmp_path_factory) -> dict[str, str]:
    site = tmp_path_factory.mktemp("not-installed")
    (site / "sitecustomize.py").write_text(SITECUSTOMIZE)
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(filter(None, [str(site), os.environ.get("PYTHONPATH")]))}
    env.pop("PYTEST_XDIST_WORKER", None)  # this test may itself run under xdist
    return env


@pytest.fixture(scope="module")
def minimal_run(blocked_env, tmp_path_factory):
    report = tmp_path_factory.mktemp("minimal-run")
    command = [sys.executable, "-m", "pytest", "conformance", "--target=hpu-emulated", "--caselist=smoke", "--cases", "model",
               "--cases", OP_CASE, "--report-dir", str(report), "-q", "-p", "no:cacheprovider"]
    completed = subprocess.run(command, cwd=ROOT, env=blocked_env, capture_output=True, text=True, timeout=600)
    return completed, report


def test_the_blocker_hides_what_it_names(blocked_env):
    """The premise: in the subprocess each package is unimportable and not an installed distribution; a
    blocker that let one through would make the run below prove nothing."""
    probe = ("import importlib, importlib.metadata as m\n"
             f"for name in {BLOCKED_MODULES!r}:\n"
             "    try:\n        importlib.import_module(name)\n    except ModuleNotFoundError:\n        pass\n"
             "    else:\n        raise SystemExit(name + ' imported')\n"
             "names = {(d.metadata['Name'] or '').lower() for d in m.distributions()}\n"
             f"print(sorted(names & set({BLOCKED_DISTRIBUTIONS!r})))\n")
    completed = subprocess.run([sys.executable, "-c", probe], env=blocked_env, capture_output=True, text=True, timeout=120)
    assert completed.returncode == 0, completed.stdout + completed.stderr
    assert completed.stdout.strip() == "[]"


def test_a_run_without_the_optional_packages_passes_and_says_what_it_skipped(minimal_run):
    completed, report = minimal_run
    output = completed.stdout + completed.stderr
    assert completed.returncode == 0, output[-6000:]
    assert "verdict: PASS" in output
    document = json.loads((report / "results.json").read_text())
    outcomes = {r["id"]: (r["outcome"], r.get("message") or "") for r in document["results"]}
    assert outcomes.pop(OP_CASE)[0] == "pass"
    assert len(outcomes) >= 9 and all(case_id.startswith("model:") for case_id in outcomes), sorted(outcomes)
    for case_id, (outcome, message) in outcomes.items():
        assert outcome == "not supported", (case_id, outcome, message)
        assert "'tokenizers'" in message and "pip install 'lora-conformance[e2e]'" in message, (case_id, message)
    # one line per missing part, in results.json's environment, the terminal's verdict and report.html
    skipped = {key.removeprefix("optional."): why for key, why in document["environment"].items() if key.startswith("optional.")}
    assert {"tokenizers", "pytest-xdist", "allure-pytest"} <= set(skipped), skipped
    for name, why in skipped.items():
        assert why.startswith("not installed: ") and f"skipped: {name} {why}" in output, (name, why)
    assert "pip install 'lora-conformance[e2e]'" in skipped["tokenizers"]
    html = (report / "report.html").read_text()
    for name in ("tokenizers", "pytest-xdist", "allure-pytest"):
        assert f"skipped: {name}" in html
    # the Allure results need no Allure: written all the same, one result per case
    assert len(list((report / "allure-results").glob("*-result.json"))) == len(document["results"])
