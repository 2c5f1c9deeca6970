"""``lora_expand``: LoRA-B products of every slice, side by side, driven by token-sorted metadata.

Slice ``s`` (width ``N_s``; slices may differ in width, e.g. GQA q/k/v) lands in columns
``[offset_start + Σ_{j<s} N_j, … + N_s)``:

    output[t, cols_s] = (output[t, cols_s] if add_inputs else 0) + round(inputs[s, t]) @ B_s[l]ᵀ

with ``bgmv_expand_slice``'s rounding (an input wider than the weight dtype is rounded to it first;
the delta is rounded to the weight dtype before the add). Rows of slot −1, columns outside the slices
and everything when ``no_lora_flag_cpu`` is set are never written.
"""

from __future__ import annotations

import torch

from ._stacks import weight_stack
from .kernel_meta import segments_of_active_loras
from .op_bgmv_expand_slice import expand_rows


def lora_expand(
    inputs: torch.Tensor,
    lora_b_weights: list[torch.Tensor],
    output_tensor: torch.Tensor,
    token_lora_mapping: torch.Tensor,
    token_indices_sorted_by_lora_ids: torch.Tensor,
    num_tokens_per_lora: torch.Tensor,
    lora_token_start_loc: torch.Tensor,
    lora_ids: torch.Tensor,
    no_lora_flag_cpu: torch.Tensor,
    offset_start: int = 0,
    add_inputs: bool = False,
) -> None:
    if bool(no_lora_flag_cpu.item()):
        return
    stacks = [weight_stack(b) for b in lora_b_weights]  # S × [L, N_s, R]
    if inputs.size(0) != len(stacks):
        raise ValueError(f"inputs have {inputs.size(0)} slices but {len(stacks)} LoRA-B stacks were given")
    if token_lora_mapping.numel() != inputs.size(1):
        raise ValueError(f"token_lora_mapping has {token_lora_mapping.numel()} entries for {inputs.size(1)} tokens")
    # One slot per row, as the metadata's segments say (rows the metadata does not list stay −1).
    slot_per_row = torch.full((inputs.size(1),), -1, dtype=torch.long)
    for slot, rows in segments_of_active_loras(
        token_indices_sorted_by_lora_ids, num_tokens_per_lora, lora_token_start_loc, lora_ids
    ):
        slot_per_row[rows] = slot
    column = offset_start
    for s, lora_b in enumerate(stacks):
        expand_rows(inputs[s], lora_b, output_tensor, slot_per_row, column, add_inputs)
        column += lora_b.size(1)
