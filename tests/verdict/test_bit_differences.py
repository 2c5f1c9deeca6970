"""What must stay as it was is compared by value: equal values with other bits are recorded, not failed.

The rule (docs/verdict.md, "Equal values, other bits"): outside the written region, and in every input,
a zero whose sign flipped or a NaN that stayed NaN with another payload is no wrong number; the case
passes and says so ("bit-level difference only: …"), and the counts reach results.json and the report.
Every other change there (another number, a NaN appearing or going, an infinity, a denormal where a
zero was) still fails as before: ``wrote outside its region`` or ``modified an input``.
"""

from __future__ import annotations

import json
from dataclasses import replace

import pytest
import torch

from conformance.cases import Case
from conformance.gate import gate_verdict, summarize
from conformance.journal import Journal, read_journals
from conformance.report import write_html_report
from conformance.runner import make_values, run_case
from conformance.targets.reference import ReferenceTarget
from conformance.tp.case import TPCase
from conformance.tp.inputs import ReadOnlyInputs
from conformance.tp.judgement import baseline_output, judge_output
from conformance.tp.layer_wire import RankAnswer
from conformance.tp.run import TPExecutor
from conformance.tp.values import layer_tensors
from conformance.verdict import FailureKind, Outcome, judge
from conformance.verdict.bit_differences import BitDifferences
from conformance.verdict.metrics import compare_values

BF16_NAN_PAYLOAD, BF16_NEGATIVE_NAN, BF16_SMALLEST_DENORMAL = 0x7FC1, -0x40, 0x0001  # bits (int16) of bfloat16 values


def from_bits(bits: int) -> torch.Tensor:
    return torch.tensor([bits], dtype=torch.int16).view(torch.bfloat16)[0]


# -- the classification, one function for every check --------------------------------------------


@pytest.mark.parametrize("dtype", [torch.float8_e4m3fn, torch.bfloat16, torch.float16, torch.float32, torch.float64])
def test_compare_values_tells_equal_values_with_other_bits_from_other_values(dtype):
    before = torch.tensor([0.0, -0.0, 1.0, 0.0, 0.0, float("nan"), 2.0]).to(dtype)
    after = torch.tensor([-0.0, 0.0, 1.0, float("nan"), 0.5, 0.0, 3.0]).to(dtype)
    comparison = compare_values(after, before)
    assert comparison.signed_zeros.tolist() == [True, True, False, False, False, False, False]
    assert comparison.changed.tolist() == [False, False, False, True, True, True, True]  # NaN appeared, a number, NaN went
    assert not comparison.nan_payloads.any()


def test_a_denormal_where_a_zero_was_is_a_value_and_another_nan_payload_is_not():
    before = torch.stack([from_bits(0), from_bits(0x7FC0), from_bits(0x7FC0)])
    after = torch.stack([from_bits(BF16_SMALLEST_DENORMAL), from_bits(BF16_NAN_PAYLOAD), from_bits(BF16_NEGATIVE_NAN)])
    comparison = compare_values(after, before)
    assert comparison.changed.tolist() == [True, False, False]
    assert comparison.nan_payloads.tolist() == [False, True, True]


def test_integer_tensors_have_no_bit_level_pairs():
    comparison = compare_values(torch.tensor([0, 1, 2]), torch.tensor([0, 1, 3]))
    assert comparison.changed.tolist() == [False, False, True] and not comparison.bits_only.any()


# -- the verdict on an output ---------------------------------------------------------------------


def judged_tensors():
    """A bfloat16 output of 3 rows, row 1 without an adapter (+0 before the call), rows 0 and 2 written."""
    oracle = torch.linspace(-1, 1, 12, dtype=torch.float64).reshape(3, 4)
    initial = torch.zeros(3, 4, dtype=torch.bfloat16)
    written = torch.tensor([True, False, True])[:, None].expand(3, 4).clone()
    actual = torch.where(written, oracle, 0.0).to(torch.bfloat16)
    return actual, oracle, actual.clone(), initial, written


