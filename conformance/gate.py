"""The gate: one verdict from many case results, as a release manager reads it.

The gate passes when at least one case ran, every case ended pass, not supported or known failure,
and pytest itself saw no other failure (a crashed worker, an error in the harness).
"""

from __future__ import annotations

from collections import Counter

from conformance.verdict import Outcome

GATE_RULE = "every case ends pass, not supported or known failure, and at least one case ran"


def summarize(results: list[dict]) -> dict:
    """Counts per op and outcome: the matrix of the report."""
    matrix: dict[str, dict[str, dict[str, int]]] = {}
    for result in results:
        cell = matrix.setdefault(result["op"], {}).setdefault(result["dtype"], {})
        cell[result["outcome"]] = cell.get(result["outcome"], 0) + 1
    return {"by_op_and_dtype": matrix}


def gate_verdict(results: list[dict], pytest_exitstatus: int = 0) -> dict:
    counts = Counter(result["outcome"] for result in results)
    reasons = []
    ran = sum(n for outcome, n in counts.items() if Outcome(outcome).ran)
    if ran == 0:
        reasons.append("no case ran")
    rejected = {o: n for o, n in counts.items() if not Outcome(o).accepted_by_gate}
    for outcome, count in sorted(rejected.items()):
        reasons.append(f"{count} case(s) ended {outcome}")
    if pytest_exitstatus not in (0, 1) and not rejected:
        reasons.append(f"pytest exited with status {int(pytest_exitstatus)} (interrupted, internal or usage error)")
    known: dict[str, dict] = {}
    for result in results:
        entry = result.get("expectation")
        if result["outcome"] == Outcome.KNOWN_FAILURE.value and entry:
            known.setdefault(entry["id"], {**entry, "cases": 0})["cases"] += 1
    return {
        "passed": not reasons,
        "rule": GATE_RULE,
        "reasons": reasons,
        "counts": {o.value: counts.get(o.value, 0) for o in Outcome},
        "known_failures": list(known.values()),
    }
