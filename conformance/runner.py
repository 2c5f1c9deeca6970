"""Running one op case on one target and judging it, in one process: the two halves put together.

An op case has two halves that a run keeps in two processes (``conformance.isolation``): the target's
(``conformance.target_call``: call the op as vLLM would, hand back everything it was given) and the
referee's (``conformance.referee``: draw the values, the float64 oracle, the judgement). :func:`run_case`
runs both here, for scripts, the suite's own tests and ``--isolation=none`` (a debugger): there the
referee shares the target's process, which a verdict for a release must not (the results say so).

1. an op the target does not implement (``implemented_ops``), then ``unsupported_reason`` → NOT_SUPPORTED,
   without touching the target's ops;
2. the target runs the op on the case's values ``runs`` times (on its device); an exception → BROKEN;
3. the referee judges every call (PASS or FAIL, the message naming rows and slots, modified inputs
   and metadata), and a failing case is attempted once more to tell a consistent failure from a
   flaky one.
"""

from __future__ import annotations

from collections.abc import Callable

from conformance.cases.case import Case
from conformance.cases.values import generator_for
from conformance.ops import OP_SPECS
from conformance.record import CaseResult
from conformance.referee import as_float64, describe_rows, judge_op, oracle_delta, oracle_magnitude, slices_hit
from conformance.target_call import DEFAULT_RUNS, TargetCall, Tensors, call_target, execute
from conformance.verdict import FailureKind, Outcome

__all__ = [
    "DEFAULT_RUNS", "CaseResult", "TargetCall", "Tensors", "as_float64", "check_values", "describe_rows", "execute", "make_values",
    "attempted", "needs_second_attempt", "oracle_delta", "oracle_magnitude", "run_case", "slices_hit",
]  # fmt: skip


def make_values(case: Case) -> Tensors:
    """The case's input tensors, on the CPU, from its seed."""
    return OP_SPECS[case.op].make_values(case, generator_for(case))


# kinds that cost the target's process (it was stopped): no second attempt, no shrinking
PROCESS_LOST = (FailureKind.CRASHED, FailureKind.TIMED_OUT, FailureKind.MALFORMED_REPLY)


def needs_second_attempt(result: CaseResult) -> bool:
    """A failure the target reported (not a crash, a hang or a refused reply, which cost a process) is attempted again:
    the second attempt tells a consistent failure from a flaky one."""
    return result.outcome in (Outcome.FAIL, Outcome.BROKEN) and not any(
        kind in PROCESS_LOST for kind in result.kinds)


def attempted(call: Callable[[], TargetCall], case: Case, case_id: str, values: Tensors, *, require_deterministic: bool = False,
              second_attempt: bool = True, breakdowns: tuple[type[Exception], ...] = (), expected: Tensors | None = None) -> CaseResult:
    """The verdict on ``case`` from ``call`` (one attempt of the target's half, wherever it runs), attempted a
    second time when the first failed (``needs_second_attempt``). One of ``breakdowns`` (the target's
    process died or hung) from the second attempt leaves the first attempt's verdict, labelled flaky; from
    the first it propagates, for the caller to record the case broken."""
    attempts = [call()]
    result = judge_op(case, case_id, values, attempts, require_deterministic=require_deterministic, expected=expected)
    if not (second_attempt and needs_second_attempt(result)):
        return result
    try:
        attempts.append(call())
    except breakdowns as exc:
        result.stability = "flaky"
        result.message += f" (flaky: attempt 2 {exc.kind.value}: {getattr(exc, 'message', None) or exc})"
        return result
    return judge_op(case, case_id, values, attempts, require_deterministic=require_deterministic, expected=expected)


def run_case(target, case: Case, case_id: str | None = None, values: Tensors | None = None, *, runs: int = DEFAULT_RUNS,
             require_deterministic: bool = False, second_attempt: bool = True) -> CaseResult:
    """``case`` on ``target``, both halves in this process (see the module docstring)."""
    values = make_values(case) if values is None else values
    return attempted(lambda: call_target(target, case, values, runs), case, case_id or case.case_id, values,
                     require_deterministic=require_deterministic, second_attempt=second_attempt)


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
