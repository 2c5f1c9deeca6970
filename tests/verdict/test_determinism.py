"""Determinism as the referee measures it (``conformance.referee.judge_op``, ``conformance.runner.attempted``):
bit-for-bit comparison of repeated calls, a second attempt of a failure, and the labels they give."""

from __future__ import annotations

import torch

from conformance.generator import profile_cases
from conformance.runner import run_case
from conformance.targets.hpu.targets import HpuEmulatedTarget
from conformance.verdict import FailureKind, Outcome


def _case():
    return next((i, c) for i, c in profile_cases("smoke", 0)
                if c.op == "bgmv_shrink" and c.dtype == "float32" and any(s != -1 for s in c.token_slots))


class WrongOnCalls(HpuEmulatedTarget):
    """Doubles its scale on the calls whose numbers (from 1, over the target's life) are in ``wrong``."""

    def __init__(self, wrong: set[int]) -> None:
        super().__init__()
        self.wrong, self.calls = wrong, 0

    def bgmv_shrink(self, inputs, lora_a_weights, output_tensor, lora_indices_tensor, scaling=1.0):
        self.calls += 1
        scaling = scaling * 2 if self.calls in self.wrong else scaling
        return super().bgmv_shrink(inputs, lora_a_weights, output_tensor, lora_indices_tensor, scaling)


def test_identical_calls_are_deterministic_and_measured():
    case_id, case = _case()
    result = run_case(HpuEmulatedTarget(), case, case_id, runs=3)
    assert result.outcome is Outcome.PASS and result.stability == "deterministic"
    assert result.determinism == {"calls": 3, "identical": True, "differing_elements": 0, "max_abs_difference": 0.0, "attempts": 1}
    assert run_case(HpuEmulatedTarget(), case, case_id, runs=1).stability is None  # one call: nothing to compare


def test_a_failure_that_a_second_attempt_does_not_repeat_is_flaky():
    case_id, case = _case()
    result = run_case(WrongOnCalls({1}), case, case_id, runs=1)
    assert result.outcome is Outcome.FAIL and result.stability == "flaky", result
    assert "(flaky: attempt 2 of 2 passed)" in result.message
    assert result.determinism["attempts"] == 2 and not result.determinism["identical"]


def test_a_failure_that_repeats_the_same_way_is_consistent():
    case_id, case = _case()
    result = run_case(WrongOnCalls({1, 2}), case, case_id, runs=1)
    assert result.outcome is Outcome.FAIL and result.stability == "deterministic", result
    assert run_case(WrongOnCalls({1}), case, case_id, runs=1, second_attempt=False).stability is None


def test_calls_that_differ_in_one_attempt_are_nondeterministic_and_fail_only_when_determinism_is_required():
    case_id, case = _case()

    class Wobbles(HpuEmulatedTarget):
        calls = 0

        def bgmv_shrink(self, inputs, lora_a_weights, output_tensor, lora_indices_tensor, scaling=1.0):
            super().bgmv_shrink(inputs, lora_a_weights, output_tensor, lora_indices_tensor, scaling)
            self.calls += 1
            row = next(r for r, s in enumerate(lora_indices_tensor.tolist()) if s != -1)
            if self.calls % 2 == 0:
                output_tensor[row, 0] = torch.nextafter(output_tensor[row, 0], torch.tensor(float("inf")))

    labelled = run_case(Wobbles(), case, case_id)
    assert labelled.outcome is Outcome.PASS and labelled.stability == "nondeterministic"
    assert labelled.determinism["differing_elements"] == 1 and labelled.determinism["max_abs_difference"] > 0
    required = run_case(Wobbles(), case, case_id, require_deterministic=True)
    assert required.outcome is Outcome.FAIL and required.kinds == (FailureKind.NONDETERMINISTIC,)
