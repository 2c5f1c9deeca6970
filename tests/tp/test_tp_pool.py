"""Real multi-process runs: one process per rank, gloo between them, the target loaded by name in each.

The targets that must pass do at TP 2 and 4; seeded faults (tests/tp/tp_fault_targets.py) are failed,
naming the rank; a rank that hangs or dies costs its case only (broken, timed out / crashed), and the
next case runs on a fresh pool. Each executor starts as few pools as it can (about a second each).
Ranks that share a device (``conformance.tp.placement``) run here too, on a target shaped like a GPU
whose backend refuses that (tests/tp/shared_device_targets.py).
"""

from __future__ import annotations

import pytest
from shared_device_targets import EXPECTED, VISIBLE

from conformance.report.clusters import cluster_failures
from conformance.targets.facts import probe
from conformance.tp.case import TPCase
from conformance.tp.moe_case import MoETPCase
from conformance.tp.run import TPExecutor
from conformance.verdict import FailureKind, Outcome


def case_of(layer: str, fully_sharded: bool, tp_size: int, dtype: str = "float32", seed: int = 5, kv_replicas: int = 1,
            index_kv_replicas: int = 1) -> TPCase:
    slices = {"column": (16,), "merged_column": (16, 32), "qkv": (32, 8, 8), "row": (16,), "qkv_indexer": (32, 8, 8, 16, 4, 4, 8)}[layer]
    return TPCase(layer, fully_sharded, tp_size, dtype, seq_lens=(2, 1, 3), seq_slots=(1, -1, 0), num_slots=2,
                  max_rank=8, hidden_size=16, output_slices=slices, scale=2.0, seed=seed, kv_replicas=kv_replicas,
                  index_kv_replicas=index_kv_replicas)


@pytest.fixture
def executor_of():
    made = []

    def make(target: str, case_timeout: float = 60, runs: int = 1, **where) -> TPExecutor:
        made.append(TPExecutor(target, probe(target), case_timeout=case_timeout, runs=runs, **where))
        return made[-1]

    yield make
    for executor in made:
        executor.close()


def test_hpu_emulated_passes_every_layer_at_tp_2_and_4(executor_of):
    executor = executor_of("hpu-emulated")
    for tp_size in (2, 4):
        for layer, kv_replicas in (("column", 1), ("merged_column", 1), ("qkv", 1), ("qkv", 2), ("row", 1)):
            for fully_sharded in (False, True):
                result = executor.run(case_of(layer, fully_sharded, tp_size, "bfloat16", kv_replicas=kv_replicas))
                assert result.outcome is Outcome.PASS, (result.case_id, result.message)
    assert executor.pool_starts == 2  # one pool per TP size, reused by its cases


def test_hpu_emulated_passes_the_seven_slice_qkv_indexer_layer_and_a_shrink_fault_fails_it(executor_of):
    executor = executor_of("hpu-emulated")
    for tp_size, kv_replicas, index_kv_replicas in ((2, 1, 2), (4, 2, 4)):
        result = executor.run(case_of("qkv_indexer", False, tp_size, "bfloat16", kv_replicas=kv_replicas, index_kv_replicas=index_kv_replicas))
        assert result.outcome is Outcome.PASS, (result.case_id, result.message)
    failed = executor_of("tp_fault_targets:Rank1DeltaTwoPercentHigh").run(case_of("qkv_indexer", False, 2, index_kv_replicas=2))
    assert failed.outcome is Outcome.FAIL and 1 in failed.failing_ranks, failed.message


def test_the_reference_passes_at_tp_2_and_4(executor_of):
    executor = executor_of("reference")
    for case in (case_of("qkv", True, 2, "float16"), case_of("row", True, 4)):
        result = executor.run(case)
        assert result.outcome is Outcome.PASS and result.message == "", result.message  # ranks on the CPU: said in the record only
        assert result.level.value == "layer" and result.to_json()["op"] == case.op
        assert result.to_json()["placement"] == {"label": f"{case.tp_size} ranks on the CPU, gloo collectives", "backend": "gloo",
                                                 "device_backend": "gloo", "variable": None, "devices": [None] * case.tp_size}


def test_ranks_are_handed_their_tensors_and_draw_nothing(executor_of):
    """The values are drawn in the referee's process only: a rank whose drawing raises still runs every layer."""
    executor = executor_of("tp_fault_targets:CannotDraw")
    for case in (case_of("column", False, 2), case_of("row", True, 2), moe_case("moe_w13", 2, True), moe_case("moe_w2", 2, False)):
        result = executor.run(case)
        assert result.outcome is Outcome.PASS, (result.case_id, result.message)


