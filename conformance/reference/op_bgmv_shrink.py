"""``bgmv_shrink``: per-token LoRA-A product (decode layout, one slot per token).

    output[t, :R] += scaling · inputs[t] @ A[l]ᵀ      for every token t with slot l = lora_indices[t] ≠ −1

``output`` is the caller's zeroed float32 buffer (vLLM's Triton kernel may split K and add atomically,
so "add into zeros" is the contract); rows with slot −1 are left exactly as they were.
"""

from __future__ import annotations

import torch

from ._grouping import rows_per_adapter
from ._stacks import accumulation_dtype, weight_stack


def bgmv_shrink(
    inputs: torch.Tensor,
    lora_a_weights: torch.Tensor,
    output_tensor: torch.Tensor,
    lora_indices_tensor: torch.Tensor,
    scaling: float = 1.0,
) -> None:
    lora_a = weight_stack(lora_a_weights)  # [L, R, H]
    if inputs.size(-1) != lora_a.size(-1):
        raise ValueError(f"inputs have {inputs.size(-1)} features but LoRA-A expects {lora_a.size(-1)}")
    if lora_indices_tensor.numel() != inputs.size(0):
        raise ValueError(f"{lora_indices_tensor.numel()} slot indices for {inputs.size(0)} tokens")
    rank = lora_a.size(1)
    acc = accumulation_dtype(inputs, lora_a, output_tensor)
    for slot, rows in rows_per_adapter(lora_indices_tensor):
        product = inputs[rows].to(acc) @ lora_a[slot].to(acc).T  # [rows, R]
        output_tensor[rows, :rank] += (scaling * product).to(output_tensor.dtype)
