"""Units of the harness that the command-line tests only reach indirectly."""

from __future__ import annotations

import datetime as dt

import pytest
import torch

from conformance.cases.replay import read_replay, write_replay
from conformance.expectations import (
    KnownFailure,
    apply_expectations,
    installed_version,
    load_expectations,
    shipped_expectations,
    split_applicable,
)
from conformance.gate import gate_verdict
from conformance.generator import cache as profile_cache
from conformance.generator import profile_cases
from conformance.runner import CaseResult, check_values, make_values
from conformance.verdict import FailureKind, Outcome, judge

TODAY = dt.date(2026, 11, 30)


@pytest.fixture(scope="module")
def smoke():
    return profile_cases("smoke")


def _result(case, outcome, failing_slots=(), features=frozenset({"neg1"}), kinds=None):
    if kinds is None:
        kinds = {Outcome.FAIL: (FailureKind.NUMERICS,), Outcome.BROKEN: (FailureKind.RAISED,)}.get(outcome, ())
    return CaseResult(case.case_id, case, outcome, "m", features=features, failing_slots=failing_slots, kinds=kinds)


def _entry(**fields) -> KnownFailure:
    base = dict(id="e", reason="r", upstream=("u",), expires=dt.date(2027, 1, 1), features_any=frozenset({"neg1"}))
    return KnownFailure(**{**base, **fields})


