"""``fused_moe_lora``: the LoRA deltas of a fused-MoE layer, for every (token, choice) pair (vLLM ≥ 0.11).

For the pair ``p = t·top_k + k`` of a token with slot ``l`` routed to local expert ``e``, slice ``s``
(every slice has width ``N``)::

    output[t, k, offset + s·N : offset + (s+1)·N]  (+)=  w_p · round((x[row] @ A_s[l, e]ᵀ)) @ B_s[l, e]ᵀ

* ``mul_routed_weight``: ``x`` holds one row per pair (``row = p``, the w2 input) and ``w_p =
  topk_weights[t, k]``; otherwise one row per token (``row = t``, the w13 input) and ``w_p = 1``;
* which pairs each (slot, expert) serves is read from the metadata, as the kernel reads it: with
  ``sorted_token_ids`` (block-aligned, ``moe_lora_align_block_size``), for every active slot ``l`` of
  ``lora_ids`` whose ``adapter_enabled[l]`` is set, the blocks ``b < ⌈num_tokens_post_padded[l] /
  block⌉`` with ``expert_ids[l, b] ≠ −1``, their entries below ``T·top_k``; without it (the naive
  form), every pair with ``expert_ids[p]`` its expert and ``token_lora_mapping[t]`` its slot;
* rounding: products accumulate in float32 (float64 for the oracle), the shrink intermediate is
  rounded to the output dtype (vLLM's kernel keeps it in ``output.dtype``), the weighted delta is
  rounded to the output dtype and then added (``add_inputs``) or stored;
* nothing else is written: pairs of slot −1, of a disabled slot, of expert −1 stay bit-identical.

The Triton tile parameters (``shrink_block_size_m`` … ``expand_split_k``) do not change the result,
except that ``shrink_block_size_m`` is the block size the sorted ids were aligned to. ``fully_sharded``
means this rank's shard: the collective between shrink and expand is the caller's (identity at one rank).
"""

from __future__ import annotations

import torch

from ._grouping import NO_ADAPTER
from ._routing import NOT_LOCAL, enabled_slots, pair_slots, pairs_per_slot_and_expert
from ._stacks import accumulation_dtype


def fused_moe_lora(
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
    num_active_loras: torch.Tensor,
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
    mul_routed_weight: bool = False,
    fully_sharded: bool = False,
    offset: int = 0,
    add_inputs: bool = True,
) -> None:
    num_tokens, top_k = topk_weights.shape
    if top_k != top_k_num or output.shape[:2] != (num_tokens, top_k):
        raise ValueError(f"output {tuple(output.shape)} and topk_weights {tuple(topk_weights.shape)} disagree with top_k_num {top_k_num}")
    if len(lora_a_stacked) != len(lora_b_stacked) or not lora_a_stacked:
        raise ValueError(f"{len(lora_a_stacked)} LoRA-A stacks but {len(lora_b_stacked)} LoRA-B stacks")
    num_slots = lora_a_stacked[0].size(0)
    rows = num_tokens * top_k if mul_routed_weight else num_tokens
    if qcurr_hidden_states.size(0) != rows:
        raise ValueError(f"the input has {qcurr_hidden_states.size(0)} rows; {'mul_routed_weight' if mul_routed_weight else 'w13'} needs {rows}")
    if sorted_token_ids is None:
        slots, experts = naive_pairs(expert_ids, token_lora_mapping, adapter_enabled, num_slots, top_k)
    else:
        slots, experts = aligned_pairs(sorted_token_ids, expert_ids, num_tokens_post_padded, lora_ids, adapter_enabled,
                                        num_slots, shrink_block_size_m, num_tokens * top_k)
    weights = topk_weights.reshape(-1) if mul_routed_weight else None
    moe_lora_into(output.view(num_tokens * top_k, -1), qcurr_hidden_states, lora_a_stacked, lora_b_stacked, slots, experts,
                  top_k if not mul_routed_weight else 1, weights, offset, add_inputs)


