"""Tiny cases of every reference op, worked out by hand.

Each test spells out its inputs as small integers and its expected output as literals computed on
paper (the comments show the arithmetic), so a reader can check the reference against the notes
(docs/vllm-lora-ops.md §2–§5) without trusting any other code. Everything runs in float64,
where these sums are exact, so results are compared exactly (rtol = atol = 0).

Conventions used throughout: "sentinel" rows hold values no op may touch (slot −1 rows, rows outside
every sgmv segment), so an op that writes them shows at once.
"""

from __future__ import annotations

import pytest
import torch

from conformance.reference import (
    LoRAKernelMeta,
    LoRAMapping,
    PunicaWrapperReference,
    SegmentMetadata,
    bgmv_expand,
    bgmv_expand_slice,
    bgmv_shrink,
    lora_expand,
    lora_shrink,
    sgmv_expand,
    sgmv_expand_slice,
    sgmv_shrink,
)

SENTINEL = -7.0


def f64(values) -> torch.Tensor:
    return torch.tensor(values, dtype=torch.float64)


def slots(values) -> torch.Tensor:
    return torch.tensor(values, dtype=torch.long)


def assert_exact(actual: torch.Tensor, expected) -> None:
    expected = expected if isinstance(expected, torch.Tensor) else torch.tensor(expected, dtype=actual.dtype)
    torch.testing.assert_close(actual, expected, rtol=0, atol=0)


def rows_of(*values: float, width: int) -> torch.Tensor:
    """An output whose row ``t`` is filled with ``values[t]``: a written cell shows as a changed value."""
    return f64([[v] * width for v in values])


# LoRA-A stack [L=3, R=2, H=3]: each slot picks a simple combination of the 3 input features.
A = f64(
    [
        [[1, 0, 0], [0, 1, 0]],  # slot 0: (x0, x1)
        [[1, 1, 1], [0, 0, 2]],  # slot 1: (x0 + x1 + x2, 2·x2)
        [[0, 0, 1], [1, 0, 0]],  # slot 2: (x2, x0)
    ]
)
# A second LoRA-A stack for multi-slice ops: the slots of A rotated (slot l of A2 is slot l−1 of A).
A2 = A[[2, 0, 1]]
X = f64([[1, 2, 3], [4, 5, 6], [7, 8, 9], [1, 0, -1], [2, 2, 2]])  # 5 tokens × H = 3

# LoRA-B stack [L=2, N=3, R=2] and a narrower one [L=2, N=1, R=2] (unequal slices, like GQA q/kv).
B = f64(
    [
        [[1, 0], [0, 1], [1, 1]],  # slot 0: (s0, s1, s0 + s1)
        [[2, 0], [0, -1], [1, 2]],  # slot 1: (2·s0, −s1, s0 + 2·s1)
    ]
)
B_NARROW = f64(
    [
        [[1, -1]],  # slot 0: s0 − s1
        [[0, 3]],  # slot 1: 3·s1
    ]
)
S = f64([[1, 2], [3, 4], [5, 6], [7, 8], [1, 1]])  # shrunk inputs of expand ops: 5 tokens × R = 2
S_NARROW = f64([[1, 1], [2, 0], [0, 2]])  # the second slice's shrunk inputs, 3 tokens


# -- bgmv_shrink -------------------------------------------------------------------------------


def test_bgmv_shrink_scales_each_token_with_its_slot_and_skips_minus_one():
    out = torch.zeros(4, 2, dtype=torch.float64)
    out[2] = SENTINEL
    bgmv_shrink(X[:4], A, out, slots([0, 2, -1, 1]), scaling=0.5)
    assert_exact(
        out,
        [
            [0.5, 1.0],  # slot 0 on (1, 2, 3): (1, 2) · 0.5
            [3.0, 2.0],  # slot 2 on (4, 5, 6): (6, 4) · 0.5
            [SENTINEL, SENTINEL],  # slot −1: untouched
            [0.0, -1.0],  # slot 1 on (1, 0, −1): (0, −2) · 0.5
        ],
    )


def test_bgmv_shrink_adds_into_the_buffer():
    # The contract is "+= into a zeroed buffer" (Triton may split K and add atomically): a buffer
    # that already holds values keeps them under the sum.
    out = torch.ones(1, 2, dtype=torch.float64)
    bgmv_shrink(X[:1], A, out, slots([1]), scaling=1.0)
    assert_exact(out, [[1 + 6, 1 + 6]])  # slot 1 on (1, 2, 3) = (6, 6)


