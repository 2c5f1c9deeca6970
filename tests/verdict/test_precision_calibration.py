"""Correct targets that round differently are never flagged for coarse precision.

The precision rule (``conformance/verdict/precision.py``, thresholds in ``tolerances.py``) must leave room
for every correct way to round: the correct targets of the systematic rule's calibration
(``calibration_systematic.correct_targets``: the mask-based plain target, both emulated Gaudi variants,
the reference computing in float32, the activation-dtype intermediate, the two MoE variants) and the
real targets that run here (``calibration_precision.REAL_TARGETS``: vLLM's CPU ops and wrapper, the
example backends). Each run seed below draws, for every op in float16 and bfloat16, one
standard-limits case of each family named: ``random``, the few-token families where a case has the
fewest elements (``t1``, ``decode``), and the fp8 expand's three scale granularities; no result may be
flagged and none the rule judges may come past ``HEADROOM`` of its threshold.
"""

from __future__ import annotations

import pytest
from calibration_precision import REAL_TARGETS, measure_precision, real_targets
from calibration_systematic import correct_targets, family_cases

from conformance.verdict.tolerances import PRECISION_THRESHOLDS

RUN_SEEDS = (1, 2, 3)
FAMILIES = ["random", "t1", "decode", "fp8_tensor", "fp8_channel", "fp8_block"]
SIXTEEN_BIT = ("float16", "bfloat16")  # the rule judges no float32 output
HEADROOM = 0.75
"""Largest share of its threshold a correct result the rule judges may reach (see docs/verdict.md,
*Precision calibration*, for the ratios over 1,000 seeds behind it)."""


@pytest.mark.slow
@pytest.mark.parametrize("run_seed", RUN_SEEDS, ids=lambda seed: f"seed{seed}")
def test_a_correct_target_rounding_elsewhere_is_never_flagged_for_coarse_precision(run_seed):
    targets = correct_targets() + real_targets(REAL_TARGETS)
    observed, _, cases = measure_precision(
        lambda seed: [(i, case) for i, case in family_cases(seed, FAMILIES) if case.dtype in SIXTEEN_BIT], [run_seed], targets
    )
    assert cases > 50
    assert observed.precision == []
    limit = {str(dtype).removeprefix("torch."): HEADROOM * rule.ratio for dtype, rule in PRECISION_THRESHOLDS.items()}
    tight = [
        f"{target} ({dtype}): precision ratio {tally.judged.value:.3g} at {tally.judged.where}"
        for (target, dtype), tally in observed.spreads.items()
        if tally.judged.value > limit[dtype]
    ]
    assert tight == [], f"a correct target came within {1 - HEADROOM:.0%} of the precision threshold"
    assert {dtype for _, dtype in observed.spreads} == set(SIXTEEN_BIT)  # the rule judged both dtypes
