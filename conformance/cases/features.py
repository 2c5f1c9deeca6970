"""The edge-case features a case exercises, read off its structure and what its op serves.

These names are the vocabulary shared by the generator (families aim at them), the expectations files
(which cases a known failure covers) and the report (which corners failed). The generator leaves
every knob an op does not use at its default, so a feature only shows up where it matters; the knobs
(``conformance.cases.knobs``) name the features each can show.

A feature counts what the op reads, not what was drawn (:func:`served_slots`): a rank, a slot or a
routing corner only shows on a row an adapter serves (a slot other than −1, enabled, and for the MoE
ops a pair of a local expert), since the kernels skip every other row. A case that serves no row
exercises the batch's shape and ``allneg1`` alone: its scale, bias, sizes and ranks are never read.
"""

from __future__ import annotations

from .case import FP8_SCALES, ODD_HIDDEN_SIZES, REAL_HIDDEN_SIZES, Case

LARGE_T = 1024
# vLLM 0.34's fused_moe_lora runs its one-shot kernel for more than 64 tokens (FUSED_MOE_LORA_TWO_KERNEL_MAX_TOKENS,
# vllm/lora/ops/triton_ops/utils.py) at a rank ≤ 128 (_FUSED_MOE_LORA_ONE_SHOT_MAX_RANK, fused_moe_lora_op.py), else two
ONE_SHOT_MAX_TOKENS, ONE_SHOT_MAX_RANK = 64, 128
TMA_ALIGNMENT = 16  # bytes: vLLM 0.34's fused_moe_lora takes its TMA path only when max_lora_rank · element size is a multiple
LONG_BATCH = 2048  # rows of one call above which a kernel gridded or tiled for 2,048 rows breaks

