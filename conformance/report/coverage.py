"""What a run exercised: per op, how many cases of each dtype, edge-case family and feature ran.

The matrix says how cases ended per op × dtype; it does not say what they were. A PASS over 120
``add_lora_linear`` cases means something only if some mixed rows without adapter with adapter rows,
used the last slot, had unequal slices, odd hidden sizes, adapters of rank below the stack's maximum.
The features are those of ``conformance.cases.features`` (``FEATURE_DOCS``; end-to-end cases name
theirs with the same words), read off each case when it was judged: what its op served (a slot, rank or
routing corner counts only on a row an adapter serves), not what was drawn.

Counted are the cases the target ran (every outcome but *not supported*, which exercised nothing),
each with how many of them passed: ``{"cases": n, "passed": m}`` per op, and per dtype, family and
feature of that op. ``HEADLINE`` are the features the report shows as columns.
"""

from __future__ import annotations

from conformance.cases.features import FEATURE_DOCS
from conformance.ops.level import LEVEL_ORDER
from conformance.verdict import Outcome

HEADLINE = ("neg1", "allneg1", "last_slot", "unequal_slices", "odd_hidden", "rank_padded")
COUNTED = (
    "cases the target ran (every outcome but not supported), and of them those that passed; "
    "a feature counts a case only where a row an adapter serves exercised it"
)


def _tally(counts: dict, name: str, passed: bool) -> None:
    entry = counts.setdefault(name, {"cases": 0, "passed": 0})
    entry["cases"] += 1
    entry["passed"] += passed


def coverage(results: list[dict]) -> dict:
    """``{"counted", "features", "ops": {op: {level, cases, passed, not_supported, dtypes, families, features}}}``."""
    ops: dict[str, dict] = {}
    for record in results:
        op = ops.setdefault(record["op"], {
            "level": record.get("level") or "other", "cases": 0, "passed": 0, "not_supported": 0,
            "dtypes": {}, "families": {}, "features": {},
        })  # fmt: skip
        if record.get("outcome") == Outcome.NOT_SUPPORTED.value:
            op["not_supported"] += 1
            continue
        passed = record.get("outcome") == Outcome.PASS.value
        op["cases"] += 1
        op["passed"] += passed
        _tally(op["dtypes"], record.get("dtype") or "?", passed)
        _tally(op["families"], record.get("family") or "?", passed)
        for feature in record.get("features") or ():
            _tally(op["features"], feature, passed)
    rank = {level: i for i, level in enumerate(LEVEL_ORDER)}
    ordered = sorted(ops, key=lambda name: (rank.get(ops[name]["level"], len(rank)), name))
    for op in ops.values():
        for part in ("dtypes", "families"):
            op[part] = dict(sorted(op[part].items()))
        known = [f for f in FEATURE_DOCS if f in op["features"]]  # the vocabulary's order, then any other
        op["features"] = {f: op["features"][f] for f in known + sorted(set(op["features"]) - set(known))}
    return {"counted": COUNTED, "headline": list(HEADLINE), "ops": {name: ops[name] for name in ordered}}


def add_coverage(document: dict) -> dict:
    """Put ``coverage`` into a results document, before its results; return the document."""
    results = document.pop("results", None) or []
    document["coverage"] = coverage(results)
    document["results"] = results
    return document


def document_coverage(document: dict) -> dict:
    """The document's coverage, counted from its results where it has none (a document of an older suite)."""
    if isinstance(document.get("coverage"), dict):
        return document["coverage"]
    return coverage(document.get("results") or [])
