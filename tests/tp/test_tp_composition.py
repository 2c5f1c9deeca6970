"""Each layer's composition (what the ranks compute, and the collectives between them) is the unsharded layer.

In float64, every rank a thread (``conformance.tp.collectives.run_in_threads``), the composition of
every layer kind and sharding at TP 2 and 4 must equal the golden reference's unsharded
``add_lora_linear`` to rounding; and compositions that are wrong in the ways a port gets them wrong
must be failed by the judgement, naming the ranks.
"""

from __future__ import annotations

import pytest
import torch

from conformance.ops import case_mapping
from conformance.reference.punica_wrapper import PunicaWrapperReference
from conformance.tp import composition, values
from conformance.tp.case import FULLY_SHARDED_LAYERS, TPCase
from conformance.tp.collectives import run_in_threads
from conformance.tp.judgement import baseline_output, judge_output, oracle_output
from conformance.tp.values import layer_tensors, lora_b_rows, rank_columns, replica_sources


def case_of(layer: str, fully_sharded: bool, tp_size: int, dtype: str = "float32", kv_replicas: int = 1, index_kv_replicas: int = 1) -> TPCase:
    slices = {"column": (32,), "merged_column": (16, 48), "qkv": (64, 16, 16), "row": (48,), "qkv_indexer": (32, 8, 8, 16, 4, 4, 8)}[layer]
    return TPCase(layer, fully_sharded, tp_size, dtype, seq_lens=(3, 2, 1, 4), seq_slots=(0, -1, 2, 1), num_slots=3,
                  max_rank=8, hidden_size=32, output_slices=slices, scale=0.5, seed=11, kv_replicas=kv_replicas,
                  index_kv_replicas=index_kv_replicas)


LAYER_KINDS = [(layer, 1) for layer in FULLY_SHARDED_LAYERS] + [("qkv", 2)]


@pytest.mark.parametrize("tp_size", [2, 4])
@pytest.mark.parametrize("fully_sharded", [False, True])
@pytest.mark.parametrize(("layer", "kv_replicas"), LAYER_KINDS)
def test_the_composition_in_float64_is_the_unsharded_layer(layer, kv_replicas, fully_sharded, tp_size):
    _assert_composition_is_the_unsharded_layer(case_of(layer, fully_sharded, tp_size, kv_replicas=kv_replicas))


def _assert_composition_is_the_unsharded_layer(case: TPCase) -> None:
    tensors = layer_tensors(case).to(torch.float64)
    composed = baseline_output(case, tensors)  # the tensors' dtype: float64 here
    assert composed.dtype == torch.float64 and composed.size(0) == case.replica_groups  # one output per replica group
    rows_without_adapter = torch.tensor(case.token_slots) == -1
    for replica in composed:
        torch.testing.assert_close(replica, oracle_output(case, tensors), rtol=0, atol=1e-12)
        assert torch.equal(replica[rows_without_adapter], tensors.y[rows_without_adapter])  # bit for bit


@pytest.mark.parametrize(("tp_size", "kv_replicas", "index_kv_replicas"), [(2, 1, 1), (2, 1, 2), (4, 2, 4), (4, 4, 2), (4, 1, 2)])
def test_the_seven_slice_qkv_indexer_composition_in_float64_is_the_unsharded_layer(tp_size, kv_replicas, index_kv_replicas):
    _assert_composition_is_the_unsharded_layer(case_of("qkv_indexer", False, tp_size, kv_replicas=kv_replicas,
                                                       index_kv_replicas=index_kv_replicas))


def test_the_qkv_indexer_slices_follow_step5s_offsets():
    """TP 4, two ranks per kv head, one indexer k head on every rank (vLLM 0.33 ``Step5FusedQKVIndexerWithLoRA.slice_lora_b``):
    q and gate by rank, k, v and index_q by ``rank // kv_replicas``, index_k and index_z whole on every rank."""
    case = case_of("qkv_indexer", False, 4, kv_replicas=2, index_kv_replicas=4)
    assert case.slice_shards == (4, 2, 2, 2, 1, 1, 4) and case.replica_groups == 4
    q, k, v, index_q, index_k, index_z, gate = 0, 32, 40, 48, 64, 68, 72  # where each slice starts
    assert rank_columns(case, 3) == [(q + 24, q + 32), (k + 4, k + 8), (v + 4, v + 8), (index_q + 8, index_q + 16),
                                     (index_k, index_k + 4), (index_z, index_z + 4), (gate + 6, gate + 8)]
    with pytest.raises(ValueError, match="no fully sharded form"):
        case_of("qkv_indexer", True, 2)
    with pytest.raises(ValueError, match="index_kv_replicas 2: only a QKV \\+ indexer layer replicates indexer heads"):
        case_of("qkv", False, 4, index_kv_replicas=2)
    with pytest.raises(ValueError, match=r"output_slices\[4\] = 3 must be a positive multiple of tp_size / index_kv_replicas = 2"):
        TPCase("qkv_indexer", False, 4, "float32", seq_lens=(1,), seq_slots=(0,), num_slots=1, max_rank=8, hidden_size=16,
               output_slices=(32, 8, 8, 16, 3, 3, 8), index_kv_replicas=2)


