"""One place per op: an op is its spec (``OpSpec``) and its reference function; the targets that
implement it are the only other place. Everything else derives from the registry.

A genuinely new op is defined here, in this module and nowhere else: ``bgmv_add_bias``, a per-token
LoRA bias written into a column window. For every row ``t`` whose slot is not −1::

    out[t, offset : offset + N] = out[t, offset : offset + N] + bias[slot(t)]   (add_inputs=True)
    out[t, offset : offset + N] = bias[slot(t)]                                 (add_inputs=False)

with ``bias`` the ``[L, N]`` stack of the slots' bias rows; rows of slot −1 and every column outside
the window stay as they were. Its values, its call, its written region and its reference are its own
(this module's functions); the spec is registered with ``conformance.ops.register`` and nothing else
changes. The op lists, the ``reference`` target, ``describe``, the generator and the runner must all
see it; a target that does not define it must report its cases "not supported"; and it must leave no
trace once unregistered.
"""

from __future__ import annotations

import dataclasses

import pytest
import torch

from conformance.cases.case import Case
from conformance.cases.values import activations, bias_stack
from conformance.ops import OP_NAMES, OP_SPECS, Level, OpCall, OpSpec, ops_at, register, unregister
from conformance.ops.spec import Tensors, rows_and_columns
from conformance.runner import run_case
from conformance.targets.base import Target
from conformance.targets.describe import describe_class, probe_case
from conformance.targets.hpu.targets import HpuEmulatedTarget
from conformance.targets.reference import ReferenceTarget
from conformance.verdict import FailureKind, Outcome

NEW_OP = "bgmv_add_bias"

# -- the new op: its reference, values, call and written region -----------------------------------


def bgmv_add_bias(bias_stacked, out, lora_indices_tensor, slice_offset, add_inputs=True):
    """The golden reference: each adapter row's bias added to (or, ``add_inputs=False``, written over) the
    window ``out[:, slice_offset : slice_offset + N]``; the sum taken in float32 (float64 for the oracle)
    and rounded once to the output dtype."""
    width = bias_stacked.size(-1)
    rows = torch.nonzero(lora_indices_tensor != -1).flatten()
    if rows.numel() == 0:
        return
    compute = torch.promote_types(out.dtype, torch.float32)
    bias = bias_stacked[lora_indices_tensor[rows]].to(compute)
    window = out[rows, slice_offset : slice_offset + width]
    written = window.to(compute) + bias if add_inputs else bias
    out[rows, slice_offset : slice_offset + width] = written.to(out.dtype)


def add_bias_values(case: Case, gen: torch.Generator) -> Tensors:
    """The ``[L, N]`` bias stack and the ``[T, W]`` output, both in the case dtype, from the case seed."""
    return {
        "bias": bias_stack(gen, case, case.output_slices[0]),
        "out": activations(gen, case, (case.num_tokens, case.output_width), case.torch_dtype),
    }


def add_bias_call(case: Case, tensors: Tensors, device: torch.device) -> OpCall:
    token_slots = torch.tensor(case.token_slots, dtype=torch.long, device=device)
    return OpCall((tensors["bias"], tensors["out"], token_slots, case.offset_start, case.add_inputs), {})


def add_bias_written(case: Case) -> torch.Tensor:
    """Adapter rows × the window's columns."""
    first = case.offset_start
    return rows_and_columns(case.token_slots, case.output_width, first, first + case.output_slices[0])


ADD_BIAS = OpSpec(
    name=NEW_OP,
    level=Level.KERNEL,
    summary="per-token LoRA bias added to (or written over) a column window (a test's op)",
    knobs=frozenset({"add_inputs", "offset", "wide"}),
    make_values=add_bias_values,
    make_call=add_bias_call,
    written_mask=add_bias_written,
    reference=bgmv_add_bias,
)


@pytest.fixture
def new_op():
    register(ADD_BIAS)
    yield ADD_BIAS
    unregister(NEW_OP)


