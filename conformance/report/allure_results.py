"""Allure results written from the results document: one ``*-result.json`` per case, labelled, at the end.

Like ``junit.xml`` (``conformance.report.junit``), the Allure results are one rendering of the document
(``conformance.report.document``): every case's typed record, the clusters, the environment. They are
written once, when the run ends (and again by ``python -m conformance.report html DIR`` for a killed run
and by ``merge`` for shards), never patched after the fact, and need no pytest plugin: ``allure-pytest``'s
per-test listener is turned off for conformance runs (``conformance.plugin``), which also saves its
milliseconds per case. What makes them a conformance report rather than a list of test names:

* suites: parentSuite = level (kernel, wrapper, model, …), suite = op, subSuite = edge-case family,
  so Allure's tree reads like the matrix; tags: the level's markers, the dtype and the case's features;
* severity (``SEVERITY_BY_LEVEL``): a level every target must implement is *critical*: the wrapper
  ops (the design makes level 2 the required contract; the profiles draw every op of every level,
  so the required set is a property of the level, not of the profile) and end-to-end generation
  (level ``model``: what a user sees); the kernel ops are optional for a target (a wrapper may be
  built without them), so *normal*; anything else *normal*;
* parameters: the case id, dtype and shape (tokens, sequences, slots, ranks, hidden, slices) count
  towards Allure's history id; the case seed and the run seed are parameters too but ``excluded``, so
  the history of a case is not split by seeds. Names and ids are the pytest test's
  (``test_case[ID]``, ``conformance.test_cases#test_case``), so Allure's history of a case carries on;
* status and message: pass → passed, fail and unexpected pass → failed, broken and no result → broken,
  not supported and known failure → skipped; the message is the JUnit one (``fail [numerics] cluster 1/2
  "…": …``), its trace what the target raised (its whole traceback, as its process formatted it), or
  else the repro;
* ``environment.properties``: the fingerprint; ``categories.json``: one category per failure cluster
  first ("Problem 1/1: rows without adapter are overwritten (wrote outside its region; 733 cases in 15
  ops)"), then our outcomes (``CATEGORIES``).

Every string is safe text (``conformance.text``) and the files are ASCII JSON: a target's message cannot
break a writer.
"""

from __future__ import annotations

import hashlib
import json
import shutil
import uuid
from pathlib import Path

from conformance.journal import TEST_FUNCTION
from conformance.report.clusters import cluster_of, document_clusters
from conformance.report.junit import record_message
from conformance.text import TRACEBACK_LIMIT, safe_text, without_surrogates
from conformance.verdict import Outcome
from conformance.verdict.failure_kind import FailureKind

# how plugin.report_outcome hands each rejected outcome to pytest, and so which Allure status it gets
ALLURE_STATUS = {Outcome.FAIL.value: "failed", Outcome.UNEXPECTED_PASS.value: "failed", Outcome.BROKEN.value: "broken"}
STATUS = {**ALLURE_STATUS, Outcome.PASS.value: "passed", Outcome.NOT_SUPPORTED.value: "skipped", Outcome.KNOWN_FAILURE.value: "skipped"}
FULL_NAME = f"conformance.test_cases#{TEST_FUNCTION}"
LEVEL_MARKERS = {"model": "e2e", "layer": "tp"}  # the pytest marker of a level whose name is not its marker

SEVERITY_BY_LEVEL = {"wrapper": "critical", "model": "critical", "layer": "critical", "kernel": "normal"}
DEFAULT_SEVERITY = "normal"

# Allure assigns a result to the first category that matches (status, then message regex); the messages
# lead with the outcome and the failure kinds in brackets (conformance.report.clusters.message_lead): one
# category per kind (the first kind listed decides).
def _status_prefix_label(kind: FailureKind) -> tuple[str, str, str]:
    """How a kind's failure reaches Allure: its status, the message's lead and the category's first word."""
    if kind.broken or kind is FailureKind.NO_RESULT:
        return "broken", r"\bbroken", "Broken"
    return "failed", r"\bfail", "Fail"


def _kind_categories() -> list[dict]:
    categories = []
    for kind in FailureKind:
        status, prefix, label = _status_prefix_label(kind)
        categories.append({
            "name": f"{label}: {kind.value} ({kind.doc.split(';')[0]})",
            "matchedStatuses": [status],
            "messageRegex": rf"(?s).*{prefix} \[{kind.value}[,\]].*",
        })
    return categories


CATEGORIES = [
    {"name": "Unexpected pass (listed as known failure, yet passed)", "matchedStatuses": ["failed"], "messageRegex": r"(?s).*unexpected pass: .*"},
    *_kind_categories(),
    {"name": "Known failure (expectations file)", "matchedStatuses": ["skipped"], "messageRegex": r"(?s).*known failure .*"},
    {"name": "Not supported (declared by the target)", "matchedStatuses": ["skipped"], "messageRegex": r"(?s).*not supported: .*"},
    {"name": "Harness error (not a target outcome)", "matchedStatuses": ["failed", "broken"]},
]  # fmt: skip


def case_shape(case: dict) -> str:
    """A one-line shape of a case (its structure, not its values)."""
    if not case.get("seq_lens"):
        return ""
    parts = [
        f"tokens={sum(case['seq_lens'])}",
        f"seqs={len(case['seq_lens'])}",
        f"slots={case.get('num_slots')}",
        f"rank={case.get('max_rank')}",
        f"hidden={case.get('hidden_size')}",
        f"slices={list(case.get('output_slices') or ())}",
    ]
    return " ".join(parts)


