"""The LoRA math, written for reading rather than speed.

Every kernel op reduces to one of two loops once it knows the adapter slot of each row
(``slot_of_row``, int64, −1 = the row uses no adapter):

    shrink:  out[t, :R]        += scale · x[t] @ A[l]ᵀ                       (A: [L, R, H])
    expand:  out[t, off:off+N]  = (out[t, off:off+N] if add_inputs else 0)
                                  + round_w(round_w(x[t]) @ B[l]ᵀ)           (B: [L, N, R])

for every row ``t`` whose slot ``l`` is not −1; ``round_w`` rounds to the weight dtype. The rules:

* products are summed in float32, whatever the storage dtype;
* the shrink adds into the caller's (zeroed, float32) buffer;
* the expand first rounds its input to the weight dtype (a float32 shrink buffer becomes bf16/fp16,
  as vLLM's Triton kernels do with ``CAST_TYPE``), and rounds the product to the weight dtype
  before adding it to the output;
* rows of slot −1 are never written, not even with ``add_inputs=False``; nor are columns outside
  ``[off, off+N)``.

The three ``slots_from_*`` helpers turn each op family's metadata into ``slot_of_row``.
"""

from __future__ import annotations

import torch

NO_ADAPTER = -1


def as_3d(stack: torch.Tensor) -> torch.Tensor:
    """A weight stack as ``[L, rows, cols]``; vLLM's layers pass ``[L, 1, rows, cols]``."""
    if stack.ndim == 4:
        return stack[:, 0]
    return stack


def rows_using(slot_of_row: torch.Tensor, num_slots: int):
    """Yield ``(slot, row indices)`` for each slot some row uses, slot −1 never."""
    for slot in range(num_slots):
        rows = torch.nonzero(slot_of_row == slot, as_tuple=True)[0]
        if rows.numel() > 0:
            yield slot, rows


def shrink(x: torch.Tensor, lora_a: torch.Tensor, out: torch.Tensor, slot_of_row: torch.Tensor, scale: float) -> None:
    """``out[t, :R] += scale · x[t] @ A[slot_t]ᵀ``, summed in float32."""
    num_slots, rank, hidden = lora_a.shape
    if x.size(-1) != hidden:
        raise ValueError(f"input has {x.size(-1)} features, LoRA-A expects {hidden}")
    for slot, rows in rows_using(slot_of_row, num_slots):
        product = x[rows].float() @ lora_a[slot].float().T  # [rows, R], float32
        out[rows, :rank] = (out[rows, :rank].float() + scale * product).to(out.dtype)


def expand(
    x: torch.Tensor,
    lora_b: torch.Tensor,
    out: torch.Tensor,
    slot_of_row: torch.Tensor,
    offset: int,
    add_inputs: bool,
) -> None:
    """``out[t, offset:offset+N] (+)= round_w(round_w(x[t]) @ B[slot_t]ᵀ)``; other rows and columns untouched."""
    num_slots, width, rank = lora_b.shape
    if x.size(-1) != rank:
        raise ValueError(f"input has rank {x.size(-1)}, LoRA-B has rank {rank}")
    if offset < 0 or offset + width > out.size(-1):
        raise ValueError(f"columns [{offset}, {offset + width}) do not fit an output of width {out.size(-1)}")
    columns = slice(offset, offset + width)
    for slot, rows in rows_using(slot_of_row, num_slots):
        rounded_input = x[rows].to(lora_b.dtype)  # CAST_TYPE: a float32 buffer is rounded first
        delta = (rounded_input.float() @ lora_b[slot].float().T).to(lora_b.dtype)
        if add_inputs:
            out[rows, columns] = (out[rows, columns].float() + delta.float()).to(out.dtype)
        else:
            out[rows, columns] = delta.to(out.dtype)


# -- one slot per row, from each family's metadata ----------------------------------------------


def slots_from_segments(starts: torch.Tensor, lengths: torch.Tensor, segment_slots: torch.Tensor, rows: int) -> torch.Tensor:
    """sgmv: segment ``b`` is rows ``[starts[b], starts[b] + lengths[b])`` with slot ``segment_slots[b]``."""
    slot_of_row = torch.full((rows,), NO_ADAPTER, dtype=torch.long, device=lengths.device)
    for start, length, slot in zip(starts.tolist(), lengths.tolist(), segment_slots.tolist()):
        slot_of_row[start : start + length] = slot
    return slot_of_row


def slots_from_sorted_tokens(
    sorted_tokens: torch.Tensor, tokens_per_id: torch.Tensor, id_starts: torch.Tensor, ids: torch.Tensor, rows: int
) -> torch.Tensor:
    """lora_*: the tokens of ``ids[i]`` are ``sorted_tokens[id_starts[i] : id_starts[i] + tokens_per_id[i]]``."""
    slot_of_row = torch.full((rows,), NO_ADAPTER, dtype=torch.long, device=sorted_tokens.device)
    for slot, start, count in zip(ids.tolist(), id_starts.tolist(), tokens_per_id.tolist()):
        if slot != NO_ADAPTER and count > 0:
            slot_of_row[sorted_tokens[start : start + count].long()] = slot
    return slot_of_row
