"""Merge the results of many shards or machines into one results document, and gate it again.

Every input must come from the same suite version, target, profile and seed, drawn by the same
Hypothesis version, with the same case list (the ``case_list`` digest each run records): otherwise
the cases are not the same population and the merged verdict would mean nothing; such inputs are
refused. Nor may a result hold another case than the one its id names: merge draws the profile's
cases again (from its profile and seed, with the installed Hypothesis, which must be the one each input
records as ``hypothesis_version``) and refuses a result whose ``case`` differs, naming the input, the
case and the first field that differs. Each input's environment fingerprint is kept
(``environments``) when they differ, and every input's workers with their devices (``workers``). The
failure clusters and the coverage are those of the union, computed again
(``conformance.report.clusters``, ``conformance.report.coverage``).

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

import conformance
from conformance.gate import gate_verdict, listed
from conformance.generator.cache import hypothesis_version
from conformance.journal import case_list_summary
from conformance.report.document import results_document

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


def merge_documents(documents: list[dict], sources: list[str] | None = None, *, check_cases: bool = True) -> dict:
    """One results document (with a fresh gate and summary) from ``documents``.

    ``check_cases=False`` leaves out drawing the profile again to check each result's case: only for
    documents built by hand to exercise the other checks; the ``merge`` command always checks.
    """
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
    if check_cases:
        _check_cases_drawn(documents, sources)
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
    absent_shards = _missing_shards(documents)
    extra_reasons = _input_gate_reasons(documents, sources) + absent_shards
    if duplicated:
        extra_reasons.append(f"{len(duplicated)} case(s) have results in more than one input: {listed(duplicated)}")
    if case_list_summary(covered) != whole and not absent_shards:
        extra_reasons.append(f"the inputs' shards hold {len(covered)} of the profile's {whole['count']} cases: merge every shard")
    # the same document a single run builds (missing, unexpected, gate), with the clusters and coverage of the
    # union: a bug every shard hit is one problem, not one per shard
    merged = results_document(manifest, results, workers=workers, extra_reasons=extra_reasons)
    merged["duplicated"] = duplicated
    return merged


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


def _check_cases_drawn(documents: list[dict], sources: list[str]) -> None:
    """Refuse a result whose case is not the case this suite draws under its id.

    A shard's ``case_list`` digest only says which ids the profile has; a results.json edited by hand,
    or drawn by another suite or Hypothesis version, can hold other cases under the same ids, and the
    merged verdict would then judge cases nobody ran. So the profile's cases are drawn again from its
    profile and seed (op, end-to-end and tensor-parallel, as ``ConformanceRun.manifest`` lists them)
    and every result's ``case`` must be that case's ``to_json()``. A shard drawn with another Hypothesis
    version (the manifest's ``hypothesis_version``) is refused outright; one that does not record it
    (an older suite) is checked all the same. A replay run holds one case frozen with its tensors: nothing
    is drawn, and it is merged as before.
    """
    installed = hypothesis_version()
    drawn: dict[tuple, dict] = {}
    for source, document in zip(sources, documents):
        if document.get("profile") == "replay":
            continue
        recorded = document.get("hypothesis_version")
        if recorded is not None and recorded != installed:
            raise MergeError(
                f"cannot merge: {source} was drawn with Hypothesis {recorded}, but this environment has {installed}: "
                f"another version may draw other cases under the same ids, so its results cannot be checked; merge "
                f"where Hypothesis {recorded} is installed, or rerun the shard with {installed}"
            )
        key = (document.get("profile"), document.get("seed") or 0)
        if key not in drawn:
            drawn[key] = _drawn_cases(*key, source, document)
        profile, seed = key
        for result in document["results"]:
            case = drawn[key].get(result["id"])
            if case is not None and result.get("case") == case:
                continue
            if case is None:
                problem = f"case {result['id']} is not a case of profile {profile} seed {seed}"
            elif not isinstance(result.get("case"), dict):
                problem = f"case {result['id']} records no case object"
            else:
                field = next(name for name in [*case, *result["case"]] if result["case"].get(name, _ABSENT) != case.get(name, _ABSENT))
                recorded_value = result["case"].get(field, "nothing")
                problem = (
                    f"case {result['id']} records {field!r} = {recorded_value!r}, but profile {profile} seed {seed} draws "
                    f"{case.get(field, 'nothing')!r} under that id"
                )
            raise MergeError(f"cannot merge: {source}: {problem}{_why_cases_differ(document, installed)}")


_ABSENT = object()


def _drawn_cases(profile: str, seed: int, source: str, document: dict) -> dict[str, dict]:
    """Every case of ``profile`` and ``seed`` by id, as JSON (what results.json holds), drawn here."""
    # imported here: the html command (and a replay merge) never draws a profile
    from conformance.generator import PROFILES
    from conformance.levels import KINDS

    if profile not in PROFILES:
        raise MergeError(
            f"cannot merge: {source} ran profile {profile!r}, which this suite ({conformance.__version__}) does not have "
            f"({', '.join(sorted(PROFILES))}), so its cases cannot be drawn again to check them; merge with the suite "
            f"that ran it ({document.get('suite_version')})"
        )
    cases = {case_id: case for kind in KINDS for case_id, case in kind.cases(profile, seed)}  # every level's, installed ones too
    return {case_id: json.loads(json.dumps(case.to_json())) for case_id, case in cases.items()}


def _why_cases_differ(document: dict, installed: str | None) -> str:
    """What may have drawn other cases, and the fix, for a shard whose results are not this suite's draws."""
    causes = []
    if document.get("suite_version") != conformance.__version__:
        causes.append(f"it was run by suite {document.get('suite_version')}, this is {conformance.__version__}")
    if document.get("hypothesis_version") is None:
        causes.append(f"it records no Hypothesis version, so the one that drew it is unknown (this environment has {installed})")
    cause = f" ({'; '.join(causes)})" if causes else ""
    return (
        f"{cause}: its results are not of the cases this suite draws, and a results.json edited by hand cannot be "
        "merged; rerun the shard with this suite and merge its own results.json"
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
