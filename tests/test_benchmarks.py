"""The benchmark command still runs: its op code path on tiny shapes, and the suite part's bookkeeping.

No timing is asserted anywhere: the numbers are measurements to record in docs/, not pass/fail
criteria.
"""

from benchmarks import suite
from benchmarks.__main__ import main
from benchmarks.workload import IMPLEMENTATIONS


def test_ops_smoke_test_writes_a_table_for_every_implementation(tmp_path):
    assert main(["ops", "--smoke-test", "--docs", str(tmp_path)]) == 0
    text = (tmp_path / "benchmarks.md").read_text()
    for implementation in IMPLEMENTATIONS:
        assert implementation in text
    assert "## tiny qkv" in text and "## tiny lm_head" in text
    assert "error²" not in text.split("¹ not run")[0]  # every implementation ran every tiny workload


def test_suite_plan_covers_both_parts_cold_and_warm():
    runs = suite.plan(("smoke", "release"))
    assert {(r.part, r.cache) for r in runs if r.profile == "smoke"} == {
        ("all", "cold"), ("op cases", "warm"), ("end-to-end", "warm")}
    assert {r.workers for r in runs if r.profile == "release"} == {2}
    assert runs[0].command() == "pytest conformance --target=hpu-emulated --profile=smoke -n 2"


def test_suite_fit_recovers_startup_and_per_case_cost():
    startup, per_case = suite.fit([(100, 12.0), (300, 16.0), (1000, 30.0)])
    assert abs(startup - 10.0) < 1e-9 and abs(per_case - 0.02) < 1e-12
    assert suite.fit([(100, 1.0)]) is None


def test_suite_report_from_recorded_runs():
    measured = [
        (suite.SuiteRun("smoke", 2, "all", "cold"), {"wall_s": 50.0, "cases": 760, "exit": 0}),
        (suite.SuiteRun("smoke", 2, "op cases", "warm"), {"wall_s": 30.0, "cases": 741, "exit": 0}),
        (suite.SuiteRun("smoke", 2, "end-to-end", "warm"), {"wall_s": 20.0, "cases": 19, "exit": 0}),
        (suite.SuiteRun("standard", 2, "op cases", "warm"), {"wall_s": 60.0, "cases": 2223, "exit": 0}),
    ]
    text = "\n".join(suite.report(measured, "python -m benchmarks suite", ["- machine"]))
    assert "smoke ≤ 60 s with `-n 2`" in text and "met" in text
    assert "2223 op cases" in text
