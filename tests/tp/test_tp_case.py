"""The tensor-parallel case as data: JSON round trip, errors naming the bad field, the profiles' case lists."""

from __future__ import annotations

import json

import pytest

from conformance.tp.case import FULLY_SHARDED_LAYERS, LAYERS, TPCase
from conformance.tp.cases import tp_cases


def a_case(**changes) -> TPCase:
    fields = dict(layer="qkv", fully_sharded=True, tp_size=4, dtype="bfloat16", seq_lens=(3, 1), seq_slots=(-1, 2),
                  num_slots=3, max_rank=8, hidden_size=32, output_slices=(32, 8, 8), scale=0.5, is_prefill=True, seed=7)
    return TPCase(**{**fields, **changes})


def test_json_round_trip_of_every_standard_case():
    for case in tp_cases("standard"):
        assert type(case).from_json(json.loads(json.dumps(case.to_json()))) == case


@pytest.mark.parametrize(
    ("field", "value", "words"),
    [
        ("tp_size", "4", "field 'tp_size' must be int"),
        ("seq_lens", [3, "1"], "field 'seq_lens' must be a list of integers"),
        ("fully_sharded", 1, "field 'fully_sharded' must be bool"),
        ("layer", "embedding", "layer 'embedding' is not one of"),
        ("op", "tp_row_parallel", "field 'op' is 'tp_row_parallel', but the case's other fields make it 'tp_qkv_parallel'"),
        ("colour", "red", "unknown tensor-parallel case field(s) ['colour']"),
    ],
)
def test_a_malformed_field_is_named(field, value, words):
    data = {**a_case().to_json(), field: value}
    with pytest.raises(ValueError) as error:
        TPCase.from_json(data)
    assert words in str(error.value)


def test_a_missing_field_is_named():
    data = a_case().to_json()
    del data["hidden_size"]
    with pytest.raises(ValueError, match=r"missing field\(s\) \['hidden_size'\]"):
        TPCase.from_json(data)


@pytest.mark.parametrize(
    ("changes", "words"),
    [
        ({"output_slices": (32, 6, 6)}, "output_slices[1] = 6 must be a positive multiple of tp_size 4"),
        ({"max_rank": 6}, "max_rank = 6 must be a positive multiple of tp_size 4"),
        ({"output_slices": (32, 8, 16)}, "k and v have the same width"),
        ({"layer": "row", "output_slices": (32,), "hidden_size": 30}, "hidden_size = 30 must be a positive multiple"),
        ({"seq_slots": (-1, 3)}, "must lie in [-1, num_slots)"),
        ({"tp_size": 1}, "tp_size must be an integer >= 2"),
        ({"kv_replicas": 2, "output_slices": (32, 3, 3)}, "output_slices[1] = 3 must be a positive multiple of tp_size / kv_replicas = 2"),
        ({"kv_replicas": 3}, "only a QKV layer replicates kv heads, over a tp_size (4) it divides"),
        ({"kv_replicas": 2, "layer": "column", "output_slices": (32,)}, "only a QKV layer replicates kv heads"),
    ],
)
def test_a_case_vllm_could_not_shard_is_refused(changes, words):
    with pytest.raises(ValueError) as error:
        a_case(**changes)
    assert words in str(error.value)


def test_profiles_cover_every_layer_sharding_and_tp_size_deterministically():
    smoke, standard = tp_cases("smoke"), tp_cases("standard")
    for cases in (smoke, standard):
        layers = {(c.layer, c.fully_sharded, c.tp_size) for c in cases if isinstance(c, TPCase)}
        assert layers == {(la, fs, tp) for la in LAYERS for fs in (False, True) for tp in (2, 4) if la in FULLY_SHARDED_LAYERS or not fs}
        assert len({c.case_id for c in cases}) == len(cases)
    assert len(smoke) == 20 + 2 + 4 and len(standard) == 120 + 12 + 36  # linear, the 7-slice QKV + indexer, MoE
    indexer = [c for c in standard if isinstance(c, TPCase) and c.layer == "qkv_indexer"]
    assert {(c.tp_size, c.kv_replicas, c.index_kv_replicas) for c in indexer} == {(2, 1, 2), (4, 2, 4)}
    assert all({"many_slices", "kv_replicated"} <= c.features() and c.num_slices == 7 for c in indexer)
    replicated = {(c.tp_size, c.fully_sharded) for c in smoke if c.layer == "qkv" and c.kv_replicas == 2}
    assert replicated == {(tp, fs) for tp in (2, 4) for fs in (False, True)}
    assert {c.dtype for c in standard} == {"float16", "bfloat16", "float32"}
    assert {c.case_id for c in smoke} <= {c.case_id for c in standard}  # a smoke failure's repro runs without --profile
    assert tp_cases("standard") == standard and tp_cases("standard", seed=1) != standard
    assert all({"neg1", "last_slot"} <= c.features() for c in smoke)
    assert any(c.layer == "qkv" and c.output_slices[0] != c.output_slices[1] for c in smoke)
    assert all(c.kv_replicas == 1 or c.layer in ("qkv", "qkv_indexer") for c in standard if isinstance(c, TPCase))