def test_repeated_calls_of_a_layer_are_compared_bit_for_bit(executor_of):
    result = executor_of("hpu-emulated", runs=2).run(case_of("qkv", True, 2))
    assert result.outcome is Outcome.PASS and result.stability == "deterministic", result.message
    assert result.determinism == {"calls": 2, "identical": True, "differing_elements": 0, "max_abs_difference": 0.0}
    assert executor_of("hpu-emulated").run(case_of("qkv", True, 2)).stability is None  # one call: nothing measured


def test_add_expand_ignoring_offset_start_fails_the_fully_sharded_row_layer_naming_rank_1(executor_of):
    executor = executor_of("tp_fault_targets:IgnoresOffsetStart")
    failed = executor.run(case_of("row", True, 2))
    assert failed.outcome is Outcome.FAIL and failed.kinds == (FailureKind.NUMERICS,)
    assert failed.failing_ranks == (0, 1) and "columns 8–15 (rank 1)" in failed.message
    assert -1 not in failed.failing_slots
    assert executor.run(case_of("row", False, 2)).outcome is Outcome.PASS  # add_lora_linear only: no offset


def test_a_shrink_that_runs_on_rank_0_only_fails_the_fully_sharded_column_layer(executor_of):
    result = executor_of("tp_fault_targets:ShrinksOnlyRankZero").run(case_of("merged_column", True, 2))
    assert result.outcome is Outcome.FAIL and FailureKind.NUMERICS in result.kinds


def test_a_delta_two_percent_high_on_one_rank_is_a_systematic_error_of_the_layer(executor_of):
    case = TPCase("column", False, 2, "bfloat16", seq_lens=(24, 8, 16), seq_slots=(1, -1, 0), num_slots=2,
                  max_rank=16, hidden_size=256, output_slices=(128,), scale=1.0, seed=3)
    result = executor_of("tp_fault_targets:Rank1DeltaTwoPercentHigh").run(case)
    # one rank's shard 2 % high also spreads the error beyond the layer's one multiple: coarse precision may join it
    assert result.outcome is Outcome.FAIL and FailureKind.SYSTEMATIC in result.kinds, result.message
    assert set(result.kinds) <= {FailureKind.SYSTEMATIC, FailureKind.PRECISION}, result.message
    assert result.measurement.budget_ratio < 1  # the elementwise budget alone lets it through
    assert "systematic error in the delta" in result.message


def test_a_rank_that_writes_into_an_input_fails_naming_rank_method_and_argument(executor_of):
    executor = executor_of("tp_fault_targets:Rank1ExpandClearsItsBuffer")
    result = executor.run(case_of("merged_column", True, 2))  # fully sharded: add_expand reads the gathered buffer
    assert result.outcome is Outcome.FAIL and result.kinds == (FailureKind.MODIFIED_INPUT,), result.message
    assert result.failing_ranks == (1,) and "rank 1: add_expand modified its input 'x'" in result.message
    assert executor.run(case_of("merged_column", False, 2)).outcome is Outcome.PASS  # add_lora_linear only: no add_expand


def test_a_hanging_rank_is_timed_out_and_the_next_case_runs_on_a_new_pool(executor_of, monkeypatch, tmp_path):
    monkeypatch.setenv("TP_TEST_MARKER", str(tmp_path / "hung"))
    executor = executor_of("tp_fault_targets:Rank1HangsOnce", case_timeout=3)
    hung = executor.run(case_of("column", False, 2))
    assert hung.outcome is Outcome.BROKEN and hung.kinds == (FailureKind.TIMED_OUT,)
    # under load the other rank may also miss the deadline (it waits in the collective for the hung one)
    assert "did not finish within 3 s" in hung.message and "rank 1 at " in hung.message and 1 in hung.failing_ranks
    assert "add_lora_linear" in hung.message and "rank(s) 0 waiting in a collective" in hung.message
    assert hung.failing_ranks == (1,)
    assert executor.run(case_of("column", False, 2, seed=6)).outcome is Outcome.PASS
    assert executor.pool_starts == 2


def test_a_dying_rank_is_recorded_crashed_and_the_next_case_runs(executor_of, monkeypatch, tmp_path):
    monkeypatch.setenv("TP_TEST_MARKER", str(tmp_path / "died"))
    executor = executor_of("tp_fault_targets:Rank1DiesOnce")
    died = executor.run(case_of("row", False, 2))
    assert died.outcome is Outcome.BROKEN and died.kinds == (FailureKind.CRASHED,)
    assert "rank 1 of 2 exited with status 3 while running this case" in died.message
    assert executor.run(case_of("row", False, 2, seed=6)).outcome is Outcome.PASS