FEATURE_DOCS = {
    "neg1": "rows without adapter (slot −1) mixed with adapter rows",
    "allneg1": "every row without adapter",
    "one_slot": "the stacks hold a single slot (−1 aliases slot 0 under negative indexing)",
    "last_slot": "the last slot L−1 is used (L ≥ 2)",
    "noncontig": "one adapter on non-adjacent tokens",
    "unequal_seqs": "sequences of unequal length",
    "len1_seq": "a sequence of length 1 among longer ones",
    "t1": "a single token",
    "large_t": f"at least {LARGE_T} tokens",
    "long_batch": f"a served row past the first {LONG_BATCH:,} of one call: tokens (and so pairs, for the MoE ops), or sampled rows for the logits and classification heads",
    "rank_padded": "an adapter of rank below the stack's max rank (zero-padded) serves a row",
    "rank_odd": "an adapter whose rank is no multiple of 16 serves a row",
    "rank_max": "an adapter of rank 256 serves a row (the largest power-of-two max_lora_rank below 320)",
    "rank_512": "an adapter of rank above 256 serves a row: 320 or 512 (vLLM's largest max_lora_rank)",
    "real_hidden": "a hidden size of a real model",
    "odd_hidden": "a hidden size that is no multiple of any block size",
    "multi_slice": "two or more output slices",
    "many_slices": "four to seven packed output slices (beyond QKV's three)",
    "packed_5_slices": "end to end: a parallel block's q, k, v, gate and up in one add_lora_linear call of 5 packed slices",
    "per_module_rank": "end to end: an adapter whose modules differ in rank and alpha (PEFT rank_pattern / alpha_pattern)",
    "unequal_slices": "output slices of unequal width",
    "offset": "output written from a column offset > 0",
    "wide_output": "output wider than the columns written",
    "no_add_inputs": "add_inputs=False (overwrite instead of accumulate)",
    "scaled": "scale ≠ 1",
    "fp32_input": "float32 expand input rounded to a narrower weight dtype",
    "bias": "LoRA bias",
    "w4d": "4-D weight stacks [L, 1, rows, cols]",
    "decode": "decode batch (one token per sequence)",
    "positive": "all-positive values (no cancellation, large accumulations)",
    # the segment layout of the sgmv ops (Case.seq_starts, Case.num_rows)
    "seg_permuted": "sgmv segments listed out of row order (b_seq_start_loc not increasing)",
    "seg_gap": "rows no sgmv segment covers between two segments",
    "seg_late_start": "the first sgmv segment starts after row 0",
    "uncovered_rows": "rows no sgmv segment covers (before, between or after the segments): never written",
    # the fused-MoE ops (docs/moe.md)
    "moe_wide_topk": "top_k ≥ 4 choices per token",
    "moe_many_experts": "32 experts or more",
    "moe_hot_expert": "one expert chosen by at least half of the pairs while another is chosen by none",
    "moe_duplicate": "a token that chooses the same expert twice",
    "moe_zero_weight": "a routing weight of exactly 0",
    "moe_nonlocal": "a choice of an expert on another rank (expert_map −1)",
    "moe_disabled": "a token whose slot's adapter_enabled is 0",
    "moe_shared": "shared-expert LoRA: one LoRA-A (w13) or LoRA-B (w2) for every expert",
    "moe_fused_slice": "gate and up as one fused 2·I slice (adapters on fused 3-D expert weights)",
    "moe_routed_weight": "mul_routed_weight: one input row per pair, the delta weighted",
    "moe_naive": "naive block assignment (topk_ids as the experts, no sorted ids)",
    "moe_full_block": "an enabled slot's pairs of one expert exactly fill whole blocks (no padding)",
    # the fp8 ops (lora_shrink_fp8, lora_expand_fp8): e4m3fn codes, saturated at ±448, with float32 amax / 448 scales
    "fp8_tensor": "fp8 operands with one activation scale and one weight scale per slot",
    "fp8_channel": "fp8 operands with a scale per token and per output channel (per_channel_quant)",
    "fp8_block": "fp8 operands with a scale per group_k × group_n block (a_scale[t, k // group_k], b_scale[l, n // group_n, k // group_k])",
    # the classification heads (apply_lora_full_linear, token_classification_head)
    "module_disabled": "a row whose slot's classification head is disabled (module_enabled False): sampled rows, or tokens for the token head",
    "token_classification": "a token-classification head call (vLLM 0.33): tokens with a saved head, tokens of an adapter without one and "
    "tokens without adapter in one batch, the label count P no multiple of 16",
    "cls_labels_wide": "a classification head of more than 256 labels (max_lora_cls_labels is unbounded)",
    # the tensor-parallel MoE LoRA layer (conformance/tp/moe_case.py; docs/tensor-parallel.md)
    "moe_tp": "an MoE LoRA layer (w13 or w2) split over tensor-parallel ranks, add_lora_w13/add_lora_w2 on every rank",
    "padded_intermediate": "tensor-parallel MoE: each rank's intermediate size padded past its shard (vLLM 0.33 strides by the unpadded size)",
    # vLLM 0.34 (docs/vllm-lora-ops.md §10)
    "moe_oneshot_boundary": f"fused_moe_lora at the edge of its one-shot kernel (vLLM 0.34: tokens > {ONE_SHOT_MAX_TOKENS} and rank ≤ "
    f"{ONE_SHOT_MAX_RANK}): {ONE_SHOT_MAX_TOKENS} or {ONE_SHOT_MAX_TOKENS + 1} tokens at a rank ≤ {ONE_SHOT_MAX_RANK}, or rank "
    f"{ONE_SHOT_MAX_RANK} or {ONE_SHOT_MAX_RANK + 1} above {ONE_SHOT_MAX_TOKENS} tokens",
    "tma_unaligned_rank": "fused_moe_lora with max_lora_rank × element size no multiple of 16 bytes (vLLM 0.34 takes its TMA path "
    "only when it is): an odd rank, or one no multiple of 8, in fp16/bf16",
    "grouped_lora_a": "head groups sharing one LoRA-A, each group its own LoRA-B (vLLM 0.34's DeepseekV4GroupedWoAWithLoRA)",
    "fp32_output": "a float32 base output; the delta built in a zeroed buffer of the LoRA dtype and added (vLLM 0.34's "
    "DeepseekV4CompressorKVScoreWithLoRA)",
    "partial_packed": "an adapter lacking some of a packed layer's sub-modules serves a row: those slices zero, the others its own "
    "(vLLM 0.34's expand_packed_lora)",
    "packed_override": "a packed slice holding another slice's sub-module (a per-layer lora_packed_modules override: Gemma 4's [q, k, k])",
    "embed_scale": "the embedding's embed_scale folded into LoRA-B (vLLM 0.34's VocabParallelEmbeddingWithLoRA.set_lora)",
    "spec_decode_logits": "speculative decoding: a request with 1 + draft tokens logits rows, each with the request's adapter",
}


def _runs(slots: tuple[int, ...]) -> list[int]:
    runs: list[int] = []
    for slot in slots:
        if not runs or runs[-1] != slot:
            runs.append(slot)
    return runs


def served_slots(case: Case) -> frozenset[int]:
    """The slots that serve at least one row of the case's op (``Case.serves``; an MoE token through one of its pairs)."""
    if case.is_moe:
        return frozenset(slot for slot, ids in zip(case.token_slots, case.topk_ids) if any(case.serves(slot, e) for e in ids))
    return frozenset(slot for slot in _row_slots(case) if case.serves(slot))


