"""Precision: whether a result's error has the spread of rounding in its own dtype, or of a coarser one.

The elementwise budget (``tolerances``) bounds the *largest* error at ``k`` times the baseline's (4 in
16-bit outputs), and the systematic rule (``systematic``) the part of the error along the LoRA delta.
Neither sees an output computed through a coarser format than the one promised: a float16 expand whose
delta passed through bfloat16 (8 significant bits instead of 11) errs by about one bfloat16 rounding of
the delta in every element, a few float16 ulps, inside 4 × the baseline's largest error on most cases,
and with random sign, so without a bias along the delta. What gives it away is the *spread*: its errors
are all about as large as the largest, where correct rounding's are spread evenly below half an ulp.
So the rule compares the root mean square of the error with what rounding correctly in the dtype
gives, over the elements the op writes (finite ones), with ``o`` the oracle, ``d`` its delta and ``g``
the rows (the output's dim −2, the dims before it flattened with it, as in ``systematic``):

    r_i      = (y_i − o_i) − α_g · d_i,  α_g = ⟨y − o, d⟩_g / ⟨d, d⟩_g    (each row g's least-squares multiple)
                                   the error beyond each row's multiple of its delta: a gain is the
                                   systematic rule's to judge, and a rank-1 intermediate rounded
                                   otherwise (Gaudi's two roundings of ``x @ Aᵀ``, up to 2u of the
                                   row's whole delta) is a correct rounding of one number per row
    rms      = √ mean r²
    expected = max( √ mean r(b)²           the baseline b: the reference in the case dtype, vLLM's roundings
                  , √ mean r(fl(o))²       the oracle rounded once to the dtype (``correctly_rounded``)
                  , √ mean σ_i² )          the model below: a floor no lucky rounding lowers
    σ_i²     = (ulp(o_i)² + ulp(d_i)²) / 12 + u² d_i² / 3 + (eps(float32) · m_i)²
    ratio    = rms / expected,   flagged where ratio > threshold(dtype) on at least min_elements elements
                                   (``r(x)``: the same residual of ``x − o``)

The model is what the baseline's roundings give on average: one of the output and one of the delta (a
rounding to nearest errs uniformly within half an ulp: mean square ulp² / 12), one of an intermediate the
row shares, relative (``u = eps / 2``: vLLM rounds the float32 shrink result to the dtype before the
expand, which moves the delta by up to ``u`` of itself: mean square ``u² d² / 3``), plus float32
accumulation of the element's terms ``m_i`` (the magnitude, as in the budget; nothing in a 16-bit output
unless the dot product cancels by thousands). The realized roundings of the baseline and of ``fl(o)``
vary from case to case; on a case of few elements, or of one row whose delta is a handful of rounded
intermediates (one-token logits of rank 8), they can be far below the model, and the model keeps the
expected value from collapsing with them: without its intermediate term a correct target that rounds
that intermediate twice reached 1.9 times a lucky baseline. Without a
delta (an op judged without one) the output stands for it in the model, and no multiple is taken out.

Why the ratio is robust on few elements: each element's error of a correct target is bounded (a
rounding or two of its output and delta), so a mean over ``n`` of them cannot stray far above the model
however few they are, while a delta rounded through bfloat16 into a float16 output is 8 times the
delta's float16 rounding in every element. Each row's multiple takes one number of the row out (a row
of one element has no spread left), and the smallest cases are still noisy, which ``min_elements`` and
the calibration behind the thresholds (docs/verdict.md, *Precision calibration*) answer. The float32 output (the shrink buffer) has no threshold: its correct results
differ from the oracle by the order of their float32 sums, many ulps of the output where the sum
cancels, and a 16-bit computation of it is thousands of float32 ulps, which the budget fails by itself.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch

from .metrics import ulp_of
from .systematic import correctly_rounded
from .tolerances import PrecisionThreshold, precision_threshold_for


@dataclass(frozen=True)
class Spread:
    """The error's spread on one case: the target's RMS beyond each row's multiple of its delta, and what
    correct rounding in the dtype gives (its three estimates and the largest, ``expected``)."""

    rms: float
    baseline_rms: float
    rounded_rms: float
    model_rms: float
    elements: int

    @property
    def expected(self) -> float:
        return max(self.baseline_rms, self.rounded_rms, self.model_rms)

    @property
    def ratio(self) -> float:
        return self.rms / self.expected if self.expected > 0 else (math.inf if self.rms else 0.0)


def _rms(values: torch.Tensor) -> float:
    return math.sqrt(float((values * values).mean())) if values.numel() else 0.0


def beyond_row_multiples(error: torch.Tensor, delta: torch.Tensor | None, rows: torch.Tensor) -> torch.Tensor:
    """``error`` less, in every row, its least-squares multiple of that row's ``delta`` (1-D, matching,
    ``rows`` the row of each element); ``error`` itself without a delta."""
    if delta is None or error.numel() == 0:
        return error
    count = int(rows.max()) + 1
    energy = torch.zeros(count, dtype=torch.float64).index_add_(0, rows, delta * delta)
    along = torch.zeros(count, dtype=torch.float64).index_add_(0, rows, error * delta)
    multiple = torch.where(energy > 0, along / energy.clamp_min(torch.finfo(torch.float64).tiny), 0.0)
    return error - multiple[rows] * delta


def error_spread(a: torch.Tensor, o: torch.Tensor, b: torch.Tensor, d: torch.Tensor | None, m: torch.Tensor | None,
                 rows: torch.Tensor, dtype: torch.dtype) -> Spread:
    """The spread of the result ``a``'s error against the oracle ``o`` (1-D float64, the written elements
    where both are finite), with the baseline ``b``, the oracle's delta ``d`` and magnitude ``m`` there
    (either may be None) and each element's row (``systematic.row_groups``), in the output ``dtype``."""
    delta = d if d is not None else o
    unit_roundoff = torch.finfo(dtype).eps / 2
    model = (ulp_of(o, dtype) ** 2 + ulp_of(delta, dtype) ** 2) / 12 + unit_roundoff**2 * delta**2 / 3
    if m is not None:
        model = model + (torch.finfo(torch.float32).eps * m.nan_to_num(0.0, 0.0, 0.0)) ** 2
    finite_baseline = torch.isfinite(b)  # a baseline that overflowed says nothing of the spread

    def spread(error: torch.Tensor, keep: torch.Tensor | None = None) -> float:
        if keep is not None:
            return _rms(beyond_row_multiples(error[keep], d[keep] if d is not None else None, rows[keep]))
        return _rms(beyond_row_multiples(error, d, rows))

    return Spread(
        rms=spread(a - o),
        baseline_rms=spread(b - o, finite_baseline),
        rounded_rms=spread(correctly_rounded(o, dtype) - o),
        model_rms=math.sqrt(float(model.mean())) if model.numel() else 0.0,
        elements=int(a.numel()),
    )


