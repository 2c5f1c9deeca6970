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
result into its tensor.
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
