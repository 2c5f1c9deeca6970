"""The ``cuda`` target's fused-MoE LoRA: the suite's neutral ``add_lora_w13``/``add_lora_w2`` (docs/moe.md)
expressed as calls of vLLM's ``PunicaWrapperGPU.add_lora_w13``/``add_lora_w2``.

vLLM's wrapper methods take what its MoE layer has at hand and the neutral contract leaves out:

* the base expert weights ``w1 [E, 2I, H]`` and ``w2 [E, H, I]``, of which it reads only the shapes
  (to look up a Triton tile config): stand-ins of those shapes, one element each, are passed;
* ``num_tokens``, ``top_k``, ``max_loras``, ``local_num_experts`` (the stacks' expert dim),
  ``num_slices``, ``use_tuned_config=False`` (vLLM's layer passes ``bool(VLLM_TUNED_CONFIG_FOLDER)``);
* ``fully_sharded``: true exactly when ``offset > 0`` (only a fully sharded rank writes at an offset).
  ``add_lora_w2`` computes that offset itself as ``shard_size · tp_rank`` (``shard_size`` = the LoRA-B
  width), so the neutral ``offset`` becomes a ``tp_rank`` when it is a multiple of the width and the
  case is refused otherwise; ``add_lora_w13`` takes no offset at all (a fully sharded rank's w13
  output is its own shard, written from column 0), so w13 cases with ``offset > 0`` are refused;
* shared-expert stacks (expert dim 1) expanded with a stride-0 ``.expand(-1, E, -1, -1)``, as
  ``LoRAExpertsMixin`` does before calling the wrapper (w13's LoRA-A, w2's LoRA-B);
* ``add_lora_w2`` takes the block-aligned ids ``add_lora_w13`` returned, while the neutral w2 takes
  the routing: they are recomputed by the wrapper's own ``moe_lora_align_block_size``, called exactly
  as ``add_lora_w13`` calls it (its block size from the w13 shrink config, its naive-assignment rule).

With ``fully_sharded=True`` vLLM's ``fused_moe_lora`` runs an all-reduce or all-gather of the shrink
result over the tensor-parallel group between its two kernels. The suite runs one rank, where that
collective is the identity, but vLLM still asks its distributed state for the group: for each such call
:func:`single_rank_tensor_parallel` sets up a world-size-1 group (gloo, a file store in a temporary
directory) and tears it down after, unless the process already has one (an engine's), which is reused.
Nothing here imports vLLM at import time.
"""

from __future__ import annotations

import contextlib
import functools
import os
import tempfile
from collections.abc import Iterator, Sequence
from typing import Any

import torch

# add_lora_w13 (vLLM 0.32) assigns blocks naively (topk_ids as the experts, no sorting) when
# num_tokens · top_k · SPARSITY_FACTOR ≤ local_num_experts · max_loras, without expert map or sharding.
SPARSITY_FACTOR = 8
# add_lora_w13's block size when the tile config names none.
DEFAULT_BLOCK_SIZE_M = 64

W13, W2 = "add_lora_w13", "add_lora_w2"
MOE_WRAPPER_OPS = (W13, W2)


# -- what vLLM's wrapper cannot express (case-level, for unsupported_reason) --------------------------


def moe_wrapper_unsupported_reason(case) -> str | None:
    """Why vLLM's ``add_lora_w13``/``add_lora_w2`` cannot express this neutral case, or ``None``."""
    return offset_reason(case.op, case.offset_start, case.output_slices[0], case.add_inputs)


def offset_reason(op: str, offset: int, shard_size: int, add_inputs: bool) -> str | None:
    """Why ``op`` with this ``offset`` (``shard_size``: the LoRA-B width) has no vLLM equivalent, or ``None``."""
    if offset <= 0:
        return None
    if op == W13:
        return (
            "vLLM's PunicaWrapperGPU.add_lora_w13 takes no offset (a fully sharded rank's w13 output is its own "
            "shard, written from column 0)"
        )
    if op == W2 and w2_tp_rank(offset, shard_size) is None:
        return (
            f"vLLM's add_lora_w2 writes a fully sharded rank's columns at shard_size·tp_rank (shard_size = the "
            f"LoRA-B width {shard_size}); offset {offset} is not a multiple of it"
        )
    if not add_inputs:
        return FULLY_SHARDED_OVERWRITE
    return None


# The assertion vLLM's _fused_moe_lora makes before its fully sharded (two-kernel) path.
FULLY_SHARDED_OVERWRITE = "vLLM's fused_moe_lora asserts add_inputs with fully_sharded=True (the suite's offset > 0)"


