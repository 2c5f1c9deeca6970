"""The ``cuda`` target's shipped known failures (``conformance/expectations/cuda.toml``) cover what they say.

vLLM's ``fused_moe_lora_fp8`` ignores the activation and weight scales it is given (read in the 0.32.0,
0.33.0 and 0.34.0 wheels' source, docs/hardware.md): its entry must match the cases whose scales are not 1
(every case of that op, which these tests check on the drawn values) in every released case list, match no
case of another op, and apply only to the vLLM releases that were read.
"""

from __future__ import annotations

import pytest

from conformance.caselists.caselist import load_caselist
from conformance.cases.case import Case
from conformance.cases.features import case_features
from conformance.cases.values import generator_for
from conformance.expectations import CENTRAL, load_expectations, shipped_expectations, split_applicable
from conformance.ops import OP_SPECS

ENTRY_ID = "vllm-cuda-fused-moe-lora-fp8-ignores-scales"
OP = "fused_moe_lora_fp8"


def shipped_entry():
    path = shipped_expectations("cuda")
    assert path is not None, "conformance/expectations/cuda.toml is missing"
    entries = load_expectations(path)  # the loader's own validation: fields, narrowing, approver of a central entry
    [entry] = [entry for entry in entries if entry.id == ENTRY_ID]
    return entry


def test_the_entry_is_central_approved_and_names_the_upstream_lines():
    entry = shipped_entry()
    assert entry.source == CENTRAL and entry.file == "conformance/expectations/cuda.toml" and entry.approver
    assert any(url.endswith("fused_moe_lora_fp8_op.py#L125-L337") and "/v0.33.0/" in url for url in entry.upstream)
    assert any(url.endswith("fused_moe_lora_fp8_op.py#L264") and "/v0.34.0/" in url for url in entry.upstream)


@pytest.mark.parametrize("name", ["smoke", "standard", "release"])
def test_it_matches_every_fused_moe_lora_fp8_case_of_a_released_list_and_nothing_else(name):
    entry = shipped_entry()
    matched, intended = set(), set()
    for listed in load_caselist(name).entries:
        if listed.level != "op":  # layer and model cases have no op of their own: the case query must not match them
            assert not entry.matches("", "", frozenset(), listed.case_id), listed.case_id
            continue
        case = Case.from_json(listed.case_json)
        if entry.matches(case.op, case.dtype, case_features(case), listed.case_id):
            matched.add(listed.case_id)
        if case.op == OP:
            intended.add(listed.case_id)
    assert intended, f"the {name} list holds no {OP} case"
    assert matched == intended


def test_every_case_it_matches_has_scales_other_than_1():
    """What "the cases whose scales are not 1" means here: every smoke case of the op, on its drawn values."""
    cases = [Case.from_json(e.case_json) for e in load_caselist("smoke").entries if e.level == "op" and e.case_json["op"] == OP]
    assert cases
    for case in cases:
        values = OP_SPECS[OP].make_values(case, generator_for(case))
        scales = {name: tensor for name, tensor in values.items() if "scale" in name}
        assert {"act_scale", "lora_a_scale.0", "lora_b_scale.0"} <= set(scales), sorted(values)
        for name, tensor in scales.items():
            assert not (tensor == 1).any(), f"{case.family}: {name} holds a scale of 1"


@pytest.mark.parametrize(
    "vllm, applies",
    [("0.31.0", False), ("0.32.0", True), ("0.33.0", True), ("0.34.0", True), ("0.34.1", True), ("0.35.0", False)],
)
def test_it_applies_to_the_vllm_releases_that_were_read(vllm, applies):
    applicable, not_applicable = split_applicable((shipped_entry(),), version_of={"vllm": vllm}.get)
    assert bool(applicable) == applies
    if not applies:
        assert f"installed: {vllm}" in not_applicable[0]["not_applicable"]
