"""Dequantizing the fp8 operands of ``lora_shrink_fp8`` / ``lora_expand_fp8``: which scale multiplies which element.

An fp8 operand holds codes ``q`` (``torch.float8_e4m3fn``, or already widened: the oracle runs on float64
copies, and fp8 → float64 is exact). Its real value is ``q · scale``, the scale chosen by the
granularity, which vLLM's kernels read from their arguments in this order:

* **block** (``group_k > 0 and group_n > 0``): the activation ``x[m, k]`` is scaled by
  ``a_scale[m, k // group_k]`` and the weight ``W[l, n, k]`` by ``b_scale[l, n // group_n, k // group_k]``;
* **channel** (``per_channel_quant``): ``x[m, k]`` by the per-token ``a_scale[m, 0]``, ``W[l, n, k]`` by the
  per-output-channel ``b_scale[l, n]``;
* **tensor** (neither): ``x`` by the single ``a_scale[0]``, ``W[l]`` by ``b_scale[l]``, one scale per slot.

``K`` is the contraction (the shrink's hidden size, the expand's rank), ``N`` the output features (the
shrink's rank, the expand's slice width). A 4-D weight scale ``[L, 1, ·, ·]`` drops its dimension 1 as the
weights do. Without ``use_fp8_w8a8`` the kernels read no scale at all (the plain lora_shrink/lora_expand
math on whatever they are given).
"""

from __future__ import annotations

import torch


def granularity(group_k: int, group_n: int, per_channel_quant: bool) -> str:
    """``"block"``, ``"channel"`` or ``"tensor"``, in the precedence the kernels test them."""
    if group_k > 0 and group_n > 0:
        return "block"
    return "channel" if per_channel_quant else "tensor"


def _per_column(scale: torch.Tensor, group: int, columns: int) -> torch.Tensor:
    """A scale per group of ``group`` columns (last dimension), repeated out to one per column."""
    return scale.repeat_interleave(group, dim=-1)[..., :columns]


def activation_scales(a_scale: torch.Tensor, mode: str, rows: int, k: int, group_k: int) -> torch.Tensor:
    """The scale of every activation element, ``[rows, K]`` (broadcastable)."""
    if mode == "block":
        return _per_column(a_scale.reshape(rows, -1), group_k, k)
    if mode == "channel":
        return a_scale.reshape(rows, 1)
    return a_scale.reshape(-1)[:1].reshape(1, 1)


def weight_scales(b_scale: torch.Tensor, mode: str, stack: torch.Tensor, group_n: int, group_k: int) -> torch.Tensor:
    """The scale of every element of the ``[L, N, K]`` weight stack (broadcastable)."""
    slots, n, k = stack.shape
    if b_scale.ndim == 4:
        b_scale = b_scale.squeeze(1)
    if mode == "block":
        per_k = _per_column(b_scale.reshape(slots, -1, b_scale.size(-1)), group_k, k)  # [L, N/gn, K]
        return per_k.repeat_interleave(group_n, dim=1)[:, :n, :]
    if mode == "channel":
        return b_scale.reshape(slots, n, 1)
    return b_scale.reshape(slots, 1, 1)


def dequantized(codes: torch.Tensor, scales: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """``codes · scales`` in ``dtype``: exact in float64 (a 4-bit significand times a float32 scale)."""
    return codes.to(dtype) * scales.to(dtype)


def operands(xs, stacks: list[torch.Tensor], a_scale, b_scale: list[torch.Tensor], use_fp8_w8a8: bool, group_k: int,
             group_n: int, per_channel_quant: bool, dtype: torch.dtype) -> tuple[list[torch.Tensor], list[torch.Tensor]]:
    """The activations ``xs`` (each ``[rows, K]``, one ``a_scale`` for all) and the weight stacks (``[L, N, K]``,
    one scale each) as real values in ``dtype``: dequantized at the kernels' granularity with ``use_fp8_w8a8``,
    else only widened (the kernels then read no scale)."""
    if not use_fp8_w8a8:
        return [x.to(dtype) for x in xs], [w.to(dtype) for w in stacks]
    mode = granularity(group_k, group_n, per_channel_quant)
    rows, k = xs[0].shape
    x_scales = activation_scales(a_scale, mode, rows, k, group_k)
    weights = [dequantized(w, weight_scales(scale, mode, w, group_n, group_k), dtype) for w, scale in zip(stacks, b_scale)]
    return [dequantized(x, x_scales, dtype) for x in xs], weights
