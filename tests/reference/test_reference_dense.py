"""Every reference op against an independent dense formula, on small shapes drawn by Hypothesis.

The reference groups rows by adapter and loops; the formula here never loops over slots. It builds a
one-hot selection matrix ``M[t, l]`` (1 where row ``t`` uses slot ``l``, an all-zero row for slot −1)
and contracts it with the whole stack:

    shrink:  out0 + scale · einsum('tl,lrh,th->tr', M, A, x)
    expand:  einsum('tl,lnr,tr->tn', M, B, x), written into the slice columns of the rows with a slot
             (added to out0 there when add_inputs), every other cell kept from out0.

In float64 the reference rounds nowhere, so both must agree to float64 summation-order noise, and the
cells no op may touch must be bit-identical to the initial output. Shapes are drawn directly with
Hypothesis (not through ``conformance.generator``) so this test does not share the generator's blind
spots.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from conformance.reference import (
    LoRAKernelMeta,
    LoRAMapping,
    PunicaWrapperReference,
    bgmv_expand,
    bgmv_expand_slice,
    bgmv_shrink,
    lora_expand,
    lora_shrink,
    sgmv_expand,
    sgmv_expand_slice,
    sgmv_shrink,
)

F64 = torch.float64
EXAMPLES = settings(max_examples=40, deadline=None, derandomize=True, database=None)

# -- the independent formula ---------------------------------------------------------------------


def selection(slots: torch.Tensor, num_slots: int) -> torch.Tensor:
    """``M[t, l] = 1`` if row ``t`` uses slot ``l``; rows of slot −1 are all zero."""
    return (slots.reshape(-1, 1) == torch.arange(num_slots).reshape(1, -1)).to(F64)


def three_d(stack: torch.Tensor) -> torch.Tensor:
    return stack.reshape(stack.size(0), *stack.shape[-2:])


def dense_shrink(x, lora_a, slots, scale, out0) -> torch.Tensor:
    a = three_d(lora_a)
    rank = a.size(1)
    expected = out0.clone()
    expected[:, :rank] += scale * torch.einsum("tl,lrh,th->tr", selection(slots, a.size(0)), a, x)
    return expected


def dense_expand_delta(x, lora_b, slots) -> torch.Tensor:
    b = three_d(lora_b)
    return torch.einsum("tl,lnr,tr->tn", selection(slots, b.size(0)), b, x)


def write_slice(expected, delta, slots, first_column, add_inputs) -> None:
    """Write ``delta`` into columns ``[first_column, + N)`` of the rows with a slot, in place."""
    columns = slice(first_column, first_column + delta.size(1))
    has_slot = (slots != -1).reshape(-1, 1)
    base = expected[:, columns] if add_inputs else torch.zeros_like(delta)
    expected[:, columns] = torch.where(has_slot, base + delta, expected[:, columns])


def dense_expand(x_slices, b_stacks, slots, out0, offset, add_inputs) -> torch.Tensor:
    expected = out0.clone()
    column = offset
    for x, b in zip(x_slices, b_stacks, strict=True):
        write_slice(expected, dense_expand_delta(x, b, slots), slots, column, add_inputs)
        column += three_d(b).size(1)
    return expected


def assert_matches(actual, expected, out0, untouched) -> None:
    """Close to the formula everywhere, and bit-identical to the initial output where nothing may write."""
    torch.testing.assert_close(actual, expected, rtol=1e-12, atol=1e-12)
    assert torch.equal(actual[untouched], out0[untouched]), "a cell that no op may write was changed"


def untouched_rows(slots: torch.Tensor, like: torch.Tensor) -> torch.Tensor:
    """Boolean mask shaped like ``like`` ([T, …]), true on every row of slot −1."""
    mask = (slots == -1).reshape(-1, *([1] * (like.dim() - 1)))
    return mask.expand_as(like)


def untouched_cells(slots, width, first, last) -> torch.Tensor:
    """``[T, W]`` mask: rows of slot −1, plus every row's columns outside ``[first, last)``."""
    columns = torch.ones(width, dtype=torch.bool)
    columns[first:last] = False
    return (slots == -1).reshape(-1, 1) | columns.reshape(1, -1)


# -- drawing problems ----------------------------------------------------------------------------


def randn(gen: torch.Generator, *shape: int) -> torch.Tensor:
    return torch.randn(*shape, generator=gen, dtype=F64)


def maybe_4d(stack: torch.Tensor, four_d: bool) -> torch.Tensor:
    return stack.unsqueeze(1) if four_d else stack


SEEDS = st.integers(0, 2**32 - 1)  # values come from a torch.Generator seeded with one of these
SLICE_WIDTHS = st.lists(st.integers(1, 4), min_size=1, max_size=3)  # N_s of 1–3 slices, unequal allowed


