"""The suite catches real LoRA bugs: every seeded fault fails at least one smoke case.

Each fault of ``fault_targets.FAULTS`` (the systematic ones, a delta one or two percent off, among
them) runs over the smoke profile (run seed 0, drawn once per
module), cheapest cases first, until one case ends FAIL; the case that caught it is recorded (user
property ``caught_by``) and printed (``pytest -rP`` shows it). The sub-ulp ones (a scale rounded to
the dtype: half a unit roundoff) are caught only by cases of a thousand rows or more, the ``large_t``
and ``long_batch`` families', in the smoke profile as in the standard one; their own test below runs their op's cases of
both profiles, and the whole-profile walk runs in the calibration tier (``slow``). Faults the suite cannot catch today
are strict xfails with the reason: when the suite learns to catch one, its test turns red so the
entry moves to ``FAULTS``.

The correct ``PlainTorchTarget`` must implement every op and pass every smoke case, under both
wrapper compositions of ``KernelTarget`` (``lora_*`` and the block-aligned MoE metadata like vLLM's
GPU wrapper; sgmv/bgmv and the naive MoE block assignment like its CPU wrapper's one index per row).
"""

from __future__ import annotations

from dataclasses import replace

import pytest
import torch
from fault_targets import (
    DELTA_GAIN_FAULTS,
    FAULTS,
    PRECISION_FAULTS,
    SUB_ULP_GAIN_FAULTS,
    UNCAUGHT_BY_DESIGN,
    PlainTorchClassicTarget,
    PlainTorchTarget,
    ScaleRoundedToInputDtype,
)

from conformance.cases import Case
from conformance.cases.scales import exact_in
from conformance.generator.profiles import profile_cases
from conformance.runner import CaseResult, run_case
from conformance.targets import KERNEL_OPS, WRAPPER_OPS
from conformance.verdict import FailureKind, Outcome
from conformance.verdict.tolerances import PRECISION_THRESHOLDS, SYSTEMATIC_THRESHOLDS


@pytest.fixture(scope="module")
def smoke_cases() -> list[tuple[str, Case]]:
    """The smoke profile (run seed 0), cheapest cases first so a fault is usually caught in seconds."""
    return sorted(profile_cases("smoke"), key=lambda pair: pair[1].cost)


def first_failure(target, cases) -> tuple[CaseResult | None, int, list[str]]:
    """The first case ending FAIL (or None), how many cases ran, and the ids of cases that crashed."""
    broken = []
    for ran, (case_id, case) in enumerate(cases, start=1):
        result = run_case(target, case, case_id)
        if result.outcome is Outcome.FAIL:
            return result, ran, broken
        if result.outcome is Outcome.BROKEN:
            broken.append(case_id)
    return None, len(cases), broken


def _summary(fault) -> str:
    return fault.__doc__.strip().splitlines()[0]


def _fault_params():
    # A sub-ulp gain is caught by the smoke profile's large_t case of its op, one of its costliest:
    # cheapest first, that is nearly the whole profile (test_a_sub_ulp_gain_… below runs its op alone).
    caught = [
        pytest.param(fault, id=fault.name.removeprefix("fault-"), marks=(pytest.mark.slow,) if fault in SUB_ULP_GAIN_FAULTS else ())
        for fault in FAULTS
    ]
    uncaught = [
        pytest.param(
            fault,
            id=fault.name.removeprefix("fault-"),
            marks=(pytest.mark.xfail(strict=True, reason=reason), pytest.mark.slow),  # runs every smoke case
        )
        for fault, reason in UNCAUGHT_BY_DESIGN.items()
    ]
    return caught + uncaught


def test_the_catalog_is_large_and_distinct():
    assert len(FAULTS) >= 15
    names = [fault.name for fault in (*FAULTS, *UNCAUGHT_BY_DESIGN)]
    assert len(set(names)) == len(names), "fault names must be unique"
    assert all(fault.__doc__ for fault in (*FAULTS, *UNCAUGHT_BY_DESIGN)), "every fault names its bug class"


@pytest.mark.parametrize("fault", _fault_params())
def test_fault_is_caught(fault, smoke_cases, request):
    result, ran, broken = first_failure(fault(), smoke_cases)
    assert result is not None, (
        f"{fault.__name__} ({_summary(fault)}) passed all {ran} smoke cases"
        + (f"; it crashed (BROKEN) on {broken}" if broken else "")
    )
    request.node.user_properties.append(("caught_by", result.case_id))
    print(f"{fault.name}: caught by {result.case_id} after {ran} case(s): {result.message}")
    assert result.message, f"{fault.__name__} caught by {result.case_id}, but the verdict gives no reason"


