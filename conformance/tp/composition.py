"""What each rank of a tensor-parallel LoRA layer computes, and which collective joins them, as vLLM composes it.

One function per layer kind and sharding, each run by every rank with that rank's wrapper (the
target's ``add_shrink`` / ``add_expand`` / ``add_lora_linear``) and the collectives between the
ranks (``conformance.tp.collectives``). Each returns the layer's *unsharded* output (every rank the
same), which is what the suite judges: the column layers' outputs are gathered (vLLM's
``gather_output``) and put back slice by slice, the row layers' outputs are all-reduced (vLLM's
``reduce_results``). Where ranks share a head (``kv_replicas`` or ``index_kv_replicas`` > 1), each replica
group's copy makes an output of its own, so a leading dimension holds one per group. ``docs/tensor-parallel.md`` gives the math and the vLLM functions each follows.

The base layer's output (``y`` before the delta) is split as vLLM's base layers leave it: the column
layers' rank holds its columns; the row layers' partial sums are all on rank 0 (the other ranks hold
zeros, as if the base weight's other shards were zero), so rows without an adapter must come back bit
for bit after the all-reduce.
"""

from __future__ import annotations

import torch

from .case import TPCase
from .moe_case import MOE_WRAPPER_METHODS, MoETPCase
from .moe_layer import moe_composition, moe_tensors
from .values import LayerTensors, layer_tensors, place_column_shards, rank_shard

REQUIRED_WRAPPER_METHODS = ("add_shrink", "add_expand", "add_lora_linear")
"""What vLLM's linear LoRA layers call on each rank; an MoE layer calls ``MOE_WRAPPER_METHODS`` instead."""
WATCHED_WRAPPER_METHODS = REQUIRED_WRAPPER_METHODS + MOE_WRAPPER_METHODS


def required_methods(case) -> tuple[str, ...]:
    """The wrapper methods ``case``'s ranks call: a target lacking one does not support the case."""
    return MOE_WRAPPER_METHODS if isinstance(case, MoETPCase) else REQUIRED_WRAPPER_METHODS


def tensors_of(case):
    """The case's unsharded tensors: ``LayerTensors`` for a linear layer, ``MoETensors`` for an MoE one."""
    return moe_tensors(case) if isinstance(case, MoETPCase) else layer_tensors(case)


def buffer_dtype(x: torch.Tensor) -> torch.dtype:
    """vLLM's shrink buffers are float32; float64 when the whole layer is (the suite's exact check of a composition)."""
    return torch.float64 if x.dtype == torch.float64 else torch.float32