# -- a vendor's implementation, written without the reference, and two seeded bugs ---------------


class AddBiasVendor(Target):
    """Defines the new op and nothing else, mask-based: every row reads a bias row, a row mask keeps the
    adapter rows' results (the way Gaudi-style code avoids data-dependent indexing)."""

    name = "add-bias-vendor"

    def slots_read(self, lora_indices: torch.Tensor, num_slots: int) -> torch.Tensor:
        """The slot whose bias each row reads (a −1 row reads slot 0; the mask drops it)."""
        return lora_indices.clamp(min=0)

    def rows_written(self, lora_indices: torch.Tensor) -> torch.Tensor:
        return lora_indices != -1

    def bgmv_add_bias(self, bias_stacked, out, lora_indices_tensor, slice_offset, add_inputs=True):
        width = bias_stacked.size(-1)
        window = out[:, slice_offset : slice_offset + width]
        bias = bias_stacked[self.slots_read(lora_indices_tensor, bias_stacked.size(0))].float()
        result = (window.float() + bias if add_inputs else bias).to(out.dtype)
        window.copy_(torch.where(self.rows_written(lora_indices_tensor)[:, None], result, window))


class NoAdapterRowsGetTheLastSlot(AddBiasVendor):
    """``bias[lora_indices]`` with no mask: a −1 row gets the last slot's bias (vllm#48421's bug class)."""

    def slots_read(self, lora_indices, num_slots):
        return lora_indices

    def rows_written(self, lora_indices):
        return torch.ones_like(lora_indices, dtype=torch.bool)


class ReadsTheNextSlot(AddBiasVendor):
    """Every adapter row reads the next slot's bias (an off-by-one in the stack offset)."""

    def slots_read(self, lora_indices, num_slots):
        return (lora_indices.clamp(min=0) + 1) % num_slots


# -- the registry, the reference target and describe -----------------------------------------------


def test_a_registered_op_is_listed_served_by_the_reference_target_and_described(new_op):
    assert NEW_OP in ops_at(Level.KERNEL) and NEW_OP not in ops_at(Level.WRAPPER)
    assert NEW_OP in ReferenceTarget().implemented_ops()
    assert NEW_OP not in HpuEmulatedTarget().implemented_ops()
    reference = describe_class(ReferenceTarget, "reference")
    hpu = describe_class(HpuEmulatedTarget, "hpu-emulated")
    for dtype in ("float16", "bfloat16", "float32"):
        assert reference.status(NEW_OP, dtype).supported
        assert reference.status(NEW_OP, dtype).status == "implemented"  # no feature refused either
        assert not hpu.status(NEW_OP, dtype).supported
        assert hpu.status(NEW_OP, dtype).status == f"not supported: hpu-emulated does not define {NEW_OP}"


# -- the generator -----------------------------------------------------------------------------------


def test_the_generator_draws_it_in_every_family_that_applies(new_op):
    from conformance.generator import cases, draw_examples, families_for
    from conformance.generator.limits import SMOKE_LIMITS

    applicable = {family.name for family in families_for(new_op, "bfloat16")}
    # the families of the knobs it reads, and none of those it does not (slices, bias, segments, MoE …)
    assert {"random", "neg1", "allneg1", "offset", "wide_output", "no_add_inputs"} <= applicable
    assert not applicable & {"slices", "bias", "scaled", "decode", "seg_gaps", "moe_hot_expert"}

    def drawn(family: str) -> list[Case]:
        return draw_examples(cases(new_op, "bfloat16", family, SMOKE_LIMITS), 5, 7)

    for family, shows in {
        "neg1": lambda c: -1 in c.token_slots and any(s != -1 for s in c.token_slots),
        "offset": lambda c: c.offset_start > 0 and c.output_width > c.offset_start + c.output_slices[0],
        "no_add_inputs": lambda c: not c.add_inputs,
        "random": lambda c: c.scale == 1.0 and not c.bias,  # knobs it does not read stay at their defaults
    }.items():
        family_cases = drawn(family)
        assert len(family_cases) == 5 and all(c.op == NEW_OP and c.family == family and shows(c) for c in family_cases)
        for case in family_cases:  # its own values, call and region serve every drawn case
            assert run_case(AddBiasVendor(), case).outcome is Outcome.PASS