@dataclass(frozen=True)
class Precision:
    """The spread of one result against its dtype's threshold (``PRECISION_THRESHOLDS``)."""

    spread: Spread
    rule: PrecisionThreshold
    dtype: torch.dtype

    @property
    def judged(self) -> bool:
        """Whether the case has elements enough for a mean square to say something."""
        return self.spread.elements >= self.rule.min_elements

    @property
    def flagged(self) -> bool:
        return self.judged and self.spread.ratio > self.rule.ratio

    def fields(self) -> dict:
        return {
            "error_rms": self.spread.rms,
            "expected_rms": self.spread.expected,
            "precision_ratio": self.spread.ratio,
            "precision_threshold": self.rule.ratio if self.judged else None,
        }

    def text(self) -> str:
        name = str(self.dtype).removeprefix("torch.")
        s = self.spread
        return (
            f"the output has the precision of a coarser dtype than {name}: the error's RMS is {s.rms:.3g} over "
            f"{s.elements} elements (beyond each row's multiple of its delta), {s.ratio:.3g} times the {s.expected:.3g} "
            f"that correct rounding in {name} gives (the largest of the baseline's {s.baseline_rms:.3g}, the "
            f"correctly rounded oracle's {s.rounded_rms:.3g} and the rounding model's {s.model_rms:.3g}), past "
            f"the threshold {self.rule.ratio:g}; an intermediate (the delta, the shrink result, a sum) was likely "
            f"rounded to a format with fewer significant bits"
        )


def precision(a, o, b, d, m, rows, dtype: torch.dtype) -> Precision | None:
    """The precision verdict on one result (arguments as :func:`error_spread`); None where the dtype has
    no threshold (float32) or nothing was written."""
    rule = precision_threshold_for(dtype)
    if rule is None or a.numel() == 0:
        return None
    return Precision(error_spread(a, o, b, d, m, rows, dtype), rule, dtype)
