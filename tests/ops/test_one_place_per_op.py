"""An op is one spec and one reference function: everything else derives from the registry.

A dummy op (a shrink whose scale is doubled) is registered with nothing but its ``OpSpec`` and its
reference function; the op lists, the reference target, ``describe``, the runner and a target that
does not define it must all see it, and it must leave no trace once unregistered.
"""

from __future__ import annotations

import dataclasses

import pytest

from conformance import reference
from conformance.ops import OP_NAMES, OP_SPECS, Level, ops_at, register, unregister
from conformance.runner import run_case
from conformance.targets.describe import describe_class, probe_case
from conformance.targets.hpu.targets import HpuEmulatedTarget
from conformance.targets.reference import ReferenceTarget
from conformance.verdict import Outcome

DUMMY = "bgmv_shrink_doubled"


def bgmv_shrink_doubled(x, lora_a, out, indices, scale):
    """The dummy op's reference: bgmv_shrink with twice the scale."""
    reference.bgmv_shrink(x, lora_a, out, indices, 2.0 * scale)


@pytest.fixture
def dummy_op():
    shrink = OP_SPECS["bgmv_shrink"]
    spec = dataclasses.replace(shrink, name=DUMMY, summary="bgmv_shrink with twice the scale (a test's op)", reference=bgmv_shrink_doubled)
    register(spec)
    yield spec
    unregister(DUMMY)


def test_a_registered_op_is_seen_by_the_op_lists_the_reference_target_and_describe(dummy_op):
    assert DUMMY in ops_at(Level.KERNEL)
    assert DUMMY in ReferenceTarget().implemented_ops()
    assert DUMMY not in HpuEmulatedTarget().implemented_ops()
    statuses = {(s.op, s.dtype): s for s in describe_class(ReferenceTarget, "reference").statuses}
    assert statuses[DUMMY, "float32"].supported and statuses[DUMMY, "float32"].status == "implemented"
    hpu = {(s.op, s.dtype): s for s in describe_class(HpuEmulatedTarget, "hpu-emulated").statuses}
    assert not hpu[DUMMY, "float32"].supported


def test_the_runner_judges_it_against_its_reference(dummy_op):
    case = dataclasses.replace(probe_case(DUMMY, "float32"), scale=0.5)
    assert run_case(ReferenceTarget(), case).outcome is Outcome.PASS
    assert run_case(HpuEmulatedTarget(), case).outcome is Outcome.NOT_SUPPORTED

    class PlainShrink(ReferenceTarget):  # the plain shrink under the dummy's name: half the delta
        bgmv_shrink_doubled = staticmethod(reference.bgmv_shrink)

    result = run_case(PlainShrink(), case)
    assert result.outcome is Outcome.FAIL and result.kind.value == "numerics"


def test_unregistering_leaves_no_trace(dummy_op):
    unregister(DUMMY)
    assert DUMMY not in OP_SPECS and DUMMY not in ops_at(Level.KERNEL) and DUMMY not in ReferenceTarget().implemented_ops()
    register(dummy_op)  # for the fixture's own unregister


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
