"""The fp8 ops' cases: what their values hold, and that their seeded faults are caught by their smoke cases.

Every fp8 operand must hold codes a target saturating at Gaudi 2's ±240 gets wrong (magnitudes in
(240, 448]) and no code beyond e4m3fn's ±448; every scale must be a positive float32 of the shape its
granularity gives, chosen as a quantizer chooses it (each group's largest value on the code ±448), and
the profile must hold both float32 ``amax / 448`` scales and power-of-two ones (docs/cases.md, *fp8
ops*). The faults of ``fault_targets.FP8_FAULTS`` change only the fp8 ops, so their own smoke cases (12)
must catch each; the correct targets pass them all. ``fused_moe_lora_fp8`` (last section) has its own smoke
cases (9: three per granularity), values and faults (``fault_targets.MOE_FP8_FAULTS``).
"""

from __future__ import annotations

import dataclasses
import math
import os
import threading

import pytest
import torch
from fault_targets import FP8_FAULTS, MOE_FP8_FAULTS, Fp8ScaledAfterSumTarget, Fp8ScaleRoundedToBf16, PlainTorchTarget

from conformance.cases.fp8_values import FP8_MAX, GAUDI2_FP8_MAX
from conformance.cases.values import generator_for
from conformance.generator.profiles import profile_cases
from conformance.ops import OP_SPECS
from conformance.runner import run_case
from conformance.verdict import FailureKind, Outcome
from conformance.wire import Channel

FP8_OPS = ("lora_shrink_fp8", "lora_expand_fp8")


@pytest.fixture(scope="module")
def fp8_smoke_cases():
    return profile_cases("smoke", ops=FP8_OPS)


