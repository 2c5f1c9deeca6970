"""Edge-case families: the corners of the LoRA ops where implementations really break.

Each family is a goal the strategy steers towards (every case of family ``f`` exhibits feature ``f``
when the op can express it) and applies to the ops that read the knobs it needs. vLLM's own random
tests reach none of ``neg1``, ``neg1_one_slot``, ``last_slot``, ``unequal_seqs`` or ``slices``
(docs/vllm-lora-ops.md §7.5).

A family is one class here: its name, what it is, the knobs it needs, the feature it shows, and the
draws it adjusts. The strategy (``conformance.generator.strategies.cases``) draws every case through
the same steps, in the same order, asking the family at each step; :class:`Family` holds the
defaults (draw freely where the structure is drawn, leave every optional feature off), and each
family overrides only the steps it steers. ``random`` turns each optional feature on or off by a
draw of its own. Adding a family is one subclass and one entry in ``FAMILIES``.
"""

from __future__ import annotations

from dataclasses import replace
from typing import ClassVar

from hypothesis import strategies as st

from conformance.cases.case import ODD_HIDDEN_SIZES, REAL_HIDDEN_SIZES
from conformance.ops import OpSpec

from .limits import Limits

POWER_OF_TWO_RANKS = (1, 2, 4, 8, 16, 32, 64, 128, 256)
ODD_RANKS = (1, 3, 5, 7, 12, 20, 33, 49, 100, 200, 250)
# The max_lora_rank values vLLM accepts (vllm/config/lora.py, 0.32 and 0.33); the families draw the stack's
# rank R freely below 256 (POWER_OF_TWO_RANKS, ODD_RANKS), 256 itself (rank_max) and those above (rank_512).
VLLM_MAX_LORA_RANKS = (1, 8, 16, 32, 64, 128, 256, 320, 512)
RANKS_ABOVE_256 = tuple(r for r in VLLM_MAX_LORA_RANKS if r > 256)  # 320 (no power of two) and 512, vLLM's largest


class Family:
    """The defaults of every step; a family overrides the steps it steers."""

    name: ClassVar[str]
    doc: ClassVar[str]
    needs_knobs: ClassVar[frozenset[str]] = frozenset()
    feature: ClassVar[str | None] = None  # the feature (conformance.cases.features) every case shows
    dtypes: ClassVar[frozenset[str] | None] = None  # the case dtypes where it can show its feature (None: all)
    min_seqs: ClassVar[int] = 1
    sized: ClassVar[bool] = False  # draws a real or odd feature size (hidden size, else the output width)
    decode: ClassVar[bool] = False  # a decode batch (ops that read prefill)
    for_moe: ClassVar[bool] = True  # also aimed at the fused-MoE ops (those that read "routing")
    # steers values, ranks or sizes only: nothing for an op judged by invariants on its indices
    # (moe_lora_align_block_size reads the routing, no weight and no activation)
    about_values: ClassVar[bool] = False
    # aimed only at the ops that name it (OpSpec.families), never by its knobs alone
    named_only: ClassVar[bool] = False
    # every case serves at least one row from an adapter: a case whose rows are all slot −1 can only check that
    # nothing was written, and its family's corner (a rank, a size, a layout) is never read (allneg1 alone is that case)
    serves: ClassVar[bool] = True

    def applies_to(self, spec: OpSpec, dtype: str) -> bool:
        if spec.families is not None and self.name not in spec.families:
            return False
        if self.named_only and spec.families is None:
            return False
        if ("routing" in spec.knobs and not self.for_moe) or (self.about_values and spec.check is not None):
            return False
        return self.needs_knobs <= spec.knobs and (self.dtypes is None or dtype in self.dtypes)

    # -- the structure: slots, sequences, ranks, sizes ------------------------------------------

    def num_slots(self, draw, limits: Limits) -> int:
        return draw(st.integers(1, limits.max_slots))

    def sequence_lengths(self, draw, limits: Limits) -> tuple[int, ...]:
        max_len = 2 if self.sized else limits.max_seq_len
        return tuple(self._lengths(draw, limits, max_len))

    def _lengths(self, draw, limits: Limits, max_len: int) -> list[int]:
        return draw(st.lists(st.integers(1, max_len), min_size=self.min_seqs, max_size=max(self.min_seqs, limits.max_seqs)))

    def sequence_slots(self, draw, num_seqs: int, num_slots: int) -> tuple[int, ...]:
        slots = self.steer_slots(draw, self._slots(draw, num_seqs, num_slots), num_slots)
        if self.serves and all(slot == -1 for slot in slots):  # steered, not rejected: the draw stays shrinkable
            slots[draw(st.integers(0, len(slots) - 1))] = draw(st.integers(0, num_slots - 1))
        return tuple(slots)

    def _slots(self, draw, num_seqs: int, num_slots: int) -> list[int]:
        return draw(st.lists(st.integers(-1, num_slots - 1), min_size=num_seqs, max_size=num_seqs))

    def steer_slots(self, draw, slots: list[int], num_slots: int) -> list[int]:
        return slots

    def max_rank(self, draw, limits: Limits) -> int:
        return draw(st.sampled_from([r for r in POWER_OF_TWO_RANKS if r <= limits.max_rank]))

    def slot_ranks(self, draw, max_rank: int, num_slots: int) -> list[int]:
        any_rank = st.one_of(st.just(max_rank), st.integers(1, max_rank))
        return draw(st.lists(any_rank, min_size=num_slots, max_size=num_slots))

    def affordable(self, limits: Limits, max_rank: int, ranks: tuple[int, ...]) -> tuple[Limits, int, tuple[int, ...]]:
        """Smaller limits for a family whose cases would otherwise be too costly to compute."""
        return limits, max_rank, ranks

    def steer_ranks(self, draw, ranks: list[int], served: list[int], max_rank: int) -> list[int]:
        """The slot ranks, steered so that a slot some row is served by (``served``, never empty but for
        allneg1) has the rank the family is about: the stack's rank alone is never read by a row."""
        return ranks

    def feature_size(self, draw, default_max: int) -> int:
        return draw(st.integers(8, default_max))

    def hidden_size(self, draw, default_max: int) -> int:
        """The hidden size where the family draws no real or odd size (``sized``): freely, whatever ``feature_size``
        a subclass has (only fp8_block steers it, towards partial scale groups)."""
        return Family.feature_size(self, draw, default_max)

    def first_width(self, draw, limits: Limits) -> int:
        """The width of the first output slice where the family draws no real or odd size (``sized``)."""
        return draw(st.integers(1, limits.max_width))

    def slice_count(self, draw, spec: OpSpec) -> int:
        # Most packed layers have one to three slices (QKV); more are the ``many_slices`` family's and ``random``'s.
        return draw(st.integers(1, min(3, spec.max_slices)))

    def distinct_widths(self) -> bool:
        return False

    def equal_widths(self) -> bool:
        """Every slice as wide as the first (asked before the other widths are drawn)."""
        return False

    def fp8_groups(self, draw, k: int, n: int) -> tuple[int, int]:
        """``(Case.group_k, Case.group_n)`` of an fp8 case: 0, 0 but for block scales."""
        return 0, 0

    # -- vLLM 0.34's corners, drawn last and only by their own families: every other case draws as it did --

    def logits_per_seq(self, draw, seq_slots: tuple[int, ...]) -> tuple[int, ...]:
        """``Case.logits_per_seq``: ``()``, one logits row per sequence."""
        return ()

    def packed_slices(self, draw, slices: tuple[int, ...], seq_slots: tuple[int, ...]) -> tuple[tuple[int, ...], tuple, tuple]:
        """``(output_slices, Case.absent_slices, Case.repeated_slices)``: the slices as drawn, every slot holding
        each slice's own sub-module."""
        return slices, (), ()

    def embed_scale(self, draw) -> float:
        """``Case.embed_scale``: 0, no scale folded."""
        return 0.0

    # -- the optional features: off unless the family turns them on ------------------------------

    def with_offset(self, draw, spec: OpSpec) -> bool:
        return False

    def wide(self, draw) -> bool:
        return False

    def add_inputs(self, draw) -> bool:
        return True

    def scaled(self, draw) -> bool:
        return False

    def fp32_input(self, draw) -> bool:
        return False

    def bias(self, draw) -> bool:
        return False

    def weights_4d(self, draw) -> bool:
        return False

    def distribution(self, draw) -> str:
        return "normal"

    def segment_layout(self, draw, seq_lens: tuple[int, ...], seq_slots: tuple[int, ...]) -> tuple[tuple[int, ...], int]:
        """``(Case.seq_starts, Case.num_rows)`` of an op that reads ``b_seq_start_loc`` (knob "segments").

        ``((), 0)``, without a draw: the segments lie back to back from row 0 in metadata order."""
        return (), 0

    # -- the routing of the fused-MoE ops (conformance.ops.moe) ----------------------------------

    def num_experts(self, draw, limits: Limits) -> int:
        return draw(st.integers(2, limits.max_experts))

    def top_k(self, draw, experts: int) -> int:
        return draw(st.integers(1, min(experts, 4)))

    def expert_map(self, draw, experts: int) -> tuple[int, ...]:
        """Global expert → local expert or −1; ``()``: every expert is local."""
        return ()

    def token_choices(self, draw, choice, num_tokens: int) -> list[list[int]]:
        """Each token's ``top_k`` experts, one draw of ``choice`` per token."""
        return [draw(choice) for _ in range(num_tokens)]

    def steer_routing(self, draw, topk_ids: list[list[int]], expert_map: tuple[int, ...], global_experts: int,
                      served: list[int]) -> list[list[int]]:
        """The routing, steered so the family's corner lies on a token an adapter serves (``served``, token
        indices): the kernels skip the pairs of slot −1, so a corner there is never read."""
        return topk_ids

    def disabled_slots(self, draw, token_slots: tuple[int, ...], num_slots: int) -> tuple[int, ...]:
        return ()

    def shared_experts(self, draw) -> bool:
        return False

    def gate_up_slices(self, draw) -> int:
        return 2  # gate and up as two slices (FusedMoEWithLoRA)

    def routed_weight(self, draw) -> bool:
        return False

    def zero_weight_pairs(self, draw, num_pairs: int, served_pairs: list[int]) -> tuple[int, ...]:
        return ()

    def naive_blocks(self, draw) -> bool:
        return False

    def block_size(self, draw) -> int:
        return draw(st.sampled_from(BLOCK_SIZES))


