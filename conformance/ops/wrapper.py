"""The wrapper-level ops (design level 2): vLLM's PunicaWrapper methods, fed by a mapping.

Before each call the runner hands the target ``update_metadata(case_mapping(case))``. Stacks are
passed as tuples (one per slice) exactly as vLLM's LoRA layers pass them.

``apply_lora_full_linear`` (vLLM's classification heads) is the one op that *replaces* rows: a
whole per-adapter linear layer over the sampled rows (one per request), skipped for rows of slot −1
and for slots whose module is disabled. Its disabled slots are the case's ``disabled_slots`` (the
field the MoE ops read as ``adapter_enabled`` 0), handed over as vLLM's bool ``module_enabled``.

``token_classification_head`` is the same replacement over the *tokens*: vLLM 0.33's
``TokenClassificationHeadWithLoRA`` (``vllm/lora/layers/classifier.py``). PunicaWrapper has no method
of that name; the layer calls ``add_shrink`` with the whole head weight as a one-slice 4-D stack
``[L, 1, P, H]`` at scale 1 into a zeroed float32 ``[1, T, P]`` buffer, adds the bias and picks each
token's row by ``token_lora_indices`` and ``full_module_enabled`` (``torch.where``). ``add_shrink``
cases draw LoRA ranks and never judge that pick, and ``P`` is ``max_lora_cls_labels``, any width, so
the call is an op of its own, composed of ``add_shrink``: any target with ``add_shrink`` runs it, and a
target's own ``add_shrink`` is judged at the head's widths (2, 3, 9, 17 … 1,000 labels).
"""

from __future__ import annotations

import torch

from conformance.cases.case import Case
from conformance.cases.values import activations, bias_stack, full_weight_stack, lora_a_stack, lora_b_stack
from conformance.reference import LoRAMapping, PunicaWrapperReference
from conformance.reference.packed_modules import fill_packed_slices

from .kernel import MAX_SLICES, expand_values, expand_written, shrink_values, shrink_written
from .level import Level
from .spec import OpCall, OpSpec, Tensors, rows_and_columns


def case_mapping(case: Case) -> LoRAMapping:
    return LoRAMapping(
        token_slots=case.token_slots,
        sampled_slots=case.sampled_slots,
        seq_lens=case.seq_lens,
        is_prefill=case.is_prefill,
        num_slots=case.num_slots,
    )


def _stacks(t: Tensors, prefix: str, count: int) -> tuple[torch.Tensor, ...]:
    return tuple(t[f"{prefix}.{s}"] for s in range(count))


def _bias_kwargs(case: Case, t: Tensors) -> dict:
    return {"lora_bias_stacked": _stacks(t, "bias", case.num_slices)} if case.bias else {}


# -- values ------------------------------------------------------------------------------------


def expand_with_bias_values(case: Case, gen: torch.Generator) -> Tensors:
    values = expand_values(case, gen)
    if case.bias:
        for s, width in enumerate(case.output_slices):
            values[f"bias.{s}"] = bias_stack(gen, case, width)
    return values


def linear_values(case: Case, gen: torch.Generator) -> Tensors:
    values = {"x": activations(gen, case, (case.num_tokens, case.hidden_size), case.torch_dtype)}
    for s, width in enumerate(case.output_slices):
        values[f"lora_a.{s}"] = lora_a_stack(gen, case)
        values[f"lora_b.{s}"] = lora_b_stack(gen, case, width)
        if case.bias:
            values[f"bias.{s}"] = bias_stack(gen, case, width)
    values["out"] = activations(gen, case, (case.num_tokens, case.output_width), case.torch_dtype)
    if case.absent_slices or case.repeated_slices:  # after every draw: the other cases' values stay as they were
        for prefix in ("lora_a", "lora_b"):
            stacks = fill_packed_slices(list(_stacks(values, prefix, case.num_slices)), case.absent_slices, case.repeated_slices)
            values.update({f"{prefix}.{s}": stack for s, stack in enumerate(stacks)})
    return values


def embedding_values(case: Case, gen: torch.Generator) -> Tensors:
    # x holds the LoRA-A rows the embedding layer looked up per token: [T, R] in the weight dtype.
    return {
        "x": activations(gen, case, (case.num_tokens, case.max_rank), case.torch_dtype),
        "lora_b.0": lora_b_stack(gen, case, case.output_width),
        "out": activations(gen, case, (case.num_tokens, case.output_width), case.torch_dtype),
    }


