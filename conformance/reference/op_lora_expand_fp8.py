"""``lora_expand_fp8``: ``lora_expand`` on fp8 shrink results and fp8 LoRA-B weights, dequantized by their scales.

    delta_s[t] = round_out( Σ_r (x[s, t, r] · sx[t, r]) · (B_s[l, n, r] · sb_s[l, n, r]) )
    output[t, cols_s] = (output[t, cols_s] if add_inputs else 0) + delta_s[t]      for tokens with slot l ≠ −1

``x`` ``[S, T, R]`` and every ``B_s`` ``[L, N_s, R]`` hold fp8 e4m3fn codes. One ``a_scale`` serves every
slice (vLLM indexes it by token only): one scale, one per token (``[T, 1]``) or one per token and
``group_k`` ranks (``[T, ⌈R/group_k⌉]``). ``b_scale[s]`` is slice ``s``'s weight scale: one per slot
``[L]``, per slot and output channel ``[L, N_s]``, or per ``group_n × group_k`` block
``[L, ⌈N_s/group_n⌉, ⌈R/group_k⌉]`` (``_fp8``). Slice ``s`` lands in columns
``[offset_start + Σ_{j<s} N_j, … + N_s)``.

As vLLM's kernel does, the delta (summed in float32, float64 for the oracle) is rounded to the output
dtype before it is added to the output in that dtype. Rows of slot −1, columns outside the slices and
everything when ``no_lora_flag_cpu`` is set are never written. ``num_active_loras`` is accepted for
vLLM's signature and not read. Operand quantization is no source of error (``op_lora_shrink_fp8``):
the target and the reference read the same fp8 codes, widened exactly. Only ``use_fp8_w8a8=True``
dequantizes; vLLM's expand then requires fp8 inputs and weights, without it 16-bit weights and no scale.
"""

from __future__ import annotations

import torch

from ._fp8 import operands
from ._stacks import accumulation_dtype, weight_stack
from .kernel_meta import segments_of_active_loras


def lora_expand_fp8(
    inputs: torch.Tensor,
    lora_b_weights: list[torch.Tensor],
    output_tensor: torch.Tensor,
    token_lora_mapping: torch.Tensor,
    token_indices_sorted_by_lora_ids: torch.Tensor,
    num_tokens_per_lora: torch.Tensor,
    lora_token_start_loc: torch.Tensor,
    lora_ids: torch.Tensor,
    no_lora_flag_cpu: torch.Tensor,
    num_active_loras: int,
    b_scale: list[torch.Tensor],
    a_scale: torch.Tensor | None = None,
    offset_start: int = 0,
    add_inputs: bool = False,
    group_k: int = 0,
    group_n: int = 0,
    use_fp8_w8a8: bool = False,
    per_channel_quant: bool = False,
) -> None:
    if bool(no_lora_flag_cpu.item()):
        return
    stacks = [weight_stack(b) for b in lora_b_weights]  # S × [L, N_s, R]
    if inputs.size(0) != len(stacks) or len(b_scale) != len(stacks):
        raise ValueError(f"inputs have {inputs.size(0)} slices; {len(stacks)} LoRA-B stacks and {len(b_scale)} weight scales were given")
    if token_lora_mapping.numel() != inputs.size(1):
        raise ValueError(f"token_lora_mapping has {token_lora_mapping.numel()} entries for {inputs.size(1)} tokens")
    if offset_start + sum(b.size(1) for b in stacks) > output_tensor.size(-1):
        raise ValueError(f"slices of widths {[b.size(1) for b in stacks]} from column {offset_start} overrun {output_tensor.size(-1)} columns")
    acc = accumulation_dtype(output_tensor, *([a_scale] if a_scale is not None else []), *b_scale)
    # one a_scale serves every slice's input (the kernel has no slice stride for it)
    xs, weights = operands(list(inputs), stacks, a_scale, b_scale, use_fp8_w8a8, group_k, group_n, per_channel_quant, acc)
    segments = list(segments_of_active_loras(token_indices_sorted_by_lora_ids, num_tokens_per_lora, lora_token_start_loc, lora_ids))
    column = offset_start
    for x, lora_b in zip(xs, weights):
        columns = slice(column, column + lora_b.size(1))
        for slot, rows in segments:
            delta = (x[rows] @ lora_b[slot].T).to(output_tensor.dtype)  # rounded to the output dtype first
            if add_inputs:
                output_tensor[rows, columns] += delta  # torch adds in float32 at least, then rounds once
            else:
                output_tensor[rows, columns] = delta
        column += lora_b.size(1)