class TestExpectations:
    def test_a_matching_failure_becomes_known(self, smoke):
        case = smoke[0][1]
        result = apply_expectations(_result(case, Outcome.FAIL, (-1,)), (_entry(failing_rows="no-adapter"),), TODAY)
        assert result.outcome is Outcome.KNOWN_FAILURE and result.expectation["id"] == "e"

    def test_a_failure_outside_the_symptom_stays_a_failure(self, smoke):
        case = smoke[0][1]
        result = apply_expectations(_result(case, Outcome.FAIL, (-1, 2)), (_entry(failing_rows="no-adapter"),), TODAY)
        assert result.outcome is Outcome.FAIL and "not covered by known failure e" in result.message

    def test_a_matching_pass_is_unexpected(self, smoke):
        case = smoke[0][1]
        assert apply_expectations(_result(case, Outcome.PASS), (_entry(),), TODAY).outcome is Outcome.UNEXPECTED_PASS

    def test_an_expired_entry_no_longer_applies(self, smoke):
        case = smoke[0][1]
        entry = _entry(expires=dt.date(2026, 1, 1))
        result = apply_expectations(_result(case, Outcome.FAIL, (-1,)), (entry,), TODAY)
        assert result.outcome is Outcome.FAIL and "expired on 2026-01-01" in result.message

    def test_features_must_all_hold(self, smoke):
        case = smoke[0][1]
        entry = _entry(features_all=frozenset({"neg1", "decode"}))
        assert apply_expectations(_result(case, Outcome.FAIL, (-1,)), (entry,), TODAY).outcome is Outcome.FAIL

    def test_an_entry_covers_only_the_failure_kinds_it_lists(self, smoke):
        case = smoke[0][1]
        numerics_only = _entry(kinds=frozenset({FailureKind.NUMERICS}))
        nan = _result(case, Outcome.FAIL, (-1,), kinds=(FailureKind.NAN_INF,))
        result = apply_expectations(nan, (numerics_only,), TODAY)
        assert result.outcome is Outcome.FAIL and "failure kinds numerics is not what failed" in result.message
        assert apply_expectations(_result(case, Outcome.FAIL, (-1,)), (numerics_only,), TODAY).outcome is Outcome.KNOWN_FAILURE

    def test_a_broken_case_is_known_only_when_its_kind_is_listed(self, smoke):
        case = smoke[0][1]
        crashed = _result(case, Outcome.BROKEN, kinds=(FailureKind.CRASHED,))
        assert apply_expectations(crashed, (_entry(),), TODAY).outcome is Outcome.BROKEN  # default: fail kinds only
        known_crash = _entry(kinds=frozenset({FailureKind.CRASHED}))
        assert apply_expectations(crashed, (known_crash,), TODAY).outcome is Outcome.KNOWN_FAILURE

    def test_a_version_range_applies_the_entry_only_to_the_versions_it_names(self, tmp_path):
        path = tmp_path / "e.toml"
        path.write_text(
            '[[known_failure]]\nid = "old-vllm"\nreason = "r"\nupstream = ["u"]\nexpires = 2027-01-01\n'
            'ops = ["bgmv_*"]\nversions = { vllm = "<0.33" }\n'
            '[[known_failure]]\nid = "always"\nreason = "r"\nupstream = ["u"]\nexpires = 2027-01-01\nops = ["bgmv_*"]\n'
        )
        entries = load_expectations(path)
        applicable, not_applicable = split_applicable(entries, version_of={"vllm": "0.32.0"}.get)
        assert [e.id for e in applicable] == ["old-vllm", "always"] and not_applicable == []
        applicable, not_applicable = split_applicable(entries, version_of={"vllm": "0.33.0"}.get)
        assert [e.id for e in applicable] == ["always"]
        assert [(e["id"], e["not_applicable"]) for e in not_applicable] == [("old-vllm", "needs vllm <0.33; installed: 0.33.0")]
        _, not_applicable = split_applicable(entries, version_of={}.get)
        assert not_applicable[0]["not_applicable"] == "needs vllm <0.33, which is not installed"

    def test_the_shipped_cpu_slot_minus_one_entries_stop_applying_on_a_fixed_vllm(self):
        entries = load_expectations(shipped_expectations("cpu"))
        assert len(split_applicable(entries, version_of={"vllm": "0.32.0"}.get)[0]) == len(entries)
        # vLLM 0.33's torch ops skip slot -1; its CPU wrapper's add_inputs clash and sgmv's ignored
        # b_seq_start_loc are still there (read in the 0.33.0 wheel), so those two entries still apply
        still = [e.id for e in split_applicable(entries, version_of={"vllm": "0.33.0"}.get)[0]]
        assert still == ["vllm-cpu-add-lora-linear-add-inputs", "vllm-cpu-sgmv-ignores-seq-start-loc"]

    def test_an_import_name_resolves_to_its_distribution(self):
        assert installed_version("vllm") == installed_version("vllm-cpu") is not None
        assert installed_version("no-such-package-anywhere") is None

    def test_the_shipped_cpu_file_parses_and_cites_upstream(self):
        entries = load_expectations(shipped_expectations("cpu"))
        # every entry cites where upstream tracks or shows it (a pull request or the source it reads)
        assert entries and all(any("github.com/vllm-project/vllm/" in u for u in e.upstream) for e in entries)

    @pytest.mark.parametrize(
        ("text", "named"),
        [
            ('[[known_failure]]\nid = "x"\nreason = "r"\nupstream = ["u"]\n', "'expires'"),
            ('[[known_failure]]\nid = "x"\nreason = "r"\nupstream = []\nexpires = 2027-01-01\n', "'upstream'"),
            ('[[known_failure]]\nid = "x"\nreason = "r"\nupstream = ["u"]\nexpires = 2027-01-01\nfeatures_any = ["nope"]\n', "'features_any'"),
            ('[[known_failure]]\nid = "x"\nreason = "r"\nupstream = ["u"]\nexpires = 2027-01-01\ncolour = 1\n', "colour"),
            ("[entry]\n", "unknown top-level"),
            ('[[known_failure]]\nid = "x"\nreason = "r"\nupstream = ["u"]\nexpires = 2027-01-01\nkinds = ["segfault"]\n', "'kinds'"),
            ('[[known_failure]]\nid = "x"\nreason = "r"\nupstream = ["u"]\nexpires = 2027-01-01\nversions = { vllm = "newest" }\n', "'versions'"),
            ('[[known_failure]]\nid = "x"\nreason = "r"\nupstream = ["u"]\nexpires = 2027-01-01\nversions = "<0.33"\n', "'versions'"),
        ],
    )
    def test_malformed_files_name_the_field(self, tmp_path, text, named):
        path = tmp_path / "e.toml"
        path.write_text(text)
        with pytest.raises(ValueError, match=named):
            load_expectations(path)


