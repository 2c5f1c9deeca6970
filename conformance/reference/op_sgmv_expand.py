"""``sgmv_expand``: LoRA-B product over segments of rows into the first ``N`` output columns.

Exactly ``sgmv_expand_slice`` with ``slice_offset = 0`` and ``slice_size = N`` (the LoRA-B width).
Note the default ``add_inputs=False`` (``bgmv_expand`` defaults to ``True``).
"""

from __future__ import annotations

import torch

from ._stacks import weight_stack
from .op_sgmv_expand_slice import sgmv_expand_slice


def sgmv_expand(
    inputs: torch.Tensor,
    lora_b_weights: torch.Tensor,
    output_tensor: torch.Tensor,
    b_seq_start_loc: torch.Tensor,
    seq_len_tensor: torch.Tensor,
    lora_indices_tensor: torch.Tensor,
    batches: int,
    max_seq_length: int,
    token_nums: int,
    add_inputs: bool = False,
) -> None:
    width = weight_stack(lora_b_weights).size(1)
    sgmv_expand_slice(
        inputs, lora_b_weights, output_tensor, b_seq_start_loc, seq_len_tensor, lora_indices_tensor,
        batches, max_seq_length, token_nums, 0, width, add_inputs,
    )
