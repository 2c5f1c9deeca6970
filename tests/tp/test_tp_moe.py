"""The MoE LoRA layer under tensor parallelism (conformance/tp/moe_*.py), every rank a thread.

In float64 the composition of w13 (two slices or one fused) and w2 at TP 2 and 4, padded or not, must
be the golden reference's unsharded ``add_lora_w13`` / ``add_lora_w2``; a padded rank's LoRA-B must put
up where the base weight has it; and the sharding mistakes a port makes (vLLM 0.32's padded stride,
a w2 output never reduced) must be failed, naming the part and the rank.
"""

from __future__ import annotations

import dataclasses
import json

import pytest
import torch

from conformance.ops import case_mapping
from conformance.reference.punica_wrapper import PunicaWrapperReference
from conformance.targets.facts import facts_of
from conformance.targets.reference import ReferenceTarget
from conformance.tp import moe_layer
from conformance.tp.cases import tp_cases
from conformance.tp.collectives import run_in_threads
from conformance.tp.inputs import ReadOnlyInputs
from conformance.tp.moe_case import MoETPCase
from conformance.tp.moe_judgement import judge_moe_output, moe_baseline_output, moe_oracle_output, moe_written_mask
from conformance.tp.moe_layer import moe_tensors, w13_columns, w13_lora_b_rows
from conformance.tp.run import unsupported_reason
from conformance.verdict import FailureKind


def moe_case(layer: str, tp_size: int, padded: bool, fused: bool = False, dtype: str = "float32", **changes) -> MoETPCase:
    """Shard 6 rows per rank, padded to 8 (alignment 8) or not (alignment 1)."""
    fields = dict(layer=layer, tp_size=tp_size, dtype=dtype, seq_lens=(3, 2, 1, 2), seq_slots=(0, -1, 2, 1), num_slots=3,
                  max_rank=8, hidden_size=32, intermediate_size=6 * tp_size, num_experts=4, top_k=2,
                  alignment=8 if padded else 1, fused_w13=fused, seed=13)
    return MoETPCase(**{**fields, **changes})


KINDS = [("moe_w13", False), ("moe_w13", True), ("moe_w2", False)]


@pytest.mark.parametrize("padded", [False, True], ids=["unpadded", "padded"])
@pytest.mark.parametrize("tp_size", [2, 4])
@pytest.mark.parametrize(("layer", "fused"), KINDS)
def test_the_moe_composition_in_float64_is_the_unsharded_layer(layer, fused, tp_size, padded):
    case = moe_case(layer, tp_size, padded, fused, disabled_slots=(1,))
    tensors = moe_tensors(case).to(torch.float64)
    composed = moe_baseline_output(case, tensors)
    torch.testing.assert_close(composed[0], moe_oracle_output(case, tensors), rtol=0, atol=1e-12)
    untouched = ~moe_written_mask(case)
    assert torch.equal(composed[0][untouched], tensors.y[untouched])  # slot −1, disabled slot 1, padding: bit for bit
    assert (moe_oracle_output(case, tensors) != tensors.y).any()  # the delta is not empty


@pytest.mark.parametrize("fused", [False, True], ids=["two_slices", "fused"])
def test_a_padded_rank_puts_up_where_the_base_weight_has_it(fused):
    """TP 2, I = 12: each rank holds 6 rows and allocates 8. Rank 1's LoRA-B: gate rows 6–11 then two zero
    rows, up rows 18–23 (of the fused 2·I slice) starting at row 8, then two zero rows."""
    case = moe_case("moe_w13", 2, padded=True, fused=fused)
    assert (case.shard, case.padded_shard, case.padding) == (6, 8, 2)
    stacks = moe_tensors(case).lora_b
    local = torch.cat(w13_lora_b_rows(case, stacks, 1), dim=2)  # [L, E, 16, R] either way
    gate, up = (stacks[0][:, :, 6:12], stacks[0][:, :, 18:24]) if fused else (stacks[0][:, :, 6:12], stacks[1][:, :, 6:12])
    assert local.size(2) == 16
    assert torch.equal(local[:, :, 0:6], gate) and torch.equal(local[:, :, 8:14], up)
    assert not local[:, :, 6:8].any() and not local[:, :, 14:16].any()
    # and the rank's output columns: gate 6–11, its gate padding, up 18–23, its up padding (after the 2·I columns)
    assert w13_columns(case, 1) == [("gate", 6, 12), ("gate padding", 28, 30), ("up", 18, 24), ("up padding", 30, 32)]


