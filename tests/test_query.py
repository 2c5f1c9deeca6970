"""Case ids and queries (``conformance.query``): one grammar for naming, selecting, waiving and replaying."""

from __future__ import annotations

import re

import pytest

from conformance.expectations import _entry
from conformance.levels import BUILT_IN_KINDS
from conformance.query import QueryError, case_id, file_name, parse_id, parse_query
from conformance.session import ConformanceRun, RunError, RunSettings
from conformance.targets.facts import facts_of
from conformance.targets.reference import ReferenceTarget

BGMV = "op:bgmv_shrink:dtype=bf16;slices=1;rank=32;family=random"
MOE = "op:fused_moe_lora:dtype=fp16;slices=1;rank=4;experts=6;top_k=2;family=random;draw=2"


def test_an_id_is_its_parameters_in_order_and_parses_back():
    made = case_id("op", "bgmv_shrink", {"dtype": "bf16", "slices": 1, "rank": 32, "experts": None, "family": "random"})
    assert made == BGMV
    parsed = parse_id(made)
    assert (parsed.level, parsed.name, parsed.param("rank"), parsed.param("experts")) == ("op", "bgmv_shrink", "32", None)
    assert str(parsed) == made
    assert case_id("layer", "qkv", {"tp": 4, "fully_sharded": True}) == "layer:qkv:tp=4;fully_sharded=1"


@pytest.mark.parametrize(("text", "says"), [
    ("bgmv_shrink-bf16-slices1-r32-random", "1 part(s)"),
    ("op:bgmv_shrink", "2 part(s)"),
    ("op:Bgmv:dtype=bf16", "lower-case"),
    ("op:bgmv_shrink:dtype", "not key=value"),
    ("op:bgmv_shrink:dtype=bf16;dtype=fp16", "gives the parameter 'dtype' twice"),
    ("op:bgmv_shrink:dtype=b f16", "not key=value"),
    ("op:bgmv_shrink:", "no parameters"),
])  # fmt: skip
def test_a_malformed_id_is_refused_naming_what_is_wrong(text, says):
    with pytest.raises(QueryError, match=re.escape(says)) as raised:
        parse_id(text)
    assert "level:name:key=value" in str(raised.value) or "keep one" in str(raised.value)


def test_ids_refuse_values_the_grammar_reserves():
    with pytest.raises(QueryError, match="rank='1;2'"):
        case_id("op", "x", {"rank": "1;2"})
    with pytest.raises(QueryError, match="no parameter"):
        case_id("op", "x", {"rank": None})


@pytest.mark.parametrize(("query", "selected"), [
    ("op", {BGMV, MOE}),
    ("op:*", {BGMV, MOE}),
    ("op:fused_*", {MOE}),
    ("op:*:dtype=bf16;*", {BGMV}),
    ("op:*:rank=?;*", {MOE}),
    ("*:*:family=random;*", {BGMV, MOE}),
    (BGMV, {BGMV}),
    ("op:bgmv_shrink:dtype=bf16;slices=1;rank=32", set()),  # not open-ended: the family is missing
    ("op:fused_moe_lora:dtype=fp16;slices=1;rank=4;experts=6;top_k=2;family=random", set()),  # a later draw is another case
    ("layer", set()),
])  # fmt: skip
def test_a_query_selects_by_level_name_and_parameters(query, selected):
    parsed = parse_query(query)
    assert {case for case in (BGMV, MOE) if parsed.matches(case)} == selected


@pytest.mark.parametrize(("text", "says"), [("", "empty"), ("op:a:b:c", "4 part(s)"), ("op:Lora", "may hold"), ("op:x:rank", "not key=value")])
def test_a_malformed_query_is_refused(text, says):
    with pytest.raises(QueryError, match=re.escape(says)):
        parse_query(text)


def test_a_file_name_needs_no_quoting():
    assert file_name(BGMV) == "op_bgmv_shrink_dtype=bf16,slices=1,rank=32,family=random"
    assert not set(file_name(MOE)) & set(":;*?\"<>|\\/ ")


@pytest.mark.parametrize("profile", ["smoke", "standard"])
def test_every_built_in_case_id_follows_the_grammar_names_its_level_and_is_unique(profile):
    for kind in BUILT_IN_KINDS:
        ids = [case_id for case_id, _ in kind.cases(profile, 0)]
        assert len(ids) == len(set(ids)), kind.name
        for text, case in kind.cases(profile, 0):
            parsed = parse_id(text)
            assert parsed.level == kind.name and parsed.param("family", case.family) == case.family, text
            if kind.name == "op":
                assert (parsed.name, int(parsed.param("rank")), int(parsed.param("slices"))) == (case.op, case.max_rank, case.num_slices)


def test_an_expectation_narrowed_by_case_queries_matches_only_those_cases():
    raw = {"id": "x", "reason": "r", "upstream": ["u"], "expires": "2099-01-01", "cases": ["op:bgmv_*:dtype=bf16;*"]}
    entry = _entry(raw, "here")
    assert entry.matches("bgmv_shrink", "bfloat16", frozenset(), BGMV)
    assert not entry.matches("fused_moe_lora", "float16", frozenset(), MOE)
    assert not entry.matches("bgmv_shrink", "bfloat16", frozenset(), None)
    with pytest.raises(ValueError, match="would turn every failure"):
        _entry({**raw, "cases": ["op:*"]}, "here")
    with pytest.raises(ValueError, match=r"field .cases.*4 part"):
        _entry({**raw, "cases": ["op:bgmv_shrink:dtype=bf16:rank=2"]}, "here")
    with pytest.raises(ValueError, match="must be a list"):
        _entry({**raw, "cases": "op:bgmv_shrink:*"}, "here")


def test_cases_selects_the_runs_cases_and_a_query_selecting_none_is_an_error(tmp_path):
    facts = facts_of(ReferenceTarget)
    run = ConformanceRun(RunSettings(target="reference", profile="smoke", report_dir=str(tmp_path), cases=["op:lora_shrink:dtype=bf16;*", "layer:row:*"]), facts=facts)
    ids = list(run.cases_by_id())
    assert ids and all(i.startswith("op:lora_shrink:dtype=bf16;") or i.startswith("layer:row:") for i in ids)
    assert any(i.startswith("layer:row:") for i in ids)
    shard = ConformanceRun(RunSettings(target="reference", profile="smoke", report_dir=str(tmp_path), cases=["op:lora_shrink:dtype=bf16;*"], shard="0/2"), facts=facts)
    assert len(shard.cases_by_id()) == (len(ids) - sum(i.startswith("layer:") for i in ids) + 1) // 2  # --shard splits the selection
    nothing = ConformanceRun(RunSettings(target="reference", profile="smoke", report_dir=str(tmp_path), cases=["op:no_such_op", "layer"]), facts=facts)
    with pytest.raises(RunError, match="'op:no_such_op' selects no case of the smoke profile"):
        nothing.entries()
    with pytest.raises(RunError, match="--cases: case query 'op:x:rank'"):
        ConformanceRun(RunSettings(target="reference", profile="smoke", report_dir=str(tmp_path), cases=["op:x:rank"]), facts=facts)