# What a case that serves no row still exercises: the shape of its batch (and allneg1 itself).
BATCH_FEATURES = frozenset({"allneg1", "one_slot", "t1", "large_t", "decode", "unequal_seqs", "len1_seq",
                            "seg_permuted", "seg_gap", "seg_late_start", "uncovered_rows"})  # fmt: skip


def case_features(case: Case) -> frozenset[str]:
    slots = case.token_slots
    used = served_slots(case)
    runs = [s for s in _runs(slots) if s in used]
    ranks = [case.adapter_ranks[s] for s in used]
    found = {
        # a real segment of slot −1, not a row no segment covers (that is "uncovered_rows")
        "neg1": -1 in case.seq_slots and bool(used),
        "allneg1": not used,
        "one_slot": case.num_slots == 1,
        "last_slot": case.num_slots >= 2 and case.num_slots - 1 in used,
        "noncontig": len(runs) != len(set(runs)),
        "unequal_seqs": len(set(case.seq_lens)) > 1,
        "len1_seq": len(case.seq_lens) > 1 and 1 in case.seq_lens and max(case.seq_lens) > 1,
        "t1": case.num_tokens == 1,
        "large_t": case.num_tokens >= LARGE_T,
        # a served row past the first 2,048 (a token's, for the MoE ops: its pairs lie past 2,048 too)
        "long_batch": any(slot in used for slot in _row_slots(case)[LONG_BATCH:]),
        "rank_padded": any(rank < case.max_rank for rank in ranks),
        "rank_odd": any(rank % 16 for rank in ranks),
        "rank_max": 256 in ranks,
        "rank_512": any(rank > 256 for rank in ranks),
        "real_hidden": case.hidden_size in REAL_HIDDEN_SIZES or case.output_width in REAL_HIDDEN_SIZES,
        "odd_hidden": case.hidden_size in ODD_HIDDEN_SIZES or case.output_width in ODD_HIDDEN_SIZES,
        "multi_slice": case.num_slices > 1,
        "many_slices": case.num_slices >= 4,
        "unequal_slices": len(set(case.output_slices)) > 1,
        "offset": case.offset_start > 0,
        "wide_output": case.output_width > case.offset_start + sum(case.output_slices),
        "no_add_inputs": not case.add_inputs,
        "scaled": case.scale != 1.0,
        "fp32_input": case.expand_input_dtype == "float32" and case.dtype != "float32",
        "bias": case.bias,
        "w4d": case.weights_4d,
        "decode": not case.is_prefill,
        "positive": case.distribution == "positive",
        **{f"fp8_{scales}": case.fp8_scales == scales for scales in FP8_SCALES},
        **_layout_features(case),
    }
    found.update(_v034_features(case, used))
    if case.is_moe:
        found.update(_routing_features(case, used))
    elif _reads(case, "module_enabled"):  # the classification heads: disabled slots are heads that were not saved
        found.update(_head_features(case))
    return frozenset(name for name, present in found.items() if present and (used or name in BATCH_FEATURES))


def _v034_features(case: Case, served: frozenset[int]) -> dict[str, bool]:
    """vLLM 0.34's corners: the fused-MoE kernel's dispatch, the packed slices an adapter fills, the logits rows of
    speculative decoding, and the layers of their own ops (read off the op: nothing else of the case says it)."""
    fused = case.is_moe and not case.fp8_scales and _reads(case, "add_inputs")  # the ops that run fused_moe_lora
    tokens, rank = case.num_tokens, case.max_rank
    absent = {slot for slot, _ in case.absent_slices} & served
    return {
        "moe_oneshot_boundary": fused and ((tokens in (ONE_SHOT_MAX_TOKENS, ONE_SHOT_MAX_TOKENS + 1) and rank <= ONE_SHOT_MAX_RANK)
                                           or (rank in (ONE_SHOT_MAX_RANK, ONE_SHOT_MAX_RANK + 1) and tokens > ONE_SHOT_MAX_TOKENS)),
        "tma_unaligned_rank": fused and rank * case.torch_dtype.itemsize % TMA_ALIGNMENT != 0,
        # a slot that lacks a slice but has another: a wholly absent adapter is a slot without weights
        "partial_packed": any(sum(1 for slot, _ in case.absent_slices if slot == s) < case.num_slices for s in absent),
        "packed_override": any(j != s for s, j in enumerate(case.repeated_slices)),
        "spec_decode_logits": any(n > 1 and slot in served for n, slot in zip(case.logits_per_seq, case.seq_slots)),
        "embed_scale": case.embed_scale > 0,
        "grouped_lora_a": case.op == "grouped_lora_linear" and case.num_slices > 1,
        "fp32_output": case.op == "fp32_output_lora_linear",
    }


