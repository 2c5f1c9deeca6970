"""Running one case on one target and judging it: the loop every front end (pytest, scripts) shares.

1. an op the target does not implement (``implemented_ops``), then ``unsupported_reason`` → NOT_SUPPORTED,
   without touching the target's ops (asked in this order, so a target's own checks in
   ``unsupported_reason`` never hide that an op is missing);
2. the target runs the op on the case's values (on its device); an exception → BROKEN;
3. the reference runs on the same values in float64 (the oracle) and in the case dtype (the
   baseline), and once more in float64 on a zeroed output (the oracle's delta, for the verdict's
   systematic-error rule);
4. ``conformance.verdict.judge`` decides PASS or FAIL, and the message names the rows and their slots;
   a target that changed one of its inputs fails too (inputs are read-only in every op's contract).
Expectations (known failures) are applied afterwards, by ``conformance.expectations``.
"""

from __future__ import annotations

import bisect
import itertools
import time
import traceback
from dataclasses import dataclass, field

import torch

from conformance.cases.case import Case
from conformance.cases.features import case_features
from conformance.cases.values import generator_for
from conformance.ops import OP_SPECS, Level, OpSpec, case_mapping
from conformance.targets.base import Target
from conformance.targets.reference import ReferenceTarget
from conformance.verdict import FailureKind, Measurement, Outcome, judge
from conformance.verdict.failure_kind import ordered
from conformance.verdict.metrics import bitwise_differences

Tensors = dict[str, torch.Tensor]


@dataclass
class CaseResult:
    case_id: str
    case: Case
    outcome: Outcome
    message: str = ""
    measurement: Measurement | None = None
    features: frozenset[str] = field(default_factory=frozenset)
    seconds: float = 0.0
    failing_slots: tuple[int, ...] = ()  # the slots of the output rows where a problem shows
    failing_slices: tuple[int, ...] = ()  # the output slices where a problem shows (−1: columns outside every slice)
    expectation: dict | None = None  # the expectations entry that matched, if any
    replay: str | None = None  # the replay file written for this case, if any
    repro: str | None = None  # the one-line command that reruns it
    kinds: tuple[FailureKind, ...] = ()  # how it went wrong (empty for a pass), most telling first

    @property
    def kind(self) -> FailureKind | None:
        return self.kinds[0] if self.kinds else None

    @property
    def level(self) -> Level:
        return OP_SPECS[self.case.op].level

    def measurement_json(self) -> dict | None:
        return self.measurement.to_json() if self.measurement else None

    def to_json(self) -> dict:
        """The results schema (results.json, the report, merge): one record per case, op or end to end."""
        return {
            "id": self.case_id,
            "op": self.case.op,
            "level": self.level.value,
            "dtype": self.case.dtype,
            "family": self.case.family,
            "features": sorted(self.features),
            "outcome": self.outcome.value,
            "kind": self.kind.value if self.kind else None,
            "kinds": [kind.value for kind in self.kinds],
            "message": self.message,
            "measurement": self.measurement_json(),
            "seconds": round(self.seconds, 4),
            "failing_slots": list(self.failing_slots),
            "failing_slices": list(self.failing_slices),
            "expectation": self.expectation,
            "replay": self.replay,
            "repro": self.repro,
            "case": self.case.to_json(),
        }


def make_values(case: Case) -> Tensors:
    """The case's input tensors, on the CPU, from its seed."""
    return OP_SPECS[case.op].make_values(case, generator_for(case))


def execute(spec: OpSpec, case: Case, values: Tensors, impl, device: torch.device, *, update_metadata: bool = True) -> Tensors:
    """Run ``spec`` on copies of ``values`` moved to ``device``; return every tensor afterwards, on the CPU.

    ``update_metadata=False`` reuses the mapping ``impl`` was given by an earlier ``execute`` of the
    same case (the reference's oracle and baseline runs share one).
    """
    tensors = {name: value.to(device).clone() for name, value in values.items()}
    if spec.level == Level.WRAPPER and update_metadata:
        impl.update_metadata(case_mapping(case))
    call = spec.make_call(case, tensors, device)
    getattr(impl, spec.name)(*call.args, **call.kwargs)
    impl.synchronize()
    return {name: tensor.cpu() for name, tensor in tensors.items()}


