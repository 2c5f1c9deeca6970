"""End to end on the MoE model: a correct target passes, seeded MoE LoRA bugs fail, and targets without
MoE LoRA report the MoE cases not supported, naming why.

The faults wrap the golden reference's ``add_lora_w13``/``add_lora_w2`` (docs/moe.md) and change one
thing each, a bug class a backend's fused MoE LoRA can have; they run the MoE smoke cases (teacher
forced and greedy on ``moe-mixed`` in float32).
"""

from __future__ import annotations

from dataclasses import replace

import pytest
import torch
from fault_targets import PlainTorchTarget

from conformance.e2e.cases import E2E_CASES, MOE_MODEL, e2e_cases
from conformance.e2e.generation import slot_assignment
from conformance.e2e.run import E2ERunner
from conformance.targets.reference import ReferenceTarget
from conformance.verdict import Outcome

# the unquantized MoE model's smoke cases (the fp8 model's one, moe-fp8-mixed, has no attention-only adapter:
# tests/e2e/test_e2e_engine_checks.py runs it)
MOE_SMOKE = [case for case in e2e_cases("smoke") if case.model == MOE_MODEL]


def outcomes(target) -> dict:
    runner = E2ERunner(target)
    return {case.case_id: runner.run(case) for case in MOE_SMOKE}


class W2WithoutRoutingWeight(ReferenceTarget):
    """w2's delta not multiplied by the routing weight (``mul_routed_weight`` lost)."""

    def add_lora_w2(self, y, x, lora_a, lora_b, topk_ids, topk_weights, adapter_enabled, **kwargs):
        super().add_lora_w2(y, x, lora_a, lora_b, topk_ids, torch.ones_like(topk_weights), adapter_enabled, **kwargs)


class W13WithRoutingWeight(ReferenceTarget):
    """w13's delta multiplied by the routing weight too (``mul_routed_weight`` on both GEMMs)."""

    def add_lora_w13(self, y, x, lora_a, lora_b, topk_ids, topk_weights, adapter_enabled, **kwargs):
        delta = torch.zeros_like(y)
        super().add_lora_w13(delta, x, lora_a, lora_b, topk_ids, topk_weights, adapter_enabled, **kwargs)
        y += (delta.to(torch.float32) * topk_weights[..., None]).to(y.dtype)


class NeighbourExpert(ReferenceTarget):
    """Each choice reads the next expert's LoRA weights (an expert index off by one)."""

    def _shifted(self, topk_ids, lora_a):
        return (topk_ids + 1) % lora_a[0].size(1)

    def add_lora_w13(self, y, x, lora_a, lora_b, topk_ids, *args, **kwargs):
        super().add_lora_w13(y, x, lora_a, lora_b, self._shifted(topk_ids, lora_a), *args, **kwargs)

    def add_lora_w2(self, y, x, lora_a, lora_b, topk_ids, *args, **kwargs):
        super().add_lora_w2(y, x, lora_a, lora_b, self._shifted(topk_ids, lora_a), *args, **kwargs)


class W2ReadsTheFirstChoiceRow(ReferenceTarget):
    """w2 reads row ``t·top_k`` for every choice of token ``t`` (its input indexed by token, not by pair)."""

    def add_lora_w2(self, y, x, *args, **kwargs):
        top_k = y.size(1)
        super().add_lora_w2(y, x.view(-1, top_k, x.size(-1))[:, :1].expand(-1, top_k, -1).reshape(x.shape), *args, **kwargs)


class GateUpHalvesSwapped(ReferenceTarget):
    """The fused gate/up slice's B read as [up, gate] (a backend that splits ``2·I`` the other way round)."""

    def add_lora_w13(self, y, x, lora_a, lora_b, *args, **kwargs):
        swapped = tuple(torch.cat(b.chunk(2, dim=2)[::-1], dim=2) for b in lora_b)
        super().add_lora_w13(y, x, lora_a, swapped, *args, **kwargs)


class AdapterEnabledOffByOne(ReferenceTarget):
    """``adapter_enabled`` read one entry late: slot ``l`` is enabled by entry ``l + 1``."""

    def _late(self, adapter_enabled):
        return torch.cat([adapter_enabled[1:], adapter_enabled[:1] * 0])

    def add_lora_w13(self, y, x, lora_a, lora_b, topk_ids, topk_weights, adapter_enabled, **kwargs):
        super().add_lora_w13(y, x, lora_a, lora_b, topk_ids, topk_weights, self._late(adapter_enabled), **kwargs)

    def add_lora_w2(self, y, x, lora_a, lora_b, topk_ids, topk_weights, adapter_enabled, **kwargs):
        super().add_lora_w2(y, x, lora_a, lora_b, topk_ids, topk_weights, self._late(adapter_enabled), **kwargs)


