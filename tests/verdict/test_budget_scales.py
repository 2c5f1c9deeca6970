"""The budget's floor and cap follow what rounding error scales with (``conformance/verdict/tolerances.py``).

Read against ``max |oracle|`` alone, they failed correct code wherever a sum cancels: a float32 dot
product whose terms cancel (a shrink of one token and rank 1), and a bfloat16 output whose base and
delta cancel. With the oracle's delta (``operands = |o − d| + |d|``) and magnitude
(``terms = |x|·|a|``) they pass, and a 16-bit budget barely moves.
"""

from __future__ import annotations

import numpy
import torch

from conformance.generator.profiles import profile_cases
from conformance.ops import OP_SPECS
from conformance.runner import as_float64, execute, make_values, oracle_delta, oracle_magnitude
from conformance.targets.reference import ReferenceTarget
from conformance.verdict import FailureKind, judge
from conformance.verdict.tolerances import TOLERANCES


def cancelling_dot_product(features: int = 4096, seed: int = 2):
    """``x [features]``, ``a [features]`` in float32 with ``x · a`` a thousandth of ``|x|·|a|``."""
    gen = torch.Generator().manual_seed(seed)
    x = torch.randn(features, generator=gen, dtype=torch.float64)
    a = torch.randn(features, generator=gen, dtype=torch.float64) / features**0.5
    a -= (x @ a) / (x @ x) * x * 0.999  # remove most of a's component along x: the sum cancels
    return x.float(), a.float()


def test_a_correct_float32_sum_in_another_order_passes_where_the_dot_product_cancels():
    x, a = cancelling_dot_product()
    accumulator = numpy.float32(0.0)
    for product in (x * a).numpy():  # one float32 accumulator, term after term: slow, correct code
        accumulator = numpy.float32(accumulator + product)
    oracle = (x.double() @ a.double()).reshape(1, 1)
    actual, baseline = torch.tensor([[accumulator]]), (x @ a).reshape(1, 1)
    initial, written = torch.zeros(1, 1), torch.ones(1, 1, dtype=torch.bool)
    magnitude = (x.double().abs() @ a.double().abs()).reshape(1, 1)
    assert float(magnitude) > 300 * abs(float(oracle))

    against_result = judge(actual, oracle, baseline, initial, written, oracle)
    assert [p.kind for p in against_result.problems] == [FailureKind.NUMERICS]  # how it failed before
    verdict = judge(actual, oracle, baseline, initial, written, oracle, magnitude)
    assert verdict.passed, verdict.problems
    assert verdict.measurement.magnitude_scale == float(magnitude)


def test_a_bfloat16_output_whose_base_and_delta_cancel_is_held_to_their_ulps():
    gen = torch.Generator().manual_seed(0)
    y0 = (torch.randn(8, 32, generator=gen, dtype=torch.float64) * 8).to(torch.bfloat16)
    d = -y0.double() + 0.01 * torch.randn(8, 32, generator=gen, dtype=torch.float64)  # the result is ~1 % of each
    oracle = y0.double() + d
    rounded = (y0.double() + d.to(torch.bfloat16).double()).to(torch.bfloat16)  # the delta rounded, then added
    written = torch.ones(8, 32, dtype=torch.bool)

    without_delta = judge(rounded, oracle, rounded, y0, written)
    assert not without_delta.passed and "rtol cap" in without_delta.problems[0].text
    verdict = judge(rounded, oracle, rounded, y0, written, d)
    assert verdict.passed, verdict.problems
    assert verdict.measurement.operand_scale > 100 * verdict.measurement.output_scale


def test_the_accumulation_term_is_hundredths_of_an_ulp_of_a_16_bit_output():
    reference = ReferenceTarget()
    checked = 0
    for _, case in profile_cases("smoke", 0):
        if case.op != "add_lora_linear" or case.dtype == "float32":
            continue
        spec, values = OP_SPECS[case.op], make_values(case)
        oracle = execute(spec, case, as_float64(values), reference, torch.device("cpu"))[spec.output]
        delta = oracle_delta(spec, case, values, reference)
        magnitude = oracle_magnitude(spec, case, values, reference)
        m = judge(oracle.to(values[spec.output].dtype), oracle, oracle.to(values[spec.output].dtype), values[spec.output],
                  spec.written_mask(case), delta, magnitude).measurement
        dtype = values[spec.output].dtype
        accumulation = TOLERANCES[dtype].accumulation_ulps * torch.finfo(torch.float32).eps * m.magnitude_scale
        assert accumulation < 0.05 * torch.finfo(dtype).eps * m.operand_scale, case
        checked += 1
    assert checked > 10
