"""The kernel-level ops (design level 1): the six classic bgmv/sgmv ops, lora_shrink/lora_expand and their fp8 forms.

bgmv ops take one slot per token; sgmv ops one slot per sequence (segments); lora_* ops the
token-sorted metadata built by ``conformance.reference.LoRAKernelMeta``. Shrink ops write a zeroed
float32 ``[.., T, R]`` buffer; expand ops write a ``[T, W]`` output in the case dtype.
"""

from __future__ import annotations

import functools

import torch

import conformance.cases.fp8_values as fp8_values
from conformance import reference
from conformance.cases.case import Case
from conformance.cases.values import activations, lora_a_stack, lora_b_stack
from conformance.reference import LoRAKernelMeta

from .level import Level
from .spec import OpCall, OpSpec, Tensors, row_mask, rows_and_columns

# -- values ------------------------------------------------------------------------------------


def shrink_values(case: Case, gen: torch.Generator) -> Tensors:
    values = {"x": activations(gen, case, (case.num_tokens, case.hidden_size), case.torch_dtype)}
    for s in range(case.num_slices):
        values[f"lora_a.{s}"] = lora_a_stack(gen, case)
    values["out"] = torch.zeros(case.num_slices, case.num_tokens, case.max_rank, dtype=torch.float32)
    return values


def expand_values(case: Case, gen: torch.Generator) -> Tensors:
    values = {
        "x": activations(gen, case, (case.num_slices, case.num_tokens, case.max_rank), case.expand_input_torch_dtype)
    }
    for s, width in enumerate(case.output_slices):
        values[f"lora_b.{s}"] = lora_b_stack(gen, case, width)
    values["out"] = activations(gen, case, (case.num_tokens, case.output_width), case.torch_dtype)
    return values


def fp8_shrink_values(case: Case, gen: torch.Generator) -> Tensors:
    """fp8 activations and LoRA-A codes with their scales (``conformance.cases.fp8_values``); the zeroed float32 buffer."""
    values = dict(zip(("x", "a_scale"), fp8_values.activations(gen, case, (case.num_tokens, case.hidden_size))))
    for s in range(case.num_slices):
        values[f"lora_a.{s}"], values[f"b_scale.{s}"] = fp8_values.lora_a(gen, case)
    values["out"] = torch.zeros(case.num_slices, case.num_tokens, case.max_rank, dtype=torch.float32)
    return values


def fp8_expand_values(case: Case, gen: torch.Generator) -> Tensors:
    """fp8 shrink results and LoRA-B codes with their scales (one a_scale for every slice, as vLLM reads it); the
    output in the case dtype."""
    values = dict(zip(("x", "a_scale"), fp8_values.activations(gen, case, (case.num_slices, case.num_tokens, case.max_rank))))
    for s, width in enumerate(case.output_slices):
        values[f"lora_b.{s}"], values[f"b_scale.{s}"] = fp8_values.lora_b(gen, case, width)
    values["out"] = activations(gen, case, (case.num_tokens, case.output_width), case.torch_dtype)
    return values


# -- metadata on the device --------------------------------------------------------------------


def token_indices(case: Case, device: torch.device) -> torch.Tensor:
    return torch.tensor(case.token_slots, dtype=torch.long, device=device)


def segment_args(case: Case, device: torch.device) -> tuple:
    """sgmv metadata with one segment per sequence: start locations, lengths, slots, then the sizes.

    The starts are the case's layout (``Case.segment_starts``: back to back from row 0 unless the case
    says otherwise), in metadata order. As vLLM passes them, ``max_seq_length`` is the longest segment
    and ``token_nums`` the rows of the input, covered by a segment or not.
    """
    return (
        torch.tensor(case.segment_starts, dtype=torch.long, device=device),
        torch.tensor(case.seq_lens, dtype=torch.long, device=device),
        torch.tensor(case.seq_slots, dtype=torch.long, device=device),
        len(case.seq_lens),
        max(case.seq_lens),
        case.num_tokens,
    )


@functools.lru_cache(maxsize=16)
def _kernel_meta(token_slots: tuple[int, ...], num_slots: int) -> LoRAKernelMeta:
    return LoRAKernelMeta.build(torch.tensor(token_slots), num_slots)