def test_bgmv_shrink_leaves_columns_beyond_the_rank():
    out = torch.zeros(1, 3, dtype=torch.float64)
    out[0, 2] = SENTINEL
    bgmv_shrink(X[:1], A, out, slots([0]))
    assert_exact(out, [[1, 2, SENTINEL]])


# -- bgmv_expand / bgmv_expand_slice -------------------------------------------------------------

# Slots [1, −1, 0] on S[:3]:  slot 1 on (1, 2) = (2, −2, 5);  slot 0 on (5, 6) = (5, 6, 11).


def test_bgmv_expand_accumulates_into_the_first_n_columns():
    out = rows_of(10, 20, 30, width=4)  # W = 4 > N = 3: column 3 is never written
    bgmv_expand(S[:3], B, out, slots([1, -1, 0]), add_inputs=True)
    assert_exact(out, [[12, 8, 15, 10], [20, 20, 20, 20], [35, 36, 41, 30]])


def test_bgmv_expand_defaults_to_add_inputs_true():
    out = rows_of(10, 20, 30, width=4)
    bgmv_expand(S[:3], B, out, slots([1, -1, 0]))
    assert_exact(out, [[12, 8, 15, 10], [20, 20, 20, 20], [35, 36, 41, 30]])


def test_bgmv_expand_without_add_inputs_overwrites_but_never_a_minus_one_row():
    out = rows_of(10, 20, 30, width=4)
    bgmv_expand(S[:3], B, out, slots([1, -1, 0]), add_inputs=False)
    assert_exact(out, [[2, -2, 5, 10], [20, 20, 20, 20], [5, 6, 11, 30]])


def test_bgmv_expand_slice_writes_only_the_slice_columns():
    out = rows_of(10, 20, 30, width=6)  # the slice is columns 2..4; 0, 1 and 5 stay
    bgmv_expand_slice(S[:3], B, out, slots([1, -1, 0]), slice_offset=2, slice_size=3, add_inputs=True)
    assert_exact(out, [[10, 10, 12, 8, 15, 10], [20] * 6, [30, 30, 35, 36, 41, 30]])


def test_bgmv_expand_slice_without_add_inputs():
    out = rows_of(10, 20, 30, width=6)
    bgmv_expand_slice(S[:3], B, out, slots([1, -1, 0]), 2, 3, add_inputs=False)
    assert_exact(out, [[10, 10, 2, -2, 5, 10], [20] * 6, [30, 30, 5, 6, 11, 30]])


# -- sgmv_shrink / sgmv_expand / sgmv_expand_slice -----------------------------------------------

# Segments (start, length, slot): (0, 2, 1), (2, 1, −1), (3, 1, 2); row 4 lies outside every segment.
SEGMENTS = (slots([0, 2, 3]), slots([2, 1, 1]), slots([1, -1, 2]), 3, 2, 5)  # … batches, max_seq_length, token_nums


def test_sgmv_shrink_uses_one_slot_per_segment_and_skips_uncovered_rows():
    out = torch.zeros(5, 2, dtype=torch.float64)
    out[2] = out[4] = SENTINEL
    sgmv_shrink(X, A, out, *SEGMENTS, 1.0)
    assert_exact(
        out,
        [
            [6, 6],  # slot 1 on (1, 2, 3)
            [15, 12],  # slot 1 on (4, 5, 6)
            [SENTINEL, SENTINEL],  # segment of slot −1
            [-1, 1],  # slot 2 on (1, 0, −1): (x2, x0)
            [SENTINEL, SENTINEL],  # no segment covers row 4
        ],
    )


# Expand segments: (0, 2, slot 0), (2, 1, −1), (3, 1, slot 1); row 4 uncovered.
EXPAND_SEGMENTS = (slots([0, 2, 3]), slots([2, 1, 1]), slots([0, -1, 1]), 3, 2, 5)
# slot 0 on (1, 2) = (1, 2, 3); on (3, 4) = (3, 4, 7); slot 1 on (7, 8) = (14, −8, 23).


def test_sgmv_expand_defaults_to_overwrite():
    out = rows_of(10, 20, 30, 40, 50, width=4)
    sgmv_expand(S, B, out, *EXPAND_SEGMENTS)  # add_inputs defaults to False for sgmv
    assert_exact(out, [[1, 2, 3, 10], [3, 4, 7, 20], [30] * 4, [14, -8, 23, 40], [50] * 4])


