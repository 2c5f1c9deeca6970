"""The precision rule: a 16-bit output computed through a coarser format fails though every element is
inside the budget and the error has no bias, and what correct rounding does passes.

The tensors mimic an accumulating op, as in ``test_systematic``: a base output ``y0`` (in the dtype), the
delta ``d`` (float64), the oracle ``y0 + d`` and a result ``round(y0 + round(d))``, the delta rounded to
the output dtype before it is added, as vLLM's kernels do; the fault rounds it to a coarser format.
"""

from __future__ import annotations

import math

import pytest
import torch

from conformance.verdict import FailureKind, judge
from conformance.verdict.metrics import ulp_of
from conformance.verdict.precision import error_spread
from conformance.verdict.tolerances import PRECISION_THRESHOLDS

FP16, BF16 = torch.float16, torch.bfloat16


def accumulated(rows: int, columns: int, seed: int = 0, dtype: torch.dtype = FP16, base: float = 1.0):
    """``(y0, d, oracle, written)`` of an accumulating op in ``dtype`` with every element written."""
    gen = torch.Generator().manual_seed(seed)
    y0 = (base * torch.randn(rows, columns, generator=gen, dtype=torch.float64)).to(dtype)
    d = torch.randn(rows, columns, generator=gen, dtype=torch.float64)
    return y0, d, y0.double() + d, torch.ones(rows, columns, dtype=torch.bool)


def result(y0: torch.Tensor, delta: torch.Tensor, through: torch.dtype | None = None) -> torch.Tensor:
    """``round(y0 + round(delta))``, the delta rounded to ``through`` (the output dtype by default)."""
    return (y0.double() + delta.to(through or y0.dtype).double()).to(y0.dtype)


def kinds(verdict) -> list[FailureKind]:
    return [problem.kind for problem in verdict.problems]


@pytest.mark.parametrize("dtype", [FP16, BF16], ids=["fp16", "bf16"])
def test_correct_roundings_are_not_flagged(dtype):
    """The baseline's order (the delta rounded, then the sum) and the delta added unrounded (one rounding
    fewer) both have the spread of rounding in the dtype."""
    for seed in range(20):
        y0, d, oracle, written = accumulated(16, 48, seed, dtype)
        baseline = result(y0, d)
        for correct in (baseline, (y0.float() + d.float()).to(dtype)):
            verdict = judge(correct, oracle, baseline, y0, written, d)
            assert verdict.passed, verdict.problems
            m = verdict.measurement
            assert m.precision_threshold == PRECISION_THRESHOLDS[dtype].ratio
            assert m.precision_ratio < PRECISION_THRESHOLDS[dtype].ratio / 2


@pytest.mark.parametrize(
    ("dtype", "through", "base"), [(FP16, BF16, 0.25), (BF16, torch.float8_e4m3fn, 1.0)], ids=["fp16-through-bf16", "bf16-through-e4m3"]
)
def test_a_delta_through_a_coarser_format_fails_inside_the_budget_for_precision_alone(dtype, through, base):
    """A float16 delta rounded to bfloat16 first (8 significant bits of 11): each element is a few ulps
    off, inside the budget, and the rounding has no sign, so the systematic rule sees nothing either.
    The same of a bfloat16 output through e4m3 (4 bits of 8; a base as large as the delta keeps it
    inside the budget)."""
    y0, d, oracle, written = accumulated(64, 64, dtype=dtype, base=base)  # a base of the delta's size or smaller
    baseline = result(y0, d)
    faulty = result(y0, d, through)
    verdict = judge(faulty, oracle, baseline, y0, written, d)
    m = verdict.measurement
    assert kinds(verdict) == [FailureKind.PRECISION], verdict.problems
    assert m.budget_ratio < 1 and m.systematic_ratio < 1
    assert m.precision_ratio > PRECISION_THRESHOLDS[dtype].ratio
    # the measured RMS is the fault's own rounding, less its multiple of each row's delta (one number of 64
    # per row: a few percent of it), beyond what rounding in the dtype gives
    assert m.error_rms == pytest.approx(math.sqrt(float(((faulty.double() - oracle) ** 2).mean())), rel=0.05)
    # what correct rounding gives: here the rounding model (one rounding of the output, of the delta and of
    # an intermediate a row shares), above this baseline's own two roundings
    u, ulp = torch.finfo(dtype).eps / 2, lambda x: ulp_of(x, dtype)
    model = math.sqrt(float(((ulp(oracle) ** 2 + ulp(d) ** 2) / 12 + u**2 * d**2 / 3).mean()))
    assert m.expected_rms == pytest.approx(max(model, math.sqrt(float(((baseline.double() - oracle) ** 2).mean()))), rel=0.05)
    text = verdict.problems[0].text
    name = str(dtype).removeprefix("torch.")
    assert f"coarser dtype than {name}" in text
    for number in (m.error_rms, m.expected_rms, m.precision_ratio):
        assert f"{number:.3g}" in text
    assert f"threshold {PRECISION_THRESHOLDS[dtype].ratio:g}" in text


def test_a_case_of_few_elements_is_measured_not_judged():
    """Below ``min_elements`` a mean square of a handful of roundings says little: the ratio is recorded
    and the case passes, however large it came out."""
    rule = PRECISION_THRESHOLDS[FP16]
    y0, d, oracle, written = accumulated(1, rule.min_elements - 1, base=0.25)
    faulty = result(y0, d, BF16)
    verdict = judge(faulty, oracle, result(y0, d), y0, written, d)
    assert verdict.passed, verdict.problems
    m = verdict.measurement
    assert m.precision_threshold is None and m.precision_ratio > rule.ratio  # what it measured, and let pass
    wider = accumulated(1, rule.min_elements, base=0.25)
    judged = judge(result(wider[0], wider[1], BF16), wider[2], result(wider[0], wider[1]), wider[0], wider[3], wider[1])
    assert judged.measurement.precision_threshold == rule.ratio