def kernel_meta_args(case: Case, device: torch.device) -> tuple:
    """The six metadata tensors of ``case``, copies of their own: built once per mapping (a case's oracle
    runs and calls share one), copied for each call, since a call may write what it is handed."""
    *on_device, no_lora_flag_cpu = _kernel_meta(case.token_slots, case.num_slots).meta_args()
    return (*(t.to(device, copy=True) for t in on_device), no_lora_flag_cpu.clone())


# -- calls -------------------------------------------------------------------------------------


def _bgmv_shrink(case: Case, t: Tensors, device) -> OpCall:
    return OpCall((t["x"], t["lora_a.0"], t["out"][0], token_indices(case, device), case.scale), {})


def _sgmv_shrink(case: Case, t: Tensors, device) -> OpCall:
    return OpCall((t["x"], t["lora_a.0"], t["out"][0], *segment_args(case, device), case.scale), {})


def _lora_shrink(case: Case, t: Tensors, device) -> OpCall:
    stacks = [t[f"lora_a.{s}"] for s in range(case.num_slices)]
    return OpCall((t["x"], stacks, t["out"], *kernel_meta_args(case, device), case.scale), {})


def _bgmv_expand(case: Case, t: Tensors, device) -> OpCall:
    return OpCall((t["x"][0], t["lora_b.0"], t["out"], token_indices(case, device), case.add_inputs), {})


def _bgmv_expand_slice(case: Case, t: Tensors, device) -> OpCall:
    args = (t["x"][0], t["lora_b.0"], t["out"], token_indices(case, device))
    return OpCall((*args, case.offset_start, case.output_slices[0], case.add_inputs), {})


def _sgmv_expand(case: Case, t: Tensors, device) -> OpCall:
    return OpCall((t["x"][0], t["lora_b.0"], t["out"], *segment_args(case, device), case.add_inputs), {})


def _sgmv_expand_slice(case: Case, t: Tensors, device) -> OpCall:
    args = (t["x"][0], t["lora_b.0"], t["out"], *segment_args(case, device))
    return OpCall((*args, case.offset_start, case.output_slices[0], case.add_inputs), {})


def _lora_expand(case: Case, t: Tensors, device) -> OpCall:
    stacks = [t[f"lora_b.{s}"] for s in range(case.num_slices)]
    args = (t["x"], stacks, t["out"], *kernel_meta_args(case, device))
    return OpCall((*args, case.offset_start, case.add_inputs), {})


def fp8_quantization_args(case: Case, t: Tensors) -> tuple:
    """vLLM's trailing fp8 arguments after the weight scales: ``a_scale, group_k, group_n, use_fp8_w8a8,
    per_channel_quant``. The suite always passes ``use_fp8_w8a8=True``: without it the kernels read no scale."""
    return (t["a_scale"], case.group_k, case.group_n, True, case.fp8_scales == "channel")


def num_active_loras(meta: tuple) -> int:
    """vLLM's ``num_active_loras`` (the fp8 kernels' grid over slots): every entry of ``lora_ids`` (the fifth
    metadata tensor), the metadata's default ``max_loras + 1``."""
    return meta[4].numel()


def _lora_shrink_fp8(case: Case, t: Tensors, device) -> OpCall:
    stacks = [t[f"lora_a.{s}"] for s in range(case.num_slices)]
    scales = [t[f"b_scale.{s}"] for s in range(case.num_slices)]
    meta = kernel_meta_args(case, device)
    args = (t["x"], stacks, t["out"], *meta, num_active_loras(meta), case.scale, scales)
    return OpCall((*args, *fp8_quantization_args(case, t)), {})


def _lora_expand_fp8(case: Case, t: Tensors, device) -> OpCall:
    stacks = [t[f"lora_b.{s}"] for s in range(case.num_slices)]
    scales = [t[f"b_scale.{s}"] for s in range(case.num_slices)]
    meta = kernel_meta_args(case, device)
    a_scale, group_k, group_n, w8a8, per_channel = fp8_quantization_args(case, t)
    args = (t["x"], stacks, t["out"], *meta, num_active_loras(meta), scales, a_scale, case.offset_start, case.add_inputs)
    return OpCall((*args, group_k, group_n, w8a8, per_channel), {})


# -- written regions ---------------------------------------------------------------------------


def shrink_written(case: Case) -> torch.Tensor:
    rows = row_mask(case.token_slots)[None, :, None]
    return rows.expand(case.num_slices, case.num_tokens, case.max_rank).clone()