def test_a_zero_that_changed_sign_outside_the_region_passes_and_is_recorded():
    actual, oracle, baseline, initial, written = judged_tensors()
    actual[1, 0], actual[1, 3] = -0.0, -0.0
    verdict = judge(actual, oracle, baseline, initial, written)
    assert verdict.passed, verdict.problems
    assert verdict.measurement.bit_differences == (BitDifferences("output", "output", 2, 0, (1,), (0, 3), (0,)),)
    assert verdict.measurement.bit_differences[0].note() == (
        "bit-level difference only: 2 zero(s) changed sign outside the written region (equal values; not a wrong number)")


def test_a_nan_with_another_payload_outside_the_region_passes_and_is_recorded():
    actual, oracle, baseline, initial, written = judged_tensors()
    initial[1] = float("nan")
    actual[1] = initial[1]
    actual[1, 1], actual[1, 2] = from_bits(BF16_NAN_PAYLOAD), from_bits(BF16_NEGATIVE_NAN)
    verdict = judge(actual, oracle, baseline, initial, written)
    assert verdict.passed, verdict.problems
    [entry] = verdict.measurement.bit_differences
    assert (entry.signed_zeros, entry.nan_payloads, entry.columns) == (0, 2, (1, 2))
    assert "2 NaN(s) changed payload or sign outside the written region" in entry.note()


@pytest.mark.parametrize("written_value", [
    pytest.param(1.0, id="another-number"),
    pytest.param(float("nan"), id="nan-appearing"),
    pytest.param(float("inf"), id="inf"),
    pytest.param(from_bits(BF16_SMALLEST_DENORMAL), id="denormal-where-zero-was"),
])
def test_every_other_change_outside_the_region_still_fails(written_value):
    actual, oracle, baseline, initial, written = judged_tensors()
    actual[1, 2] = written_value
    verdict = judge(actual, oracle, baseline, initial, written)
    assert [p.kind for p in verdict.problems] == [FailureKind.OUTSIDE_REGION]
    assert verdict.problems[0].rows == (1,) and verdict.problems[0].text.startswith("wrote 1 element(s)")
    assert verdict.measurement.bit_differences == ()


def test_a_nan_that_went_outside_the_region_still_fails():
    actual, oracle, baseline, initial, written = judged_tensors()
    initial[1, 1] = float("nan")
    verdict = judge(actual, oracle, baseline, initial, written)
    assert [p.kind for p in verdict.problems] == [FailureKind.OUTSIDE_REGION]


def test_a_sign_flip_beside_a_wrong_number_fails_for_the_number_and_records_the_flip():
    actual, oracle, baseline, initial, written = judged_tensors()
    actual[1, 0], actual[1, 1] = -0.0, 1.0
    verdict = judge(actual, oracle, baseline, initial, written)
    [problem] = verdict.problems
    assert problem.kind is FailureKind.OUTSIDE_REGION and problem.columns == (1,) and "wrote 1 element(s)" in problem.text
    assert verdict.measurement.bit_differences[0].signed_zeros == 1


def test_the_record_is_json_and_comes_back_as_it_went():
    actual, oracle, baseline, initial, written = judged_tensors()
    actual[1, 0] = -0.0
    measurement = judge(actual, oracle, baseline, initial, written).measurement
    record = json.loads(json.dumps(measurement.to_json()))
    assert record["bit_differences"] == [{"tensor": "output", "role": "output", "signed_zeros": 1, "nan_payloads": 0,
                                          "rows": [1], "columns": [0], "planes": [0]}]
    assert BitDifferences.from_json(record["bit_differences"][0]) == measurement.bit_differences[0]


# -- an op case, end to end in this process ----------------------------------------------------------

CASE = Case(op="add_lora_linear", dtype="bfloat16", seq_lens=(2, 2), seq_slots=(0, -1), num_slots=2, max_rank=4,
            adapter_ranks=(4, 4), hidden_size=16, output_slices=(8,), output_width=8)  # rows 2, 3: slot −1


class AddsAMaskedZeroDelta(ReferenceTarget):
    """Correct, then adds a zero delta to every row (a Gaudi formulation: ``y += mask · delta``): −0 + 0 = +0."""

    name = "adds-a-masked-zero-delta"

    def add_lora_linear(self, y, *args, **kwargs):
        super().add_lora_linear(y, *args, **kwargs)
        y.add_(torch.zeros_like(y))