def test_sgmv_expand_with_add_inputs():
    out = rows_of(10, 20, 30, 40, 50, width=4)
    sgmv_expand(S, B, out, *EXPAND_SEGMENTS, add_inputs=True)
    assert_exact(out, [[11, 12, 13, 10], [23, 24, 27, 20], [30] * 4, [54, 32, 63, 40], [50] * 4])


def test_sgmv_expand_slice_writes_only_the_slice_of_covered_rows():
    out = rows_of(10, 20, 30, 40, 50, width=5)
    sgmv_expand_slice(S, B, out, *EXPAND_SEGMENTS, 1, 3)  # columns 1..3, add_inputs defaults to False
    assert_exact(out, [[10, 1, 2, 3, 10], [20, 3, 4, 7, 20], [30] * 5, [40, 14, -8, 23, 40], [50] * 5])


# Segments in any order, anywhere in the rows: the rows come from b_seq_start_loc, never from the
# lengths. Listed (start, length, slot): (3, 2, 0), (0, 1, 2); rows 1 and 2 lie in the gap between.
PERMUTED_SEGMENTS = (slots([3, 0]), slots([2, 1]), slots([0, 2]), 2, 2, 5)


def test_sgmv_shrink_reads_permuted_segments_at_their_starts_and_skips_the_gap():
    out = torch.zeros(5, 2, dtype=torch.float64)
    out[1] = out[2] = SENTINEL
    sgmv_shrink(X, A, out, *PERMUTED_SEGMENTS, 1.0)
    # Repeating the slots by length from row 0 would give rows 0–1 slot 0 and row 2 slot 2 instead.
    assert_exact(
        out,
        [
            [3, 1],  # second listed segment, slot 2 on (1, 2, 3): (x2, x0)
            [SENTINEL, SENTINEL],  # gap: no segment covers rows 1 and 2
            [SENTINEL, SENTINEL],
            [1, 0],  # first listed segment, slot 0 on (1, 0, −1): (x0, x1)
            [2, 2],  # slot 0 on (2, 2, 2)
        ],
    )


# Expand segments listed (2, 2, slot 1), (1, 1, slot 0): the first segment in the rows starts at row 1,
# row 0 before it and row 4 after the last are uncovered.
# slot 0 on (3, 4) = (3, 4, 7); slot 1 on (5, 6) = (10, −6, 17); on (7, 8) = (14, −8, 23).
LATE_SEGMENTS = (slots([2, 1]), slots([2, 1]), slots([1, 0]), 2, 2, 5)


def test_sgmv_expand_with_a_late_first_segment_leaves_the_rows_before_and_after_alone():
    out = rows_of(10, 20, 30, 40, 50, width=4)
    sgmv_expand(S, B, out, *LATE_SEGMENTS, add_inputs=True)
    assert_exact(out, [[10] * 4, [23, 24, 27, 20], [40, 24, 47, 30], [54, 32, 63, 40], [50] * 4])


def test_sgmv_expand_slice_overwrite_never_touches_uncovered_rows():
    out = rows_of(10, 20, 30, 40, 50, width=5)
    sgmv_expand_slice(S, B, out, *LATE_SEGMENTS, 1, 3)  # columns 1..3, add_inputs=False: overwrite
    assert_exact(out, [[10] * 5, [20, 3, 4, 7, 20], [30, 10, -6, 17, 30], [40, 14, -8, 23, 40], [50] * 5])


# -- LoRAKernelMeta ------------------------------------------------------------------------------

# 20 tokens: slot −1 three times, 0 ten times, 1 five times, 2 twice, interleaved.
TWENTY = [0, 1, -1, 0, 0, 2, 1, 0, -1, 0, 1, 0, 0, 2, 1, 0, -1, 0, 1, 0]


def int32(values) -> torch.Tensor:
    return torch.tensor(values, dtype=torch.int32)


def test_kernel_meta_matches_the_example_of_the_notes():
    meta = LoRAKernelMeta.build(slots(TWENTY), max_loras=3)
    assert_exact(meta.token_lora_mapping, int32(TWENTY))
    assert_exact(meta.active_lora_ids, int32([-1, 0, 1, 2]))
    assert_exact(meta.num_tokens_per_lora, int32([3, 10, 5, 2]))
    assert_exact(meta.lora_token_start_loc, int32([0, 3, 13, 18, 20]))
    assert not bool(meta.no_lora_flag_cpu.item())


