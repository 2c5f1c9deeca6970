"""``moe_lora_align_block_size``: the (token, choice) pairs of each slot, sorted by expert, in blocks.

vLLM's CUDA op (``_moe_C``) prepares ``fused_moe_lora``'s metadata. For every active slot ``l`` (in
``lora_ids``, with ``adapter_enabled[l]`` set) it writes, in row ``l`` of its three flat outputs:

* ``sorted_token_ids[l·P : (l+1)·P]``: the pairs ``p = t·top_k + k`` of tokens with slot ``l`` whose
  expert is local, grouped by local expert, each group padded with ids ``≥ T·top_k`` to a multiple of
  ``block_size`` (``P = max_num_tokens_padded``);
* ``experts_ids[l·B + b]``: the local expert of block ``b`` (−1 for blocks it does not use);
* ``num_tokens_post_pad[l]``: how many entries of the slot's row are meaningful (a multiple of
  ``block_size``).

``topk_ids`` hold global experts; ``expert_map[g]`` is the local expert of global expert ``g`` or −1
(expert parallelism; ``num_experts`` is then the global count). Many outputs are correct (the order of
blocks and of pairs inside a group is free), so the op is judged by the invariants of
:func:`alignment_problems`; :func:`moe_lora_align_block_size` writes one correct output (experts in
increasing order, pairs in increasing order, padding ``T·top_k``).
"""

from __future__ import annotations

import torch

from ._routing import NOT_LOCAL, local_experts, pair_slots


def moe_lora_align_block_size(
    topk_ids: torch.Tensor,
    token_lora_mapping: torch.Tensor,
    num_experts: int,
    block_size: int,
    max_loras: int,
    max_num_tokens_padded: int,
    max_num_m_blocks: int,
    sorted_token_ids: torch.Tensor,
    experts_ids: torch.Tensor,
    num_tokens_post_pad: torch.Tensor,
    adapter_enabled: torch.Tensor,
    lora_ids: torch.Tensor,
    expert_map: torch.Tensor | None = None,
) -> None:
    sorted_rows = sorted_token_ids.view(max_loras, max_num_tokens_padded)
    expert_rows = experts_ids.view(max_loras, max_num_m_blocks)
    num_pairs = topk_ids.numel()
    slots = pair_slots(token_lora_mapping, topk_ids.size(-1))
    experts = local_experts(topk_ids, expert_map)
    for slot in lora_ids.reshape(-1).tolist():
        if not 0 <= slot < max_loras or int(adapter_enabled[slot]) == 0:
            continue
        ids: list[int] = []
        blocks: list[int] = []
        for expert in range(num_experts):
            pairs = torch.nonzero((slots == slot) & (experts == expert)).flatten().tolist()
            if not pairs:
                continue
            padded = -(-len(pairs) // block_size) * block_size
            ids += pairs + [num_pairs] * (padded - len(pairs))
            blocks += [expert] * (padded // block_size)
        if len(ids) > max_num_tokens_padded or len(blocks) > max_num_m_blocks:
            raise ValueError(f"slot {slot}: {len(ids)} aligned ids do not fit max_num_tokens_padded {max_num_tokens_padded}")
        sorted_rows[slot] = num_pairs
        sorted_rows[slot, : len(ids)] = torch.tensor(ids, dtype=sorted_rows.dtype)
        expert_rows[slot] = NOT_LOCAL
        expert_rows[slot, : len(blocks)] = torch.tensor(blocks, dtype=expert_rows.dtype)
        num_tokens_post_pad[slot] = len(ids)


def alignment_problems(
    topk_ids: torch.Tensor,
    token_lora_mapping: torch.Tensor,
    adapter_enabled: torch.Tensor,
    expert_map: torch.Tensor | None,
    block_size: int,
    sorted_token_ids: torch.Tensor,
    experts_ids: torch.Tensor,
    num_tokens_post_pad: torch.Tensor,
) -> list[tuple[int, str]]:
    """``(slot, what is wrong)`` for every invariant an output breaks; empty when it is correct.

    For every slot ``l`` some token uses and whose ``adapter_enabled[l]`` is set:

    1. ``num_tokens_post_pad[l]`` is a multiple of ``block_size`` that fits the slot's row;
    2. every pair of slot ``l`` with a local expert ``e`` appears exactly once among its first
       ``num_tokens_post_pad[l]`` entries, in a block whose expert is ``e``;
    3. every other entry there is padding: an id ≥ ``T·top_k``, which the kernel masks;
    4. the blocks after those are unused: expert −1, so the kernel skips them.

    Slots no token uses and disabled slots are never read by ``fused_moe_lora``: not constrained.
    """
    max_loras = num_tokens_post_pad.numel()
    sorted_rows = sorted_token_ids.reshape(max_loras, -1).long()
    expert_rows = experts_ids.reshape(max_loras, -1).long()
    num_pairs = topk_ids.numel()
    slots = pair_slots(token_lora_mapping, topk_ids.size(-1))
    experts = local_experts(topk_ids, expert_map)
    problems: list[tuple[int, str]] = []
    for slot in sorted({s for s in token_lora_mapping.reshape(-1).tolist() if 0 <= s < max_loras}):
        if int(adapter_enabled[slot]) == 0:
            continue
        padded = int(num_tokens_post_pad[slot])
        if padded % block_size or not 0 <= padded <= sorted_rows.size(1) or padded // block_size > expert_rows.size(1):
            problems.append((slot, f"num_tokens_post_pad {padded} is not a multiple of the block size {block_size} within the buffer"))
            continue
        entries = sorted_rows[slot, :padded]
        block_expert = expert_rows[slot, : padded // block_size].repeat_interleave(block_size)
        expected = torch.nonzero((slots == slot) & (experts != NOT_LOCAL)).flatten()
        real = entries[(entries >= 0) & (entries < num_pairs)]
        counts = torch.bincount(real, minlength=num_pairs)
        missing = [p for p in expected.tolist() if counts[p] == 0]
        repeated = [p for p in expected.tolist() if counts[p] > 1]
        strangers = sorted(set(real.tolist()) - set(expected.tolist()))
        mine = set(expected.tolist())
        wrong_expert = [p for p, e in zip(entries.tolist(), block_expert.tolist()) if p in mine and e != int(experts[p])]
        negative = int((entries < 0).sum())
        unused = expert_rows[slot, padded // block_size :]
        for pairs, what in (
            (missing, "pair(s) missing"),
            (repeated, "pair(s) listed more than once"),
            (strangers, "pair(s) that are not this slot's local pairs (another slot's, no adapter's, or a non-local expert's)"),
            (wrong_expert, "pair(s) in a block of another expert"),
        ):
            if pairs:
                shown = ", ".join(map(str, pairs[:8])) + (", …" if len(pairs) > 8 else "")
                problems.append((slot, f"{len(pairs)} {what}: {shown}"))
        if negative:
            problems.append((slot, f"{negative} negative id(s) among the first {padded} entries (padding must be ≥ {num_pairs})"))
        if bool((unused != NOT_LOCAL).any()):
            problems.append((slot, f"{int((unused != NOT_LOCAL).sum())} block(s) after num_tokens_post_pad have an expert instead of -1"))
    return problems
