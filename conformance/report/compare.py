"""Comparing runs of different targets over the same cases (``python -m conformance.report compare``).

Runs of two or more targets (or of one target on two machines) with the same profile and seed judge
the same cases, so their results can be read side by side: the comparison (``compare.json``; rendered
as ``compare.html`` by ``conformance.report.compare_html``) holds

* ``runs``: each input, labelled by its target (and its source where two inputs share a target);
* ``cells``: per level × op × dtype, each run's outcome counts and the quantiles of its budget ratios,
  and, over the cases every run passes, which run is closer to the reference (``closer``);
* ``differing``: the cases whose outcomes differ among the runs that support them, with each run's
  outcome, kind, message and repro;
* ``unsupported``: the cases some runs do not support (and the others' outcomes);
* ``e2e``: per end-to-end case, whether the runs generated the same tokens, where they first differ,
  and whether each run's tokens are the reference's.

Runs are comparable only if they were to judge the same cases: inputs with another profile or seed,
another case list (cases only one of them holds, or the whole profile's list), or a case drawn
differently under the same id are refused (:class:`CompareError`), the message naming the difference.
Unlike a merge, inputs drawn with different Hypothesis versions are not refused for it: every case's
drawn content is compared instead, which is what a Hypothesis version could change, and runs of two
targets often come from two machines.
"""

from __future__ import annotations

import math
from collections import Counter
from pathlib import Path

from conformance.e2e.cases import KINDS
from conformance.ops import Level
from conformance.report.merge import MergeError, read_document
from conformance.verdict import Outcome
from conformance.verdict.judge import number_from_json

MISSING = "missing"  # an expected case without a result in that run (killed run, missing shard)
OUTCOMES = (*(outcome.value for outcome in Outcome), MISSING)  # the order of counts and badges
SAME_FIELDS = ("profile", "seed")
QUANTILES = {"q25": 0.25, "median": 0.5, "q75": 0.75}
# The end-to-end invariance checks measure a target against itself in another batch, not against the
# reference: their budget ratios say nothing about which target is closer to the reference.
SELF_MEASURED_OPS = frozenset(prefix + kind for kind in KINDS if kind.endswith("_invariance") for prefix in ("", "moe_"))


class CompareError(ValueError):
    """The inputs cannot be compared: they did not judge the same cases."""


def read_run(path) -> dict:
    """The results document at ``path`` (a results.json, or a report dir holding one)."""
    path = Path(path)
    try:
        return read_document(path / "results.json" if path.is_dir() else path)
    except MergeError as exc:  # the same reading and the same messages as a merge's
        raise CompareError(str(exc)) from None


def compare_documents(documents: list[dict], sources: list[str] | None = None) -> dict:
    """The comparison (``compare.json``) of ``documents``; :class:`CompareError` if they are not comparable."""
    sources = [str(s) for s in sources] if sources else [f"input {i + 1}" for i in range(len(documents))]
    check_comparable(documents, sources)
    labels = run_labels(documents, sources)
    by_run = {label: {r["id"]: r for r in document["results"]} for label, document in zip(labels, documents)}
    case_ids = case_list(documents[0])
    cases = [_case(case_id, by_run) for case_id in case_ids]
    cells = _cells(cases, labels)
    closer = Counter(cell["closer"]["closer"] for cell in cells if cell["closer"] and cell["closer"]["cases"])
    return {
        "profile": documents[0].get("profile"),
        "seed": documents[0].get("seed"),
        "case_list": documents[0].get("case_list"),
        "cases": len(case_ids),
        "runs": [_run(label, source, document) for label, source, document in zip(labels, sources, documents)],
        "summary": {
            "differing": sum(1 for case in cases if _differs(case, labels)),
            "unsupported_by_some": sum(1 for case in cases if _unsupported_by_some(case, labels)),
            "unsupported_by_all": sum(1 for case in cases if not _supporters(case, labels)),
            # the op × dtype cells where each run is closer to the reference, over the cases every run passes
            "closer": {label: closer.get(label, 0) for label in labels},
            "as_close": sum(1 for cell in cells if cell["closer"] and cell["closer"]["cases"] and cell["closer"]["closer"] is None),
        },
        "cells": cells,
        "differing": [_case_detail(case, labels) for case in cases if _differs(case, labels)],
        "unsupported": [_unsupported_detail(case, labels) for case in cases if _unsupported_by_some(case, labels)],
        "e2e": [_tokens(case, labels) for case in cases if case["level"] == Level.MODEL.value],
    }


