"""The writers never fail on what a target said, even when it reaches them unsanitized (defence in depth):
report.html, the Allure results (allure-pytest's file writer, cluster labelling) and the journals."""

from __future__ import annotations

import json

from test_report import SYNTHETIC, document, result

from conformance import journal
from conformance.report.allure_results import SAFE_TEXT_PLUGIN, TRACE_LIMIT, install_safe_text_results, label_clusters, safe_allure_item
from conformance.report.clusters import add_clusters, message_lead
from conformance.report.html import write_html_report
from conformance.text import MESSAGE_LIMIT

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


def test_allure_results_and_containers_are_made_safe_text_before_the_file_logger_writes_them(tmp_path):
    import allure_commons
    from allure_commons.logger import AllureFileLogger
    from allure_commons.model2 import Parameter, StatusDetails, TestResult, TestStepResult

    assert install_safe_text_results() and allure_commons.plugin_manager.has_plugin(SAFE_TEXT_PLUGIN)
    assert install_safe_text_results()  # once per process: a second call registers nothing
    logger = AllureFileLogger(tmp_path)
    allure_commons.plugin_manager.register(logger)
    try:
        item = TestResult(
            name="test_case[add_lora_linear-f16-x]", uuid="u1", status="broken",
            statusDetails=StatusDetails(message=f"TargetBroken: broken [raised]: {HOSTILE}", trace=HOSTILE),
            parameters=[Parameter(name="case", value="\udcff")], steps=[TestStepResult(name="step \udcfe\x1b")],
        )  # fmt: skip
        allure_commons.plugin_manager.hook.report_result(result=item)
    finally:
        allure_commons.plugin_manager.unregister(logger)
    (path,) = tmp_path.glob("*-result.json")
    written = json.loads(path.read_text(encoding="utf-8"))
    details = written["statusDetails"]
    assert details["message"].startswith("TargetBroken: broken [raised]: driver said \\udcff\\udcfe \\x00 \\x1b[31mred")
    assert len(details["message"]) <= MESSAGE_LIMIT and len(details["trace"]) <= TRACE_LIMIT
    assert written["parameters"][0]["value"] == "\\udcff" and written["steps"][0]["name"] == "step \\udcfe\\x1b"


def test_safe_allure_item_leaves_other_values_and_plain_objects_alone():
    from allure_commons.model2 import Label, TestResult

    item = TestResult(name="plain", start=12, labels=[Label(name="tag", value="float16")])
    safe_allure_item(item)
    safe_allure_item(object())  # not a model object: nothing to do
    assert (item.name, item.start, item.labels[0].value) == ("plain", 12, "float16")


def test_label_clusters_skips_a_result_file_it_cannot_read_and_writes_the_others_as_valid_utf8(tmp_path):
    doc = hostile_document()
    failing = next(r for r in doc["results"] if r["outcome"] == "fail")
    message = f"{message_lead(failing)}: \udcff"  # as report_outcome leads it
    good = {"name": f"test_case[{failing['id']}]", "status": "failed", "statusDetails": {"message": message}}
    (tmp_path / "a-result.json").write_text(json.dumps(good), encoding="utf-8")  # "\udcff" as a JSON escape
    (tmp_path / "b-result.json").write_bytes(b'{"name": "test_case[x]", "statusDetails": {"message": "\xff')  # cut short
    assert label_clusters(tmp_path, doc) == 1
    labelled = json.loads((tmp_path / "a-result.json").read_text(encoding="utf-8"))
    assert " cluster " in labelled["statusDetails"]["message"] and "\\udcff" in labelled["statusDetails"]["message"]
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
