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

    def only_enabled(self, enabled: torch.Tensor) -> PaddedRows:
        """The same rows with those whose slot is disabled (``enabled[slot]`` false) turned into −1 rows.

        Decided by the one-hot mask, not by indexing ``enabled`` with the slots: no index op, and the
        shapes stay those of the bucket (``apply_lora_full_linear``'s ``module_enabled``).
        """
        enabled = enabled.reshape(-1).to(device=self.slots.device, dtype=torch.bool)
        keep = (self.onehot(enabled.numel()) & enabled[None, :]).any(1)
        return PaddedRows(torch.where(keep, self.slots, torch.full_like(self.slots, NO_ADAPTER)), self.count)


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


# -- (token, choice) pairs of the fused-MoE ops ------------------------------------------------


class RoutedPairs:
    """The rows of an MoE call: one per (token, choice) pair ``p = t·top_k + k``, padded per token bucket.

    Each pair has a slot (−1: no adapter, a disabled adapter, or padding) and a local expert (−1: on
    another rank). The MoE LoRA of a pair is the dense LoRA of the *virtual slot* ``slot·E + expert``
    of stacks seen as ``[L·E, rows, cols]`` (``stacks.experts_as_slots``), so the dense mask and gather
    math serve it unchanged: every shape depends on the bucket, ``top_k``, ``L``, ``E`` and ``R`` only,
    never on the routing. A shared stack (one matrix per adapter) uses virtual slot ``slot``.
    """

    def __init__(self, slots: torch.Tensor, experts: torch.Tensor, count: int) -> None:
        self.served = (slots >= 0) & (experts >= 0)
        self.slots = slots
        self.experts = experts
        self.count = count
        self._rows: dict[int, PaddedRows] = {}

    @property
    def padded(self) -> int:
        return self.slots.numel()

    @classmethod
    def padded_to(cls, slots: torch.Tensor, experts: torch.Tensor, count: int, padded: int) -> RoutedPairs:
        """Pairs from one slot and expert per real pair, padded with −1 up to ``padded`` pairs."""
        extra = padded - count
        return cls(F.pad(slots.long(), (0, extra), value=NO_ADAPTER), F.pad(experts.long(), (0, extra), value=NO_ADAPTER), count)

    @classmethod
    def from_routing(
        cls, token_rows: PaddedRows, topk_ids: torch.Tensor, expert_map: torch.Tensor | None, adapter_enabled: torch.Tensor, num_slots: int
    ) -> RoutedPairs:
        """The wrapper's pairs: token slots from the mapping, experts from ``topk_ids`` through ``expert_map``."""
        device = token_rows.slots.device
        top_k = topk_ids.size(1)
        ids = F.pad(topk_ids.to(device).long(), (0, 0, 0, token_rows.padded - topk_ids.size(0)))
        experts = expert_map.to(device).long()[ids] if expert_map is not None else ids
        slots = enabled_slots(token_rows.slots.long().repeat_interleave(top_k), adapter_enabled.to(device), num_slots)
        return cls(slots, experts.reshape(-1), token_rows.count * top_k)

    def rows(self, experts_per_slot: int) -> PaddedRows:
        """The pairs' row state over virtual slots ``slot·E + expert`` (``E = 1``: a shared stack)."""
        if experts_per_slot not in self._rows:
            expert = self.experts if experts_per_slot > 1 else torch.zeros_like(self.experts)
            virtual = torch.where(self.served, self.slots * experts_per_slot + expert, NO_ADAPTER)
            self._rows[experts_per_slot] = PaddedRows(virtual.to(torch.int32), self.count)
        return self._rows[experts_per_slot]


def enabled_slots(slots: torch.Tensor, adapter_enabled: torch.Tensor, num_slots: int) -> torch.Tensor:
    """``slots`` with −1 where a slot is outside the stacks or its ``adapter_enabled`` entry is 0."""
    enabled = adapter_enabled.long()[slots.clamp(0, num_slots - 1)] != 0
    return torch.where((slots >= 0) & (slots < num_slots) & enabled, slots, NO_ADAPTER)


def pairs_from_aligned_metadata(
    sorted_token_ids: torch.Tensor,
    expert_ids: torch.Tensor,
    num_tokens_post_padded: torch.Tensor,
    lora_ids: torch.Tensor,
    adapter_enabled: torch.Tensor,
    block_size: int,
    num_pairs: int,
) -> tuple[torch.Tensor, torch.Tensor]:
    """``fused_moe_lora``'s block-aligned metadata → the slot and expert of every pair, read as the kernel reads it.

    Entry ``j`` of slot ``l``'s row counts when ``l`` is in ``lora_ids`` and enabled, ``j <
    num_tokens_post_padded[l]``, its block's expert is not −1 and the id is a real pair; those are
    scattered to their pair (the others into one dump entry, dropped). No loop, no data-dependent shape.
    """
    device = sorted_token_ids.device
    num_slots, width = sorted_token_ids.shape
    position = torch.arange(width, device=device)
    slot_index = torch.arange(num_slots, device=device)
    active = (slot_index[:, None] == lora_ids.reshape(1, -1).long()).any(1) & (adapter_enabled[:num_slots].long() != 0)
    block_expert = expert_ids.long()[:, (position // block_size).clamp(max=expert_ids.size(1) - 1)]
    ids = sorted_token_ids.long()
    valid = (
        active[:, None] & (position[None, :] < num_tokens_post_padded.long()[:, None]) & (block_expert >= 0) & (ids >= 0) & (ids < num_pairs)
    )
    where = torch.where(valid, ids, num_pairs).reshape(-1)
    slots = torch.full((num_pairs + 1,), NO_ADAPTER, dtype=torch.long, device=device)
    experts = torch.full((num_pairs + 1,), NO_ADAPTER, dtype=torch.long, device=device)
    slots = slots.scatter(0, where, torch.where(valid, slot_index[:, None].expand(-1, width), NO_ADAPTER).reshape(-1))
    experts = experts.scatter(0, where, torch.where(valid, block_expert, NO_ADAPTER).reshape(-1))
    return slots[:num_pairs], experts[:num_pairs]
