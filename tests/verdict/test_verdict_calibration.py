"""A correct low-precision target is never flagged, whatever the run seed.

``PlainTorchTarget`` (tests/fault_targets.py) computes every op correctly in the case dtype with
float32 accumulation and vLLM's roundings, but in a different order than the reference (one product
against all slots, then a mask). The verdict's budget (``conformance/verdict/tolerances.py``) must
leave room for that: over several smoke profiles (run seeds 1–4; seed 0 runs in
test_fault_catalog.py) no case may end FAIL or BROKEN, and every case must keep headroom below the
budget. Each seed runs a whole smoke profile: about 6 s of one core (15 s when the profile cache is cold).
"""

from __future__ import annotations

import pytest
from fault_targets import PlainTorchTarget

from conformance.generator.profiles import profile_cases
from conformance.runner import run_case
from conformance.verdict import Outcome

RUN_SEEDS = (1, 2, 3, 4)
HEADROOM = 0.75
"""Largest budget ratio a correct target may reach (1 = on the budget). Measured over run seeds 1–16
(11,952 cases): at most 0.17 for float16 outputs, 0.27 for bfloat16, 0.42 for float32."""


@pytest.mark.slow
@pytest.mark.parametrize("run_seed", RUN_SEEDS, ids=lambda seed: f"seed{seed}")
def test_a_correct_low_precision_target_is_never_flagged(run_seed):
    target = PlainTorchTarget()
    results = [run_case(target, case, case_id) for case_id, case in profile_cases("smoke", run_seed)]
    flagged = [f"{r.case_id}: {r.outcome.value}: {r.message}" for r in results if r.outcome in (Outcome.FAIL, Outcome.BROKEN)]
    assert flagged == []
    tight = [
        f"{r.case_id}: budget ratio {r.measurement.budget_ratio:.3g}"
        for r in results
        if r.measurement is not None and r.measurement.budget_ratio > HEADROOM
    ]
    assert tight == [], f"a correct target came within {1 - HEADROOM:.0%} of the error budget"