def local_slices(case: TPCase) -> tuple[int, ...]:
    return tuple(width // shards for width, shards in zip(case.output_slices, case.slice_shards))


def gathered_columns(case: TPCase, local: torch.Tensor, collectives, initial: torch.Tensor) -> torch.Tensor:
    """All-gather the ranks' packed column outputs (rank-major) and put each rank's slices in their place:
    ``[replica_groups, T, Σ N_s]``, one unsharded output per replica group (each rank's copy of a
    replicated head is judged, not just one of them)."""
    gathered = collectives.all_gather(local, dim=-1)
    width = local.size(-1)
    shards = [gathered[:, r * width : (r + 1) * width] for r in range(case.tp_size)]
    return torch.stack([place_column_shards(case, shards, initial, replica) for replica in range(case.replica_groups)])


def column_parallel(case: TPCase, t: LayerTensors, wrapper, collectives, rank: int) -> torch.Tensor:
    """``ColumnParallelLinearWithLoRA`` / ``MergedColumnParallelLinearWithLoRA`` / ``MergedQKVParallelLinearWithLoRA``
    / ``Step5FusedQKVIndexerWithLoRA`` (vLLM 0.33, seven slices):
    LoRA-A whole on every rank, LoRA-B cut to the rank's output columns of each slice; one
    ``add_lora_linear`` on the rank's columns; the outputs all-gathered."""
    own = rank_shard(case, t, rank)
    wrapper.add_lora_linear(own.y, own.x, own.lora_a, own.lora_b, case.scale, local_slices(case))
    return gathered_columns(case, own.y, collectives, t.y)


def column_parallel_fully_sharded(case: TPCase, t: LayerTensors, wrapper, collectives, rank: int) -> torch.Tensor:
    """``*ColumnParallelLinearWithShardedLoRA`` / ``QKVParallelLinearWithShardedLoRA`` (vLLM's ``_mcp_apply``):
    LoRA-A cut to the rank's R / tp rows; ``add_shrink`` into a float32 ``[S, T, R / tp]`` buffer; the
    buffers all-gathered along the rank dimension (``[S, T, R]``, the whole shrink); ``add_expand`` of
    the rank's LoRA-B columns at ``offset_start`` 0 of its own output; the outputs all-gathered."""
    own = rank_shard(case, t, rank)
    buffer = torch.zeros((case.num_slices, case.num_tokens, case.max_rank // case.tp_size), dtype=buffer_dtype(t.x), device=own.y.device)
    wrapper.add_shrink(buffer, own.x, own.lora_a, case.scale)
    buffer = collectives.all_gather(buffer, dim=-1)
    wrapper.add_expand(own.y, buffer, own.lora_b, local_slices(case), 0, True)
    return gathered_columns(case, own.y, collectives, t.y)


def row_parallel(case: TPCase, t: LayerTensors, wrapper, collectives, rank: int) -> torch.Tensor:
    """``RowParallelLinearWithLoRA``: x and LoRA-A cut along the input features, LoRA-B whole; each rank's
    ``add_lora_linear`` adds a partial delta to its partial output; the outputs all-reduced."""
    own = rank_shard(case, t, rank)
    wrapper.add_lora_linear(own.y, own.x, own.lora_a, own.lora_b, case.scale, case.output_slices)
    return collectives.all_reduce(own.y)[None]


def row_parallel_fully_sharded(case: TPCase, t: LayerTensors, wrapper, collectives, rank: int) -> torch.Tensor:
    """``RowParallelLinearWithShardedLoRA`` (S-LoRA): ``add_shrink`` of the rank's input features into a float32
    ``[1, T, R]`` buffer; the buffers all-reduced (the whole shrink); ``add_expand`` of the rank's
    N / tp LoRA-B rows at ``offset_start = rank · N / tp`` of the (full-width, partial) output; the
    outputs all-reduced."""
    own = rank_shard(case, t, rank)
    buffer = torch.zeros((1, case.num_tokens, case.max_rank), dtype=buffer_dtype(own.x), device=own.y.device)
    wrapper.add_shrink(buffer, own.x, own.lora_a, case.scale)
    buffer = collectives.all_reduce(buffer)
    shard = case.output_slices[0] // case.tp_size
    wrapper.add_expand(own.y, buffer, own.lora_b, (shard,), rank * shard, True)
    return collectives.all_reduce(own.y)[None]


def composition(case: TPCase | MoETPCase):
    """The function every rank runs for ``case``."""
    if isinstance(case, MoETPCase):
        return moe_composition(case)
    if case.layer == "row":
        return row_parallel_fully_sharded if case.fully_sharded else row_parallel
    return column_parallel_fully_sharded if case.fully_sharded else column_parallel


def run_rank(case: TPCase, tensors: LayerTensors, wrapper, collectives, rank: int, device: torch.device) -> torch.Tensor:
    """One rank's part of ``case`` on ``device`` (``update_metadata`` already called); the unsharded output
    of each replica group, ``[replica_groups, T, Σ N_s]`` (one group but for replicated heads), on the CPU;
    an MoE case's joined output ``[1, T·top_k, judged_width]``."""
    output = composition(case)(case, tensors.on(device), wrapper, collectives, rank)
    if hasattr(wrapper, "synchronize"):
        wrapper.synchronize()
    return output.cpu()