def logits_values(case: Case, gen: torch.Generator) -> Tensors:
    rows = len(case.sampled_slots)
    return {
        "x": activations(gen, case, (rows, case.hidden_size), case.torch_dtype),
        "lora_a.0": lora_a_stack(gen, case),
        "lora_b.0": lora_b_stack(gen, case, case.output_width),
        "out": activations(gen, case, (rows, case.output_width), case.torch_dtype),
    }


def full_linear_values(case: Case, gen: torch.Generator) -> Tensors:
    rows, width = len(case.sampled_slots), case.output_width
    enabled = torch.ones(case.num_slots, dtype=torch.bool)
    enabled[list(case.disabled_slots)] = False
    bias = activations(gen, case, (case.num_slots, width), case.torch_dtype)
    return {
        "x": activations(gen, case, (rows, case.hidden_size), case.torch_dtype),
        "weight.0": full_weight_stack(gen, case, width),
        # vLLM's layer always passes a [L, P] bias, zero for a head without one (the "bias" knob off)
        "bias.0": bias if case.bias else torch.zeros_like(bias),
        "module_enabled": enabled,
        "out": activations(gen, case, (rows, width), case.torch_dtype),
    }


def token_head_values(case: Case, gen: torch.Generator) -> Tensors:
    """As vLLM's token head holds them: the stack always 4-D, a bias row per slot (zero where a saved head has
    none, which the random rows here cover), and the base classifier's output ``[T, P]`` as ``out``."""
    tokens, width = case.num_tokens, case.output_width
    enabled = torch.ones(case.num_slots, dtype=torch.bool)
    enabled[list(case.disabled_slots)] = False
    return {
        "x": activations(gen, case, (tokens, case.hidden_size), case.torch_dtype),
        "weight.0": full_weight_stack(gen, case, width).unsqueeze(1).contiguous(),
        "bias.0": activations(gen, case, (case.num_slots, width), case.torch_dtype),
        "module_enabled": enabled,
        "out": activations(gen, case, (tokens, width), case.torch_dtype),
    }


# -- calls -------------------------------------------------------------------------------------


def _add_shrink(case: Case, t: Tensors, device) -> OpCall:
    return OpCall((t["out"], t["x"], _stacks(t, "lora_a", case.num_slices), case.scale), {})


def _add_expand(case: Case, t: Tensors, device) -> OpCall:
    args = (t["out"], t["x"], _stacks(t, "lora_b", case.num_slices), case.output_slices, case.offset_start, case.add_inputs)
    return OpCall(args, _bias_kwargs(case, t))


def _add_lora_linear(case: Case, t: Tensors, device) -> OpCall:
    args = (
        t["out"],
        t["x"],
        _stacks(t, "lora_a", case.num_slices),
        _stacks(t, "lora_b", case.num_slices),
        case.scale,
        case.output_slices,
    )
    # vLLM's layers pass add_inputs only to ask for the LoRA-only output (False, the GPU wrapper's
    # dual-stream path, where the base runs on another stream); True is the default they leave unsaid.
    add_inputs = {} if case.add_inputs else {"add_inputs": False}
    return OpCall(args, _bias_kwargs(case, t) | add_inputs)


def _add_lora_embedding(case: Case, t: Tensors, device) -> OpCall:
    return OpCall((t["out"], t["x"], t["lora_b.0"], case.add_inputs), {})


def _add_lora_logits(case: Case, t: Tensors, device) -> OpCall:
    return OpCall((t["out"], t["x"], t["lora_a.0"], t["lora_b.0"], case.scale), {})


def _apply_lora_full_linear(case: Case, t: Tensors, device) -> OpCall:
    return OpCall((t["out"], t["x"], t["weight.0"], t["bias.0"], t["module_enabled"]), {})


def _token_classification_head(case: Case, t: Tensors, device) -> OpCall:
    return OpCall((t["out"], t["x"], t["weight.0"], t["bias.0"], t["module_enabled"]), {})


# -- written regions ---------------------------------------------------------------------------


def all_columns_written(case: Case) -> torch.Tensor:
    return rows_and_columns(case.token_slots, case.output_width, 0, case.output_width)


def logits_written(case: Case) -> torch.Tensor:
    return rows_and_columns(case.sampled_slots, case.output_width, 0, case.output_width)


def full_linear_written(case: Case) -> torch.Tensor:
    """Sampled rows of a slot ≠ −1 whose module is enabled, every column (the row is replaced)."""
    disabled = set(case.disabled_slots)
    served = [s != -1 and s not in disabled for s in case.sampled_slots]
    return torch.tensor(served, dtype=torch.bool)[:, None].expand(-1, case.output_width).clone()


