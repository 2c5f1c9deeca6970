"""``sgmv_shrink``: LoRA-A product over segments of rows (prefill layout, one slot per segment).

Segment ``b`` covers rows ``[b_seq_start_loc[b], b_seq_start_loc[b] + seq_len_tensor[b])`` with slot
``lora_indices_tensor[b]``; inside a segment the math is ``bgmv_shrink``'s. Rows outside every segment
and rows of slot −1 are never written.
"""

from __future__ import annotations

import torch

from ._grouping import slot_per_row_from_segments
from ._segments import check_segments
from .op_bgmv_shrink import bgmv_shrink


def sgmv_shrink(
    inputs: torch.Tensor,
    lora_a_weights: torch.Tensor,
    output_tensor: torch.Tensor,
    b_seq_start_loc: torch.Tensor,
    seq_len_tensor: torch.Tensor,
    lora_indices_tensor: torch.Tensor,
    batches: int,
    max_seq_length: int,
    token_nums: int,
    scaling: float,
) -> None:
    check_segments(inputs, b_seq_start_loc, seq_len_tensor, lora_indices_tensor, batches, max_seq_length, token_nums)
    slots = slot_per_row_from_segments(b_seq_start_loc, seq_len_tensor, lora_indices_tensor, inputs.size(0))
    bgmv_shrink(inputs, lora_a_weights, output_tensor, slots, scaling)
