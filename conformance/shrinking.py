"""Shrinking a failure to the smallest case that still fails the same way.

The profile's cases are drawn by Hypothesis, so Hypothesis can also search the same op × dtype ×
family space for a failing case and shrink it: fewer sequences, fewer slots, lower ranks, smaller
sizes, seed 0. "The same way" means the same outcome and the same failure kinds
(``conformance.verdict.FailureKind``: wrote outside its region, NaN/Inf, over budget, raised, …), and
for a failure confined to rows without adapter, still confined to them. The result is a case a kernel
author can read in full.

The search runs beside the referee; each candidate's target call goes to the process that runs the
target, and comes back to be judged like any case (``run``), so the failures shrunk are those the
target reports by returning or raising; a crash or a hang of a candidate ends the search
(``conformance.isolation`` reports it), which is why crashed and timed-out cases are not shrunk.
"""

from __future__ import annotations

from collections.abc import Callable

from hypothesis import HealthCheck, Phase, given, settings

from conformance.cases.case import Case
from conformance.compat import without_hypothesis_local_constants
from conformance.generator.limits import Limits
from conformance.generator.strategies import cases
from conformance.ops import OP_SPECS
from conformance.record import CaseResult


def failure_signature(result: CaseResult) -> tuple:
    """What makes two failures "the same": outcome, failure kinds, confined to no-adapter rows."""
    return result.outcome, frozenset(result.kinds), set(result.failing_slots) == {-1}


def shrink_failure(run: Callable[[Case], CaseResult], failing: CaseResult, limits: Limits, max_examples: int = 300) -> Case | None:
    """The smallest case of ``failing``'s op, dtype and family that fails like it, or None.

    ``run`` judges one candidate (``conformance.runner.run_case`` bound to a target, or the session's
    own path through the target's worker process)."""
    wanted = failure_signature(failing)
    strategy = cases(OP_SPECS[failing.case.op], failing.case.dtype, failing.case.family, limits)
    smallest: list[Case] = []

    @settings(
        max_examples=max_examples,
        phases=[Phase.generate, Phase.shrink],
        database=None,
        derandomize=True,
        deadline=None,
        report_multiple_bugs=False,
        suppress_health_check=list(HealthCheck),
    )
    @given(strategy)
    def fails_the_same_way(case: Case) -> None:
        if failure_signature(run(case)) == wanted:
            smallest.append(case)
            raise AssertionError("fails the same way")

    try:
        with without_hypothesis_local_constants():
            fails_the_same_way()
    except AssertionError:
        pass
    return smallest[-1] if smallest else None  # Hypothesis replays the shrunk example last
