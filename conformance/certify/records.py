"""One record of a bundle: its digest, and whether its outcome follows from its measurement.

**The record digest** chains an outcome to what decided it: SHA-256 over the canonical JSON
(``conformance.digest.canonical_json``: sorted keys, no spaces, ASCII) of the record's
``RECORD_FIELDS``: its id and case, the digest of the inputs it was judged on, the oracle's fingerprint,
the outcome with its failure kinds, the measurement, and the expectation (waiver) that turned a failure
into a known one. Editing any of them without computing the digest again is caught by comparing the
digests a bundle lists (``digests.json``) with those of its records. The digests are not signed: they
make an edit evident, and a forger who recomputes them is caught by the verdict rules below, by the
list's inputs digests, or by ``verify --rejudge`` (docs/certification.md).

**The verdict rules** (:func:`outcome_problems`): which outcomes a measurement allows, for the records
whose measurement is the op verdict's (``conformance.verdict.judge.Measurement``: kernel, wrapper and
tensor-parallel layer cases). The judge fails a result when its largest error exceeds the budget
(``budget_ratio`` > 1: kind ``numerics``, or ``wrote nothing`` when nothing arrived), and inside the
budget when the error's part along the delta is past its threshold (``systematic_ratio`` > 1: kind
``systematic error``) or its spread is (``precision_ratio`` > ``precision_threshold``: kind
``coarse precision``); the record's measurement is the call that decided the outcome (the failing call
of a failure, the largest budget ratio of a pass). So:

* a pass (or an unexpected pass) has no kinds, and its numbers pass all three rules;
* a fail or known failure that lists one of those kinds has numbers that fail that rule, and one whose
  numbers fail a rule lists the rule's kind.

What the numbers cannot tell is not checked: NaN/Inf elements (measured apart from the finite error),
writes outside the region, modified inputs, broken invariants, nondeterminism, raised or crashed calls,
and the model level's log-prob measurement (greedy generation is judged by its tokens, so a pass may
carry a log-prob error past the teacher-forced bound). A case the target did not run (not supported)
has no measurement.
"""

from __future__ import annotations

import math

from conformance.digest import canonical_json, sha256
from conformance.verdict import FailureKind, Outcome

RECORD_FIELDS = ("id", "case", "inputs_digest", "oracle_fingerprint", "outcome", "kinds", "measurement", "expectation")
PASSED = (Outcome.PASS.value, Outcome.UNEXPECTED_PASS.value)
FAILED = (Outcome.FAIL.value, Outcome.KNOWN_FAILURE.value)
OVER_BUDGET = (FailureKind.NUMERICS.value, FailureKind.WROTE_NOTHING.value)
OP_MEASUREMENT = ("budget", "budget_ratio", "max_abs_error")  # the fields that make a measurement the op verdict's


def record_digest(record: dict) -> str:
    """``sha256:<hex>`` of the record's ``RECORD_FIELDS`` (absent fields as null; a non-finite number as the
    string ``inf``, ``-inf`` or ``nan``, as ``Measurement.to_json`` writes one: an end-to-end case's log-prob
    error is infinite where the target gave a token no probability)."""
    return sha256(canonical_json(_finite({name: record.get(name) for name in RECORD_FIELDS})))


def _finite(value):
    """``value`` with every non-finite float written as its string (canonical JSON holds no NaN or Infinity)."""
    if isinstance(value, float) and not math.isfinite(value):
        return str(value)
    if isinstance(value, dict):
        return {key: _finite(item) for key, item in value.items()}
    if isinstance(value, list):
        return [_finite(item) for item in value]
    return value


def _number(measurement: dict, name: str) -> float | None:
    """A measurement's number: JSON numbers, and the strings ``inf``/``nan`` a non-finite one is written
    as (``Measurement.to_json``); None when absent; ValueError for anything else."""
    value = measurement.get(name)
    if value is None:
        return None
    if isinstance(value, str) and value.strip().lower() in ("inf", "+inf", "-inf", "nan"):
        return float(value)
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        raise ValueError(f"measurement {name} is {value!r}, not a number")
    return float(value)


