"""A LoRA delta added to a float32 base output: vLLM 0.34's ``DeepseekV4CompressorKVScoreWithLoRA``.

DeepSeek-V4's KV compressor computes its packed ``wkv`` / ``wgate`` projection in float32. Punica's expand
writes in the LoRA dtype, so vLLM 0.34 (``vllm/lora/layers/custom_layer.py``,
``DeepseekV4CompressorKVScoreWithLoRA.apply``) builds the delta in a zeroed buffer of the LoRA-B dtype with
``add_lora_linear`` and adds that buffer to the float32 output. For a token ``t`` of slot ``l ≠ −1``::

    delta[t, cols_s] = round_lora_dtype(scale · (x[t] @ A_s[l]ᵀ) @ B_s[l]ᵀ)      (zero for rows of slot −1)
    y[t] = y[t] + delta[t]                                                     (y float32)

In the oracle every tensor is float64 and nothing rounds; the baseline rounds the delta once to the LoRA
dtype, as vLLM does. Rows of slot −1 get ``+ 0``.
"""

from __future__ import annotations

from collections.abc import Callable

import torch


def add_lora_to_fp32_output(add_lora_linear: Callable, y: torch.Tensor, x: torch.Tensor, lora_a_stacked: tuple[torch.Tensor, ...],
                            lora_b_stacked: tuple[torch.Tensor, ...], scale: float, output_slices: tuple[int, ...]) -> None:
    """``y += delta``, the delta from ``add_lora_linear`` into a zeroed buffer of LoRA-B's dtype."""
    delta = torch.zeros_like(y, dtype=lora_b_stacked[0].dtype)
    add_lora_linear(delta, x, lora_a_stacked, lora_b_stacked, scale, output_slices)
    y.add_(delta.to(y.dtype))
