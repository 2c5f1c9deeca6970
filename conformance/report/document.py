"""The results document (``results.json``), built in one place for every way a run ends.

A run that ends normally (``conformance.session``), a killed run rebuilt from its journals
(``python -m conformance.report html DIR``) and a merge of shards (``conformance.report.merge``) all get
their document from :func:`results_document`: the manifest's description of the run, the records, the
gate over them (``conformance.journal.build_document``), the environment with the devices the workers
used, then one cluster per distinct problem (``conformance.report.clusters``), what the cases
exercised (``conformance.report.coverage``) and what the target warned and printed, deduplicated
(``conformance.report.target_output``).
"""

from __future__ import annotations

from conformance import journal

from .clusters import add_clusters
from .coverage import add_coverage
from .target_output import add_target_output


def results_document(
    manifest: dict, results: list[dict], *, workers: list[dict] | None = None, pytest_exitstatus: int = 0,
    environment: dict | None = None, extra_reasons: list[str] = (),
) -> dict:
    """The document of ``results`` under ``manifest``. ``environment``: the fingerprint of the process that
    ends the run (a rebuilt or merged document keeps the manifest's); ``extra_reasons``: what else fails
    the gate (a merge's missing shards)."""
    document = journal.build_document(manifest, results, workers=workers, pytest_exitstatus=pytest_exitstatus)
    if environment is not None:
        environment = document["environment"] = dict(environment)
        devices = list(dict.fromkeys((w.get("device"), w.get("driver")) for w in document["workers"]))
        environment["device"] = "; ".join(str(name) for name, _ in devices)
        environment["driver"] = "; ".join(dict.fromkeys(str(driver) for _, driver in devices))
        # what device-scoped expectations name (conformance.expectations): "unknown" from a worker that did not say
        environment["device_generation"] = "; ".join(dict.fromkeys(str(w.get("device_generation", "unknown")) for w in document["workers"]))
    if extra_reasons:
        gate = document["gate"]
        document["gate"] = {**gate, "passed": False, "reasons": [*gate["reasons"], *extra_reasons]}
    document = add_target_output(add_coverage(add_clusters(document)))
    document["results"] = document.pop("results")  # results.json: the summaries first, the long list of records last
    return document
