"""The checks every end-to-end case adds: base-request invariance and graphs vs eager (docs/e2e.md).

Base-request invariance: requests without an adapter must get what the same engine with LoRA disabled gives
them. A seeded fault that hands base rows slot 0's delta in one layer fails there as ``changed base requests``
and on no other kind, on its base requests only; expert LoRA fed the fp8 codes of its activations (vllm#42007)
fails the fp8 MoE smoke case on adapter requests. Graphs vs eager: a target that captures its decode steps with
the CPU graph emulation gives the eager tokens while the graphs serve the batch they were captured for, and fails
when a graph captured for a batch without adapters serves one with them.
"""

from __future__ import annotations

import pytest
import torch
from fault_targets import BaseRowsGetSlotZeroInOneLayer, PlainTorchTarget

from conformance.e2e.cases import E2ECase
from conformance.e2e.fp8 import E4M3_MAX, MIN_SCALE
from conformance.e2e.generation import slot_assignment
from conformance.e2e.production import BASE_CHECK, GRAPHS_CHECK, batch_plan
from conformance.e2e.referee import CHECKED, NO_BASE_REQUEST, ONE_PREFILL
from conformance.e2e.run import E2ERunner
from conformance.targets.capture import emulated_capture
from conformance.verdict import FailureKind, Outcome


class CapturedPlainTorch(PlainTorchTarget):
    """The plain target serving through the CPU graph emulation. It reads the active slots on the host
    (``tolist()`` of its metadata) and writes each mapping into new tensors, so a graph replays the mapping of
    the batch it was captured with: right while the batch is that batch, wrong for another (the "frozen at
    capture" class of serving bugs: a no-LoRA batch captured, adapters served later)."""

    name = "plain-torch-captured"

    def capture(self, step):
        return emulated_capture(step)


def case(kind, batch, dtype="float32") -> E2ECase:
    return E2ECase(kind, batch, dtype, False)


def test_every_case_with_base_requests_plans_a_run_with_lora_disabled_and_every_generator_a_graph_run():
    plans = {(c.kind, c.batch): [p.name for p in batch_plan(c)] for c in (
        case("greedy_generation", "mixed"), case("greedy_generation", "adapters-only"),
        case("token_classification", "tokcls-mixed"))}
    assert plans[("greedy_generation", "mixed")] == ["batch", BASE_CHECK, GRAPHS_CHECK]
    assert plans[("greedy_generation", "adapters-only")] == ["batch", GRAPHS_CHECK]
    assert plans[("token_classification", "tokcls-mixed")] == ["batch", BASE_CHECK]


def test_a_correct_target_passes_and_the_result_says_what_was_checked():
    runner = E2ERunner(PlainTorchTarget())
    mixed = runner.run(case("greedy_generation", "mixed"))
    assert mixed.outcome is Outcome.PASS, mixed.message
    assert mixed.engine_checks == {"base_request_invariance": CHECKED, "graphs_vs_eager":
                                   "eager only: plain-torch runs every step eagerly (Target.capture returns None)"}
    assert mixed.to_json()["engine_checks"] == mixed.engine_checks
    alone = runner.run(case("teacher_forced_logits", "adapters-only"))
    assert alone.outcome is Outcome.PASS and alone.engine_checks["base_request_invariance"] == NO_BASE_REQUEST
    labels = runner.run(case("token_classification", "tokcls-mixed"))
    assert labels.outcome is Outcome.PASS and labels.engine_checks == {"base_request_invariance": CHECKED,
                                                                       "graphs_vs_eager": ONE_PREFILL}


@pytest.mark.parametrize(("kind", "batch"), [("greedy_generation", "mixed"), ("teacher_forced_logits", "moe-mixed"),
                                             ("batch_invariance", "mixed"), ("greedy_generation", "one-slot")])
def test_lora_changing_base_requests_fails_on_its_own_kind_only(kind, batch):
    result = E2ERunner(BaseRowsGetSlotZeroInOneLayer()).run(case(kind, batch))
    assert result.outcome is Outcome.FAIL
    assert result.kinds == (FailureKind.BASE_CHANGED,), result.message
    assert set(result.failing_slots) == {-1}
    assert "base-request invariance: request base · " in result.message
    assert "the same engine with LoRA disabled at step" in result.message or "position" in result.message


