"""The ``fused_moe_lora_fp8`` reference against a loop written one (token, choice) pair and one element at a time.

The loop does not share the reference's routing or scale spreading: it reads each pair's slot from
``token_lora_mapping`` and its expert from ``topk_ids``, and looks up every element's scale by its indices
(``lora_a_scale[l, e, r // group_n, k // group_k]`` …). It keeps the two rounding points of vLLM's op:
the intermediate rounded to the output dtype, the delta rounded before it is added. Random cases use
float32 scales with full significands, so a reference that rounded a scale or a dequantized value, or
took a scale of the wrong (slot, expert), would miss the loop; the last tests seed such bugs and check
that the comparison sees them.
"""

from __future__ import annotations

import itertools

import pytest
import torch

from conformance.reference import aligned_buffers, fused_moe_lora_fp8, moe_lora_align_block_size

E4M3 = torch.float8_e4m3fn
TOKENS, TOP_K, HIDDEN, RANK, WIDTH, SLOTS, EXPERTS, SLICES = 5, 2, 19, 6, 7, 3, 4, 2
GROUP_N, GROUP_K = 4, 8
TOKEN_SLOTS = [2, -1, 0, 2, 1]  # token 1 has no adapter: its pairs must stay as they were
DISABLED_SLOT = 1  # adapter_enabled[1] = 0: token 4's pairs are never written either
BLOCK_M = 4
TILES = (BLOCK_M, 16, 16, 1, 4, 2, 1, BLOCK_M, 16, 16, 1, 4, 2, 1)  # Triton tiles: no effect on the result


def draw_codes(shape, gen) -> torch.Tensor:
    return (torch.randn(shape, generator=gen, dtype=torch.float64) * 100).clamp(-448, 448).to(E4M3)


def draw_scales(shape, gen) -> torch.Tensor:
    """float32 scales of 24 significant bits, 2⁻⁸ … 2⁻²: no product with a code is exact in 16 bits."""
    significand = 1.0 + torch.rand(shape, generator=gen, dtype=torch.float64)
    return (significand * torch.pow(2.0, torch.randint(-8, -2, shape, generator=gen).double())).float()