class MoENegativeIndexIsLastSlot(ReferenceTarget):
    """In the MoE ops only, tokens without adapter (slot −1) get the last slot's (vLLM's −1 bug, there)."""

    def _wrapped(self, method, *args, **kwargs):
        mapping = self.mapping
        last = mapping.num_slots - 1
        self.update_metadata(replace(mapping, token_slots=tuple(last if s == -1 else s for s in mapping.token_slots)))
        try:
            method(*args, **kwargs)
        finally:
            self.update_metadata(mapping)

    def add_lora_w13(self, *args, **kwargs):
        self._wrapped(super().add_lora_w13, *args, **kwargs)

    def add_lora_w2(self, *args, **kwargs):
        self._wrapped(super().add_lora_w2, *args, **kwargs)


def test_the_moe_smoke_cases_are_teacher_forced_and_greedy_on_the_mixed_moe_batch():
    assert {(case.kind, case.batch, case.dtype) for case in MOE_SMOKE} == {
        ("teacher_forced_logits", "moe-mixed", "float32"), ("greedy_generation", "moe-mixed", "float32")}
    assert all(case.op == "moe_" + case.kind and case.model == MOE_MODEL for case in MOE_SMOKE)


def test_the_reference_in_the_case_dtype_passes_every_moe_case():
    runner = E2ERunner(ReferenceTarget())
    results = {case.case_id: runner.run(case) for case in E2E_CASES if case.is_moe}
    assert len(results) == 22  # 18 on the MoE model, 4 on its fp8 twin
    assert {r.outcome for r in results.values()} == {Outcome.PASS}, {k: r.message for k, r in results.items()}


@pytest.mark.parametrize("fault", [W2WithoutRoutingWeight, W13WithRoutingWeight, NeighbourExpert, W2ReadsTheFirstChoiceRow,
                                   GateUpHalvesSwapped, AdapterEnabledOffByOne])
def test_moe_lora_bugs_fail_end_to_end(fault):
    results = outcomes(fault())
    failed = [r for r in results.values() if r.outcome is Outcome.FAIL]
    assert len(failed) == len(MOE_SMOKE), {k: (r.outcome, r.message) for k, r in results.items()}
    for result in failed:  # only requests whose adapter has expert LoRA can be wrong
        slots, _ = slot_assignment(result.case.requests, result.case.max_loras)
        assert -1 not in result.failing_slots and slots.index("moe-attn-qv-r6") not in result.failing_slots, result.message


def test_moe_no_adapter_tokens_getting_the_last_slot_fail_only_base_requests():
    results = outcomes(MoENegativeIndexIsLastSlot())
    assert {r.outcome for r in results.values()} == {Outcome.FAIL}, {k: r.message for k, r in results.items()}
    for result in results.values():
        assert set(result.failing_slots) == {-1}, result.message
        assert "request base" in result.message


def test_a_correct_plain_target_passes_the_moe_smoke_cases():
    results = outcomes(PlainTorchTarget())  # tests/fault_targets.py: its own mask-based fused MoE LoRA kernel
    assert {r.outcome for r in results.values()} == {Outcome.PASS}, {k: r.message for k, r in results.items()}


class WithoutMoELoRA(PlainTorchTarget):
    add_lora_w13 = add_lora_w2 = None  # an op set to None is not defined (conformance/targets/base.py)


def test_a_target_without_moe_lora_methods_reports_the_moe_cases_not_supported():
    runner = E2ERunner(WithoutMoELoRA())
    for case in [c for c in E2E_CASES if c.is_moe]:
        result = runner.run(case)
        assert result.outcome is Outcome.NOT_SUPPORTED
        assert "does not implement add_lora_w13, add_lora_w2" in result.message


def test_a_vllm_engine_target_reports_the_moe_cases_not_supported_naming_why():
    class VllmEngineWithoutMoE(WithoutMoELoRA):
        name = "vllm-like"
        generation_engine = "vllm"

    class VllmEngineWithMoE(PlainTorchTarget):
        name = "vllm-like"
        generation_engine = "vllm"

    case = MOE_SMOKE[0]
    without = E2ERunner(VllmEngineWithoutMoE()).run(case)
    assert without.outcome is Outcome.NOT_SUPPORTED
    assert "through the installed vLLM engine" in without.message and "add_lora_w13, add_lora_w2 missing" in without.message
    assert "PunicaWrapperBase raises NotImplementedError" in without.message
    with_methods = E2ERunner(VllmEngineWithMoE()).run(case)
    assert with_methods.outcome is Outcome.NOT_SUPPORTED
    assert "does not drive vLLM's MoE LoRA engine path" in with_methods.message
