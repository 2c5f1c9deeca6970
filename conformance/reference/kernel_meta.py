"""The token-sorted metadata of ``lora_shrink`` / ``lora_expand`` (vLLM's ``LoRAKernelMeta``).

From one slot per token ``m`` (−1 = no adapter) it derives:

* ``token_lora_mapping``               = m
* ``token_indices_sorted_by_lora_ids`` = stable argsort of m: tokens grouped by slot, in token order
* ``active_lora_ids``                  = the distinct slots of m in increasing order, then −1 padding
* ``num_tokens_per_lora``              = how many tokens use each active slot, then 0 padding
* ``lora_token_start_loc``             = exclusive cumulative sum of those counts (``[0] = 0``)
* ``no_lora_flag_cpu``                 = True when every token has slot −1 (kernels then write nothing)

Invariant the kernels rely on: ``sorted[start[i] : start[i] + count[i]]`` is exactly the tokens whose
slot is ``active_lora_ids[i]``. Example: ids ``[-1, 0, 1, 2]``, counts ``[3, 10, 5, 2]`` give starts
``[0, 3, 13, 18, 20]``. The increasing order matters: vLLM bug #15979 came from ``unique(sorted=False)``.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch


@dataclass(frozen=True)
class LoRAKernelMeta:
    token_lora_mapping: torch.Tensor  # int32 [T]
    token_indices_sorted_by_lora_ids: torch.Tensor  # int32 [T]
    num_tokens_per_lora: torch.Tensor  # int32 [max_loras + 1]
    lora_token_start_loc: torch.Tensor  # int32 [max_loras + 2]
    active_lora_ids: torch.Tensor  # int32 [max_loras + 1]
    no_lora_flag_cpu: torch.Tensor  # bool [1], on the CPU

    @classmethod
    def build(cls, token_slots: torch.Tensor, max_loras: int) -> LoRAKernelMeta:
        slots = token_slots.reshape(-1).to(torch.int32)
        if slots.numel() and (int(slots.min()) < -1 or int(slots.max()) >= max_loras):
            raise ValueError(f"token slots must lie in [-1, {max_loras - 1}], got {slots.tolist()}")
        active_ids = torch.full((max_loras + 1,), -1, dtype=torch.int32)
        counts = torch.zeros(max_loras + 1, dtype=torch.int32)
        starts = torch.zeros(max_loras + 2, dtype=torch.int32)
        ids, id_counts = torch.unique(slots, sorted=True, return_counts=True)
        active_ids[: ids.numel()] = ids
        counts[: ids.numel()] = id_counts.to(torch.int32)
        starts[1 : ids.numel() + 1] = torch.cumsum(id_counts, 0).to(torch.int32)
        return cls(
            token_lora_mapping=slots,
            token_indices_sorted_by_lora_ids=torch.sort(slots, stable=True).indices.to(torch.int32),
            num_tokens_per_lora=counts,
            lora_token_start_loc=starts,
            active_lora_ids=active_ids,
            no_lora_flag_cpu=torch.tensor([bool((slots == -1).all())], dtype=torch.bool),
        )

    def to(self, device: torch.device | str) -> LoRAKernelMeta:
        """The same metadata with every tensor but the CPU flag on ``device``."""
        return LoRAKernelMeta(*(t.to(device) for t in self.meta_args()[:-1]), self.no_lora_flag_cpu)

    def meta_args(self) -> tuple[torch.Tensor, ...]:
        """The six tensors in the order ``lora_shrink`` / ``lora_expand`` take them."""
        return (
            self.token_lora_mapping,
            self.token_indices_sorted_by_lora_ids,
            self.num_tokens_per_lora,
            self.lora_token_start_loc,
            self.active_lora_ids,
            self.no_lora_flag_cpu,
        )


def segments_of_active_loras(
    token_indices_sorted_by_lora_ids: torch.Tensor,
    num_tokens_per_lora: torch.Tensor,
    lora_token_start_loc: torch.Tensor,
    active_lora_ids: torch.Tensor,
):
    """Yield ``(slot, token_rows)`` for every active slot ≠ −1, read straight from the metadata."""
    for i, slot in enumerate(active_lora_ids.tolist()):
        if slot == -1:
            continue
        start, count = int(lora_token_start_loc[i]), int(num_tokens_per_lora[i])
        yield slot, token_indices_sorted_by_lora_ids[start : start + count].long()