def outcome_problems(record: dict) -> list[str]:
    """Why ``record``'s outcome and kinds do not follow from its measurement and the verdict rules (empty
    when they do, or when the numbers cannot tell: see the module docstring)."""
    outcome, kinds, measurement = record.get("outcome"), record.get("kinds") or [], record.get("measurement")
    if outcome not in {o.value for o in Outcome}:
        return [f"outcome {outcome!r} is not one of the suite's outcomes"]
    if not isinstance(kinds, list) or not all(isinstance(kind, str) for kind in kinds):
        return [f"kinds {kinds!r} is not a list of failure kinds"]
    if outcome == Outcome.NOT_SUPPORTED.value:
        return ["not supported, yet it records a measurement: a case the target did not run has none"] if measurement else []
    if outcome in PASSED and kinds:
        return [f"a {outcome} that records failure kinds {kinds}"]
    if outcome in FAILED and not kinds:
        return [f"a {outcome} that records no failure kind"]
    if not isinstance(measurement, dict) or not all(name in measurement for name in OP_MEASUREMENT):
        return []  # no measurement, or the model level's: nothing here derives the outcome
    try:
        budget = _number(measurement, "budget_ratio")
        systematic = _number(measurement, "systematic_ratio")
        precision, threshold = _number(measurement, "precision_ratio"), _number(measurement, "precision_threshold")
    except ValueError as exc:
        return [str(exc)]
    if budget is None or math.isnan(budget):
        return [f"measurement budget_ratio is {measurement.get('budget_ratio')!r}: the verdict needs a number"]
    within = budget <= 1
    biased = within and systematic is not None and systematic > 1
    coarse = within and precision is not None and threshold is not None and precision > threshold
    numbers = (f"budget_ratio {budget:.6g}" + (f", systematic_ratio {systematic:.6g}" if systematic is not None else "")
               + (f", precision_ratio {precision:.6g} against threshold {threshold:g}" if precision is not None and threshold is not None else ""))
    if outcome in PASSED:
        failed = [rule for rule, broken in (("the error exceeds its budget", not within), ("the error is biased along the delta", biased),
                                             ("the error has the spread of a coarser dtype", coarse)) if broken]
        return [f"recorded {outcome}, but its measurement ({numbers}) fails: {'; '.join(failed)}"] if failed else []
    if outcome not in FAILED:
        return []  # broken: the target did not return normally; its measurement (of earlier calls) decides nothing
    problems = []
    claimed = set(kinds)
    for kind, shows, rule in (
        (OVER_BUDGET, not within, "budget_ratio > 1"),
        ((FailureKind.SYSTEMATIC.value,), biased, "systematic_ratio > 1 inside the budget"),
        ((FailureKind.PRECISION.value,), coarse, "precision_ratio > precision_threshold inside the budget"),
    ):
        listed = claimed & set(kind)
        if listed and not shows and not _at_edge(kind, budget, systematic, precision, threshold):
            problems.append(f"recorded kind {sorted(listed)[0]!r}, but its measurement ({numbers}) does not show it ({rule} is false)")
        if shows and not listed:
            problems.append(f"its measurement ({numbers}) shows {rule}, but its kinds {kinds} do not list {kind[0]!r}")
    return problems


def _at_edge(kind: tuple[str, ...], budget: float, systematic: float | None, precision: float | None, threshold: float | None) -> bool:
    """A ratio of exactly 1 whose failure was decided before the division rounded it (``error > budget`` with
    ``error / budget`` rounding to 1.0): a failure at the edge, not an edited one."""
    if kind == OVER_BUDGET:
        return budget == 1
    if kind == (FailureKind.SYSTEMATIC.value,):
        return budget <= 1 and systematic == 1
    return False