def test_kernel_meta_sorts_tokens_stably():
    # Grouped by slot in increasing order; inside a group, tokens keep their original order.
    meta = LoRAKernelMeta.build(slots(TWENTY), max_loras=3)
    expected = [2, 8, 16] + [0, 3, 4, 7, 9, 11, 12, 15, 17, 19] + [1, 6, 10, 14, 18] + [5, 13]
    assert_exact(meta.token_indices_sorted_by_lora_ids, int32(expected))


def test_kernel_meta_pads_unused_entries():
    # With room for 5 slots but only 2 active ids, ids pad with −1, counts with 0, starts with 0.
    meta = LoRAKernelMeta.build(slots([3, 3, 0]), max_loras=5)
    assert_exact(meta.active_lora_ids, int32([0, 3, -1, -1, -1, -1]))
    assert_exact(meta.num_tokens_per_lora, int32([1, 2, 0, 0, 0, 0]))
    assert_exact(meta.lora_token_start_loc, int32([0, 1, 3, 0, 0, 0, 0]))
    assert_exact(meta.token_indices_sorted_by_lora_ids, int32([2, 0, 1]))


def test_kernel_meta_flags_a_batch_without_adapters():
    assert bool(LoRAKernelMeta.build(slots([-1, -1]), max_loras=2).no_lora_flag_cpu.item())
    assert not bool(LoRAKernelMeta.build(slots([-1, 1]), max_loras=2).no_lora_flag_cpu.item())


# -- SegmentMetadata -----------------------------------------------------------------------------


def test_segment_metadata_merges_runs_of_equal_slots():
    meta = SegmentMetadata.from_token_slots(slots([0, 0, -1, 1, 1, 1, 0]))
    assert_exact(meta.b_seq_start_loc, slots([0, 2, 3, 6]))
    assert_exact(meta.seq_len_tensor, slots([2, 1, 3, 1]))
    assert_exact(meta.lora_indices_tensor, slots([0, -1, 1, 0]))
    assert (meta.batches, meta.max_seq_length, meta.token_nums, meta.no_lora) == (4, 3, 7, False)
    assert meta.args()[3:] == (4, 3, 7)


def test_segment_metadata_of_a_batch_without_adapters():
    meta = SegmentMetadata.from_token_slots(slots([-1, -1, -1]))
    assert (meta.batches, meta.max_seq_length, meta.token_nums, meta.no_lora) == (1, 3, 3, True)


# -- lora_shrink / lora_expand -------------------------------------------------------------------


def test_lora_shrink_writes_every_slice_from_the_sorted_metadata():
    # Slot 2 on tokens 0 and 3 (not adjacent), slot 0 on token 2, token 1 without adapter.
    meta = LoRAKernelMeta.build(slots([2, -1, 0, 2]), max_loras=3)
    out = torch.zeros(2, 4, 2, dtype=torch.float64)
    out[:, 1] = SENTINEL
    lora_shrink(X[:4], [A, A2], out, *meta.meta_args(), 2.0)
    assert_exact(
        out[0],  # slice 0, stack A, scale 2
        [[6, 2], [SENTINEL] * 2, [14, 16], [-2, 2]],  # (3, 1)·2, −, (7, 8)·2, (−1, 1)·2
    )
    assert_exact(
        out[1],  # slice 1, stack A2: slot 2 → A[1], slot 0 → A[2]
        [[12, 12], [SENTINEL] * 2, [18, 14], [0, -4]],  # (6, 6)·2, −, (9, 7)·2, (0, −2)·2
    )


# lora_expand: three slices of unequal widths (1, 3, 1) from offset_start 1:
#   slice 0 = B_NARROW on S_NARROW → column 1;  slice 1 = B on S[:3] → columns 2..4;
#   slice 2 = B_NARROW on S[:3] → column 5;  columns 0 and 6 are never written.
# token 0, slot 1: 3·1 = 3 | (2, −2, 5) | 3·2 = 6;   token 2, slot 0: 0 − 2 = −2 | (5, 6, 11) | 5 − 6 = −1
THREE_SLICES = (torch.stack([S_NARROW, S[:3], S[:3]]), [B_NARROW, B, B_NARROW])