def weight_scale_shape(mode: str, n: int, k: int) -> tuple[int, ...]:
    """vLLM's layouts: per (slot, expert); per (slot, expert, output channel); per block of ``group_n × group_k``."""
    return {"tensor": (SLOTS, EXPERTS), "channel": (SLOTS, EXPERTS, n, 1),
            "block": (SLOTS, EXPERTS, -(-n // GROUP_N), -(-k // GROUP_K))}[mode]


def act_scale_shape(mode: str, rows: int, k: int) -> tuple[int, ...]:
    return {"tensor": (1,), "channel": (rows, 1), "block": (rows, -(-k // GROUP_K))}[mode]


def weight_scale(mode: str, scale: torch.Tensor, l: int, e: int, n: int, k: int) -> float:  # noqa: E741
    if mode == "tensor":
        return float(scale[l, e])
    if mode == "channel":
        return float(scale[l, e, n, 0])
    return float(scale[l, e, n // GROUP_N, k // GROUP_K])


def act_scale(mode: str, scale: torch.Tensor | None, row: int, k: int) -> float:
    if scale is None:
        return 1.0
    if mode == "tensor":
        return float(scale[0])
    return float(scale[row, 0] if mode == "channel" else scale[row, k // GROUP_K])


def draw_case(mode: str, seed: int, mul_routed_weight: bool, with_expand_scale: bool) -> dict:
    gen = torch.Generator().manual_seed(seed)
    rows = TOKENS * TOP_K if mul_routed_weight else TOKENS
    topk_ids = torch.stack([torch.randperm(EXPERTS, generator=gen)[:TOP_K] for _ in range(TOKENS)])
    return {
        "mode": mode,
        "mul_routed_weight": mul_routed_weight,
        "topk_ids": topk_ids,
        "topk_weights": torch.rand(TOKENS, TOP_K, generator=gen, dtype=torch.float64).float(),
        "x": draw_codes((rows, HIDDEN), gen),
        "lora_a": [draw_codes((SLOTS, EXPERTS, RANK, HIDDEN), gen) for _ in range(SLICES)],
        "lora_b": [draw_codes((SLOTS, EXPERTS, WIDTH, RANK), gen) for _ in range(SLICES)],
        "a_scales": [draw_scales(weight_scale_shape(mode, RANK, HIDDEN), gen) for _ in range(SLICES)],
        "b_scales": [draw_scales(weight_scale_shape(mode, WIDTH, RANK), gen) for _ in range(SLICES)],
        "shrink_act_scale": draw_scales(act_scale_shape(mode, rows, HIDDEN), gen),
        "expand_act_scale": draw_scales(act_scale_shape(mode, TOKENS * TOP_K, RANK), gen) if with_expand_scale else None,
        "initial": torch.randn(TOKENS, TOP_K, 3 + SLICES * WIDTH + 2, generator=gen, dtype=torch.float64),
    }


def run_reference(case: dict, out_dtype: torch.dtype, aligned: bool, **overrides) -> torch.Tensor:
    case = {**case, **overrides}
    token_slots = torch.tensor(TOKEN_SLOTS)
    adapter_enabled = torch.tensor([1 if slot != DISABLED_SLOT else 0 for slot in range(SLOTS)])
    lora_ids = torch.tensor([0, 1, 2])
    if aligned:
        sorted_ids, expert_ids, post_padded, blocks, per_slot = aligned_buffers(TOKENS * TOP_K, EXPERTS, BLOCK_M, SLOTS, "cpu")
        moe_lora_align_block_size(case["topk_ids"], token_slots, EXPERTS, BLOCK_M, SLOTS, per_slot, blocks, sorted_ids,
                                  expert_ids, post_padded, adapter_enabled, lora_ids)
        metadata = (sorted_ids.view(SLOTS, -1), expert_ids.view(SLOTS, -1), post_padded)
    else:
        metadata = (None, case["topk_ids"].reshape(-1), None)
    out = case["initial"].to(out_dtype, copy=True)
    mode = case["mode"]
    fused_moe_lora_fp8(
        out, case["x"], case["lora_a"], case["lora_b"], case["topk_weights"], *metadata, token_slots, RANK, TOP_K,
        lora_ids, SLOTS, adapter_enabled, *TILES, case["a_scales"], case["b_scales"], case["shrink_act_scale"],
        case["expand_act_scale"], mul_routed_weight=case["mul_routed_weight"], offset=3, use_fp8_w8a8=True,
        per_channel_quant=mode == "channel", block_shape=[GROUP_N, GROUP_K] if mode == "block" else None,
    )
    return out


def per_pair_loop(case: dict, out_dtype: torch.dtype, round_intermediate: bool = True) -> torch.Tensor:
    """Every pair, every element: dequantize by the scale its indices pick, sum in float64, round where vLLM does."""
    mode, out = case["mode"], case["initial"].to(out_dtype, copy=True)
    for t, k in itertools.product(range(TOKENS), range(TOP_K)):
        slot, expert, pair = TOKEN_SLOTS[t], int(case["topk_ids"][t, k]), t * TOP_K + k
        if slot == -1 or slot == DISABLED_SLOT:
            continue
        row = pair if case["mul_routed_weight"] else t
        weight = float(case["topk_weights"][t, k]) if case["mul_routed_weight"] else 1.0
        for s in range(SLICES):
            a, b, sa, sb = case["lora_a"][s], case["lora_b"][s], case["a_scales"][s], case["b_scales"][s]
            h = [sum(float(case["x"][row, c]) * act_scale(mode, case["shrink_act_scale"], row, c)
                     * float(a[slot, expert, r, c]) * weight_scale(mode, sa, slot, expert, r, c) for c in range(HIDDEN))
                 for r in range(RANK)]
            if round_intermediate:  # the intermediate is a buffer in the output dtype
                h = torch.tensor(h, dtype=torch.float64).to(out_dtype).double().tolist()
            for n in range(WIDTH):
                delta = weight * sum(h[r] * act_scale(mode, case["expand_act_scale"], pair, r)
                                     * float(b[slot, expert, n, r]) * weight_scale(mode, sb, slot, expert, n, r)
                                     for r in range(RANK))
                column = 3 + s * WIDTH + n
                out[t, k, column] += torch.tensor(delta, dtype=torch.float64).to(out_dtype)
    return out


@pytest.mark.parametrize(("mode", "mul_routed_weight", "aligned"),
                         [(m, w, a) for m in ("tensor", "channel", "block") for w, a in ((False, True), (True, False))])
def test_reference_matches_the_per_pair_loop_in_float64(mode, mul_routed_weight, aligned):
    case = draw_case(mode, seed=len(mode) + mul_routed_weight, mul_routed_weight=mul_routed_weight, with_expand_scale=True)
    got = run_reference(case, torch.float64, aligned)
    torch.testing.assert_close(got, per_pair_loop(case, torch.float64), rtol=1e-12, atol=1e-12)
    assert torch.equal(got[1], case["initial"][1]) and torch.equal(got[4], case["initial"][4])  # no adapter, disabled slot


@pytest.mark.parametrize("mode", ["tensor", "channel", "block"])
def test_reference_rounds_where_vllm_rounds_in_bfloat16(mode):
    """Without an expand activation scale (the intermediate read as it is), in bfloat16: the loop rounds the
    intermediate and the delta to bfloat16, the reference must land on the same bits up to one ulp of the
    float64 sums' order (the two sum in a different order, and a rounding boundary may fall between)."""
    case = draw_case(mode, seed=7, mul_routed_weight=True, with_expand_scale=False)
    got, expected = run_reference(case, torch.bfloat16, aligned=True), per_pair_loop(case, torch.bfloat16)
    mismatched = (got != expected).float().mean()
    assert mismatched < 0.02, f"{mismatched:.1%} of bfloat16 outputs differ from the loop's"


def test_the_naive_and_the_aligned_metadata_give_the_same_result():
    case = draw_case("block", seed=3, mul_routed_weight=False, with_expand_scale=True)
    assert torch.equal(run_reference(case, torch.float64, aligned=True), run_reference(case, torch.float64, aligned=False))


def test_without_fp8_it_is_fused_moe_lora_that_adds():
    from conformance.reference import fused_moe_lora

    case = draw_case("tensor", seed=5, mul_routed_weight=False, with_expand_scale=False)
    lora_a, lora_b = [a.double() for a in case["lora_a"]], [b.double() for b in case["lora_b"]]
    token_slots, enabled, lora_ids = torch.tensor(TOKEN_SLOTS), torch.ones(SLOTS, dtype=torch.long), torch.tensor([0, 1, 2])
    args = (case["x"].double(), lora_a, lora_b, case["topk_weights"], None, case["topk_ids"].reshape(-1), None, token_slots,
            RANK, TOP_K, lora_ids, SLOTS, enabled, *TILES)
    plain, quantized = case["initial"].clone(), case["initial"].clone()
    fused_moe_lora(plain, *args, add_inputs=True)
    fused_moe_lora_fp8(quantized, *args, None, None)
    assert torch.equal(plain, quantized) and not torch.equal(plain, case["initial"])
    with pytest.raises(ValueError, match="without use_fp8_w8a8"):
        fused_moe_lora_fp8(quantized, *args, case["a_scales"], case["b_scales"])


# -- the comparison catches seeded bugs ------------------------------------------------------------


def expert_zero_scales(scales: list[torch.Tensor]) -> list[torch.Tensor]:
    """Every expert given expert 0's scales: a kernel that indexed the scale by slot only."""
    return [s[:, :1].expand_as(s).contiguous() for s in scales]


@pytest.mark.parametrize("mode", ["tensor", "channel", "block"])
def test_a_scale_taken_from_expert_zero_misses_the_loop(mode):
    case = draw_case(mode, seed=11, mul_routed_weight=False, with_expand_scale=True)
    bugged = run_reference(case, torch.float64, aligned=True, a_scales=expert_zero_scales(case["a_scales"]))
    assert not torch.allclose(bugged, per_pair_loop(case, torch.float64), rtol=1e-3, atol=0)


@pytest.mark.parametrize("mode", ["tensor", "block"])
def test_an_intermediate_left_unrounded_misses_the_loop_in_bfloat16(mode):
    """The bfloat16 check above sees the intermediate's rounding: the loop without it is far off."""
    case = draw_case(mode, seed=7, mul_routed_weight=True, with_expand_scale=False)
    got = run_reference(case, torch.bfloat16, aligned=True)
    unrounded = per_pair_loop(case, torch.bfloat16, round_intermediate=False)
    assert (got != unrounded).float().mean() > 0.1