def test_a_replicated_indexer_head_taken_by_rank_modulo_shards_fails_naming_the_ranks(monkeypatch):
    """The classic kv_shard_id slip, ``rank % shards`` for ``rank // replicas``: at TP 4 with two ranks per head,
    ranks 1 and 2 load the other head's LoRA-B rows of k, v, index_q, index_k and index_z."""
    case = case_of("qkv_indexer", False, 4, kv_replicas=2, index_kv_replicas=2)

    def modulo_rows(stacks, case, rank):
        return tuple(stack[:, :, (rank % shards) * (width // shards) : (rank % shards + 1) * (width // shards), :].contiguous()
                     for stack, width, shards in zip(stacks, case.output_slices, case.slice_shards))

    monkeypatch.setattr(values, "lora_b_rows", modulo_rows)  # what rank_shard cuts each rank's LoRA-B with
    assert lora_b_rows is not modulo_rows
    verdict, message, slots, ranks, _, _ = judge_output(case, _composed_with(case, lambda inner: inner))
    assert not verdict.passed and ranks == (1, 2), message
    assert "slice 4 (index_k), rank 1" in message and "slice 3 (index_q), rank 2" in message


def test_kv_heads_shared_by_two_ranks_are_cut_by_kv_shard_id():
    """TP 4, two ranks per kv head (vLLM: ``kv_shard_id = rank // num_kv_head_replicas``): ranks 0 and 1
    hold k and v columns 0–7 of each, ranks 2 and 3 columns 8–15; q is cut by rank."""
    case = case_of("qkv", False, 4, kv_replicas=2)
    assert case.slice_shards == (4, 2, 2)
    assert [rank_columns(case, rank) for rank in range(4)] == [
        [(0, 16), (64, 72), (80, 88)], [(16, 32), (64, 72), (80, 88)],
        [(32, 48), (72, 80), (88, 96)], [(48, 64), (72, 80), (88, 96)],
    ]
    assert replica_sources(case, 0) == "k, v from ranks 0, 2" and replica_sources(case, 1) == "k, v from ranks 1, 3"


def test_each_replica_of_a_shared_kv_head_is_judged_and_a_wrong_copy_names_its_rank():
    case = case_of("qkv", True, 4, kv_replicas=2)
    tensors = layer_tensors(case)
    composed = baseline_output(case, tensors)
    assert judge_output(case, composed, tensors)[0].passed
    wrong = composed.clone()
    wrong[1, :, 64:72] = wrong[1, :, 72:80]  # rank 1 used kv head 1's LoRA-B for k (sliced by rank, not kv_shard_id)
    verdict, message, slots, ranks, _, _ = judge_output(case, wrong, tensors)
    assert not verdict.passed and ranks == (1,)
    assert "replica group 1 (k, v from ranks 1, 3)" in message and "slice 1, rank 1" in message
    assert "replica group 0" not in message


def _composed_with(case: TPCase, collectives_class) -> torch.Tensor:
    tensors = layer_tensors(case)

    def one_rank(rank, collectives):
        reference = PunicaWrapperReference()
        reference.update_metadata(case_mapping(case))
        return composition.run_rank(case, tensors, reference, collectives_class(collectives), rank, torch.device("cpu"))

    return run_in_threads(case.tp_size, one_rank)[0]


class SkipsTheBufferReduce:
    """Fully sharded row layer without the all-reduce of the shrink buffers: each rank expands its partial shrink."""

    def __init__(self, inner) -> None:
        self.inner, self.reduces = inner, 0

    def all_gather(self, tensor, dim=-1):
        return self.inner.all_gather(tensor, dim)

    def all_reduce(self, tensor):
        self.reduces += 1
        return tensor if self.reduces == 1 else self.inner.all_reduce(tensor)


def test_a_composition_that_skips_the_shrink_all_reduce_fails_on_adapter_rows():
    case = case_of("row", True, 2)
    verdict, message, slots, ranks, kinds, _ = judge_output(case, _composed_with(case, SkipsTheBufferReduce))
    assert not verdict.passed and [k.value for k in kinds] == ["numerics"]
    assert -1 not in slots and set(slots) == {0, 1, 2}
    assert ranks == (0, 1) and "columns 0–23 (rank 0); columns 24–47 (rank 1)" in message


def test_a_gather_that_concatenates_merged_slices_rank_by_rank_fails_naming_slice_and_rank(monkeypatch):
    """The all-gathered merged output used as it comes ([r0: gate₀ up₀ | r1: gate₁ up₁]), not put back per slice."""
    case = case_of("merged_column", False, 2)

    def concatenated(case, local, collectives, initial):
        return collectives.all_gather(local, dim=-1)[None]

    monkeypatch.setattr(composition, "gathered_columns", concatenated)
    verdict, message, slots, ranks, _, _ = judge_output(case, _composed_with(case, lambda inner: inner))
    assert not verdict.passed
    assert "slice 1, rank 0" in message and "slice 0, rank 1" in message  # the misplaced shards
    assert -1 in slots  # rows without adapter come back with another rank's base columns


def test_the_baseline_sums_partials_in_the_case_dtype():
    """bfloat16 row layer at TP 4: the baseline's partial sums round in bfloat16, so it differs from the
    float64 oracle by more than one unsharded bfloat16 call would (what a correct target may do)."""
    case = case_of("row", False, 4, "bfloat16")
    tensors = layer_tensors(case)
    baseline, oracle = baseline_output(case, tensors), oracle_output(case, tensors)
    assert baseline.dtype == torch.bfloat16
    assert 0 < (baseline.double() - oracle).abs().max() < 0.1
    assert judge_output(case, baseline, tensors)[0].passed
