"""The LoRA math in NumPy, written functionally: every function returns a new output array and writes
none of its arguments.

Every dense kernel op reduces to one of two functions once it knows the adapter slot of each row
(``slot_of_row``, −1 = the row uses no adapter):

    shrink:  new[t, :R]         = out[t, :R] + scale · x[t] @ A[l]ᵀ                       (A: [L, R, H])
    expand:  new[t, off:off+N]  = (out[t, off:off+N] if add_inputs else 0)
                                  + round_w(round_w(x[t]) @ B[l]ᵀ)                         (B: [L, N, R])

for every row ``t`` whose slot ``l`` is not −1; every other element of ``new`` is ``out``'s, bit for bit
(rows of slot −1, columns outside ``[off, off+N)``). ``round_w`` rounds to the weight dtype. As a
kernel computes them:

* products are summed in float32 (the operands are widened to float32 first: NumPy's float16 matmul
  would not say how it accumulates);
* the shrink adds into the caller's float32 buffer, never overwrites it;
* the expand rounds its input to the weight dtype first (a float32 shrink buffer becomes float16, as
  vLLM's Triton kernels do with ``CAST_TYPE``), rounds the product to the weight dtype, then adds it to
  the output in float32 and rounds once to the output dtype.

The ``slots_from_*`` helpers turn each op family's metadata into ``slot_of_row``.
"""

from __future__ import annotations

from collections.abc import Iterator

import numpy as np

NO_ADAPTER = -1


def as_3d(stack: np.ndarray) -> np.ndarray:
    """A weight stack as ``[L, rows, cols]``; vLLM's layers pass ``[L, 1, rows, cols]``."""
    return stack[:, 0] if stack.ndim == 4 else stack


def rows_per_slot(slot_of_row: np.ndarray, num_slots: int) -> Iterator[tuple[int, np.ndarray]]:
    """``(slot, row indices)`` for each slot some row uses; slot −1 never."""
    for slot in np.unique(slot_of_row).tolist():
        if slot == NO_ADAPTER:
            continue
        if not 0 <= slot < num_slots:
            raise ValueError(f"slot {slot} outside the {num_slots} slots of the weight stack")
        yield slot, np.flatnonzero(slot_of_row == slot)


def shrink(x: np.ndarray, lora_a: np.ndarray, out: np.ndarray, slot_of_row: np.ndarray, scale: float) -> np.ndarray:
    """``out`` with ``scale · x[t] @ A[slot_t]ᵀ`` added into ``[t, :R]`` of every row with an adapter."""
    num_slots, rank, hidden = lora_a.shape
    if x.shape[-1] != hidden:
        raise ValueError(f"input has {x.shape[-1]} features, LoRA-A expects {hidden}")
    new = out.copy()
    for slot, rows in rows_per_slot(slot_of_row, num_slots):
        product = x[rows].astype(np.float32) @ lora_a[slot].astype(np.float32).T  # [rows, R], float32 sums
        new[rows, :rank] = (out[rows, :rank].astype(np.float32) + np.float32(scale) * product).astype(out.dtype)
    return new


def expand(
    x: np.ndarray, lora_b: np.ndarray, out: np.ndarray, slot_of_row: np.ndarray, offset: int, add_inputs: bool
) -> np.ndarray:
    """``out`` with ``round_w(round_w(x[t]) @ B[slot_t]ᵀ)`` added into (or, without ``add_inputs``, written over)
    columns ``[offset, offset + N)`` of every row with an adapter."""
    num_slots, width, rank = lora_b.shape
    if x.shape[-1] != rank:
        raise ValueError(f"input has rank {x.shape[-1]}, LoRA-B has rank {rank}")
    if offset < 0 or offset + width > out.shape[-1]:
        raise ValueError(f"columns [{offset}, {offset + width}) do not fit an output of width {out.shape[-1]}")
    columns = slice(offset, offset + width)
    new = out.copy()
    for slot, rows in rows_per_slot(slot_of_row, num_slots):
        rounded_input = x[rows].astype(lora_b.dtype)  # CAST_TYPE: a float32 buffer is rounded first
        delta = (rounded_input.astype(np.float32) @ lora_b[slot].astype(np.float32).T).astype(lora_b.dtype)
        if add_inputs:
            new[rows, columns] = (out[rows, columns].astype(np.float32) + delta.astype(np.float32)).astype(out.dtype)
        else:
            new[rows, columns] = delta.astype(out.dtype)
    return new


# -- one slot per row, from each family's metadata ----------------------------------------------


def slots_from_segments(starts: np.ndarray, lengths: np.ndarray, segment_slots: np.ndarray, rows: int) -> np.ndarray:
    """sgmv: segment ``b`` is rows ``[starts[b], starts[b] + lengths[b])`` with slot ``segment_slots[b]``; rows
    outside every segment have none."""
    slot_of_row = np.full(rows, NO_ADAPTER, dtype=np.int64)
    for start, length, slot in zip(starts.tolist(), lengths.tolist(), segment_slots.tolist(), strict=True):
        slot_of_row[start : start + length] = slot
    return slot_of_row


def slots_from_sorted_tokens(
    sorted_tokens: np.ndarray, tokens_per_id: np.ndarray, id_starts: np.ndarray, ids: np.ndarray, rows: int
) -> np.ndarray:
    """lora_*: the rows of ``ids[i]`` are ``sorted_tokens[id_starts[i] : id_starts[i] + tokens_per_id[i]]``
    (an id −1 is the rows without adapter)."""
    slot_of_row = np.full(rows, NO_ADAPTER, dtype=np.int64)
    for slot, start, count in zip(ids.tolist(), id_starts.tolist(), tokens_per_id.tolist()):
        if slot != NO_ADAPTER and count > 0:
            slot_of_row[sorted_tokens[start : start + count]] = slot
    return slot_of_row
