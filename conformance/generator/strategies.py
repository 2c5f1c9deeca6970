"""Hypothesis strategies that draw the structure of a case for one op, dtype and family.

Hypothesis draws the structure (so a failure shrinks towards fewer sequences, fewer slots, smaller
ranks and sizes); the values come from ``case.seed`` (``conformance.cases.values``). Knobs an op does
not read stay at their defaults (``conformance.cases.knobs``), so features and ids only mention what
matters for the op.
"""

from __future__ import annotations

from hypothesis import strategies as st

from conformance.cases.case import Case
from conformance.cases.knobs import KNOBS
from conformance.cases.scales import SCALES
from conformance.ops import OpSpec

from .families import FAMILIES, Family
from .limits import Limits


def _left(knob: str, field: str | None = None):
    """What a case holds in ``field`` (the knob's only field, when omitted) where its op does not read ``knob``."""
    return KNOBS[knob].default(field)


def _slices(draw, spec: OpSpec, family: Family, limits: Limits, big_width: bool) -> tuple[int, ...]:
    if "slices" not in spec.knobs or big_width:
        # A sized family's width must be the whole output width, or the size is lost in the sum.
        count = 1
    else:
        count = family.slice_count(draw, spec)
    if "widths" in spec.knobs:
        first = family.feature_size(draw, limits.max_width) if big_width else family.first_width(draw, limits)
        if family.equal_widths():
            return (first,) * count
        widths = [first] + draw(st.lists(st.integers(1, limits.max_width), min_size=count - 1, max_size=count - 1))
        if family.distinct_widths() and len(set(widths)) == 1:
            widths[-1] = widths[-1] + 1
        return tuple(widths)
    return (1,) * count  # shrink-side ops write [S, T, R]: slice widths are not read


def _moe_slices(draw, spec: OpSpec, family: Family, limits: Limits) -> tuple[int, ...]:
    """Equal widths: gate and up as two slices or one fused (``gate_up``), else one slice. The width is drawn
    for every MoE op, also for moe_lora_align_block_size, which does not read it ("widths"): its draws stay
    as they were."""
    count = family.gate_up_slices(draw) if "gate_up" in spec.knobs else 1
    return (draw(st.integers(1, limits.max_width)),) * count


def _routing(draw, spec: OpSpec, family: Family, limits: Limits, token_slots: tuple[int, ...], num_slots: int) -> dict:
    """The MoE fields of a case (``Case.num_experts`` …), each step asking the family."""
    experts = family.num_experts(draw, limits)
    top_k = family.top_k(draw, experts)
    expert_map = family.expert_map(draw, experts)
    global_experts = len(expert_map) or experts
    top_k = min(top_k, global_experts)
    choice = st.lists(st.integers(0, global_experts - 1), min_size=top_k, max_size=top_k, unique=True)
    topk_ids = family.token_choices(draw, choice, len(token_slots))
    served = [token for token, slot in enumerate(token_slots) if slot != -1]  # the tokens an adapter serves
    topk_ids = family.steer_routing(draw, topk_ids, expert_map, global_experts, served)
    if spec.routed_weight is not None:
        routed = spec.routed_weight
    else:
        routed = family.routed_weight(draw) if "routed_weight" in spec.knobs else _left("routed_weight")
    return {
        "num_experts": experts,
        "top_k": top_k,
        "topk_ids": tuple(tuple(ids) for ids in topk_ids),
        "expert_map": expert_map,
        "disabled_slots": family.disabled_slots(draw, token_slots, num_slots),
        "shared_experts": family.shared_experts(draw),
        "routed_weight": routed,
        "zero_weight_pairs": family.zero_weight_pairs(draw, len(token_slots) * top_k, [t * top_k + k for t in served for k in range(top_k)])
        if routed else (),
        "block_size": family.block_size(draw) if "blocks" in spec.knobs else _left("blocks"),
        "naive_blocks": family.naive_blocks(draw) if "naive" in spec.knobs else _left("naive"),
    }