def expected_scale_shape(case, name: str, value: torch.Tensor) -> tuple[int, ...]:
    shrink = case.op == "lora_shrink_fp8"
    k = case.hidden_size if shrink else case.max_rank
    rows = case.num_tokens
    if name == "a_scale":
        return {"tensor": (1,), "channel": (rows, 1), "block": (rows, -(-k // max(case.group_k, 1)))}[case.fp8_scales]
    n = case.max_rank if shrink else case.output_slices[int(name.split(".")[1])]
    return {
        "tensor": (case.num_slots,),
        "channel": (case.num_slots, n),
        "block": (case.num_slots, -(-n // max(case.group_n, 1)), -(-k // max(case.group_k, 1))),
    }[case.fp8_scales]


def test_the_smoke_profile_holds_each_granularity_of_each_op(fp8_smoke_cases):
    seen = {(case.op, case.fp8_scales) for _, case in fp8_smoke_cases}
    assert seen == {(op, scales) for op in FP8_OPS for scales in ("tensor", "channel", "block")}
    assert all(-1 in case.token_slots and set(case.token_slots) != {-1} for _, case in fp8_smoke_cases)
    assert len(fp8_smoke_cases) <= 60 and len(profile_cases("standard", ops=FP8_OPS)) <= 250


def largest_code_per_activation_scale(case, x: torch.Tensor) -> torch.Tensor:
    """max |code| over the elements each ``a_scale`` entry dequantizes (the expand's span every slice)."""
    x = x.float().abs().reshape(-1, *x.shape[-2:]).amax(dim=0)  # [T, K]
    if case.fp8_scales == "tensor":
        return x.amax().reshape(1)
    if case.fp8_scales == "channel":
        return x.amax(dim=1)
    return torch.stack([x[:, k : k + case.group_k].amax(dim=1) for k in range(0, x.size(1), case.group_k)], dim=1)


def is_power_of_two(scale: torch.Tensor) -> bool:
    return all(math.frexp(s)[0] == 0.5 for s in scale.flatten().tolist())


def test_fp8_values_hold_codes_beyond_gaudi2_range_and_quantizer_scales(fp8_smoke_cases):
    kinds = set()
    for case_id, case in fp8_smoke_cases:
        values = OP_SPECS[case.op].make_values(case, generator_for(case))
        operands = {name: v for name, v in values.items() if v.dtype == torch.float8_e4m3fn}
        assert set(operands) == {"x"} | {f"lora_{'a' if case.op == 'lora_shrink_fp8' else 'b'}.{s}" for s in range(case.num_slices)}
        for name, value in operands.items():
            magnitude = value.float().abs()
            assert magnitude.max() <= FP8_MAX, (case_id, name)
            assert ((magnitude > GAUDI2_FP8_MAX) & (magnitude <= FP8_MAX)).any(), (case_id, name)
        # a quantizer's scale puts each group's largest value on ±448 (amax / 448), or past it (power of two: saturates)
        assert (largest_code_per_activation_scale(case, values["x"]) == FP8_MAX).all(), case_id
        for name, value in values.items():
            if "scale" in name:
                assert value.dtype == torch.float32 and tuple(value.shape) == expected_scale_shape(case, name, value), (case_id, name)
                assert (value > 0).all() and value.isfinite().all(), (case_id, name)
                kinds.add(is_power_of_two(value))
    assert kinds == {True, False}  # arbitrary float32 scales, and power-of-two ones


@pytest.mark.parametrize("target", [PlainTorchTarget, Fp8ScaledAfterSumTarget], ids=lambda t: t.name)
def test_correct_targets_pass_every_fp8_smoke_case(target, fp8_smoke_cases):
    results = [run_case(target(), case, case_id) for case_id, case in fp8_smoke_cases]
    assert [f"{r.case_id}: {r.message}" for r in results if r.outcome is not Outcome.PASS] == []


@pytest.mark.parametrize("fault", FP8_FAULTS, ids=lambda fault: fault.name.removeprefix("fault-"))
def test_each_fp8_fault_fails_an_fp8_smoke_case(fault, fp8_smoke_cases):
    outcomes = [run_case(fault(), case, case_id).outcome for case_id, case in fp8_smoke_cases]
    assert Outcome.FAIL in outcomes and Outcome.BROKEN not in outcomes, fault.__doc__.splitlines()[0]


def test_a_weight_scale_rounded_to_bf16_is_a_systematic_error_in_16_bit_outputs(fp8_smoke_cases):
    """``bf16(s) / s`` is a gain of up to 2⁻⁹ on every delta a scale serves: in a float32 output (the shrink
    buffer, a float32 expand) thousands of ulps, in a 16-bit one inside the elementwise budget, where the
    systematic-error rule is what sees it where one scale serves the rows (per tensor); where each channel or
    block has its own scale the gains differ from column to column, and the precision rule sees their spread
    beyond the delta's one multiple. Power-of-two scales are exact in bfloat16: nothing to see."""
    results = [(case, run_case(Fp8ScaleRoundedToBf16(), case, case_id)) for case_id, case in fp8_smoke_cases]
    sixteen_bit = [r for case, r in results if r.outcome is Outcome.FAIL and case.op == "lora_expand_fp8" and case.dtype != "float32"]
    assert sixteen_bit, "no 16-bit expand case catches the fault"
    for result in sixteen_bit:
        assert set(result.kinds) <= {FailureKind.SYSTEMATIC, FailureKind.PRECISION}, result.message
        assert result.measurement.budget_ratio < 1, result.message
    for case, result in results:
        values = OP_SPECS[case.op].make_values(case, generator_for(case))
        if all(is_power_of_two(v) for name, v in values.items() if name.startswith("b_scale")):
            assert result.outcome is Outcome.PASS, result.case_id


def test_fp8_values_cross_the_worker_pipe_bit_for_bit(fp8_smoke_cases):
    """The worker gets a case's values as frames of the wire (``conformance.wire``): fp8 tensors must arrive as
    the same bytes, dtype and strides."""
    case_id, case = fp8_smoke_cases[-1]
    values = OP_SPECS[case.op].make_values(case, generator_for(case))
    values["x.t"] = values["x"].transpose(-1, -2)  # a strided view too
    read, write = os.pipe()
    sender, receiver = Channel(None, write), Channel(read, None)
    try:
        thread = threading.Thread(target=sender.send, args=("call", values))
        thread.start()
        arrived = receiver.receive().body
        thread.join()
    finally:
        sender.close()
        receiver.close()
    for name, value in values.items():
        got = arrived[name]
        assert got.dtype == value.dtype and got.shape == value.shape and got.stride() == value.stride(), name
        assert torch.equal(got.contiguous().view(torch.uint8), value.contiguous().view(torch.uint8)), name  # the bytes



@pytest.mark.parametrize(
    ("fields", "problem"),
    [
        ({"fp8_scales": "row"}, "fp8_scales 'row' is not one of tensor, channel, block"),
        ({"fp8_scales": "block", "group_k": 16}, "must both be > 0 for block scales"),
        ({"fp8_scales": "channel", "group_k": 16, "group_n": 16}, "must both be > 0 for block scales and 0 otherwise"),
    ],
)
def test_an_impossible_fp8_case_is_refused_naming_the_field(fp8_smoke_cases, fields, problem):
    _, case = fp8_smoke_cases[0]
    with pytest.raises(ValueError, match=problem):
        dataclasses.replace(case, **fields)


# -- fused_moe_lora_fp8 ----------------------------------------------------------------------------


@pytest.fixture(scope="module")
def moe_fp8_smoke_cases():
    return profile_cases("smoke", ops=("fused_moe_lora_fp8",))


def test_the_moe_fp8_smoke_cases_hold_each_granularity_with_no_adapter_pairs(moe_fp8_smoke_cases):
    by_scales = {scales: [case for _, case in moe_fp8_smoke_cases if case.fp8_scales == scales] for scales in ("tensor", "channel", "block")}
    assert all(1 <= len(cases) <= 6 for cases in by_scales.values()), {k: len(v) for k, v in by_scales.items()}
    assert all(-1 in case.token_slots and set(case.token_slots) != {-1} for _, case in moe_fp8_smoke_cases)
    assert all(case.group_k > 0 and case.group_n > 0 for case in by_scales["block"])


def test_moe_fp8_values_hold_per_slot_and_expert_scales_in_vllms_layouts(moe_fp8_smoke_cases):
    """Weight scales ``[L, E]``, ``[L, E, N, 1]`` or ``[L, E, ⌈N/gn⌉, ⌈K/gk⌉]`` (the strides vLLM's kernel takes and
    its own tests build); codes in (240, 448] in every operand; experts of one slot scaled apart."""
    for case_id, case in moe_fp8_smoke_cases:
        values = OP_SPECS[case.op].make_values(case, generator_for(case))
        rows = case.num_tokens * case.top_k if case.routed_weight else case.num_tokens
        for name, value in values.items():
            if value.dtype == torch.float8_e4m3fn:
                magnitude = value.float().abs()
                assert magnitude.max() <= FP8_MAX and ((magnitude > GAUDI2_FP8_MAX).any()), (case_id, name)
        for s in range(case.num_slices):
            for side, (n, k) in (("a", (case.max_rank, case.hidden_size)), ("b", (case.output_slices[s], case.max_rank))):
                stack, scale = values[f"lora_{side}.{s}"], values[f"lora_{side}_scale.{s}"]
                assert tuple(stack.shape) == (case.num_slots, case.num_experts, n, k), (case_id, side)
                expected = {"tensor": (case.num_slots, case.num_experts), "channel": (case.num_slots, case.num_experts, n, 1),
                            "block": (case.num_slots, case.num_experts, -(-n // max(case.group_n, 1)), -(-k // max(case.group_k, 1)))}
                assert tuple(scale.shape) == expected[case.fp8_scales] and scale.dtype == torch.float32, (case_id, side)
                assert (scale > 0).all(), (case_id, side)
        act = values["act_scale"]
        assert act.shape[0] == (1 if case.fp8_scales == "tensor" else rows), case_id


def test_the_plain_target_passes_every_moe_fp8_smoke_case(moe_fp8_smoke_cases):
    results = [run_case(PlainTorchTarget(), case, case_id) for case_id, case in moe_fp8_smoke_cases]
    assert [f"{r.case_id}: {r.message}" for r in results if r.outcome is not Outcome.PASS] == []


@pytest.mark.parametrize("fault", MOE_FP8_FAULTS, ids=lambda fault: fault.name.removeprefix("fault-"))
def test_each_moe_fp8_fault_fails_a_moe_fp8_smoke_case(fault, moe_fp8_smoke_cases):
    outcomes = [run_case(fault(), case, case_id).outcome for case_id, case in moe_fp8_smoke_cases]
    assert Outcome.FAIL in outcomes and Outcome.BROKEN not in outcomes, fault.__doc__.splitlines()[0]
