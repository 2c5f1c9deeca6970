"""The values of a tensor-parallel serving case, drawn in the referee's process (never in a rank's).

As for one process (``conformance.serving.values``): the adapter pool drawn once (the unsharded stacks of
a layer with one slot per adapter, each adapter's rank zero-padded up to the max rank); a step's batch
drawn as the tensor-parallel case of its real rows (``TPServingCase.step_case``, ``conformance.tp.values``),
its stacks the pool's rows of the adapters resident in its slots (zeros for a slot never loaded); and the
persistent buffers' first contents: large activations with every fifth row NaN, and a base output of
noise. Each rank cuts its shard of all of it (``conformance.tp.values.rank_shard``), as it would cut an
adapter it loads.
"""

from __future__ import annotations

import dataclasses
import math

import torch

from conformance.cases.case import DTYPES

from .serving_case import TPServingCase
from .values import LayerTensors, layer_tensors


def adapter_pool(case: TPServingCase) -> LayerTensors:
    """Every adapter's unsharded stacks (``x`` and ``y`` unused): ``[adapters, 1, R, H]`` and ``[adapters, 1, N_s, R]``."""
    pool_case = dataclasses.replace(case.layer, num_slots=len(case.adapter_ranks), seq_lens=(1,), seq_slots=(-1,),
                                    seed=case.seed * 1000 + 999)
    drawn = layer_tensors(pool_case)
    ranks = torch.tensor(case.adapter_ranks)
    kept = torch.arange(case.layer.max_rank)[None, :] < ranks[:, None]  # [adapters, R]: the rank rows each adapter has
    lora_a = tuple(a * kept[:, None, :, None].to(a.dtype) for a in drawn.lora_a)
    lora_b = tuple(b * kept[:, None, None, :].to(b.dtype) for b in drawn.lora_b)
    return dataclasses.replace(drawn, lora_a=lora_a, lora_b=lora_b)


def _resident(stacks: tuple[torch.Tensor, ...], resident: tuple[int, ...]) -> tuple[torch.Tensor, ...]:
    index = torch.tensor(resident)
    loaded = (index >= 0).view(-1, 1, 1, 1)
    return tuple(stack[index.clamp(min=0)] * loaded.to(stack.dtype) for stack in stacks)


def step_tensors(case: TPServingCase, index: int, pool: LayerTensors) -> LayerTensors:
    """Step ``index``'s unsharded layer: its batch (``x``, base output ``y``) and the resident adapters' stacks."""
    drawn = layer_tensors(case.step_case(index))
    resident = case.steps[index].resident
    return dataclasses.replace(drawn, lora_a=_resident(pool.lora_a, resident), lora_b=_resident(pool.lora_b, resident))


def initial_tensors(case: TPServingCase) -> LayerTensors:
    """The persistent buffers before the first step, unsharded: ``max_tokens`` rows of poisoned activations and base
    output, and the stacks zeroed (vLLM allocates them zeroed)."""
    layer, dtype = case.layer, DTYPES[case.layer.dtype]
    generator = torch.Generator().manual_seed(case.seed * 1000 + 998)
    x = torch.randn((case.max_tokens, layer.hidden_size), generator=generator, dtype=torch.float64) * 64
    x[::5] = math.nan
    y = torch.randn((case.max_tokens, layer.output_width), generator=generator, dtype=torch.float64)
    slots, rank = layer.num_slots, layer.max_rank
    lora_a = tuple(torch.zeros((slots, 1, rank, layer.hidden_size), dtype=dtype) for _ in layer.output_slices)
    lora_b = tuple(torch.zeros((slots, 1, width, rank), dtype=dtype) for width in layer.output_slices)
    return LayerTensors(x.to(dtype), lora_a, lora_b, y.to(dtype))


def request_tensors(case: TPServingCase) -> tuple[LayerTensors, list[LayerTensors]]:
    """Everything the ranks are handed: the buffers' first contents and every step's unsharded layer."""
    pool = adapter_pool(case)
    return initial_tensors(case), [step_tensors(case, index, pool) for index in range(len(case.steps))]


def named_tensors(initial: LayerTensors, steps: list[LayerTensors]) -> dict[str, torch.Tensor]:
    """Every tensor of a request by a name of its own (what the case's inputs digest covers)."""
    named = initial.named("initial.")
    for index, tensors in enumerate(steps):
        named.update(tensors.named(f"step{index}."))
    return named
