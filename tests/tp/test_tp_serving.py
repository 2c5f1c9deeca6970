"""Tensor-parallel layers served step after step: every rank a target instance on persistent shard buffers.

``hpu-emulated`` serves every smoke case through the CPU graph emulation (pieces captured between the
collectives); the reference, which captures nothing, serves them eagerly and says so. Seeded faults on one
rank, each invisible to the same batch called fresh: a rank whose metadata is not persistent (``stale state``,
naming the rank), a rank writing one row past its rows (``stale state``), a rank clearing an activation
row (``modified input``); a rank that raises mid-sequence is ``broken``, naming it. The ranks draw nothing: a
target whose process cannot draw serves as well.
"""

from __future__ import annotations

import dataclasses

import pytest

from conformance.levels import SERVING
from conformance.targets.facts import probe
from conformance.tp.run import TPExecutor
from conformance.tp.serving_case import TPServingCase
from conformance.tp.serving_cases import tp_serving_cases
from conformance.tp.serving_run import serve_on_ranks
from conformance.verdict import FailureKind, Outcome

SMOKE = tp_serving_cases("smoke", 0)


@pytest.fixture
def serve():
    made: dict[str, TPExecutor] = {}

    def run(target: str, case: TPServingCase):
        if target not in made:
            made[target] = TPExecutor(target, probe(target), case_timeout=120)
        return serve_on_ranks(made[target], case)

    yield run
    for executor in made.values():
        executor.close()


def cases_of(family: str | None = None, layer: str | None = None, tp_size: int | None = None, fully_sharded: bool | None = None):
    return [case for case in SMOKE if family in (None, case.family) and layer in (None, case.layer.layer)
            and tp_size in (None, case.tp_size) and fully_sharded in (None, case.layer.fully_sharded)]


def test_the_smoke_profile_serves_every_family_at_both_sizes_and_every_layer_kind():
    assert len(SMOKE) == 16 and len({case.case_id for case in SMOKE}) == 16
    assert {(case.family, case.tp_size) for case in SMOKE} == {(f, t) for f in {c.family for c in SMOKE} for t in (2, 4)}
    kinds = {(case.layer.layer, case.layer.fully_sharded, case.layer.kv_replicas) for case in SMOKE}
    assert len(kinds) == 10
    assert [case.tp_size for case in SMOKE] == sorted(case.tp_size for case in SMOKE)  # one pool start per size
    assert all(SERVING.owns(case) and case.case_id.startswith("serving:") for case in SMOKE)
    assert all(SERVING.case_from_json(case.to_json()) == case for case in SMOKE)


def test_a_case_with_an_adapter_above_the_max_rank_is_refused_naming_it():
    case = SMOKE[0]
    with pytest.raises(ValueError, match=r"adapter ranks .* must lie in \[1, "):
        dataclasses.replace(case, adapter_ranks=(case.layer.max_rank + 1,) * len(case.adapter_ranks))


@pytest.mark.integration  # starts rank pools of 2 and 4 processes
def test_hpu_emulated_serves_every_smoke_case_in_captured_pieces(serve):
    results = [serve("hpu-emulated", case) for case in SMOKE]
    failed = [f"{r.case_id}: {r.message}" for r in results if r.outcome is not Outcome.PASS]
    assert not failed, failed
    for result in results:
        pieces = 2 if result.case.layer.fully_sharded else 1
        assert "piece(s) captured with HpuEmulatedTarget.capture" in result.message, result.message
        assert ("2 per graph" if pieces > 1 else "one per graph") in result.message
        assert result.level == "serving" and result.placement is not None


@pytest.mark.integration
def test_a_target_that_captures_nothing_serves_eagerly_and_says_so(serve):
    result = serve("reference", cases_of("stale_tail", tp_size=2)[0])
    assert result.outcome is Outcome.PASS, result.message
    assert "reference captures nothing (capture returned None)" in result.message


@pytest.mark.integration
def test_ranks_draw_nothing_when_serving(serve):
    result = serve("tp_fault_targets:CannotDraw", cases_of("evict_reload")[0])
    assert result.outcome is Outcome.PASS, result.message


@pytest.mark.integration
def test_a_rank_whose_metadata_is_not_persistent_fails_stale_state_naming_it(serve):
    results = [serve("tp_fault_targets:Rank1ForgetsItServes", case) for case in cases_of(tp_size=2)]
    failed = [r for r in results if r.outcome is not Outcome.PASS]
    assert failed, "a stale rank passed every case"
    for result in failed:
        assert result.outcome is Outcome.FAIL and result.kinds == (FailureKind.STALE_STATE,), result.message
        assert "the same batch called fresh passes" in result.message
        assert 1 in result.failing_ranks, result.failing_ranks
    # where each rank computes its own columns, only rank 1's are wrong; a fully sharded layer gathers rank 1's stale
    # shrink into every rank's expand
    own_columns = [r for r in failed if r.case.layer.layer != "row" and not r.case.layer.fully_sharded]
    assert own_columns and all(r.failing_ranks == (1,) for r in own_columns), [r.failing_ranks for r in own_columns]


@pytest.mark.integration
def test_a_rank_that_writes_one_row_past_its_rows_fails_stale_state(serve):
    result = serve("tp_fault_targets:Rank1WritesOneRowPast", cases_of("stale_tail", "column", 2, False)[0])
    assert result.outcome is Outcome.FAIL and result.kinds == (FailureKind.STALE_STATE,), result.message
    assert "rank 1 wrote row(s)" in result.message and "past the" in result.message
    assert result.failing_ranks == (1,)


@pytest.mark.integration
def test_a_rank_that_clears_an_activation_row_fails_modified_input_naming_it(serve):
    result = serve("tp_fault_targets:Rank1ClearsItsLastActivationRow", cases_of("stale_tail", "column", 2, False)[0])
    assert result.outcome is Outcome.FAIL and result.kinds == (FailureKind.MODIFIED_INPUT,), result.message
    assert "rank 1 modified its persistent input(s) ['x']" in result.message
    assert result.failing_ranks == (1,)


@pytest.mark.integration
def test_a_rank_that_raises_mid_sequence_is_broken_naming_it_and_the_next_case_runs(serve):
    first, second = cases_of(tp_size=2, fully_sharded=False)[:2]  # add_lora_linear on every rank
    result = serve("tp_fault_targets:Rank1RaisesInLinear", first)
    assert result.outcome is Outcome.BROKEN and result.kinds == (FailureKind.RAISED,), result.message
    assert result.failing_ranks == (1,) and "rank 1 of 2 raised" in result.message and result.traceback
    assert serve("tp_fault_targets:Rank1RaisesInLinear", second).outcome is Outcome.BROKEN  # a new pool, the same fault
