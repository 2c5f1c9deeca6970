"""An op's output kind and its compositions are data on its spec, checked when it is made and registered."""

from __future__ import annotations

import dataclasses

import pytest

from conformance.ops import COMPOSITIONS, OP_SPECS, OUTPUT_KINDS, Level, register


def replaced(op: str, **fields):
    return dataclasses.replace(OP_SPECS[op], **fields)


def test_every_output_kind_is_used_and_each_op_has_one():
    assert {spec.output_kind for spec in OP_SPECS.values()} == set(OUTPUT_KINDS)
    assert [op for op, spec in OP_SPECS.items() if spec.output_kind == "index"] == ["moe_lora_align_block_size"]


def test_an_unknown_output_kind_or_an_index_output_without_invariants_is_refused():
    with pytest.raises(ValueError, match="output_kind must be one of"):
        replaced("bgmv_expand", output_kind="overwrite")
    with pytest.raises(ValueError, match="judge it by its invariants"):
        replaced("bgmv_expand", output_kind="index")


def test_every_kernel_backed_wrapper_op_has_every_composition():
    for spec in OP_SPECS.values():
        if spec.level == Level.WRAPPER and not spec.composed_of:
            assert set(spec.compositions) == set(COMPOSITIONS) == {"lora", "classic", "bgmv", "sgmv"}, spec.name
    assert OP_SPECS["add_lora_linear"].composed_of == ("add_shrink", "add_expand")


def test_a_composition_of_the_wrong_shape_is_refused_when_the_spec_is_made():
    with pytest.raises(ValueError, match="only a wrapper op"):
        replaced("bgmv_shrink", compositions={"lora": ("lora_shrink",)})
    with pytest.raises(ValueError, match="unknown compositions"):
        replaced("add_shrink", compositions={"gpu": ("lora_shrink",)})
    with pytest.raises(ValueError, match="names no kernel op"):
        replaced("add_shrink", compositions={"lora": ()})
    with pytest.raises(ValueError, match="not both"):
        replaced("add_shrink", composed_of=("add_expand",))


def test_a_composition_of_unregistered_ops_is_refused_when_registered():
    with pytest.raises(ValueError, match=r"calls \['no_such_kernel'\], which are not registered kernel ops"):
        register(replaced("add_shrink", name="test_shrink", compositions={"lora": ("no_such_kernel",)}))
    with pytest.raises(ValueError, match=r"calls \['add_expand'\]"):  # a wrapper op is no kernel
        register(replaced("add_shrink", name="test_shrink", compositions={"lora": ("add_expand",)}))
    with pytest.raises(ValueError, match="not registered wrapper ops"):
        register(replaced("add_lora_linear", name="test_linear", composed_of=("add_shrink", "lora_expand")))
    assert "test_shrink" not in OP_SPECS and "test_linear" not in OP_SPECS