class TestReplay:
    def test_round_trip_keeps_structure_and_values(self, tmp_path, smoke):
        case_id, case = smoke[5]
        values = make_values(case)
        path = write_replay(tmp_path, case_id, case, values, target="reference")
        read_id, read_case, read_values, document = read_replay(path)
        assert (read_id, read_case, document["target"]) == (case_id, case, "reference")
        assert values.keys() == read_values.keys()
        assert all(torch.equal(values[k], read_values[k]) for k in values)
        check_values(read_case, read_values)

    def test_an_moe_case_round_trips_with_its_routing(self, tmp_path, smoke):
        case_id, case = next((i, c) for i, c in smoke if c.is_moe and c.expert_map and c.op == "fused_moe_lora")
        values = make_values(case)
        read_id, read_case, read_values, _ = read_replay(write_replay(tmp_path, case_id, case, values, target="reference"))
        assert read_case == case and isinstance(read_case.topk_ids[0], tuple)  # nested tuples, not lists
        assert all(torch.equal(values[k], read_values[k]) and values[k].dtype == read_values[k].dtype for k in values)
        check_values(read_case, read_values)

    def test_values_that_do_not_fit_the_case_are_named(self, smoke):
        case = smoke[5][1]
        values = make_values(case)
        values["x"] = values["x"][:, :1]
        with pytest.raises(ValueError, match="tensor 'x'"):
            check_values(case, values)

    def test_an_unknown_case_field_is_named(self, tmp_path, smoke):
        case_id, case = smoke[5]
        path = write_replay(tmp_path, case_id, case, make_values(case))
        path.write_text(path.read_text().replace('"seed"', '"sead"'))
        with pytest.raises(ValueError, match="sead"):
            read_replay(path)


class TestJudge:
    def _tensors(self):
        oracle = torch.linspace(-1, 1, 12, dtype=torch.float64).reshape(3, 4)
        initial = torch.zeros(3, 4, dtype=torch.bfloat16)
        written = torch.tensor([True, False, True])[:, None].expand(3, 4).clone()
        actual = torch.where(written, oracle, 0.0).to(torch.bfloat16)
        return actual, oracle, actual.clone(), initial, written

    def test_the_baseline_itself_passes(self):
        assert judge(*self._tensors()).passed

    def test_a_write_outside_the_region_is_named_by_row(self):
        actual, oracle, baseline, initial, written = self._tensors()
        actual[1, 2] = 1.0
        verdict = judge(actual, oracle, baseline, initial, written)
        assert not verdict.passed and verdict.problems[0].rows == (1,)

    def test_a_negative_zero_outside_the_region_is_recorded_not_failed(self):
        # equal values, other bits (docs/verdict.md); tests/verdict/test_bit_differences.py holds the rule
        actual, oracle, baseline, initial, written = self._tensors()
        actual[1, 0] = -0.0
        verdict = judge(actual, oracle, baseline, initial, written)
        assert verdict.passed and verdict.measurement.bit_differences[0].signed_zeros == 1

    def test_nan_where_the_oracle_is_finite_fails(self):
        actual, oracle, baseline, initial, written = self._tensors()
        actual[2, 3] = float("nan")
        verdict = judge(actual, oracle, baseline, initial, written)
        assert [p.rows for p in verdict.problems] == [(2,)]

    def test_error_beyond_the_budget_fails(self):
        actual, oracle, baseline, initial, written = self._tensors()
        actual[0, 0] += 0.1
        verdict = judge(actual, oracle, baseline, initial, written)
        assert not verdict.passed and verdict.measurement.budget_ratio > 1
        assert [p.kind for p in verdict.problems] == [FailureKind.NUMERICS]

    def test_an_untouched_output_is_wrote_nothing_not_a_rounding_error(self):
        actual, oracle, baseline, initial, written = self._tensors()
        verdict = judge(initial.clone(), oracle, baseline, initial, written)
        [problem] = verdict.problems
        assert problem.kind is FailureKind.WROTE_NOTHING and "in place" in problem.text

    def test_each_problem_has_its_kind(self):
        actual, oracle, baseline, initial, written = self._tensors()
        actual[1, 2] = 1.0
        actual[2, 3] = float("nan")
        kinds = [p.kind for p in judge(actual, oracle, baseline, initial, written).problems]
        assert kinds == [FailureKind.OUTSIDE_REGION, FailureKind.NAN_INF]
        wrong_shape = judge(actual[:2], oracle, baseline, initial, written)
        assert [p.kind for p in wrong_shape.problems] == [FailureKind.WRONG_OUTPUT_TYPE]


