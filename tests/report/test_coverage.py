"""Coverage: per op, how many cases of each dtype, family and feature ran and passed, in results.json and
report.html, so that a reader sees what a PASS covered."""

from __future__ import annotations

import json
from collections import Counter

import pytest
from test_report import conformance, document, parse

from conformance.cases.features import FEATURE_DOCS
from conformance.report import write_html_report
from conformance.report.coverage import HEADLINE, add_coverage, coverage


def record(case_id, op, outcome="pass", dtype="float32", family="neg1", features=("neg1", "rank_padded"), level="kernel") -> dict:
    return {"id": case_id, "op": op, "level": level, "dtype": dtype, "family": family, "features": list(features), "outcome": outcome}


RESULTS = [
    record("a", "add_lora_linear", level="wrapper", features=("unequal_slices", "neg1")),
    record("b", "add_lora_linear", "fail", dtype="bfloat16", level="wrapper"),
    record("c", "add_lora_linear", "not supported", dtype="float16", level="wrapper"),
    record("d", "bgmv_shrink", family="last_slot", features=("last_slot",)),
    record("e", "greedy_generation", "known failure", family="mixed", features=("neg1", "last_slot"), level="model"),
]


def test_coverage_counts_what_ran_and_what_passed_per_op_dtype_family_and_feature():
    counted = coverage(RESULTS)
    assert list(counted["ops"]) == ["bgmv_shrink", "add_lora_linear", "greedy_generation"]  # by level, then name
    linear = counted["ops"]["add_lora_linear"]
    assert (linear["level"], linear["cases"], linear["passed"], linear["not_supported"]) == ("wrapper", 2, 1, 1)
    assert linear["dtypes"] == {"bfloat16": {"cases": 1, "passed": 0}, "float32": {"cases": 1, "passed": 1}}  # float16 never ran
    assert linear["families"] == {"neg1": {"cases": 2, "passed": 1}}
    # in the vocabulary's order (conformance.cases.features), whatever order the case listed them in
    assert list(linear["features"]) == ["neg1", "rank_padded", "unequal_slices"]
    assert linear["features"]["neg1"] == {"cases": 2, "passed": 1} and linear["features"]["unequal_slices"] == {"cases": 1, "passed": 1}
    assert counted["ops"]["greedy_generation"]["features"] == {"neg1": {"cases": 1, "passed": 0}, "last_slot": {"cases": 1, "passed": 0}}
    assert counted["headline"] == list(HEADLINE) and set(HEADLINE) <= set(FEATURE_DOCS)


def test_the_report_shows_a_coverage_row_per_op(tmp_path):
    page_path = write_html_report(add_coverage(document(RESULTS)), tmp_path / "report.html")
    html = page_path.read_text()
    [table] = parse(page_path).text["#coverage"]
    for header in ("cases run", "not supported", *HEADLINE):
        assert header in table
    assert '<tr data-op="add_lora_linear"><th>add_lora_linear</th><td class="muted">wrapper</td><td class="num">2 (1)</td>' in html
    assert '<td class="num" data-feature="unequal_slices">1 (1)</td>' in html
    assert '<td class="num zero" data-feature="allneg1">0</td>' in html  # nothing of the kind ran: said, not hidden
    assert '<td class="num zero" data-dtype="float16">0</td>' in html  # its only float16 case was not supported
    assert html.index('id="matrix"') < html.index('id="coverage"') < html.index('id="failures"')


@pytest.mark.integration  # starts a process: not the in-process unit loop
def test_a_run_records_the_coverage_of_its_cases(tmp_path):
    completed = conformance("--target=reference", "--profile=smoke", "-m", "not e2e", "-k", "bgmv_shrink", report_dir=tmp_path)
    assert completed.returncode == 0, completed.stdout[-2000:]
    results = json.loads((tmp_path / "results.json").read_text())
    assert list(results)[-4:] == ["clusters", "coverage", "target_output", "results"] and results["clusters"] == []
    [(name, op)] = results["coverage"]["ops"].items()
    assert name == "bgmv_shrink" and op["cases"] == op["passed"] == len(results["results"])
    features = Counter(feature for r in results["results"] for feature in r["features"])
    assert {f: t["cases"] for f, t in op["features"].items()} == dict(features)
    assert {"neg1", "allneg1", "last_slot", "rank_padded"} <= set(op["features"])
    assert 'data-op="bgmv_shrink"' in (tmp_path / "report.html").read_text()