def test_a_case_every_rank_raised_in_keeps_the_pool_and_one_rank_alone_ends_it(executor_of):
    """Every rank raised before any collective: each is back in its loop, so the next cases reuse the pool (a port
    whose sharded path raises in every case pays one pool start, not one per case). One rank raised while its peer
    waits in the all-gather for it: the pool cannot be trusted, and the next case starts a new one."""
    executor = executor_of("tp_fault_targets:EveryRankRaisesInLinear")
    for seed in (5, 6):
        raised = executor.run(case_of("column", False, 2, seed=seed))
        assert (raised.outcome, raised.kinds) == (Outcome.BROKEN, (FailureKind.RAISED,)), raised.message
        assert "raised while running this case: RuntimeError: no fused LoRA kernel on rank" in raised.message
    assert executor.run(case_of("column", True, 2)).outcome is Outcome.PASS  # add_shrink/add_expand: the same ranks
    assert executor.pool_starts == 1
    alone = executor_of("tp_fault_targets:Rank1RaisesInLinear")
    raised = alone.run(case_of("column", False, 2))
    assert (raised.outcome, raised.failing_ranks) == (Outcome.BROKEN, (1,)), raised.message
    assert alone.run(case_of("column", True, 2)).outcome is Outcome.PASS
    assert alone.pool_starts == 2


def test_a_target_without_add_expand_is_not_supported_without_starting_ranks(executor_of):
    executor = executor_of("tp_fault_targets:NoExpand")
    result = executor.run(case_of("column", True, 2))
    assert result.outcome is Outcome.NOT_SUPPORTED and "does not implement add_expand" in result.message
    assert executor.pool_starts == 0


# -- ranks that share a device (conformance.tp.placement) ------------------------------------------------

SHARED = "shared_device_targets:NcclShapedDevice"


def test_ranks_sharing_one_device_run_with_gloo_where_the_devices_backend_refuses(executor_of, monkeypatch):
    monkeypatch.setenv(VISIBLE, "0")  # one device visible, as on a one-GPU machine
    monkeypatch.setenv(EXPECTED, "0,0,0,0")
    executor = executor_of(SHARED)
    for case in (case_of("qkv", True, 2), case_of("row", False, 4), moe_case("moe_w2", 2, padded=True)):
        result = executor.run(case)
        label = f"{case.tp_size} ranks on 1 device, gloo collectives"
        assert result.outcome is Outcome.PASS and result.message == label, result.message
        assert result.placement == {"label": label, "backend": "gloo", "device_backend": "nccl", "variable": VISIBLE,
                                    "devices": ["0"] * case.tp_size}
    failed = executor_of(SHARED.replace("NcclShapedDevice", "ZeroesNoAdapterRowsOnOneDevice")).run(case_of("column", False, 2))
    assert failed.outcome is Outcome.FAIL and failed.message.endswith(" (2 ranks on 1 device, gloo collectives)"), failed.message


def test_four_ranks_on_two_devices_take_them_round_robin_and_devices_still_chooses(executor_of, monkeypatch):
    monkeypatch.setenv(VISIBLE, "0,1")
    monkeypatch.setenv(EXPECTED, "0,1,0,1")  # each rank checks it sees exactly its device
    result = executor_of(SHARED).run(case_of("merged_column", True, 4))
    assert result.outcome is Outcome.PASS and result.message == "4 ranks on 2 devices, gloo collectives", result.message
    monkeypatch.setenv(EXPECTED, "1,1")
    chosen = executor_of(SHARED, devices=["1"]).run(case_of("column", False, 2))
    assert chosen.outcome is Outcome.PASS and chosen.placement["devices"] == ["1", "1"], chosen.message
    with pytest.raises(ValueError, match=r"--devices names 7, which is not among the cpu devices here \(0, 1, as TP_TEST_VISIBLE"):
        executor_of(SHARED, devices=["0", "7"]).run(case_of("column", False, 2))