def test_lora_expand_places_unequal_slices_from_offset_start():
    meta = LoRAKernelMeta.build(slots([1, -1, 0]), max_loras=2)
    out = rows_of(10, 20, 30, width=7)
    lora_expand(*THREE_SLICES, out, *meta.meta_args(), offset_start=1)  # add_inputs defaults to False
    assert_exact(out, [[10, 3, 2, -2, 5, 6, 10], [20] * 7, [30, -2, 5, 6, 11, -1, 30]])


def test_lora_expand_with_add_inputs():
    meta = LoRAKernelMeta.build(slots([1, -1, 0]), max_loras=2)
    out = rows_of(10, 20, 30, width=7)
    lora_expand(*THREE_SLICES, out, *meta.meta_args(), offset_start=1, add_inputs=True)
    assert_exact(out, [[10, 13, 12, 8, 15, 16, 10], [20] * 7, [30, 28, 35, 36, 41, 29, 30]])


def test_no_lora_flag_means_nothing_is_written():
    meta = LoRAKernelMeta.build(slots([-1, -1, -1]), max_loras=2)
    shrunk = torch.full((1, 3, 2), SENTINEL, dtype=torch.float64)
    lora_shrink(X[:3], [A], shrunk, *meta.meta_args(), 1.0)
    assert_exact(shrunk, torch.full((1, 3, 2), SENTINEL, dtype=torch.float64))
    out = rows_of(10, 20, 30, width=3)
    lora_expand(S[:3].unsqueeze(0), [B], out, *meta.meta_args(), add_inputs=False)
    assert_exact(out, rows_of(10, 20, 30, width=3))


def test_no_lora_flag_wins_over_stale_metadata():
    # vLLM leaves the other buffers stale when the flag is set; the kernels must still write nothing.
    stale = LoRAKernelMeta.build(slots([0, 1, 0]), max_loras=2).meta_args()[:-1]
    out = rows_of(10, 20, 30, width=3)
    lora_expand(S[:3].unsqueeze(0), [B], out, *stale, torch.tensor([True]), add_inputs=False)
    assert_exact(out, rows_of(10, 20, 30, width=3))


# -- rounding and layout -------------------------------------------------------------------------


def test_fp32_expand_input_is_rounded_to_the_bf16_weight_dtype_first():
    # x0 = 1 + 2⁻⁸ + 2⁻¹⁰ is exact in float32; bfloat16 keeps 8 significant bits, so it rounds up
    # to 1 + 2⁻⁷. With B = [1, 1] the delta is x0 − 1: 2⁻⁷ after rounding, 5·2⁻¹⁰ without (and
    # 5·2⁻¹⁰ = 1.25·2⁻⁸ is itself a bfloat16, so only the input rounding can explain 2⁻⁷).
    x = torch.tensor([[1 + 2**-8 + 2**-10, -1.0]], dtype=torch.float32)
    ones = torch.ones(1, 1, 2)
    for op in (bgmv_expand, lambda x, b, o, i, add_inputs: bgmv_expand_slice(x, b, o, i, 0, 1, add_inputs)):
        out = torch.zeros(1, 1, dtype=torch.bfloat16)
        op(x, ones.to(torch.bfloat16), out, slots([0]), add_inputs=False)
        assert out.item() == 2**-7
        # The same product with float32 weights is not rounded.
        out32 = torch.zeros(1, 1, dtype=torch.float32)
        op(x, ones, out32, slots([0]), add_inputs=False)
        assert out32.item() == 5 * 2**-10
    meta = LoRAKernelMeta.build(slots([0]), max_loras=1)
    out = torch.zeros(1, 1, dtype=torch.bfloat16)
    lora_expand(x.unsqueeze(0), [ones.to(torch.bfloat16)], out, *meta.meta_args())
    assert out.item() == 2**-7


