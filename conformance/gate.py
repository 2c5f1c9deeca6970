"""The gate: one verdict from many case results, as a release manager reads it.

The gate passes when at least one case ran, every case ended pass, not supported or known failure,
every case the run was to judge has a result, and pytest itself saw no other failure (an error in the
harness). A case without a result is never a pass: the run was killed before it, or a process died in
a way nothing recorded; ``missing`` names them.
"""

from __future__ import annotations

from collections import Counter

from conformance.verdict import Outcome

GATE_RULE = "every expected case has a result, every result is pass, not supported or known failure, and at least one case ran"
SHOWN_IDS = 10


def summarize(results: list[dict]) -> dict:
    """Counts per op and outcome: the matrix of the report."""
    matrix: dict[str, dict[str, dict[str, int]]] = {}
    for result in results:
        cell = matrix.setdefault(result["op"], {}).setdefault(result["dtype"], {})
        cell[result["outcome"]] = cell.get(result["outcome"], 0) + 1
    return {"by_op_and_dtype": matrix}


def listed(ids: list[str]) -> str:
    """The first ids and how many more: for reasons a person reads."""
    return ", ".join(ids[:SHOWN_IDS]) + (f", … ({len(ids) - SHOWN_IDS} more)" if len(ids) > SHOWN_IDS else "")


def gate_verdict(
    results: list[dict], pytest_exitstatus: int = 0, *, missing: list[str] = (), unexpected: list[str] = ()
) -> dict:
    """The gate over ``results``; ``missing``: expected case ids without a result; ``unexpected``: results of
    cases the run did not expect."""
    counts = Counter(result["outcome"] for result in results)
    reasons = []
    if missing:
        reasons.append(f"{len(missing)} expected case(s) have no result: {listed(list(missing))}")
    if unexpected:
        reasons.append(f"{len(unexpected)} result(s) of cases this run did not expect: {listed(list(unexpected))}")
    ran = sum(n for outcome, n in counts.items() if Outcome(outcome).ran)
    if ran == 0:
        reasons.append("no case ran")
    rejected = {o: n for o, n in counts.items() if not Outcome(o).accepted_by_gate}
    stability = Counter(r.get("stability") for r in results if r.get("stability") in ("flaky", "nondeterministic"))
    flaky_rejected = Counter(r["outcome"] for r in results if r.get("stability") == "flaky")
    for outcome, count in sorted(rejected.items()):
        flaky = f" ({flaky_rejected[outcome]} of them flaky: a second attempt ended otherwise)" if flaky_rejected[outcome] else ""
        reasons.append(f"{count} case(s) ended {outcome}{flaky}")
    if pytest_exitstatus not in (0, 1) and not rejected and not missing:
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
        "counts": {**{o.value: counts.get(o.value, 0) for o in Outcome}, "no result": len(missing)},
        "known_failures": list(known.values()),
        # how many results were not deterministic (conformance.record): a flaky one fails like any other,
        # a nondeterministic pass passes unless the run required determinism
        "stability": {"flaky": stability.get("flaky", 0), "nondeterministic": stability.get("nondeterministic", 0)},
    }