@dataclass
class Sizes:
    """One problem's structure: L slots, rank R, T tokens and their slots (−1 included), values, layout."""

    num_slots: int
    rank: int
    tokens: int
    slots: torch.Tensor
    gen: torch.Generator
    four_d: bool


@st.composite
def sizes(draw, max_tokens: int = 7) -> Sizes:
    num_slots = draw(st.integers(1, 4))
    tokens = draw(st.integers(1, max_tokens))
    token_slots = draw(st.lists(st.integers(-1, num_slots - 1), min_size=tokens, max_size=tokens))
    return Sizes(
        num_slots=num_slots,
        rank=draw(st.integers(1, 4)),
        tokens=tokens,
        slots=torch.tensor(token_slots, dtype=torch.long),
        gen=torch.Generator().manual_seed(draw(SEEDS)),
        four_d=draw(st.booleans()),
    )


@st.composite
def segments(draw):
    """sgmv metadata with gaps: ``(segment args, one slot per row with −1 where no segment covers)``.

    Segments need not cover every row nor start at row 0; ``max_seq_length`` may exceed the longest.
    """
    num_slots = draw(st.integers(1, 4))
    starts, lengths, seg_slots = [], [], []
    row = draw(st.integers(0, 2))
    for _ in range(draw(st.integers(0, 3))):
        length = draw(st.integers(1, 3))
        starts.append(row)
        lengths.append(length)
        seg_slots.append(draw(st.integers(-1, num_slots - 1)))
        row += length + draw(st.integers(0, 2))  # a gap after the segment
    tokens = max(row, 1)
    per_row = torch.full((tokens,), -1, dtype=torch.long)
    for start, length, slot in zip(starts, lengths, seg_slots):
        per_row[start : start + length] = slot
    max_seq_length = max(lengths, default=0) + draw(st.integers(0, 2))
    args = (
        torch.tensor(starts, dtype=torch.long),
        torch.tensor(lengths, dtype=torch.long),
        torch.tensor(seg_slots, dtype=torch.long),
        len(starts),
        max_seq_length,
        tokens,
    )
    return num_slots, args, per_row


# -- classic kernel ops --------------------------------------------------------------------------


@EXAMPLES
@given(sizes(), st.integers(1, 5), st.sampled_from([1.0, 0.5, -2.0]))
def test_bgmv_shrink(s, hidden, scale):
    x, lora_a = randn(s.gen, s.tokens, hidden), randn(s.gen, s.num_slots, s.rank, hidden)
    out0 = randn(s.gen, s.tokens, s.rank)
    out = out0.clone()
    bgmv_shrink(x, maybe_4d(lora_a, s.four_d), out, s.slots, scale)
    assert_matches(out, dense_shrink(x, lora_a, s.slots, scale, out0), out0, untouched_rows(s.slots, out0))


@EXAMPLES
@given(sizes(), st.integers(1, 5), st.integers(0, 3), st.integers(0, 3), st.booleans(), st.booleans())
def test_bgmv_expand_and_expand_slice(s, width, offset, extra, add_inputs, use_slice_op):
    x, lora_b = randn(s.gen, s.tokens, s.rank), randn(s.gen, s.num_slots, width, s.rank)
    if not use_slice_op:
        offset = 0  # bgmv_expand always writes from column 0
    out0 = randn(s.gen, s.tokens, offset + width + extra)
    out = out0.clone()
    stack = maybe_4d(lora_b, s.four_d)
    if use_slice_op:
        bgmv_expand_slice(x, stack, out, s.slots, offset, width, add_inputs)
    else:
        bgmv_expand(x, stack, out, s.slots, add_inputs)
    expected = dense_expand([x], [lora_b], s.slots, out0, offset, add_inputs)
    assert_matches(out, expected, out0, untouched_cells(s.slots, out0.size(1), offset, offset + width))


@EXAMPLES
@given(segments(), st.integers(1, 4), st.integers(1, 5), SEEDS, st.booleans())
def test_sgmv_shrink(segment_problem, rank, hidden, seed, four_d):
    num_slots, args, per_row = segment_problem
    gen = torch.Generator().manual_seed(seed)
    x, lora_a = randn(gen, per_row.numel(), hidden), randn(gen, num_slots, rank, hidden)
    out0 = randn(gen, per_row.numel(), rank)
    out = out0.clone()
    sgmv_shrink(x, maybe_4d(lora_a, four_d), out, *args, 0.75)
    assert_matches(out, dense_shrink(x, lora_a, per_row, 0.75, out0), out0, untouched_rows(per_row, out0))


