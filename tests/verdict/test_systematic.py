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


def accumulated(rows: int, columns: int, seed: int = 0, dtype: torch.dtype = BF16):
    """``(y0, d, oracle, written)`` of an accumulating op in ``dtype`` with every element written."""
    gen = torch.Generator().manual_seed(seed)
    y0 = torch.randn(rows, columns, generator=gen, dtype=torch.float64).to(dtype)
    d = torch.randn(rows, columns, generator=gen, dtype=torch.float64)
    return y0, d, y0.double() + d, torch.ones(rows, columns, dtype=torch.bool)


def result(y0: torch.Tensor, delta: torch.Tensor) -> torch.Tensor:
    return (y0.double() + delta.to(y0.dtype).double()).to(y0.dtype)


def test_a_one_percent_gain_fails_inside_the_budget():
    y0, d, oracle, written = accumulated(64, 64)
    baseline = result(y0, d)
    faulty = result(y0, d * 1.01)
    budget_only = judge(faulty, oracle, baseline, y0, written)
    # what the budget lets through (without a delta to take its multiple of, the precision rule may see the gain as spread)
    assert FailureKind.NUMERICS not in [p.kind for p in budget_only.problems] and budget_only.measurement.budget_ratio < 1
    verdict = judge(faulty, oracle, baseline, y0, written, d)
    assert [problem.kind for problem in verdict.problems] == [FailureKind.SYSTEMATIC]
    m = verdict.measurement
    assert m.delta_bias == pytest.approx(0.01, abs=1e-3)
    assert abs(m.baseline_delta_bias) < 1e-3 and m.systematic_ratio > 1
    text = verdict.problems[0].text
    percent = "{:+.3g}%".format
    assert percent(m.delta_bias * 100) in text and percent(m.baseline_delta_bias * 100) in text
    assert f"{m.delta_bias_threshold * 100:.3g}%" in text


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


@pytest.mark.parametrize(("dtype", "gain"), [(BF16, 2**-9), (torch.float16, -(2**-12))], ids=["bf16", "fp16"])
def test_half_a_unit_roundoff_of_gain_is_flagged_on_a_thousand_rows_and_not_on_sixteen(dtype, gain):
    """``alpha / r = 4/3`` rounded to the dtype: every element within half an ulp of its delta. With a
    thousand rows the bias is many standard errors of rounding (each row's shared rounding averages
    out); with sixteen it is not told from the rounding of a rank-1 intermediate, and is not judged."""
    for rows, flagged in ((1024, True), (16, False)):
        y0, d, oracle, written = accumulated(rows, 64, dtype=dtype)
        verdict = judge(result(y0, d * (1 + gain)), oracle, result(y0, d), y0, written, d)
        m = verdict.measurement
        assert m.budget_ratio < 1 and m.delta_bias == pytest.approx(gain, rel=0.3 if flagged else 3)
        assert [p.kind for p in verdict.problems] == ([FailureKind.SYSTEMATIC] if flagged else [])
        if flagged:
            assert m.delta_bias_threshold == SYSTEMATIC_THRESHOLDS[dtype].min_bias < abs(gain) / 1.5  # min_bias binds


def test_the_oracle_rounded_to_the_dtype_is_where_the_error_is_measured_from():
    """A positive base output and a positive delta of a few ulps, nearly the same everywhere (the
    ``positive`` values with a small scale): rounding ``y0 + d`` moves every element of a binade the
    same way, so even the correctly rounded result is −1.7 % of the delta off the exact oracle, at
    many standard errors. That part is the oracle's own rounding, common to every correct result;
    the bias is measured from the correctly rounded oracle, and a gain still shows on top of it."""
    gen = torch.Generator().manual_seed(5)
    y0 = (0.5 + 0.5 * torch.rand(512, 64, generator=gen, dtype=torch.float64)).to(BF16)
    d = 0.0125 + 0.001 * torch.randn(512, 64, generator=gen, dtype=torch.float64)  # about 3.2 ulps of y0
    oracle, written = y0.double() + d, torch.ones(512, 64, dtype=torch.bool)
    correct = result(y0, d)
    exact_error_bias = float(((correct.double() - oracle) * d).sum() / (d * d).sum())
    assert exact_error_bias < -0.01  # what the rule read before: a bias of 1 % and more
    verdict = judge(correct, oracle, correct, y0, written, d)
    assert verdict.passed and abs(verdict.measurement.delta_bias) < 1e-3
    faulty = judge(result(y0, d * 1.05), oracle, correct, y0, written, d)
    assert [p.kind for p in faulty.problems] == [FailureKind.SYSTEMATIC]
    assert faulty.measurement.delta_bias == pytest.approx(0.05, rel=0.3)


def test_a_bias_the_baseline_shares_is_what_correct_rounding_gives_and_is_not_flagged():
    """Rank 1, one output column whose LoRA-B entry is 255/128 (a mantissa of all ones, just below a
    power of two): every product ``s · b`` rounds down by about half an ulp, so rounding the delta
    correctly, as the baseline does, biases it by −0.45 u in every row, at many standard errors. The
    rule asks for a bias past the threshold both from the correctly rounded oracle and from the
    baseline: the baseline's rounding passes, so does a target that rounds once (no bias at all),
    and a gain on top of the baseline's bias is still caught."""
    gen = torch.Generator().manual_seed(3)
    rows = 2048
    y0 = torch.randn(rows, 1, generator=gen, dtype=torch.float64).to(BF16)
    shrunk = torch.randn(rows, 1, generator=gen, dtype=torch.float64).to(BF16).double()  # the rank-1 intermediate
    d = shrunk * (255 / 128)
    oracle, written = y0.double() + d, torch.ones(rows, 1, dtype=torch.bool)
    baseline = result(y0, d)  # the delta rounded, then added: vLLM's order
    verdict = judge(baseline, oracle, baseline, y0, written, d)
    m = verdict.measurement
    assert m.delta_bias == pytest.approx(-0.45 * UNIT_ROUNDOFF, rel=0.1)
    assert abs(m.delta_bias) > 1.2 * m.delta_bias_threshold  # past the threshold from the correctly rounded oracle
    assert verdict.passed and m.systematic_ratio == 0  # but it is the baseline's own bias
    rounded_once = (y0.double() + d).to(BF16)
    assert judge(rounded_once, oracle, baseline, y0, written, d).passed
    gained = judge(result(y0, d * 1.01), oracle, baseline, y0, written, d)
    assert [p.kind for p in gained.problems] == [FailureKind.SYSTEMATIC]
    assert gained.measurement.delta_bias == pytest.approx(0.01, rel=0.1)


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
