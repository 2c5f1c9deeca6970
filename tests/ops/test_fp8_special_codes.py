"""The fp8 codes where formats and ports differ, in every fp8 smoke case where the op reads them; partial block
groups; per-pair activation scales (issue 32, part 4).

Drawn values almost never hold −0, ±2⁻⁹ or +0 where an op reads them (before ``fp8_values.place_special_codes``:
no −0 in any smoke ``lora_shrink_fp8`` / ``lora_expand_fp8`` case, 2 in 45 MoE operands), so every operand gets
each of ``SPECIAL_CODES`` on purpose. The read region is worked out here from the case alone (rows an adapter
serves, ranks below the slot's rank, the (slot, expert) stacks served pairs read): a code only in rank padding
or in a slot −1 row would not count. Block cases must have a partial last scale group where a served row reads
it, on the shrink side (K = hidden size, N = rank) and the expand side (K = rank, N = slice width), and one
per-channel MoE case must scale each pair by its own row with two choices per token: the faults
``fault-fp8-fnuz-negative-zero-nan``, ``fault-fp8-expand-partial-rank-group-clamped`` and
``fault-moe-fp8-pair-scale-read-per-token`` (tests/fault_targets.py) pass every case without them.
"""

from __future__ import annotations

import pytest
import torch

from conformance.cases.fp8_values import FP8_DTYPE, FP8_MAX, SPECIAL_CODES, place_special_codes
from conformance.cases.values import generator_for
from conformance.generator.profiles import profile_cases
from conformance.ops import OP_SPECS
from conformance.ops.moe import served_pairs

FP8_OPS = ("lora_shrink_fp8", "lora_expand_fp8", "fused_moe_lora_fp8")
# the bytes of −0, +448, −448, +2⁻⁹, −2⁻⁹, +0 in e4m3fn, SPECIAL_CODES' order: compared as bytes, so −0 is not +0
SPECIAL_BYTES = {"-0": 0x80, "+448": 0x7E, "-448": 0xFE, "+2^-9": 0x01, "-2^-9": 0x81, "+0": 0x00}


@pytest.fixture(scope="module")
def smoke_cases():
    return [(case_id, case, OP_SPECS[case.op].make_values(case, generator_for(case))) for case_id, case in profile_cases("smoke", ops=FP8_OPS)]


def served_stacks(case) -> set[tuple[int, ...]]:
    """The stacks a served row reads: ``(slot,)`` for the dense ops, ``(slot, local expert)`` for the MoE op."""
    if case.op != "fused_moe_lora_fp8":
        return {(slot,) for slot in case.token_slots if slot != -1}
    experts = [case.local_expert(e) for ids in case.topk_ids for e in ids]
    return {(slot, expert) for slot, expert, served in zip(case.pair_slots, experts, served_pairs(case).tolist()) if served}


def read_region(case, name: str, value: torch.Tensor) -> torch.Tensor:
    """bool like ``value``: the elements the op multiplies on behalf of a served row, below its slot's rank."""
    read = torch.zeros(value.shape, dtype=torch.bool)
    if name == "x" and case.op == "fused_moe_lora_fp8":  # a row per pair (w2) or per token (w13, any served pair)
        pairs = served_pairs(case)
        read[pairs if case.routed_weight else pairs.view(case.num_tokens, case.top_k).any(dim=1)] = True
    elif name == "x":
        for token, slot in enumerate(case.token_slots):
            if slot != -1:  # the expand's input [S, T, R]: only ranks below the slot's meet its weights
                read[..., token, : case.adapter_ranks[slot] if case.op == "lora_expand_fp8" else value.size(-1)] = True
    else:
        for stack in served_stacks(case):
            rank = case.adapter_ranks[stack[0]]
            if name.startswith("lora_a"):
                read[stack][:rank] = True  # LoRA-A rows
            else:
                read[stack][:, :rank] = True  # LoRA-B columns
    return read


def test_every_fp8_operand_holds_every_special_code_where_the_op_reads_it(smoke_cases):
    for case_id, case, values in smoke_cases:
        checked = set()
        for name, value in values.items():
            if value.dtype != FP8_DTYPE:
                continue
            checked.add(name)
            read_bytes = value.view(torch.uint8)[read_region(case, name, value)]
            missing = [code for code, byte in SPECIAL_BYTES.items() if not (read_bytes == byte).any()]
            assert missing == [], (case_id, name)
        stacks = {"lora_a"} if case.op == "lora_shrink_fp8" else {"lora_b"} if case.op == "lora_expand_fp8" else {"lora_a", "lora_b"}
        assert checked == {"x"} | {f"{stack}.{s}" for stack in stacks for s in range(case.num_slices)}, case_id