def moe_lora_into(
    output: torch.Tensor,
    x: torch.Tensor,
    lora_a_stacked,
    lora_b_stacked,
    slots: torch.Tensor,
    experts: torch.Tensor,
    pairs_per_row: int,
    weights: torch.Tensor | None,
    offset: int,
    add_inputs: bool,
) -> None:
    """The math of every MoE op: ``output`` is ``[T·top_k, W]``, one slot and local expert per pair.

    ``pairs_per_row``: ``top_k`` when ``x`` has one row per token (pair ``p`` reads row ``p // top_k``),
    1 when it has one row per pair. A stack of expert dim 1 is shared by every expert.
    """
    acc = accumulation_dtype(output, x, *lora_a_stacked, *lora_b_stacked)
    width = lora_b_stacked[0].size(2)
    if any(b.size(2) != width for b in lora_b_stacked):
        raise ValueError(f"MoE slices have equal widths, got {[b.size(2) for b in lora_b_stacked]}")
    if offset < 0 or offset + width * len(lora_b_stacked) > output.size(-1):
        raise ValueError(f"slices [{offset}, {offset + width * len(lora_b_stacked)}) do not fit an output of width {output.size(-1)}")
    for slot, expert, pairs in pairs_per_slot_and_expert(slots, experts):
        inputs = x[pairs // pairs_per_row].to(acc)  # [pairs, K]
        for s, (lora_a, lora_b) in enumerate(zip(lora_a_stacked, lora_b_stacked, strict=True)):
            a = lora_a[slot, expert if lora_a.size(1) > 1 else 0]  # [R, K]
            b = lora_b[slot, expert if lora_b.size(1) > 1 else 0]  # [N, R]
            shrunk = (inputs @ a.to(acc).T).to(output.dtype)  # the intermediate, in the output dtype
            delta = shrunk.to(acc) @ b.to(acc).T
            if weights is not None:
                delta = delta * weights[pairs].to(acc)[:, None]
            delta = delta.to(output.dtype)
            columns = slice(offset + s * width, offset + (s + 1) * width)
            if add_inputs:
                output[pairs, columns] += delta  # summed in the promoted dtype, rounded once
            else:
                output[pairs, columns] = delta


def naive_pairs(expert_ids, token_lora_mapping, adapter_enabled, num_slots: int, top_k: int):
    """Naive block assignment: pair ``p``'s expert is ``expert_ids[p]``, its slot its token's."""
    slots = enabled_slots(pair_slots(token_lora_mapping, top_k), adapter_enabled, num_slots)
    return slots, expert_ids.reshape(-1).long()


def aligned_pairs(sorted_token_ids, expert_ids, num_tokens_post_padded, lora_ids, adapter_enabled,
                   num_slots: int, block: int, num_pairs: int):
    """The slot and expert of every pair, read from the block-aligned metadata as the kernel walks it."""
    slots = torch.full((num_pairs,), NO_ADAPTER, dtype=torch.long)
    experts = torch.full((num_pairs,), NOT_LOCAL, dtype=torch.long)
    sorted_ids = sorted_token_ids.reshape(sorted_token_ids.size(0), -1).long().cpu()
    block_experts = expert_ids.reshape(expert_ids.size(0), -1).long().cpu()
    for slot in lora_ids.reshape(-1).tolist():
        if not 0 <= slot < num_slots or int(adapter_enabled[slot]) == 0:
            continue
        padded = int(num_tokens_post_padded[slot])
        for b in range(-(-padded // block)):
            expert = int(block_experts[slot, b]) if b < block_experts.size(1) else NOT_LOCAL
            if expert == NOT_LOCAL:
                continue
            pairs = sorted_ids[slot, b * block : (b + 1) * block]
            pairs = pairs[(pairs >= 0) & (pairs < num_pairs)]
            slots[pairs], experts[pairs] = slot, expert
    return slots.to(sorted_token_ids.device), experts.to(sorted_token_ids.device)
