"""The fp8 reference ops: tiny cases worked out by hand, and an element-by-element sum on random ones.

The hand-worked cases use fp8 codes that are small integers (exact in e4m3fn) and power-of-two or
simple scales, so every sum below is exact in float64 and compared exactly. The random ones compare
the reference with a sum written one element at a time, the scale of each element looked up by its
indices as the kernels read them (``a_scale[m, k // group_k]``, ``b_scale[l, n // group_n, k // group_k]``).
"""

from __future__ import annotations

import itertools

import pytest
import torch

from conformance.reference import LoRAKernelMeta, lora_expand_fp8, lora_shrink_fp8

SENTINEL = -7.0
E4M3 = torch.float8_e4m3fn


def codes(values) -> torch.Tensor:
    return torch.tensor(values, dtype=torch.float64).to(E4M3)


def f32(values) -> torch.Tensor:
    return torch.tensor(values, dtype=torch.float32)


def meta(slots: list[int], num_slots: int) -> tuple:
    return LoRAKernelMeta.build(torch.tensor(slots), num_slots).meta_args()


def quant_args(mode: str, group_k: int = 0, group_n: int = 0) -> dict:
    return {"group_k": group_k, "group_n": group_n, "use_fp8_w8a8": True, "per_channel_quant": mode == "channel"}


# Shrink: token 0 uses slot 0, token 1 has no adapter (its row must stay SENTINEL).
X = [[1, 2, 3, 4], [5, 5, 5, 5]]  # [T=2, H=4]
A = [[[1, 1, 1, 1], [1, 0, 0, 2]]]  # [L=1, R=2, H=4]


@pytest.mark.parametrize(
    ("mode", "a_scale", "b_scale", "groups", "expected"),
    [
        # x·A₀ = 1+2+3+4 = 10, x·A₁ = 1+8 = 9; × a 0.5 × b 4 × scaling 2
        ("tensor", [0.5], [4.0], (0, 0), [40.0, 36.0]),
        # x row scaled 0.5: [0.5, 1, 1.5, 2]; A₀ × 2 → 2·5 = 10, A₁ × 0.5 = [0.5, 0, 0, 1] → 0.25 + 2 = 2.25; × scaling 2
        ("channel", [[0.5], [3.0]], [[2.0, 0.5]], (0, 0), [20.0, 4.5]),
        # group_k 2: x → [0.5, 1, 6, 8] (scales 0.5, 2); group_n 1: A₀ → [1, 1, 4, 4], A₁ → [0.25, 0, 0, 2]
        # A₀: 0.5 + 1 + 24 + 32 = 57.5; A₁: 0.125 + 16 = 16.125; × scaling 2
        ("block", [[0.5, 2.0], [9.0, 9.0]], [[[1.0, 4.0], [0.25, 1.0]]], (2, 1), [115.0, 32.25]),
    ],
)
def test_shrink_by_hand(mode, a_scale, b_scale, groups, expected):
    out = torch.tensor([[[0.0, 0.0], [SENTINEL, SENTINEL]]], dtype=torch.float64)
    lora_shrink_fp8(codes(X), [codes(A)], out, *meta([0, -1], 1), 2, 2.0, [f32(b_scale)], f32(a_scale),
                    **quant_args(mode, *groups))
    torch.testing.assert_close(out, torch.tensor([[expected, [SENTINEL, SENTINEL]]], dtype=torch.float64), rtol=0, atol=0)


@pytest.mark.parametrize(("add_inputs", "row1"), [(True, [1.0, 6.0, 4.0]), (False, [1.0, 5.0, 3.0])])
def test_expand_by_hand(add_inputs, row1):
    # token 0 has no adapter; token 1 uses slot 0. x₁ = [2, 4] × 0.25 = [0.5, 1]; B × 2: [[2, 4], [6, 0]]
    # delta = [0.5·2 + 1·4, 0.5·6] = [5, 3], written from column 1
    x = codes([[[7, 7], [2, 4]]])  # [S=1, T=2, R=2]
    out = torch.tensor([[SENTINEL] * 3, [1.0, 1.0, 1.0]], dtype=torch.float64)
    lora_expand_fp8(x, [codes([[[1, 2], [3, 0]]])], out, *meta([-1, 0], 1), 2, [f32([2.0])], f32([0.25]),
                    1, add_inputs, **quant_args("tensor"))
    torch.testing.assert_close(out, torch.tensor([[SENTINEL] * 3, row1], dtype=torch.float64), rtol=0, atol=0)


def test_nothing_is_written_when_no_row_has_an_adapter():
    out = torch.full((1, 2, 2), SENTINEL, dtype=torch.float64)
    lora_shrink_fp8(codes(X), [codes(A)], out, *meta([-1, -1], 1), 2, 1.0, [f32([1.0])], f32([1.0]), **quant_args("tensor"))
    assert (out == SENTINEL).all()


# -- random cases against a sum taken one element at a time ---------------------------------------


