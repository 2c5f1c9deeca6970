"""``lora_shrink_fp8``: ``lora_shrink`` on fp8 activations and fp8 LoRA-A weights, dequantized by their scales.

    output[s, t, :R] = scaling · Σ_k (x[t, k] · sx[t, k]) · (A_s[l, r, k] · sa_s[l, r, k])
                       for each slice s and token t with slot l ≠ −1

``x`` ``[T, H]`` and every ``A_s`` ``[L, R, H]`` hold fp8 e4m3fn codes; ``sx`` and ``sa_s`` are the scales
``a_scale`` and ``b_scale[s]`` spread over the elements by the granularity (``_fp8``: per tensor with one
weight scale per slot, per token and output channel, or in ``group_k × group_n`` blocks). The metadata,
the slices and slot −1 are ``lora_shrink``'s: rows of slot −1 are never written, nor is anything when
``no_lora_flag_cpu`` is set. ``num_active_loras`` is accepted for vLLM's signature and not read. The
output is the caller's zeroed float32 ``[S, T, R]`` buffer (vLLM's kernel zeroes it itself; the suite
hands it zeroed, so both agree).

Operand quantization is not a source of error here: the suite hands the target fp8 codes already
rounded (round to nearest even, saturated at ±448, e4m3fn's largest finite value), the same bits the
reference reads, and fp8 → float64 is exact; so is each code times its float32 scale. The oracle is
that exact product summed in float64. The low-precision baseline dequantizes in float32 and sums in
float32. Only ``use_fp8_w8a8=True`` dequantizes: without it the kernels read no scale (and no fp8
activations), which is plain ``lora_shrink``.
"""

from __future__ import annotations

import torch

from ._fp8 import operands
from ._stacks import accumulation_dtype, weight_stack
from .kernel_meta import segments_of_active_loras


def lora_shrink_fp8(
    inputs: torch.Tensor,
    lora_a_weights: list[torch.Tensor],
    output_tensor: torch.Tensor,
    token_lora_mapping: torch.Tensor,
    token_indices_sorted_by_lora_ids: torch.Tensor,
    num_tokens_per_lora: torch.Tensor,
    lora_token_start_loc: torch.Tensor,
    lora_ids: torch.Tensor,
    no_lora_flag_cpu: torch.Tensor,
    num_active_loras: int,
    scaling: float,
    b_scale: list[torch.Tensor],
    a_scale: torch.Tensor | None = None,
    group_k: int = 0,
    group_n: int = 0,
    use_fp8_w8a8: bool = False,
    per_channel_quant: bool = False,
) -> None:
    if bool(no_lora_flag_cpu.item()):
        return
    stacks = [weight_stack(a) for a in lora_a_weights]  # S × [L, R, H]
    if output_tensor.size(0) != len(stacks) or len(b_scale) != len(stacks):
        raise ValueError(f"{len(stacks)} LoRA-A stacks, {len(b_scale)} weight scales, {output_tensor.size(0)} output slices")
    if token_lora_mapping.numel() != inputs.size(0):
        raise ValueError(f"token_lora_mapping has {token_lora_mapping.numel()} entries for {inputs.size(0)} tokens")
    acc = accumulation_dtype(output_tensor, *([a_scale] if a_scale is not None else []), *b_scale)
    (x,), weights = operands([inputs], stacks, a_scale, b_scale, use_fp8_w8a8, group_k, group_n, per_channel_quant, acc)
    for slot, rows in segments_of_active_loras(token_indices_sorted_by_lora_ids, num_tokens_per_lora, lora_token_start_loc, lora_ids):
        for s, lora_a in enumerate(weights):
            product = x[rows] @ lora_a[slot].T  # [rows, R]
            output_tensor[s, rows, : lora_a.size(1)] += (scaling * product).to(output_tensor.dtype)
