"""The systematic-error rule: a delta a percent off fails though every element is inside the budget,
and what rounding can do does not.

The tensors mimic an accumulating op in bfloat16: a base output ``y0`` (in the dtype), the delta
``d`` (float64), the oracle ``y0 + d`` and a result ``round(y0 + round(d · (1 + gain)))``: the delta
rounded to the output dtype before it is added, as vLLM's kernels do, and the sum rounded once.
"""

from __future__ import annotations

import pytest
import torch

from conformance.cases import Case
from conformance.generator.profiles import profile_cases
from conformance.ops import OP_SPECS
from conformance.runner import as_float64, execute, make_values, oracle_delta
from conformance.targets.reference import ReferenceTarget
from conformance.verdict import FailureKind, judge
from conformance.verdict.systematic import delta_bias, row_groups
from conformance.verdict.tolerances import SYSTEMATIC_THRESHOLDS

BF16 = torch.bfloat16
UNIT_ROUNDOFF = torch.finfo(BF16).eps / 2  # 2⁻⁸


def accumulated(rows: int, columns: int, seed: int = 0):
    """``(y0, d, oracle, written)`` of an accumulating bfloat16 op with every element written."""
    gen = torch.Generator().manual_seed(seed)
    y0 = torch.randn(rows, columns, generator=gen, dtype=torch.float64).to(BF16)
    d = torch.randn(rows, columns, generator=gen, dtype=torch.float64)
    return y0, d, y0.double() + d, torch.ones(rows, columns, dtype=torch.bool)


def result(y0: torch.Tensor, delta: torch.Tensor) -> torch.Tensor:
    return (y0.double() + delta.to(y0.dtype).double()).to(y0.dtype)


def test_a_one_percent_gain_fails_inside_the_budget():
    y0, d, oracle, written = accumulated(64, 64)
    baseline = result(y0, d)
    faulty = result(y0, d * 1.01)
    budget_only = judge(faulty, oracle, baseline, y0, written)
    assert budget_only.passed and budget_only.measurement.budget_ratio < 1  # what the budget alone lets through
    verdict = judge(faulty, oracle, baseline, y0, written, d)
    assert [problem.kind for problem in verdict.problems] == [FailureKind.SYSTEMATIC]
    m = verdict.measurement
    assert m.delta_bias == pytest.approx(0.01, abs=1e-3)
    assert abs(m.baseline_delta_bias) < 1e-3 and m.systematic_ratio > 1
    text = verdict.problems[0].text
    assert f"{m.delta_bias:+.3%}" in text and f"{m.delta_bias_threshold:.3%}" in text and f"{m.baseline_delta_bias:+.3%}" in text


def test_correct_rounding_is_not_flagged():
    for seed in range(20):
        y0, d, oracle, written = accumulated(16, 48, seed)
        baseline = result(y0, d)
        reassociated = (y0.float() + d.float()).to(BF16)  # the delta not rounded first: another correct rounding
        verdict = judge(reassociated, oracle, baseline, y0, written, d)
        assert verdict.passed, verdict.problems
        assert verdict.measurement.systematic_ratio < 0.5


def test_a_bias_one_shared_rounding_explains_is_not_flagged_on_one_row_but_is_on_many():
    """Rank 1: a row's delta is one intermediate times a LoRA-B row, so rounding that intermediate moves
    the whole row's delta by one relative error. 1.5 units of roundoff (two roundings) on one row is
    what a correct target can show; the same on each of 64 rows is a bias."""
    bias = 1.5 * UNIT_ROUNDOFF
    assert bias > SYSTEMATIC_THRESHOLDS[BF16].min_bias
    for rows, flagged in ((1, False), (64, True)):
        y0, d, oracle, written = accumulated(rows, 256)
        verdict = judge(result(y0, d * (1 + bias)), oracle, result(y0, d), y0, written, d)
        assert verdict.measurement.delta_bias == pytest.approx(bias, rel=0.2)
        assert (FailureKind.SYSTEMATIC in [p.kind for p in verdict.problems]) is flagged


