"""The referee's half of an op case: the oracle, the judgement and the determinism measure.

It runs in a process that never imports the target (``conformance.isolation`` keeps the target in a
worker process of its own): it draws the values, hands them to the target's half
(``conformance.target_call``), and judges what comes back (:func:`judge_op`):

1. the reference runs on the same values in float64 (the oracle) and in the case dtype (the baseline),
   once more in float64 on a zeroed output (the oracle's delta, for the systematic-error rule) and on
   the absolute values (the magnitude of the terms, for the budget's accumulation allowance);
2. every call's output is judged (``conformance.verdict.judge``; an op with many correct outputs by
   its invariants, ``OpSpec.check``), and the message names the rows and their slots;
3. every tensor the target was handed, inputs and metadata alike, must come back with the values the
   referee made (inputs are read-only in every op's contract, and vLLM shares one step's metadata
   across every layer); a zero whose sign flipped or a NaN with another payload is recorded, not failed
   (``conformance.verdict.bit_differences``), as outside the output's written region;
4. the calls of an attempt are compared bit for bit with each other, and the attempts' verdicts with
   each other: ``stability`` and ``determinism`` of the result (``conformance.record``).
Expectations (known failures) are applied afterwards, by ``conformance.expectations``.
"""

from __future__ import annotations

import bisect
import itertools
from dataclasses import dataclass, field, replace

import torch

from conformance.cases.case import Case
from conformance.cases.features import case_features
from conformance.digest import oracle_fingerprint, tensors_digest
from conformance.ops import OP_SPECS, Level, OpSpec
from conformance.record import CaseResult
from conformance.target_call import TargetCall, Tensors, execute, handed_tensors
from conformance.targets.reference import ReferenceTarget
from conformance.verdict import FailureKind, Measurement, Outcome, judge
from conformance.verdict.bit_differences import BitDifferences, bit_level_notes
from conformance.verdict.failure_kind import ordered
from conformance.verdict.metrics import compare_values, spread

CPU = torch.device("cpu")


def as_float64(values: Tensors) -> Tensors:
    return {k: v.double() if v.is_floating_point() else v for k, v in values.items()}


@dataclass(frozen=True)
class Oracle:
    """The reference's view of a case: the float64 output, the in-dtype baseline, the delta and the magnitude."""

    output: torch.Tensor
    baseline: torch.Tensor
    delta: torch.Tensor
    magnitude: torch.Tensor

    @classmethod
    def of(cls, spec: OpSpec, case: Case, values: Tensors) -> Oracle:
        # One reference wrapper for every run: its metadata depends on the mapping only, not on the
        # dtype, so the later runs reuse what the first built (a few percent of a wrapper case's time).
        reference = ReferenceTarget()
        exact = as_float64(values)  # converted once: the oracle, its delta and its magnitude all read it
        output = execute(spec, case, exact, reference, CPU, outputs_only=True)[spec.output]
        baseline = execute(spec, case, values, reference, CPU, update_metadata=False, outputs_only=True)[spec.output]
        return cls(output, baseline, oracle_delta(spec, case, exact, reference), oracle_magnitude(spec, case, exact, reference))


def oracle_delta(spec: OpSpec, case: Case, values: Tensors, reference: ReferenceTarget) -> torch.Tensor:
    """What the op adds to its output, in float64: the reference on the same inputs with the output zeroed.

    One generic run instead of knowing, per op, whether it accumulates (the delta is the oracle minus
    the initial output) or overwrites (``add_inputs=False``, ``apply_lora_full_linear``: the delta is
    what it writes); the systematic-error rule of the verdict fits the error against it.
    ``values`` in the case dtype or already in float64; ``reference`` already holds the case's mapping."""
    zeroed = as_float64(values)
    zeroed[spec.output] = torch.zeros_like(zeroed[spec.output])
    return execute(spec, case, zeroed, reference, CPU, update_metadata=False, outputs_only=True)[spec.output]


def oracle_magnitude(spec: OpSpec, case: Case, values: Tensors, reference: ReferenceTarget) -> torch.Tensor:
    """The size of what each output element is summed from, in float64: the reference on the absolute
    values of every floating input (the initial output included), ``|y| + |x|·|A|·|B|`` for a LoRA
    linear. It bounds the oracle (``|o| ≤ m``) and is the scale rounding error is proportional to:
    where the terms cancel (one token, rank 1: one dot product over thousands of features), a
    correct target that sums in another order errs by ulps of ``m``, many ulps of ``|o|``. The
    budget and the systematic-error noise model allow float32 accumulation error in ulps of it
    (``conformance.verdict.tolerances``).
    ``values`` in the case dtype or already in float64; ``reference`` already holds the case's mapping."""
    absolute = {name: value.abs() if value.is_floating_point() else value for name, value in as_float64(values).items()}
    return execute(spec, case, absolute, reference, CPU, update_metadata=False, outputs_only=True)[spec.output]


