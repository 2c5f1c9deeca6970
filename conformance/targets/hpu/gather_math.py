"""The gather-based LoRA math: each row's adapter weights copied out with ``index_select``, then a batched GEMM.

This is the first HPU LoRA (HabanaAI/vllm-fork#170, PyPI ``vllm-hpu-extension==0.1``;
docs/gaudi-lora.md §1.6): ``wa = index_select(wa_t_all, 0, indices)`` gives ``[T, R, H]`` and a
batched matmul does the rest. Gaudi replaced it with the mask-based math "to optimize performance and
reduce device memory usage": it moves ``T·R·(H + N)`` weight elements per call, and the gather is a
data-dependent index op. Shapes stay static (``[T, R, H]`` for a bucket of ``T`` rows), so it compiles
once per bucket too. It is kept as a variant so that both can be judged by the same suite and compared
for cost.

Rows of slot −1 gather slot 0 (the index is clamped) and are then discarded with ``torch.where``, so
nothing of slot 0 reaches them, finite or not. Rounding follows vLLM's kernels exactly as the
mask-based math does (float32 accumulation, ``CAST_TYPE``, delta rounded to the weight dtype).
"""

from __future__ import annotations

import torch


def shrink_rows(
    x: torch.Tensor, a3: torch.Tensor, index: torch.Tensor, row_active: torch.Tensor, scale: float
) -> torch.Tensor:
    """``[T, R]`` in ``a3``'s dtype: ``scale · x[t] @ A[slot_t]ᵀ``, zero for rows without adapter."""
    a_rows = a3.index_select(0, index)  # [T, R, H]: a copy of every row's LoRA-A
    s = torch.bmm(a_rows, x.to(a3.dtype).unsqueeze(-1)).squeeze(-1) * scale
    return torch.where(row_active[:, None], s, 0.0)


def expand_rows(
    s: torch.Tensor, b3: torch.Tensor, index: torch.Tensor, row_active: torch.Tensor, weight_dtype: torch.dtype,
    row_weight: torch.Tensor | None = None,
) -> torch.Tensor:
    """The delta ``[T, N]`` of a rank-space input ``[T, R]``, rounded to the weight dtype (weighted per row
    before the rounding when ``row_weight`` is given: the MoE routing weight)."""
    b_rows = b3.index_select(0, index)  # [T, N, R]: a copy of every row's LoRA-B
    s = s.to(weight_dtype).to(b3.dtype)  # CAST_TYPE
    delta = torch.bmm(b_rows, s.unsqueeze(-1)).squeeze(-1)
    if row_weight is not None:
        delta = delta * row_weight.to(delta.dtype)[:, None]
    return torch.where(row_active[:, None], delta, 0.0).to(weight_dtype)


def linear(
    x: torch.Tensor,
    a3: torch.Tensor,
    b3: torch.Tensor,
    index: torch.Tensor,
    row_active: torch.Tensor,
    scale: float,
    weight_dtype: torch.dtype,
) -> torch.Tensor:
    """The LoRA delta ``[T, N]``: per-row shrink into ``[T, R]``, then per-row expand."""
    return expand_rows(shrink_rows(x, a3, index, row_active, scale), b3, index, row_active, weight_dtype)


def select_table_rows(table: torch.Tensor, index: torch.Tensor, row_active: torch.Tensor) -> torch.Tensor:
    """``[L, N]`` per-slot rows (LoRA bias) → ``[T, N]``, zeros for rows without adapter."""
    return torch.where(row_active[:, None], table.index_select(0, index), 0.0)
