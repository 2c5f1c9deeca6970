"""The case knobs: what a case can vary, and what it holds where an op does not read the knob.

An op lists the knobs it reads (``OpSpec.knobs``); the generator draws a knob only for the ops that
read it and otherwise leaves its fields at the defaults below (``conformance.generator.strategies``),
so a case's features (``conformance.cases.features``) only name what matters for its op. Each
:class:`Knob` says what it varies, which :class:`~conformance.cases.case.Case` fields it sets, their
value when the op does not read it, and the features it can show. ``describe`` probes every knob
(``conformance.targets.describe.FEATURE_PROBES``); docs/cases.md shows this registry as a table
(``python -m conformance.targets ops-table knobs``).

Adding a knob: one :class:`Knob` here, the strategy step that draws it, and a ``describe`` probe.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any

from .case import Case

_CASE_FIELDS = {f.name: f for f in dataclasses.fields(Case)}


@dataclass(frozen=True)
class Knob:
    name: str
    doc: str  # one line: what turning the knob varies
    fields: tuple[str, ...]  # the Case fields it sets
    # Field → the value the generator leaves where the op does not read the knob. A field absent here
    # depends on other draws (the slice count, the widths); ``left`` then says what is left.
    defaults: Mapping[str, Any] = field(default_factory=dict, hash=False)
    features: tuple[str, ...] = ()  # the features (conformance.cases.features) it can show
    left: str = ""

    def __post_init__(self) -> None:
        unknown = [name for name in self.fields if name not in _CASE_FIELDS]
        if unknown:
            raise ValueError(f"knob {self.name}: {unknown} are not Case fields")
        if not set(self.defaults) <= set(self.fields):
            raise ValueError(f"knob {self.name}: defaults for fields it does not set: {sorted(set(self.defaults) - set(self.fields))}")
        if set(self.fields) - set(self.defaults) and not self.left:
            raise ValueError(f"knob {self.name}: say what is left of {sorted(set(self.fields) - set(self.defaults))} (``left``)")
        for name, value in self.defaults.items():
            declared = _CASE_FIELDS[name].default
            if declared is not dataclasses.MISSING and declared != value:
                # a case that does not read the knob must look like one made without the field
                raise ValueError(f"knob {self.name}: default {name}={value!r} differs from Case's {declared!r}")

    def default(self, field_name: str | None = None) -> Any:
        """The value of ``field_name`` (of the knob's only field, when omitted) where an op does not read the knob."""
        if field_name is None:
            (field_name,) = self.defaults
        return self.defaults[field_name]

    @property
    def when_not_read(self) -> str:
        """What a case of an op that does not read the knob holds, in words."""
        values = ", ".join(f"{name}={value!r}" for name, value in self.defaults.items())
        return "; ".join(part for part in (values, self.left) if part)


_KNOBS = (
    Knob("hidden", "the input features H of the shrink side (an MoE op's K)", ("hidden_size",), {"hidden_size": 16},
         features=("real_hidden", "odd_hidden")),
    Knob("widths", "the width N_s of each output slice (the columns the op writes); a shrink's columns are the rank",
         ("output_slices",), features=("unequal_slices", "real_hidden", "odd_hidden"), left="every slice 1 wide (an MoE op's one width is drawn all the same: moe_lora_align_block_size's draws predate the knob)"),
    Knob("slices", "several packed output slices (q, k, v …), each with its own stacks, up to the op's max slices",
         ("output_slices",), features=("multi_slice", "many_slices"), left="one slice"),
    Knob("offset", "the first column written (offset_start, slice_offset) > 0", ("offset_start",), {"offset_start": 0},
         features=("offset",)),
    Knob("wide", "columns beyond the written ones, which must stay untouched", ("output_width",),
         features=("wide_output",), left="output_width = offset_start + Σ output_slices"),
    Knob("add_inputs", "add_inputs=False: the written region is overwritten with the delta instead of added to",
         ("add_inputs",), {"add_inputs": True}, features=("no_add_inputs",)),
    Knob("scale", "a scale ≠ 1 multiplying the LoRA product", ("scale",), {"scale": 1.0}, features=("scaled",)),
    Knob("expand_input", "a float32 expand input (the shrink buffer), rounded to the weight dtype first",
         ("expand_input_dtype",), {"expand_input_dtype": None}, features=("fp32_input",)),
    Knob("bias", "a LoRA bias per slot, added after the LoRA-B product, unscaled", ("bias",), {"bias": False},
         features=("bias",)),
    Knob("w4d", "weight stacks in the layers' legacy 4-D layout [L, 1, rows, cols]", ("weights_4d",),
         {"weights_4d": False}, features=("w4d",)),
    Knob("prefill", "a decode batch (one token per sequence) besides prefill ones", ("is_prefill",), {"is_prefill": True},
         features=("decode",)),
    Knob("segments", "sgmv segments anywhere in the rows (b_seq_start_loc): out of row order, rows no segment covers",
         ("seq_starts", "num_rows"), {"seq_starts": (), "num_rows": 0},
         features=("seg_permuted", "seg_gap", "seg_late_start", "uncovered_rows")),
    Knob("module_enabled", "slots whose classification head is disabled (module_enabled, the token head's full_module_enabled, False)", ("disabled_slots",),
         {"disabled_slots": ()}, features=("module_disabled",)),
    Knob("routing", "the MoE routing: experts, top_k, each token's choices, expert_map, disabled adapters, shared stacks, zero weights",
         ("num_experts", "top_k", "topk_ids", "expert_map", "disabled_slots", "shared_experts", "zero_weight_pairs"),
         {"num_experts": 0, "top_k": 0, "topk_ids": (), "expert_map": (), "disabled_slots": (), "shared_experts": False,
          "zero_weight_pairs": ()},
         features=("moe_wide_topk", "moe_many_experts", "moe_hot_expert", "moe_duplicate", "moe_zero_weight", "moe_nonlocal",
                   "moe_disabled", "moe_shared")),
    Knob("gate_up", "gate and up as two slices or one fused 2·I slice", ("output_slices",), features=("moe_fused_slice",),
         left="one slice"),
    Knob("routed_weight", "mul_routed_weight drawn both ways (one input row per pair, the delta weighted)", ("routed_weight",),
         {"routed_weight": False}, features=("moe_routed_weight",),
         left="an op that always or never applies the weight says so itself (OpSpec.routed_weight)"),
    Knob("blocks", "the MoE kernels' block size (16, 32, 64)", ("block_size",), {"block_size": 0}, features=("moe_full_block",)),
    Knob("naive", "naive block assignment: topk_ids as the experts, no sorted ids", ("naive_blocks",), {"naive_blocks": False},
         features=("moe_naive",)),
    Knob("fp8_scales", "fp8 e4m3fn operands (±448) and the granularity of their scales: per tensor, per token and channel, "
         "or per group_k × group_n block", ("fp8_scales", "group_k", "group_n"), {"fp8_scales": "", "group_k": 0, "group_n": 0},
         features=("fp8_tensor", "fp8_channel", "fp8_block")),
    # vLLM 0.34 (docs/vllm-lora-ops.md §10)
    Knob("spec_decode", "speculative decoding: 1 + draft tokens logits rows per request, each with the request's adapter",
         ("logits_per_seq",), {"logits_per_seq": ()}, features=("spec_decode_logits",)),
    Knob("packed", "packed slices as an adapter fills them: a sub-module it lacks (zero), or a slice repeating another "
         "sub-module's weights (a per-layer lora_packed_modules override, Gemma 4's [q, k, k])",
         ("absent_slices", "repeated_slices"), {"absent_slices": (), "repeated_slices": ()},
         features=("partial_packed", "packed_override")),
    Knob("embed_scale", "the embedding's embed_scale folded into LoRA-B when the adapter is set", ("embed_scale",),
         {"embed_scale": 0.0}, features=("embed_scale",)),
)  # fmt: skip

KNOBS: dict[str, Knob] = {knob.name: knob for knob in _KNOBS}
