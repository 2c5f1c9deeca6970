"""``fused_moe_lora_fp8``: ``fused_moe_lora`` on fp8 activations and fp8 LoRA weights, dequantized by their scales.

For the pair ``p = t·top_k + k`` of a token with slot ``l`` routed to local expert ``e``, slice ``s``
(every slice has width ``N``, the rank is ``R = max_lora_rank``)::

    h[s, p, r] = round_out( Σ_k (x[row, k] · sx[row, k]) · (A_s[l, e, r, k] · sa_s[l, e, r, k]) )
    output[t, k, offset + s·N + n]  +=  round_out( w_p · Σ_r (h[s, p, r] · sh[p, r]) · (B_s[l, e, n, r] · sb_s[l, e, n, r]) )

``row``, ``w_p`` and which pairs each (slot, expert) serves are ``fused_moe_lora``'s (``row = p`` and
``w_p = topk_weights[t, k]`` with ``mul_routed_weight``, else ``row = t`` and ``w_p = 1``; block-aligned
or naive metadata; slot −1, a disabled slot and expert −1 are never written). ``x`` ``[rows, K]`` and
every ``A_s`` ``[L, E, R, K]`` / ``B_s`` ``[L, E, N, R]`` hold e4m3fn codes. The scales, laid out as vLLM's
wrapper hands their strides to the kernel, ``block_shape = [group_n, group_k]``:

* **block** (``block_shape`` given): ``sx = shrink_act_scale[row, k // group_k]``, ``sh =
  expand_act_scale[p, r // group_k]``; ``sa_s = lora_a_scale_stacked[s][l, e, r // group_n, k // group_k]``
  (``[L, E, ⌈R/group_n⌉, ⌈K/group_k⌉]``, the shape vLLM asserts), ``sb_s`` likewise over ``[N, R]``;
* **channel** (``per_channel_quant``): one activation scale per row (``[rows, 1]``, ``[T·top_k, 1]``), one
  weight scale per (slot, expert, output channel) (``[L, E, R]`` / ``[L, E, N]``, or with a trailing 1);
* **tensor** (neither): one activation scale, one weight scale per (slot, expert) (``[L, E]``).

``expand_act_scale`` is optional (absent: ``sh = 1``). Rounding points, as vLLM's op has them: the
intermediate ``h`` is a zeroed buffer in the output dtype (the shrink's float32 sum rounded to it) and
is **not** re-quantized to fp8 before the expand, which reads it as it is; the expand's float32 sum,
times ``w_p``, is rounded to the output dtype and added to the output in it (the op has no
``add_inputs``: its expand always adds). The oracle dequantizes exactly (fp8 → float64 is exact, and
so is a 4-bit significand times a float32 scale) and sums in float64.

vLLM 0.32.0's Triton kernel for this op accepts the scales, ``block_shape`` and ``use_fp8_w8a8`` and reads
none of them (its body is the plain fused_moe_lora kernel's, the weights read through a pointer of the
output's element type), so this definition is the one its arguments and the dense fp8 ops
(``_fp8``) give, not what that kernel computes. Without ``use_fp8_w8a8`` no scale may be given and the
op is plain ``fused_moe_lora`` that adds. The int8 modes are outside the suite. The tile parameters and
``fully_sharded`` are ``fused_moe_lora``'s (this rank's shard; the collective is the caller's).
"""

from __future__ import annotations

import torch

from ._fp8 import activation_scales, dequantized, granularity, weight_scales
from ._routing import pairs_per_slot_and_expert
from ._stacks import accumulation_dtype
from .op_fused_moe_lora import aligned_pairs, fused_moe_lora, naive_pairs