def test_three_and_four_dimensional_stacks_give_the_same_result():
    token_slots = slots([2, -1, 0, 1])
    out3, out4 = torch.zeros(4, 2, dtype=torch.float64), torch.zeros(4, 2, dtype=torch.float64)
    bgmv_shrink(X[:4], A, out3, token_slots)
    bgmv_shrink(X[:4], A.unsqueeze(1), out4, token_slots)  # [L, 1, R, H]
    assert_exact(out4, out3)

    out3, out4 = rows_of(1, 2, 3, width=4), rows_of(1, 2, 3, width=4)
    bgmv_expand(S[:3], B, out3, slots([1, -1, 0]))
    bgmv_expand(S[:3], B.unsqueeze(1), out4, slots([1, -1, 0]))  # [L, 1, N, R]
    assert_exact(out4, out3)

    meta = LoRAKernelMeta.build(slots([1, -1, 0]), max_loras=2).meta_args()
    inputs = torch.stack([S[:3], S_NARROW])
    out3, out4 = rows_of(1, 2, 3, width=5), rows_of(1, 2, 3, width=5)
    lora_expand(inputs, [B, B_NARROW], out3, *meta, offset_start=1)
    lora_expand(inputs, [B.unsqueeze(1), B_NARROW], out4, *meta, offset_start=1)  # mixed 3-D and 4-D
    assert_exact(out4, out3)


# -- bad arguments -------------------------------------------------------------------------------


def _out(rows: int, cols: int) -> torch.Tensor:
    return torch.zeros(rows, cols, dtype=torch.float64)


BAD_CALLS = {
    "slice_size": lambda: bgmv_expand_slice(S[:3], B, _out(3, 6), slots([0, 0, 0]), 0, 2),
    "token_nums": lambda: sgmv_shrink(X, A, _out(5, 2), slots([0]), slots([5]), slots([0]), 1, 5, 4, 1.0),
    "batches": lambda: sgmv_shrink(X, A, _out(5, 2), slots([0]), slots([5]), slots([0]), 2, 5, 5, 1.0),
    "max_seq_length": lambda: sgmv_expand(S, B, _out(5, 3), slots([0]), slots([5]), slots([0]), 1, 4, 5),
    "overlap": lambda: sgmv_shrink(X, A, _out(5, 2), slots([0, 1]), slots([2, 2]), slots([0, 1]), 2, 2, 5, 1.0),
    "outside the 5 rows": lambda: sgmv_expand(S, B, _out(5, 3), slots([4]), slots([2]), slots([0]), 1, 2, 5),
    "slot indices": lambda: bgmv_shrink(X[:4], A, _out(4, 2), slots([0, 0, 0])),
    "features": lambda: bgmv_shrink(X[:, :2], A, _out(5, 2), slots([0] * 5)),
    "rank": lambda: bgmv_expand(X[:3], B, _out(3, 3), slots([0, 0, 0])),
    "does not fit": lambda: bgmv_expand_slice(S[:3], B, _out(3, 4), slots([0, 0, 0]), 2, 3),
    "num_layers": lambda: bgmv_shrink(X[:1], torch.zeros(3, 2, 2, 3, dtype=torch.float64), _out(1, 2), slots([0])),
    "token slots": lambda: LoRAKernelMeta.build(slots([0, 3]), max_loras=3),
    "slices": lambda: lora_expand(
        torch.stack([S[:3], S_NARROW]), [B], _out(3, 3), *LoRAKernelMeta.build(slots([0, 0, 0]), 2).meta_args()
    ),
    "seq_lens": lambda: LoRAMapping((0, 0), (0,), (3,), True, 1),
    "sampled_slots": lambda: LoRAMapping((0,), (2,), (1,), True, 2),
}


@pytest.mark.parametrize("problem", BAD_CALLS)
def test_bad_arguments_raise_a_value_error_naming_the_problem(problem):
    with pytest.raises(ValueError, match=problem):
        BAD_CALLS[problem]()


# -- PunicaWrapperReference ----------------------------------------------------------------------


def wrapper_for(token_slots, num_slots, sampled_slots=None) -> PunicaWrapperReference:
    """A wrapper whose mapping has one token per sequence (so sampled rows default to the tokens)."""
    wrapper = PunicaWrapperReference()
    sampled = tuple(token_slots) if sampled_slots is None else tuple(sampled_slots)
    wrapper.update_metadata(LoRAMapping(tuple(token_slots), sampled, (1,) * len(token_slots), True, num_slots))
    return wrapper


def test_add_shrink_scales_every_slice():
    y = torch.zeros(2, 4, 2, dtype=torch.float64)
    y[:, 1] = SENTINEL
    wrapper_for([2, -1, 0, 2], 3).add_shrink(y, X[:4], (A, A2), 0.5)
    # lora_shrink's worked example at scale 0.5 instead of 2
    assert_exact(y[0], [[1.5, 0.5], [SENTINEL] * 2, [3.5, 4], [-0.5, 0.5]])
    assert_exact(y[1], [[3, 3], [SENTINEL] * 2, [4.5, 3.5], [0, -1]])


