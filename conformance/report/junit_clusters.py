"""JUnit failure messages that name their failure cluster: ``fail [numerics] cluster 1/2 "…": …``.

A case's JUnit message is written when the case ends, before the run knows which failures are one
problem (``conformance.report.clusters`` groups them once every result is in). So the junit.xml pytest
wrote is read again at the end of the run and each clustered failure's message (the ``message``
attribute and the text of its ``<failure>``/``<error>``) gets its cluster after the kinds: CI's test
list then reads "cluster 1/1" on all 733 failures of one bug. Test cases are matched to results by
their case id (``test_case[ID]``); what is not a conformance case is left as it is.
"""

from __future__ import annotations

import xml.etree.ElementTree as ET
from pathlib import Path

from conformance.journal import case_id_of
from conformance.report.clusters import cluster_of, document_clusters, label_message


def label_junit_clusters(path, document: dict) -> int:
    """Name each failure's cluster in the JUnit file at ``path``; return how many test cases were labelled."""
    path = Path(path)
    clusters = document_clusters(document)
    by_case = cluster_of(document)
    if not by_case or not path.is_file():
        return 0
    records = {record["id"]: record for record in document.get("results") or []}
    tree = ET.parse(path)
    labelled = 0
    for testcase in tree.iter("testcase"):
        case_id = case_id_of(testcase.get("name", ""))
        cluster = by_case.get(case_id)
        if cluster is None:
            continue
        record = records[case_id]
        failures = [element for element in testcase if element.tag in ("failure", "error")]
        for element in failures:
            element.set("message", label_message(element.get("message", ""), record, cluster, len(clusters)))
            if element.text:
                element.text = label_message(element.text, record, cluster, len(clusters))
        labelled += bool(failures)
    tree.write(path, encoding="utf-8", xml_declaration=True)
    return labelled
