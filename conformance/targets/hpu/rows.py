"""The rows of one op call: one adapter slot per row, padded to a bucket, and the masks made from it.

Everything the HPU math needs to know about a batch is a vector of slots (−1 = no adapter), one per
row, living on the device. From it, with no Python loop over rows and no data-dependent shape:

* ``row_active`` ``[T]``: the row uses an adapter (slot ≠ −1);
* ``mask(L, R)`` ``[T, L·R]``: column ``j`` belongs to slot ``j // R``; a row keeps only its own slot's
  block: ``(arange(L·R) // R)[None] == slot[:, None]``. A row of slot −1 (no adapter, or padding)
  is all False. This is Gaudi's ``lora_mask`` (docs/gaudi-lora.md §3.1), built on the device
  from the slot vector instead of on the host, and handed to the math explicitly, not via a global;
* ``onehot(L)`` ``[T, L]``: the same at slot granularity (LoRA bias rows);
* ``gather_index`` ``[T]``: the slot clamped to ≥ 0 (the gather-based variant; −1 rows are masked out).

Masks are memoized per ``(L, R)``: built once per batch, reused by every layer (vLLM calls the wrapper
once per layer with the same mapping). The slot vector is int32 because Gaudi's int64 support is
limited (Gaudi best-practices page).

Where the slots come from differs per op family, so this module also turns vLLM's two kinds of
kernel metadata into one slot per row, again without looping over rows.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from .buckets import BucketPolicy

NO_ADAPTER = -1


class PaddedRows:
    """``count`` real rows plus padding up to ``padded`` rows, with one slot per row on the device."""

    def __init__(self, slots: torch.Tensor, count: int) -> None:
        if slots.ndim != 1 or slots.dtype != torch.int32:
            raise ValueError(f"slots must be a 1-D int32 tensor, got {tuple(slots.shape)} {slots.dtype}")
        self.slots = slots
        self.count = count
        self._memo: dict[tuple, torch.Tensor] = {}

    @classmethod
    def from_slots(cls, slots: torch.Tensor, buckets: BucketPolicy, device: torch.device) -> PaddedRows:
        """Pad a slot vector (any integer dtype, any device) with −1 up to its bucket, on ``device``."""
        slots = slots.reshape(-1)
        count = slots.numel()
        slots = slots.to(device=device, dtype=torch.int32)
        padding = buckets.bucket(count) - count
        if padding:
            slots = F.pad(slots, (0, padding), value=NO_ADAPTER)
        return cls(slots, count)

    @property
    def padded(self) -> int:
        return self.slots.numel()

    def _memoized(self, key: tuple, build) -> torch.Tensor:
        if key not in self._memo:
            self._memo[key] = build()
        return self._memo[key]

    @property
    def row_active(self) -> torch.Tensor:
        return self._memoized(("row_active",), lambda: self.slots >= 0)

    def mask(self, num_slots: int, rank: int) -> torch.Tensor:
        """``[T, L·R]`` bool: True in the columns of the row's own slot."""

        def build() -> torch.Tensor:
            column_slot = torch.arange(num_slots * rank, device=self.slots.device, dtype=torch.int32) // rank
            return column_slot[None, :] == self.slots[:, None]

        return self._memoized(("mask", num_slots, rank), build)

    def onehot(self, num_slots: int) -> torch.Tensor:
        """``[T, L]`` bool: True at the row's slot."""

        def build() -> torch.Tensor:
            return torch.arange(num_slots, device=self.slots.device, dtype=torch.int32)[None, :] == self.slots[:, None]

        return self._memoized(("onehot", num_slots), build)

    @property
    def gather_index(self) -> torch.Tensor:
        return self._memoized(("gather_index",), lambda: self.slots.clamp(min=0))


# -- slot vectors from vLLM's kernel metadata --------------------------------------------------


def slots_from_segments(
    b_seq_start_loc: torch.Tensor, seq_len_tensor: torch.Tensor, lora_indices_tensor: torch.Tensor, num_rows: int
) -> torch.Tensor:
    """sgmv metadata → one slot per row: segment ``b`` covers ``[start[b], start[b] + len[b])``.

    Built as a ``[T, B]`` membership matrix; segments are disjoint, so a row's slot is the sum of
    ``(slot + 1)`` over the segments holding it, minus one. Rows in no segment get −1 (never written).
    """
    rows = torch.arange(num_rows, device=b_seq_start_loc.device)[:, None]
    starts = b_seq_start_loc.reshape(1, -1).long()
    inside = (rows >= starts) & (rows < starts + seq_len_tensor.reshape(1, -1).long())
    return ((lora_indices_tensor.reshape(1, -1).long() + 1) * inside).sum(1) - 1


def slots_from_sorted_metadata(
    token_indices_sorted_by_lora_ids: torch.Tensor,
    num_tokens_per_lora: torch.Tensor,
    lora_token_start_loc: torch.Tensor,
    active_lora_ids: torch.Tensor,
    num_rows: int,
) -> torch.Tensor:
    """``lora_shrink`` / ``lora_expand`` metadata → one slot per row, read from the metadata as the kernels do.

    Position ``p`` of the sorted order lies in segment ``i`` when ``start[i] ≤ p < start[i] + count[i]``;
    its slot is ``active_lora_ids[i]`` and its row is ``sorted[p]``. Padding segments (id −1, count 0)
    hold nothing; rows the metadata does not list stay −1. ``token_lora_mapping`` is not read, exactly
    like the kernels.
    """
    device = token_indices_sorted_by_lora_ids.device
    positions = torch.arange(num_rows, device=device)[:, None]
    starts = lora_token_start_loc[:-1].reshape(1, -1).long()
    inside = (positions >= starts) & (positions < starts + num_tokens_per_lora.reshape(1, -1).long())
    slot_at_position = ((active_lora_ids.reshape(1, -1).long() + 1) * inside).sum(1) - 1
    slots = torch.full((num_rows,), NO_ADAPTER, dtype=torch.long, device=device)
    return slots.scatter(0, token_indices_sorted_by_lora_ids.reshape(-1)[:num_rows].long(), slot_at_position)