def element_scale(mode: str, scale: torch.Tensor, row: int, n: int | None, k: int, group_n: int, group_k: int) -> float:
    """The scale of activation ``[row, k]`` (``n`` None) or weight ``[row=l, n, k]``, indexed as the kernels read it."""
    if mode == "tensor":
        return float(scale.reshape(-1)[0 if n is None else row])
    if mode == "channel":
        return float(scale[row, 0] if n is None else scale[row, n])
    return float(scale[row, k // group_k] if n is None else scale[row, n // group_n, k // group_k])


def draw(shape, gen) -> torch.Tensor:
    return (torch.randn(shape, generator=gen, dtype=torch.float64) * 100).clamp(-448, 448).to(E4M3)


def scales_for(mode: str, shape_tensor, shape_channel, shape_block, gen) -> torch.Tensor:
    """float32 scales with full 24-bit significands (as ``amax / 448`` gives), 2⁻³ … 2⁴: a reference that
    rounded a scale, or a dequantized value, below float64 would miss the element-by-element sum."""
    shape = {"tensor": shape_tensor, "channel": shape_channel, "block": shape_block}[mode]
    significand = 1.0 + torch.rand(shape, generator=gen, dtype=torch.float64)
    return (significand * torch.pow(2.0, torch.randint(-3, 4, shape, generator=gen).double())).float()


@pytest.mark.parametrize(("mode", "seed"), list(itertools.product(("tensor", "channel", "block"), range(3))))
def test_shrink_matches_an_element_by_element_sum(mode, seed):
    gen = torch.Generator().manual_seed(seed)
    tokens, hidden, rank, num_slots, group_k, group_n = 5, 37, 6, 3, 8, 4
    gk, gn = (group_k, group_n) if mode == "block" else (0, 0)
    slots = [2, -1, 0, 2, 1]
    x, stacks = draw((tokens, hidden), gen), [draw((num_slots, rank, hidden), gen) for _ in range(2)]
    a_scale = scales_for(mode, (1,), (tokens, 1), (tokens, -(-hidden // group_k)), gen)
    b_scales = [scales_for(mode, (num_slots,), (num_slots, rank), (num_slots, -(-rank // group_n), -(-hidden // group_k)), gen)
                for _ in stacks]
    out = torch.zeros(2, tokens, rank, dtype=torch.float64)
    lora_shrink_fp8(x, stacks, out, *meta(slots, num_slots), num_slots + 1, 0.5, b_scales, a_scale, **quant_args(mode, gk, gn))
    expected = torch.zeros_like(out)
    for s, t, r in itertools.product(range(2), range(tokens), range(rank)):
        if slots[t] == -1:
            continue
        expected[s, t, r] = 0.5 * sum(
            float(x[t, k]) * element_scale(mode, a_scale, t, None, k, gn, gk)
            * float(stacks[s][slots[t], r, k]) * element_scale(mode, b_scales[s], slots[t], r, k, gn, gk)
            for k in range(hidden)
        )
    torch.testing.assert_close(out, expected, rtol=1e-12, atol=1e-9)


@pytest.mark.parametrize(("mode", "seed"), list(itertools.product(("tensor", "channel", "block"), range(3))))
def test_expand_matches_an_element_by_element_sum(mode, seed):
    gen = torch.Generator().manual_seed(seed)
    tokens, rank, width, num_slots, group_k, group_n, offset = 4, 9, 11, 2, 4, 4, 3
    gk, gn = (group_k, group_n) if mode == "block" else (0, 0)
    slots = [1, 0, -1, 1]
    x, stacks = draw((2, tokens, rank), gen), [draw((num_slots, width, rank), gen) for _ in range(2)]
    a_scale = scales_for(mode, (1,), (tokens, 1), (tokens, -(-rank // group_k)), gen)
    b_scales = [scales_for(mode, (num_slots,), (num_slots, width), (num_slots, -(-width // group_n), -(-rank // group_k)), gen)
                for _ in stacks]
    initial = torch.randn(tokens, offset + 2 * width + 2, generator=gen, dtype=torch.float64)
    out = initial.clone()
    lora_expand_fp8(x, stacks, out, *meta(slots, num_slots), num_slots + 1, b_scales, a_scale, offset, True,
                    **quant_args(mode, gk, gn))
    expected = initial.clone()
    for s, t, n in itertools.product(range(2), range(tokens), range(width)):
        if slots[t] == -1:
            continue
        expected[t, offset + s * width + n] += sum(
            float(x[s, t, k]) * element_scale(mode, a_scale, t, None, k, gn, gk)
            * float(stacks[s][slots[t], n, k]) * element_scale(mode, b_scales[s], slots[t], n, k, gn, gk)
            for k in range(rank)
        )
    torch.testing.assert_close(out, expected, rtol=1e-12, atol=1e-9)


def test_the_oracle_reads_widened_codes_as_the_same_numbers():
    """The referee hands the oracle float64 copies of the fp8 codes: the same values, so the same result."""
    gen = torch.Generator().manual_seed(0)
    x, stack = draw((3, 16), gen), draw((2, 4, 16), gen)
    args = (*meta([0, 1, -1], 2), 3, 1.0, [f32([0.25, 4.0])], f32([0.125]))
    fp8_out, wide_out = torch.zeros(1, 3, 4, dtype=torch.float64), torch.zeros(1, 3, 4, dtype=torch.float64)
    lora_shrink_fp8(x, [stack], fp8_out, *args, **quant_args("tensor"))
    lora_shrink_fp8(x.double(), [stack.double()], wide_out, *args, **quant_args("tensor"))
    assert torch.equal(fp8_out, wide_out) and fp8_out.abs().sum() > 0
