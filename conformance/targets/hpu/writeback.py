"""How a LoRA result lands in the caller's output, as vLLM's kernels land it.

Per output element of a row that uses an adapter:

* expand / linear: ``y = round_y((y if add_inputs else 0) + delta)``, the delta already rounded to the
  weight dtype, the sum done in float32;
* bias: added after the delta, in a second rounding step, unscaled;
* shrink into the float32 buffer: ``y = y + round_y(scale · x @ Aᵀ)``;
* full linear (``apply_lora_full_linear``): ``y = round_y(x @ Wᵀ + bias)``, the row replaced, one rounding.

Rows without adapter (slot −1, and padding) keep their old value **bit for bit**, also with
``add_inputs=False``, also when they hold NaN or −0.0: the result is chosen with ``torch.where`` on the
row mask, never computed as ``y + 0`` (``−0.0 + 0.0 = +0.0``) and never written through data-dependent
indexing (which would make shapes depend on the adapter mix). Pure functions: the caller copies the
result into its tensor; ``merge_blocks`` (the grouped MoE variant's) writes into the scratch copy it is
handed instead of allocating output-sized temporaries, and needs no ``torch.where``: it writes
only the served pairs' rows (through static index vectors whose empty entries hit a dump row).
"""

from __future__ import annotations

import torch


def _acc(*tensors: torch.Tensor) -> torch.dtype:
    return torch.float64 if any(t.dtype == torch.float64 for t in tensors) else torch.float32


def merge(y: torch.Tensor, delta: torch.Tensor, row_active: torch.Tensor, add_inputs: bool) -> torch.Tensor:
    acc = _acc(y, delta)
    base = y.to(acc) if add_inputs else torch.zeros_like(y, dtype=acc)
    return torch.where(row_active[:, None], (base + delta.to(acc)).to(y.dtype), y)


def add_bias(y: torch.Tensor, bias_rows: torch.Tensor, row_active: torch.Tensor) -> torch.Tensor:
    acc = _acc(y, bias_rows)
    return torch.where(row_active[:, None], (y.to(acc) + bias_rows.to(acc)).to(y.dtype), y)


def accumulate(y: torch.Tensor, shrunk: torch.Tensor, row_active: torch.Tensor) -> torch.Tensor:
    return torch.where(row_active[:, None], y + shrunk.to(y.dtype), y)


def replace(y: torch.Tensor, product: torch.Tensor, bias_rows: torch.Tensor | None, row_active: torch.Tensor) -> torch.Tensor:
    acc = _acc(y, product)
    result = product.to(acc) if bias_rows is None else product.to(acc) + bias_rows.to(acc)
    return torch.where(row_active[:, None], result.to(y.dtype), y)


def _exact_into(source: torch.dtype, target: torch.dtype) -> bool:
    """Every ``source`` value is a ``target`` value (a bf16 / fp16 delta into a float32 output, …)."""
    return source == target or target == torch.float64 or (target == torch.float32 and source in (torch.bfloat16, torch.float16))


def merge_blocks(
    y: torch.Tensor, delta: torch.Tensor, pair_at: torch.Tensor, position: torch.Tensor, row_active: torch.Tensor, add_inputs: bool
) -> torch.Tensor:
    """``merge`` for a delta kept in another row order (the grouped MoE variant's block layout): the ``[P, N]``
    result, row ``p`` the merge of ``y[p]`` with the delta at block position ``position[p]``.

    ``y`` ``[P + 1, N]``: the output rows padded to the ``P`` pairs plus one **dump row** (row ``P``), a
    scratch copy this function writes into. ``delta`` ``[M, N]``, already rounded to the weight dtype: block
    position ``j`` holds pair ``pair_at[j]``'s delta, ``pair_at[j] = P`` (the dump row) where the position is
    empty; ``position`` and ``row_active`` (pairs served) are the same plan seen from the pairs.

    When the delta converts exactly into ``y``'s dtype, the delta rows are added (``index_add_``,
    ``add_inputs``) or copied (``index_copy_``) straight from the block layout into their rows: the rows of
    unserved pairs are never written (only the dump row is, by empty positions, possibly several times, and
    it is cut off), so they stay bit for bit (NaN, −0.0) without a ``torch.where`` over the output, and no
    gathered ``[P, N]`` copy of the delta is made. The add runs in ``y``'s dtype: one rounding (bf16 / fp16
    arithmetic computes in float32), as ``merge`` rounds. Otherwise (a float32 delta into a bf16 output, …)
    the delta rows are gathered to the pairs and merged as ``merge`` does, in float32 (float64)."""
    pairs = y.size(0) - 1
    if _exact_into(delta.dtype, y.dtype):
        rows = delta.to(y.dtype)
        y = y.index_add_(0, pair_at, rows) if add_inputs else y.index_copy_(0, pair_at, rows)
        return y[:pairs]
    rows = delta.index_select(0, position.clamp(max=delta.size(0) - 1))
    return merge(y[:pairs], rows, row_active, add_inputs)
