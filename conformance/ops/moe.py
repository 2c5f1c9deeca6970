"""The fused-MoE LoRA ops (docs/moe.md): two kernels and two wrapper methods, as data.

* ``fused_moe_lora`` (kernel): vLLM's Triton op, fed block-aligned metadata from the reference's
  ``moe_lora_align_block_size`` (or the naive form), ``mul_routed_weight`` drawn both ways;
* ``fused_moe_lora_fp8`` (kernel): the same call on fp8 e4m3fn activations and LoRA stacks with float32
  scales per (slot, expert), per output channel or per block (``fp8_values``), aimed at by the fp8
  families only; the intermediate stays in the output dtype (no ``expand_act_scale``) and the op adds;
* ``moe_lora_align_block_size`` (kernel): judged by its invariants, not against one output;
* ``add_lora_w13`` / ``add_lora_w2`` (wrapper): the suite's hardware-neutral contract; slots come from
  ``update_metadata`` like every wrapper op.

An MoE op's output ``y`` is ``[T, top_k, W]``; the suite keeps it as ``[T·top_k, W]`` (one row per
(token, choice) pair, ``rows="pairs"``) and hands the target a ``[T, top_k, W]`` view of it, so the
verdict names pairs and their slots. A shared stack (expert dim 1) is w13's LoRA-A or w2's LoRA-B, as
in vLLM's shared-expert LoRA; the kernel receives it expanded with stride 0, as vLLM's layer passes it.
"""

from __future__ import annotations

import torch

import conformance.cases.fp8_values as fp8_values
from conformance import reference
from conformance.cases.case import Case
from conformance.cases.values import activations, moe_lora_a_stack, moe_lora_b_stack, routing_weights
from conformance.reference import LoRAKernelMeta, PunicaWrapperReference, aligned_buffers, aligned_sizes, alignment_problems

from .kernel import FP8_FAMILIES
from .level import Level
from .spec import OpCall, OpSpec, Tensors


def input_rows(case: Case) -> int:
    """Rows of the op's input: one per pair when the routing weight is applied (w2), else one per token."""
    return case.num_tokens * case.top_k if case.routed_weight else case.num_tokens


def _shared_side(case: Case) -> str | None:
    """Which stack a shared-expert case shares: w13's LoRA-A, or (routed, w2) LoRA-B."""
    if not case.shared_experts:
        return None
    return "b" if case.routed_weight else "a"


# -- values ------------------------------------------------------------------------------------


def routing_values(case: Case, gen: torch.Generator) -> Tensors:
    enabled = torch.ones(case.num_slots + 1, dtype=torch.int32)
    enabled[list(case.disabled_slots)] = 0
    enabled[case.num_slots] = 0  # vLLM's adapter_enabled has max_loras + 1 entries; the last is never a slot
    values = {
        "topk_ids": torch.tensor(case.topk_ids, dtype=torch.int32).reshape(case.num_tokens, case.top_k),
        "topk_weights": routing_weights(gen, case),
        "adapter_enabled": enabled,
    }
    if case.expert_map:
        values["expert_map"] = torch.tensor(case.expert_map, dtype=torch.int32)
    return values


def moe_values(case: Case, gen: torch.Generator) -> Tensors:
    values = routing_values(case, gen)
    values["x"] = activations(gen, case, (input_rows(case), case.hidden_size), case.torch_dtype)
    shared = _shared_side(case)
    for s, width in enumerate(case.output_slices):
        values[f"lora_a.{s}"] = moe_lora_a_stack(gen, case, 1 if shared == "a" else case.num_experts)
        values[f"lora_b.{s}"] = moe_lora_b_stack(gen, case, width, 1 if shared == "b" else case.num_experts)
    values["out"] = activations(gen, case, (case.num_tokens * case.top_k, case.output_width), case.torch_dtype)
    return values


