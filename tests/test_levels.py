"""Every level is a kind of one case (``conformance.levels``); a level a package installs is one more
(``tests/test_custom_level.py`` runs ``examples/custom_level`` through the worker)."""

from __future__ import annotations

from conformance.levels import BUILT_IN_KINDS, KINDS, LAYER, MODEL, OP, SERVING, kind_of


def test_the_built_in_levels_own_their_cases_and_nothing_else():
    assert {kind.name for kind in BUILT_IN_KINDS} == {"op", "layer", "model", "serving"} and KINDS[:4] == BUILT_IN_KINDS
    for kind in BUILT_IN_KINDS:
        case_id, case = kind.cases("smoke", 0)[0]
        assert kind_of(case) is kind and case_id
        assert set(kind.marks(case)) <= set(kind.markers)
    assert kind_of(OP.cases("smoke", 0)[0][1]) is OP and kind_of(LAYER.cases("smoke", 0)[0][1]) is LAYER
    assert kind_of(MODEL.cases("smoke", 0)[0][1]) is MODEL and kind_of(SERVING.cases("smoke", 0)[0][1]) is SERVING
