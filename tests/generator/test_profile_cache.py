"""The disk cache of drawn profiles keys on what the drawing reads, and on nothing else.

What the drawing reads: the source of the strategy, family, limit, profile and drawing modules and of the
case (``cache.DRAWING_SOURCES``), and, per op drawn, the fields of its spec that are not callables. So
editing an op's values, call, written region or reference (its callables, which the drawing never calls)
keeps every cached profile, while a knob, a slice count or a strategy change draws anew.
"""

from __future__ import annotations

import dataclasses
import shutil

import pytest

from conformance.generator import FAMILIES, cache, profiles
from conformance.generator.profiles import PROFILES, profile_cases, profile_key
from conformance.ops import OP_SPECS, OpCall, register, unregister

SMOKE = PROFILES["smoke"]
SUBSET = {"ops": ("bgmv_shrink", "lora_expand"), "dtypes": ("float32",)}


def key(ops=SUBSET["ops"], dtypes=SUBSET["dtypes"]) -> dict:
    return profile_key(SMOKE, 0, ops, dtypes)


def replaced(monkeypatch, op: str, **changes) -> None:
    """The registered spec of ``op`` with ``changes``, for this test only."""
    monkeypatch.setitem(OP_SPECS, op, dataclasses.replace(OP_SPECS[op], **changes))


def another_call(case, tensors, device) -> OpCall:
    return OpCall((), {})


# -- the spec's part of the key ----------------------------------------------------------------------


@pytest.mark.parametrize("field", ["make_values", "make_call", "written_mask", "reference"])
def test_editing_a_callable_of_a_spec_keeps_the_key(monkeypatch, field):
    before = key()
    replaced(monkeypatch, "lora_expand", **{field: another_call})
    assert key() == before


@pytest.mark.parametrize(
    "changes",
    [
        pytest.param(lambda spec: {"knobs": spec.knobs - {"offset"}}, id="knobs"),
        pytest.param(lambda spec: {"max_slices": 3}, id="max_slices"),
        pytest.param(lambda spec: {"rows": "sampled"}, id="rows"),
        pytest.param(lambda spec: {"routed_weight": True}, id="routed_weight"),
        pytest.param(lambda spec: {"check": lambda case, after, values: []}, id="check-now-present"),  # families ask for one
    ],
)
def test_changing_what_the_drawing_reads_of_a_spec_changes_the_key(monkeypatch, changes):
    before = key()
    replaced(monkeypatch, "lora_expand", **changes(OP_SPECS["lora_expand"]))
    assert key() != before


def test_a_field_added_to_the_spec_counts_without_a_change_to_the_cache():
    @dataclasses.dataclass(frozen=True)
    class SpecWithANewField(type(OP_SPECS["bgmv_shrink"])):
        new_field: int = 0

    spec = OP_SPECS["bgmv_shrink"]
    fields = {f.name: getattr(spec, f.name) for f in dataclasses.fields(spec)}
    one, two = SpecWithANewField(**fields, new_field=1), SpecWithANewField(**fields, new_field=2)
    assert cache.drawn_spec_fields(one)["new_field"] == 1
    assert cache.drawn_spec_fields(one) != cache.drawn_spec_fields(two)


def test_the_ops_drawn_and_the_families_are_in_the_key(monkeypatch):
    everything, subset = profile_key(SMOKE, 0, None, None), key()
    register(dataclasses.replace(OP_SPECS["bgmv_shrink"], name="registered_for_the_key"))
    try:
        assert profile_key(SMOKE, 0, None, None) != everything  # every registered op is drawn
        assert key() == subset  # not drawn with the filter
    finally:
        unregister("registered_for_the_key")
    monkeypatch.setitem(FAMILIES, "a_tests_family", FAMILIES["neg1"])
    assert key() != subset


# -- the source part of the key -------------------------------------------------------------------------


def test_the_source_digest_reads_the_drawing_modules_and_not_the_ops(monkeypatch, tmp_path):
    package = cache._PACKAGE
    for entry in (*cache.DRAWING_SOURCES, "ops/kernel.py"):
        if (package / entry).is_file():
            (tmp_path / entry).parent.mkdir(parents=True, exist_ok=True)
            shutil.copy(package / entry, tmp_path / entry)
    monkeypatch.setattr(cache, "_PACKAGE", tmp_path)
    digest = cache._source_digest()
    assert digest == cache._SOURCE_DIGEST  # the same files as the package's own

    with (tmp_path / "ops/kernel.py").open("a") as kernel:  # an op's values, calls, written regions
        kernel.write("\n# an edited op\n")
    assert cache._source_digest() == digest
    with (tmp_path / "generator/strategies.py").open("a") as strategies:
        strategies.write("\n# an edited strategy\n")
    assert cache._source_digest() != digest


# -- end to end: the files of the cache -----------------------------------------------------------------


def test_the_cache_serves_a_profile_until_what_the_drawing_reads_changes(monkeypatch, tmp_path):
    monkeypatch.setenv("LORA_CONFORMANCE_CACHE", str(tmp_path))
    draws = []
    draw = profiles._draw_profile

    def counted(*args):
        draws.append(args)
        return draw(*args)

    monkeypatch.setattr(profiles, "_draw_profile", counted)
    first = profile_cases("smoke", **SUBSET)
    assert len(draws) == 1 and len(list(tmp_path.iterdir())) == 1

    replaced(monkeypatch, "bgmv_shrink", make_call=another_call)  # an edited reference call: served
    assert profile_cases("smoke", **SUBSET) == first and len(draws) == 1

    replaced(monkeypatch, "bgmv_shrink", knobs=OP_SPECS["bgmv_shrink"].knobs - {"scale"})  # drawn anew
    redrawn = profile_cases("smoke", **SUBSET)
    assert len(draws) == 2 and len(list(tmp_path.iterdir())) == 2
    assert not any(case.scale != 1.0 for _, case in redrawn if case.op == "bgmv_shrink")

    monkeypatch.setattr(cache, "_SOURCE_DIGEST", "a changed strategy")  # drawn anew
    profile_cases("smoke", **SUBSET)
    assert len(draws) == 3 and len(list(tmp_path.iterdir())) == 3
