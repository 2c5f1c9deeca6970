"""``bgmv_expand``: per-token LoRA-B product into the first ``N`` output columns.

Exactly ``bgmv_expand_slice`` with ``slice_offset = 0`` and ``slice_size = N`` (the LoRA-B width);
columns at and beyond ``N`` of a wider output are never written. Note the default ``add_inputs=True``
(the sgmv ops default to ``False``).
"""

from __future__ import annotations

import torch

from ._stacks import weight_stack
from .op_bgmv_expand_slice import bgmv_expand_slice


def bgmv_expand(
    inputs: torch.Tensor,
    lora_b_weights: torch.Tensor,
    output_tensor: torch.Tensor,
    lora_indices_tensor: torch.Tensor,
    add_inputs: bool = True,
) -> None:
    width = weight_stack(lora_b_weights).size(1)
    bgmv_expand_slice(inputs, lora_b_weights, output_tensor, lora_indices_tensor, 0, width, add_inputs)
