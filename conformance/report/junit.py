"""``junit.xml`` written from the results document, as deqp-runner's ``junit`` command writes its file.

The document (``conformance.report.document``) holds every case's record, the clusters and the
environment, so the JUnit file is one rendering of it, like report.html: written at the end of a run,
and again by ``python -m conformance.report html DIR`` (a killed run) and ``merge`` (shards). Nothing is
patched after the fact, and an expected case without a result is a test case too (an error, "no result").

One ``<testsuite>`` with the environment fingerprint as its properties; one ``<testcase>`` per case,
``classname`` ``conformance.<level>.<op>`` and ``name`` the pytest test's (``test_case[ID]``, so a CI's
test list and the repro agree), its time, and by outcome: ``<failure>`` (fail, unexpected pass),
``<error>`` (broken, no result), ``<skipped>`` (not supported, known failure). A failure's message leads
with its outcome, kinds and stability (``fail [numerics] (flaky): …``) and names its cluster
(``conformance.report.clusters``), as the pytest message does; the text adds the repro and, for a case
whose target raised, its whole traceback (the record's ``traceback``).
"""

from __future__ import annotations

import xml.etree.ElementTree as ET
from pathlib import Path

from conformance.journal import TEST_FUNCTION
from conformance.text import TRACEBACK_LIMIT, safe_text

from .clusters import cluster_label, cluster_of, document_clusters, message_lead

FAILURE = ("fail", "unexpected pass")
ERROR = ("broken",)
SKIPPED = ("not supported", "known failure")


def record_message(record: dict, clusters: list[dict], by_case: dict[str, dict]) -> str:
    """A failure's message, as JUnit and Allure show it: its lead (outcome, kinds, stability), its cluster, its text."""
    lead = message_lead(record)
    cluster = by_case.get(record["id"])
    if cluster is not None:
        lead += " " + cluster_label(cluster, len(clusters))
    entry = record.get("expectation") or {}
    if record["outcome"] == "known failure":
        return f"known failure {entry.get('id')}: {entry.get('reason')} ({', '.join(entry.get('upstream') or [])})"
    if record["outcome"] == "not supported":
        return f"not supported: {record.get('message', '')}"
    return f"{lead}: {record.get('message', '')}"


def _traceback(record: dict) -> str:
    """What the target raised, as its process formatted it, after the message and the repro ("" where it
    raised nothing): CI shows the element's text, not only its message attribute."""
    traceback = record.get("traceback")
    return f"\n\nwhat the target raised:\n{safe_text(traceback, TRACEBACK_LIMIT)}" if traceback else ""


def junit_tree(document: dict) -> ET.ElementTree:
    """The JUnit XML of ``document``."""
    results = document.get("results") or []
    clusters, by_case = document_clusters(document), cluster_of(document)
    missing = document.get("missing") or []
    counts = {"failures": sum(r["outcome"] in FAILURE for r in results),
              "errors": sum(r["outcome"] in ERROR for r in results) + len(missing),
              "skipped": sum(r["outcome"] in SKIPPED for r in results)}
    root = ET.Element("testsuites")
    suite = ET.SubElement(root, "testsuite", name="lora-conformance", tests=str(len(results) + len(missing)),
                          time=f"{sum(r.get('seconds') or 0 for r in results):.3f}", **{k: str(v) for k, v in counts.items()})
    properties = ET.SubElement(suite, "properties")
    for name, value in (document.get("environment") or {}).items():
        ET.SubElement(properties, "property", name=safe_text(name), value=safe_text(value))
    for record in results:
        case = ET.SubElement(suite, "testcase", classname=f"conformance.{record.get('level')}.{record['op']}",
                             name=f"{TEST_FUNCTION}[{record['id']}]", time=f"{record.get('seconds') or 0:.3f}")
        outcome = record["outcome"]
        if outcome == "pass":
            continue
        message = safe_text(record_message(record, clusters, by_case))
        tag = "failure" if outcome in FAILURE else "error" if outcome in ERROR else "skipped"
        element = ET.SubElement(case, tag, message=message.splitlines()[0] if message else "")
        if outcome in SKIPPED:
            element.set("type", "pytest.xfail" if outcome == "known failure" else "pytest.skip")
        element.text = message + (f"\nrepro: {safe_text(record['repro'])}" if record.get("repro") else "") + _traceback(record)
    for case_id in missing:
        case = ET.SubElement(suite, "testcase", classname="conformance", name=f"{TEST_FUNCTION}[{case_id}]", time="0")
        ET.SubElement(case, "error", message="no result: the run ended before this case had one").text = (
            "an expected case without a result fails the gate; pytest conformance --resume REPORT_DIR runs it")
    return ET.ElementTree(root)


def write_junit(document: dict, path) -> Path:
    """Write ``document``'s JUnit XML to ``path``; return the path."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    tree = junit_tree(document)
    ET.indent(tree)
    tree.write(path, encoding="utf-8", xml_declaration=True)
    return path