@st.composite
def cases(draw, spec: OpSpec, dtype: str, family: str, limits: Limits) -> Case:
    """One case of ``spec.name`` in ``dtype`` aimed at ``family``: the same steps for every family, each
    step asking the family (``conformance.generator.families``) how to draw it."""
    name, family = family, FAMILIES[family]
    moe = "routing" in spec.knobs
    if moe:
        limits = limits.for_moe(family.sized)
    num_slots = family.num_slots(draw, limits)
    seq_lens = family.sequence_lengths(draw, limits)
    if family.sized:
        seq_lens = seq_lens[: limits.max_real_tokens]
    seq_slots = family.sequence_slots(draw, len(seq_lens), num_slots)
    max_rank = family.max_rank(draw, limits)
    adapter_ranks = tuple(family.slot_ranks(draw, max_rank, num_slots))
    limits, max_rank, adapter_ranks = family.affordable(limits, max_rank, adapter_ranks)
    served_slots = sorted({slot for slot in seq_slots if slot != -1})
    adapter_ranks = tuple(family.steer_ranks(draw, list(adapter_ranks), served_slots, max_rank))
    hidden_is_sized = family.sized and "hidden" in spec.knobs
    if "hidden" not in spec.knobs:
        hidden = _left("hidden")
    else:  # a sized family's hidden size is its feature size; the others' is Family.hidden_size (free but for fp8_block)
        hidden = family.feature_size(draw, limits.max_hidden) if hidden_is_sized else family.hidden_size(draw, limits.max_hidden)
    if moe:
        slices = _moe_slices(draw, spec, family, limits)
    else:
        slices = _slices(draw, spec, family, limits, big_width=family.sized and not hidden_is_sized)
    if not family.with_offset(draw, spec):
        offset = _left("offset")
    elif moe:  # a fully sharded rank's columns start at shard width · tp_rank (vLLM's w2)
        offset = draw(st.integers(1, 3)) * sum(slices)
    else:
        offset = draw(st.integers(1, 64))
    extra = draw(st.integers(1, 48)) if "wide" in spec.knobs and family.wide(draw) else 0  # 0: output_width = offset + Σ slices
    add_inputs = family.add_inputs(draw) if "add_inputs" in spec.knobs else _left("add_inputs")
    scale = draw(st.sampled_from(SCALES)) if "scale" in spec.knobs and family.scaled(draw) else _left("scale")
    expand_input_dtype = "float32" if "expand_input" in spec.knobs and family.fp32_input(draw) else _left("expand_input")
    bias = family.bias(draw) if "bias" in spec.knobs else _left("bias")
    weights_4d = family.weights_4d(draw) if "w4d" in spec.knobs else _left("w4d")
    is_prefill = not family.decode if "prefill" in spec.knobs else _left("prefill")
    distribution = family.distribution(draw)
    token_slots = tuple(slot for slot, n in zip(seq_slots, seq_lens) for _ in range(n))
    routing = _routing(draw, spec, family, limits, token_slots, num_slots) if moe else {}
    if "module_enabled" in spec.knobs:  # drawn last, so the other ops' draws stay as they were
        routing["disabled_slots"] = family.disabled_slots(draw, seq_slots, num_slots)
    # Drawn last too, and only by the segment families: every other family's sgmv cases stay as they were.
    if "segments" in spec.knobs:
        seq_starts, num_rows = family.segment_layout(draw, seq_lens, seq_slots)
    else:
        seq_starts, num_rows = _left("segments", "seq_starts"), _left("segments", "num_rows")
    # The fp8 fields, drawn last and only for the fp8 ops: the contraction K is the shrink's hidden size and the
    # expand's rank, the output features N the shrink's rank and the expand's slice width.
    if "fp8_scales" in spec.knobs:
        k, n = (hidden, max_rank) if "hidden" in spec.knobs else (max_rank, slices[0])
        group_k, group_n = family.fp8_groups(draw, k, n)
        fp8 = {"fp8_scales": family.scales, "group_k": group_k, "group_n": group_n}
    else:
        fp8 = {name: _left("fp8_scales", name) for name in ("fp8_scales", "group_k", "group_n")}
    # vLLM 0.34's corners, drawn last and only for the ops that read them (a family that does not aim at one draws nothing)
    v034 = {
        "logits_per_seq": family.logits_per_seq(draw, seq_slots) if "spec_decode" in spec.knobs else _left("spec_decode"),
        "embed_scale": family.embed_scale(draw) if "embed_scale" in spec.knobs else _left("embed_scale"),
    }
    if "packed" in spec.knobs:
        packed, v034["absent_slices"], v034["repeated_slices"] = family.packed_slices(draw, slices, seq_slots)
        slices = packed
    return Case(
        op=spec.name,
        dtype=dtype,
        seq_lens=seq_lens,
        seq_slots=seq_slots,
        num_slots=num_slots,
        max_rank=max_rank,
        adapter_ranks=adapter_ranks,
        hidden_size=hidden,
        output_slices=slices,
        output_width=offset + sum(slices) + extra,
        offset_start=offset,
        add_inputs=add_inputs,
        scale=scale,
        expand_input_dtype=expand_input_dtype,
        weights_4d=weights_4d,
        bias=bias,
        is_prefill=is_prefill,
        distribution=distribution,
        seed=draw(st.integers(0, 2**31 - 1)),
        family=name,
        seq_starts=seq_starts,
        num_rows=num_rows,
        **routing,
        **fp8,
        **v034,
    )