def cluster_categories(document: dict) -> list[dict]:
    """One category per cluster, matched by the cluster label :func:`record_message` puts into its failures' messages
    (Allure takes the first category that matches, so these go before ``CATEGORIES``)."""
    clusters = document_clusters(document)
    categories = []
    for cluster in clusters:
        outcomes = cluster.get("outcomes") or {}
        statuses = [ALLURE_STATUS[outcome] for outcome in outcomes if outcome in ALLURE_STATUS]
        categories.append({
            "name": f"Problem {cluster['id']}/{len(clusters)}: {cluster['title']} "
                    f"({cluster['kind']}; {cluster['count']} cases in {len(cluster.get('ops') or ())} ops)",
            "matchedStatuses": list(dict.fromkeys(statuses)) or ["failed", "broken"],
            "messageRegex": rf'(?s).* cluster {cluster["id"]}/{len(clusters)} ".*',
        })  # fmt: skip
    return categories


def md5(*parts: str) -> str:
    """Allure's history and test-case ids: the md5 of the parts, one after the other (as allure-python makes them)."""
    digest = hashlib.md5(usedforsecurity=False)
    for part in parts:
        digest.update(str(part).encode("utf-8", "backslashreplace"))
    return digest.hexdigest()


def _parameters(record: dict, run_seed) -> list[dict]:
    case = record.get("case") or {}
    parameters = [{"name": "conformance_case", "value": record["id"]}]
    if record.get("dtype"):
        parameters.append({"name": "dtype", "value": repr(record["dtype"])})
    if shape := case_shape(case):
        parameters.append({"name": "shape", "value": repr(shape)})
    if case.get("seed") is not None:
        parameters.append({"name": "case seed", "value": str(case["seed"]), "excluded": True})
    if run_seed is not None:
        parameters.append({"name": "run seed", "value": str(run_seed), "excluded": True})
    return parameters


def _labels(record: dict, environment: dict) -> list[dict]:
    level = record.get("level") or "other"
    labels = [("parentSuite", level), ("suite", record.get("op") or "?")]
    if record.get("family"):
        labels.append(("subSuite", record["family"]))
    labels.append(("severity", SEVERITY_BY_LEVEL.get(level, DEFAULT_SEVERITY)))
    labels += [("tag", tag) for tag in (LEVEL_MARKERS.get(level, level), record.get("dtype"), *(record.get("features") or ())) if tag]
    labels += [("framework", "lora-conformance"), ("language", "cpython3"), ("package", "conformance.test_cases")]
    labels += [("host", environment.get("host") or "unknown"), ("thread", record.get("worker") or "main")]
    return [{"name": name, "value": safe_text(value)} for name, value in labels]


def _trace(record: dict) -> str:
    """A failure's trace: what the target raised, as its process formatted it; else the repro that reruns it."""
    if record.get("traceback"):
        return safe_text(record["traceback"], TRACEBACK_LIMIT)
    return f"repro: {safe_text(record['repro'])}" if record.get("repro") else ""


def allure_result(record: dict, document: dict, clusters: list[dict], by_case: dict[str, dict]) -> dict:
    """The Allure result of one record of ``document`` (the Allure 2 result schema)."""
    parameters = _parameters(record, document.get("seed"))
    included = sorted((p for p in parameters if not p.get("excluded")), key=lambda p: p["name"])
    stop = int(1000 * (record.get("finished") or document.get("finished") or 0))
    result = {
        "uuid": str(uuid.uuid4()), "historyId": md5(FULL_NAME, *(p["value"] for p in included)), "testCaseId": md5(FULL_NAME),
        "fullName": FULL_NAME, "name": f"{TEST_FUNCTION}[{record['id']}]", "status": STATUS.get(record["outcome"], "broken"),
        "stage": "finished", "start": stop - int(1000 * (record.get("seconds") or 0)), "stop": stop,
        "labels": _labels(record, document.get("environment") or {}), "parameters": parameters,
    }  # fmt: skip
    if record["outcome"] != Outcome.PASS.value:
        result["statusDetails"] = {"message": safe_text(record_message(record, clusters, by_case)), "trace": _trace(record)}
    return result


def write_allure_results(document: dict, results_dir) -> Path:
    """Every case of ``document`` as an Allure result in ``results_dir`` (emptied first: results of an earlier
    run would mix into this one), an expected case without a result as a broken one, and the environment and
    categories; returns the directory."""
    results_dir = Path(results_dir)
    shutil.rmtree(results_dir, ignore_errors=True)
    results_dir.mkdir(parents=True, exist_ok=True)
    clusters, by_case = document_clusters(document), cluster_of(document)
    missing = [{"id": case_id, "op": "?", "outcome": "broken", "kinds": [FailureKind.NO_RESULT.value],
                "message": "the run ended before this case had one"} for case_id in document.get("missing") or ()]
    for record in [*(document.get("results") or ()), *missing]:
        result = without_surrogates(allure_result(record, document, clusters, by_case))
        (results_dir / f"{result['uuid']}-result.json").write_text(json.dumps(result), encoding="ascii")
    environment = document.get("environment") or {}
    lines = [f"{_escape_key(k)}={_escape_value(v)}" for k, v in environment.items()]
    (results_dir / "environment.properties").write_text("\n".join(lines) + "\n", encoding="utf-8", errors="backslashreplace")
    (results_dir / "categories.json").write_text(json.dumps(cluster_categories(document) + CATEGORIES, indent=1) + "\n")
    return results_dir


def _escape_key(key) -> str:  # java.util.Properties: '=', ':', whitespace and '\' are escaped in keys
    return "".join("\\" + c if c in "=: \\#!" else c for c in str(key))


def _escape_value(value) -> str:
    text = str(value).replace("\\", "\\\\").replace("\n", "\\n").replace("\r", "\\r")
    return ("\\" + text) if text.startswith(" ") else text