@pytest.mark.parametrize("fault", [pytest.param(fault, id=fault.name.removeprefix("fault-")) for fault in DELTA_GAIN_FAULTS])
def test_a_delta_gain_is_measured_as_its_bias_and_in_bfloat16_only_the_systematic_rule_sees_it(fault, smoke_cases):
    """The case that catches a delta-gain fault measures the gain as its delta bias; in bfloat16 the
    error stays inside the elementwise budget (about one rounding), so that case fails for systematic
    error alone. In float16 and float32 the budget is tight enough to catch a percent by itself."""
    result, _, _ = first_failure(fault(), smoke_cases)
    assert result is not None
    assert result.measurement.delta_bias == pytest.approx(fault.gain, rel=0.3)
    if fault.dtype == torch.bfloat16:
        assert result.kinds == (FailureKind.SYSTEMATIC,) and result.measurement.budget_ratio < 1


@pytest.mark.parametrize("profile", ["smoke", "standard"])
@pytest.mark.parametrize("fault", [pytest.param(fault, id=fault.name.removeprefix("fault-")) for fault in SUB_ULP_GAIN_FAULTS])
def test_a_sub_ulp_gain_is_caught_by_every_large_case_of_its_op_for_systematic_error_alone(fault, profile):
    """Half a unit roundoff in every element (``alpha / r = 4/3`` rounded to the dtype): the elementwise
    budget cannot see it, and the systematic-error rule only where the case has rows enough to average
    the rounding of a rank-1 intermediate out (``SE ≈ u / √rows``): the ``large_t`` and ``long_batch``
    cases, a thousand tokens or more (one of each in the smoke profile, five in the standard one), and
    every one of them. Each catching case fails for systematic error alone and measures the gain as
    its bias."""
    op, dtype = fault.gained_op, str(fault.dtype).removeprefix("torch.")
    results = [run_case(fault(), case, case_id) for case_id, case in profile_cases(profile, ops=(op,), dtypes=(dtype,))]
    failed = [r for r in results if r.outcome is Outcome.FAIL]
    large = [r for r in results if {"large_t", "long_batch"} & r.features]  # a thousand rows and more
    assert large and all(r.outcome is Outcome.FAIL for r in large), [r.case_id for r in large if r.outcome is not Outcome.FAIL]
    for result in failed:
        assert result.kinds == (FailureKind.SYSTEMATIC,) and result.measurement.budget_ratio < 1, result.message
        assert result.measurement.delta_bias == pytest.approx(fault.gain, rel=0.3), result.case_id


@pytest.mark.parametrize("dtype", ["float16", "bfloat16"])
def test_a_scale_rounded_to_the_dtype_is_caught_on_the_standard_profile_and_is_correct_where_the_scale_is_exact(dtype):
    """A real rounding of the scale (``ScaleRoundedToInputDtype``), not a modelled gain: it changes nothing where
    the dtype holds the scale, so it must pass those cases, and the standard profile must catch it on a case
    whose scale (``alpha / r``, ``alpha / √r``: ``conformance.cases.scales``) the dtype does not hold."""
    torch_dtype = getattr(torch, dtype)
    scaled = [(i, c) for i, c in profile_cases("standard", dtypes=(dtype,)) if c.scale != 1.0]
    inexact = sorted(((i, c) for i, c in scaled if not exact_in(c.scale, torch_dtype)), key=lambda pair: -pair[1].num_tokens)
    result, ran, broken = first_failure(ScaleRoundedToInputDtype(), inexact)
    assert result is not None and not broken, f"passed all {ran} standard {dtype} cases of an inexact scale; broken: {broken}"
    exact = sorted(((i, c) for i, c in scaled if exact_in(c.scale, torch_dtype)), key=lambda pair: pair[1].cost)[:5]
    assert exact and _not_passed(ScaleRoundedToInputDtype(), exact) == []


