"""Where a broken case's traceback shows: results.json (the record's ``traceback``), report.html (folded
under the case's message), junit.xml (the ``<error>`` element's text) and Allure (``statusDetails.trace``);
it survives the journal, a rebuild and a merge, and a results.json without it still loads.

The traceback is made in the target's process (tests/isolation/test_target_traceback.py); here it is
a record's field, real (one whole run of the suite) or hand-made (hostile: surrogates, controls, 10 MB).
"""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
import xml.etree.ElementTree as ET
from html import escape
from pathlib import Path

import pytest
from test_report import SYNTHETIC, document, parse, result

from conformance import journal
from conformance.generator import profile_cases
from conformance.record import CaseResult
from conformance.report import merge_documents, write_html_report
from conformance.report.allure_results import write_allure_results
from conformance.report.clusters import add_clusters
from conformance.report.document import results_document
from conformance.report.junit import junit_tree, write_junit
from conformance.text import TRACEBACK_LIMIT, format_traceback
from conformance.verdict import FailureKind, Outcome

ROOT = Path(__file__).resolve().parents[2]
MISBEHAVING_TARGETS = ROOT / "tests" / "misbehaving_targets.py"
UNSAFE = re.compile(r"[\ud800-\udfff\x00-\x08\x0b-\x1f\x7f-\x9f]")
BROKEN_ID = "add_lora_linear-f32-traceback"


def _interop_layer(values):
    try:
        return (lambda handle: handle.launch(values))(None)  # a frame named <lambda>: the page must escape it
    except AttributeError as exc:
        raise RuntimeError("the interop layer could not launch add_lora_linear & co") from exc


def real_traceback() -> str:
    try:
        _interop_layer([1, 2])
    except RuntimeError as exc:
        return format_traceback(exc)


TRACEBACK = real_traceback()


def broken_record(traceback: str, case_id: str = BROKEN_ID) -> dict:
    record = result(case_id, "add_lora_linear", "float32", "broken", level="wrapper", ratio=None,
                    message="the call raised: RuntimeError: the interop layer could not launch add_lora_linear & co (at x.py:3)",
                    repro=f"pytest conformance --target=acme --replay r/{case_id}.json", traceback=traceback)
    record["kind"], record["kinds"] = "raised", ["raised"]
    return record


def allure_results(directory: Path, doc: dict) -> dict[str, dict]:
    """The Allure results written from ``doc``, by test name."""
    write_allure_results(doc, directory)
    return {r["name"]: r for r in (json.loads(p.read_text()) for p in directory.glob("*-result.json"))}


def test_the_traceback_shows_folded_in_the_html_report_in_the_junit_error_text_and_as_the_allure_trace(tmp_path):
    doc = add_clusters(document([*SYNTHETIC, broken_record(TRACEBACK)]))  # SYNTHETIC's broken case has no traceback

    page_text = write_html_report(doc, tmp_path / "report.html").read_text(encoding="utf-8")
    row = page_text[page_text.index(f'id="case-{BROKEN_ID}"'):]
    row = row[: row.index("</tr>")]
    assert f'<details class="traceback"><summary>traceback</summary><pre class="traceback">{escape(TRACEBACK)}</pre></details>' in row
    assert "&lt;lambda&gt;" in row and "<lambda>" not in page_text
    assert page_text.count('<details class="traceback">') == 1  # the broken case without one shows none
    page = parse(tmp_path / "report.html")
    assert any("_interop_layer" in text and "AttributeError" in text for text in page.text[".traceback"])

    errors = {testcase.get("name"): testcase.find("error") for testcase in junit_tree(doc).getroot().iter("testcase")}
    error = errors[f"test_case[{BROKEN_ID}]"]
    assert error.text.endswith(f"\n\nwhat the target raised:\n{TRACEBACK}") and "repro: pytest" in error.text
    assert "Traceback" not in error.get("message")  # the attribute stays one line: the text holds the traceback
    assert "what the target raised" not in errors["test_case[add_lora_linear-f16-d]"].text

    written = allure_results(tmp_path / "allure-results", doc)
    assert written[f"test_case[{BROKEN_ID}]"]["statusDetails"]["trace"] == TRACEBACK
    assert "Traceback" not in written["test_case[add_lora_linear-f16-d]"]["statusDetails"]["trace"]  # it raised nothing


def test_a_hostile_traceback_leaves_every_writer_valid_and_bounded(tmp_path):
    """A record that bypassed ``CaseResult.to_json`` (hand-made, or an older writer) with a traceback of
    surrogates, controls and 10 MB: each writer cuts and escapes it itself."""
    hostile = "Traceback (most recent call last):\n  File \"drv\udcff.py\", line 1, in \x1b[31mlaunch\n" + "device log line\n" * 700_000
    doc = add_clusters(document([*SYNTHETIC, broken_record(hostile)]))

    page = write_html_report(doc, tmp_path / "report.html")
    text = page.read_text(encoding="utf-8")  # strict: valid UTF-8
    assert "drv\\udcff.py&quot;, line 1, in \\x1b[31mlaunch" in text and "characters cut" in text
    assert "\x1b" not in text and page.stat().st_size < 1_000_000

    path = write_junit(doc, tmp_path / "junit.xml")
    error_text = next(e.text for e in ET.parse(path).getroot().iter("error") if "what the target raised" in (e.text or ""))
    assert "drv\\udcff.py" in error_text and not UNSAFE.search(error_text.replace("\n", "")) and path.stat().st_size < 1_000_000

    trace = allure_results(tmp_path / "allure-results", doc)[f"test_case[{BROKEN_ID}]"]["statusDetails"]["trace"]
    assert len(trace) <= TRACEBACK_LIMIT and trace.startswith("Traceback (most recent call last):") and "characters cut" in trace