# -- which runs can be compared --------------------------------------------------------------------


def case_list(document: dict) -> list[str]:
    """The cases a run was to judge (its manifest's ``expected``; its results' ids for an older document)."""
    expected = document.get("expected")
    return list(expected) if isinstance(expected, list) else [r["id"] for r in document["results"]]


def check_comparable(documents: list[dict], sources: list[str]) -> None:
    """Refuse inputs that did not judge the same cases, naming every difference found."""
    if len(documents) < 2:
        raise CompareError(f"compare needs the results of at least two runs, got {len(documents)}")
    first, first_source = documents[0], sources[0]
    differences = []
    for field in SAME_FIELDS:
        for source, document in zip(sources[1:], documents[1:]):
            if document.get(field) != first.get(field):
                differences.append(f"{field} {first.get(field)!r} in {first_source} but {document.get(field)!r} in {source}")
    first_ids = case_list(first)
    for source, document in zip(sources[1:], documents[1:]):
        ids = case_list(document)
        only_first = sorted(set(first_ids) - set(ids))
        only_other = sorted(set(ids) - set(first_ids))
        if only_first or only_other:
            differences.append(
                f"their case lists differ: {len(only_first)} case(s) only in {first_source}"
                + (f" ({_listed(only_first)})" if only_first else "")
                + f", {len(only_other)} only in {source}"
                + (f" ({_listed(only_other)})" if only_other else "")
            )
        elif first.get("case_list") and document.get("case_list") and document["case_list"] != first["case_list"]:
            # the same selection of two different profiles' lists (a -k over other suite versions)
            differences.append(
                f"{source} was drawn from another whole case list ({document['case_list']['count']} cases, "
                f"{document['case_list']['digest']}) than {first_source} ({first['case_list']['count']} cases, "
                f"{first['case_list']['digest']})"
            )
        redrawn = _drawn_differently(first, document)
        if redrawn:
            differences.append(
                f"{len(redrawn)} case(s) were drawn differently under the same id in {first_source} and {source} "
                f"({_listed(redrawn)})"
            )
    if differences:
        raise CompareError("cannot compare: " + "; ".join(differences))


def _drawn_differently(first: dict, other: dict) -> list[str]:
    """Ids whose case (structure and seed, as recorded in each result) is not the same in both runs."""
    theirs = {r["id"]: r.get("case") for r in other["results"]}
    return sorted(
        r["id"] for r in first["results"] if r.get("case") and theirs.get(r["id"]) and r["case"] != theirs[r["id"]]
    )


def _listed(ids: list[str], shown: int = 5) -> str:
    """The first few ids and how many more: a refusal names the difference without flooding the terminal."""
    return ", ".join(ids[:shown]) + (f", … ({len(ids) - shown} more)" if len(ids) > shown else "")


def run_labels(documents: list[dict], sources: list[str]) -> list[str]:
    """Each run's target name; where two inputs share one, the name and the input's source."""
    names = [str(d.get("target_name") or d.get("target") or "?") for d in documents]
    counts = Counter(names)
    return [name if counts[name] == 1 else f"{name} ({source})" for name, source in zip(names, sources)]


def _run(label: str, source: str, document: dict) -> dict:
    gate = document.get("gate") or {}
    environment = document.get("environment") or {}
    return {
        "label": label,
        "source": source,
        "target": document.get("target"),
        "expectations": document.get("expectations"),
        "suite_version": document.get("suite_version"),
        "gate_passed": gate.get("passed"),
        "counts": dict(Counter(r["outcome"] for r in document["results"])),
        "missing": len(document.get("missing") or []),
        # which cases were not deterministic in this run (conformance.record): ids by stability
        "stability": {label: sorted(r["id"] for r in document["results"] if r.get("stability") == label)
                      for label in ("nondeterministic", "flaky")},
        "environment": {key: environment[key] for key in ("device", "torch", "vllm", "git_commit") if key in environment},
    }


# -- per case --------------------------------------------------------------------------------------


