"""The LoRA scales the cases draw: those of real adapter configs, most of them inexact in 16 bits.

A LoRA layer adds ``scale · B(A x)`` with ``scale = lora_alpha / r``, or ``lora_alpha / √r`` for rsLoRA
(PEFT's ``LoraConfig.use_rslora``; vLLM reads the scaling PEFT would apply when it loads an adapter).
Real configs pair an alpha with ranks that do not divide it (alpha 16 at rank 12 gives 4/3), and
rsLoRA divides by a square root: neither value is exact in float16 or bfloat16. A port that hands its
kernel the scale as a tensor of the model's dtype rounds it, and every delta then carries the same
gain (up to 2^-9 in bfloat16, 2^-12 in float16: the systematic rule's scale,
``conformance.verdict.systematic``). Exact scales (0.5, 2) would never show it, so they are two of the
nine drawn. The values are the float64 quotients, as a Python float holds them: the oracle multiplies by
that value, a correct float32 kernel by its float32 rounding (2^-24, far below every budget).
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch


@dataclass(frozen=True)
class AdapterScale:
    lora_alpha: int
    rank: int
    rslora: bool = False  # scale = alpha / √r (rank-stabilized LoRA) instead of alpha / r

    @property
    def value(self) -> float:
        return self.lora_alpha / (math.sqrt(self.rank) if self.rslora else self.rank)


ADAPTER_SCALES = (
    AdapterScale(8, 16),  # 0.5: exact
    AdapterScale(32, 16),  # 2: exact (alpha = 2r, a common default)
    AdapterScale(16, 12),  # 4/3: float16 rounds it down 0.024 %, bfloat16 up 0.20 %
    AdapterScale(16, 28),  # 4/7: bfloat16 rounds it down 0.20 %
    AdapterScale(16, 48),  # 1/3
    AdapterScale(64, 12),  # 16/3
    AdapterScale(12, 6, rslora=True),  # 4.899: bfloat16 up 0.15 %
    AdapterScale(16, 12, rslora=True),  # 4.619: float16 down 0.035 %, bfloat16 up 0.13 %
    AdapterScale(8, 12, rslora=True),  # 2.309
)
SCALES = tuple(scale.value for scale in ADAPTER_SCALES)


def exact_in(value: float, dtype: torch.dtype) -> bool:
    """Whether ``value`` survives a round trip through ``dtype`` unchanged."""
    return float(torch.tensor(value, dtype=torch.float64).to(dtype).double()) == value
