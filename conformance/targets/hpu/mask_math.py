"""The mask-based LoRA math: every adapter at once, two dense GEMMs, the row's own block kept by a mask.

This is Gaudi's BGMV (``dispatch_bgmv_linear``, docs/gaudi-lora.md §1.2, §1.6)::

    y += ((x @ A_flat.T) ⊙ M) @ B_flat          A_flat [L·R, H], B_flat [L·R, N], M [T, L·R]

Every shape depends only on the (bucketed) row count and on ``L``, ``R``, ``H``, ``N``; never on which
adapters are active. So one compiled graph per bucket serves every adapter mix, and there are no
gathers, scatters or per-adapter loops. The cost is that the GEMMs run over all ``L·R`` columns.

Two deliberate departures from Gaudi's code:

* **``torch.where``, not multiplication, applies the mask**, both to the shrunk activations and to the
  LoRA-B rows of slots no row uses. ``0 · Inf = NaN``: with a multiply, an Inf or NaN in an *unused*
  slot's weights leaks NaN into every row (hazard 5, docs/gaudi-lora.md §3.4). ``where`` selects,
  so an unselected Inf never reaches an arithmetic op. (A non-finite value in a slot that *some* row
  uses still meets zeros of other rows inside the expand GEMM; a dense GEMM cannot avoid that.)
* **Rounding where vLLM's kernels round**: products accumulate in float32 (operands are upcast; the
  prepared weights already are), the shrunk activations are rounded to the weight dtype before the
  expand (the Triton kernels' ``CAST_TYPE``), and the delta is rounded to the weight dtype before it
  is added to the output (``writeback``).

All functions are pure (no in-place writes, no Python branches on tensor data), so they run unchanged
eagerly, in Gaudi's lazy mode, inside an HPU graph and under ``torch.compile(dynamic=False)``.
"""

from __future__ import annotations

import torch


def shrink(x: torch.Tensor, a_flat: torch.Tensor, mask: torch.Tensor, scale: float) -> torch.Tensor:
    """``[T, L·R]`` in ``a_flat``'s dtype: ``scale · x @ A_lᵀ`` in the row's own block, exact zeros elsewhere."""
    return torch.where(mask, (x.to(a_flat.dtype) @ a_flat.T) * scale, 0.0)


def select(shrunk: torch.Tensor, rank: int) -> torch.Tensor:
    """``[T, L·R]`` → ``[T, R]``: the row's own block, as a sum over blocks.

    A gather without index ops (vllm-gaudi's ``add_shrink`` does the same). Exact only because every
    other block of the row is an exact zero: at most one active block per row.
    """
    return shrunk.unflatten(1, (-1, rank)).sum(1)


def spread(s: torch.Tensor, mask: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """``[T, R]`` → ``[T, L·R]`` in ``dtype``: the rank-space input copied into the row's own block only."""
    repeats = mask.size(1) // s.size(1)
    return torch.where(mask, s.to(dtype).repeat(1, repeats), 0.0)


def expand(
    shrunk: torch.Tensor, b_flat: torch.Tensor, mask: torch.Tensor, weight_dtype: torch.dtype, row_weight: torch.Tensor | None = None
) -> torch.Tensor:
    """``[T, L·R]`` (masked) → the delta ``[T, N]``, rounded to the weight dtype.

    ``row_weight`` (the MoE routing weight of each pair) multiplies the accumulated delta before it is
    rounded, as vLLM's fused-MoE kernel applies ``mul_routed_weight`` to its float32 accumulator."""
    used_columns = mask.any(0)  # slots some row of this batch uses
    b = torch.where(used_columns[:, None], b_flat, 0.0)  # unused slots' rows are zero, whatever they hold
    s = shrunk.to(weight_dtype).to(b_flat.dtype)  # CAST_TYPE: the float32 shrink result is rounded first
    delta = s @ b
    if row_weight is not None:
        delta = delta * row_weight.to(delta.dtype)[:, None]
    return delta.to(weight_dtype)


def linear(
    x: torch.Tensor,
    a_flat: torch.Tensor,
    b_flat: torch.Tensor,
    mask: torch.Tensor,
    scale: float,
    weight_dtype: torch.dtype,
) -> torch.Tensor:
    """The fused LoRA delta ``[T, N]``: shrink and expand with the ``[T, L·R]`` intermediate, no select."""
    return expand(shrink(x, a_flat, mask, scale), b_flat, mask, weight_dtype)


def shrink_rows(x: torch.Tensor, a_flat: torch.Tensor, mask: torch.Tensor, scale: float, rank: int) -> torch.Tensor:
    """``[T, R]``: each row's own ``scale · x @ A_lᵀ`` (zero for rows without adapter)."""
    return select(shrink(x, a_flat, mask, scale), rank)


def expand_rows(
    s: torch.Tensor, b_flat: torch.Tensor, mask: torch.Tensor, weight_dtype: torch.dtype, row_weight: torch.Tensor | None = None
) -> torch.Tensor:
    """The delta ``[T, N]`` of a rank-space input ``[T, R]`` (the expand ops, the embedding, MoE's expand)."""
    return expand(spread(s, mask, b_flat.dtype), b_flat, mask, weight_dtype, row_weight)


def select_table_rows(table: torch.Tensor, onehot: torch.Tensor) -> torch.Tensor:
    """``[L, N]`` per-slot rows (LoRA bias) → ``[T, N]``: each row's slot's entry, zeros for no adapter.

    A one-hot GEMM (exact: one product ``1 · b`` plus exact zeros); unused slots are zeroed by ``where``
    first so that ``0 · Inf`` cannot occur.
    """
    used = onehot.any(0)
    return onehot.to(table.dtype) @ torch.where(used[:, None], table, 0.0)