def test_a_gain_is_the_systematic_rules_and_not_a_coarser_precision():
    """The spread is taken beyond each row's multiple of its delta: a delta 1 % off in bfloat16 fails
    for systematic error alone, though its raw error is several times the rounding's."""
    y0, d, oracle, written = accumulated(64, 64, dtype=BF16)
    baseline = result(y0, d)
    verdict = judge(result(y0, d * 1.01), oracle, baseline, y0, written, d)
    assert kinds(verdict) == [FailureKind.SYSTEMATIC]
    assert verdict.measurement.precision_ratio < 1.5


@pytest.mark.parametrize("dtype", [FP16, BF16], ids=["fp16", "bf16"])
def test_a_rank_1_intermediate_rounded_twice_is_no_coarse_precision(dtype):
    """With rank 1 a row's delta is one intermediate times a LoRA-B row: rounding that intermediate twice (in
    the activation dtype, then scaled: Gaudi's order) moves the row's whole delta by up to two units of
    roundoff, a different multiple in every row. On a few rows without a base that is more than twice the
    rounding's RMS (the raw ratio below), and correct: the spread is taken beyond each row's multiple."""
    u = torch.finfo(dtype).eps / 2
    for seed in range(10):
        y0, d, oracle, written = accumulated(4, 64, seed, dtype, base=0.0)
        sign = torch.where(torch.rand(4, 1, generator=torch.Generator().manual_seed(100 + seed)) < 0.5, -1.0, 1.0)
        actual = result(y0, d * (1 + 2 * u * sign.double()))  # each row's delta off by ±2u
        verdict = judge(actual, oracle, result(y0, d), y0, written, d)
        m = verdict.measurement
        raw = math.sqrt(float(((actual.double() - oracle) ** 2).mean())) / m.expected_rms
        assert raw > 2  # the spread with the rows' multiples kept: near the thresholds
        assert verdict.passed and m.precision_ratio < 1, verdict.problems


def test_both_faults_at_once_show_both_kinds():
    y0, d, oracle, written = accumulated(64, 64, base=0.25)
    verdict = judge(result(y0, d * 1.002, BF16), oracle, result(y0, d), y0, written, d)
    assert kinds(verdict) == [FailureKind.SYSTEMATIC, FailureKind.PRECISION]


def test_a_result_outside_the_budget_keeps_its_numerics_kind():
    y0, d, oracle, written = accumulated(64, 64, base=0.25)
    verdict = judge(result(y0, d, torch.float8_e4m3fn), oracle, result(y0, d), y0, written, d)
    assert kinds(verdict) == [FailureKind.NUMERICS]
    assert verdict.measurement.precision_ratio > PRECISION_THRESHOLDS[FP16].ratio  # measured all the same


def test_the_rounding_model_is_the_floor_where_the_oracle_lies_on_the_dtype():
    """An oracle of numbers the dtype holds (a delta of small integers on an integer base): the baseline
    and the correctly rounded oracle err by nothing, and the expected RMS is the model's, one rounding of
    the output and one of the delta, not zero; a target off by one rounding of each passes."""
    gen = torch.Generator().manual_seed(3)
    y0 = torch.randint(-64, 64, (32, 32), generator=gen).to(FP16)
    d = torch.randint(-64, 64, (32, 32), generator=gen).double()
    oracle, written = y0.double() + d, torch.ones(32, 32, dtype=torch.bool)
    ulp = torch.finfo(FP16).eps * 64  # the spacing at 64…128
    off = torch.where(torch.rand(32, 32, generator=gen) < 0.5, -0.5, 0.5).double() * ulp  # half an ulp either way
    actual = (oracle + off * (oracle.abs() >= 64)).to(FP16)
    verdict = judge(actual, oracle, y0.double().add(d).to(FP16), y0, written, d)
    rows = torch.arange(32).repeat_interleave(32)
    spread = error_spread(actual.double().flatten(), oracle.flatten(), oracle.flatten(), d.flatten(), None, rows, FP16)
    assert spread.baseline_rms == spread.rounded_rms == 0 and spread.model_rms > 0
    assert verdict.measurement.expected_rms == spread.model_rms
    assert verdict.passed, verdict.problems


def test_a_float32_output_is_not_judged_for_precision():
    y0, d, oracle, written = accumulated(16, 16, dtype=torch.float32)
    verdict = judge(result(y0, d, BF16), oracle, result(y0, d), y0, written, d)
    m = verdict.measurement
    assert m.precision_ratio is None and m.precision_threshold is None and m.error_rms is None
    assert FailureKind.PRECISION not in kinds(verdict)  # the budget's, where it is wrong: float32 is held to float32


def test_the_spread_is_recorded_in_json():
    y0, d, oracle, written = accumulated(8, 8)
    json = judge(result(y0, d), oracle, result(y0, d), y0, written, d).measurement.to_json()
    assert {"error_rms", "expected_rms", "precision_ratio", "precision_threshold"} <= set(json)
    assert json["precision_ratio"] == pytest.approx(json["error_rms"] / json["expected_rms"])
