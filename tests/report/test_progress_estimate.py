"""The progress line's time left: summed per group from its finished cases, priors for groups not started.

A fake clock and hand-made reports drive ``conformance.report.progress.Progress``: nothing here depends
on how fast this machine is.
"""

from __future__ import annotations

import re
from types import SimpleNamespace

import pytest

from conformance.journal import node_id
from conformance.report.progress import LEVEL_PRIORS, Progress

OP_IDS = [f"op:bgmv_shrink:dtype=fp16;rank={n}" for n in range(100)]
TP_IDS = [f"layer:column:tp={size};dtype=fp32;draw={n}" for size in (2, 4) for n in range(84)]
PLAN = {**{case_id: ("op", False) for case_id in OP_IDS}, **{case_id: ("layer", False) for case_id in TP_IDS}}


class FakeClock:
    def __init__(self) -> None:
        self.now = 0.0

    def __call__(self) -> float:
        return self.now


def progress_of(plan: dict, clock: FakeClock, workers: int = 1) -> Progress:
    config = SimpleNamespace(pluginmanager=SimpleNamespace(get_plugin=lambda name: None))  # no terminal: lines not printed
    progress = Progress(config, every=0, clock=clock, plan=lambda: plan, workers=workers)
    progress.pytest_collection_finish(SimpleNamespace(items=[SimpleNamespace(nodeid=node_id(case_id)) for case_id in plan]))
    return progress


def finish(progress: Progress, clock: FakeClock, case_id: str, seconds: float, outcome: str = "passed") -> None:
    """One case's three phases as pytest reports them, the call taking ``seconds`` of the fake clock."""
    for when, phase_outcome, duration in (("setup", "passed", 0.0), ("call", outcome, seconds), ("teardown", "passed", 0.0)):
        clock.now += duration
        progress.pytest_runtest_logreport(pytest.TestReport(node_id(case_id), ("", 0, ""), {}, phase_outcome, None, when, duration=duration))


def seconds_left(line: str) -> int:
    match = re.search(r"about (?:(\d+)m)?(\d+)s left \(estimate", line)
    assert match, line
    return int(match.group(1) or 0) * 60 + int(match.group(2))


def test_op_cases_done_and_tensor_parallel_cases_to_come_are_estimated_from_the_layer_prior():
    clock = FakeClock()
    progress = progress_of(PLAN, clock)
    for case_id in OP_IDS:
        finish(progress, clock, case_id, 0.01)
    line = progress.line(clock.now)
    # the mean time of the finished op cases (10 ms) says 2 s; the 168 layer cases' prior says over a minute
    assert seconds_left(line) == round(len(TP_IDS) * LEVEL_PRIORS["layer"]) and seconds_left(line) >= 60, line
    assert line.endswith("left (estimate; layer from a prior)") and "elapsed 1s" in line


def test_a_started_group_is_estimated_from_its_own_cases_and_an_unstarted_one_from_its_levels():
    clock = FakeClock()
    progress = progress_of(PLAN, clock)
    for case_id in OP_IDS:
        finish(progress, clock, case_id, 0.01)
    finish(progress, clock, TP_IDS[0], 20.0)  # the tp2 rank pool's start: not what tp2's next cases cost
    line = progress.line(clock.now)
    # every case left at the layer's prior, and tp4 starts a pool of its own, as tp2 did
    assert seconds_left(line) == round(20 + 166 * LEVEL_PRIORS["layer"]) and "(estimate; layer from a prior)" in line, line
    for case_id in TP_IDS[1:4]:  # three more tp2 cases at 3 s each: tp4's are estimated at 3 s too, after its start
        finish(progress, clock, case_id, 3.0)
    line = progress.line(clock.now)
    assert seconds_left(line) == 80 * 3 + 20 + 83 * 3 and line.endswith("left (estimate)"), line
    assert "tp2 4/84" in line and "1 done" in line


def test_cases_the_facts_refuse_and_skipped_cases_cost_nothing():
    clock = FakeClock()
    plan = {**PLAN, **{case_id: ("layer", True) for case_id in TP_IDS if ":tp=4;" in case_id}}
    progress = progress_of(plan, clock, workers=2)
    finish(progress, clock, TP_IDS[0], 0.0, outcome="skipped")  # not supported, said by its worker: not a measurement
    finish(progress, clock, TP_IDS[1], 30.0)  # the first case that ran pays the rank pool's start
    finish(progress, clock, TP_IDS[2], 2.0)
    for case_id in OP_IDS:
        finish(progress, clock, case_id, 0.01)
    line = progress.line(clock.now)
    assert seconds_left(line) == 81 * 2.0 / 2, line  # tp2's 81 cases left at 2 s, on two workers; tp4 refused
    for case_id in TP_IDS[3:84]:
        finish(progress, clock, case_id, 2.0)
    assert seconds_left(progress.line(clock.now)) == 0  # the refused tp4 cases have not run yet, but cost nothing
    assert progress.line(clock.now).startswith(f"[progress] {100 + 84}/{100 + 168} cases, 0 failures; ")


def test_before_any_case_ends_every_level_is_estimated_from_its_prior():
    clock = FakeClock()
    plan = {**PLAN, "greedy_generation-mixed-fp32": ("model", False)}
    line = progress_of(plan, clock).line(clock.now)
    expected = 100 * LEVEL_PRIORS["op"] + 168 * LEVEL_PRIORS["layer"] + LEVEL_PRIORS["model"]
    assert seconds_left(line) == round(expected) and line.endswith("(estimate; layer, model, op from priors)"), line