def v032_w13_lora_b_rows(case: MoETPCase, stacks, rank: int):
    """vLLM 0.32.0's slicing (``_slice_w13_b``): the stride is the *allocated* per-rank size, and a fused slice's
    up part is put right after the gate rows it got; the stack is zero past what was copied."""
    size, inter = case.padded_shard, case.intermediate_size

    def into_zeros(part, rows):
        out = part.new_zeros(*part.shape[:2], rows, part.size(3))
        out[:, :, : part.size(2)] = part
        return out

    if not case.fused_w13:
        return tuple(into_zeros(b[:, :, rank * size : (rank + 1) * size], size) for b in stacks)
    (fused,) = stacks
    gate, up = fused[:, :, :inter], fused[:, :, inter:]
    part = torch.cat([gate[:, :, rank * size : (rank + 1) * size], up[:, :, rank * size : (rank + 1) * size]], dim=2)
    return (into_zeros(part, 2 * size),)


def _composed(case, tensors, collectives_class=lambda inner: inner):
    def one_rank(rank, collectives):
        reference = PunicaWrapperReference()
        reference.update_metadata(case_mapping(case))
        return moe_layer.moe_composition(case)(case, tensors, reference, collectives_class(collectives), rank)

    return run_in_threads(case.tp_size, one_rank)[0]


@pytest.mark.parametrize("fused", [False, True], ids=["two_slices", "fused"])
def test_vllm_032_slicing_fails_a_padded_layer_and_matches_0_33_unpadded(monkeypatch, fused):
    monkeypatch.setattr(moe_layer, "w13_lora_b_rows", v032_w13_lora_b_rows)
    unpadded = moe_case("moe_w13", 2, padded=False, fused=fused)
    tensors = moe_tensors(unpadded)
    assert judge_moe_output(unpadded, _composed(unpadded, tensors), tensors)[0].passed
    case = moe_case("moe_w13", 2, padded=True, fused=fused)
    tensors = moe_tensors(case)
    verdict, message, slots, ranks, _, _ = judge_moe_output(case, _composed(case, tensors), tensors)
    assert not verdict.passed and ranks == (0, 1), message
    # stride 8, not 6: rank 0 takes rank 1's rows 6–7 into its padding, rank 1 starts at row 8 (its gate and up wrong)
    assert "columns 24–25 (gate padding, rank 0)" in message and "wrote" in message
    assert "columns 6–11 (gate, rank 1)" in message and "columns 18–23 (up, rank 1)" in message
    assert -1 not in slots


class NeverReduces:
    """A w2 composition whose partial outputs are never all-reduced: each rank's partial sum is its answer."""

    def __init__(self, inner) -> None:
        self.inner = inner

    def all_gather(self, tensor, dim=-1):
        return self.inner.all_gather(tensor, dim)

    def all_reduce(self, tensor):
        return tensor


def test_a_w2_output_never_reduced_fails_on_adapter_rows_naming_every_rank():
    case = moe_case("moe_w2", 2, padded=True)
    tensors = moe_tensors(case)
    verdict, message, slots, ranks, kinds, _ = judge_moe_output(case, _composed(case, tensors, collectives_class=NeverReduces), tensors)
    assert not verdict.passed and ranks == (0, 1), message
    assert "every rank adds a partial delta to every column" in message
    assert -1 not in slots and set(slots) == {0, 1, 2}


def test_an_empty_pad_region_written_is_outside_the_region():
    """A rank writing into its padding columns (rows past its shard) fails even though nothing reads them."""
    case = moe_case("moe_w13", 4, padded=True)
    tensors = moe_tensors(case)
    composed = moe_baseline_output(case, tensors)
    _, start, end = w13_columns(case, 3)[1]
    assert w13_columns(case, 3)[1][0] == "gate padding"
    composed[0, 0, start] += 1
    verdict, message, _, ranks, kinds, _ = judge_moe_output(case, composed, tensors)
    assert kinds == (FailureKind.OUTSIDE_REGION,) and ranks == (3,), message
    assert "(gate padding, rank 3)" in message