def test_ranks_on_devices_of_their_own_keep_the_devices_backend(executor_of, monkeypatch):
    """Two devices, two ranks: nccl, as vLLM runs them; this CPU build of torch has none, so the pool cannot start."""
    monkeypatch.setenv(VISIBLE, "0,1")
    monkeypatch.setenv(EXPECTED, "0,1")
    result = executor_of(SHARED).run(case_of("column", False, 2))
    assert result.outcome is Outcome.BROKEN and "the tensor-parallel pool could not start" in result.message
    assert result.placement["backend"] == "nccl" and result.placement["label"] == "2 ranks on 2 devices, nccl collectives"


def test_rows_without_an_adapter_zeroed_by_a_layer_are_recorded_zeroed(executor_of):
    result = executor_of("tp_fault_targets:ZeroesNoAdapterRows").run(case_of("column", False, 2))
    assert result.outcome is Outcome.FAIL and result.kinds == (FailureKind.OUTSIDE_REGION,), result.message
    assert result.failing_slots == (-1,) and result.message.startswith("zeroed "), result.message
    record = {**result.to_json(), "outcome": "fail"}
    assert record["outside_zeroed"] is True  # before: absent, and the cluster said the rows "are overwritten"
    [cluster] = cluster_failures([record])[0]
    assert cluster["title"] == "rows without adapter are zeroed"


# -- the MoE LoRA layer: add_lora_w13 / add_lora_w2 on every rank ----------------------------------------


def moe_case(layer: str, tp_size: int, padded: bool, fused: bool = False, dtype: str = "float32") -> MoETPCase:
    """Each rank holds 6 intermediate rows, allocated as 8 when padded (alignment 8)."""
    return MoETPCase(layer, tp_size, dtype, seq_lens=(2, 1, 3), seq_slots=(1, -1, 0), num_slots=2, max_rank=8, hidden_size=16,
                     intermediate_size=6 * tp_size, num_experts=4, top_k=2, alignment=8 if padded else 1, fused_w13=fused, seed=9)


def test_hpu_emulated_passes_the_moe_layer_at_tp_2_and_4_padded_or_not(executor_of):
    executor = executor_of("hpu-emulated")
    for tp_size in (2, 4):
        for layer, fused in (("moe_w13", False), ("moe_w13", True), ("moe_w2", False)):
            for padded in (False, True):
                result = executor.run(moe_case(layer, tp_size, padded, fused, "bfloat16"))
                assert result.outcome is Outcome.PASS, (result.case_id, result.message)
                assert "moe_tp" in result.features and ("padded_intermediate" in result.features) == padded
    assert executor.pool_starts == 2


def test_w13_slices_swapped_fail_naming_gate_and_up_of_every_rank(executor_of):
    result = executor_of("tp_fault_targets:SwapsW13Halves").run(moe_case("moe_w13", 2, padded=True))
    assert result.outcome is Outcome.FAIL and FailureKind.NUMERICS in result.kinds, result.message
    assert result.failing_ranks == (0, 1) and "(gate, rank 0)" in result.message and "(up, rank 1)" in result.message
    assert -1 not in result.failing_slots


def test_up_at_the_unpadded_offset_fails_only_where_the_intermediate_is_padded(executor_of):
    executor = executor_of("tp_fault_targets:PacksW13SlicesByLiveRows")
    assert executor.run(moe_case("moe_w13", 4, padded=False)).outcome is Outcome.PASS  # no zero rows: nothing moves
    result = executor.run(moe_case("moe_w13", 4, padded=True))
    assert result.outcome is Outcome.FAIL and FailureKind.OUTSIDE_REGION in result.kinds, result.message
    assert "(gate padding, rank 0)" in result.message and "(up, rank 3)" in result.message
    assert result.outside_zeroed is False  # up's delta written into the padding: not zeros
    assert result.failing_ranks == (0, 1, 2, 3)


def test_a_w2_delta_reduced_twice_fails_every_rank(executor_of):
    result = executor_of("tp_fault_targets:ReducesW2Itself").run(moe_case("moe_w2", 2, padded=True))
    assert result.outcome is Outcome.FAIL and FailureKind.NUMERICS in result.kinds, result.message
    assert result.failing_ranks == (0, 1) and "every rank adds a partial delta" in result.message
    assert -1 not in result.failing_slots


def test_a_target_without_moe_methods_is_not_supported_for_moe_only(executor_of):
    executor = executor_of("tp_fault_targets:NoMoE")
    result = executor.run(moe_case("moe_w13", 2, padded=False))
    assert result.outcome is Outcome.NOT_SUPPORTED and "does not implement add_lora_w13, add_lora_w2" in result.message
    assert executor.pool_starts == 0
    assert executor.run(case_of("column", False, 2)).outcome is Outcome.PASS