class TestGate:
    def test_no_case_ran(self):
        gate = gate_verdict([{"outcome": "not supported", "op": "a", "dtype": "float16"}])
        assert not gate["passed"] and "no case ran" in gate["reasons"]

    def test_known_failures_and_not_supported_are_accepted(self):
        results = [
            {"outcome": "pass"},
            {"outcome": "not supported"},
            {"outcome": "known failure", "expectation": {"id": "e", "upstream": ["u"], "reason": "r", "expires": "2027-01-01"}},
        ]
        gate = gate_verdict(results)
        assert gate["passed"] and gate["known_failures"][0]["cases"] == 1

    @pytest.mark.parametrize("outcome", ["fail", "broken", "unexpected pass"])
    def test_rejected_outcomes(self, outcome):
        assert not gate_verdict([{"outcome": "pass"}, {"outcome": outcome}])["passed"]

    def test_a_crashed_or_interrupted_session_fails(self):
        assert not gate_verdict([{"outcome": "pass"}], pytest_exitstatus=2)["passed"]

    def test_an_expected_case_without_a_result_fails_and_is_named(self):
        gate = gate_verdict([{"outcome": "pass"}], missing=["add_lora_linear-fp32-a", "bgmv_shrink-bf16-b"])
        assert not gate["passed"] and gate["counts"]["no result"] == 2
        assert gate["reasons"] == ["2 expected case(s) have no result: add_lora_linear-fp32-a, bgmv_shrink-bf16-b"]


def test_the_profile_cache_returns_what_was_drawn(tmp_path, monkeypatch):
    monkeypatch.setenv("LORA_CONFORMANCE_CACHE", str(tmp_path))
    draws = []

    def draw():
        draws.append(1)
        return profile_cases("smoke", ops=("bgmv_shrink",), dtypes=("float16",))

    key = {"probe": 1}
    first = profile_cache.cached_cases(key, draw)
    second = profile_cache.cached_cases(key, draw)
    assert first == second and len(draws) == 1
    assert profile_cache.cached_cases({"probe": 2}, draw) == first and len(draws) == 2


class TestRegistry:
    def test_a_vendor_entry_point_is_found_by_name(self, monkeypatch):
        from importlib.metadata import EntryPoint

        from conformance.targets import registry

        vendor = EntryPoint("mychip", "conformance.targets.reference:ReferenceTarget", registry.ENTRY_POINT_GROUP)
        monkeypatch.setattr(registry, "entry_points", lambda group: [vendor] if group == registry.ENTRY_POINT_GROUP else [])
        assert registry.resolve("mychip").name == "reference"
        assert "mychip" in registry.known_targets()

    def test_an_entry_point_cannot_shadow_a_builtin(self, monkeypatch):
        from importlib.metadata import EntryPoint

        from conformance.targets import registry

        impostor = EntryPoint("cpu", "conformance.targets.reference:ReferenceTarget", registry.ENTRY_POINT_GROUP)
        monkeypatch.setattr(registry, "entry_points", lambda group: [impostor])
        assert registry.known_targets()["cpu"] == registry.BUILTIN_TARGETS["cpu"]

    def test_a_reference_to_something_else_is_refused(self):
        from conformance.targets import TargetError, resolve

        with pytest.raises(TargetError, match="not a subclass"):
            resolve("conformance.runner:run_case")
        with pytest.raises(TargetError, match="cannot import"):
            resolve("no_such_package.module:Thing")


def test_the_public_surface_lists_every_export_and_each_resolves():
    import conformance

    assert sorted(conformance.__all__) == sorted(["__version__", *conformance._EXPORTS])
    assert all(getattr(conformance, name) is not None for name in conformance.__all__)


def test_failing_rows_are_named_by_slot_and_rows_no_segment_covers_as_such():
    from conformance.runner import describe_rows

    slots = (0, 0, -1, -1, 2, -1)
    assert describe_rows((0, 2, 4), slots) == "row 2 (slot -1, no adapter); row 0 (slot 0); row 4 (slot 2)"
    assert describe_rows((2, 3, 5), slots, uncovered=frozenset({5})) == "rows 2, 3 (slot -1, no adapter); row 5 (no segment)"


def test_a_sgmv_fault_that_stores_uncovered_rows_names_them_as_no_segment():
    from fault_targets import SgmvStoresUncoveredRows

    from conformance.generator.profiles import profile_cases
    from conformance.runner import run_case

    cases = [
        (case_id, case) for case_id, case in profile_cases("smoke", 0)
        if case.op == "sgmv_expand" and not all(case.covered_rows) and case.add_inputs is False
    ]
    assert cases
    messages = [run_case(SgmvStoresUncoveredRows(), case, case_id).message for case_id, case in cases]
    assert any("(no segment)" in message for message in messages), messages
