"""The writers never fail on what a target said, even when it reaches them unsanitized (defence in depth):
report.html, the Allure results and the journals."""

from __future__ import annotations

import json

from test_report import SYNTHETIC, document, result

from conformance import journal
from conformance.report.allure_results import write_allure_results
from conformance.report.clusters import add_clusters
from conformance.report.html import write_html_report
from conformance.text import MESSAGE_LIMIT, TRACEBACK_LIMIT

HOSTILE = "driver said \udcff\udcfe \x00 \x1b[31mred\x1b[0m " + "device log line\n" * 700_000  # 11 MB


def hostile_document() -> dict:
    broken = result("add_lora_linear-f16-x", "add_lora_linear", "float16", "broken", level="wrapper", ratio=None, message=HOSTILE)
    broken["kind"], broken["kinds"] = "raised", ["raised"]
    return add_clusters(document([*SYNTHETIC, broken]))


def test_the_html_report_is_written_from_a_message_with_surrogates_controls_and_10_mb(tmp_path):
    path = write_html_report(hostile_document(), tmp_path / "report.html")
    page = path.read_text(encoding="utf-8")  # strict: valid UTF-8
    assert "driver said \\udcff\\udcfe \\x00 \\x1b[31mred" in page and "characters cut" in page
    assert "\x00" not in page and "\x1b" not in page and path.stat().st_size < 1_000_000


def test_the_allure_results_are_ascii_json_with_bounded_safe_messages_and_traces(tmp_path):
    doc = hostile_document()
    broken = next(r for r in doc["results"] if r["id"] == "add_lora_linear-f16-x")
    broken["traceback"] = HOSTILE  # as a record that bypassed CaseResult.to_json would hold it
    write_allure_results(doc, tmp_path)
    written = {}
    for path in tmp_path.glob("*-result.json"):
        path.read_bytes().decode("ascii")  # strict: nothing but ASCII, every other character escaped
        result = json.loads(path.read_text())
        written[result["name"]] = result
    details = written["test_case[add_lora_linear-f16-x]"]["statusDetails"]
    assert details["message"].startswith("broken [raised]") and "driver said \\udcff\\udcfe \\x00 \\x1b[31mred" in details["message"]
    assert len(details["message"]) <= MESSAGE_LIMIT and len(details["trace"]) <= TRACEBACK_LIMIT and "characters cut" in details["trace"]
    assert len(written) == len(doc["results"])
    json.loads((tmp_path / "categories.json").read_text())


def test_an_old_journal_with_surrogates_controls_and_a_huge_message_is_read_as_safe_text(tmp_path):
    path = tmp_path / journal.JOURNALS / "main.jsonl"
    path.parent.mkdir()
    lines = [
        json.dumps({"id": "b-case", "outcome": "broken", "message": HOSTILE, "kinds": ["raised \udcfe"]}),
        json.dumps({"id": "a-case", "outcome": "pass", "message": "line\u2028separator \x1c"}),  # no split there
        '{"id": "c-case", "outcome": "pass", "mess',  # cut short by a kill: skipped
        json.dumps({"id": 7, "outcome": "pass"}),  # not a case id: skipped
    ]
    path.write_bytes(("\n".join(lines) + "\n").encode() + b'{"id": "d-case", "message": "\xff"}\n')
    records = journal.read_journals(tmp_path)
    assert [r["id"] for r in records] == ["a-case", "b-case", "d-case"]
    a, b, d = records
    assert a["message"] == "line\u2028separator \\x1c"
    assert b["message"].startswith("driver said \\udcff\\udcfe \\x00 \\x1b[31mred") and len(b["message"]) <= MESSAGE_LIMIT
    assert b["kinds"] == ["raised \\udcfe"] and d["message"] == "\\udcff"
    json.dumps(records, ensure_ascii=False).encode("utf-8")