def _layout_features(case: Case) -> dict[str, bool]:
    """How the sgmv segments lie in the rows; all False in the canonical layout (back to back from row 0)."""
    if not (case.seq_starts or case.num_rows):  # canonical, said without the prefix sums (thousands of sequences)
        return dict.fromkeys(("seg_permuted", "seg_gap", "seg_late_start", "uncovered_rows"), False)
    starts = case.segment_starts
    in_rows = sorted(zip(starts, case.seq_lens))
    return {
        "seg_permuted": any(later <= earlier for earlier, later in zip(starts, starts[1:])),
        "seg_gap": any(start > previous + n for (previous, n), (start, _) in zip(in_rows, in_rows[1:])),
        "seg_late_start": bool(in_rows) and in_rows[0][0] > 0,
        "uncovered_rows": not all(case.covered_rows),
    }


def _routing_features(case: Case, served: frozenset[int]) -> dict[str, bool]:
    """The routing corners, over the tokens an adapter serves (the kernels skip every other token's pairs)."""
    served_tokens = [t for t, slot in enumerate(case.token_slots) if slot in served]
    routes = [case.topk_ids[t] for t in served_tokens]
    chosen = [e for ids in routes for e in ids]
    counts = [chosen.count(e) for e in range(case.global_experts)]
    used_slots = {s for s in case.token_slots if s != -1}
    served_pairs = {t * case.top_k + k for t in served_tokens for k in range(case.top_k)}
    return {
        "moe_wide_topk": case.top_k >= 4,
        "moe_many_experts": case.global_experts >= 32,
        "moe_hot_expert": bool(chosen) and max(counts) * 2 >= len(chosen) > 1 and min(counts) == 0,
        "moe_duplicate": any(len(set(ids)) < len(ids) for ids in routes),
        "moe_zero_weight": bool(served_pairs & set(case.zero_weight_pairs)),
        "moe_nonlocal": any(case.local_expert(e) == -1 for e in chosen),
        "moe_disabled": bool(used_slots & set(case.disabled_slots)),
        "moe_shared": case.shared_experts,
        "moe_fused_slice": case.num_slices == 1 and _reads(case, "gate_up") and not case.routed_weight,
        "moe_routed_weight": case.routed_weight,
        "moe_naive": case.naive_blocks,
        "moe_full_block": _fills_whole_blocks(case),
    }


def _head_features(case: Case) -> dict[str, bool]:
    """The corners of a classification head, over the rows the op picks by (sampled rows or tokens)."""
    from conformance.ops import OP_SPECS

    spec = OP_SPECS[case.op]
    used = {s for s in spec.row_slots(case) if s != -1}
    disabled = used & set(case.disabled_slots)
    return {
        "module_disabled": bool(disabled),
        "token_classification": spec.rows == "tokens" and bool(used - disabled) and bool(disabled)
        and -1 in spec.row_slots(case) and case.output_width % 16 != 0,
        "cls_labels_wide": case.output_width > 256,
    }


def _reads(case: Case, knob: str) -> bool:
    """Whether the case's op reads ``knob``: for a feature the knob's default itself would show (one slice is
    also a fused gate/up slice). Imported here: conformance.ops imports this package."""
    from conformance.ops import OP_SPECS

    spec = OP_SPECS.get(case.op)
    return spec is not None and knob in spec.knobs


def _row_slots(case: Case) -> tuple[int, ...]:
    """The slot of each row one call of the case's op handles: its sampled rows for an op whose rows are those
    (``OpSpec.rows``), else its tokens (an MoE op's pairs are top_k per token)."""
    from conformance.ops import OP_SPECS

    spec = OP_SPECS.get(case.op)
    return case.sampled_slots if spec is not None and spec.rows == "sampled" else case.token_slots


def _fills_whole_blocks(case: Case) -> bool:
    if not case.block_size or case.naive_blocks:
        return False
    groups: dict[tuple[int, int], int] = {}
    for slot, ids in zip(case.token_slots, case.topk_ids):
        for expert in ids:
            if slot != -1 and slot not in case.disabled_slots and case.local_expert(expert) != -1:
                groups[slot, case.local_expert(expert)] = groups.get((slot, case.local_expert(expert)), 0) + 1
    return any(count % case.block_size == 0 for count in groups.values())
