"""``sgmv_expand_slice``: LoRA-B product over segments of rows into one column slice of the output.

``bgmv_expand_slice``'s math with one slot per segment (see ``op_sgmv_shrink``). Default ``add_inputs=False``.
"""

from __future__ import annotations

import torch

from ._grouping import slot_per_row_from_segments
from ._segments import check_segments
from ._stacks import weight_stack
from .op_bgmv_expand_slice import expand_rows


def sgmv_expand_slice(
    inputs: torch.Tensor,
    lora_b_weights: torch.Tensor,
    output_tensor: torch.Tensor,
    b_seq_start_loc: torch.Tensor,
    seq_len_tensor: torch.Tensor,
    lora_indices_tensor: torch.Tensor,
    batches: int,
    max_seq_length: int,
    token_nums: int,
    slice_offset: int,
    slice_size: int,
    add_inputs: bool = False,
) -> None:
    check_segments(inputs, b_seq_start_loc, seq_len_tensor, lora_indices_tensor, batches, max_seq_length, token_nums)
    lora_b = weight_stack(lora_b_weights)
    if slice_size != lora_b.size(1):
        raise ValueError(f"slice_size {slice_size} differs from the LoRA-B output width {lora_b.size(1)}")
    slots = slot_per_row_from_segments(b_seq_start_loc, seq_len_tensor, lora_indices_tensor, inputs.size(0))
    expand_rows(inputs, lora_b, output_tensor, slots, slice_offset, add_inputs)
