"""``moe_lora_align_block_size`` without a loop over tokens: the pairs of each slot sorted into expert blocks.

For slot ``l`` (a loop over the ``L`` slots: static, never over tokens or pairs), with ``P = T·top_k``
pairs, ``E`` experts and block size ``b``:

* ``key[p]`` = the pair's local expert where it belongs to slot ``l``, else ``E`` (a "no expert" bin);
* ``onehot [P, E+1]`` of the keys; its column sums are the per-expert counts ``c_e``, its running sums
  (minus one) each pair's rank inside its expert;
* expert ``e`` owns ``⌈c_e / b⌉`` blocks starting at block ``Σ_{j<e} ⌈c_j / b⌉``; a pair lands at
  ``start_e · b + rank``; every other position of the row is padding ``P``;
* block ``k`` belongs to the expert whose block range holds it (a ``[B, E]`` membership matrix), −1
  past the last used block.

Every shape is ``P``, ``E``, ``L`` or the buffer sizes: the same graph for every routing. Pairs of
slot ``l`` are written with one ``scatter`` (distinct positions by construction); the others go to one
dump position past the row, dropped.
"""

from __future__ import annotations

import torch

from .rows import NO_ADAPTER, enabled_slots


def align_block_size(
    topk_ids: torch.Tensor,
    token_lora_mapping: torch.Tensor,
    num_experts: int,
    block_size: int,
    max_loras: int,
    max_num_tokens_padded: int,
    max_num_m_blocks: int,
    adapter_enabled: torch.Tensor,
    lora_ids: torch.Tensor,
    expert_map: torch.Tensor | None,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """``(sorted_token_ids [L, P_max], expert_ids [L, B_max], num_tokens_post_pad [L], slot_written [L])``.

    ``slot_written[l]``: whether slot ``l`` is active (in ``lora_ids``) and enabled; only those rows are
    the op's to write (vLLM's kernel writes nothing else).
    """
    device = topk_ids.device
    top_k = topk_ids.size(-1)
    num_pairs = topk_ids.numel()
    ids = topk_ids.reshape(-1).long()
    experts = expert_map.long()[ids] if expert_map is not None else ids
    local_count = num_experts  # the global count: local ids are below it, and the shapes stay static
    pair_slot = enabled_slots(token_lora_mapping.long().repeat_interleave(top_k), adapter_enabled, max_loras)
    slot_index = torch.arange(max_loras, device=device)
    active = (slot_index[:, None] == lora_ids.reshape(1, -1).long()).any(1) & (adapter_enabled[:max_loras].long() != 0)

    sorted_rows = torch.full((max_loras, max_num_tokens_padded + 1), num_pairs, dtype=torch.int32, device=device)
    expert_rows = torch.full((max_loras, max_num_m_blocks), NO_ADAPTER, dtype=torch.int32, device=device)
    padded_counts = torch.zeros(max_loras, dtype=torch.int32, device=device)
    bins = torch.arange(local_count + 1, device=device)
    block_index = torch.arange(max_num_m_blocks, device=device)
    for slot in range(max_loras):
        mine = (pair_slot == slot) & (experts >= 0)
        key = torch.where(mine, experts, local_count)
        onehot = (key[:, None] == bins[None, :]).long()  # [P, E + 1]
        counts = onehot[:, :local_count].sum(0)
        blocks = (counts + block_size - 1) // block_size
        first_block = torch.cumsum(blocks, 0) - blocks
        rank = (torch.cumsum(onehot, 0) - 1).gather(1, key[:, None]).squeeze(1)
        position = first_block[key.clamp(max=local_count - 1)] * block_size + rank
        position = torch.where(mine, position, max_num_tokens_padded)  # the dump position
        row = torch.full((max_num_tokens_padded + 1,), num_pairs, dtype=torch.int32, device=device)
        row = row.scatter(0, position, torch.arange(num_pairs, device=device, dtype=torch.int32))
        row[max_num_tokens_padded] = num_pairs
        owner = (block_index[:, None] >= first_block[None, :]) & (block_index[:, None] < (first_block + blocks)[None, :])
        block_expert = torch.where(owner.any(1), owner.long().argmax(1), NO_ADAPTER).to(torch.int32)
        sorted_rows[slot] = torch.where(active[slot], row, sorted_rows[slot])
        expert_rows[slot] = torch.where(active[slot], block_expert, expert_rows[slot])
        padded_counts[slot] = blocks.sum() * block_size
    return sorted_rows[:, :max_num_tokens_padded], expert_rows, padded_counts, active