# the BLOCK_SIZE_M values of vLLM's fused-MoE LoRA tile configs
BLOCK_SIZES = (16, 32, 64)


def _draws_on(self, draw) -> bool:
    return draw(st.booleans())


class Random(Family):
    name, doc = "random", "everything drawn freely"
    wide = add_inputs = scaled = fp32_input = bias = weights_4d = _draws_on
    shared_experts = routed_weight = naive_blocks = _draws_on

    def distribution(self, draw) -> str:
        return draw(st.sampled_from(("normal", "positive")))

    def gate_up_slices(self, draw) -> int:
        return draw(st.integers(1, 2))

    def slice_count(self, draw, spec: OpSpec) -> int:
        return draw(st.integers(1, spec.max_slices))


class Neg1(Family):
    name, doc, feature, min_seqs = "neg1", "rows without adapter (slot −1) mixed with adapter rows", "neg1", 2

    def steer_slots(self, draw, slots: list[int], num_slots: int) -> list[int]:
        i = draw(st.integers(0, len(slots) - 1))
        j = (i + 1 + draw(st.integers(0, len(slots) - 2))) % len(slots)
        slots[i] = -1
        if slots[j] == -1:
            slots[j] = draw(st.integers(0, num_slots - 1))
        return slots


class Neg1OneSlot(Neg1):
    name, doc, feature = "neg1_one_slot", "slot −1 mixed with the only slot of a one-slot stack", "one_slot"

    def num_slots(self, draw, limits: Limits) -> int:
        return 1


class AllNeg1(Family):
    name, doc, feature = "allneg1", "no row uses an adapter", "allneg1"
    serves = False

    def _slots(self, draw, num_seqs: int, num_slots: int) -> list[int]:
        return [-1] * num_seqs


class LastSlot(Family):
    name, doc, feature = "last_slot", "the last slot L−1 is used", "last_slot"

    def num_slots(self, draw, limits: Limits) -> int:
        return draw(st.integers(2, limits.max_slots))

    def steer_slots(self, draw, slots: list[int], num_slots: int) -> list[int]:
        slots[draw(st.integers(0, len(slots) - 1))] = num_slots - 1
        return slots


class NonContiguous(Family):
    name, doc, feature, min_seqs = "noncontig", "one adapter on non-adjacent tokens", "noncontig", 3

    def steer_slots(self, draw, slots: list[int], num_slots: int) -> list[int]:
        start = draw(st.integers(0, len(slots) - 3))
        slot = draw(st.integers(0, num_slots - 1))
        other = draw(st.integers(-1, num_slots - 1).filter(lambda s: s != slot))
        slots[start : start + 3] = [slot, other, slot]
        return slots


class UnequalSequences(Family):
    name, doc, feature, min_seqs = "unequal_seqs", "sequences of unequal length, one of length 1", "len1_seq", 2

    def _lengths(self, draw, limits: Limits, max_len: int) -> list[int]:
        lens = super()._lengths(draw, limits, max_len)
        longer = draw(st.integers(2, max(2, limits.max_seq_len)))
        where = draw(st.integers(0, len(lens) - 1))
        lens[where] = longer
        lens[(where + 1) % len(lens)] = 1
        return lens


class OneToken(Family):
    name, doc, feature = "t1", "a single token", "t1"

    def sequence_lengths(self, draw, limits: Limits) -> tuple[int, ...]:
        return (1,)


