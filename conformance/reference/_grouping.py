"""Grouping rows by adapter slot: the one idea that makes the reference both obvious and fast.

Every LoRA op computes, for each row ``t`` whose slot ``l`` is not −1, a product with adapter ``l``'s
matrix. Rather than gathering a weight matrix per row (vLLM's torch ops do, which costs ``T·N·R``
memory and is 40–120× slower), the reference gathers the rows of each adapter and does one matrix
product per adapter present in the batch.
"""

from __future__ import annotations

from collections.abc import Iterator

import torch

NO_ADAPTER = -1
"""The slot of a row that uses no adapter. Such rows are never written."""


def rows_per_adapter(slot_per_row: torch.Tensor) -> Iterator[tuple[int, torch.Tensor]]:
    """Yield ``(slot, row_indices)`` for every slot present, in increasing slot order, skipping −1."""
    slot_per_row = slot_per_row.reshape(-1).long()
    for slot in torch.unique(slot_per_row).tolist():
        if slot == NO_ADAPTER:
            continue
        yield slot, torch.nonzero(slot_per_row == slot).flatten()


def slot_per_row_from_segments(
    b_seq_start_loc: torch.Tensor,
    seq_len_tensor: torch.Tensor,
    lora_indices_tensor: torch.Tensor,
    num_rows: int,
) -> torch.Tensor:
    """Expand per-segment slots (sgmv metadata) to one slot per row.

    Segment ``b`` covers rows ``[b_seq_start_loc[b], b_seq_start_loc[b] + seq_len_tensor[b])`` and uses
    slot ``lora_indices_tensor[b]``. Rows outside every segment get −1: they are not written.
    """
    slots = torch.full((num_rows,), NO_ADAPTER, dtype=torch.long)
    for start, length, slot in zip(
        b_seq_start_loc.tolist(), seq_len_tensor.tolist(), lora_indices_tensor.tolist(), strict=True
    ):
        slots[start : start + length] = slot
    return slots