def fused_moe_lora_fp8(
    output: torch.Tensor,
    qcurr_hidden_states: torch.Tensor,
    lora_a_stacked: list[torch.Tensor],
    lora_b_stacked: list[torch.Tensor],
    topk_weights: torch.Tensor,
    sorted_token_ids: torch.Tensor | None,
    expert_ids: torch.Tensor,
    num_tokens_post_padded: torch.Tensor | None,
    token_lora_mapping: torch.Tensor,
    max_lora_rank: int,
    top_k_num: int,
    lora_ids: torch.Tensor,
    num_active_loras: int,
    adapter_enabled: torch.Tensor,
    shrink_block_size_m: int,
    shrink_block_size_n: int,
    shrink_block_size_k: int,
    shrink_group_size_m: int,
    shrink_num_warps: int,
    shrink_num_stages: int,
    shrink_split_k: int,
    expand_block_size_m: int,
    expand_block_size_n: int,
    expand_block_size_k: int,
    expand_group_size_m: int,
    expand_num_warps: int,
    expand_num_stages: int,
    expand_split_k: int,
    lora_a_scale_stacked: list[torch.Tensor] | None,
    lora_b_scale_stacked: list[torch.Tensor] | None,
    shrink_act_scale: torch.Tensor | None = None,
    expand_act_scale: torch.Tensor | None = None,
    mul_routed_weight: bool = False,
    fully_sharded: bool = False,
    offset: int = 0,
    use_fp8_w8a8: bool = False,
    use_int8_w8a8: bool = False,
    use_int8_w8a16: bool = False,
    per_channel_quant: bool = False,
    block_shape: list[int] | None = None,
) -> None:
    tiles = (shrink_block_size_m, shrink_block_size_n, shrink_block_size_k, shrink_group_size_m, shrink_num_warps,
             shrink_num_stages, shrink_split_k, expand_block_size_m, expand_block_size_n, expand_block_size_k,
             expand_group_size_m, expand_num_warps, expand_num_stages, expand_split_k)
    if use_int8_w8a8 or use_int8_w8a16:
        raise ValueError("the int8 modes of fused_moe_lora_fp8 are outside the suite (fp8 e4m3fn only)")
    if shrink_block_size_m != expand_block_size_m:
        raise ValueError(f"shrink and expand block sizes differ ({shrink_block_size_m}, {expand_block_size_m}): vLLM requires them equal")
    if not use_fp8_w8a8:
        if lora_a_scale_stacked is not None or lora_b_scale_stacked is not None or shrink_act_scale is not None or expand_act_scale is not None:
            raise ValueError("scales given without use_fp8_w8a8")
        fused_moe_lora(output, qcurr_hidden_states, lora_a_stacked, lora_b_stacked, topk_weights, sorted_token_ids, expert_ids,
                       num_tokens_post_padded, token_lora_mapping, max_lora_rank, top_k_num, lora_ids, num_active_loras,
                       adapter_enabled, *tiles, mul_routed_weight, fully_sharded, offset, add_inputs=True)
        return
    num_tokens, top_k = topk_weights.shape
    if top_k != top_k_num or output.shape[:2] != (num_tokens, top_k):
        raise ValueError(f"output {tuple(output.shape)} and topk_weights {tuple(topk_weights.shape)} disagree with top_k_num {top_k_num}")
    if not lora_a_stacked or not len(lora_a_stacked) == len(lora_b_stacked) == len(lora_a_scale_stacked) == len(lora_b_scale_stacked):
        raise ValueError(f"{len(lora_a_stacked)} LoRA-A and {len(lora_b_stacked)} LoRA-B stacks, "
                         f"{len(lora_a_scale_stacked)} and {len(lora_b_scale_stacked)} weight scales")
    rows = num_tokens * top_k if mul_routed_weight else num_tokens
    if qcurr_hidden_states.size(0) != rows:
        raise ValueError(f"the input has {qcurr_hidden_states.size(0)} rows; {'mul_routed_weight' if mul_routed_weight else 'w13'} needs {rows}")
    num_slots, width = lora_a_stacked[0].size(0), lora_b_stacked[0].size(2)
    if any(b.size(2) != width for b in lora_b_stacked) or offset < 0 or offset + width * len(lora_b_stacked) > output.size(-1):
        raise ValueError(f"slices of widths {[b.size(2) for b in lora_b_stacked]} from column {offset} do not fit {output.size(-1)} columns")
    if sorted_token_ids is None:
        slots, experts = naive_pairs(expert_ids, token_lora_mapping, adapter_enabled, num_slots, top_k)
    else:
        slots, experts = aligned_pairs(sorted_token_ids, expert_ids, num_tokens_post_padded, lora_ids, adapter_enabled,
                                       num_slots, shrink_block_size_m, num_tokens * top_k)

    group_n, group_k = block_shape if block_shape is not None else (0, 0)
    mode = granularity(group_k, group_n, per_channel_quant)
    scales = [shrink_act_scale, *([expand_act_scale] if expand_act_scale is not None else []), *lora_a_scale_stacked, *lora_b_scale_stacked]
    acc = accumulation_dtype(output, *scales)
    x = dequantized(qcurr_hidden_states, activation_scales(shrink_act_scale, mode, rows, qcurr_hidden_states.size(1), group_k), acc)
    num_pairs = num_tokens * top_k
    h_scales = (activation_scales(expand_act_scale, mode, num_pairs, max_lora_rank, group_k).to(acc)
                if expand_act_scale is not None else torch.ones(1, 1, dtype=acc)).expand(num_pairs, max_lora_rank)
    lora_a = [dequantized(a, expert_weight_scales(sa, mode, a, group_n, group_k), acc) for a, sa in zip(lora_a_stacked, lora_a_scale_stacked)]
    lora_b = [dequantized(b, expert_weight_scales(sb, mode, b, group_n, group_k), acc) for b, sb in zip(lora_b_stacked, lora_b_scale_stacked)]
    pair_weights = topk_weights.reshape(-1).to(acc) if mul_routed_weight else None
    out = output.view(num_pairs, -1)
    for slot, expert, pairs in pairs_per_slot_and_expert(slots, experts):
        inputs = x[pairs if mul_routed_weight else pairs // top_k]  # [pairs, K]
        for s, (a, b) in enumerate(zip(lora_a, lora_b)):
            shrunk = (inputs @ a[slot, expert].T).to(output.dtype)  # the intermediate: output dtype, not re-quantized
            h = shrunk.to(acc) * h_scales[pairs, : shrunk.size(1)]  # the expand's activation scale, if any
            delta = h @ b[slot, expert].T  # [pairs, N]
            if pair_weights is not None:
                delta = delta * pair_weights[pairs][:, None]
            out[pairs, offset + s * width : offset + (s + 1) * width] += delta.to(output.dtype)  # rounded, then added


def expert_weight_scales(scale: torch.Tensor, mode: str, stack: torch.Tensor, group_n: int, group_k: int) -> torch.Tensor:
    """The scale of every element of an ``[L, E, N, K]`` stack (broadcastable): ``_fp8.weight_scales`` with
    each (slot, expert) taken as one slot, since the kernel indexes the scale by both as it does the weight."""
    slots, experts, n, k = stack.shape
    if mode == "block":
        flat = scale.reshape(slots * experts, scale.size(-2), scale.size(-1))
    elif mode == "channel":
        flat = scale.reshape(slots * experts, n)  # [L, E, N] or [L, E, N, 1]
    else:
        flat = scale.reshape(slots * experts)
    spread = weight_scales(flat, mode, stack.reshape(slots * experts, n, k), group_n, group_k)
    return spread.reshape(slots, experts, *spread.shape[1:])