@pytest.mark.parametrize("batch", ["adapters-only", "moe-fp8-mixed"])
def test_the_fault_passes_where_it_changes_nothing(batch):
    """No base request (adapters-only), or slot 0's adapter has no q/k/v LoRA (moe-fp8-mixed: moe-experts-r4), so
    the delta base rows get is zero: the check raises no false alarm."""
    result = E2ERunner(BaseRowsGetSlotZeroInOneLayer()).run(case("greedy_generation", batch))
    assert result.outcome is Outcome.PASS, result.message


class LoRAReadsFp8CodesWithoutScale(PlainTorchTarget):
    """The expert LoRA shrinks read the activations as the fp8 base GEMM does, quantized per row, but without
    their scale: the e4m3 codes ``x / scale`` (vllm#42007: the MoE LoRA kernel got the hidden states the MoE
    layer had already quantized, "values 50-500x" off, and adapter requests generated gibberish)."""

    name = "fault-moe-lora-reads-fp8-codes"

    @staticmethod
    def _codes(x):
        scale = (x.float().abs().amax(-1, keepdim=True) / E4M3_MAX).clamp(min=MIN_SCALE)
        return (x.float() / scale).clamp(-E4M3_MAX, E4M3_MAX).to(torch.float8_e4m3fn).to(x.dtype)

    def add_lora_w13(self, y, x, *args, **kwargs):
        return super().add_lora_w13(y, self._codes(x), *args, **kwargs)

    def add_lora_w2(self, y, x, *args, **kwargs):
        return super().add_lora_w2(y, self._codes(x), *args, **kwargs)


def test_expert_lora_on_fp8_codes_fails_the_fp8_smoke_case_on_its_adapter_requests():
    result = E2ERunner(LoRAReadsFp8CodesWithoutScale()).run(case("greedy_generation", "moe-fp8-mixed"))
    assert result.outcome is Outcome.FAIL and FailureKind.BASE_CHANGED not in result.kinds, result.message
    slots, _ = slot_assignment(result.case.requests, result.case.max_loras)
    assert -1 not in result.failing_slots and set(result.failing_slots) <= set(range(len(slots))), result.message


def test_graphs_replayed_for_the_batch_they_were_captured_for_give_the_eager_tokens():
    result = E2ERunner(CapturedPlainTorch()).run(case("greedy_generation", "mixed"))
    assert result.outcome is Outcome.PASS, result.message
    assert result.engine_checks["graphs_vs_eager"] == CHECKED


def test_graphs_captured_without_adapters_fail_when_they_serve_adapters():
    runner = E2ERunner(CapturedPlainTorch())
    assert runner.run(case("greedy_generation", "base-only")).outcome is Outcome.PASS
    result = runner.run(case("greedy_generation", "adapters-only"))  # replays base-only's graphs: every row −1
    assert result.outcome is Outcome.FAIL and result.kinds == (FailureKind.TOKENS,), result.message
    assert "with captured graphs: request " in result.message and "the same engine run eagerly" in result.message


def test_hpu_emulated_graphs_serve_batches_after_the_one_they_were_captured_for():
    """Its piecewise graphs share the slot masks one piece makes and the next reads (kept on the host side, as a
    device graph keeps them at their addresses): a batch without adapters replays the graphs an adapter batch
    captured, and the reverse, and gets the eager tokens."""
    from conformance.targets import load

    runner = E2ERunner(load("hpu-emulated"))
    for batch in ("adapters-only", "base-only", "mixed"):
        result = runner.run(case("greedy_generation", batch))
        assert result.outcome is Outcome.PASS and result.engine_checks["graphs_vs_eager"] == CHECKED, (batch, result.message)


def test_vllm_on_the_cpu_says_graphs_are_not_supported_here():
    pytest.importorskip("vllm")
    from conformance.e2e.vllm_engine import VllmEngine

    assert VllmEngine.graphs_unsupported_reason().startswith("not supported here: vLLM on the CPU captures no graphs")
