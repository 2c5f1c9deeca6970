"""``lora_shrink``: LoRA-A products of every slice, driven by token-sorted metadata (vLLM ≥ 0.8).

    output[s, t, :R] += scaling · inputs[t] @ A_s[l]ᵀ     for each slice s and token t with slot l ≠ −1

The tokens of slot ``l`` are read from the metadata (``kernel_meta``), not from
``token_lora_mapping``, exactly as the kernels do. Nothing is written when ``no_lora_flag_cpu`` is set.
``output`` is the caller's zeroed float32 ``[S, T, R]`` buffer.
"""

from __future__ import annotations

import torch

from ._stacks import accumulation_dtype, weight_stack
from .kernel_meta import segments_of_active_loras


def lora_shrink(
    inputs: torch.Tensor,
    lora_a_weights: list[torch.Tensor],
    output_tensor: torch.Tensor,
    token_lora_mapping: torch.Tensor,
    token_indices_sorted_by_lora_ids: torch.Tensor,
    num_tokens_per_lora: torch.Tensor,
    lora_token_start_loc: torch.Tensor,
    lora_ids: torch.Tensor,
    no_lora_flag_cpu: torch.Tensor,
    scaling: float,
) -> None:
    if bool(no_lora_flag_cpu.item()):
        return
    stacks = [weight_stack(a) for a in lora_a_weights]  # S × [L, R, H]
    if output_tensor.size(0) != len(stacks):
        raise ValueError(f"output has {output_tensor.size(0)} slices but {len(stacks)} LoRA-A stacks were given")
    if token_lora_mapping.numel() != inputs.size(0):
        raise ValueError(f"token_lora_mapping has {token_lora_mapping.numel()} entries for {inputs.size(0)} tokens")
    acc = accumulation_dtype(inputs, *stacks, output_tensor)
    segments = segments_of_active_loras(token_indices_sorted_by_lora_ids, num_tokens_per_lora, lora_token_start_loc, lora_ids)
    for slot, rows in segments:
        x = inputs[rows].to(acc)
        for s, lora_a in enumerate(stacks):
            product = x @ lora_a[slot].to(acc).T  # [rows, R]
            output_tensor[s, rows, : lora_a.size(1)] += (scaling * product).to(output_tensor.dtype)
