"""The isolation benchmark's bookkeeping (``python -m benchmarks isolation``), from recorded runs: no process starts."""

from __future__ import annotations

from benchmarks.isolation import IsolationRun, report, summary


def _runs(wall_process: list[float], wall_none: list[float]) -> list:
    measured = []
    for i, (p, n) in enumerate(zip(wall_process, wall_none)):
        for mode, wall in (("process", p), ("none", n)):
            measured.append((IsolationRun("standard", "op cases", mode), {"wall_s": wall, "cpu_s": 2 * wall, "cases": 6000, "exit": 0, "round": i + 1}))
    return measured


def test_the_ratio_is_of_the_median_walls_and_the_goals_are_judged_from_it():
    measured = _runs([60.0, 80.0, 70.0], [50.0, 40.0, 45.0])
    (row,) = summary(measured)
    assert row["wall"] == {"process": 70.0, "none": 45.0} and abs(row["ratio"] - 70 / 45) < 1e-12
    assert abs(row["cases_per_s"] - 6000 / 70) < 1e-12 and row["all_passed"]
    text = "\n".join(report(measured, "python -m benchmarks isolation", ["- machine"]))
    assert "isolated ≥ 100 cases/s: 85.7, **missed**" in text and "1.56×, **missed**" in text


def test_a_run_whose_gate_failed_is_said():
    measured = _runs([50.0], [45.0])
    measured[0][1]["exit"] = 1
    text = "\n".join(report(measured, "cmd", []))
    assert "isolated ≥ 100 cases/s: 120.0, met" in text and "1.11×, met" in text and "**did not pass**" in text
    assert IsolationRun("smoke", "all", "none").command() == "pytest conformance --target=hpu-emulated --profile=smoke -n 2 --repeat=2 --isolation=none"
