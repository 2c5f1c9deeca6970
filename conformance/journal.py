"""A run's record on disk, written as it goes, so that a killed run still says what it judged.

Two kinds of file in the report dir:

* ``run.json``, the **manifest**, written once the cases are collected (before the first one runs):
  what was run (target, profile, seed, shard, expectations; from a pytest run also ``shard_source``:
  ``--shard=I/N`` given, or the CI variables ``--shard=auto`` read, ``conformance.sharding``), the
  environment fingerprint, and the case lists: ``expected`` (every case this run is to judge: its
  shard's share after ``-k``/``-m``), ``selection`` (those ``-k`` and ``-m`` expressions and the
  node-id arguments as given, empty from a script; ``--resume`` refuses others; absent from older
  manifests: read as empty), ``shard_cases`` (its shard's share before the selection) and
  ``case_list`` (the count and digest of the profile's whole list, every shard together: what a merge
  must add up to), with ``hypothesis_version``, which drew the op cases (a merge draws them again);
* ``results/<worker>.jsonl``, the **journals**: one line per case, appended and flushed as each
  result arrives (``main`` in a serial run, ``gw0``… under xdist, ``controller`` for the cases the
  controller saw a pytest worker crash on).

:func:`build_document` turns a manifest and the journals into the results document
(``results.json``), whether the run ended normally, was killed (``python -m conformance.report html
DIR`` rebuilds it) or was completed by ``--resume DIR``. An expected case with no line in any journal
is *missing*, and a missing case fails the gate (``conformance.gate``).
"""

from __future__ import annotations

import hashlib
import json
from pathlib import Path

from conformance.gate import gate_verdict, summarize
from conformance.text import TRACEBACK_LIMIT, safe_text, without_surrogates

MANIFEST = "run.json"
JOURNALS = "results"
MANIFEST_FIELDS = ("suite_version", "target", "profile", "seed", "shard", "expected", "shard_cases", "case_list")


def case_list_summary(case_ids: list[str]) -> dict:
    """``{"count", "digest"}`` of a case list: equal digests, equal lists (order does not matter)."""
    digest = hashlib.sha256("\n".join(sorted(case_ids)).encode()).hexdigest()
    return {"count": len(case_ids), "digest": f"sha256:{digest}"}


# Every level's cases are one test function (conformance/test_cases.py), parametrized by case id.
TEST_FILE = "conformance/test_cases.py"
TEST_FUNCTION = "test_case"


def node_id(case_id: str) -> str:
    """The pytest node id of a case, as a repro command names it."""
    return f"{TEST_FILE}::{TEST_FUNCTION}[{case_id}]"


def case_id_of(nodeid: str) -> str | None:
    """``conformance/test_cases.py::test_case[ID]`` → ``ID``; None for a test that is not a conformance case."""
    name = nodeid.rsplit("::", 1)[-1]
    if not (name.startswith(f"{TEST_FUNCTION}[") and name.endswith("]")):
        return None
    return name[name.index("[") + 1 : -1]


class Journal:
    """One process's journal: ``append`` writes one line and flushes it before returning."""

    def __init__(self, report_dir: Path, worker: str) -> None:
        self.path = Path(report_dir) / JOURNALS / f"{worker}.jsonl"

    def append(self, record: dict) -> None:
        self.path.parent.mkdir(parents=True, exist_ok=True)
        with self.path.open("a") as stream:  # closed (so flushed to the OS) before the next case runs
            stream.write(json.dumps(record) + "\n")


def clear_journals(report_dir: Path) -> None:
    """Remove the journals and manifest of an earlier run in this report dir."""
    for stale in (Path(report_dir) / JOURNALS).glob("*.jsonl"):
        stale.unlink()
    (Path(report_dir) / MANIFEST).unlink(missing_ok=True)


def read_journals(report_dir: Path) -> list[dict]:
    """Every journalled result, one per case id (a later line for the same case replaces an earlier one).

    A line cut short by a kill in the middle of a write is skipped: its case counts as missing. A journal
    written before messages were made safe text (``conformance.text``) may hold ``"\\udcff"``, which JSON
    decodes into a lone surrogate that no UTF-8 writer accepts: such surrogates come back escaped
    (``\\udcff`` as text), and a message longer than ``conformance.text.MESSAGE_LIMIT`` is cut, as is
    a ``traceback`` (what the target raised) longer than ``conformance.text.TRACEBACK_LIMIT``.
    """
    by_id: dict[str, dict] = {}
    for path in sorted((Path(report_dir) / JOURNALS).glob("*.jsonl")):
        # only line breaks split records: str.splitlines would also split at \x1c, \x85, \u2028, …
        for line in path.read_text(encoding="utf-8", errors="surrogateescape").split("\n"):
            try:
                record = json.loads(line)
            except json.JSONDecodeError:
                continue
            if isinstance(record, dict) and isinstance(record.get("id"), str):
                record = without_surrogates(record)
                if isinstance(record.get("message"), str):
                    record["message"] = safe_text(record["message"])
                if isinstance(record.get("traceback"), str):
                    record["traceback"] = safe_text(record["traceback"], TRACEBACK_LIMIT)
                by_id[record["id"]] = record
    return sorted(by_id.values(), key=lambda r: r["id"])


def write_manifest(report_dir: Path, manifest: dict) -> Path:
    path = Path(report_dir) / MANIFEST
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(manifest, indent=1) + "\n")
    return path


def read_manifest(report_dir: Path) -> dict:
    """The manifest of the run in ``report_dir``; ``ValueError`` naming what is missing or malformed."""
    path = Path(report_dir) / MANIFEST
    try:
        manifest = json.loads(path.read_text())
    except FileNotFoundError:
        raise ValueError(
            f"{path} does not exist: {report_dir} holds no run that got as far as collecting its cases "
            "(a run writes run.json before its first case)"
        ) from None
    except json.JSONDecodeError as exc:
        raise ValueError(f"{path} is not valid JSON: {exc}") from None
    if not isinstance(manifest, dict):
        raise ValueError(f"{path} is not a run manifest (a JSON object)")
    missing = [name for name in MANIFEST_FIELDS if name not in manifest]
    if missing:
        raise ValueError(f"{path} lacks the field(s) {missing}")
    if not (isinstance(manifest["expected"], list) and all(isinstance(i, str) for i in manifest["expected"])):
        raise ValueError(f"{path}: field 'expected' must be a list of case ids")
    return manifest


def build_document(manifest: dict, results: list[dict], *, workers: list[dict] | None = None, pytest_exitstatus: int = 0) -> dict:
    """The results document: the manifest's description of the run, its results, and the gate over them.

    Results of cases the manifest does not expect (none, unless journals were mixed by hand) are
    kept and listed under ``unexpected``; expected cases without a result are listed under ``missing``.
    """
    expected = manifest["expected"]
    seen = {r["id"] for r in results}
    expected_set = set(expected)
    missing = [case_id for case_id in expected if case_id not in seen]
    unexpected = sorted(seen - expected_set)
    gate = gate_verdict(results, pytest_exitstatus, missing=missing, unexpected=unexpected)
    document = dict(manifest)
    document.update(
        missing=missing,
        unexpected=unexpected,
        workers=workers if workers is not None else _workers_from(results),
        gate=gate,
        summary=summarize(results),
        results=results,
    )
    return document


def _workers_from(results: list[dict]) -> list[dict]:
    """Without the processes' own reports (a killed run): which workers journalled results."""
    return [{"worker": name, "device": "not recorded (the run did not end normally)"}
            for name in sorted({r.get("worker") for r in results if r.get("worker")})]
