"""Merge the results of many shards or machines into one results document, and gate it again.

Every input must come from the same suite version, target, profile and seed, drawn by the same
Hypothesis version, with the same case list (the ``case_list`` digest each run records): otherwise
the cases are not the same population and the merged verdict would mean nothing; such inputs are
refused. Each input's environment fingerprint is kept (``environments``) when they differ, and every
input's workers with their devices (``workers``). The failure clusters and the coverage are those of
the union, computed again (``conformance.report.clusters``, ``conformance.report.coverage``).

The merged gate is the gate over the union (``conformance.gate``), and it fails, naming the cases,
when the inputs do not add up to exactly the profile's case list: a case of some input's shard
without a result (**missing**, e.g. a killed shard, or a ``-k`` selection), a result of a case no
input's shard holds (**extra**), a case with results in two inputs (**duplicated**: the same shard
merged twice), or shards of ``N`` absent altogether. It fails too when an input's own gate failed
for a reason its results do not show (pytest interrupted).
"""

from __future__ import annotations

import json
from pathlib import Path

from conformance.gate import gate_verdict, listed
from conformance.journal import build_document, case_list_summary
from conformance.report.clusters import add_clusters
from conformance.report.coverage import add_coverage

SAME_FIELDS = ("suite_version", "target", "profile", "seed")


class MergeError(ValueError):
    """The inputs cannot be merged into one verdict."""


def read_document(path) -> dict:
    try:
        document = json.loads(Path(path).read_text())
    except OSError as exc:
        raise MergeError(f"cannot read {path}: {exc.strerror or exc}") from None
    except json.JSONDecodeError as exc:
        raise MergeError(f"{path} is not a results.json document: {exc}") from None
    if not isinstance(document, dict) or not isinstance(document.get("results"), list):
        raise MergeError(f"{path} is not a results.json document (no 'results' list)")
    return document


def merge_documents(documents: list[dict], sources: list[str] | None = None) -> dict:
    """One results document (with a fresh gate and summary) from ``documents``."""
    if not documents:
        raise MergeError("nothing to merge")
    sources = [str(s) for s in sources] if sources else [f"input {i + 1}" for i in range(len(documents))]
    first = documents[0]
    for field in SAME_FIELDS:
        for source, document in zip(sources[1:], documents[1:]):
            if document.get(field) != first.get(field):
                raise MergeError(
                    f"cannot merge: field '{field}' differs: {first.get(field)!r} in {sources[0]} "
                    f"but {document.get(field)!r} in {source}"
                )
    _check_same_population(documents, sources)
    by_id: dict[str, tuple[dict, str]] = {}
    duplicated: list[str] = []
    for source, document in zip(sources, documents):
        for result in document["results"]:
            seen = by_id.get(result["id"])
            if seen is None:
                by_id[result["id"]] = (result, source)
            elif seen[0]["outcome"] != result["outcome"]:
                raise MergeError(
                    f"cannot merge: case {result['id']} ended {seen[0]['outcome']!r} in {seen[1]} "
                    f"but {result['outcome']!r} in {source}"
                )
            else:
                duplicated.append(f"{result['id']} ({seen[1]} and {source})")
    results = sorted((result for result, _ in by_id.values()), key=lambda r: r["id"])
    covered = list(dict.fromkeys(case_id for document in documents for case_id in document["shard_cases"]))
    whole = first["case_list"]
    manifest = {field: first.get(field) for field in (*SAME_FIELDS, "target_name")}
    manifest.update(
        replay=None,
        expectations=_joined(documents, "expectations"),
        python=_joined(documents, "python"),
        shard=None,
        merged_from=[
            {"source": source, "shard": document.get("shard"), "cases": len(document["results"])}
            for source, document in zip(sources, documents)
        ],
        case_list=whole,
        expected=covered,  # every case of every input's shard: what the merged verdict covers
        shard_cases=covered,
    )
    environment = _environment(documents)
    if environment:
        manifest["environment"] = environment
    fingerprints = [
        {"source": source, "shard": document.get("shard"), "environment": document.get("environment") or {}}
        for source, document in zip(sources, documents)
    ]
    if len({json.dumps(f["environment"], sort_keys=True) for f in fingerprints}) > 1:
        manifest["environments"] = fingerprints  # machines differ: keep each one's whole fingerprint
    workers = [{"source": source, **worker} for source, document in zip(sources, documents) for worker in document.get("workers") or []]
    # the same document a single run builds from its manifest and journals (missing, unexpected, gate)
    merged = build_document(manifest, results, workers=workers)
    absent_shards = _missing_shards(documents)
    extra_reasons = _input_gate_reasons(documents, sources) + absent_shards
    if duplicated:
        extra_reasons.append(f"{len(duplicated)} case(s) have results in more than one input: {listed(duplicated)}")
    if case_list_summary(covered) != whole and not absent_shards:
        extra_reasons.append(f"the inputs' shards hold {len(covered)} of the profile's {whole['count']} cases: merge every shard")
    gate = merged["gate"]
    if extra_reasons:
        merged["gate"] = {**gate, "passed": False, "reasons": [*gate["reasons"], *extra_reasons]}
    merged["duplicated"] = duplicated
    # clusters and coverage of the union: a bug every shard hit is one problem, not one per shard
    return add_coverage(add_clusters(merged))