def test_moe_cases_round_trip_through_json_and_refuse_what_vllm_cannot_shard():
    for case in tp_cases("standard"):
        assert type(case).from_json(json.loads(json.dumps(case.to_json()))) == case
    with pytest.raises(ValueError, match="intermediate_size = 10 must be a positive multiple of tp_size 4"):
        moe_case("moe_w13", 4, padded=False, intermediate_size=10)
    with pytest.raises(ValueError, match="fused_w13: only the w13 LoRA"):
        moe_case("moe_w2", 2, padded=False, fused=True)
    with pytest.raises(ValueError, match=r"unknown tensor-parallel MoE case field\(s\) \['colour'\]"):
        MoETPCase.from_json({**moe_case("moe_w2", 2, False).to_json(), "colour": "red"})


def test_profiles_hold_moe_cases_with_their_features():
    smoke, standard = tp_cases("smoke"), tp_cases("standard")
    smoke_moe = [c for c in smoke if isinstance(c, MoETPCase)]
    standard_moe = [c for c in standard if isinstance(c, MoETPCase)]
    assert len(smoke_moe) == 4 and len(standard_moe) == 36
    assert {(c.layer, c.fused_w13) for c in smoke_moe} == {("moe_w13", False), ("moe_w13", True), ("moe_w2", False)}
    assert {c.tp_size for c in smoke_moe if c.padding} == {2, 4}
    assert all("moe_tp" in c.features() for c in standard_moe)
    assert all(("padded_intermediate" in c.features()) == (c.padding > 0) for c in standard_moe)
    assert sum(c.padding > 0 for c in standard_moe) == 18 and all(c.shard % c.alignment for c in standard_moe if c.alignment > 1)
    assert {c.case_id for c in smoke_moe} <= {c.case_id for c in standard_moe}


def test_a_target_without_the_moe_wrapper_methods_does_not_support_moe_cases():
    facts = facts_of(ReferenceTarget)
    without = dataclasses.replace(facts, methods=tuple(m for m in facts.methods if m != "add_lora_w2"),
                                  why_not_implemented={"add_lora_w2": "no fused-MoE kernel on this device"})
    case = moe_case("moe_w2", 2, padded=False)
    reason = unsupported_reason(without, case)
    assert "does not implement add_lora_w2" in reason and "MoE LoRA layer calls add_lora_w13, add_lora_w2" in reason
    assert "no fused-MoE kernel on this device" in reason
    assert unsupported_reason(facts, case) is None
    linear = next(c for c in tp_cases("smoke") if not isinstance(c, MoETPCase))
    assert unsupported_reason(without, linear) is None  # the linear layers need no MoE method


def test_a_rank_writing_into_the_routing_weights_is_named():
    """The MoE methods are watched like the linear ones (conformance/tp/inputs.py): an ``add_lora_w2`` that
    rounds ``topk_weights`` to bfloat16 in place (a kernel casting its operand where it lies) is a modified
    input, even where the layer's output is right."""

    class RoundsWeightsInPlace(PunicaWrapperReference):
        def add_lora_w2(self, y, x, lora_a_stacked, lora_b_stacked, topk_ids, topk_weights, *args, **kwargs):
            super().add_lora_w2(y, x, lora_a_stacked, lora_b_stacked, topk_ids, topk_weights, *args, **kwargs)
            topk_weights.copy_(topk_weights.to(torch.bfloat16))

    case = moe_case("moe_w2", 2, padded=False)
    tensors = moe_tensors(case)
    watched = []

    def one_rank(rank, collectives):
        wrapper = RoundsWeightsInPlace()
        wrapper.update_metadata(case_mapping(case))
        watched.append(ReadOnlyInputs(wrapper))
        return moe_layer.moe_composition(case)(case, replace_weights(tensors), watched[-1], collectives, rank)

    run_in_threads(case.tp_size, one_rank)
    assert all(w.modified == ["add_lora_w2 modified its input 'topk_weights'"] for w in watched)


def replace_weights(tensors):
    """Each rank its own copy of the routing weights (as each rank process has)."""
    return dataclasses.replace(tensors, topk_weights=tensors.topk_weights.clone())