@EXAMPLES
@given(segments(), st.integers(1, 4), st.integers(1, 5), st.integers(0, 3), st.booleans(), st.booleans(), SEEDS)
def test_sgmv_expand_and_expand_slice(segment_problem, rank, width, offset, add_inputs, use_slice_op, seed):
    num_slots, args, per_row = segment_problem
    gen = torch.Generator().manual_seed(seed)
    x, lora_b = randn(gen, per_row.numel(), rank), randn(gen, num_slots, width, rank)
    if not use_slice_op:
        offset = 0
    out0 = randn(gen, per_row.numel(), offset + width + 1)
    out = out0.clone()
    if use_slice_op:
        sgmv_expand_slice(x, lora_b, out, *args, offset, width, add_inputs)
    else:
        sgmv_expand(x, lora_b, out, *args, add_inputs)
    expected = dense_expand([x], [lora_b], per_row, out0, offset, add_inputs)
    assert_matches(out, expected, out0, untouched_cells(per_row, out0.size(1), offset, offset + width))


# -- lora_shrink / lora_expand -------------------------------------------------------------------


@EXAMPLES
@given(sizes(), st.integers(1, 3), st.integers(1, 5), st.sampled_from([1.0, 0.25]))
def test_lora_shrink(s, num_slices, hidden, scale):
    x = randn(s.gen, s.tokens, hidden)
    stacks = [randn(s.gen, s.num_slots, s.rank, hidden) for _ in range(num_slices)]
    out0 = randn(s.gen, num_slices, s.tokens, s.rank)
    out = out0.clone()
    meta = LoRAKernelMeta.build(s.slots, s.num_slots)
    lora_shrink(x, [maybe_4d(a, s.four_d) for a in stacks], out, *meta.meta_args(), scale)
    expected = torch.stack([dense_shrink(x, a, s.slots, scale, out0[i]) for i, a in enumerate(stacks)])
    untouched = (s.slots == -1).reshape(1, -1, 1).expand_as(out0)
    assert_matches(out, expected, out0, untouched)


@EXAMPLES
@given(sizes(), SLICE_WIDTHS, st.integers(0, 3), st.integers(0, 2), st.booleans())
def test_lora_expand(s, widths, offset, extra, add_inputs):
    x = randn(s.gen, len(widths), s.tokens, s.rank)
    stacks = [randn(s.gen, s.num_slots, n, s.rank) for n in widths]
    out0 = randn(s.gen, s.tokens, offset + sum(widths) + extra)
    out = out0.clone()
    meta = LoRAKernelMeta.build(s.slots, s.num_slots)
    lora_expand(x, [maybe_4d(b, s.four_d) for b in stacks], out, *meta.meta_args(), offset, add_inputs)
    expected = dense_expand(list(x), stacks, s.slots, out0, offset, add_inputs)
    assert_matches(out, expected, out0, untouched_cells(s.slots, out0.size(1), offset, offset + sum(widths)))


# -- wrapper methods -----------------------------------------------------------------------------


def wrapper_for(token_slots: torch.Tensor, num_slots: int, sampled_slots: torch.Tensor | None = None):
    sampled = token_slots if sampled_slots is None else sampled_slots
    wrapper = PunicaWrapperReference()
    mapping = LoRAMapping(tuple(token_slots.tolist()), tuple(sampled.tolist()), (1,) * token_slots.numel(), True, num_slots)
    wrapper.update_metadata(mapping)
    return wrapper


def dense_bias(bias: torch.Tensor, slots: torch.Tensor) -> torch.Tensor:
    """``bias[slot]`` per row, zero on rows of slot −1: ``M @ bias``."""
    return selection(slots, bias.size(0)) @ bias.reshape(bias.size(0), -1)


@EXAMPLES
@given(sizes(), st.integers(1, 3), st.integers(1, 5), st.sampled_from([1.0, 3.0]))
def test_add_shrink(s, num_slices, hidden, scale):
    x = randn(s.gen, s.tokens, hidden)
    stacks = tuple(randn(s.gen, s.num_slots, s.rank, hidden) for _ in range(num_slices))
    out0 = randn(s.gen, num_slices, s.tokens, s.rank)
    y = out0.clone()
    wrapper_for(s.slots, s.num_slots).add_shrink(y, x, tuple(maybe_4d(a, s.four_d) for a in stacks), scale)
    expected = torch.stack([dense_shrink(x, a, s.slots, scale, out0[i]) for i, a in enumerate(stacks)])
    assert_matches(y, expected, out0, (s.slots == -1).reshape(1, -1, 1).expand_as(out0))


