"""End to end, a correct plain target passes and seeded LoRA bugs fail, each for the right requests.

The fault targets (tests/fault_targets.py) are the op-level catalog's; here they run the suite's
decoder on the smoke set of end-to-end cases. What a bug breaks shows in *which* requests fail:
the −1 bug breaks only base requests (the symptom the vLLM CPU expectation checks), a lost last slot
only the adapter in it, and so on.
"""

from __future__ import annotations

import pytest
from fault_targets import (
    FirstSliceWeightsForAllSlices,
    LastSlotNeverApplied,
    LogitsUseTokenMapping,
    NegativeIndexIsLastSlot,
    PlainTorchTarget,
    RankTailIgnored,
    SlotIdUsedAsSlot,
)

from conformance.e2e.cases import e2e_cases
from conformance.e2e.generation import slot_assignment
from conformance.e2e.run import E2ERunner
from conformance.verdict import Outcome

SMOKE = e2e_cases("smoke")


def outcomes(target) -> dict:
    runner = E2ERunner(target)
    return {case.case_id: runner.run(case) for case in SMOKE}


def test_a_correct_plain_target_passes_every_smoke_case():
    results = outcomes(PlainTorchTarget())
    assert {r.outcome for r in results.values()} == {Outcome.PASS}, {k: r.message for k, r in results.items()}


def test_no_adapter_rows_getting_the_last_slot_fail_only_base_requests():
    results = outcomes(NegativeIndexIsLastSlot())
    failed = [r for r in results.values() if r.outcome is Outcome.FAIL]
    assert {r.case.kind for r in failed} >= {"teacher_forced_logits", "greedy_generation", "batch_invariance"}
    for result in failed:
        assert set(result.failing_slots) == {-1}, result.message
        assert "request base" in result.message


def test_a_lost_last_slot_fails_the_adapter_in_it():
    results = outcomes(LastSlotNeverApplied())
    failed = [r for r in results.values() if r.outcome is Outcome.FAIL]
    assert failed
    for result in failed:
        slots, _ = slot_assignment(result.case.requests, result.case.max_loras)
        assert set(result.failing_slots) == {len(slots) - 1}, result.message


@pytest.mark.parametrize("fault", [SlotIdUsedAsSlot, RankTailIgnored, FirstSliceWeightsForAllSlices, LogitsUseTokenMapping])
def test_other_lora_bugs_fail_end_to_end(fault):
    results = outcomes(fault())
    assert any(r.outcome in (Outcome.FAIL, Outcome.BROKEN) for r in results.values()), fault.__name__


def test_not_implemented_is_not_supported_end_to_end_as_for_op_cases():
    class NoLogitsYet(PlainTorchTarget):
        def add_lora_logits(self, *args, **kwargs):
            raise NotImplementedError("LoRA on the logits head is not ported yet")

    case = SMOKE[0]
    result = E2ERunner(NoLogitsYet()).run(case)
    assert result.outcome is Outcome.NOT_SUPPORTED and "not ported yet" in result.message