def _check_same_population(documents: list[dict], sources: list[str]) -> None:
    """Refuse inputs whose case lists cannot be compared, or differ."""
    for source, document in zip(sources, documents):
        absent = [field for field in ("case_list", "shard_cases") if not isinstance(document.get(field), (dict, list))]
        if absent:
            raise MergeError(
                f"cannot merge: {source} records no {' or '.join(absent)} (written by an older suite, or by hand), so "
                "what it should hold cannot be checked; rerun it with this suite"
            )
    versions = {source: (document.get("environment") or {}).get("hypothesis") for source, document in zip(sources, documents)}
    if len(set(versions.values())) > 1:
        shown = ", ".join(f"{version} in {source}" for source, version in versions.items())
        raise MergeError(
            f"cannot merge: the inputs were drawn with different Hypothesis versions ({shown}), which may draw "
            "different cases; run every shard with one version"
        )
    first = documents[0]["case_list"]
    for source, document in zip(sources[1:], documents[1:]):
        if document["case_list"] != first:
            raise MergeError(
                f"cannot merge: {source} was drawn from another case list ({document['case_list']['count']} cases, "
                f"{document['case_list']['digest']}) than {sources[0]} ({first['count']} cases, {first['digest']})"
            )


def _joined(documents: list[dict], field: str):
    values = list(dict.fromkeys(d.get(field) for d in documents))
    return values[0] if len(values) == 1 else "; ".join(str(v) for v in values)


def _environment(documents: list[dict]) -> dict:
    """The inputs' fingerprints, key by key; where machines differ, their values joined with '; '."""
    keys = list(dict.fromkeys(k for d in documents for k in (d.get("environment") or {})))
    environment = {}
    for key in keys:
        values = list(dict.fromkeys(str((d.get("environment") or {}).get(key)) for d in documents))
        environment[key] = (documents[0].get("environment") or {}).get(key) if len(values) == 1 else "; ".join(values)
    return environment


def _input_gate_reasons(documents: list[dict], sources: list[str]) -> list[str]:
    """Reasons an input's gate failed that its results and missing cases do not explain (pytest interrupted)."""
    reasons = []
    for source, document in zip(sources, documents):
        gate = document.get("gate") or {}
        own = gate_verdict(document["results"], 0, missing=document.get("missing") or [])
        if gate and not gate.get("passed") and own["passed"]:
            reasons.extend(f"{source}: {reason}" for reason in gate.get("reasons") or ["its gate failed"])
    return reasons


def _missing_shards(documents: list[dict]) -> list[str]:
    shards = [d.get("shard") for d in documents]
    if not shards or any(not s for s in shards):
        return []
    try:
        parsed = {tuple(int(x) for x in str(s).split("/")) for s in shards}
    except ValueError:
        return []
    counts = {n for _, n in parsed}
    if len(counts) != 1:
        return [f"shards of different splits merged: {', '.join(sorted(map(str, set(shards))))}"]
    [count] = counts
    missing = sorted(set(range(count)) - {i for i, _ in parsed})
    return [f"shard(s) {', '.join(f'{i}/{count}' for i in missing)} missing from the merge"] if missing else []
