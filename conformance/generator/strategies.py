"""Hypothesis strategies that draw the structure of a case for one op, dtype and family.

Hypothesis draws the structure (so a failure shrinks towards fewer sequences, fewer slots, smaller
ranks and sizes); the values come from ``case.seed`` (``conformance.cases.values``). Knobs an op does
not read stay at their defaults, so features and ids only mention what matters for the op.
"""

from __future__ import annotations

from hypothesis import strategies as st

from conformance.cases.case import ODD_HIDDEN_SIZES, REAL_HIDDEN_SIZES, Case
from conformance.ops import OpSpec

from .limits import Limits

POWER_OF_TWO_RANKS = (1, 2, 4, 8, 16, 32, 64, 128, 256)
ODD_RANKS = (1, 3, 5, 7, 12, 20, 33, 49, 100, 200, 250)
SCALES = (0.5, 2.0, 0.125, 3.75)


def _sequence_lengths(draw, family: str, limits: Limits, small: bool) -> tuple[int, ...]:
    max_len = 2 if small else limits.max_seq_len
    if family == "t1":
        return (1,)
    if family == "decode":
        return (1,) * draw(st.integers(1, limits.max_seqs * 2))
    if family == "large_t":
        low, high = limits.large_t
        count = draw(st.integers(1, 4))
        # Round the per-sequence floor up: 3 × (1024 // 3) = 1023 tokens would miss ``large_t``.
        lens = draw(st.lists(st.integers(-(-low // count), high // count), min_size=count, max_size=count))
        return tuple(lens)
    min_seqs = {"neg1": 2, "neg1_one_slot": 2, "noncontig": 3, "unequal_seqs": 2}.get(family, 1)
    lens = draw(st.lists(st.integers(1, max_len), min_size=min_seqs, max_size=max(min_seqs, limits.max_seqs)))
    if family == "unequal_seqs":
        longer = draw(st.integers(2, max(2, limits.max_seq_len)))
        where = draw(st.integers(0, len(lens) - 1))
        lens[where] = longer
        lens[(where + 1) % len(lens)] = 1
    return tuple(lens)


def _sequence_slots(draw, family: str, num_seqs: int, num_slots: int) -> tuple[int, ...]:
    if family == "allneg1":
        return (-1,) * num_seqs
    slots = draw(st.lists(st.integers(-1, num_slots - 1), min_size=num_seqs, max_size=num_seqs))
    if family in ("neg1", "neg1_one_slot"):
        i = draw(st.integers(0, num_seqs - 1))
        j = (i + 1 + draw(st.integers(0, num_seqs - 2))) % num_seqs
        slots[i] = -1
        if slots[j] == -1:
            slots[j] = draw(st.integers(0, num_slots - 1))
    elif family == "rank_padded" and all(s == -1 for s in slots):
        # A padded rank only matters on a row that reads it: make one sequence use an adapter.
        slots[draw(st.integers(0, num_seqs - 1))] = draw(st.integers(0, num_slots - 1))
    elif family == "last_slot":
        slots[draw(st.integers(0, num_seqs - 1))] = num_slots - 1
    elif family == "noncontig":
        start = draw(st.integers(0, num_seqs - 3))
        slot = draw(st.integers(0, num_slots - 1))
        other = draw(st.integers(-1, num_slots - 1).filter(lambda s: s != slot))
        slots[start : start + 3] = [slot, other, slot]
    return tuple(slots)


def _ranks(draw, family: str, num_slots: int, limits: Limits) -> tuple[int, tuple[int, ...]]:
    if family == "rank_max":
        max_rank = 256
    elif family == "rank_odd":
        max_rank = draw(st.sampled_from([r for r in ODD_RANKS if r <= max(limits.max_rank, 33)]))
    else:
        max_rank = draw(st.sampled_from([r for r in POWER_OF_TWO_RANKS if r <= limits.max_rank]))
    if family == "rank_padded" and max_rank == 1:
        max_rank = 2
    full = st.just(max_rank)
    below = st.integers(1, max(1, max_rank - 1))
    any_rank = st.one_of(full, st.integers(1, max_rank))
    ranks = draw(st.lists(below if family == "rank_padded" else any_rank, min_size=num_slots, max_size=num_slots))
    if family == "rank_odd":
        ranks[draw(st.integers(0, num_slots - 1))] = max_rank if max_rank % 16 else 1
    return max_rank, tuple(ranks)


def _feature_size(draw, family: str, default_max: int) -> int:
    if family == "real_hidden":
        return draw(st.sampled_from(REAL_HIDDEN_SIZES))
    if family == "odd_hidden":
        return draw(st.sampled_from(ODD_HIDDEN_SIZES))
    return draw(st.integers(8, default_max))


def _slices(draw, spec: OpSpec, family: str, limits: Limits, big_width: bool) -> tuple[int, ...]:
    if "slices" not in spec.knobs or big_width:
        # A sized family's width must be the whole output width, or the size is lost in the sum.
        count = 1
    elif family == "slices":
        count = draw(st.integers(2, spec.max_slices))
    else:
        count = draw(st.integers(1, spec.max_slices))
    if spec.knobs & {"add_inputs", "expand_input"} or spec.name in ("add_lora_linear", "add_lora_logits"):
        first = _feature_size(draw, family, limits.max_width) if big_width else draw(st.integers(1, limits.max_width))
        widths = [first] + draw(st.lists(st.integers(1, limits.max_width), min_size=count - 1, max_size=count - 1))
        if family == "slices" and len(set(widths)) == 1:
            widths[-1] = widths[-1] + 1
        return tuple(widths)
    return (1,) * count  # shrink-side ops write [S, T, R]: slice widths are not read


@st.composite
def cases(draw, spec: OpSpec, dtype: str, family: str, limits: Limits) -> Case:
    """One case of ``spec.name`` in ``dtype`` aimed at ``family``."""
    sized = family in ("real_hidden", "odd_hidden")
    num_slots = 1 if family == "neg1_one_slot" else draw(st.integers(2 if family == "last_slot" else 1, limits.max_slots))
    seq_lens = _sequence_lengths(draw, family, limits, small=sized)
    if sized:
        seq_lens = seq_lens[: limits.max_real_tokens]
    seq_slots = _sequence_slots(draw, family, len(seq_lens), num_slots)
    max_rank, adapter_ranks = _ranks(draw, family, num_slots, limits)
    if family in ("large_t", "rank_max"):  # keep the products affordable
        limits = Limits(limits.max_slots, limits.max_seqs, limits.max_seq_len, 64, 64, 16, limits.large_t, 1)
        if family == "large_t":
            max_rank, adapter_ranks = min(max_rank, 16), tuple(min(r, 16) for r in adapter_ranks)
    hidden_is_sized = sized and "hidden" in spec.knobs
    hidden = _feature_size(draw, family if hidden_is_sized else "random", limits.max_hidden) if "hidden" in spec.knobs else 16
    slices = _slices(draw, spec, family, limits, big_width=sized and not hidden_is_sized)

    # A bias must follow offset_start and must not be scaled, so the bias family also draws both.
    with_offset = family == "offset" or (family == "bias" and "offset" in spec.knobs and draw(st.booleans()))
    offset = draw(st.integers(1, 64)) if with_offset else 0
    extra = 0
    if "wide" in spec.knobs:
        wide = family in ("offset", "wide_output") or (family == "random" and draw(st.booleans()))
        extra = draw(st.integers(1, 48)) if wide else 0
    add_inputs = True
    if "add_inputs" in spec.knobs:
        add_inputs = family != "no_add_inputs" and (family != "random" or draw(st.booleans()))
    scale = 1.0
    if "scale" in spec.knobs and (family == "scaled" or (family in ("random", "bias") and draw(st.booleans()))):
        scale = draw(st.sampled_from(SCALES))
    expand_input_dtype = None
    if "expand_input" in spec.knobs and (family == "fp32_input" or (family == "random" and draw(st.booleans()))):
        expand_input_dtype = "float32"
    bias = "bias" in spec.knobs and (family == "bias" or (family == "random" and draw(st.booleans())))
    weights_4d = family == "w4d" or (family == "random" and draw(st.booleans()))
    is_prefill = not ("prefill" in spec.knobs and family == "decode")
    distribution = "positive" if family == "positive" else "normal"
    if family == "random":
        distribution = draw(st.sampled_from(("normal", "positive")))
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
        family=family,
    )