@pytest.mark.parametrize("fault", [pytest.param(fault, id=fault.name.removeprefix("fault-")) for fault in SUB_ULP_GAIN_FAULTS])
def test_the_rule_before_issue_23_let_a_sub_ulp_gain_through(fault, monkeypatch):
    """The thresholds the rule had before (``min_bias`` 0.5 % in bfloat16, 0.1 % in float16: a bias of a
    unit roundoff or two, whatever the rows) pass the smoke case that catches the fault now."""
    op, dtype = fault.gained_op, str(fault.dtype).removeprefix("torch.")
    case_id, case = next((i, c) for i, c in profile_cases("smoke", ops=(op,), dtypes=(dtype,)) if c.family == "large_t")
    assert run_case(fault(), case, case_id).outcome is Outcome.FAIL
    before = {torch.bfloat16: 5e-3, torch.float16: 1e-3}
    for dt, min_bias in before.items():
        monkeypatch.setitem(SYSTEMATIC_THRESHOLDS, dt, replace(SYSTEMATIC_THRESHOLDS[dt], min_bias=min_bias))
    result = run_case(fault(), case, case_id)
    assert result.outcome is Outcome.PASS and result.measurement.systematic_ratio < 0.5


@pytest.mark.parametrize("fault", [pytest.param(fault, id=fault.name.removeprefix("fault-")) for fault in PRECISION_FAULTS])
def test_a_float16_delta_through_bfloat16_is_caught_for_coarse_precision_alone_and_was_not_before(fault, monkeypatch):
    """A float16 output whose delta passed through bfloat16 (``DeltaThroughBf16``): over the smoke cases of its
    op in float16, every case that catches it fails for coarse precision alone, inside the budget and without a
    systematic error, and measures a spread past the threshold; without the precision rule (no threshold in
    ``PRECISION_THRESHOLDS``) every one of those cases passes, as every case did before the rule."""
    cases = profile_cases("smoke", ops=(fault.rounded_op,), dtypes=("float16",))
    results = [run_case(fault(), case, case_id) for case_id, case in cases]
    failed = [(r, case) for r, (_, case) in zip(results, cases) if r.outcome is Outcome.FAIL]
    assert failed, f"{fault.name} passed all {len(cases)} float16 smoke cases of {fault.rounded_op}"
    threshold = PRECISION_THRESHOLDS[torch.float16].ratio
    for result, _ in failed:
        m = result.measurement
        assert result.kinds == (FailureKind.PRECISION,) and m.budget_ratio < 1 and m.systematic_ratio < 1, result.message
        assert m.precision_ratio > threshold and m.precision_threshold == threshold
    monkeypatch.delitem(PRECISION_THRESHOLDS, torch.float16)
    before = [run_case(fault(), case, result.case_id) for result, case in failed]
    assert [r.outcome for r in before] == [Outcome.PASS] * len(failed), [r.message for r in before]


# -- the correct target ---------------------------------------------------------------------------


def test_plain_torch_implements_every_op():
    assert set(PlainTorchTarget().implemented_ops()) == set(KERNEL_OPS) | set(WRAPPER_OPS)


def _not_passed(target, cases) -> list[str]:
    results = (run_case(target, case, case_id) for case_id, case in cases)
    return [f"{r.case_id}: {r.outcome.value}: {r.message}" for r in results if r.outcome is not Outcome.PASS]


@pytest.mark.slow
def test_plain_torch_passes_every_smoke_case(smoke_cases):
    assert _not_passed(PlainTorchTarget(), smoke_cases) == []


@pytest.mark.slow
def test_classic_composition_passes_every_wrapper_smoke_case(smoke_cases):
    wrapper_cases = [(case_id, case) for case_id, case in smoke_cases if case.op in WRAPPER_OPS]
    assert _not_passed(PlainTorchClassicTarget(), wrapper_cases) == []


# -- KernelTarget: which wrapper ops follow from which kernels --------------------------------------

CLASSIC = ("bgmv_shrink", "bgmv_expand", "bgmv_expand_slice", "sgmv_shrink", "sgmv_expand", "sgmv_expand_slice")
LORA = ("lora_shrink", "lora_expand")
MOE = ("fused_moe_lora", "moe_lora_align_block_size")
MOE_WRAPPERS = ("add_lora_w13", "add_lora_w2")
DENSE_WRAPPERS = tuple(op for op in WRAPPER_OPS if op not in MOE_WRAPPERS)


# vLLM 0.34's layer ops made of add_lora_linear: there wherever add_lora_linear is
LINEAR_LAYERS = ("grouped_lora_linear", "fp32_output_lora_linear")


def _with_kernels(kernels: tuple[str, ...], **methods) -> PlainTorchTarget:
    """A PlainTorchTarget that defines only ``kernels`` (the others set to None) plus ``methods``."""
    missing = {op: None for op in KERNEL_OPS if op not in kernels}
    return type("Partial", (PlainTorchTarget,), {**missing, **methods})()