def _case(case_id: str, by_run: dict[str, dict[str, dict]]) -> dict:
    """The case's record in each run (None where it has no result), and what it is (from any record)."""
    records = {label: results.get(case_id) for label, results in by_run.items()}
    known = next((r for r in records.values() if r), {})
    return {
        "id": case_id,
        "level": known.get("level") or "unknown",
        "op": known.get("op") or "unknown",
        "dtype": known.get("dtype") or "unknown",
        "family": known.get("family"),
        "records": records,
    }


def outcome_of(case: dict, label: str) -> str:
    record = case["records"][label]
    return record["outcome"] if record else MISSING


def _supporters(case: dict, labels: list[str]) -> list[str]:
    return [label for label in labels if outcome_of(case, label) != Outcome.NOT_SUPPORTED.value]


def _differs(case: dict, labels: list[str]) -> bool:
    """Outcomes differ among the runs that support the case (a target that does not is listed apart)."""
    return len({outcome_of(case, label) for label in _supporters(case, labels)}) > 1


def _unsupported_by_some(case: dict, labels: list[str]) -> bool:
    return 0 < len(_supporters(case, labels)) < len(labels)


def _ratio(record: dict | None) -> float | None:
    return number_from_json(((record or {}).get("measurement") or {}).get("budget_ratio"))


def _case_detail(case: dict, labels: list[str]) -> dict:
    runs = {}
    for label in labels:
        record = case["records"][label] or {}
        runs[label] = {
            "outcome": outcome_of(case, label),
            "kind": record.get("kind"),
            "message": record.get("message") or "",
            "repro": record.get("repro"),
            "replay": record.get("replay"),
            "budget_ratio": _ratio(record),
        }
    return {key: case[key] for key in ("id", "level", "op", "dtype", "family")} | {"runs": runs}


def _unsupported_detail(case: dict, labels: list[str]) -> dict:
    detail = _case_detail(case, labels)
    detail["not_supported_by"] = [label for label in labels if outcome_of(case, label) == Outcome.NOT_SUPPORTED.value]
    return detail


# -- per level × op × dtype ------------------------------------------------------------------------


def quantiles(values: list[float]) -> dict | None:
    """n, min, quartiles and max (linear interpolation), or None without values."""
    if not values:
        return None
    ordered = sorted(values)

    def at(q: float) -> float:
        position = q * (len(ordered) - 1)
        low = math.floor(position)
        high = min(low + 1, len(ordered) - 1)
        if ordered[low] == ordered[high]:  # also keeps inf - inf out of the interpolation
            return ordered[low]
        return ordered[low] + (ordered[high] - ordered[low]) * (position - low)

    return {"n": len(ordered), "min": ordered[0], **{name: at(q) for name, q in QUANTILES.items()}, "max": ordered[-1]}


def _cells(cases: list[dict], labels: list[str]) -> list[dict]:
    grouped: dict[tuple[str, str, str], list[dict]] = {}
    for case in cases:
        grouped.setdefault((case["level"], case["op"], case["dtype"]), []).append(case)
    cells = []
    for (level, op, dtype), members in grouped.items():
        runs = {}
        for label in labels:
            ratios = [r for r in (_ratio(case["records"][label]) for case in members) if r is not None]
            counts = Counter(outcome_of(case, label) for case in members)
            runs[label] = {
                "counts": {o: counts[o] for o in OUTCOMES if counts[o]},
                "budget_ratio": quantiles(ratios),
                "ratios": ratios,  # every measured case's, in case order: the plot's dots
            }
        cells.append({
            "level": level, "op": op, "dtype": dtype, "cases": len(members), "runs": runs,
            "closer": None if op in SELF_MEASURED_OPS else closer_to_reference(members, labels),
        })  # fmt: skip
    return sorted(cells, key=lambda c: (c["level"], c["op"], c["dtype"]))