def w2_tp_rank(offset: int, shard_size: int) -> int | None:
    """The ``tp_rank`` for which vLLM's ``add_lora_w2`` writes at ``offset`` (``shard_size · tp_rank``), or None."""
    if offset < 0 or shard_size <= 0 or offset % shard_size:
        return None
    return offset // shard_size


# -- the arguments vLLM's wrapper takes beyond the neutral ones ------------------------------------


def local_num_experts(lora_a_stacked: Sequence[torch.Tensor], lora_b_stacked: Sequence[torch.Tensor]) -> int:
    """``E``: the stacks' expert dim (a shared stack has 1; the other side of the pair has ``E``)."""
    return max(stack.size(1) for stack in (*lora_a_stacked, *lora_b_stacked))


def expand_shared(stacks: Sequence[torch.Tensor], num_experts: int) -> tuple[torch.Tensor, ...]:
    """Shared stacks (expert dim 1) as ``LoRAExpertsMixin`` hands them to the wrapper: a stride-0 view."""
    return tuple(s.expand(-1, num_experts, -1, -1) if s.size(1) == 1 else s for s in stacks)


def shape_stand_in(shape: tuple[int, ...], like: torch.Tensor) -> torch.Tensor:
    """A tensor of ``shape`` (``like``'s dtype and device) holding one element: vLLM reads only ``w1.shape``/``w2.shape``."""
    return torch.zeros((), dtype=like.dtype, device=like.device).expand(shape)


