"""End to end on the parallel-block model (tiny-cohere): 5 packed slices in one ``add_lora_linear`` call.

Its layers' attention and MLP read the same LayerNorm'd input, so the suite's decoder runs q, k, v, gate
and up as one call of 5 slices of widths (64, 32, 32, 96, 96), as a backend that fuses them would. The
dense Llama's widest call is QKV's 3 slices, so a backend that serves at most three slices passes every
Llama case and only these catch it. vLLM's own Cohere makes two calls (3 + 2 slices): on a vLLM engine
target these cases are not supported, saying why.
"""

from __future__ import annotations

import torch
from fault_targets import PackedSlicesCappedAtThree

from conformance.e2e.cases import E2E_CASES, FIVE, GATE_UP, K_UP, PARALLEL_MODEL, E2ECase, e2e_cases
from conformance.e2e.decoder_engine import DecoderEngine
from conformance.e2e.generation import Request
from conformance.e2e.lora_stacks import LoRAStacks
from conformance.e2e.run import E2ERunner
from conformance.targets.reference import ReferenceTarget
from conformance.verdict import Outcome

PACKED5_SMOKE = [case for case in e2e_cases("smoke") if case.model == PARALLEL_MODEL]
WIDTHS = (64, 32, 32, 96, 96)  # q, k, v, gate, up


def test_the_packed5_smoke_cases_are_teacher_forced_and_greedy_on_the_mixed_batch():
    assert {(case.kind, case.batch, case.dtype) for case in PACKED5_SMOKE} == {
        ("teacher_forced_logits", "packed5-mixed", "float32"), ("greedy_generation", "packed5-mixed", "float32")}
    packed5 = [case for case in E2E_CASES if case.model == PARALLEL_MODEL]
    assert len(packed5) == 12 and {case.dtype for case in packed5} == {"float32", "bfloat16", "float16"}
    assert all(case.op == case.kind and "packed_5_slices" in case.features() for case in packed5)  # dense LoRA ops
    assert not any("packed_5_slices" in case.features() for case in E2E_CASES if case.model != PARALLEL_MODEL)
    assert {"neg1", "last_slot"} <= PACKED5_SMOKE[0].features()


class CallRecorder(ReferenceTarget):
    """The reference, recording the slice widths of every ``add_lora_linear`` call."""

    def __init__(self) -> None:
        super().__init__()
        self.calls: list[tuple[int, ...]] = []

    def add_lora_linear(self, y, x, lora_a_stacked, lora_b_stacked, scale, output_slices, **kwargs):
        self.calls.append(tuple(output_slices))
        super().add_lora_linear(y, x, lora_a_stacked, lora_b_stacked, scale, output_slices, **kwargs)


def test_the_decoder_packs_q_k_v_gate_up_into_one_call_of_5_slices():
    fixture = E2ERunner(ReferenceTarget()).model(PARALLEL_MODEL)
    recorder = CallRecorder()
    engine = DecoderEngine(recorder, fixture.checkpoint, fixture.adapters, torch.float32)
    engine.generate([Request("Once upon a time", FIVE), Request("A", None)], 1, 5, max_loras=1)
    # per layer: q/k/v/gate/up, then o_proj (attention), then down_proj (MLP)
    assert recorder.calls == [WIDTHS, (64,), (64,)] * fixture.checkpoint.config.num_hidden_layers


def test_the_stacks_zero_the_slices_an_adapter_does_not_target():
    fixture = E2ERunner(ReferenceTarget()).model(PARALLEL_MODEL)
    adapters = tuple(fixture.adapters[name] for name in (FIVE, K_UP, GATE_UP))
    stacks = LoRAStacks.build(adapters, fixture.checkpoint.config, torch.float64, "cpu")
    assert set(stacks.layers[1]) == {"qkv_gate_up_proj", "o_proj", "down_proj"}
    site = stacks.layers[1]["qkv_gate_up_proj"]
    assert site.output_slices == WIDTHS and all(b.shape == (3, 1, width, 8) for b, width in zip(site.lora_b, WIDTHS))
    targeted = [[bool(site.lora_b[s][slot].any()) for s in range(5)] for slot in range(3)]
    assert targeted == [[True] * 5, [False, True, False, False, True], [False, False, False, True, True]]
    k = fixture.adapters[K_UP].delta(1, "k_proj")
    torch.testing.assert_close(site.lora_b[1][1, 0, :, :4], k.b.double() * 2.0)  # alpha 8 / r 4, rank padded to 8
    assert not site.lora_b[1][1, 0, :, 4:].any()


def test_the_reference_in_the_case_dtype_passes_every_packed5_case():
    runner = E2ERunner(ReferenceTarget())
    results = {case.case_id: runner.run(case) for case in E2E_CASES if case.model == PARALLEL_MODEL}
    assert {r.outcome for r in results.values()} == {Outcome.PASS}, {k: r.message for k, r in results.items()}


def test_slices_past_the_third_dropped_fail_the_packed5_cases_but_no_llama_case():
    """Every fixture adapter of the parallel model has LoRA on gate or up (slices 3 and 4): its requests
    fail, base requests do not; the Llama's widest call has 3 slices, so its cases cannot see the bug."""
    runner = E2ERunner(PackedSlicesCappedAtThree())
    for case in PACKED5_SMOKE:
        result = runner.run(case)
        assert result.outcome is Outcome.FAIL, (case.case_id, result.outcome, result.message)
        assert -1 not in result.failing_slots and "request base" not in result.message, result.message
    assert set(runner.run(PACKED5_SMOKE[0]).failing_slots) == {0, 1, 2}  # teacher forced: every adapter
    llama = E2ECase("teacher_forced_logits", "mixed", "float32", True)
    assert runner.run(llama).outcome is Outcome.PASS


def test_a_vllm_engine_target_reports_the_packed5_cases_not_supported_naming_why():
    class VllmEngineTarget(ReferenceTarget):
        name = "vllm-like"
        generation_engine = "vllm"

    runner = E2ERunner(VllmEngineTarget())
    for case in [c for c in E2E_CASES if c.model == PARALLEL_MODEL]:
        result = runner.run(case)
        assert result.outcome is Outcome.NOT_SUPPORTED, result.message
        assert "vllm/model_executor/models/commandr.py" in result.message
        assert "qkv_proj (3 slices) and gate_up_proj (2 slices)" in result.message