def modified_inputs(spec: OpSpec, values: Tensors, after: Tensors) -> list[str]:
    """The input tensors (all but the outputs) a call changed: inputs are read-only in every op's contract."""
    return [
        name
        for name, value in values.items()
        if name not in spec.outputs and bool(bitwise_differences(after[name], value).any())
    ]


def _float64(values: Tensors) -> Tensors:
    return {k: v.double() if v.is_floating_point() else v for k, v in values.items()}


def oracle_delta(spec: OpSpec, case: Case, values: Tensors, reference: ReferenceTarget) -> torch.Tensor:
    """What the op adds to its output, in float64: the reference on the same inputs with the output zeroed.

    One generic run instead of knowing, per op, whether it accumulates (the delta is the oracle minus
    the initial output) or overwrites (``add_inputs=False``, ``apply_lora_full_linear``: the delta is
    what it writes); the systematic-error rule of the verdict fits the error against it.
    ``values`` in the case dtype or already in float64; ``reference`` already holds the case's mapping."""
    zeroed = _float64(values)
    zeroed[spec.output] = torch.zeros_like(zeroed[spec.output])
    return execute(spec, case, zeroed, reference, torch.device("cpu"), update_metadata=False)[spec.output]


def oracle_magnitude(spec: OpSpec, case: Case, values: Tensors, reference: ReferenceTarget) -> torch.Tensor:
    """The size of what each output element is summed from, in float64: the reference on the absolute
    values of every floating input (the initial output included), ``|y| + |x|·|A|·|B|`` for a LoRA
    linear. It bounds the oracle (``|o| ≤ m``) and is the scale rounding error is proportional to:
    where the terms cancel (one token, rank 1: one dot product over thousands of features), a
    correct target that sums in another order errs by ulps of ``m``, many ulps of ``|o|``. The
    budget and the systematic-error noise model allow float32 accumulation error in ulps of it
    (``conformance.verdict.tolerances``).
    ``values`` in the case dtype or already in float64; ``reference`` already holds the case's mapping."""
    absolute = {name: value.abs() if value.is_floating_point() else value for name, value in _float64(values).items()}
    return execute(spec, case, absolute, reference, torch.device("cpu"), update_metadata=False)[spec.output]


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


