"""Routing for the MoE ops: which (token, choice) pairs each (adapter slot, expert) serves.

A fused-MoE LoRA op computes, for every pair ``p = t·top_k + k`` of a token with slot ``l`` routed to
local expert ``e``, a product with adapter ``l``'s matrices for expert ``e``. As for the dense ops
(``_grouping``), the reference does not gather a weight per pair: it gathers the pairs of each
(slot, expert) group and does one matrix product per group present in the batch.
"""

from __future__ import annotations

from collections.abc import Iterator

import torch

from ._grouping import NO_ADAPTER

NOT_LOCAL = -1
"""The expert of a choice whose expert lives on another rank (``expert_map`` says −1): never served."""


def local_experts(topk_ids: torch.Tensor, expert_map: torch.Tensor | None) -> torch.Tensor:
    """The local expert of every pair ``[T·top_k]``: ``expert_map[topk_ids]`` (−1: not local), or ``topk_ids``."""
    experts = topk_ids.reshape(-1).long()
    return experts if expert_map is None else expert_map.long()[experts]


def pair_slots(token_slots: torch.Tensor, top_k: int) -> torch.Tensor:
    """The slot of every pair ``t·top_k + k``: its token's slot."""
    return token_slots.reshape(-1).long().repeat_interleave(top_k)


def enabled_slots(slots: torch.Tensor, adapter_enabled: torch.Tensor, num_slots: int) -> torch.Tensor:
    """``slots`` with −1 where the slot has no adapter, lies outside the stacks, or is disabled."""
    valid = (slots >= 0) & (slots < num_slots)
    enabled = adapter_enabled.long()[slots.clamp(0, num_slots - 1)] != 0
    return torch.where(valid & enabled, slots, NO_ADAPTER)


def pairs_per_slot_and_expert(slots: torch.Tensor, experts: torch.Tensor) -> Iterator[tuple[int, int, torch.Tensor]]:
    """Yield ``(slot, expert, pair_indices)`` for every group present, skipping slot −1 and expert −1."""
    served = (slots != NO_ADAPTER) & (experts != NOT_LOCAL)
    keys = torch.stack((slots[served], experts[served]), dim=1)
    indices = torch.nonzero(served).flatten()
    for slot, expert in torch.unique(keys, dim=0).tolist():
        yield slot, expert, indices[(keys[:, 0] == slot) & (keys[:, 1] == expert)]
