"""What the target warned and printed, over the run (``conformance.report.target_output``): one row per distinct
warning or line with its counts, the report's section, and the terminal's one line. Synthetic documents, no run."""

from __future__ import annotations

from test_report import SYNTHETIC, document, parse

from conformance.report import write_html_report
from conformance.report.target_output import LOADING, RUN_KEPT, summarize, terminal_line


def said(warnings=(), lines=(), omitted=None) -> dict:
    """A case's ``target_output`` as the session records it (``TargetOutput.to_json``)."""
    return {"warnings": [{"category": c, "message": m, "where": w, "count": n} for c, m, w, n in warnings],
            "lines": [{"text": t, "count": n} for t, n in lines],
            "total": {"warnings": sum(n for *_, n in warnings), "lines": sum(n for _, n in lines)},
            "omitted": {"warnings": 0, "lines": 0, "bytes": 0, **(omitted or {})}}


DEPRECATION = ("FutureWarning", "shard_map is deprecated", "jax/api.py:10", 1)
AUTOTUNER = ("W autotuner.cc:120] no autotuning cache", 2)


def with_output(*outputs: dict | None, workers=()) -> dict:
    """SYNTHETIC's document, its first cases carrying ``outputs``."""
    results = [dict(r) for r in SYNTHETIC]
    for record, output in zip(results, outputs):
        if output is not None:
            record["target_output"] = output
    return document(results, workers=list(workers))


def test_each_distinct_warning_and_line_is_one_row_with_its_counts_and_first_case(tmp_path):
    doc = with_output(said([DEPRECATION], [AUTOTUNER]), None, said([DEPRECATION], [AUTOTUNER], {"bytes": 10}),
                      workers=[{"worker": "main", "target_output_at_load": said(lines=[("I loading the runtime", 1)])}])
    summary = summarize(doc)
    first = SYNTHETIC[0]["id"]
    assert summary["warnings"] == [{"category": "FutureWarning", "message": "shard_map is deprecated", "where": "jax/api.py:10",
                                    "count": 2, "cases": 2, "first_case": first}]
    assert summary["lines"] == [{"text": AUTOTUNER[0], "count": 4, "cases": 2, "first_case": first},
                                {"text": "I loading the runtime", "count": 1, "cases": 1, "first_case": f"{LOADING} main"}]
    assert summary["total"] == {"warnings": 2, "lines": 5, "cases": 2} and summary["omitted"] == {"warnings": 0, "lines": 0, "bytes": 10}
    line = terminal_line(doc, "reports/acme")
    assert line == ("target output: 2 warning(s) (1 distinct) and 5 line(s) on stdout/stderr (2 distinct) in 2 case(s), not shown "
                    "here: reports/acme/report.html#target-output, results.json target_output")
    html = write_html_report(doc, tmp_path / "report.html").read_text()
    assert "I loading the runtime" in html and "target_output_at_load" not in html  # its section, not a column of the workers table


def test_the_run_keeps_the_most_frequent_rows_and_counts_the_rest():
    outputs = [said(lines=[(f"line {i}-{j}", 1) for j in range(RUN_KEPT // 2 + 10)], omitted={"lines": 3}) for i in range(2)]
    outputs[1]["lines"][0]["count"] = 9
    summary = summarize(with_output(*outputs))
    assert len(summary["lines"]) == RUN_KEPT and summary["lines"][0]["text"] == "line 1-0"
    assert summary["omitted"]["lines"] == 2 * 3 + 2 * (RUN_KEPT // 2 + 10) - RUN_KEPT


def test_a_run_that_said_nothing_has_no_terminal_line_and_says_so_in_the_report(tmp_path):
    doc = with_output()
    assert terminal_line(doc, "r") is None
    page = parse(write_html_report(doc, tmp_path / "report.html"))
    assert "the target warned and printed nothing" in page.text["#target-output"][0]


def test_output_only_while_loading_is_said_as_such():
    doc = with_output(workers=[{"worker": "gw0", "target_output_at_load": said(lines=[("I loading", 1)])}])
    assert terminal_line(doc, "r").endswith("(1 distinct) while it loaded, not shown here: r/report.html#target-output, results.json target_output")


def test_the_report_shows_both_tables_with_what_the_target_wrote_as_text(tmp_path):
    hostile = ("<script>alert(1)</script>", 1)
    doc = with_output(said([DEPRECATION], [AUTOTUNER, hostile]))
    path = write_html_report(doc, tmp_path / "report.html")
    page = parse(path)
    [section] = page.text["#target-output"]
    assert "shard_map is deprecated" in section and "no autotuning cache" in section and "<script>alert(1)</script>" in section
    assert "script" not in page.tags and "&lt;script&gt;" in path.read_text()
    assert "1 warning(s) and 3 line(s) in 1 case(s)" in section


def test_a_document_with_broken_records_still_renders():
    doc = with_output({"warnings": "many", "lines": [{"text": "ok line", "count": "lots"}, 5], "total": {"lines": -4}, "omitted": []},
                      {"warnings": [{"category": None}], "lines": None, "total": None, "omitted": {"bytes": True}})
    summary = summarize(doc)
    assert [(line["text"], line["count"]) for line in summary["lines"]] == [("ok line", 1)]
    assert summary["total"] == {"warnings": 0, "lines": 0, "cases": 2} and summary["omitted"] == {"warnings": 0, "lines": 0, "bytes": 0}
    assert [w["category"] for w in summary["warnings"]] == ["None"]
