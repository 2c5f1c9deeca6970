"""The serving level catches the bugs that live between steps, each as ``stale state``, and passes a graph-safe layer.

Each target of ``serving_targets`` passes its batches called fresh (the serving level's own fresh calls say
so); served through the CPU graph emulation, each fault fails the family built to provoke it, on the kind
``stale state`` alone. The cases are the smoke profile's ``add_lora_linear`` serving cases (run seed 0).
"""

from __future__ import annotations

import pytest
from serving_targets import (
    SERVING_FAULTS,
    ActiveCountReadAtCapture,
    EagerLinear,
    GraphSafeLinear,
    MetadataPerCapture,
    NoLoraFlagReadAtCapture,
    StaleMetadataTail,
)

from conformance.levels.serving import SERVING
from conformance.serving.driver import drive
from conformance.serving.scenarios import serving_cases
from conformance.serving.values import request_values
from conformance.verdict import FailureKind, Outcome

# The family each fault is aimed at (scenarios' docstring): the fault must fail there.
CAUGHT_IN = {
    StaleMetadataTail: "stale_tail",
    MetadataPerCapture: "alternating_sizes",
    ActiveCountReadAtCapture: "capture_without_adapters",
    NoLoraFlagReadAtCapture: "capture_without_adapters",
}


def linear_cases(family: str | None = None):
    return [case for case in serving_cases("smoke", 0) if case.op == "add_lora_linear" and family in (None, case.family)]


def served(target_class, case):
    """The case's result as the serving level judges it, the target's half run in this process."""
    name = f"serving_targets:{target_class.__name__}"
    initial, steps = request_values(case)
    run = drive(name, target_class(), case, initial, steps)
    return SERVING.judged(case.case_id, case, initial, steps, run)


def test_the_graph_safe_layer_passes_every_linear_serving_case():
    results = [served(GraphSafeLinear, case) for case in linear_cases()]
    assert len(results) == 24
    failed = [f"{r.case_id}: {r.message}" for r in results if r.outcome is not Outcome.PASS]
    assert not failed, failed
    assert all("graph(s) captured" in r.message for r in results if any(s.mode == "capture" for s in r.case.steps))


@pytest.mark.parametrize("fault", SERVING_FAULTS, ids=lambda fault: fault.name)
def test_each_serving_fault_fails_its_family_on_stale_state_alone(fault):
    results = [served(fault, case) for case in linear_cases(CAUGHT_IN[fault])]
    failed = [r for r in results if r.outcome is not Outcome.PASS]
    assert failed, f"{fault.name} passed every {CAUGHT_IN[fault]} case"
    for result in failed:
        assert result.outcome is Outcome.FAIL and result.kinds == (FailureKind.STALE_STATE,), (result.case_id, result.message)
        assert "the same batch called fresh passes" in result.message, result.message


def test_a_layer_that_captures_nothing_serves_every_step_eagerly_and_says_so():
    result = served(EagerLinear, linear_cases("stale_tail")[0])
    assert result.outcome is Outcome.PASS, result.message
    assert "serving-eager captures nothing (capture returned None)" in result.message, result.message
