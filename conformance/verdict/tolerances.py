"""Error budgets per output dtype, kept as data.

A target's result ``y`` is compared with the float64 oracle ``o`` (the reference on the same inputs,
rounded to the case dtype) over the elements the op may write:

    error(y)  = max |y − o|
    scale     = max |o|                                 (1 when the oracle is all zero)
    budget    = k · error(baseline) + floor_ulps · eps(dtype) · scale
    pass iff  error(y) ≤ budget  and  error(y) ≤ rtol · scale

where ``baseline`` is the same reference run in the case dtype. The first rule asks a target to be
about as accurate as straightforward float32-accumulating code; the floor keeps a zero baseline error
from demanding bit-exactness; the second rule is an absolute cap per dtype. The dtype is that of the
output written: a shrink op writes a float32 buffer, so it is held to float32 whatever its inputs.

Why these numbers: k = 4 leaves room for any summation order (measured: correct reorderings stay
below 2× the baseline error over thousands of cases, tests/test_verdict_calibration.py); the floor
is a few units in the last place of the output; rtol is the loosest relative error a LoRA delta can
carry before it changes greedy tokens on real models.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch


@dataclass(frozen=True)
class Tolerance:
    k: float  # multiple of the baseline's error
    floor_ulps: float  # floor, in units of eps(dtype) · scale
    rtol: float  # absolute cap relative to the output scale


TOLERANCES: dict[torch.dtype, Tolerance] = {
    torch.float16: Tolerance(k=4.0, floor_ulps=2.0, rtol=1e-2),
    torch.bfloat16: Tolerance(k=4.0, floor_ulps=2.0, rtol=3e-2),
    torch.float32: Tolerance(k=4.0, floor_ulps=16.0, rtol=1e-4),
}


def tolerance_for(dtype: torch.dtype) -> Tolerance:
    try:
        return TOLERANCES[dtype]
    except KeyError:
        raise ValueError(f"no tolerance for output dtype {dtype}; known: {sorted(map(str, TOLERANCES))}") from None