def fp8_moe_values(case: Case, gen: torch.Generator) -> Tensors:
    """The routing, fp8 activations and per-(slot, expert) LoRA codes with their scales (``fp8_values``); drawn
    after the routing, as ``moe_values`` draws, so the same case has the same routing in both ops."""
    values = routing_values(case, gen)
    values["x"], values["act_scale"] = fp8_values.activations(gen, case, (input_rows(case), case.hidden_size))
    for s, width in enumerate(case.output_slices):
        values[f"lora_a.{s}"], values[f"lora_a_scale.{s}"] = fp8_values.moe_lora_a(gen, case)
        values[f"lora_b.{s}"], values[f"lora_b_scale.{s}"] = fp8_values.moe_lora_b(gen, case, width)
    values["out"] = activations(gen, case, (case.num_tokens * case.top_k, case.output_width), case.torch_dtype)
    return values


def alignment_values(case: Case, gen: torch.Generator) -> Tensors:
    values = routing_values(case, gen)
    del values["topk_weights"]
    sorted_ids, expert_ids, padded, _, _ = aligned_buffers(case.num_tokens * case.top_k, case.global_experts, case.block_size, case.num_slots, "cpu")
    values.update(sorted_token_ids=sorted_ids, expert_ids=expert_ids, num_tokens_post_pad=padded)
    return values


# -- calls -------------------------------------------------------------------------------------


def _stacks(t: Tensors, prefix: str, count: int) -> tuple[torch.Tensor, ...]:
    return tuple(t[f"{prefix}.{s}"] for s in range(count))


def _output_view(case: Case, t: Tensors) -> torch.Tensor:
    return t["out"].view(case.num_tokens, case.top_k, case.output_width)


def _wrapper_call(case: Case, t: Tensors, device) -> OpCall:
    args = (
        _output_view(case, t), t["x"], _stacks(t, "lora_a", case.num_slices), _stacks(t, "lora_b", case.num_slices),
        t["topk_ids"], t["topk_weights"], t["adapter_enabled"],
    )
    return OpCall(args, {"expert_map": t.get("expert_map"), "offset": case.offset_start, "add_inputs": case.add_inputs})


def token_lora_mapping(case: Case, device) -> torch.Tensor:
    return torch.tensor(case.token_slots, dtype=torch.int32, device=device)


def lora_ids(case: Case, device) -> torch.Tensor:
    """The active slots, increasing, −1 padded to ``L + 1`` (vLLM's ``LoRAKernelMeta.active_lora_ids``)."""
    return LoRAKernelMeta.build(torch.tensor(case.token_slots), case.num_slots).active_lora_ids.to(device)


def kernel_metadata(case: Case, t: Tensors, device) -> tuple:
    """``(sorted_token_ids [L, P] | None, expert_ids, num_tokens_post_padded | None)`` for ``fused_moe_lora``.

    Block-aligned by the reference's ``moe_lora_align_block_size`` (a correct alignment: the kernel is
    judged, not the alignment), or the naive form: ``topk_ids.flatten()`` as the experts, no sorted ids.
    """
    if case.naive_blocks:  # the pairs' local experts (vLLM uses the naive form without an expert_map only)
        experts = t["topk_ids"].reshape(-1).long()
        if "expert_map" in t:
            experts = t["expert_map"].long()[experts]
        return None, experts.to(torch.int32), None
    sorted_ids, expert_ids, padded, blocks, per_slot = aligned_buffers(
        case.num_tokens * case.top_k, case.global_experts, case.block_size, case.num_slots, "cpu"
    )
    reference.moe_lora_align_block_size(
        t["topk_ids"].cpu(), token_lora_mapping(case, "cpu"), case.global_experts, case.block_size, case.num_slots,
        per_slot, blocks, sorted_ids, expert_ids, padded, t["adapter_enabled"].cpu(), lora_ids(case, "cpu"),
        t["expert_map"].cpu() if "expert_map" in t else None,
    )
    return sorted_ids.view(case.num_slots, -1).to(device), expert_ids.view(case.num_slots, -1).to(device), padded.to(device)


def _expanded(stacks: tuple[torch.Tensor, ...], experts: int) -> list[torch.Tensor]:
    """Shared stacks as vLLM's layer hands them to the kernel: expanded to every expert with stride 0."""
    return [s.expand(-1, experts, -1, -1) if s.size(1) == 1 else s for s in stacks]