@pytest.fixture(scope="module")
def linear_case():
    return next(case for _, case in profile_cases("smoke", 0) if case.op == "add_lora_linear")


def test_the_traceback_survives_the_journal_a_rebuild_and_a_merge_and_old_results_load(tmp_path, linear_case):
    broken = CaseResult(linear_case.case_id, linear_case, Outcome.BROKEN, "the call raised: …", kinds=(FailureKind.RAISED,),
                        traceback=TRACEBACK)
    passed = CaseResult("bgmv_shrink-bf16-a", linear_case, Outcome.PASS)
    assert broken.to_json()["traceback"] == TRACEBACK and "traceback" not in passed.to_json()

    log = journal.Journal(tmp_path, "main")
    log.append({**broken.to_json(), "worker": "main"})
    hostile = {**broken.to_json(), "id": "old-journal-case", "traceback": "\udcff\x00" + "frame line\n" * 1_000_000}
    log.path.write_text(log.path.read_text() + json.dumps(hostile) + "\n")  # a journal line no CaseResult wrote
    records = {r["id"]: r for r in journal.read_journals(tmp_path)}
    assert records[linear_case.case_id]["traceback"] == TRACEBACK
    cut = records["old-journal-case"]["traceback"]
    assert cut.startswith("\\udcff\\x00frame line") and len(cut) <= TRACEBACK_LIMIT and "characters cut" in cut

    manifest = document([records[linear_case.case_id]])
    rebuilt = results_document({k: v for k, v in manifest.items() if k not in ("results", "gate", "summary")},
                               [records[linear_case.case_id]])
    assert rebuilt["results"][0]["traceback"] == TRACEBACK

    first = document([records[linear_case.case_id]], shard="0/2")
    older = document(SYNTHETIC[:2], shard="1/2")  # a results.json written before the field existed
    assert all("traceback" not in r for r in older["results"])
    paths = []
    for name, doc in (("first", first), ("older", older)):
        paths.append(tmp_path / f"{name}.json")
        paths[-1].write_text(json.dumps(doc))
    merged = merge_documents([json.loads(p.read_text()) for p in paths], [str(p) for p in paths], check_cases=False)
    by_id = {r["id"]: r for r in merged["results"]}
    assert by_id[linear_case.case_id]["traceback"] == TRACEBACK and "traceback" not in by_id[SYNTHETIC[0]["id"]]
    write_html_report(merged, tmp_path / "merged.html")
    junit_tree(merged)


@pytest.mark.integration
def test_a_run_whose_target_raised_writes_the_traceback_into_every_artifact(tmp_path):
    """One real run (one add_lora_linear case, the target raises in its worker): results.json, report.html,
    junit.xml and the Allure result all hold the frames of the suite and of the target."""
    case_id = next(case_id for case_id, case in profile_cases("smoke", 0) if case.op == "add_lora_linear" and case.dtype == "float32")
    completed = subprocess.run(
        [sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", "--report-dir", str(tmp_path), "--profile=smoke",
         "--target=misbehaving_targets:RaisesDeviceError", f"conformance/test_cases.py::test_case[{case_id}]"],
        cwd=ROOT, capture_output=True, text=True, timeout=600, env={**os.environ, "PYTHONPATH": str(ROOT / "tests")},
    )  # fmt: skip
    assert completed.returncode == 1, completed.stdout[-3000:] + completed.stderr[-3000:]
    [record] = json.loads((tmp_path / "results.json").read_text(encoding="utf-8"))["results"]
    traceback = record["traceback"]
    suite_frame = 'conformance/target_call.py", line '
    raise_line = 1 + next(n for n, line in enumerate(MISBEHAVING_TARGETS.read_text().splitlines()) if "synapse error 26" in line)
    target_frame = f'tests/misbehaving_targets.py", line {raise_line}, in misbehave'
    assert (record["outcome"], record["kind"]) == ("broken", "raised") and suite_frame in traceback and target_frame in traceback
    assert escape(traceback) in (tmp_path / "report.html").read_text(encoding="utf-8")
    [error] = ET.parse(tmp_path / "junit.xml").getroot().iter("error")
    assert traceback in error.text
    [allure] = [json.loads(p.read_text(encoding="utf-8")) for p in (tmp_path / "allure-results").glob("*-result.json")]
    assert allure["statusDetails"]["trace"] == traceback