def token_head_written(case: Case) -> torch.Tensor:
    """Tokens of a slot ≠ −1 whose head is enabled, every label column (the row is replaced)."""
    disabled = set(case.disabled_slots)
    served = [s != -1 and s not in disabled for s in case.token_slots]
    return torch.tensor(served, dtype=torch.bool)[:, None].expand(-1, case.output_width).clone()


def _wrapper(name, summary, knobs, values, call, written, **fields) -> OpSpec:
    """A dense wrapper op's spec; its reference is ``PunicaWrapperReference.<name>``."""
    knobs = frozenset(knobs | {"prefill", "w4d"})
    return OpSpec(name, Level.WRAPPER, summary, knobs, values, call, written, getattr(PunicaWrapperReference, name), **fields)


WRAPPER_OP_SPECS = (
    _wrapper(
        "add_shrink", "y[s] += scale · x @ A_s[slot]ᵀ for every slice", {"hidden", "scale", "slices"}, shrink_values, _add_shrink,
        shrink_written, max_slices=MAX_SLICES, output_kind="buffer",
        compositions={"lora": ("lora_shrink",), "classic": ("sgmv_shrink", "bgmv_shrink"), "bgmv": ("bgmv_shrink",),
                      "sgmv": ("sgmv_shrink",)},
    ),
    _wrapper(
        "add_expand",
        "y[:, offset_start + Σ N_j ...] (+)= x[s] @ B_s[slot]ᵀ (+ bias) for every slice",
        {"slices", "widths", "offset", "wide", "add_inputs", "expand_input", "bias"},
        expand_with_bias_values, _add_expand, expand_written, max_slices=MAX_SLICES,
        compositions={"lora": ("lora_expand",), "classic": ("sgmv_expand_slice", "bgmv_expand_slice"),
                      "bgmv": ("bgmv_expand_slice",), "sgmv": ("sgmv_expand_slice",)},
    ),
    _wrapper(
        "add_lora_linear",
        "y (+)= scale · (x @ A_s[slot]ᵀ) @ B_s[slot]ᵀ (+ bias), packed slices",
        {"hidden", "scale", "slices", "widths", "bias", "add_inputs", "packed"},
        linear_values, _add_lora_linear, expand_written, max_slices=MAX_SLICES,
        composed_of=("add_shrink", "add_expand"),  # shrink into a zeroed float32 buffer, then expand it
    ),
    _wrapper(
        "add_lora_embedding", "y (+)= x @ B[slot]ᵀ for looked-up LoRA-A rows", {"widths", "add_inputs"}, embedding_values,
        _add_lora_embedding, all_columns_written,
        compositions={"lora": ("lora_expand",), "classic": ("sgmv_expand", "bgmv_expand"), "bgmv": ("bgmv_expand",),
                      "sgmv": ("sgmv_expand",)},
    ),
    _wrapper(
        "add_lora_logits", "logits += scale · (h @ A[slot]ᵀ) @ B[slot]ᵀ per sampled row", {"hidden", "widths", "scale", "spec_decode"},
        logits_values,
        _add_lora_logits, logits_written, rows="sampled",
        compositions={"lora": ("lora_shrink", "lora_expand"), "classic": ("bgmv_shrink", "bgmv_expand"),
                      "bgmv": ("bgmv_shrink", "bgmv_expand"), "sgmv": ("sgmv_shrink", "sgmv_expand")},
    ),
    _wrapper(
        "apply_lora_full_linear", "y[p] = x[p] @ W[slot]ᵀ + bias[slot] per sampled row of an enabled module (replaced)",
        {"hidden", "widths", "bias", "module_enabled"}, full_linear_values, _apply_lora_full_linear, full_linear_written,
        rows="sampled", output_kind="replace",
        # the whole per-slot weight shrunk at scale 1 into a float32 buffer, the bias added, the rows replaced
        compositions={"lora": ("lora_shrink",), "classic": ("bgmv_shrink",), "bgmv": ("bgmv_shrink",), "sgmv": ("sgmv_shrink",)},
    ),
    # Not through _wrapper: the layer always passes a 4-D stack and runs prefill (pooling) batches only, so
    # neither "w4d" nor "prefill" is a knob of this call; its corners are its own families.
    OpSpec(
        "token_classification_head", Level.WRAPPER,
        "y[t] = x[t] @ W[slot]ᵀ + bias[slot] per token of an adapter with a saved head (replaced): add_shrink, then the pick",
        frozenset({"hidden", "widths", "module_enabled"}), token_head_values, _token_classification_head, token_head_written,
        PunicaWrapperReference.token_classification_head, output_kind="replace", composed_of=("add_shrink",),
        families=("token_classification", "cls_labels_wide", "module_disabled", "allneg1", "neg1_one_slot", "long_batch"),
    ),
)
