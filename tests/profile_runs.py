"""Running a target over a list of cases, for tests that assert a whole profile passes."""

from __future__ import annotations

import collections

from conformance.runner import run_case
from conformance.verdict import Outcome


def run_profile(target, cases) -> tuple[collections.Counter, list[str]]:
    """Outcome counts, and ``"id: outcome: message"`` for every case that did not pass."""
    outcomes, problems = collections.Counter(), []
    for case_id, case in cases:
        result = run_case(target, case, case_id)
        outcomes[result.outcome] += 1
        if result.outcome is not Outcome.PASS:
            problems.append(f"{case_id}: {result.outcome.value}: {result.message}")
    return outcomes, problems
