"""Correct targets that round differently are never flagged for systematic error.

The systematic-error rule (``conformance/verdict/systematic.py``, thresholds in ``tolerances.py``)
must leave room for every correct way to round: the mask-based ``PlainTorchTarget``, both emulated
Gaudi variants, the reference computing in float32, the Gaudi-like intermediate kept in the
activation dtype (the fused wrappers) and the two MoE variants (``calibration_systematic.correct_targets``).
Each run seed below draws, for every op × dtype, one standard-limits case of the ``random`` family
and of the families that move the values most (positive values, a scale, one token, overwriting
outputs); no result may be flagged and none may come past ``HEADROOM`` of its threshold. About 4 s
of one core per seed.
"""

from __future__ import annotations

import pytest
from calibration_systematic import family_cases, measure

RUN_SEEDS = tuple(range(1, 11))
FAMILIES = ["random", "positive", "scaled", "t1", "no_add_inputs"]
HEADROOM = 0.75
"""Largest systematic ratio (1 is flagged) a correct result may reach. Measured with the rule of issue 23
(docs/verdict.md, *Systematic-error calibration*: ``min_bias`` a quarter of a unit roundoff in 16-bit
outputs, the bias taken from the correctly rounded oracle), as |α| / threshold before the baseline
condition, which only lowers it: over run seeds 1–300 of these families at most 0.47 for bfloat16
outputs, 0.42 for float16 and 0.03 for float32 (0.53 and 0.37 over seeds 1–1000 of the fused wrappers),
and no result flagged by the budget either (largest budget ratio 0.39)."""


@pytest.mark.slow
@pytest.mark.parametrize("run_seed", RUN_SEEDS, ids=lambda seed: f"seed{seed}")
def test_a_correct_target_rounding_elsewhere_is_never_flagged_as_systematic(run_seed):
    tallies, flagged, cases = measure(lambda seed: family_cases(seed, FAMILIES), [run_seed])
    assert cases > 100
    assert flagged == []
    tight = [
        f"{target} ({dtype}): systematic ratio {tally.ratio.value:.3g} at {tally.ratio.where}"
        for (target, dtype), tally in tallies.items()
        if tally.ratio.value > HEADROOM
    ]
    assert tight == [], f"a correct target came within {1 - HEADROOM:.0%} of the systematic-error threshold"
