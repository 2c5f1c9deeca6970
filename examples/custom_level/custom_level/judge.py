"""The judgement of a ``device_sum`` case, in the referee's process.

The values are positive (U[0.5, 1)), so the sum cannot cancel and ``Σ|x|`` is the sum itself. A float32
sum of ``n`` such values, in any order, errs by at most ``(n − 1) · u · Σx`` with ``u = 2⁻²⁴`` (the
worst case of recursive summation), and in practice by about ``√n · u · Σx`` (the rounding errors of the
partial sums are as often up as down; pairwise summation, as torch's CPU kernels do, errs less still).
The allowance is ``(8 · √n + 1) · u · Σx``: a device that rounds a sum, or its partial sums, to bfloat16
(``u = 2⁻⁹``) or that drops a term is far outside it, a float32 one inside.
"""

from __future__ import annotations

import math

import torch

UNIT_ROUNDOFF = 2.0**-24  # float32


def draw(length: int, seed: int) -> torch.Tensor:
    """The case's values: U[0.5, 1), drawn in float64 and rounded to float32, from the case's seed."""
    generator = torch.Generator().manual_seed(seed)
    return (0.5 + 0.5 * torch.rand(length, generator=generator, dtype=torch.float64)).to(torch.float32)


def allowance(values: torch.Tensor) -> float:
    return (8 * math.sqrt(values.numel()) + 1) * UNIT_ROUNDOFF * float(values.double().abs().sum())


def judge(values: torch.Tensor, answer: torch.Tensor) -> tuple[bool, str, float]:
    """``(passed, message, ratio)``: the sum against the float64 sum; ``ratio`` is the error over the allowance."""
    exact = float(values.double().sum())
    got = float(answer.double().reshape(-1)[0])
    if not math.isfinite(got):
        return False, f"the sum is {got}; the exact sum is {exact:.9g}", math.inf
    error, allowed = abs(got - exact), allowance(values)
    ratio = error / allowed if allowed else (0.0 if error == 0 else math.inf)
    if ratio > 1:
        return False, f"the sum {got:.9g} is {error:.3g} from the exact {exact:.9g}, over the float32 allowance {allowed:.3g}", ratio
    return True, "", ratio
