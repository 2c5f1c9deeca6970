"""vLLM 0.34's LoRA layers whose code is more than one wrapper call: wrapper-level ops of their own.

Each is a layer's forward over the wrapper methods, as vLLM 0.34 writes it, with no PunicaWrapper method
of its own (like ``token_classification_head``), so a target gets it from the layer's code over its own
wrapper methods (``conformance.targets.vllm034_layers``) and is judged on those methods at the layer's
shapes. Their references are ``conformance/reference/grouped_lora.py``, ``fp32_output.py`` and
``embed_scale.py``:

* ``grouped_lora_linear`` (``DeepseekV4GroupedWoAWithLoRA``): ``G`` head groups (the case's slices, all as
  wide as ``o_lora_rank``), one LoRA-A for every group, each group its own LoRA-B. ``x`` is ``[T, G, H]``;
  the output is kept as ``[T, G·N]`` and handed over as a ``[T, G, N]`` view, so the verdict names the group
  (its slice) of a wrong column;
* ``fp32_output_lora_linear`` (``DeepseekV4CompressorKVScoreWithLoRA``): the packed ``wkv`` / ``wgate``
  (two slices) over a float32 base output, the delta made in a zeroed buffer of the LoRA dtype and added;
* ``scaled_embedding_lora`` (``VocabParallelEmbeddingWithLoRA`` of a scaled embedding): the adapter's LoRA-B
  and the embedding's ``embed_scale``, folded once when the adapter is set, then ``add_lora_embedding``.
"""

from __future__ import annotations

import torch

from conformance.cases.case import Case
from conformance.cases.values import activations, lora_a_stack, lora_b_stack
from conformance.reference import PunicaWrapperReference

from .kernel import expand_written
from .level import Level
from .spec import OpCall, OpSpec, Tensors
from .wrapper import all_columns_written, embedding_values

MAX_GROUPS = 8  # DeepSeek-V4's wo_a has 8 head groups per rank at tensor parallel 1 (n_local_groups)


def _stacks(t: Tensors, prefix: str, count: int) -> tuple[torch.Tensor, ...]:
    return tuple(t[f"{prefix}.{s}"] for s in range(count))


def grouped_values(case: Case, gen: torch.Generator) -> Tensors:
    groups, width = case.num_slices, case.output_slices[0]
    values = {"x": activations(gen, case, (case.num_tokens, groups, case.hidden_size), case.torch_dtype),
              "lora_a.0": lora_a_stack(gen, case)}
    for g in range(groups):
        values[f"lora_b.{g}"] = lora_b_stack(gen, case, width)
    values["out"] = activations(gen, case, (case.num_tokens, groups * width), case.torch_dtype)
    return values


def fp32_output_values(case: Case, gen: torch.Generator) -> Tensors:
    values = {"x": activations(gen, case, (case.num_tokens, case.hidden_size), case.torch_dtype)}
    for s, width in enumerate(case.output_slices):
        values[f"lora_a.{s}"] = lora_a_stack(gen, case)
        values[f"lora_b.{s}"] = lora_b_stack(gen, case, width)
    values["out"] = activations(gen, case, (case.num_tokens, case.output_width), torch.float32)  # the float32 base output
    return values


def _grouped_lora_linear(case: Case, t: Tensors, device) -> OpCall:
    out = t["out"].view(case.num_tokens, case.num_slices, case.output_slices[0])
    return OpCall((out, t["x"], t["lora_a.0"], _stacks(t, "lora_b", case.num_slices), case.scale), {})


def _fp32_output_lora_linear(case: Case, t: Tensors, device) -> OpCall:
    stacks = (_stacks(t, "lora_a", case.num_slices), _stacks(t, "lora_b", case.num_slices))
    return OpCall((t["out"], t["x"], *stacks, case.scale, case.output_slices), {})


def _scaled_embedding_lora(case: Case, t: Tensors, device) -> OpCall:
    return OpCall((t["out"], t["x"], t["lora_b.0"], case.embed_scale or None, case.add_inputs), {})


LAYER_OP_SPECS = (
    OpSpec(
        "grouped_lora_linear", Level.WRAPPER, "y[t, g] += scale · (x[t, g] @ A[l]ᵀ) @ B_g[l]ᵀ: head groups sharing LoRA-A, "
        "each its own LoRA-B (DeepSeek-V4's wo_a)",
        frozenset({"hidden", "widths", "slices", "scale", "w4d"}), grouped_values, _grouped_lora_linear, expand_written,
        PunicaWrapperReference.grouped_lora_linear, max_slices=MAX_GROUPS, composed_of=("add_lora_linear",),
        families=("grouped_lora_a",),
    ),
    OpSpec(
        "fp32_output_lora_linear", Level.WRAPPER, "y_fp32 += round_lora_dtype(scale · (x @ A_s[l]ᵀ) @ B_s[l]ᵀ), packed slices "
        "(DeepSeek-V4's compressor)",
        frozenset({"hidden", "widths", "slices", "scale", "w4d"}), fp32_output_values, _fp32_output_lora_linear, expand_written,
        PunicaWrapperReference.fp32_output_lora_linear, max_slices=2, composed_of=("add_lora_linear",), families=("fp32_output",),
        delta_in_case_dtype=True,
    ),
    OpSpec(
        "scaled_embedding_lora", Level.WRAPPER, "y (+)= x @ (embed_scale · B[slot])ᵀ: embed_scale folded into LoRA-B, then "
        "add_lora_embedding",
        frozenset({"widths", "add_inputs", "embed_scale", "w4d"}), embedding_values, _scaled_embedding_lora, all_columns_written,
        PunicaWrapperReference.scaled_embedding_lora, composed_of=("add_lora_embedding",), families=("embed_scale",),
    ),
)