class LargeT(Family):
    name, doc, feature = "large_t", "a thousand tokens or more", "large_t"
    for_moe = False  # a thousand tokens' routing as case data: the MoE benchmarks cover large T

    def sequence_lengths(self, draw, limits: Limits) -> tuple[int, ...]:
        low, high = limits.large_t
        count = draw(st.integers(1, 4))
        # Round the per-sequence floor up: 3 × (1024 // 3) = 1023 tokens would miss ``large_t``.
        return tuple(draw(st.lists(st.integers(-(-low // count), high // count), min_size=count, max_size=count)))

    def affordable(self, limits, max_rank, ranks):
        return _small_products(limits), min(max_rank, 16), tuple(min(r, 16) for r in ranks)


class RankPadded(Family):
    name, doc, feature = "rank_padded", "adapters of rank below the stack's max rank", "rank_padded"
    about_values = True

    def max_rank(self, draw, limits: Limits) -> int:
        return max(super().max_rank(draw, limits), 2)  # rank 1 cannot be padded

    def slot_ranks(self, draw, max_rank: int, num_slots: int) -> list[int]:
        return draw(st.lists(st.integers(1, max(1, max_rank - 1)), min_size=num_slots, max_size=num_slots))


class RankOdd(Family):
    name, doc, feature = "rank_odd", "ranks that are not multiples of 16, rank 1 included", "rank_odd"
    about_values = True

    def max_rank(self, draw, limits: Limits) -> int:
        return draw(st.sampled_from([r for r in ODD_RANKS if r <= max(limits.max_rank, 33)]))

    def steer_ranks(self, draw, ranks, served, max_rank):
        return _serve_rank(draw, ranks, served, lambda rank: rank % 16 != 0, max_rank if max_rank % 16 else 1)


class RankMax(Family):
    # 256 was vLLM's largest max_lora_rank before 320 and 512 (rank_512); kept as it was, so its draws stay.
    name, doc, feature = "rank_max", "rank 256, the largest power-of-two rank below vLLM's 320 and 512", "rank_max"
    about_values = True

    def max_rank(self, draw, limits: Limits) -> int:
        return 256

    def affordable(self, limits, max_rank, ranks):
        return _small_products(limits), max_rank, ranks

    def steer_ranks(self, draw, ranks, served, max_rank):
        return _serve_rank(draw, ranks, served, lambda rank: rank == max_rank, max_rank)


class RealHidden(Family):
    name, doc, feature, sized = "real_hidden", "hidden sizes of real models", "real_hidden", True
    about_values = True

    def feature_size(self, draw, default_max: int) -> int:
        return draw(st.sampled_from(REAL_HIDDEN_SIZES))


class OddHidden(Family):
    name, doc, feature, sized = "odd_hidden", "hidden sizes that are no multiple of any block size", "odd_hidden", True
    about_values = True

    def feature_size(self, draw, default_max: int) -> int:
        return draw(st.sampled_from(ODD_HIDDEN_SIZES))


class Slices(Family):
    name, doc, feature = "slices", "2–3 output slices of unequal width (QKV, gate/up)", "unequal_slices"
    needs_knobs = frozenset({"slices"})

    def slice_count(self, draw, spec: OpSpec) -> int:
        return draw(st.integers(2, min(3, spec.max_slices)))

    def distinct_widths(self) -> bool:
        return True


class ManySlices(Slices):
    """Packed layers beyond QKV: vLLM 0.33 fuses up to 7 projections into one layer, where a kernel that
    sized its per-slice pointer table or grid for 3 slices reads past it or drops the rest."""

    name, doc, feature = "many_slices", "4–7 packed output slices of unequal width", "many_slices"

    def applies_to(self, spec: OpSpec, dtype: str) -> bool:
        return super().applies_to(spec, dtype) and spec.max_slices >= 4

    def slice_count(self, draw, spec: OpSpec) -> int:
        return draw(st.integers(4, spec.max_slices))


class Offset(Family):
    name, doc, feature = "offset", "output written from a column offset, output wider than written", "offset"
    needs_knobs = frozenset({"offset"})

    def with_offset(self, draw, spec: OpSpec) -> bool:
        return True

    def wide(self, draw) -> bool:
        return True


class WideOutput(Family):
    name, doc, feature = "wide_output", "output wider than the columns written", "wide_output"
    needs_knobs = frozenset({"wide"})

    def wide(self, draw) -> bool:
        return True


class NoAddInputs(Family):
    name, doc, feature = "no_add_inputs", "add_inputs=False: overwrite instead of accumulate", "no_add_inputs"
    needs_knobs = frozenset({"add_inputs"})

    def add_inputs(self, draw) -> bool:
        return False


class Scaled(Family):
    name, doc, feature = "scaled", "scale ≠ 1", "scaled"
    needs_knobs = frozenset({"scale"})

    def scaled(self, draw) -> bool:
        return True


class Fp32Input(Family):
    name, doc, feature = "fp32_input", "a float32 expand input (the shrink buffer) rounded to the weight dtype", "fp32_input"
    needs_knobs = frozenset({"expand_input"})
    dtypes = frozenset({"float16", "bfloat16"})  # a float32 input into float32 weights rounds nothing

    def fp32_input(self, draw) -> bool:
        return True


class Bias(Family):
    name, doc, feature = "bias", "LoRA bias per slot", "bias"
    needs_knobs = frozenset({"bias"})

    # A bias must follow offset_start and must not be scaled, so the bias family also draws both.
    def with_offset(self, draw, spec: OpSpec) -> bool:
        return "offset" in spec.knobs and draw(st.booleans())

    scaled = _draws_on

    def bias(self, draw) -> bool:
        return True


class FourDStacks(Family):
    name, doc, feature = "w4d", "4-D weight stacks [L, 1, rows, cols]", "w4d"
    needs_knobs = frozenset({"w4d"})

    def weights_4d(self, draw) -> bool:
        return True


class Decode(Family):
    name, doc, feature, decode = "decode", "decode batch: one token per sequence", "decode", True
    needs_knobs = frozenset({"prefill"})

    def sequence_lengths(self, draw, limits: Limits) -> tuple[int, ...]:
        return (1,) * draw(st.integers(1, limits.max_seqs * 2))


class Positive(Family):
    name, doc, feature = "positive", "all-positive values: large sums without cancellation", "positive"
    about_values = True

    def distribution(self, draw) -> str:
        return "positive"


# -- the segment layout of the sgmv ops: b_seq_start_loc is data, not the prefix sum of the lengths ---


class SegmentFamily(Family):
    """Segments that do not lie back to back from row 0 in metadata order (the sgmv ops).

    An implementation that ignores ``b_seq_start_loc`` and hands out the segments' slots by length from
    row 0 (vLLM's CPU torch ops: ``repeat_interleave(lora_indices, seq_len)``) gets such a batch wrong.
    For that to show even where slot −1 is not involved, the first two segments of the metadata use two
    different adapters."""

    needs_knobs = frozenset({"segments"})
    min_seqs = 2
    # drawn both ways: an overwrite (add_inputs=False) must leave the rows no segment covers alone too
    add_inputs = _draws_on

    def num_slots(self, draw, limits: Limits) -> int:
        return draw(st.integers(2, max(2, limits.max_slots)))

    def steer_slots(self, draw, slots: list[int], num_slots: int) -> list[int]:
        slots[0], slots[1] = draw(st.permutations(range(num_slots)))[:2]
        return slots


def _lay_out(seq_lens: tuple[int, ...], row_order: list[int], gaps: list[int]) -> tuple[tuple[int, ...], int]:
    """``(starts, rows)``: the segments placed in the rows in ``row_order`` (segment indices), ``gaps[0]``
    uncovered rows before the first, ``gaps[i]`` after the i-th (so ``gaps[-1]`` after the last)."""
    starts = [0] * len(seq_lens)
    row = gaps[0]
    for position, segment in enumerate(row_order):
        starts[segment] = row
        row += seq_lens[segment] + gaps[position + 1]
    return tuple(starts), row


class SegPermuted(SegmentFamily):
    name, doc, feature = "seg_permuted", "sgmv segments listed out of row order, every row covered, no slot −1", "seg_permuted"

    def _slots(self, draw, num_seqs: int, num_slots: int) -> list[int]:
        # no slot −1: a wrong row here is a segment read at the wrong place, never the −1 corner
        return draw(st.lists(st.integers(0, num_slots - 1), min_size=num_seqs, max_size=num_seqs))

    def segment_layout(self, draw, seq_lens, seq_slots):
        row_order = list(draw(st.permutations(range(len(seq_lens)))))
        # Row 0 must belong to a segment of another slot than the first listed one, so that a kernel
        # handing out the slots in metadata order from row 0 gets row 0 wrong (a mere reordering of equal
        # slots would not show). Segment 1's slot differs from segment 0's (steer_slots): it goes first.
        if seq_slots[row_order[0]] == seq_slots[0]:
            row_order.remove(1)
            row_order.insert(0, 1)
        return _lay_out(seq_lens, row_order, [0] * (len(seq_lens) + 1))


class SegGaps(SegmentFamily):
    name, doc, feature = "seg_gaps", "rows no sgmv segment covers before, between and after the segments", "seg_gap"

    def segment_layout(self, draw, seq_lens, seq_slots):
        count = len(seq_lens)
        row_order = list(draw(st.permutations(range(count)))) if draw(st.booleans()) else list(range(count))
        before, after = draw(st.integers(1, 3)), draw(st.integers(1, 3))
        between = draw(st.lists(st.integers(0, 3), min_size=count - 1, max_size=count - 1))
        if not any(between):
            between[draw(st.integers(0, count - 2))] = 1
        return _lay_out(seq_lens, row_order, [before, *between, after])


# -- the fused-MoE families: the corners of routing ---------------------------------------------------


class MoEFamily(Family):
    needs_knobs = frozenset({"routing"})


class MoEWideTopK(MoEFamily):
    name, doc, feature = "moe_wide_topk", "4–8 choices per token (Qwen3-MoE routes to 8)", "moe_wide_topk"

    def num_experts(self, draw, limits: Limits) -> int:
        return draw(st.integers(8, max(8, limits.max_experts)))

    def top_k(self, draw, experts: int) -> int:
        return draw(st.integers(4, 8))


class MoEManyExperts(MoEFamily):
    name, doc, feature = "moe_many_experts", "32–64 experts (Qwen3-MoE has 128, DeepSeek 256)", "moe_many_experts"

    def num_experts(self, draw, limits: Limits) -> int:
        return draw(st.integers(32, 64))

    def affordable(self, limits, max_rank, ranks):
        return replace(limits, max_hidden=min(limits.max_hidden, 64), max_width=min(limits.max_width, 64)), max_rank, ranks


class MoEHotExpert(MoEFamily):
    name, doc, feature, min_seqs = "moe_hot_expert", "one expert chosen by every token, another by none", "moe_hot_expert", 2

    def num_experts(self, draw, limits: Limits) -> int:
        return draw(st.integers(3, max(3, limits.max_experts)))

    def top_k(self, draw, experts: int) -> int:
        return draw(st.integers(1, 2))  # the hot expert then holds at least half of the pairs

    def steer_slots(self, draw, slots: list[int], num_slots: int) -> list[int]:
        # two served sequences: a hot expert among the served pairs needs two of them
        for position in draw(st.permutations(range(len(slots))))[:2]:
            if slots[position] == -1:
                slots[position] = draw(st.integers(0, num_slots - 1))
        return slots

    def steer_routing(self, draw, topk_ids, expert_map, global_experts, served):
        hot, cold = draw(st.permutations(range(global_experts)))[:2]
        others = [e for e in range(global_experts) if e not in (hot, cold)]
        for ids in topk_ids:
            ids[:] = [hot] + [draw(st.sampled_from(others)) for _ in ids[1:]]
        return topk_ids


class MoEDuplicateRouting(MoEFamily):
    name, doc, feature = "moe_duplicate", "a token choosing the same expert twice", "moe_duplicate"

    def top_k(self, draw, experts: int) -> int:
        return draw(st.integers(2, min(experts, 4)))

    def steer_routing(self, draw, topk_ids, expert_map, global_experts, served):
        ids = topk_ids[draw(st.sampled_from(served))]
        ids[1] = ids[0]
        return topk_ids


class MoEZeroWeight(MoEFamily):
    name, doc, feature = "moe_zero_weight", "routing weights of exactly 0 (a pruned or masked choice)", "moe_zero_weight"
    about_values = True

    def applies_to(self, spec: OpSpec, dtype: str) -> bool:
        return super().applies_to(spec, dtype) and spec.routed_weight is not False  # only a weighted op reads them

    def routed_weight(self, draw) -> bool:
        return True

    def zero_weight_pairs(self, draw, num_pairs: int, served_pairs: list[int]) -> tuple[int, ...]:
        zero = draw(st.sets(st.integers(0, num_pairs - 1), min_size=1, max_size=num_pairs))
        if not zero & set(served_pairs):  # a zero weight on a pair of slot −1 is never read
            zero.add(draw(st.sampled_from(served_pairs)))
        if len(served_pairs) > 1 and set(served_pairs) <= zero:  # and one served pair keeps a weight
            zero.discard(draw(st.sampled_from(served_pairs)))
        return tuple(sorted(zero))


class MoENonLocal(MoEFamily):
    name, doc, feature = "moe_nonlocal", "expert parallelism: choices of experts on another rank (expert_map −1)", "moe_nonlocal"

    def expert_map(self, draw, experts: int) -> tuple[int, ...]:
        order = draw(st.permutations(range(experts + draw(st.integers(1, experts)))))
        mapping = [-1] * len(order)
        for local, global_expert in enumerate(order[:experts]):
            mapping[global_expert] = local
        return tuple(mapping)

    def top_k(self, draw, experts: int) -> int:
        return draw(st.integers(2, min(experts, 4)))  # a remote choice beside a local one on the same served token

    def steer_routing(self, draw, topk_ids, expert_map, global_experts, served):
        remote = [g for g, local in enumerate(expert_map) if local == -1]
        ids = topk_ids[draw(st.sampled_from(served))]
        if not set(ids) & set(remote):
            ids[0] = draw(st.sampled_from(remote))
        if all(expert_map[e] == -1 for e in ids):  # what is served must still be computed for this token
            ids[1] = draw(st.sampled_from([g for g, local in enumerate(expert_map) if local != -1]))
        return topk_ids


class MoEDisabledSlot(MoEFamily):
    name, doc, feature, min_seqs = "moe_disabled", "a token whose slot has no MoE LoRA (adapter_enabled 0) beside one that has", "moe_disabled", 2

    def num_slots(self, draw, limits: Limits) -> int:
        return draw(st.integers(2, max(2, limits.max_slots)))

    def steer_slots(self, draw, slots: list[int], num_slots: int) -> list[int]:
        # two sequences of two different slots: one is disabled, the other stays served
        first, second = draw(st.permutations(range(len(slots))))[:2]
        slots[first], slots[second] = draw(st.permutations(range(num_slots)))[:2]
        return slots

    def disabled_slots(self, draw, token_slots, num_slots: int) -> tuple[int, ...]:
        used = sorted({s for s in token_slots if s != -1})
        return (draw(st.sampled_from(used)),)


class ModuleDisabled(MoEDisabledSlot):
    """The same corner for apply_lora_full_linear's module_enabled: a disabled head's row keeps the base output."""

    name, doc, feature = "module_disabled", "a sampled row whose slot's full-linear module is disabled beside one that is enabled", "module_disabled"
    needs_knobs = frozenset({"module_enabled"})


class MoEFullBlock(MoEHotExpert):
    name, doc, feature = "moe_full_block", "one slot's pairs of one expert exactly fill whole blocks (32 pairs, block size 16 or 32)", "moe_full_block"
    needs_knobs = frozenset({"routing", "blocks"})

    def num_slots(self, draw, limits: Limits) -> int:
        return draw(st.integers(1, limits.max_slots))

    def sequence_lengths(self, draw, limits: Limits) -> tuple[int, ...]:
        return (8, 8, 8, 8)

    def sequence_slots(self, draw, num_seqs: int, num_slots: int) -> tuple[int, ...]:
        return (draw(st.integers(0, num_slots - 1)),) * num_seqs

    def top_k(self, draw, experts: int) -> int:
        return 1  # the hot expert then holds exactly the 32 pairs

    def block_size(self, draw) -> int:
        return draw(st.sampled_from((16, 32)))


class MoESharedExperts(MoEFamily):
    name, doc, feature = "moe_shared", "shared-expert LoRA: one w13 LoRA-A / w2 LoRA-B for every expert", "moe_shared"
    about_values = True

    def shared_experts(self, draw) -> bool:
        return True


class MoEFusedSlice(MoEFamily):
    name, doc, feature = "moe_fused_slice", "gate and up as one fused 2·I slice (FusedMoE3DWithLoRA)", "moe_fused_slice"
    needs_knobs = frozenset({"routing", "gate_up"})

    def gate_up_slices(self, draw) -> int:
        return 1

    def applies_to(self, spec: OpSpec, dtype: str) -> bool:
        return super().applies_to(spec, dtype) and spec.routed_weight is not True  # gate/up is w13's input side


class MoERoutedWeight(MoEFamily):
    name, doc, feature = "moe_routed_weight", "mul_routed_weight: one input row per pair, the delta weighted", "moe_routed_weight"
    needs_knobs = frozenset({"routing", "routed_weight"})

    def routed_weight(self, draw) -> bool:
        return True


class MoENaiveBlocks(MoEFamily):
    name, doc, feature = "moe_naive", "naive block assignment: topk_ids as the experts, no sorted ids", "moe_naive"
    needs_knobs = frozenset({"routing", "naive"})

    def naive_blocks(self, draw) -> bool:
        return True


# -- added after the families above, last in FAMILIES: their combinations have seeds of their own, and no
# earlier family's draws moved (docs/cases.md) ----------------------------------------------------------


class Rank512(Family):
    """A stack rank above 256: 320 (no power of two: a kernel that pads or tiles the rank to a power of two,
    or sizes a buffer for 256, reads or writes past it) or 512, the largest ``max_lora_rank`` vLLM accepts.
    The shrink buffer ``[S, T, R]`` is then 320 or 512 float32 columns wide."""

    name, doc, feature = "rank_512", "a stack rank above 256: 320 or 512 (vLLM's largest max_lora_rank)", "rank_512"
    about_values = True

    def num_slots(self, draw, limits: Limits) -> int:
        # at most 4 slots (and 4 experts): the mask math's columns grow with L·R (L·E·R for the MoE ops)
        return draw(st.integers(1, min(limits.max_slots, 4)))

    def max_rank(self, draw, limits: Limits) -> int:
        return draw(st.sampled_from(RANKS_ABOVE_256))

    def affordable(self, limits, max_rank, ranks):
        return _small_products(limits), max_rank, ranks

    def steer_ranks(self, draw, ranks, served, max_rank):
        # a kernel that drops every rank above 256 passes unless a served slot has one
        return _serve_rank(draw, ranks, served, lambda rank: rank > 256, max_rank)

    def num_experts(self, draw, limits: Limits) -> int:
        return draw(st.integers(2, max(2, min(limits.max_experts, 4))))


class LongBatch(Family):
    """More than 2,048 tokens in one call, up to vLLM's default ``max_num_batched_tokens`` (8,192): a kernel
    whose grid, tile loop or buffer is sized for 2,048 rows passes every shorter batch. The other sizes stay
    small (≤ 4 slots, rank ≤ 16, 8–32 features, slices of 1–32 columns), so a case costs little more than its rows, and
    the last sequence, which holds the rows beyond 2,048, always has an adapter. The MoE ops route every token to
    two experts (more than 4,096 pairs), a short drawn pattern of choices repeated. The ops whose rows are the
    sampled rows (logits, classification heads) get ``long_sampled`` instead."""

    name, doc, feature = "long_batch", "more than 2,048 tokens (up to 8,192; two choices each for the MoE ops)", "long_batch"

    def applies_to(self, spec: OpSpec, dtype: str) -> bool:
        return super().applies_to(spec, dtype) and spec.rows != "sampled"

    def num_slots(self, draw, limits: Limits) -> int:
        return draw(st.integers(1, min(limits.max_slots, 4)))

    def sequence_lengths(self, draw, limits: Limits) -> tuple[int, ...]:
        low, high = limits.long_batch
        count = draw(st.integers(1, 4))
        return tuple(draw(st.lists(st.integers(-(-low // count), high // count), min_size=count, max_size=count)))

    def steer_slots(self, draw, slots: list[int], num_slots: int) -> list[int]:
        if slots[-1] == -1:  # the rows beyond 2,048 lie in the last sequence: they must read an adapter
            slots[-1] = draw(st.integers(0, num_slots - 1))
        return slots

    def affordable(self, limits, max_rank, ranks):
        return _long_rows(limits), min(max_rank, 16), tuple(min(r, 16) for r in ranks)

    def num_experts(self, draw, limits: Limits) -> int:
        return draw(st.integers(2, max(2, min(limits.max_experts, 4))))

    def top_k(self, draw, experts: int) -> int:
        return 2  # more than 4,096 pairs from 2,049 tokens: a kernel bucketing pairs by 4,096 leaves some unserved

    def token_choices(self, draw, choice, num_tokens: int) -> list[list[int]]:
        # A short drawn pattern, repeated: one Hypothesis draw per token would overrun its choice buffer (about
        # 4,000 choices) long before 8,192 tokens.
        pattern = draw(st.lists(choice, min_size=1, max_size=16))
        return [list(pattern[token % len(pattern)]) for token in range(num_tokens)]


class LongSampled(LongBatch):
    """The same for the ops whose rows are the sampled rows: more than 2,048 of them in one call, as the
    logits of prompt logprobs (every prompt token a row) or a large pooling batch give. One token per
    sequence, their slots a short drawn pattern repeated (one draw per row would overrun Hypothesis' buffer),
    the last row with an adapter."""

    name, doc = "long_sampled", "more than 2,048 sampled rows (logits of prompt logprobs, classification heads)"

    def applies_to(self, spec: OpSpec, dtype: str) -> bool:
        return Family.applies_to(self, spec, dtype) and spec.rows == "sampled"

    def sequence_lengths(self, draw, limits: Limits) -> tuple[int, ...]:
        low, high = limits.long_batch
        return (1,) * draw(st.integers(low, high))

    def _slots(self, draw, num_seqs: int, num_slots: int) -> list[int]:
        pattern = draw(st.lists(st.integers(-1, num_slots - 1), min_size=1, max_size=8))
        return [pattern[i % len(pattern)] for i in range(num_seqs)]


# -- vLLM 0.33's token classification head (token_classification_head): aimed at that op alone ----------

# Label counts of real token-classification heads (NER's 9 BIO tags, POS's 17 universal tags, binary and
# three-way taggers): none a multiple of 16, so a kernel that tiles or buckets the "rank" by 16 drops labels.
SMALL_LABEL_COUNTS = (2, 3, 9, 17)
# vLLM pads every head to max_lora_cls_labels, which has no upper bound: above 256 and 512 no LoRA-rank
# bucket holds it (300 and 1000: neither a power of two nor a multiple of 16).
WIDE_LABEL_COUNTS = (300, 1000)


class TokenClassification(Family):
    """One call as vLLM 0.33's token head makes it: tokens of an adapter with a saved head, of an adapter
    without one (``full_module_enabled`` False: the base output stays) and of no adapter (slot −1: the base
    output stays) in one batch, the label count ``P`` no multiple of 16."""

    name, doc, feature, min_seqs = (
        "token_classification",
        "a token-classification head call: tokens with a saved head, without one and without adapter; P no multiple of 16",
        "token_classification",
        3,
    )
    needs_knobs = frozenset({"module_enabled"})
    named_only = True

    def num_slots(self, draw, limits: Limits) -> int:
        return draw(st.integers(2, max(2, limits.max_slots)))

    def steer_slots(self, draw, slots: list[int], num_slots: int) -> list[int]:
        # three sequences: no adapter, and two different slots (one of them will have no head)
        first, second, third = draw(st.permutations(range(len(slots))))[:3]
        slots[first] = -1
        slots[second], slots[third] = draw(st.permutations(range(num_slots)))[:2]
        return slots

    def disabled_slots(self, draw, token_slots, num_slots: int) -> tuple[int, ...]:
        # a non-empty proper subset of the slots in use: some tokens keep the base output, others are replaced
        used = sorted({s for s in token_slots if s != -1})
        return tuple(sorted(draw(st.sets(st.sampled_from(used), min_size=1, max_size=len(used) - 1))))

    def first_width(self, draw, limits: Limits) -> int:
        any_width = st.integers(1, limits.max_width).map(lambda p: p if p % 16 else p - 1)
        return draw(st.one_of(st.sampled_from(SMALL_LABEL_COUNTS), any_width))


class WideClassificationHead(TokenClassification):
    """The same call with a head of more than 256 labels: a shrink kernel that takes the head's width for a
    LoRA rank (≤ 512, bucketed) cannot hold it."""

    name, doc, feature = "cls_labels_wide", "a classification head of more than 256 labels (257–1,024)", "cls_labels_wide"

    def first_width(self, draw, limits: Limits) -> int:
        return draw(st.one_of(st.sampled_from(WIDE_LABEL_COUNTS), st.integers(257, 1024)))


# -- the fp8 ops (lora_shrink_fp8, lora_expand_fp8): aimed at them alone, one family per scale granularity --

# Block sizes of block-wise fp8 scales: vLLM's default is 128 × 128 (DeepSeek-V3's); the smaller ones let the
# drawn sizes hold several blocks. Each is drawn below the dimension it splits: two blocks at least, above 16.
FP8_GROUP_SIZES = (16, 32, 64, 128)


class Fp8Scales(Family):
    """fp8 operands with one scale granularity (``Case.fp8_scales``), slot −1 rows among the adapter rows (the
    kernels skip them); the optional features drawn freely. Slices are equally wide: vLLM's expand reads
    every slice's weight scales with the first slice's strides. A shrink's case dtype is read by nothing
    (fp8 in, float32 out), so its cases are drawn in bfloat16 only."""

    needs_knobs = frozenset({"fp8_scales"})
    named_only, min_seqs = True, 2
    scales: ClassVar[str]
    wide = add_inputs = scaled = _draws_on
    # fused_moe_lora_fp8: w13 or w2 (the routing weight), aligned or naive metadata; the dense fp8 ops read neither knob
    routed_weight = naive_blocks = _draws_on

    def applies_to(self, spec: OpSpec, dtype: str) -> bool:
        return super().applies_to(spec, dtype) and (spec.output_kind != "buffer" or dtype == "bfloat16")

    def steer_slots(self, draw, slots: list[int], num_slots: int) -> list[int]:
        return Neg1.steer_slots(self, draw, slots, num_slots)

    def with_offset(self, draw, spec: OpSpec) -> bool:
        return "offset" in spec.knobs and draw(st.booleans())

    def equal_widths(self) -> bool:
        return True

    def first_width(self, draw, limits: Limits) -> int:
        # 8 columns at least: a served slot's LoRA-B then has a code below 448 for each special code
        # (fp8_values.place_special_codes) even at rank 2 with a scale per channel (two codes a group, one of them 448)
        return draw(st.integers(8, max(8, limits.max_width)))


class Fp8Tensor(Fp8Scales):
    name, doc, feature, scales = "fp8_tensor", "fp8 operands, one activation scale and one weight scale per slot", "fp8_tensor", "tensor"


class Fp8Channel(Fp8Scales):
    name, doc, feature, scales = "fp8_channel", "fp8 operands, a scale per token and per output channel", "fp8_channel", "channel"

    def top_k(self, draw, experts: int) -> int:
        # fused_moe_lora_fp8: two choices at least. With the routing weight (w2) the input and its per-row scales are
        # per pair, and only with several pairs per token does a scale read per token (row p // top_k) differ
        return draw(st.integers(2, min(experts, 4)))

    def routed_weight(self, draw) -> bool:
        # w2 (a row and a scale per pair) three times in four, so the few cases of a profile hold one; w13 (a row and
        # a scale per token, read for each of its pairs) the fourth
        return draw(st.integers(0, 3)) > 0


class Fp8Block(Fp8Scales):
    name, doc, feature, scales = "fp8_block", "fp8 operands, a scale per group_k × group_n block", "fp8_block", "block"

    # The sizes the groups split, each with two groups at least: the hidden size (the shrink's K) and the slice width
    # (the expand's N) always leave a partial last group (_partial_size), the rank (the shrink's N, the expand's K)
    # three times in four; else it is a power of two from 32, as vLLM's ranks are, split into whole groups.

    def max_rank(self, draw, limits: Limits) -> int:
        if draw(st.integers(0, 3)) < 3:
            return _partial_size(draw, limits.max_rank)
        return draw(st.sampled_from([r for r in POWER_OF_TWO_RANKS if 32 <= r <= max(32, limits.max_rank)]))

    def steer_ranks(self, draw, ranks: list[int], served: list[int], max_rank: int) -> list[int]:
        # a served slot of the stack's full rank: the last rank group (the expand's last K-group, the shrink's last
        # N-group) is read with weights only by a slot whose rank reaches into it
        if served and all(ranks[slot] != max_rank for slot in served):
            ranks[draw(st.sampled_from(served))] = max_rank
        return ranks

    def first_width(self, draw, limits: Limits) -> int:
        return _partial_size(draw, limits.max_width)

    def hidden_size(self, draw, default_max: int) -> int:
        return _partial_size(draw, default_max)

    def fp8_groups(self, draw, k: int, n: int) -> tuple[int, int]:
        def below(size: int) -> int:
            return draw(st.sampled_from([g for g in FP8_GROUP_SIZES if g < size] or [FP8_GROUP_SIZES[0]]))

        return below(k), below(n)


# -- vLLM 0.34 (docs/vllm-lora-ops.md §10): fused_moe_lora's dispatch, its new layers, packed adapters, spec decode --

# FUSED_MOE_LORA_TWO_KERNEL_MAX_TOKENS (vllm/lora/ops/triton_ops/utils.py) and _FUSED_MOE_LORA_ONE_SHOT_MAX_RANK
# (fused_moe_lora_op.py): the one-shot kernel serves more than 64 tokens at a rank ≤ 128
ONE_SHOT_MAX_TOKENS, ONE_SHOT_MAX_RANK = 64, 128


class MoEOneShotFamily(MoEFamily):
    """vLLM 0.34's ``_fused_moe_lora`` runs one fused kernel for more than 64 tokens at a rank ≤ 128 and the
    shrink and expand kernels otherwise: a port that copies the dispatch with an off-by-one, or whose one path
    is wrong, shows on one side of an edge only. Aimed at the ops that run that kernel (not the fp8 one, not
    the alignment, judged by invariants). Small sizes otherwise: ≤ 2 slots, ≤ 4 experts, 8–32 features."""

    about_values = True

    def applies_to(self, spec: OpSpec, dtype: str) -> bool:
        return super().applies_to(spec, dtype) and "add_inputs" in spec.knobs and "fp8_scales" not in spec.knobs

    def num_slots(self, draw, limits: Limits) -> int:
        return draw(st.integers(1, 2))

    def num_experts(self, draw, limits: Limits) -> int:
        return draw(st.integers(2, 4))

    def affordable(self, limits, max_rank, ranks):
        return replace(limits, max_hidden=32, max_width=32), max_rank, ranks


class MoEOneShotTokens(MoEOneShotFamily):
    name, doc, feature = "moe_oneshot_tokens", "fused_moe_lora at 64 or 65 tokens, rank ≤ 128 (its one-shot kernel's edge)", "moe_oneshot_boundary"

    def sequence_lengths(self, draw, limits: Limits) -> tuple[int, ...]:
        total = ONE_SHOT_MAX_TOKENS + draw(st.integers(0, 1))
        cuts = sorted(draw(st.sets(st.integers(1, total - 1), max_size=3)))
        return tuple(b - a for a, b in zip([0, *cuts], [*cuts, total]))

    def max_rank(self, draw, limits: Limits) -> int:
        return draw(st.sampled_from([r for r in POWER_OF_TWO_RANKS if r <= min(limits.max_rank, 16)]))


class MoEOneShotRank(MoEOneShotFamily):
    name, doc, feature = "moe_oneshot_rank", "fused_moe_lora at rank 128 or 129 above 64 tokens (its one-shot kernel's edge)", "moe_oneshot_boundary"

    def sequence_lengths(self, draw, limits: Limits) -> tuple[int, ...]:
        total = draw(st.integers(ONE_SHOT_MAX_TOKENS + 1, ONE_SHOT_MAX_TOKENS + 8))
        cut = draw(st.integers(1, total - 1))
        return (cut, total - cut)

    def max_rank(self, draw, limits: Limits) -> int:
        return ONE_SHOT_MAX_RANK + draw(st.integers(0, 1))

    def steer_ranks(self, draw, ranks, served, max_rank):
        return _serve_rank(draw, ranks, served, lambda rank: rank == max_rank, max_rank)


class MixedSlotsFamily(Family):
    """Rows without adapter among adapter rows (as ``neg1``), the optional features drawn freely: the families of
    vLLM 0.34's layer ops, which aim at those ops alone (``OpSpec.families``)."""

    named_only, min_seqs = True, 2
    scaled = add_inputs = weights_4d = _draws_on

    def steer_slots(self, draw, slots: list[int], num_slots: int) -> list[int]:
        return Neg1.steer_slots(self, draw, slots, num_slots)


class GroupedLoRAA(MixedSlotsFamily):
    name, doc, feature = "grouped_lora_a", "2–8 head groups sharing LoRA-A, each its own LoRA-B (DeepSeek-V4's wo_a)", "grouped_lora_a"

    def slice_count(self, draw, spec: OpSpec) -> int:
        return draw(st.integers(2, spec.max_slices))

    def equal_widths(self) -> bool:
        return True  # every group is o_lora_rank wide


class Fp32Output(MixedSlotsFamily):
    name, doc, feature = "fp32_output", "a float32 base output, the delta in the LoRA dtype added (DeepSeek-V4's compressor)", "fp32_output"
    dtypes = frozenset({"float16", "bfloat16"})  # a float32 LoRA rounds nothing on its way into a float32 output

    def slice_count(self, draw, spec: OpSpec) -> int:
        return spec.max_slices  # wkv and wgate


# √hidden, Gemma's embed_scale, for hidden sizes of Gemma models (2B, Gemma 2 2B, Gemma 3 4B, 7B, Gemma 2 9B): 48 is exact
EMBED_SCALES = tuple(hidden**0.5 for hidden in (2048, 2304, 2560, 3072, 3584))


class EmbedScale(MixedSlotsFamily):
    name, doc, feature = "embed_scale", "an embed_scale (√hidden, Gemma's) folded into the embedding's LoRA-B", "embed_scale"

    def embed_scale(self, draw) -> float:
        return draw(st.sampled_from(EMBED_SCALES))


class PartialPacked(Family):
    """vLLM 0.34's ``expand_packed_lora`` accepts an adapter without some of a packed layer's sub-modules (a None
    group anywhere, not only the last): those slices stay zero for its slot, the others hold its weights. A port
    that shifts the present groups into the wrong slices, or reads a stale adapter's weights for the absent one,
    shows only where a served slot lacks a slice."""

    name, doc, feature = "partial_packed", "an adapter lacking some of a packed layer's sub-modules (2–4 slices)", "partial_packed"
    needs_knobs = frozenset({"packed"})
    min_seqs = 2

    def slice_count(self, draw, spec: OpSpec) -> int:
        return draw(st.integers(2, min(4, spec.max_slices)))

    def packed_slices(self, draw, slices, seq_slots):
        served = sorted({slot for slot in seq_slots if slot != -1})
        lacking = draw(st.sets(st.sampled_from(served), min_size=1))
        absent = []
        for slot in sorted(lacking):  # a non-empty proper subset of the slices for each: an adapter lacking all has no weights
            gone = draw(st.sets(st.integers(0, len(slices) - 1), min_size=1, max_size=len(slices) - 1))
            absent += [(slot, s) for s in sorted(gone)]
        return slices, tuple(absent), ()


class PackedOverride(Family):
    """A per-layer ``lora_packed_modules`` (vLLM 0.34): Gemma 4's full-attention ``k_eq_v`` layers pack
    ``[q_proj, k_proj, k_proj]``, so the v slice holds k_proj's LoRA. The v slice is as wide as the k slice."""

    name, doc, feature = "packed_override", "packed slices [q, k, k]: the v slice holds k's LoRA (Gemma 4)", "packed_override"
    needs_knobs = frozenset({"packed"})

    def slice_count(self, draw, spec: OpSpec) -> int:
        return 3

    def packed_slices(self, draw, slices, seq_slots):
        return (slices[0], slices[1], slices[1]), (), (0, 1, 1)


class SpecDecodeLogits(Family):
    """Speculative decoding: vLLM 0.34's model runner maps one ``lm_head`` adapter per logits row, 1 + the draft
    tokens of each request (``LoraState.make_lora_inputs``: ``lora_ids.repeat(num_logits)``); a port indexing the
    logits by request, or one row per request, reads the wrong adapter on the rows after a request's first."""

    name, doc, feature = "spec_decode_logits", "1 + 1–4 draft tokens logits rows per request, rows without adapter among them", "spec_decode_logits"
    needs_knobs = frozenset({"spec_decode"})
    min_seqs = 2

    def steer_slots(self, draw, slots: list[int], num_slots: int) -> list[int]:
        return Neg1.steer_slots(self, draw, slots, num_slots)

    def logits_per_seq(self, draw, seq_slots):
        rows = draw(st.lists(st.integers(1, 5), min_size=len(seq_slots), max_size=len(seq_slots)))
        served = [i for i, slot in enumerate(seq_slots) if slot != -1]
        if all(rows[i] == 1 for i in served):  # a served request with drafts: else every row is a request's first
            rows[draw(st.sampled_from(served))] = draw(st.integers(2, 5))
        return tuple(rows)


def _partial_size(draw, high: int) -> int:
    """A size in 17 … ``high`` (two groups of 16 at least) that is no multiple of 16, so that every block-scale group
    size (``FP8_GROUP_SIZES``, 16–128) leaves a partial last group: where a kernel's scale lookup clamps or drops."""
    return draw(st.integers(17, max(17, high)).map(lambda size: size if size % 16 else size - 1))


def _serve_rank(draw, ranks: list[int], served: list[int], wanted, rank: int) -> list[int]:
    """``ranks`` with ``rank`` given to a drawn served slot unless a served slot's rank already is ``wanted``."""
    if served and not any(wanted(ranks[slot]) for slot in served):
        ranks[draw(st.sampled_from(served))] = rank
    return ranks


def _small_products(limits: Limits) -> Limits:
    """Limits that keep the products of a thousand tokens, or of rank 256, affordable."""
    return Limits(limits.max_slots, limits.max_seqs, limits.max_seq_len, 64, 64, 16, limits.large_t, 1, min(limits.max_experts, 8),
                  limits.long_batch)


def _long_rows(limits: Limits) -> Limits:
    """Limits that keep a batch of up to 8,192 rows cheap: what it costs grows with rows × columns."""
    return replace(_small_products(limits), max_hidden=32, max_width=32)


FAMILIES: dict[str, Family] = {
    family.name: family
    for family in (
        Random(), Neg1(), Neg1OneSlot(), AllNeg1(), LastSlot(), NonContiguous(), UnequalSequences(), OneToken(),
        LargeT(), RankPadded(), RankOdd(), RankMax(), RealHidden(), OddHidden(), Slices(), ManySlices(), Offset(), WideOutput(),
        NoAddInputs(), Scaled(), Fp32Input(), Bias(), FourDStacks(), Decode(), Positive(), SegPermuted(), SegGaps(),
        MoEWideTopK(), MoEManyExperts(), MoEHotExpert(), MoEDuplicateRouting(), MoEZeroWeight(), MoENonLocal(),
        MoEDisabledSlot(), MoEFullBlock(), MoESharedExperts(), MoEFusedSlice(), MoERoutedWeight(), MoENaiveBlocks(),
        ModuleDisabled(), Rank512(), LongBatch(), LongSampled(), TokenClassification(), WideClassificationHead(),
        Fp8Tensor(), Fp8Channel(), Fp8Block(), MoEOneShotTokens(), MoEOneShotRank(), GroupedLoRAA(), Fp32Output(), EmbedScale(),
        PartialPacked(), PackedOverride(), SpecDecodeLogits(),
    )
}  # fmt: skip


def families_for(spec: OpSpec, dtype: str) -> tuple[Family, ...]:
    return tuple(f for f in FAMILIES.values() if f.applies_to(spec, dtype))
