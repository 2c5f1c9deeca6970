"""The values of a case: tensors filled from a ``torch.Generator`` seeded with ``case.seed``.

Magnitudes are chosen so that every intermediate stays O(1) in every dtype (no fp16 overflow at
H = 14336): activations ~ N(0, 1), LoRA-A entries scaled by 1/√H, LoRA-B entries by 1/√rank. The
``positive`` distribution draws from U[0, 1) (scaled by 1/H and 1/rank) like vLLM's own tests, so
sums grow without cancellation. Ranks below the stack's ``R`` are zero-padded. Slots no token uses
still hold non-zero weights, so a row that reads the wrong slot shows.
"""

from __future__ import annotations

import torch

from .case import Case


def generator_for(case: Case) -> torch.Generator:
    return torch.Generator().manual_seed(case.seed)


def activations(gen: torch.Generator, case: Case, shape: tuple[int, ...], dtype: torch.dtype) -> torch.Tensor:
    if case.distribution == "positive":
        values = torch.rand(shape, generator=gen, dtype=torch.float64)
    else:
        values = torch.randn(shape, generator=gen, dtype=torch.float64)
    return values.to(dtype)


def _weights(gen: torch.Generator, case: Case, shape: tuple[int, ...], fan_in: float) -> torch.Tensor:
    if case.distribution == "positive":
        return torch.rand(shape, generator=gen, dtype=torch.float64) / fan_in
    return torch.randn(shape, generator=gen, dtype=torch.float64) / fan_in**0.5


def _stack_layout(case: Case, stack: torch.Tensor) -> torch.Tensor:
    stack = stack.to(case.torch_dtype)
    return stack.unsqueeze(1).contiguous() if case.weights_4d else stack.contiguous()


def lora_a_stack(gen: torch.Generator, case: Case) -> torch.Tensor:
    """``[L, R, H]`` (or ``[L, 1, R, H]``); rows at and above each slot's rank are zero."""
    stack = _weights(gen, case, (case.num_slots, case.max_rank, case.hidden_size), case.hidden_size)
    for slot, rank in enumerate(case.adapter_ranks):
        stack[slot, rank:, :] = 0
    return _stack_layout(case, stack)


def lora_b_stack(gen: torch.Generator, case: Case, width: int) -> torch.Tensor:
    """``[L, N, R]`` (or ``[L, 1, N, R]``); columns at and above each slot's rank are zero."""
    stack = torch.empty(case.num_slots, width, case.max_rank, dtype=torch.float64)
    for slot, rank in enumerate(case.adapter_ranks):
        stack[slot] = _weights(gen, case, (width, case.max_rank), rank)
        stack[slot, :, rank:] = 0
    return _stack_layout(case, stack)


def full_weight_stack(gen: torch.Generator, case: Case, width: int) -> torch.Tensor:
    """``[L, P, H]`` (or ``[L, 1, P, H]``): a whole linear layer per slot (``apply_lora_full_linear``),
    scaled by 1/√H like LoRA-A so each output stays O(1)."""
    return _stack_layout(case, _weights(gen, case, (case.num_slots, width, case.hidden_size), case.hidden_size))


def bias_stack(gen: torch.Generator, case: Case, width: int) -> torch.Tensor:
    """``[L, N]`` (or ``[L, 1, N]``): one bias row per slot."""
    return _stack_layout(case, activations(gen, case, (case.num_slots, width), torch.float64))


# -- the fused-MoE ops: stacks with an expert dimension, and the routing ----------------------


def moe_lora_a_stack(gen: torch.Generator, case: Case, experts: int) -> torch.Tensor:
    """``[L, E, R, K]`` (``E = 1``: shared by every expert); rows at and above each slot's rank are zero."""
    stack = _weights(gen, case, (case.num_slots, experts, case.max_rank, case.hidden_size), case.hidden_size)
    for slot, rank in enumerate(case.adapter_ranks):
        stack[slot, :, rank:, :] = 0
    return stack.to(case.torch_dtype).contiguous()


def moe_lora_b_stack(gen: torch.Generator, case: Case, width: int, experts: int) -> torch.Tensor:
    """``[L, E, N, R]`` (``E = 1``: shared by every expert); columns at and above each slot's rank are zero."""
    stack = torch.empty(case.num_slots, experts, width, case.max_rank, dtype=torch.float64)
    for slot, rank in enumerate(case.adapter_ranks):
        stack[slot] = _weights(gen, case, (experts, width, case.max_rank), rank)
        stack[slot, :, :, rank:] = 0
    return stack.to(case.torch_dtype).contiguous()


def routing_weights(gen: torch.Generator, case: Case) -> torch.Tensor:
    """float32 ``[T, top_k]``: positive weights summing to 1 per token (a softmax router's), then the
    case's zero-weight pairs set to exactly 0."""
    weights = torch.rand(case.num_tokens, case.top_k, generator=gen, dtype=torch.float64) + 0.05
    weights = (weights / weights.sum(1, keepdim=True)).reshape(-1)
    weights[list(case.zero_weight_pairs)] = 0.0
    return weights.reshape(case.num_tokens, case.top_k).to(torch.float32)