def closer_to_reference(cases: list[dict], labels: list[str]) -> dict:
    """Over the cases every run passes with a measurement: which run is closer to the reference.

    Per case the run with the smallest budget ratio is closest (a case's budget is the same in every
    run, so this is also the smallest error); the run closest on more cases is the closer one, the
    smaller median ratio deciding a tie; equal on both, none is (``closer`` None). Medians of the
    budget ratio, the max abs error and the SQNR (higher is closer) say by how much.
    """
    both_pass = [
        case for case in cases
        if all(outcome_of(case, label) == Outcome.PASS.value and _ratio(case["records"][label]) is not None for label in labels)
    ]  # fmt: skip
    closest_on: Counter = Counter()
    ties = 0
    for case in both_pass:
        ratios = {label: _ratio(case["records"][label]) for label in labels}
        best = min(ratios.values())
        winners = [label for label, ratio in ratios.items() if ratio == best]
        if len(winners) == 1:
            closest_on[winners[0]] += 1
        else:
            ties += 1

    def median(label: str, field: str) -> float | None:
        values = [number_from_json((case["records"][label].get("measurement") or {}).get(field)) for case in both_pass]
        found = quantiles([v for v in values if v is not None])
        return found["median"] if found else None

    medians = {field: {label: median(label, field) for label in labels} for field in ("budget_ratio", "max_abs_error", "sqnr_db")}
    ranking = sorted(labels, key=lambda label: (-closest_on[label], medians["budget_ratio"][label] or 0.0))
    leader, runner_up = ranking[0], ranking[1]
    same = closest_on[leader] == closest_on[runner_up] and medians["budget_ratio"][leader] == medians["budget_ratio"][runner_up]
    return {
        "cases": len(both_pass),
        "closer": None if same or not both_pass else leader,
        "closest_on": {label: closest_on[label] for label in labels},
        "ties": ties,
        "median": medians,
    }


# -- end-to-end tokens -----------------------------------------------------------------------------


def _tokens(case: dict, labels: list[str]) -> dict:
    """Whether the runs generated the same tokens for the case, where they first differ, and whether
    each run's tokens are the reference's (a difference within a near-tie can still pass)."""
    recorded = {label: (case["records"][label] or {}).get("tokens") for label in labels}
    runs = {label: {"outcome": outcome_of(case, label), **_against_reference(recorded[label])} for label in labels}
    entry = {key: case[key] for key in ("id", "op", "dtype")} | {"runs": runs}
    without = [label for label, tokens in recorded.items() if not tokens]
    if without:
        why = ", ".join(f"{label} ({runs[label]['outcome']})" for label in without)
        return entry | {"agree": None, "why": f"no tokens recorded by {why}", "first_difference": None}
    sources = {tokens["source"] for tokens in recorded.values()}
    entry["source"] = sources.pop() if len(sources) == 1 else "; ".join(sorted(sources))
    generated = {label: tokens["target"] for label, tokens in recorded.items()}
    difference = first_difference(generated)
    if difference:
        requests = ((case["records"][labels[0]] or {}).get("case") or {}).get("requests") or []
        if difference["request"] < len(requests):
            difference |= {"adapter": requests[difference["request"]].get("adapter"), "prompt": requests[difference["request"]].get("prompt")}
        differing = sum(1 for per_request in zip(*generated.values()) if len({tuple(t) for t in per_request}) > 1)
        difference |= {"requests_differing": differing, "requests": max(len(tokens) for tokens in generated.values())}
    return entry | {"agree": difference is None, "first_difference": difference}


def first_difference(generated: dict[str, list[list[int]]]) -> dict | None:
    """The first request (batch order) and position where the runs' token lists are not all equal, with
    each run's token there (None past its end); None when they agree everywhere."""
    lists = list(generated.values())
    for request in range(max(len(tokens) for tokens in lists)):
        per_run = {label: tokens[request] if request < len(tokens) else [] for label, tokens in generated.items()}
        if len({tuple(t) for t in per_run.values()}) == 1:
            continue
        length = max(len(t) for t in per_run.values())
        position = next(p for p in range(length) if len({t[p] if p < len(t) else None for t in per_run.values()}) > 1)
        return {"request": request, "position": position, "tokens": {label: t[position] if position < len(t) else None for label, t in per_run.items()}}
    return None


def _against_reference(tokens: dict | None) -> dict:
    if not tokens:
        return {"matches_reference": None, "reference_difference": None}
    difference = first_difference({"target": tokens["target"], "reference": tokens["reference"]})
    return {
        "matches_reference": difference is None,
        "reference_difference": None if difference is None else {key: difference[key] for key in ("request", "position")},
    }