def base_weights(num_experts: int, intermediate: int, hidden: int, like: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Stand-ins for the layer's ``w1 [E, 2I, H]`` (gate and up) and ``w2 [E, H, I]`` (down)."""
    return (
        shape_stand_in((num_experts, 2 * intermediate, hidden), like),
        shape_stand_in((num_experts, hidden, intermediate), like),
    )


def w13_base_weights(x: torch.Tensor, lora_b_stacked: Sequence[torch.Tensor], num_experts: int):
    """w13's input is the hidden state (``H = x``'s width) and its slices together are the 2·I gate/up columns."""
    gate_up = sum(b.size(-2) for b in lora_b_stacked)
    return base_weights(num_experts, max(gate_up // 2, 1), x.size(-1), x)


def w2_base_weights(y: torch.Tensor, x: torch.Tensor, num_experts: int):
    """w2's input is the intermediate (``I = x``'s width) and its output the hidden state (``H = y``'s width:
    under full sharding LoRA-B holds only this rank's ``H / tp`` rows, ``y`` all of them)."""
    return base_weights(num_experts, x.size(-1), y.size(-1), x)


def alignment_block_size(w1: torch.Tensor, w2: torch.Tensor, rank: int, top_k: int, dtype: torch.dtype, num_tokens: int) -> int:
    """The block size ``add_lora_w13`` aligns to: ``BLOCK_SIZE_M`` of its w13 shrink config (vLLM's lookup)."""
    from vllm.lora.layers.utils import try_get_optimal_moe_lora_config
    from vllm.lora.ops.triton_ops.utils import _normalize_lora_config_keys
    from vllm.model_executor.layers.fused_moe.config import _get_config_dtype_str

    config = try_get_optimal_moe_lora_config(
        op_type="fused_moe_lora_w13_shrink",
        w1_shape=w1.shape,
        w2_shape=w2.shape,
        rank=rank,
        top_k=top_k,
        dtype=_get_config_dtype_str(dtype=dtype, use_fp8_w8a8=False, use_int8_w8a16=False, use_int4_w4a16=False),
        M=num_tokens,
    )
    return int(_normalize_lora_config_keys(config).get("BLOCK_SIZE_M") or DEFAULT_BLOCK_SIZE_M)


def naive_block_assignment(fully_sharded: bool, expert_map, num_tokens: int, top_k: int, num_experts: int, max_loras: int) -> bool:
    """``add_lora_w13``'s choice of naive block assignment (sparse batches), which ``add_lora_w2`` inherits."""
    return not fully_sharded and expert_map is None and num_tokens * top_k * SPARSITY_FACTOR <= num_experts * max_loras


# -- the calls -------------------------------------------------------------------------------------


def add_lora_w13(wrapper, y, x, lora_a_stacked, lora_b_stacked, topk_ids, topk_weights, adapter_enabled, *,
                 expert_map=None, offset: int = 0, add_inputs: bool = True) -> None:
    """The neutral ``add_lora_w13`` through ``wrapper.add_lora_w13`` (a ``PunicaWrapperGPU`` after ``update_metadata``)."""
    if (reason := offset_reason(W13, offset, lora_b_stacked[0].size(-2), add_inputs)) is not None:
        raise NotImplementedError(reason)  # a script's call: the runner refuses such cases before
    num_tokens, top_k = topk_ids.shape
    experts = local_num_experts(lora_a_stacked, lora_b_stacked)
    w1, w2 = w13_base_weights(x, lora_b_stacked, experts)
    wrapper.add_lora_w13(
        y, x, expand_shared(lora_a_stacked, experts), tuple(lora_b_stacked), topk_ids, topk_weights, expert_map,
        w1, w2, num_tokens, top_k, lora_a_stacked[0].size(0), adapter_enabled, experts, top_k, len(lora_a_stacked),
        False,  # fully_sharded: offset is 0
        False,  # use_tuned_config
        add_inputs=add_inputs,
    )  # fmt: skip


def add_lora_w2(wrapper, y, x, lora_a_stacked, lora_b_stacked, topk_ids, topk_weights, adapter_enabled, *,
                expert_map=None, offset: int = 0, add_inputs: bool = True) -> None:
    """The neutral ``add_lora_w2``: w13's alignment recomputed, then ``wrapper.add_lora_w2``."""
    shard_size = lora_b_stacked[0].size(-2)
    if (reason := offset_reason(W2, offset, shard_size, add_inputs)) is not None:
        raise NotImplementedError(reason)  # a script's call: the runner refuses such cases before
    tp_rank = w2_tp_rank(offset, shard_size)
    fully_sharded = offset > 0
    num_tokens, top_k = topk_ids.shape
    experts = local_num_experts(lora_a_stacked, lora_b_stacked)
    max_loras = lora_a_stacked[0].size(0)
    w1, w2 = w2_base_weights(y, x, experts)
    # As add_lora_w13 aligns for both projections of the layer (same w1, w2, num_tokens, dtype): the w2
    # shrink config it will look up has the same BLOCK_SIZE_M, which the kernel asserts.
    block_size = alignment_block_size(w1, w2, lora_a_stacked[0].size(-2), top_k, x.dtype, num_tokens)
    naive = naive_block_assignment(fully_sharded, expert_map, num_tokens, top_k, experts, max_loras)
    token_lora_mapping, sorted_ids, expert_ids, padded = wrapper.moe_lora_align_block_size(
        topk_ids, num_tokens, block_size, experts, max_loras, adapter_enabled, expert_map, naive_block_assignment=naive
    )
    with single_rank_tensor_parallel() if fully_sharded else contextlib.nullcontext():
        wrapper.add_lora_w2(
            y, x, tuple(lora_a_stacked), expand_shared(lora_b_stacked, experts), topk_weights, sorted_ids, expert_ids,
            padded, token_lora_mapping, num_tokens, w1, w2, top_k, max_loras, adapter_enabled, top_k, fully_sharded,
            tp_rank,
            False,  # use_tuned_config
            add_inputs=add_inputs,
        )  # fmt: skip


# -- one rank's tensor-parallel group ------------------------------------------------------------


@contextlib.contextmanager
def single_rank_tensor_parallel() -> Iterator[None]:
    """vLLM's tensor-parallel group of one rank, for the duration of a fully sharded call.

    ``tensor_model_parallel_all_reduce``/``all_gather`` return their input at world size 1, but reach
    for the group first (``get_tp_group()`` asserts it exists). An existing group (a vLLM engine's in
    this process) is used as it is; one of another size cannot be this rank's alone: not supported.
    What this sets up it tears down, so no distributed state outlives the call.
    """
    from vllm.distributed import parallel_state

    if parallel_state.model_parallel_is_initialized():
        size = parallel_state.get_tensor_model_parallel_world_size()
        if size != 1:
            raise NotImplementedError(f"this process's vLLM tensor-parallel group has {size} ranks; the suite runs one")
        yield
        return
    had_torch_group = torch.distributed.is_available() and torch.distributed.is_initialized()
    had_world = parallel_state._WORLD is not None  # get_world_group() would assert instead of answering
    with tempfile.TemporaryDirectory(prefix="lora-conformance-tp-") as scratch:
        from vllm.config import set_current_vllm_config

        with set_current_vllm_config(_default_vllm_config()):  # initialize_model_parallel reads the current config
            parallel_state.init_distributed_environment(
                world_size=1, rank=0, distributed_init_method=f"file://{os.path.join(scratch, 'store')}",
                local_rank=0, backend="gloo",
            )  # fmt: skip
            parallel_state.initialize_model_parallel(1, 1)
        try:
            yield
        finally:
            parallel_state.destroy_model_parallel()
            if not (had_torch_group or had_world):
                parallel_state.destroy_distributed_environment()


@functools.cache
def _default_vllm_config() -> Any:
    from vllm.config import VllmConfig

    return VllmConfig()  # one parallel config of one rank: no model, no device work
