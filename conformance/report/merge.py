"""Merge the results of many shards or machines into one results document, and gate it again.

Every input must come from the same suite version, target, profile and seed (otherwise the cases are
not the same population and the merged verdict would mean nothing); a case id seen twice must have
ended the same way. Each input's environment fingerprint is kept (``environments``) when they differ,
and every input's workers with their devices (``workers``). The gate is applied afresh to the union (``conformance.gate``), and it fails too
when an input's own gate failed for a reason its results do not show (pytest interrupted, a worker
crashed), or when the inputs are shards ``I/N`` and some shard of ``N`` is missing.
"""

from __future__ import annotations

import json
from pathlib import Path

from conformance.gate import gate_verdict, summarize

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
    by_id: dict[str, tuple[dict, str]] = {}
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
    results = sorted((result for result, _ in by_id.values()), key=lambda r: r["id"])
    gate = gate_verdict(results, 0)
    extra = _input_gate_reasons(documents, sources) + _missing_shards(documents)
    if extra:
        gate = {**gate, "passed": False, "reasons": [*gate["reasons"], *extra]}
    merged = {field: first.get(field) for field in SAME_FIELDS}
    merged.update(
        replay=None,
        expectations=_joined(documents, "expectations"),
        python=_joined(documents, "python"),
        shard=None,
        merged_from=[
            {"source": source, "shard": document.get("shard"), "cases": len(document["results"])}
            for source, document in zip(sources, documents)
        ],
    )
    environment = _environment(documents)
    if environment:
        merged["environment"] = environment
    fingerprints = [
        {"source": source, "shard": document.get("shard"), "environment": document.get("environment") or {}}
        for source, document in zip(sources, documents)
    ]
    if len({json.dumps(f["environment"], sort_keys=True) for f in fingerprints}) > 1:
        merged["environments"] = fingerprints  # machines differ: keep each one's whole fingerprint
    merged["workers"] = [
        {"source": source, **worker} for source, document in zip(sources, documents) for worker in document.get("workers") or []
    ]
    merged.update(gate=gate, summary=summarize(results), results=results)
    return merged


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
    """Reasons an input's gate failed that its results alone do not explain (e.g. pytest interrupted)."""
    reasons = []
    for source, document in zip(sources, documents):
        gate = document.get("gate") or {}
        if gate and not gate.get("passed") and gate_verdict(document["results"], 0)["passed"]:
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