# -- the runner ----------------------------------------------------------------------------------------


def test_the_runner_judges_it_against_its_reference(new_op):
    case = probe_case(NEW_OP, "bfloat16")  # two rows of slot 0, one of slot −1, two slots
    assert run_case(ReferenceTarget(), case).outcome is Outcome.PASS
    assert run_case(AddBiasVendor(), case).outcome is Outcome.PASS
    overwrite = dataclasses.replace(case, add_inputs=False, offset_start=4, output_slices=(8,))
    assert run_case(AddBiasVendor(), overwrite).outcome is Outcome.PASS

    minus_one = run_case(NoAdapterRowsGetTheLastSlot(), case)
    assert minus_one.outcome is Outcome.FAIL and minus_one.kinds == (FailureKind.OUTSIDE_REGION,), minus_one.message
    assert "slot -1" in minus_one.message
    wrong_slot = run_case(ReadsTheNextSlot(), case)
    assert wrong_slot.outcome is Outcome.FAIL and wrong_slot.kind is FailureKind.NUMERICS, wrong_slot.message
    assert wrong_slot.failing_slots == (0,)


def test_a_target_without_it_reports_its_cases_not_supported(new_op):
    result = run_case(HpuEmulatedTarget(), probe_case(NEW_OP, "float32"))
    assert result.outcome is Outcome.NOT_SUPPORTED and NEW_OP in result.message


def test_unregistering_leaves_no_trace(new_op):
    unregister(NEW_OP)
    try:
        assert NEW_OP not in OP_SPECS and NEW_OP not in ops_at(Level.KERNEL)
        assert NEW_OP not in ReferenceTarget().implemented_ops() and NEW_OP not in AddBiasVendor().implemented_ops()
        assert not [s for s in describe_class(ReferenceTarget, "reference").statuses if s.op == NEW_OP]
        assert tuple(OP_SPECS) == OP_NAMES
    finally:
        register(new_op)  # for the fixture's own unregister


# -- what the registry refuses, and families -----------------------------------------------------------


def test_a_spec_without_a_reference_function_is_refused():
    with pytest.raises(ValueError, match="reference must be a function"):
        dataclasses.replace(OP_SPECS["bgmv_shrink"], name="no_reference", reference=None)
    with pytest.raises(ValueError, match="already registered"):
        register(OP_SPECS["bgmv_shrink"])
    assert tuple(OP_SPECS) == OP_NAMES  # the registry is left as it was


def test_a_family_is_one_class_and_the_strategy_asks_it_at_every_step():
    from hypothesis import strategies as st

    from conformance.generator import FAMILIES, cases, draw_examples
    from conformance.generator.families import Family
    from conformance.generator.limits import SMOKE_LIMITS

    class ThreeSlotsFirstUnused(Family):
        name, doc, feature = "three_slots_first_unused", "a test's family: three slots, slot 0 never used", None

        def num_slots(self, draw, limits):
            return 3

        def steer_slots(self, draw, slots, num_slots):
            return [draw(st.integers(1, 2)) if s == 0 else s for s in slots]

    FAMILIES[ThreeSlotsFirstUnused.name] = ThreeSlotsFirstUnused()
    try:
        drawn = draw_examples(cases(OP_SPECS["add_lora_linear"], "float32", ThreeSlotsFirstUnused.name, SMOKE_LIMITS), 20, 1)
    finally:
        del FAMILIES[ThreeSlotsFirstUnused.name]
    assert len(drawn) == 20
    assert all(c.num_slots == 3 and 0 not in c.seq_slots and c.family == ThreeSlotsFirstUnused.name for c in drawn)
    assert any(c.bias is False for c in drawn) and not any(c.scale != 1.0 for c in drawn)  # the defaults: features off