def describe_rows(rows: tuple[int, ...], row_slots: tuple[int, ...], limit: int = 8, uncovered: frozenset[int] = frozenset()) -> str:
    """"rows 3, 5 (slot −1, no adapter); row 7 (slot 2)": rows grouped by the slot they use; the rows
    in ``uncovered`` (no sgmv segment covers them) as "(no segment)"."""
    by_slot: dict[int | None, list[int]] = {}
    for row in rows:
        by_slot.setdefault(None if row in uncovered else row_slots[row], []).append(row)
    parts = []
    for slot, slot_rows in sorted(by_slot.items(), key=lambda item: (item[0] is None, item[0] or 0)):
        shown = ", ".join(map(str, slot_rows[:limit])) + (", …" if len(slot_rows) > limit else "")
        label = "no segment" if slot is None else "slot -1, no adapter" if slot == -1 else f"slot {slot}"
        parts.append(f"row{'s' if len(slot_rows) > 1 else ''} {shown} ({label})")
    return "; ".join(parts)


def slices_hit(case: Case, output: torch.Tensor, problem) -> set[int]:
    """The slices of ``case`` where ``problem`` shows: a 3-D output ``[slices, T, R]`` (the shrink buffers) by
    its leading index; otherwise by column, the slices lying side by side from ``offset_start`` (−1: a column
    before the offset or past the last slice)."""
    if output.dim() == 3 and output.size(0) == case.num_slices:
        return set(problem.planes)
    bounds = list(itertools.accumulate(case.output_slices, initial=case.offset_start))
    return {bisect.bisect_right(bounds, c) - 1 if bounds[0] <= c < bounds[-1] else -1 for c in problem.columns}


def modified_inputs(spec: OpSpec, expected: Tensors, after: Tensors,
                    values: Tensors | None = None) -> tuple[list[str], tuple[BitDifferences, ...]]:
    """What the call changed of what it was handed: one sentence per input (every tensor but the op's
    outputs) or metadata tensor whose values differ from the referee's own copy, and the bit-level
    differences of those whose values are equal (a −0 handed back as +0: a backend that round-trips
    its inputs through another framework may canonicalize it; docs/verdict.md)."""
    changed, bit_level = [], []
    for name, before in expected.items():
        if name in spec.outputs:
            continue
        what = "input" if values is None or name in values else "metadata"
        if name not in after:
            changed.append(f"did not hand back its {what} {name!r}")
            continue
        now = after[name]
        comparison = compare_values(now, before) if now.shape == before.shape and now.dtype == before.dtype else None
        if comparison is None or comparison.changed.any():
            changed.append(
                f"modified its input {name!r}, which every op must only read" if what == "input" else
                f"modified the metadata {name!r} it was handed (vLLM shares one step's metadata across every layer)"
            )
        elif entry := BitDifferences.of(comparison, name, what):
            bit_level.append(entry)
    return changed, tuple(bit_level)


@dataclass
class RunJudgement:
    """The verdict on one call's output."""

    passed: bool
    details: list[str] = field(default_factory=list)
    kinds: tuple[FailureKind, ...] = ()
    measurement: Measurement | None = None
    failing_slots: tuple[int, ...] = ()
    failing_slices: tuple[int, ...] = ()
    notes: tuple[str, ...] = ()  # bit-level differences of equal values, one sentence each: said, not failed
    outside_zeroed: bool | None = None  # where it wrote outside its region: whether every element it changed there is zero