def _fused_moe_lora(case: Case, t: Tensors, device) -> OpCall:
    sorted_ids, expert_ids, padded = kernel_metadata(case, t, device)
    ids = lora_ids(case, device)
    tiles = (case.block_size, 64, 32, 8, 4, 3, 1) * 2  # shrink and expand: BLOCK_M, N, K, GROUP_M, warps, stages, split_k
    args = (
        _output_view(case, t), t["x"],
        _expanded(_stacks(t, "lora_a", case.num_slices), case.num_experts),
        _expanded(_stacks(t, "lora_b", case.num_slices), case.num_experts),
        t["topk_weights"], sorted_ids, expert_ids, padded, token_lora_mapping(case, device), case.max_rank, case.top_k,
        ids, torch.tensor([ids.numel()]), t["adapter_enabled"], *tiles,
        case.routed_weight, case.offset_start > 0, case.offset_start, case.add_inputs,
    )  # fmt: skip
    return OpCall(args, {})


def _fused_moe_lora_fp8(case: Case, t: Tensors, device) -> OpCall:
    """vLLM's argument order: ``fused_moe_lora``'s up to the tiles, then the weight scales, ``shrink_act_scale``,
    ``expand_act_scale`` (None: vLLM's intermediate is a 16-bit buffer, no fp8 codes to scale),
    ``mul_routed_weight``, ``fully_sharded``, ``offset``, the quantization flags and ``block_shape =
    [group_n, group_k]``. No ``add_inputs``: the op always adds. ``num_active_loras`` is an int here."""
    sorted_ids, expert_ids, padded = kernel_metadata(case, t, device)
    ids = lora_ids(case, device)
    tiles = (case.block_size, 64, 32, 8, 4, 3, 1) * 2
    block_shape = [case.group_n, case.group_k] if case.fp8_scales == "block" else None
    args = (
        _output_view(case, t), t["x"], list(_stacks(t, "lora_a", case.num_slices)), list(_stacks(t, "lora_b", case.num_slices)),
        t["topk_weights"], sorted_ids, expert_ids, padded, token_lora_mapping(case, device), case.max_rank, case.top_k,
        ids, ids.numel(), t["adapter_enabled"], *tiles,
        list(_stacks(t, "lora_a_scale", case.num_slices)), list(_stacks(t, "lora_b_scale", case.num_slices)), t["act_scale"], None,
        case.routed_weight, case.offset_start > 0, case.offset_start, True, False, False, case.fp8_scales == "channel", block_shape,
    )  # fmt: skip
    return OpCall(args, {})


def _alignment_sizes(case: Case) -> tuple[int, int]:
    return aligned_sizes(case.num_tokens * case.top_k, case.global_experts, case.block_size)


def _moe_lora_align_block_size(case: Case, t: Tensors, device) -> OpCall:
    per_slot, blocks = _alignment_sizes(case)
    args = (
        t["topk_ids"], token_lora_mapping(case, device), case.global_experts, case.block_size, case.num_slots, per_slot, blocks,
        t["sorted_token_ids"], t["expert_ids"], t["num_tokens_post_pad"], t["adapter_enabled"], lora_ids(case, device),
        t.get("expert_map"),
    )  # fmt: skip
    return OpCall(args, {})


# -- written regions and the alignment's invariants --------------------------------------------


def served_pairs(case: Case) -> torch.Tensor:
    """bool ``[T·top_k]``: the pairs an MoE op writes (an enabled slot, a local expert)."""
    disabled = set(case.disabled_slots)
    served = [
        slot != -1 and slot not in disabled and case.local_expert(expert) != -1
        for slot, ids in zip(case.token_slots, case.topk_ids)
        for expert in ids
    ]
    return torch.tensor(served, dtype=torch.bool)


def moe_written(case: Case) -> torch.Tensor:
    columns = torch.zeros(case.output_width, dtype=torch.bool)
    columns[case.offset_start : case.offset_start + sum(case.output_slices)] = True
    return served_pairs(case)[:, None] & columns[None, :]


