"""Head groups sharing one LoRA-A, each with its own LoRA-B: vLLM 0.34's ``DeepseekV4GroupedWoAWithLoRA``.

DeepSeek-V4's grouped output projection ``wo_a`` maps each of ``G`` head groups' inputs to its own
``o_lora_rank`` outputs. vLLM 0.34 (``vllm/lora/layers/custom_layer.py``, ``DeepseekV4GroupedWoAWithLoRA``)
gives every group the one LoRA-A of the adapter (``lora_a_stacked``, ``[L, (1,) R, H]``) and group ``g``
the rows ``g·N : (g+1)·N`` of its LoRA-B, kept as a stack of its own (``lora_b_stacked[g]``, ``[L, (1,) N, R]``).
Its ``grouped_forward`` runs ``add_lora_linear`` once per group on that group's input and output columns.
For a token ``t`` of slot ``l ≠ −1`` and every group ``g``::

    y[t, g] += scale · (x[t, g] @ A[l]ᵀ) @ B_g[l]ᵀ

``x`` is ``[T, G, H]``, ``y`` ``[T, G, N]``; rows of slot −1 are never written. vLLM passes scale 1 (its
scaling is folded into LoRA-B when the adapter is loaded).
"""

from __future__ import annotations

from collections.abc import Callable

import torch


def add_grouped_lora(add_lora_linear: Callable, y: torch.Tensor, x: torch.Tensor, lora_a_stacked: torch.Tensor,
                     lora_b_stacked: tuple[torch.Tensor, ...], scale: float) -> None:
    """``y[:, g] += scale · (x[:, g] @ Aᵀ) @ B_gᵀ`` per group, through ``add_lora_linear(y, x, (A,), (B_g,), scale, (N,))``."""
    groups = len(lora_b_stacked)
    if x.size(1) != groups or y.size(1) != groups:
        raise ValueError(f"{groups} LoRA-B stacks (one per head group) but x has {x.size(1)} groups and y {y.size(1)}")
    for g, lora_b in enumerate(lora_b_stacked):
        group_y = y[:, g].contiguous()
        add_lora_linear(group_y, x[:, g].contiguous(), (lora_a_stacked,), (lora_b,), scale, (group_y.size(-1),))
        y[:, g] = group_y
