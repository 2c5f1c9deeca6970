"""The values of a serving case, drawn in the referee's process: the adapter pool, each step's batch, the poison.

* **The adapter pool**: every adapter of the case, drawn once from the case's seed as the stacks of an op
  case with one slot per adapter (its rank zero-padded up to the max rank). A step's stacks are the pool's
  rows of the adapters resident in its slots; a slot never loaded holds zeros (vLLM allocates its stacks zeroed),
  an evicted adapter's weights stay until another is loaded over them (vLLM only clears the slot's id).
* **A step's batch**: the op case of its real rows (``ServingCase.step_case``) drawn as every op case is
  (``conformance.runner.make_values``): activations, the output's initial values, the routing.
* **The persistent buffers' first contents**: what the rows past a batch hold before any step wrote them:
  large activations, NaN rows and routing to live experts. A correct target never lets them reach a
  real row (rows of a matmul are independent), and the output's rows past the padded batch must keep
  them bit for bit.
"""

from __future__ import annotations

import dataclasses
import math

import torch

from conformance.ops import OP_SPECS
from conformance.runner import make_values

from .case import ServingCase

Tensors = dict[str, torch.Tensor]

STACK_PREFIXES = ("lora_a.", "lora_b.", "bias.")  # per slot: loaded in place from the pool
SLOT_VALUES = ("adapter_enabled",)  # per slot, written when an adapter is loaded (vLLM's fused-MoE layer)
ROW_VALUES = ("x", "out", "topk_ids", "topk_weights")  # per token (or per (token, choice) pair): the batch


def is_stack(name: str) -> bool:
    return name.startswith(STACK_PREFIXES)


def adapter_pool(case: ServingCase) -> Tensors:
    """Every adapter's stacks, ``[adapters, ...]``: an op case's stacks with one slot per adapter."""
    first = case.step_case(0)
    pool_case = dataclasses.replace(first, num_slots=len(case.adapter_ranks), adapter_ranks=case.adapter_ranks,
                                    seq_slots=(-1,) * len(first.seq_lens), seed=case.seed * 1000 + 999)
    return {name: tensor for name, tensor in make_values(pool_case).items() if is_stack(name)}


def step_values(case: ServingCase, index: int, pool: Tensors) -> Tensors:
    """Step ``index``'s values as its op case names them, the stacks made of the resident adapters."""
    step = case.steps[index]
    values = make_values(case.step_case(index))
    resident = torch.tensor(step.resident)
    loaded = resident >= 0
    for name in values:
        if is_stack(name):
            stack = pool[name][resident.clamp(min=0)]
            stack[~loaded] = 0
            values[name] = stack
    if "adapter_enabled" in values:  # set when an adapter is loaded into the slot, never cleared
        values["adapter_enabled"][: case.layer.num_slots] = loaded.to(values["adapter_enabled"].dtype)
    return values


def row_factor(values: Tensors, name: str, tokens: int) -> int:
    """Rows of ``name`` per token of a batch of ``tokens`` tokens (``top_k`` for an MoE output, 1 otherwise; logits
    rows are sequences, never more than the tokens)."""
    return max(1, values[name].size(0) // tokens) if values[name].size(0) % tokens == 0 else 1


def initial_buffers(case: ServingCase, first: Tensors) -> Tensors:
    """The persistent row buffers as a server's memory holds them before the first step (see the module docstring)."""
    generator = torch.Generator().manual_seed(case.seed * 1000 + 998)
    buffers = {}
    for name in ROW_VALUES:
        if name not in first:
            continue
        like = first[name]
        shape = (case.max_tokens * row_factor(first, name, case.steps[0].num_tokens), *like.shape[1:])
        if name == "topk_ids":
            buffers[name] = torch.randint(0, max(case.layer.num_experts, 1), shape, generator=generator, dtype=like.dtype)
            continue
        noise = torch.randn(shape, generator=generator, dtype=torch.float64)
        if name == "x":  # large activations, and every fifth row NaN
            noise = noise * 64
            noise[::5] = math.nan
        buffers[name] = noise.to(like.dtype)
    return buffers


def padded_rows(values: Tensors, name: str, tokens: int, rows: int) -> int:
    """Rows of ``name`` the layer gets when a batch of ``tokens`` tokens runs on ``rows`` rows (padded when more)."""
    if rows == tokens:
        return values[name].size(0)
    return rows * row_factor(values, name, tokens)


def request_values(case: ServingCase) -> tuple[Tensors, list[Tensors]]:
    """Everything the target's half needs: the buffers' first contents and every step's values."""
    pool = adapter_pool(case)
    steps = [step_values(case, index, pool) for index in range(len(case.steps))]
    unknown = sorted(name for name in steps[0] if not is_stack(name) and name not in SLOT_VALUES + ROW_VALUES)
    if unknown:  # a layer whose values this level does not know how to keep: say so, never drop them
        raise ValueError(f"{case.op}: the serving level does not know how a server keeps {unknown}")
    if OP_SPECS[case.op].rows == "sampled" and any(step.rows != step.num_tokens for step in case.steps):
        raise ValueError(f"{case.op}: its rows are sampled rows, which are never padded (every step must be eager)")
    return initial_buffers(case, steps[0]), steps
