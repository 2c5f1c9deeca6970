"""The knob registry is the one place a knob is described, and its readers agree with it.

Every feature a knob names exists; every knob an op reads is registered; a drawn case holds the
registry's defaults for every knob its op does not read; ``describe`` probes every knob.
"""

from __future__ import annotations

import dataclasses

import pytest

from conformance.cases import FEATURE_DOCS
from conformance.cases.knobs import KNOBS, Knob
from conformance.generator.profiles import profile_cases
from conformance.ops import OP_SPECS
from conformance.targets.describe import FEATURE_PROBES


def test_every_feature_a_knob_names_exists():
    unknown = {knob.name: [f for f in knob.features if f not in FEATURE_DOCS] for knob in KNOBS.values()}
    assert {name: features for name, features in unknown.items() if features} == {}


def test_every_knob_is_read_by_an_op_and_probed_by_describe():
    read = set().union(*(spec.knobs for spec in OP_SPECS.values()))
    assert set(KNOBS) == read
    assert {knob for _, knob, _ in FEATURE_PROBES} == set(KNOBS)


def test_a_case_holds_the_registrys_defaults_for_every_knob_its_op_does_not_read():
    wrong = set()
    for _, case in profile_cases("smoke"):
        spec = OP_SPECS[case.op]
        # a field another knob of the op sets (disabled_slots: routing and module_enabled) is that knob's
        set_by_read_knobs = {field for knob in spec.knobs for field in KNOBS[knob].fields}
        for knob in KNOBS.values():
            if knob.name in spec.knobs or (knob.name == "routed_weight" and spec.routed_weight is not None):
                continue
            wrong |= {
                (case.op, knob.name, field)
                for field, value in knob.defaults.items()
                if field not in set_by_read_knobs and getattr(case, field) != value
            }
    assert wrong == set()


def test_an_op_that_does_not_read_the_slice_widths_leaves_every_slice_1_wide():
    for _, case in profile_cases("smoke"):
        if "widths" not in OP_SPECS[case.op].knobs and "routing" not in OP_SPECS[case.op].knobs:
            assert set(case.output_slices) == {1}, case.op


def test_a_knob_is_refused_when_it_names_no_case_field_or_contradicts_case():
    with pytest.raises(ValueError, match="not Case fields"):
        Knob("nonsense", "a field Case does not have", ("no_such_field",), {"no_such_field": 0})
    with pytest.raises(ValueError, match="differs from Case's"):
        Knob("scale", "scale ≠ 1", ("scale",), {"scale": 2.0})
    with pytest.raises(ValueError, match="say what is left"):
        Knob("slices", "several slices", ("output_slices",))
    assert KNOBS["segments"].default("num_rows") == 0 and KNOBS["scale"].default() == 1.0


def test_an_op_reading_an_unregistered_knob_is_refused():
    with pytest.raises(ValueError, match="unknown knobs.*conformance.cases.knobs"):
        dataclasses.replace(OP_SPECS["bgmv_shrink"], knobs=OP_SPECS["bgmv_shrink"].knobs | {"no_such_knob"})
