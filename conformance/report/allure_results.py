"""Allure results for every run: labels per case, the fingerprint, and categories for our outcomes.

allure-pytest writes one ``*-result.json`` per test; this module adds what makes them a conformance
report rather than a list of test names:

* suites: parentSuite = level (kernel, wrapper, model, …), suite = op, subSuite = edge-case family,
  so Allure's tree reads like the matrix; tags: dtype and the case's features;
* severity (``SEVERITY_BY_LEVEL``): a level every target must implement is *critical*: the wrapper
  ops (the design makes level 2 the required contract; the profiles draw every op of every level,
  so the required set is a property of the level, not of the profile) and end-to-end generation
  (level ``model``: what a user sees); the kernel ops are optional for a target (a wrapper may be
  built without them), so *normal*; anything else *normal*;
* parameters: dtype and shape (tokens, sequences, slots, ranks, hidden, slices) count towards
  Allure's history id; the case seed and the run seed are parameters too but ``excluded``, so the
  history of a case is not split by seeds;
* ``environment.properties``: the fingerprint; ``categories.json``: our outcomes as Allure categories
  (``CATEGORIES``; how the plugin maps outcomes to pytest, and so to Allure statuses, is in
  ``conformance.plugin``);
* failure clusters (``conformance.report.clusters``): once every result is in, :func:`label_clusters`
  names each failure's cluster in its result's message (``fail [numerics] cluster 1/2 "…": …``) and
  puts one category per cluster before ``CATEGORIES``, so Allure's Categories tab lists the distinct
  problems: "Problem 1/1: rows without adapter receive a delta (wrote outside its region; 733 cases in
  15 ops)";
* what the target raised: a broken case's ``statusDetails.trace`` becomes the record's ``traceback``
  (:func:`label_clusters`, once every result is in), the target's whole Python traceback as its
  process formatted it, instead of the frame where the plugin reported the case;
* safe text (:func:`install_safe_text_results`, installed when this module is imported): allure-pytest
  writes each result as UTF-8 JSON as its case ends, and a lone surrogate in a target's message (what a
  driver's bytes decoded with ``surrogateescape`` give) once made that writer raise and lose every later
  case; a plugin of allure's own plugin manager, called before its file writer, makes every string of a
  result or container safe text (``conformance.text``), cutting the message and trace to a bounded size.
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

from conformance.journal import case_id_of
from conformance.report.clusters import cluster_of, document_clusters, label_message
from conformance.text import MESSAGE_LIMIT, TRACEBACK_LIMIT, safe_text, without_surrogates
from conformance.verdict import Outcome
from conformance.verdict.failure_kind import FailureKind

# how plugin.report_outcome hands each rejected outcome to pytest, and so which Allure status it gets
ALLURE_STATUS = {Outcome.FAIL.value: "failed", Outcome.UNEXPECTED_PASS.value: "failed", Outcome.BROKEN.value: "broken"}

SEVERITY_BY_LEVEL = {"wrapper": "critical", "model": "critical", "layer": "critical", "kernel": "normal"}
DEFAULT_SEVERITY = "normal"

# Allure assigns a result to the first category that matches (status, then message regex); the
# messages are those conformance.plugin.report_outcome raises, as allure-pytest formats them, which
# lead with the failure kinds in brackets: one category per kind (the first kind listed decides).
def _status_prefix_label(kind: FailureKind) -> tuple[str, str, str]:
    """How a kind's failure reaches Allure: its status, the message's lead and the category's first word."""
    return ("broken", r"TargetBroken: broken", "Broken") if kind.broken else ("failed", r"\bfail", "Fail")


def _kind_categories() -> list[dict]:
    categories = []
    for kind in FailureKind:
        if kind is FailureKind.NO_RESULT:  # a case without a result has no test result to categorise
            continue
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