class CanonicalizesNaN(ReferenceTarget):
    """Correct, then writes every NaN of its output back as the canonical NaN (a round trip through another framework)."""

    name = "canonicalizes-nan"

    def add_lora_linear(self, y, *args, **kwargs):
        super().add_lora_linear(y, *args, **kwargs)
        y.copy_(torch.where(y.isnan(), torch.full_like(y, float("nan")), y))


class ZerosBecomeDenormals(ReferenceTarget):
    """Writes the smallest denormal where its output held a zero: a value, however small."""

    name = "zeros-become-denormals"

    def add_lora_linear(self, y, *args, **kwargs):
        super().add_lora_linear(y, *args, **kwargs)
        y.copy_(torch.where(y == 0, from_bits(BF16_SMALLEST_DENORMAL).to(y.dtype), y))


class CanonicalizesItsInput(ReferenceTarget):
    """Adds zero to its activations in place before the call (a functional backend's round trip): −0 → +0."""

    name = "canonicalizes-its-input"

    def add_lora_linear(self, y, x, *args, **kwargs):
        x.add_(0.0)
        super().add_lora_linear(y, x, *args, **kwargs)


class ScalesItsInput(ReferenceTarget):
    """Doubles its activations in place after the call: a modified input."""

    name = "scales-its-input"

    def add_lora_linear(self, y, x, *args, **kwargs):
        super().add_lora_linear(y, x, *args, **kwargs)
        x.mul_(2)


def values_with(**rows_without_adapter) -> dict:
    """The case's values, with the output's rows of slot −1 (2 and 3) set to what is given (a bfloat16 scalar)."""
    values = make_values(CASE)
    for value in rows_without_adapter.values():
        values["out"][2:] = value
    return values


def test_an_op_whose_rows_without_adapter_come_back_positive_zero_passes_with_the_note(tmp_path):
    result = run_case(AddsAMaskedZeroDelta(), CASE, "signed-zero", values_with(out=torch.tensor(-0.0)))
    assert result.outcome is Outcome.PASS, result.message
    assert result.message == ("bit-level difference only: 16 zero(s) changed sign outside the written region "
                              "(equal values; not a wrong number): rows 2, 3 (slot -1, no adapter)")
    record = result.to_json()
    assert record["measurement"]["bit_differences"][0]["signed_zeros"] == 16
    assert record["measurement"]["bit_differences"][0]["rows"] == [2, 3]
    journal = Journal(tmp_path, "main")
    journal.append(record)
    [read] = read_journals(tmp_path)
    assert read == json.loads(json.dumps(record))

    report = write_html_report({"target": "acme", "results": [read], "gate": gate_verdict([read]), "summary": summarize([read])},
                               tmp_path / "report.html").read_text()
    section = report[report.index('id="bit-differences"'):]
    assert "signed-zero" in section and "16 zero(s) changed sign outside the written region" in section


def test_an_op_that_canonicalizes_nan_payloads_outside_the_region_passes_with_the_note():
    result = run_case(CanonicalizesNaN(), CASE, "nan-payload", values_with(out=from_bits(BF16_NAN_PAYLOAD)))
    assert result.outcome is Outcome.PASS, result.message
    assert result.message.startswith("bit-level difference only: 16 NaN(s) changed payload or sign outside the written region")
    assert result.measurement.bit_differences[0].nan_payloads == 16


def test_an_op_that_writes_a_denormal_where_a_zero_was_still_writes_outside_its_region():
    result = run_case(ZerosBecomeDenormals(), CASE, "denormal", values_with(out=torch.tensor(0.0)))
    assert result.outcome is Outcome.FAIL and result.kinds == (FailureKind.OUTSIDE_REGION,), result.message
    assert "rows 2, 3 (slot -1, no adapter)" in result.message


def test_an_input_whose_negative_zero_came_back_positive_gets_the_note_not_modified_input():
    values = make_values(CASE)
    values["x"][1, 3] = -0.0
    result = run_case(CanonicalizesItsInput(), CASE, "input-zero", values)
    assert result.outcome is Outcome.PASS, result.message
    assert result.message == "bit-level difference only: 1 zero(s) changed sign in the input 'x' (equal values; not a modified input)"
    [entry] = result.to_json()["measurement"]["bit_differences"]
    assert (entry["tensor"], entry["role"], entry["rows"], entry["columns"]) == ("x", "input", [1], [3])