def test_placed_codes_keep_every_activation_groups_largest_code_at_448(smoke_cases):
    """A placed code goes over a code below 448, so each activation scale still dequantizes a group whose largest
    code is ±448, as the quantizer chose it (the MoE op's here; the dense ops' in test_fp8_ops.py)."""
    for case_id, case, values in smoke_cases:
        if case.op != "fused_moe_lora_fp8":
            continue
        x = values["x"].float().abs()
        if case.fp8_scales == "tensor":
            largest = x.amax().reshape(1)
        elif case.fp8_scales == "channel":
            largest = x.amax(dim=1)
        else:
            largest = torch.stack([x[:, k : k + case.group_k].amax(dim=1) for k in range(0, x.size(1), case.group_k)], dim=1)
        assert (largest == FP8_MAX).all(), case_id


def test_special_codes_go_where_read_over_codes_below_448_and_only_as_many_as_fit():
    codes = torch.tensor([[448.0, 1.0, -2.0, 3.0], [-448.0, 0.5, 448.0, -4.0], [5.0, 6.0, 7.0, 8.0]]).to(FP8_DTYPE)
    read = torch.tensor([[True] * 4, [True] * 4, [False] * 4])  # row 2 is a slot −1 row
    placed = place_special_codes(torch.Generator().manual_seed(0), codes, read)
    changed = placed.view(torch.uint8) != codes.view(torch.uint8)
    below = codes.float().abs() < FP8_MAX
    assert changed.sum() <= len(SPECIAL_CODES) and not (changed & ~(read & below)).any()  # never row 2, never a 448
    assert set(placed.view(torch.uint8)[read & below].tolist()) == {0x80, 0x7E, 0xFE, 0x01, 0x81}  # 5 places: +0 left out
    again = place_special_codes(torch.Generator().manual_seed(0), codes, read)
    assert torch.equal(again.view(torch.uint8), placed.view(torch.uint8))  # drawn from the generator alone


def partial(size: int, group: int) -> bool:
    """Two groups at least along ``size``, the last one partial."""
    return size > group and size % group != 0


def rank_reads_last_group(case, group: int) -> bool:
    """A served slot's rank reaches into the rank's last group (only there its weights are read)."""
    last_start = (case.max_rank - 1) // group * group
    return any(case.adapter_ranks[stack[0]] > last_start for stack in served_stacks(case))


def test_block_cases_have_partial_last_groups_on_the_shrink_and_the_expand_side(smoke_cases):
    block = [case for _, case, _ in smoke_cases if case.fp8_scales == "block"]
    # the expand (K = rank, N = slice width) and the MoE op's LoRA-B half (the same sides)
    expand_side = [
        case for case in block
        if case.op != "lora_shrink_fp8" and partial(case.max_rank, case.group_k) and rank_reads_last_group(case, case.group_k)
        and partial(case.output_slices[0], case.group_n)
    ]  # fmt: skip
    # the shrink (K = hidden size, N = rank) and the MoE op's LoRA-A half
    shrink_side = [
        case for case in block
        if case.op != "lora_expand_fp8" and partial(case.hidden_size, case.group_k)
        and partial(case.max_rank, case.group_n) and rank_reads_last_group(case, case.group_n)
    ]  # fmt: skip
    assert "lora_expand_fp8" in [case.op for case in expand_side], "no lora_expand_fp8 block case reads a partial rank group"
    assert shrink_side, "no block case has partial groups along both the hidden size and the rank"
    # most block cases: every hidden size and slice width the family draws leaves a partial last group
    assert all(partial(case.hidden_size, case.group_k) for case in block if case.op != "lora_expand_fp8")
    assert all(partial(case.output_slices[0], case.group_n) for case in block if case.op == "lora_expand_fp8")


def test_a_per_channel_w2_moe_case_scales_the_pairs_of_a_token_apart(smoke_cases):
    """With the routing weight the input has a row per pair, and so has the per-channel activation scale: with
    top_k ≥ 2 some served pair's scale differs from the one at its token's row index (``p // top_k``)."""
    found = []
    for case_id, case, values in smoke_cases:
        if case.op == "fused_moe_lora_fp8" and case.fp8_scales == "channel" and case.routed_weight and case.top_k >= 2:
            scale = values["act_scale"].reshape(-1)
            pairs = torch.nonzero(served_pairs(case)).flatten()
            if (scale[pairs] != scale[pairs // case.top_k]).any():
                found.append(case_id)
    assert found
