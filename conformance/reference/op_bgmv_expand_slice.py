"""``bgmv_expand_slice``: per-token LoRA-B product written into one column slice of the output.

    delta[t] = round_to_weight_dtype(inputs[t]) @ B[l]ᵀ                       (l = lora_indices[t] ≠ −1)
    output[t, off:off+N] = (output[t, off:off+N] if add_inputs else 0) + delta[t]

* an input wider than the weight dtype (the float32 shrink buffer) is first rounded to the weight
  dtype, as the Triton kernels do (``CAST_TYPE``);
* products accumulate in float32 (float64 for the oracle), the delta is rounded to the weight dtype,
  then added to the output in the output dtype;
* rows with slot −1 and columns outside ``[off, off+N)`` are never written, even with
  ``add_inputs=False``.
"""

from __future__ import annotations

import torch

from ._grouping import rows_per_adapter
from ._stacks import accumulation_dtype, weight_stack


def expand_rows(
    inputs: torch.Tensor,
    lora_b: torch.Tensor,
    output_tensor: torch.Tensor,
    slot_per_row: torch.Tensor,
    slice_offset: int,
    add_inputs: bool,
) -> None:
    """The expand math shared by every expand op: ``lora_b`` is ``[L, N, R]``, one slot per row."""
    width = lora_b.size(1)
    if inputs.size(-1) != lora_b.size(-1):
        raise ValueError(f"inputs have rank {inputs.size(-1)} but LoRA-B has rank {lora_b.size(-1)}")
    if slice_offset < 0 or slice_offset + width > output_tensor.size(-1):
        raise ValueError(
            f"slice [{slice_offset}, {slice_offset + width}) does not fit an output of width {output_tensor.size(-1)}"
        )
    acc = accumulation_dtype(inputs, lora_b, output_tensor)
    columns = slice(slice_offset, slice_offset + width)
    for slot, rows in rows_per_adapter(slot_per_row):
        shrunk = inputs[rows].to(lora_b.dtype)  # CAST_TYPE: a float32 buffer is rounded first
        delta = (shrunk.to(acc) @ lora_b[slot].to(acc).T).to(lora_b.dtype)
        if not add_inputs:
            output_tensor[rows, columns] = delta.to(output_tensor.dtype)
        elif delta.dtype == output_tensor.dtype == acc:
            # float32/float64 throughout (the oracle): add into the rows in place, one addition per element,
            # instead of gathering them into a [rows, N] temporary and scattering it back; at N = 28672 and
            # more those copies were most of the oracle's time. Same values, bit for bit.
            output_tensor[:, columns].index_add_(0, rows, delta)
        else:
            # torch adds in the promoted dtype (float32 at least) and rounds once to the output dtype:
            # exactly ``(output.to(acc) + delta.to(acc)).to(output.dtype)``.
            output_tensor[rows, columns] += delta


def bgmv_expand_slice(
    inputs: torch.Tensor,
    lora_b_weights: torch.Tensor,
    output_tensor: torch.Tensor,
    lora_indices_tensor: torch.Tensor,
    slice_offset: int,
    slice_size: int,
    add_inputs: bool = True,
) -> None:
    lora_b = weight_stack(lora_b_weights)  # [L, N, R]
    if slice_size != lora_b.size(1):
        raise ValueError(f"slice_size {slice_size} differs from the LoRA-B output width {lora_b.size(1)}")
    if lora_indices_tensor.numel() != inputs.size(0):
        raise ValueError(f"{lora_indices_tensor.numel()} slot indices for {inputs.size(0)} tokens")
    expand_rows(inputs, lora_b, output_tensor, lora_indices_tensor, slice_offset, add_inputs)