def test_an_input_that_changed_value_is_still_a_modified_input():
    result = run_case(ScalesItsInput(), CASE, "input-scaled")
    assert result.outcome is Outcome.FAIL and FailureKind.MODIFIED_INPUT in result.kinds, result.message
    assert "modified its input 'x'" in result.message


# -- a tensor-parallel layer --------------------------------------------------------------------------


TP_CASE = TPCase("column", False, 2, "float32", seq_lens=(3, 2, 1, 4), seq_slots=(0, -1, 2, 1), num_slots=3,
                 max_rank=8, hidden_size=32, output_slices=(32,), scale=0.5, seed=11)  # rows 3, 4: slot −1


def test_a_tensor_parallel_layer_judges_its_rows_without_adapter_by_value():
    case = TP_CASE
    tensors = layer_tensors(case)
    y = tensors.y.clone()
    y[3:5] = 0.0
    tensors = replace(tensors, y=y)
    composed = baseline_output(case, tensors)
    composed[0, 3:5, :4] = -0.0
    verdict, message, slots, ranks, kinds, _ = judge_output(case, composed, tensors)
    assert verdict.passed and kinds == (), message
    assert message.startswith("bit-level difference only: 8 zero(s) changed sign outside the written region")
    assert "rows 3, 4 (slot -1, no adapter)" in message
    composed[0, 3, 5] = 1.0
    verdict, message, slots, ranks, kinds, _ = judge_output(case, composed, tensors)
    assert kinds == (FailureKind.OUTSIDE_REGION,) and slots == (-1,), message


class ExpandThatTouchesItsInput:
    """A wrapper whose ``add_expand`` does ``touch`` to its input ``x`` (the shrink buffer) in place."""

    def __init__(self, touch) -> None:
        self.touch = touch

    def add_expand(self, y, x, lora_b_stacked, output_slices, offset_start=0, add_inputs=True):
        self.touch(x)


def test_a_rank_input_with_equal_values_and_other_bits_is_recorded_not_modified():
    x = torch.tensor([[1.0, -0.0, 2.0]])
    watched = ReadOnlyInputs(ExpandThatTouchesItsInput(lambda x: x.add_(0.0)))
    watched.add_expand(torch.zeros(1, 3), x, (), (3,))
    assert watched.modified == []
    assert [(e.tensor, e.role, e.signed_zeros, e.columns) for e in watched.bit_level] == [("add_expand: x", "input", 1, (1,))]
    scaled = ReadOnlyInputs(ExpandThatTouchesItsInput(lambda x: x.mul_(2)))
    scaled.add_expand(torch.zeros(1, 3), torch.tensor([[1.0, -0.0, 2.0]]), (), (3,))
    assert scaled.modified == ["add_expand modified its input 'x'"] and scaled.bit_level == []


def test_a_tensor_parallel_pass_says_which_rank_handed_back_an_input_with_other_bits():
    tensors = layer_tensors(TP_CASE)
    composed = baseline_output(TP_CASE, tensors)
    entry = BitDifferences("add_expand: x", "input", 1, 0, (0,), (1,), (0,))
    result = TPExecutor._judged(TP_CASE, tensors, [RankAnswer(composed), RankAnswer(None, (), (entry,))], frozenset(), 0.0)
    assert result.outcome is Outcome.PASS, result.message
    assert result.message == ("rank 1: bit-level difference only: 1 zero(s) changed sign in the input 'add_expand: x' "
                              "(equal values; not a modified input)")
    assert result.to_json()["measurement"]["bit_differences"] == [entry.to_json()]
    modified = TPExecutor._judged(TP_CASE, tensors, [RankAnswer(composed), RankAnswer(None, ("add_expand modified its input 'x'",))],
                                  frozenset(), 0.0)
    assert modified.outcome is Outcome.FAIL and modified.kinds == (FailureKind.MODIFIED_INPUT,), modified.message
