"""A failure's family (dense or MoE LoRA) is read from its case's own fields, never from its op's name."""

from __future__ import annotations

from conformance.e2e.cases import e2e_cases
from conformance.report.clusters import DENSE, MOE, family


def test_an_end_to_end_case_says_whether_its_model_is_moe_and_an_op_case_by_its_experts():
    cases = e2e_cases("standard")
    moe = next(c for c in cases if c.is_moe)
    dense = next(c for c in cases if not c.is_moe)
    assert family({"level": "model", "op": "renamed", "case": moe.to_json()}) == MOE
    assert family({"level": "model", "op": "moe_renamed", "case": dense.to_json()}) == DENSE
    assert family({"level": "wrapper", "case": {"num_experts": 8}}) == MOE and family({"level": "kernel", "case": {}}) == DENSE