def judge_run(spec: OpSpec, case: Case, values: Tensors, expected: Tensors, after: Tensors, oracle: Oracle | None) -> RunJudgement:
    """One call's output against the oracle (or the op's invariants), and what it did to its inputs."""
    changed, input_bits = modified_inputs(spec, expected, after, values)
    changed_kind = [FailureKind.MODIFIED_INPUT] * bool(changed)
    if spec.check is not None:
        return _checked_run(spec, case, values, after, changed, changed_kind, bit_level_notes(input_bits))
    verdict = judge(after[spec.output], oracle.output, oracle.baseline, values[spec.output], spec.written_mask(case),
                    oracle.delta, oracle.magnitude, rounding_dtype=case.torch_dtype if spec.delta_in_case_dtype else None)
    measurement = verdict.measurement
    if measurement is not None and input_bits:
        measurement = replace(measurement, bit_differences=measurement.bit_differences + input_bits)
    row_slots = spec.row_slots(case)
    uncovered = frozenset(row for row, covered in enumerate(case.covered_rows) if not covered) if spec.rows == "tokens" else frozenset()
    notes = bit_level_notes(measurement.bit_differences if measurement else input_bits,
                            lambda rows: describe_rows(rows, row_slots, uncovered=uncovered))
    if verdict.passed and not changed:
        return RunJudgement(True, measurement=measurement, notes=notes)
    details = [f"{p.text}: {describe_rows(p.rows, row_slots, uncovered=uncovered)}" if p.rows else p.text for p in verdict.problems]
    return RunJudgement(
        False, details + changed, ordered([p.kind for p in verdict.problems] + changed_kind), measurement,
        tuple(sorted({row_slots[row] for p in verdict.problems for row in p.rows})),
        tuple(sorted({s for p in verdict.problems for s in slices_hit(case, after[spec.output], p)})), notes,
        next((p.zeroed for p in verdict.problems if p.kind is FailureKind.OUTSIDE_REGION), None),
    )


def _checked_run(spec: OpSpec, case: Case, values: Tensors, after: Tensors, changed: list[str], changed_kind,
                 notes: tuple[str, ...]) -> RunJudgement:
    """An op judged by its invariants (``OpSpec.check``), not against the oracle: each problem names its slot."""
    reshaped = [
        f"output {name!r} has shape {tuple(after[name].shape)} and dtype {after[name].dtype}; expected {tuple(values[name].shape)} and {values[name].dtype}"
        for name in spec.outputs
        if after[name].shape != values[name].shape or after[name].dtype != values[name].dtype
    ]
    if reshaped:  # the invariants read the outputs in their contract's layout
        return RunJudgement(False, reshaped, (FailureKind.WRONG_OUTPUT_TYPE,))
    problems = spec.check(case, after, values)
    if not problems and not changed:
        return RunJudgement(True, notes=notes)
    details = [f"slot {slot}: {text}" for slot, text in problems] + changed
    kinds = ordered([FailureKind.INVARIANT] * bool(problems) + changed_kind)
    return RunJudgement(False, details, kinds, failing_slots=tuple(sorted({slot for slot, _ in problems})), notes=notes)


# -- determinism -----------------------------------------------------------------------------------


def determinism(spec: OpSpec, attempts: list[TargetCall]) -> dict | None:
    """How far the calls of every attempt differ from the first call, bit for bit, over every output
    (``conformance.verdict.metrics.spread``); None with fewer than two calls."""
    runs = [run for attempt in attempts for run in attempt.runs]
    if len(runs) < 2:
        return None
    empty = torch.zeros(0)
    # the outputs of each call side by side, flattened, so that one spread covers them all
    flat = [torch.cat([run.get(name, empty).reshape(-1).double() for name in spec.outputs]) for run in runs]
    return {**spread(flat), "attempts": len(attempts)}


def _attempt_signature(judgements: list[RunJudgement], attempt: TargetCall) -> tuple:
    """What must repeat for a verdict to be consistent: per call pass or its kinds, and a raise."""
    return tuple(() if j.passed else j.kinds for j in judgements), attempt.status


# -- the verdict on a case -------------------------------------------------------------------------


def same_bits(run: Tensors, other: Tensors) -> bool:
    """Whether two calls handed back the same tensors bit for bit (names, dtypes, shapes and every byte)."""
    if run.keys() != other.keys():
        return False
    for name, tensor in run.items():
        seen = other[name]
        if tensor.dtype != seen.dtype or tensor.shape != seen.shape:
            return False
        if not torch.equal(tensor.contiguous().reshape(-1).view(torch.uint8), seen.contiguous().reshape(-1).view(torch.uint8)):
            return False
    return True


