"""How LoRA weight stacks are laid out, and the precision the reference computes in.

A stack holds one matrix per adapter slot. vLLM keeps a legacy ``num_layers`` dimension of size 1,
so a stack is either ``[L, 1, rows, cols]`` or ``[L, rows, cols]``:

* LoRA-A stacks are ``[L, R, H]`` (PEFT's ``lora_A.weight`` per slot), applied as ``x @ A[l]ᵀ``;
* LoRA-B stacks are ``[L, N, R]`` (PEFT's ``lora_B.weight`` per slot), applied as ``s @ B[l]ᵀ``.

Adapters of rank below the stack's ``R`` are zero-padded, so the padding contributes nothing.
"""

from __future__ import annotations

import torch


def weight_stack(stack: torch.Tensor) -> torch.Tensor:
    """Return the stack as ``[L, rows, cols]``, dropping vLLM's legacy ``num_layers`` dimension."""
    if stack.ndim == 4:
        if stack.size(1) != 1:
            raise ValueError(f"a 4-D LoRA stack must have size 1 in dim 1 (num_layers), got {tuple(stack.shape)}")
        return stack.squeeze(1)
    if stack.ndim != 3:
        raise ValueError(f"a LoRA stack must be 3-D [L, rows, cols] or 4-D [L, 1, rows, cols], got {tuple(stack.shape)}")
    return stack


def accumulation_dtype(*tensors: torch.Tensor) -> torch.dtype:
    """The dtype products are summed in.

    Float64 when the reference runs as the oracle (any float64 operand), otherwise float32, which is
    what every vLLM LoRA kernel accumulates in whatever the storage dtype.
    """
    return torch.float64 if any(t.dtype == torch.float64 for t in tensors) else torch.float32