def run_case(target: Target, case: Case, case_id: str | None = None, values: Tensors | None = None) -> CaseResult:
    case_id = case_id or case.case_id
    features = case_features(case)
    if case.op not in target.implemented_ops():
        reason = target.not_implemented_reason(case.op)
    else:
        reason = target.unsupported_reason(case)
    if reason is not None:
        return CaseResult(case_id, case, Outcome.NOT_SUPPORTED, reason, features=features)
    spec = OP_SPECS[case.op]
    values = make_values(case) if values is None else values
    started = time.perf_counter()
    try:
        after = execute(spec, case, values, target, target.device)
    except NotImplementedError as exc:
        return CaseResult(case_id, case, Outcome.NOT_SUPPORTED, f"{case.op} raised NotImplementedError: {exc}", features=features)
    except Exception as exc:  # noqa: BLE001 - any crash of the target is the BROKEN outcome
        frame = traceback.extract_tb(exc.__traceback__)[-1]
        message = f"{type(exc).__name__}: {exc} (at {frame.filename}:{frame.lineno})"
        return CaseResult(
            case_id, case, Outcome.BROKEN, message, features=features, seconds=time.perf_counter() - started,
            kinds=(FailureKind.RAISED,),
        )
    seconds = time.perf_counter() - started
    if spec.check is not None:
        return _checked_result(spec, case, case_id, values, after, features, seconds)
    cpu = torch.device("cpu")
    # One reference wrapper for both runs: its metadata depends on the mapping only, not on the dtype,
    # so the baseline reuses what the oracle run built (a few percent of a wrapper case's time).
    reference = ReferenceTarget()
    exact = _float64(values)  # converted once: the oracle, its delta and its magnitude all read it
    oracle = execute(spec, case, exact, reference, cpu)[spec.output]
    baseline = execute(spec, case, values, reference, cpu, update_metadata=False)[spec.output]
    delta = oracle_delta(spec, case, exact, reference)
    magnitude = oracle_magnitude(spec, case, exact, reference)
    verdict = judge(after[spec.output], oracle, baseline, values[spec.output], spec.written_mask(case), delta, magnitude)
    changed = modified_inputs(spec, values, after)
    if verdict.passed and not changed:
        return CaseResult(case_id, case, Outcome.PASS, "", verdict.measurement, features, seconds)
    row_slots = spec.row_slots(case)
    uncovered = frozenset(row for row, covered in enumerate(case.covered_rows) if not covered) if spec.rows == "tokens" else frozenset()
    details = [f"{p.text}: {describe_rows(p.rows, row_slots, uncovered=uncovered)}" if p.rows else p.text for p in verdict.problems]
    details += [f"modified its input {name!r}, which every op must only read" for name in changed]
    failing_slots = tuple(sorted({row_slots[row] for p in verdict.problems for row in p.rows}))
    failing_slices = tuple(sorted({s for p in verdict.problems for s in slices_hit(case, after[spec.output], p)}))
    kinds = ordered([p.kind for p in verdict.problems] + [FailureKind.MODIFIED_INPUT] * bool(changed))
    return CaseResult(
        case_id, case, Outcome.FAIL, "; ".join(details), verdict.measurement, features, seconds, failing_slots, kinds=kinds,
        failing_slices=failing_slices,
    )


def _checked_result(spec: OpSpec, case: Case, case_id: str, values: Tensors, after: Tensors, features, seconds: float) -> CaseResult:
    """An op judged by its invariants (``OpSpec.check``), not against the oracle: each problem names its slot."""
    reshaped = [
        f"output {name!r} has shape {tuple(after[name].shape)} and dtype {after[name].dtype}; expected {tuple(values[name].shape)} and {values[name].dtype}"
        for name in spec.outputs
        if after[name].shape != values[name].shape or after[name].dtype != values[name].dtype
    ]
    if reshaped:  # the invariants read the outputs in their contract's layout
        return CaseResult(case_id, case, Outcome.FAIL, "; ".join(reshaped), None, features, seconds, kinds=(FailureKind.WRONG_OUTPUT_TYPE,))
    problems = spec.check(case, after, values)
    changed = modified_inputs(spec, values, after)
    if not problems and not changed:
        return CaseResult(case_id, case, Outcome.PASS, "", None, features, seconds)
    details = [f"slot {slot}: {text}" for slot, text in problems]
    details += [f"modified its input {name!r}, which every op must only read" for name in changed]
    kinds = ordered([FailureKind.INVARIANT] * bool(problems) + [FailureKind.MODIFIED_INPUT] * bool(changed))
    failing_slots = tuple(sorted({slot for slot, _ in problems}))
    return CaseResult(case_id, case, Outcome.FAIL, "; ".join(details), None, features, seconds, failing_slots, kinds=kinds)


def check_values(case: Case, values: Tensors) -> None:
    """Raise ``ValueError`` naming the tensor when ``values`` (e.g. from a replay) do not fit ``case``."""
    expected = make_values(case)
    missing, unexpected = sorted(set(expected) - set(values)), sorted(set(values) - set(expected))
    if missing or unexpected:
        raise ValueError(f"tensors do not fit the case: missing {missing}, unexpected {unexpected}")
    for name, tensor in expected.items():
        got = values[name]
        if got.shape != tensor.shape or got.dtype != tensor.dtype:
            raise ValueError(
                f"tensor {name!r} is {tuple(got.shape)} {got.dtype}, the case needs {tuple(tensor.shape)} {tensor.dtype}"
            )