def every_element_of_sorted_ids(case: Case) -> torch.Tensor:
    return torch.ones(case.num_slots * _alignment_sizes(case)[0], dtype=torch.bool)


def check_alignment(case: Case, after: Tensors, values: Tensors) -> list[tuple[int, str]]:
    return alignment_problems(
        values["topk_ids"], token_lora_mapping(case, "cpu"), values["adapter_enabled"], values.get("expert_map"), case.block_size,
        after["sorted_token_ids"], after["expert_ids"], after["num_tokens_post_pad"],
    )  # fmt: skip


MOE_KNOBS = frozenset({"routing", "hidden", "widths", "offset", "wide", "add_inputs"})
# lora: vLLM's GPU wrapper aligns each slot's pairs into blocks, then walks them; every other composition gives
# one expert per pair (the naive block assignment), as bgmv takes one index per row (vLLM's CPU wrapper has no
# MoE LoRA, and no dense kernel family can stand in for fused_moe_lora).
_NAIVE_MOE = ("fused_moe_lora",)
MOE_COMPOSITIONS = {"lora": ("moe_lora_align_block_size", "fused_moe_lora"), "classic": _NAIVE_MOE, "bgmv": _NAIVE_MOE, "sgmv": _NAIVE_MOE}

FP8_MOE_SPEC = OpSpec(
    "fused_moe_lora_fp8", Level.KERNEL,
    "y[t, k, offset + s·N …] += [w_tk ·] round(x̂ @ Â_s[l, e]ᵀ) @ B̂_s[l, e]ᵀ, x̂ Â B̂ fp8 codes times their scales",
    (MOE_KNOBS - {"add_inputs"}) | {"gate_up", "routed_weight", "blocks", "naive", "fp8_scales"}, fp8_moe_values, _fused_moe_lora_fp8,
    moe_written, reference.fused_moe_lora_fp8, max_slices=2, rows="pairs", families=FP8_FAMILIES,
)

MOE_OP_SPECS = (
    OpSpec(
        "fused_moe_lora", Level.KERNEL,
        "y[t, k, offset + s·N …] (+)= [w_tk ·] (x @ A_s[l, e]ᵀ) @ B_s[l, e]ᵀ from block-aligned (or naive) metadata",
        MOE_KNOBS | {"gate_up", "routed_weight", "blocks", "naive"}, moe_values, _fused_moe_lora, moe_written, reference.fused_moe_lora,
        max_slices=2, rows="pairs",
    ),
    OpSpec(
        "moe_lora_align_block_size", Level.KERNEL,
        "each slot's (token, choice) pairs sorted by local expert into blocks (judged by its invariants)",
        frozenset({"routing", "blocks"}), alignment_values, _moe_lora_align_block_size, every_element_of_sorted_ids,
        reference.moe_lora_align_block_size, output="sorted_token_ids", rows="pairs", check=check_alignment,
        extra_outputs=("expert_ids", "num_tokens_post_pad"), routed_weight=False, output_kind="index",
    ),
    OpSpec(
        "add_lora_w13", Level.WRAPPER, "y[t, k, offset + s·N …] (+)= (x[t] @ A_s[l, e]ᵀ) @ B_s[l, e]ᵀ, gate/up slices or one fused",
        MOE_KNOBS | {"gate_up"}, moe_values, _wrapper_call, moe_written, PunicaWrapperReference.add_lora_w13, max_slices=2, rows="pairs",
        routed_weight=False, compositions=MOE_COMPOSITIONS,
    ),
    OpSpec(
        "add_lora_w2", Level.WRAPPER, "y[t, k, offset …] (+)= w_tk · (x[t·top_k + k] @ A[l, e]ᵀ) @ B[l, e]ᵀ",
        MOE_KNOBS, moe_values, _wrapper_call, moe_written, PunicaWrapperReference.add_lora_w2, rows="pairs", routed_weight=True,
        compositions=MOE_COMPOSITIONS,
    ),
    FP8_MOE_SPEC,  # last: the ops before it draw as they did
)