def test_add_expand_bias_follows_offset_start_and_is_added_after_overwrite():
    bias_wide = f64([[100, 200, 300], [400, 500, 600]])  # [L, N=3]
    bias_narrow = f64([[[7]], [[8]]])  # [L, 1, N=1], vLLM's layout
    y = rows_of(10, 20, 30, width=6)
    wrapper_for([1, -1, 0], 2).add_expand(
        y, (S[:3], S_NARROW), (B, B_NARROW), (3, 1), offset_start=1, add_inputs=False,
        lora_bias_stacked=(bias_wide, bias_narrow),
    )
    assert_exact(
        y,
        [
            [10, 2 + 400, -2 + 500, 5 + 600, 3 + 8, 10],  # slot 1
            [20] * 6,  # slot −1: no delta, no bias
            [30, 5 + 100, 6 + 200, 11 + 300, -2 + 7, 30],  # slot 0
        ],
    )


def test_add_expand_accumulates_and_skips_a_missing_bias():
    y = rows_of(10, 20, 30, width=4)
    wrapper_for([1, -1, 0], 2).add_expand(
        y, torch.stack([S[:3], S_NARROW]), (B, B_NARROW), (3, 1), lora_bias_stacked=(None, f64([[7], [8]]))
    )
    assert_exact(y, [[12, 8, 15, 10 + 3 + 8], [20] * 4, [35, 36, 41, 30 - 2 + 7]])


def test_add_lora_linear_composes_shrink_and_expand_with_an_unscaled_bias():
    # Shrink at scale 0.5 (token: slot, x → scale·A x):
    #   0: slot 2, (1, 2, 3) → (1.5, 0.5);  2: slot 0, (7, 8, 9) → (3.5, 4);  3: slot 1, (1, 0, −1) → (0, −1)
    b_square = f64([[[1, 0], [0, 1]], [[0, 1], [1, 0]], [[1, 1], [1, -1]]])  # identity, swap, sum/difference
    b_single = f64([[[2, 0]], [[0, 2]], [[1, 1]]])  # 2·s0, 2·s1, s0 + s1
    bias_single = f64([[10], [20], [30]])
    y = torch.ones(4, 3, dtype=torch.float64)
    wrapper_for([2, -1, 0, 1], 3).add_lora_linear(
        y, X[:4], (A, A), (b_square, b_single), 0.5, (2, 1), lora_bias_stacked=(None, bias_single)
    )
    assert_exact(
        y,
        [
            [1 + 2, 1 + 1, 1 + 2 + 30],  # slot 2: (1.5 + 0.5, 1.5 − 0.5), 1.5 + 0.5, bias 30
            [1, 1, 1],
            [1 + 3.5, 1 + 4, 1 + 7 + 10],  # slot 0: identity, 2·3.5, bias 10
            [1 + -1, 1 + 0, 1 + -2 + 20],  # slot 1: swap, 2·(−1), bias 20
        ],
    )


def test_add_lora_embedding_with_a_four_dimensional_stack():
    y = rows_of(10, 20, 30, width=3)
    wrapper_for([1, -1, 0], 2).add_lora_embedding(y, S[:3], B.unsqueeze(1))
    assert_exact(y, [[12, 8, 15], [20] * 3, [35, 36, 41]])
    y = rows_of(10, 20, 30, width=3)
    wrapper_for([1, -1, 0], 2).add_lora_embedding(y, S[:3], B.unsqueeze(1), add_inputs=False)
    assert_exact(y, [[2, -2, 5], [20] * 3, [5, 6, 11]])


def test_add_lora_logits_reads_the_sampled_rows_not_the_tokens():
    # Tokens use slots (0, 1, −1) but the sampled rows use (1, −1, 0): the logits follow the latter.
    wrapper = wrapper_for([0, 1, -1], 2, sampled_slots=[1, -1, 0])
    y = torch.ones(3, 3, dtype=torch.float64)
    wrapper.add_lora_logits(y, X[:3], A[:2], B, 0.5)
    # row 0, slot 1: A x = (6, 6)·0.5 = (3, 3) → B (6, −3, 9);  row 2, slot 0: (7, 8)·0.5 → (3.5, 4, 7.5)
    assert_exact(y, [[7, -2, 10], [1, 1, 1], [4.5, 5, 8.5]])