def label_current_test(record: dict, run_seed: int | None = None) -> None:
    """Label the running test from its result record (the results.json schema); no-op without Allure."""
    import allure  # allure-pytest is a dependency; imported here so the report layer loads without it

    level, op = record.get("level") or "other", record.get("op") or "?"
    dynamic = allure.dynamic
    dynamic.parent_suite(level)
    dynamic.suite(op)
    if record.get("family"):
        dynamic.sub_suite(record["family"])
    dynamic.severity(SEVERITY_BY_LEVEL.get(level, DEFAULT_SEVERITY))
    # the level is a tag already: allure-pytest turns the test's pytest markers (kernel, wrapper) into tags
    dynamic.tag(*[str(t) for t in (record.get("dtype"), *(record.get("features") or ())) if t])
    if record.get("dtype"):
        dynamic.parameter("dtype", record["dtype"])
    case = record.get("case") or {}
    shape = case_shape(case)
    if shape:
        dynamic.parameter("shape", shape)
    if case.get("seed") is not None:
        dynamic.parameter("case seed", case["seed"], excluded=True)
    if run_seed is not None:
        dynamic.parameter("run seed", run_seed, excluded=True)


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
    """One category per cluster, matched by the label :func:`label_clusters` puts into its failures' messages
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


def label_clusters(results_dir, document: dict) -> int:
    """Name each failure's cluster in the Allure results under ``results_dir``, put what the target raised
    (the record's ``traceback``) into the ``statusDetails.trace`` of each case whose target raised, and put
    the clusters' categories into its categories.json; return how many results were labelled."""
    results_dir = Path(results_dir)
    clusters = document_clusters(document)
    by_case = cluster_of(document)
    records = {record["id"]: record for record in document.get("results") or []}
    labelled = 0
    for path in sorted(results_dir.glob("*-result.json")):
        try:
            result = json.loads(path.read_text(encoding="utf-8", errors="surrogateescape"))
        except (OSError, ValueError):  # not a result allure-pytest wrote whole: left as it is, unlabelled
            continue
        if not isinstance(result, dict):
            continue
        case_id = case_id_of(str(result.get("name", "")))
        cluster = by_case.get(case_id)
        details = result.get("statusDetails") or {}
        record = records.get(case_id)
        if not details or record is None or (cluster is None and not record.get("traceback")):
            continue
        if record.get("traceback"):
            # allure-pytest's trace is where the plugin raised TargetBroken, a frame of the suite's reporting
            # that tells a vendor nothing; what the target raised is, formatted in the target's process
            details["trace"] = safe_text(record["traceback"], TRACEBACK_LIMIT)
        if cluster is not None:
            for field in ("message", "trace"):
                if details.get(field):
                    details[field] = label_message(details[field], record, cluster, len(clusters))
            labelled += 1
        path.write_text(json.dumps(without_surrogates(result)), encoding="utf-8")
    # the kinds' categories stay, after the clusters': they take what no cluster names (a known failure, …)
    (results_dir / "categories.json").write_text(json.dumps(cluster_categories(document) + CATEGORIES, indent=1) + "\n")
    return labelled


def write_results_extras(results_dir, fingerprint: dict) -> None:
    """``environment.properties`` (the fingerprint) and ``categories.json`` in an Allure results dir."""
    results_dir = Path(results_dir)
    results_dir.mkdir(parents=True, exist_ok=True)
    lines = [f"{_escape_key(k)}={_escape_value(v)}" for k, v in fingerprint.items()]
    (results_dir / "environment.properties").write_text("\n".join(lines) + "\n", encoding="utf-8", errors="backslashreplace")
    (results_dir / "categories.json").write_text(json.dumps(CATEGORIES, indent=1) + "\n")


def _escape_key(key) -> str:  # java.util.Properties: '=', ':', whitespace and '\' are escaped in keys
    return "".join("\\" + c if c in "=: \\#!" else c for c in str(key))


def _escape_value(value) -> str:
    text = str(value).replace("\\", "\\\\").replace("\n", "\\n").replace("\r", "\\r")
    return ("\\" + text) if text.startswith(" ") else text


# -- safe text in what allure-pytest writes ----------------------------------------------------------

SAFE_TEXT_PLUGIN = "lora-conformance-safe-text"
TRACE_LIMIT = 2 * MESSAGE_LIMIT  # a trace repeats the message after pytest's lines of the raising frame


def safe_allure_item(item, _depth: int = 0) -> None:
    """Make every string of an allure-commons model object (a test result or container, its status details,
    steps, parameters, labels, …) safe text, in place: surrogates and control characters escaped
    (``conformance.text.safe_text``), the message cut to ``MESSAGE_LIMIT`` characters and the trace to
    ``TRACE_LIMIT``. Never raises."""
    fields = getattr(type(item), "__attrs_attrs__", None)
    if fields is None or _depth > 20:
        return
    for field in fields:
        try:
            value = getattr(item, field.name)
            limit = {"message": MESSAGE_LIMIT, "trace": TRACE_LIMIT}.get(field.name, sys.maxsize)
            if isinstance(value, str):
                setattr(item, field.name, safe_text(value, limit))
            elif isinstance(value, list):
                value[:] = [safe_text(v, limit) if isinstance(v, str) else v for v in value]
                for element in value:
                    safe_allure_item(element, _depth + 1)
            else:
                safe_allure_item(value, _depth + 1)
        except Exception:  # noqa: BLE001 - making text safe must not be what loses a result
            continue


def install_safe_text_results() -> bool:
    """Register, once per process, the allure-commons plugin that makes each result and container safe
    text (:func:`safe_allure_item`) before allure-pytest's file logger writes it (``tryfirst``: the
    logger's ``json.dump(..., ensure_ascii=False)`` into a UTF-8 file raises on a lone surrogate). False
    without allure-commons installed."""
    try:
        import allure_commons
    except ImportError:
        return False
    manager = allure_commons.plugin_manager
    if manager.has_plugin(SAFE_TEXT_PLUGIN):
        return True

    class SafeTextResults:
        @allure_commons.hookimpl(tryfirst=True)
        def report_result(self, result) -> None:
            safe_allure_item(result)

        @allure_commons.hookimpl(tryfirst=True)
        def report_container(self, container) -> None:
            safe_allure_item(container)

    manager.register(SafeTextResults(), SAFE_TEXT_PLUGIN)
    return True


# conformance.plugin imports this module in every process that runs cases (a serial run, each xdist
# worker), before allure-pytest writes any result there: installing here covers them all
install_safe_text_results()
