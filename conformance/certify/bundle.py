"""Writing a bundle: the results of one run of a frozen case list, or of its shards, as one file.

The members (docs/certification.md has the reader's version):

* ``bundle.json``: what the bundle is: suite version, target, the case list's name, digest and count, the
  inputs (one per run or shard), the date, how record digests are computed, and the verdict certify
  reached (``verify`` reaches it again and must agree);
* ``results.json``: the results document, every record (merged from the shards by
  ``conformance.report.merge``'s logic when there are several);
* ``manifests/input-N.json``: each input run's own document without its records: suite, vLLM, torch,
  driver and device fingerprint (``environment``), its workers and their devices, its shard, its gate;
* ``digests.json``: every record's digest (``records.record_digest``) and the input it came from;
* ``waivers.json``: the expectations file each input loaded (its entries, central or local) and each
  entry the known failures and unexpected passes used, with their cases;
* ``statement.toml``: the vendor's statement, a template certify leaves unfilled (``statement``);
* ``certificate.html``: the one-page certificate (``certificate``);
* ``index.json``: SHA-256 and size of every other member (``archive``).
"""

from __future__ import annotations

import datetime as _dt
import json
from collections import Counter
from pathlib import Path

import conformance

from .records import RECORD_FIELDS, record_digest
from .waivers import loaded_waivers, used_waivers

FORMAT = 1
BUNDLE, RESULTS, DIGESTS, WAIVERS, STATEMENT, CERTIFICATE = (
    "bundle.json", "results.json", "digests.json", "waivers.json", "statement.toml", "certificate.html")
MANIFESTS = "manifests/"


class CertifyError(ValueError):
    """The inputs cannot make a bundle (named, with the fix)."""


def json_bytes(value) -> bytes:
    return (json.dumps(value, indent=1, sort_keys=True, ensure_ascii=False) + "\n").encode()


def read_inputs(paths: list[str | Path]) -> tuple[list[dict], list[str]]:
    """The results documents of report dirs (or results.json files), and their names."""
    from conformance.report.merge import MergeError, read_document  # here: it imports Hypothesis, which a run imports first

    if not paths:
        raise CertifyError("nothing to bundle: name the report dir of each run (or shard) of the list")
    documents, sources = [], []
    for path in map(Path, paths):
        results = path / "results.json" if path.is_dir() else path
        try:
            documents.append(read_document(results))
        except MergeError as exc:
            raise CertifyError(f"{exc}; give a report dir a run of the list wrote (--report-dir)") from None
        sources.append(str(path))
    return documents, sources


def combined(documents: list[dict], sources: list[str]) -> tuple[dict, list[int]]:
    """The one results document of the inputs, and for each of its records the index of its input."""
    lists = [document.get("caselist") for document in documents]
    for source, listed in zip(sources, lists):
        if not isinstance(listed, dict) or not listed.get("name") or not listed.get("digest"):
            raise CertifyError(f"{source} was not run from a frozen case list (its results record no 'caselist'): run "
                               "`lora-conformance certify --target=NAME --caselist NAME`, or each shard with --caselist NAME --shard I/N")
    names = {(listed["name"], listed["digest"]) for listed in lists}
    if len(names) > 1:
        shown = ", ".join(f"{source}: {listed['name']} {listed['digest']}" for source, listed in zip(sources, lists))
        raise CertifyError(f"the inputs ran different case lists ({shown}): one bundle is one list")
    origin: dict[str, int] = {}
    repeated = []
    for number, document in enumerate(documents):
        for record in document["results"]:
            if record.get("id") in origin:
                repeated.append(f"{record.get('id')} ({sources[origin[record['id']]]} and {sources[number]})")
            origin.setdefault(record.get("id"), number)
    if repeated:
        raise CertifyError(f"{len(repeated)} case(s) have results in two inputs, e.g. {repeated[0]}: the same shard given twice? "
                           "Give each shard's report dir once")
    if len(documents) == 1:
        document = documents[0]
    else:
        from conformance.report.merge import MergeError, merge_documents

        try:
            document = merge_documents(documents, sources, check_cases=False)  # the cases are checked against the list instead
        except MergeError as exc:
            raise CertifyError(str(exc)) from None
        document["caselist"] = dict(lists[0])
    return document, [origin[record.get("id")] for record in document["results"]]


def content_members(documents: list[dict], sources: list[str], statement: bytes, *, created: _dt.date | None = None) -> dict[str, bytes]:
    """Every member but the verdict-dependent ones (``bundle.json``'s verdict, the certificate, the index):
    ``bundle.json`` is written with ``verdict`` None, for :func:`conformance.certify.verify.finish` to fill."""
    document, inputs = combined(documents, sources)
    digests = [{"id": record.get("id"), "digest": record_digest(record), "input": number + 1} for record, number in zip(document["results"], inputs)]
    listed = document["caselist"]
    header = {
        "bundle": "lora-conformance certification bundle", "format": FORMAT,
        "suite_version": document.get("suite_version"), "certified_with": conformance.__version__,
        "target": document.get("target"), "target_class": document.get("target_class"),
        "caselist": {"name": listed["name"], "digest": listed["digest"], "count": listed.get("count")},
        "created": (created or _dt.datetime.now(_dt.timezone.utc).date()).isoformat(),
        "inputs": [{"input": n + 1, "source": source, "shard": doc.get("shard"), "cases": len(doc["results"]),
                    "manifest": f"{MANIFESTS}input-{n + 1}.json"} for n, (source, doc) in enumerate(zip(sources, documents))],
        "record_digest": {"algorithm": "sha256", "fields": list(RECORD_FIELDS),
                          "canonical_json": "sorted keys, separators ',' and ':', ASCII, absent fields as null, "
                                                            "non-finite numbers as the strings inf, -inf, nan"},
        "verdict": None,
    }
    members = {
        BUNDLE: json_bytes(header),
        RESULTS: json_bytes(document),
        DIGESTS: json_bytes({"algorithm": "sha256", "records": digests}),
        WAIVERS: json_bytes({"loaded": loaded_waivers(documents, sources), "used": used_waivers(document["results"])}),
        STATEMENT: statement,
    }
    for n, doc in enumerate(documents):
        members[f"{MANIFESTS}input-{n + 1}.json"] = json_bytes({key: value for key, value in doc.items() if key != "results"})
    return members


def outcome_counts(results: list[dict]) -> dict[str, int]:
    return dict(sorted(Counter(str(record.get("outcome")) for record in results).items()))


def default_out(target: str, caselist: str) -> Path:
    """``<target>-<caselist>-bundle.tar.gz``, the target's name made a file name (``module:Class`` → ``module_Class``)."""
    safe = "".join(c if c.isalnum() or c in "._-" else "_" for c in f"{target}-{caselist}")
    return Path(f"{safe}-bundle.tar.gz")