@EXAMPLES
@given(sizes(), SLICE_WIDTHS, st.integers(0, 3), st.booleans(), st.lists(st.booleans(), min_size=3, max_size=3))
def test_add_expand(s, widths, offset, add_inputs, with_bias):
    x = randn(s.gen, len(widths), s.tokens, s.rank)
    stacks = [randn(s.gen, s.num_slots, n, s.rank) for n in widths]
    biases = [randn(s.gen, s.num_slots, n) if with_bias[i] else None for i, n in enumerate(widths)]
    out0 = randn(s.gen, s.tokens, offset + sum(widths) + 1)
    y = out0.clone()
    wrapper_for(s.slots, s.num_slots).add_expand(
        y, x, tuple(maybe_4d(b, s.four_d) for b in stacks), tuple(widths), offset, add_inputs,
        lora_bias_stacked=tuple(biases),
    )
    expected = dense_expand(list(x), stacks, s.slots, out0, offset, add_inputs)
    column = offset
    for bias, n in zip(biases, widths):  # the bias follows offset_start, unscaled, on rows with a slot
        if bias is not None:
            expected[:, column : column + n] += dense_bias(bias, s.slots)
        column += n
    assert_matches(y, expected, out0, untouched_cells(s.slots, out0.size(1), offset, offset + sum(widths)))


@EXAMPLES
@given(sizes(), SLICE_WIDTHS, st.integers(1, 5), st.sampled_from([1.0, 0.5]), st.booleans())
def test_add_lora_linear(s, widths, hidden, scale, with_bias):
    x = randn(s.gen, s.tokens, hidden)
    a_stacks = [randn(s.gen, s.num_slots, s.rank, hidden) for _ in widths]
    b_stacks = [randn(s.gen, s.num_slots, n, s.rank) for n in widths]
    biases = [randn(s.gen, s.num_slots, 1, n) for n in widths] if with_bias else None
    out0 = randn(s.gen, s.tokens, sum(widths) + 1)
    y = out0.clone()
    wrapper_for(s.slots, s.num_slots).add_lora_linear(
        y, x, tuple(maybe_4d(a, s.four_d) for a in a_stacks), tuple(maybe_4d(b, s.four_d) for b in b_stacks),
        scale, tuple(widths), lora_bias_stacked=None if biases is None else tuple(biases),
    )
    m = selection(s.slots, s.num_slots)
    expected = out0.clone()
    column = 0
    for i, (a, b, n) in enumerate(zip(a_stacks, b_stacks, widths)):
        shrunk = scale * torch.einsum("tl,lrh,th->tr", m, a, x)
        delta = torch.einsum("tl,lnr,tr->tn", m, b, shrunk)
        if biases is not None:
            delta = delta + dense_bias(biases[i], s.slots)  # the bias is not scaled
        expected[:, column : column + n] += delta
        column += n
    assert_matches(y, expected, out0, untouched_cells(s.slots, out0.size(1), 0, sum(widths)))


@EXAMPLES
@given(sizes(), st.integers(1, 5), st.booleans())
def test_add_lora_embedding(s, width, add_inputs):
    x = randn(s.gen, s.tokens, s.rank)
    lora_b = randn(s.gen, s.num_slots, width, s.rank)
    out0 = randn(s.gen, s.tokens, width)
    y = out0.clone()
    wrapper_for(s.slots, s.num_slots).add_lora_embedding(y, x, maybe_4d(lora_b, s.four_d), add_inputs)
    expected = dense_expand([x], [lora_b], s.slots, out0, 0, add_inputs)
    assert_matches(y, expected, out0, untouched_rows(s.slots, out0))


@EXAMPLES
@given(sizes(), st.data(), st.integers(1, 5), st.integers(1, 5), st.sampled_from([1.0, 0.5]))
def test_add_lora_logits(s, data, hidden, vocab, scale):
    # The sampled rows have their own slots, independent of the tokens': the logits must follow them.
    rows = data.draw(st.integers(1, 5), label="sampled rows")
    sampled = torch.tensor(data.draw(st.lists(st.integers(-1, s.num_slots - 1), min_size=rows, max_size=rows)))
    x = randn(s.gen, rows, hidden)
    lora_a, lora_b = randn(s.gen, s.num_slots, s.rank, hidden), randn(s.gen, s.num_slots, vocab, s.rank)
    out0 = randn(s.gen, rows, vocab)
    y = out0.clone()
    wrapper = wrapper_for(s.slots, s.num_slots, sampled_slots=sampled)
    wrapper.add_lora_logits(y, x, maybe_4d(lora_a, s.four_d), maybe_4d(lora_b, s.four_d), scale)
    m = selection(sampled, s.num_slots)
    shrunk = scale * torch.einsum("tl,lrh,th->tr", m, lora_a, x)
    expected = out0 + torch.einsum("tl,lnr,tr->tn", m, lora_b, shrunk)
    assert_matches(y, expected, out0, untouched_rows(sampled, out0))