def judge_op(case: Case, case_id: str, values: Tensors, attempts: list[TargetCall], *, require_deterministic: bool = False,
             expected: Tensors | None = None) -> CaseResult:
    """The result of ``case`` from the target's attempts at it (``conformance.target_call``): the first
    attempt's verdict, labelled flaky when a later attempt's differs (see the module docstring).
    ``expected``: the handed tensors as a correct target gives them back (``handed_tensors``), if the caller has them.

    A call that handed back the same bits as the first call has that call's judgement: judging is a function
    of those bits (and of the values and the oracle, the same for every call), so a repeat costs a comparison."""
    features = case_features(case)
    first = attempts[0]
    if first.status == "not_supported":
        return CaseResult(case_id, case, Outcome.NOT_SUPPORTED, first.message, features=features)
    spec = OP_SPECS[case.op]
    expected = handed_tensors(spec, case, values) if expected is None else expected
    oracle = Oracle.of(spec, case, values) if spec.check is None and any(a.runs for a in attempts) else None
    judged_first: list[tuple[Tensors, RunJudgement]] = []  # the first call and its judgement

    def judged_run(run: Tensors) -> RunJudgement:
        if judged_first and same_bits(run, judged_first[0][0]):
            return judged_first[0][1]
        judgement = judge_run(spec, case, values, expected, run, oracle)
        if not judged_first:
            judged_first.append((run, judgement))
        return judgement

    judged = [[judged_run(run) for run in attempt.runs] for attempt in attempts]
    signatures = [_attempt_signature(j, a) for j, a in zip(judged, attempts)]
    flaky = len(set(signatures)) > 1
    measured = determinism(spec, [a for a in attempts if a.status != "not_supported"])
    stability = "flaky" if flaky else None if measured is None else "deterministic" if measured["identical"] else "nondeterministic"
    result = _verdict(spec, case, case_id, first, judged[0], features)
    result.stability, result.determinism = stability, measured
    # what this verdict was reached on, for a bundle's reviewer (conformance.digest)
    result.inputs_digest = tensors_digest(values)
    result.oracle_fingerprint = oracle_fingerprint(oracle.output) if oracle is not None else None
    if result.traceback is None:  # a later attempt that raised (a flaky failure): what it raised
        raising = next((a for a in attempts if a.traceback), None)
        result.traceback, result.raised = (raising.traceback, raising.raised) if raising else (None, None)
    if flaky:
        again = "passed" if all(j.passed for j in judged[1]) and attempts[1].status == "ran" else "ended otherwise"
        result.message += f" (flaky: attempt 2 of {len(attempts)} {again})"
    if result.outcome is Outcome.PASS and require_deterministic and stability == "nondeterministic":
        result.outcome, result.kinds = Outcome.FAIL, (FailureKind.NONDETERMINISTIC,)
        result.message = (f"{measured['calls']} calls on the same inputs differ in {measured['differing_elements']} "
                          f"element(s), by up to {measured['max_abs_difference']:.3g} (--require-deterministic)")
    return result


def _verdict(spec: OpSpec, case: Case, case_id: str, attempt: TargetCall, judged: list[RunJudgement], features) -> CaseResult:
    """One attempt's result: its first failing call speaks for it, naming which call that was."""
    calls = len(judged) + (attempt.status == "raised")
    measurements = [j.measurement for j in judged if j.measurement is not None]
    measurement = max(measurements, key=lambda m: m.budget_ratio) if measurements else None
    failing = next((i for i, j in enumerate(judged) if not j.passed), None)
    if attempt.status == "raised":
        which = f"call {attempt.raised_in + 1} of {calls}" if calls > 1 else "the call"
        earlier = f" after {attempt.raised_in} call(s) that returned" if attempt.raised_in else ""
        return CaseResult(case_id, case, Outcome.BROKEN, f"{which} raised{earlier}: {attempt.message}", measurement, features,
                          attempt.seconds, kinds=(FailureKind.RAISED,), traceback=attempt.traceback, raised=attempt.raised)
    if failing is None:  # a pass says what differs in bits only, once per sentence over the calls
        notes = "; ".join(dict.fromkeys(note for j in judged for note in j.notes))
        return CaseResult(case_id, case, Outcome.PASS, notes, measurement, features, attempt.seconds)
    run = judged[failing]
    prefix = ""
    if len(judged) > 1:
        passed = [str(i + 1) for i, j in enumerate(judged) if j.passed]
        prefix = f"call {failing + 1} of {len(judged)}" + (f" (call {', '.join(passed)} passed)" if passed else "") + ": "
        if passed and spec.level == Level.WRAPPER and failing > 0 and all(j.passed for j in judged[:failing]):
            prefix = (f"call {failing + 1} of {len(judged)} after one update_metadata (the first passed: does the wrapper "
                      f"keep its batch state across calls? vLLM calls it once per layer): ")
    return CaseResult(case_id, case, Outcome.FAIL, prefix + "; ".join(run.details), run.measurement, features,
                      attempt.seconds, run.failing_slots, run.failing_slices, kinds=run.kinds, outside_zeroed=run.outside_zeroed)