def test_outside_the_budget_the_kinds_stay_numerics_and_the_bias_is_recorded():
    y0, d, oracle, written = accumulated(8, 8)
    verdict = judge(result(y0, d * 1.5), oracle, result(y0, d), y0, written, d)
    assert [problem.kind for problem in verdict.problems] == [FailureKind.NUMERICS]
    assert verdict.measurement.delta_bias == pytest.approx(0.5, abs=0.05)


def test_without_a_delta_or_with_a_zero_one_nothing_is_fitted():
    y0, d, oracle, written = accumulated(4, 4)
    for delta in (None, torch.zeros_like(d)):
        verdict = judge(result(y0, torch.zeros_like(d)), y0.double(), y0.clone(), y0, written, delta)
        assert verdict.passed
        json = verdict.measurement.to_json()
        assert json["delta_bias"] is None and json["systematic_ratio"] is None


def test_the_bias_is_the_least_squares_multiple_and_its_error_follows_the_noise_model():
    d = torch.tensor([1.0, -1.0, 1.0, -1.0], dtype=torch.float64)
    error = 0.01 * d + torch.tensor([1e-3, 1e-3, -1e-3, 0.0], dtype=torch.float64)
    one_row = delta_bias(error, d, d, torch.zeros(4, dtype=torch.long), torch.float32)
    four_rows = delta_bias(error, d, d, torch.arange(4), torch.float32)
    assert one_row.bias == four_rows.bias == pytest.approx(float((error * d).sum() / (d * d).sum()))
    # σ_i = ½(ulp(1) + ulp(1)) = eps for every element; the row term is u per row of equal energy
    eps = torch.finfo(torch.float32).eps
    u = eps / 2
    element_variance = 4 * eps**2
    assert one_row.standard_error == pytest.approx((element_variance + u**2 * 4**2) ** 0.5 / 4)
    assert four_rows.standard_error == pytest.approx((element_variance + u**2 * 4) ** 0.5 / 4)
    assert one_row.significance == pytest.approx(abs(one_row.bias) / one_row.standard_error)


def test_rows_are_the_second_last_dim_with_the_leading_dims_flattened():
    written = torch.zeros(2, 3, 4, dtype=torch.bool)
    written[0, 1, 2] = written[1, 0, 0] = written[1, 2, 3] = True
    assert row_groups(written).tolist() == [1, 3, 5]


# -- the delta the runner fits against ---------------------------------------------------------


def _first(op: str, add_inputs: bool) -> Case:
    """A smoke case of ``op`` that writes something, of the random family where there is one."""
    spec = OP_SPECS[op]
    candidates = [
        case
        for _, case in profile_cases("smoke")
        if case.op == op and case.add_inputs is add_inputs and bool(spec.written_mask(case).any())
    ]
    return next((case for case in candidates if case.family == "random"), candidates[0])


@pytest.mark.parametrize(
    ("op", "add_inputs", "overwrites"),
    [
        ("add_lora_linear", True, False),
        ("add_lora_linear", False, True),
        ("bgmv_expand", True, False),
        ("add_shrink", True, False),
        ("apply_lora_full_linear", True, True),
        ("add_lora_w2", False, True),
    ],
)
def test_the_oracle_delta_is_what_the_op_adds_or_writes(op, add_inputs, overwrites):
    case = _first(op, add_inputs)
    spec = OP_SPECS[op]
    values = make_values(case)
    reference = ReferenceTarget()
    oracle = execute(spec, case, as_float64(values), reference, torch.device("cpu"))[spec.output]
    delta = oracle_delta(spec, case, values, reference)
    written = spec.written_mask(case)
    expected = oracle if overwrites else oracle - values[spec.output].double()
    torch.testing.assert_close(delta[written], expected[written], rtol=1e-12, atol=1e-12)
    assert bool(delta[written].ne(0).any())
