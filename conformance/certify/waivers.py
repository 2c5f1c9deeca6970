"""The waivers of a bundle: which expectations entries the run loaded, which its known failures used, and
whether each used one is a central waiver that applies.

A known failure is accepted by a conformance verdict only under a *central* waiver: an entry of the
expectations files this suite release ships, found by its digest, that covers the case, its symptom, the
run's date, package versions and device (``conformance.expectations.waiver_check``). A run may load a
local file (``--expectations FILE``); its known failures are then honest but not conformant. A record
that presents a waiver as central which the release does not ship as such (an edited entry, a local one
relabelled, one that does not cover the case) is a forged record: the bundle is invalid.
"""

from __future__ import annotations

import datetime as _dt
import functools
from collections.abc import Mapping
from pathlib import Path

from conformance.expectations import CENTRAL, LOCAL, central_entries, load_expectations, waiver_check
from conformance.verdict import Outcome

WAIVED = (Outcome.KNOWN_FAILURE.value, Outcome.UNEXPECTED_PASS.value)  # the outcomes an expectations entry decided
LOCAL_WAIVER, FORGED_WAIVER = "local", "forged"


def run_fingerprint(manifest: Mapping, record: Mapping) -> dict:
    """What ``waiver_check`` reads of the run that produced ``record``: its input's environment fingerprint
    (package versions), the device of the worker that ran it, the target's version and the versions the
    target says it runs."""
    workers = [w for w in manifest.get("workers") or () if isinstance(w, Mapping) and w.get("worker") == record.get("worker")]
    device = {key: value for key, value in (workers[0] if workers else {}).items() if key not in ("worker", "pid", "source")}
    return {
        **(manifest.get("environment") or {}), **device,
        "target_version": manifest.get("target_version"),
        "target_package_versions": manifest.get("target_package_versions") or {},
    }


def run_date(record: Mapping, fallback: _dt.date) -> _dt.date:
    """The day the record's case finished (UTC), against which its waiver's expiry is read; ``fallback``
    (the bundle's date) for a record that does not say."""
    finished = record.get("finished")
    if isinstance(finished, (int, float)) and not isinstance(finished, bool):
        return _dt.datetime.fromtimestamp(finished, _dt.timezone.utc).date()
    return fallback


@functools.cache
def _shipped_entries():
    """The release's central entries, read once per process: the shipped files do not change under a verify."""
    return central_entries()


def waiver_finding(record: Mapping, fingerprint: Mapping, today: _dt.date) -> tuple[str, str] | None:
    """``(LOCAL_WAIVER | FORGED_WAIVER, why)`` for a known failure whose waiver is not a central one that
    applies; None when it is. Local: the record says its entry came from a local file (an honest record
    of a run that is not conformant); forged: it says central, or nothing, and the release ships no such
    central entry covering it."""
    why = waiver_check(record, fingerprint, today, _shipped_entries())
    if why is None:
        return None
    expectation = record.get("expectation") if isinstance(record.get("expectation"), Mapping) else {}
    return (LOCAL_WAIVER if expectation.get("source") == LOCAL else FORGED_WAIVER), why


def used_waivers(records: list[dict]) -> list[dict]:
    """Each expectations entry the records' known failures and unexpected passes name, once, with the ids
    of the cases it decided."""
    used: dict[str, dict] = {}
    for record in records:
        expectation = record.get("expectation")
        if record.get("outcome") not in WAIVED or not isinstance(expectation, dict):
            continue
        key = str(expectation.get("digest") or expectation.get("id"))
        entry = used.setdefault(key, {"entry": expectation, "known failure": [], "unexpected pass": []})
        entry[record["outcome"]].append(record.get("id"))
    return sorted(used.values(), key=lambda u: str(u["entry"].get("id")))


def loaded_waivers(documents: list[dict], sources: list[str]) -> list[dict]:
    """The expectations file each input run loaded: its path, whether it is central, and its entries as
    loaded here (or why they could not be read: the file is on the machine that ran it)."""
    loaded = []
    for source, document in zip(sources, documents):
        path = document.get("expectations")
        record: dict = {"source": source, "file": path, "not_applicable": document.get("expectations_not_applicable") or []}
        if path:
            try:
                entries = load_expectations(Path(path))
                record["entries"] = [entry.to_json() for entry in entries]
                record["central"] = all(entry.source == CENTRAL for entry in entries)
            except ValueError as exc:
                record["unreadable"] = str(exc)
        loaded.append(record)
    return loaded