@pytest.mark.parametrize(
    ("kernels", "wrappers"),
    [
        pytest.param(LORA + MOE, WRAPPER_OPS, id="lora-ops"),
        pytest.param(CLASSIC + MOE, WRAPPER_OPS, id="classic-ops"),
        pytest.param(LORA, DENSE_WRAPPERS, id="lora-dense-only"),
        pytest.param(CLASSIC + ("fused_moe_lora",), WRAPPER_OPS, id="classic-ops-naive-moe"),
        pytest.param(("lora_expand",), ("add_expand", "add_lora_embedding", "scaled_embedding_lora"), id="lora-expand-only"),
        pytest.param(("lora_shrink",), ("add_shrink", "apply_lora_full_linear", "token_classification_head"), id="lora-shrink-only"),
        pytest.param(("bgmv_shrink", "bgmv_expand", "bgmv_expand_slice"), DENSE_WRAPPERS, id="bgmv-only"),
        pytest.param(("sgmv_shrink", "sgmv_expand", "sgmv_expand_slice"), DENSE_WRAPPERS, id="sgmv-only"),
        pytest.param(("sgmv_shrink", "bgmv_shrink", "sgmv_expand_slice", "bgmv_expand_slice"),
                     ("add_shrink", "add_expand", "add_lora_linear", "apply_lora_full_linear", "token_classification_head",
                      *LINEAR_LAYERS), id="linear-classic"),
        pytest.param(("lora_shrink", "sgmv_expand_slice", "bgmv_expand_slice"),
                     ("add_shrink", "add_expand", "add_lora_linear", "apply_lora_full_linear", "token_classification_head",
                      *LINEAR_LAYERS), id="mixed-compositions"),
        pytest.param(MOE, MOE_WRAPPERS, id="moe-aligned"),
        pytest.param(("fused_moe_lora",), MOE_WRAPPERS, id="moe-naive"),
        pytest.param(("moe_lora_align_block_size",), (), id="moe-alignment-only"),
        pytest.param((), (), id="no-kernels"),
    ],
)
def test_kernel_target_derives_exactly_the_wrapper_ops_its_kernels_allow(kernels, wrappers):
    expected_wrappers = tuple(op for op in WRAPPER_OPS if op in wrappers)  # in the registry's order
    assert _with_kernels(kernels).implemented_ops() == tuple(op for op in KERNEL_OPS if op in kernels) + expected_wrappers


@pytest.mark.parametrize(
    ("kernels", "paths", "derived"),
    [
        pytest.param(MOE, ("lora", "classic"), ("moe_lora_align_block_size", "fused_moe_lora"), id="aligned-first"),
        pytest.param(MOE, ("classic", "lora"), ("fused_moe_lora",), id="naive-first"),
        pytest.param(("fused_moe_lora",), ("lora", "classic"), ("fused_moe_lora",), id="naive-fallback"),
        pytest.param(("fused_moe_lora",), ("lora",), (), id="aligned-only-without-alignment"),
    ],
)
def test_the_moe_wrapper_ops_follow_from_fused_moe_lora_with_or_without_the_alignment(kernels, paths, derived):
    target = _with_kernels(kernels, wrapper_paths=paths)
    for op in MOE_WRAPPERS:
        assert target.derived_from(op) == derived
        assert (op in target.implemented_ops()) == bool(derived)


def test_an_overridden_wrapper_method_counts_and_composes():
    target = _with_kernels(("lora_expand",), add_shrink=lambda self, *args, **kwargs: None)
    assert set(target.implemented_ops()) == {
        "lora_expand", "add_shrink", "add_expand", "add_lora_linear", "add_lora_embedding", "token_classification_head",
        "scaled_embedding_lora", *LINEAR_LAYERS,  # the layer ops made of add_lora_linear and add_lora_embedding
    }


def test_a_wrapper_method_set_to_none_is_not_implemented():
    assert "add_lora_logits" not in _with_kernels(LORA, add_lora_logits=None).implemented_ops()


def test_wrapper_cases_without_their_kernels_are_not_supported(smoke_cases):
    target = _with_kernels(("lora_expand",))
    cheapest_per_op = {}
    for case_id, case in smoke_cases:
        cheapest_per_op.setdefault(case.op, (case_id, case))
    outcomes = {op: run_case(target, case, case_id).outcome for op, (case_id, case) in cheapest_per_op.items()}
    supported = set(target.implemented_ops())
    assert {op for op, outcome in outcomes.items() if outcome is Outcome.PASS} == supported
    assert {op for op, outcome in outcomes.items() if outcome is Outcome.NOT_SUPPORTED} == set(outcomes) - supported