def test_add_lora_logits_with_fewer_sampled_rows_than_tokens():
    wrapper = PunicaWrapperReference()
    wrapper.update_metadata(LoRAMapping((0, 0, 0, 1, 1), (0, 1), (3, 2), True, 2))
    y = torch.zeros(2, 3, dtype=torch.float64)
    wrapper.add_lora_logits(y, X[:2], A[:2], B, 1.0)
    # row 0, slot 0: (1, 2) → (1, 2, 3);  row 1, slot 1: (15, 12) → (30, −12, 39)
    assert_exact(y, [[1, 2, 3], [30, -12, 39]])


def test_wrapper_refuses_mismatched_slices_and_rows():
    wrapper = wrapper_for([0, 0, 0], 2)
    with pytest.raises(ValueError, match="output_slices"):
        wrapper.add_expand(rows_of(0, 0, 0, width=4), torch.stack([S[:3], S_NARROW]), (B, B_NARROW), (3, 2))
    with pytest.raises(ValueError, match="mapping describes 3 rows"):
        wrapper.add_lora_embedding(rows_of(0, 0, width=3), S[:2], B)


def test_wrapper_needs_metadata_first():
    with pytest.raises(RuntimeError, match="update_metadata"):
        PunicaWrapperReference().add_lora_embedding(rows_of(0, width=3), S[:1], B)


# -- apply_lora_full_linear: a whole linear layer per slot, replacing the row ------------------------------

# Three slots of a 2-label head over H = 2: W[l] is [P = 2, H = 2], bias[l] is [2].
W_FULL = f64([[[1, 0], [0, 1]], [[1, 1], [2, -1]], [[0, 3], [1, 0]]])
BIAS_FULL = f64([[10, 20], [0, -1], [5, 5]])


def test_apply_lora_full_linear_replaces_enabled_rows_and_leaves_the_others():
    # Tokens use slots (2, 2, 2, 0) but the sampled rows (one per request) use (1, −1, 2, 0); slot 2 is disabled.
    wrapper = PunicaWrapperReference()
    wrapper.update_metadata(LoRAMapping((2, 2, 2, 0), (1, -1, 2, 0), (1, 1, 1, 1), True, 3))
    x = f64([[1, 2], [3, 4], [5, 6], [7, 8]])
    y = torch.full((4, 2), SENTINEL, dtype=torch.float64)
    enabled = torch.tensor([True, True, False])
    wrapper.apply_lora_full_linear(y, x, W_FULL.unsqueeze(1), BIAS_FULL, enabled)
    # row 0, slot 1: (1 + 2, 2 − 2) + (0, −1) = (3, −1);  row 3, slot 0: (7, 8) + (10, 20) = (17, 28)
    # row 1 (slot −1) and row 2 (slot 2, disabled) keep the base output: the sentinel, not a sum with it
    assert_exact(y, [[3, -1], [SENTINEL, SENTINEL], [SENTINEL, SENTINEL], [17, 28]])


def test_apply_lora_full_linear_without_bias_and_with_a_three_dimensional_stack():
    wrapper = wrapper_for([2, 0], 3)
    y = torch.full((2, 2), SENTINEL, dtype=torch.float64)
    wrapper.apply_lora_full_linear(y, f64([[1, 2], [3, 4]]), W_FULL, None, torch.ones(3, dtype=torch.bool))
    # row 0, slot 2: (0·1 + 3·2, 1·1 + 0·2) = (6, 1);  row 1, slot 0: identity (3, 4)
    assert_exact(y, [[6, 1], [3, 4]])


def test_apply_lora_full_linear_rounds_once_to_the_output_dtype():
    # 1 + 2⁻¹¹ is not a float16; its sum with a bias of 2⁻¹¹ is (1 + 2⁻¹⁰): rounding the product first
    # (to 1.0) and then adding the bias (1 + 2⁻¹¹ → 1.0 again, ties to even) would lose it.
    wrapper = wrapper_for([0], 1)
    weight = torch.tensor([[[1.0, 2.0**-11]]], dtype=torch.float32)  # [L = 1, P = 1, H = 2]
    y = torch.zeros(1, 1, dtype=torch.float16)
    x = torch.tensor([[1.0, 1.0]], dtype=torch.float32)
    wrapper.apply_lora_full_linear(y, x, weight, torch.tensor([[2.0**-11]]), torch.ones(1, dtype=torch.bool))
    assert y.item() == 1 + 2.0**-10
