"""Systematic error: the part of a result's error that is proportional to the LoRA delta.

The elementwise budget (``tolerances``) bounds the largest error; an implementation whose delta is
off by one or two percent everywhere stays inside it, since correct low-precision code already
errs by about one rounding of the output. What tells such a bug from rounding is that its error
points along the delta. Over the elements the op writes (finite ones), with

    e = actual − fl(oracle)    the error beyond the correctly rounded result (``fl``: rounded to
                               the output dtype, to nearest; :func:`correctly_rounded`)
    d = the oracle's delta     what the op adds to its output (the float64 reference on a zeroed
                               output: for an op that overwrites, the value it writes)

the least-squares fit ``e ≈ α · d`` gives

    α = ⟨e, d⟩ / ⟨d, d⟩        the relative bias of the delta (+0.016: the delta is 1.6 % too large)

The error is measured from ``fl(oracle)``, not the oracle, because every correct result is rounded
to the output dtype, and that rounding's own part along the delta, ``β = ⟨fl(o) − o, d⟩ / ⟨d, d⟩``, is
fixed by the oracle, not random: where the delta is a few ulps of a base output already in the dtype
and nearly the same everywhere (``positive`` values, a small scale), ``y₀ + d`` rounds the same way
in a whole binade, and the correctly rounded result is −1.7 % of the delta off the oracle at 17
standard errors (tests/verdict/test_sub_ulp_calibration.py drew it). Measured from ``fl(o)`` it is
0.03 %; a gain still shows on top of it wherever it moves elements to other roundings.

Rounding moves α too, so α is read against its standard error under a noise model of what correct
code may do (a bound on each rounding, not a fit to the target's own residuals, so that it holds on a
case of one element as on one of a million), with ``u = eps(dtype) / 2`` the unit roundoff of the
output dtype and ``ulp`` the spacing of that dtype:

* every element: one rounding of the output and one of the delta, independent between elements,
  each at most half an ulp, and (given the magnitude ``m_i``, the size of the terms the element sums)
  float32 accumulation error of one ulp of those terms:
  ``σ_i = ½ · (ulp(o_i) + ulp(d_i)) + eps(float32) · m_i``. The last term is nothing in a 16-bit
  output; in a float32 one it keeps a dot product that cancels (a shrink of one token and rank 1, the
  result a thousandth of its terms) from reading its accumulation error as a bias: a float32 sum of
  4,096 cancelling terms, term after term, erred by up to 0.15 ulps of its terms. Measured from
  ``fl(o)``, the output's rounding shows as a step of one ulp where the error before it, ``ε``, carries
  the result across a rounding boundary (with probability about ``|ε| / ulp(o)``): a mean square of
  about ``ulp(o) · |ε| ≤ ulp(o) · ulp(d) / 2``, inside ``σ_i²``;
* every row ``g`` (the output's dim −2, the dims before it flattened with it): one rounding of an
  intermediate the row shares (the shrink result of rank 1, a routing weight), relative at most
  ``u`` and the same for the whole row, so it is exactly proportional to that row's delta;

    SE(α)² = [ Σ_i σ_i² d_i²  +  u² Σ_g (Σ_{i∈g} d_i²)² ] / (Σ_i d_i²)²

Both terms bound a rounding by its largest value, so they overestimate its spread; the second
keeps a case of few rows (one token, rank 1, where α *is* that row's rounding) from looking biased,
and it is what sets the rule's resolution: ``SE ≈ u / √rows`` once the rows are alike, so half a
unit roundoff (a scale rounded to the dtype) is five standard errors from about a hundred rows on.
The verdict (``judge``) flags a result whose ``|α|`` exceeds both ``min_bias`` of its dtype and
``z · SE(α)`` (``SYSTEMATIC_THRESHOLDS`` in ``tolerances``), and whose difference from the
baseline's α does too: the model takes roundings as independent and centred, and rounding a product
of two numbers of the dtype is not (a LoRA-B entry just below a power of two makes every rank-1
product round down, by −0.45 u on average); a bias the baseline shares is that, not the target's.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch

from .metrics import ulp_of


@dataclass(frozen=True)
class DeltaBias:
    bias: float  # α: the error's least-squares multiple of the delta
    standard_error: float  # SE(α) under the rounding noise model above

    @property
    def significance(self) -> float:
        """``|α| / SE(α)``: how many standard errors the bias is from zero."""
        if self.standard_error > 0:
            return abs(self.bias) / self.standard_error
        return math.inf if self.bias else 0.0


def row_groups(written: torch.Tensor) -> torch.Tensor:
    """The row (dim −2, with the dims before it flattened) of every written element, in ``written``'s order."""
    index = torch.arange(written.numel()).reshape(written.shape)
    return (index // written.size(-1))[written]


def correctly_rounded(oracle: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """The float64 ``oracle`` rounded to ``dtype`` (to nearest) where that is finite, the oracle itself
    where it overflows: the result a correct target's error is measured from (``α`` above)."""
    rounded = oracle.to(dtype).double()
    return torch.where(torch.isfinite(rounded), rounded, oracle)


def delta_bias(
    error: torch.Tensor, delta: torch.Tensor, oracle: torch.Tensor, rows: torch.Tensor, dtype: torch.dtype,
    magnitude: torch.Tensor | None = None,
) -> DeltaBias | None:
    """α and SE(α) over matching 1-D float64 ``error``, ``delta``, ``oracle``, ``rows`` (row ids) and
    ``magnitude`` (or None); None when the delta is zero everywhere (nothing to be proportional to)."""
    delta_energy = float((delta * delta).sum())
    if delta_energy == 0.0:
        return None
    bias = float((error * delta).sum()) / delta_energy
    element_noise = 0.5 * (ulp_of(oracle, dtype) + ulp_of(delta, dtype))
    if magnitude is not None:
        element_noise = element_noise + torch.finfo(torch.float32).eps * magnitude.nan_to_num(0.0, 0.0, 0.0)
    element_variance = float((element_noise**2 * delta**2).sum())
    per_row_energy = torch.zeros(int(rows.max()) + 1, dtype=torch.float64).index_add_(0, rows, delta * delta)
    unit_roundoff = torch.finfo(dtype).eps / 2
    row_variance = unit_roundoff**2 * float((per_row_energy**2).sum())
    return DeltaBias(bias, math.sqrt(element_variance + row_variance) / delta_energy)