def expand_written(case: Case) -> torch.Tensor:
    first = case.offset_start
    return rows_and_columns(case.token_slots, case.output_width, first, first + sum(case.output_slices))


def _kernel(name, summary, knobs, values, call, written, max_slices=1) -> OpSpec:
    """A dense kernel op's spec; its reference is ``conformance.reference.<name>``. A shrink (it fills the
    shrink buffer) writes a float32 buffer, an expand accumulates into the output."""
    knobs = frozenset(knobs | {"w4d"})
    output_kind = "buffer" if values is shrink_values else "accumulate"
    return OpSpec(
        name, Level.KERNEL, summary, knobs, values, call, written, getattr(reference, name), max_slices=max_slices,
        output_kind=output_kind,
    )


def _fp8_kernel(name, summary, knobs, values, call, written) -> OpSpec:
    """An fp8 kernel op's spec: like ``_kernel``'s, without the 4-D layout (vLLM's fp8 kernels take the weight
    scales' strides from 3-D stacks)."""
    output_kind = "buffer" if values is fp8_shrink_values else "accumulate"
    return OpSpec(name, Level.KERNEL, summary, frozenset(knobs), values, call, written, getattr(reference, name),
                  max_slices=MAX_SLICES, output_kind=output_kind, families=FP8_FAMILIES)


# The most slices one packed layer has: vLLM 0.33 fuses up to 7 projections into one QKV-like layer
# (and variable-slice merged column layers take 3 or more); the LoRA kernels loop over any count.
MAX_SLICES = 7

SHRINK_KNOBS = {"hidden", "scale"}
EXPAND_KNOBS = {"add_inputs", "expand_input", "wide", "widths"}
FP8_FAMILIES = ("fp8_tensor", "fp8_channel", "fp8_block")  # one per scale granularity (conformance.generator.families)
FP8_KNOBS = {"fp8_scales", "slices"}  # no w4d: vLLM's fp8 kernels read 3-D stacks and scales; slice widths are equal
SEGMENT_KNOBS = {"segments"}  # the sgmv ops read b_seq_start_loc: segments may lie anywhere in the rows

KERNEL_OP_SPECS = (
    _kernel("bgmv_shrink", "per-token LoRA-A product into a float32 buffer", SHRINK_KNOBS, shrink_values, _bgmv_shrink, shrink_written),
    _kernel("bgmv_expand", "per-token LoRA-B product into the first N columns", EXPAND_KNOBS, expand_values, _bgmv_expand, expand_written),
    _kernel("bgmv_expand_slice", "per-token LoRA-B product into a column slice", EXPAND_KNOBS | {"offset"}, expand_values, _bgmv_expand_slice, expand_written),
    _kernel("sgmv_shrink", "per-segment LoRA-A product into a float32 buffer", SHRINK_KNOBS | SEGMENT_KNOBS, shrink_values, _sgmv_shrink, shrink_written),
    _kernel("sgmv_expand", "per-segment LoRA-B product into the first N columns", EXPAND_KNOBS | SEGMENT_KNOBS, expand_values, _sgmv_expand, expand_written),
    _kernel("sgmv_expand_slice", "per-segment LoRA-B product into a column slice", EXPAND_KNOBS | {"offset"} | SEGMENT_KNOBS, expand_values, _sgmv_expand_slice, expand_written),
    _kernel("lora_shrink", "LoRA-A products of every slice from token-sorted metadata", SHRINK_KNOBS | {"slices"}, shrink_values, _lora_shrink, shrink_written, MAX_SLICES),
    _kernel("lora_expand", "LoRA-B products of every slice side by side from token-sorted metadata", EXPAND_KNOBS | {"offset", "slices"}, expand_values, _lora_expand, expand_written, MAX_SLICES),
    _fp8_kernel("lora_shrink_fp8", "lora_shrink on fp8 activations and weights with per-tensor, per-channel or block scales", SHRINK_KNOBS | FP8_KNOBS, fp8_shrink_values, _lora_shrink_fp8, shrink_written),
    _fp8_kernel("lora_expand_fp8", "lora_expand on fp8 inputs and weights with per-tensor, per-channel or block scales", {"add_inputs", "offset", "wide", "widths"} | FP8_KNOBS, fp8_expand_values, _lora_expand_fp8, expand_written),
)
