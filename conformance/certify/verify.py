"""Verifying a bundle without rerunning it: ``lora-conformance verify BUNDLE [--rejudge N]``.

The checks, in order (docs/certification.md says what each proves and what it does not):

1. the file opens as a .tar.gz whose members are plain files with safe names and sizes (``archive``);
2. the hash index holds: every member listed, with its SHA-256 and size, nothing unlisted;
3. the bundle's files parse (JSON; the statement as TOML) and name the suite release verifying them;
4. the case list it names is one this release ships, with the same digest;
5. every case of the list has exactly one record, none is extra, none duplicated;
6. each record holds its list entry's case JSON and was judged on the list's inputs (``inputs_digest``);
7. each record's digest recomputes (``records.record_digest``) and names an input the bundle holds;
8. each outcome follows from its recorded measurement by the released verdict rules (``records``);
9. each known failure's waiver is central and applies (``waivers``; a local one makes it not conformant);
10. ``waivers.json`` lists exactly the waivers the records used;
11. the statement names this bundle's target and list (filled or not is reported, not judged);
12. ``bundle.json``'s verdict is the one reached here (said only where the data is otherwise valid: an
    invalid bundle's own problems are named already), and ``certificate.html`` is the one its data renders;
13. with ``--rejudge N``: N cases sampled from the list (seeded; the seed is printed) get their inputs
    digest and oracle fingerprint computed again here and compared with the records.

A failing check of 1–8 or 10–13 makes the bundle **invalid** (exit 2): it is not what certify wrote
from a run of the released list. Otherwise a case that failed, broke or passed against its expectation
(unexpected pass), or a known failure under a local waiver, makes it **not conformant** (exit 1);
else it is **conformant** (exit 0). Every problem is reported, each naming its file and record.
"""

from __future__ import annotations

import datetime as _dt
import json
import random
import secrets
from dataclasses import dataclass, field
from pathlib import Path

import conformance
from conformance.verdict import Outcome

from . import archive
from .against_list import listed_ids, population_problems, record_problems, released_list
from .bundle import BUNDLE, CERTIFICATE, DIGESTS, FORMAT, MANIFESTS, RESULTS, STATEMENT, WAIVERS
from .certificate import render_certificate
from .records import outcome_problems, record_digest
from .statement import statement_findings
from .waivers import LOCAL_WAIVER, run_date, run_fingerprint, used_waivers, waiver_finding

INVALID, NOT_CONFORMANT = "invalid", "not conformant"
CONFORMANT = "conformant"
EXIT_CODES = {CONFORMANT: 0, NOT_CONFORMANT: 1, INVALID: 2}
UNWAIVED = (Outcome.FAIL.value, Outcome.BROKEN.value, Outcome.UNEXPECTED_PASS.value)


@dataclass(frozen=True)
class Finding:
    severity: str  # INVALID or NOT_CONFORMANT
    where: str  # the file (and record) it is about
    what: str

    def line(self) -> str:
        return f"{self.severity}: {self.where}: {self.what}"


@dataclass
class Verification:
    findings: list[Finding] = field(default_factory=list)
    notes: list[str] = field(default_factory=list)  # said, not judged: the statement, the rejudge seed
    summary: str = ""

    def invalid(self, where: str, what: str) -> None:
        self.findings.append(Finding(INVALID, where, what))

    def not_conformant(self, where: str, what: str) -> None:
        self.findings.append(Finding(NOT_CONFORMANT, where, what))

    @property
    def verdict(self) -> str:
        severities = {finding.severity for finding in self.findings}
        return INVALID if INVALID in severities else NOT_CONFORMANT if severities else CONFORMANT

    @property
    def exit_code(self) -> int:
        return EXIT_CODES[self.verdict]

    def claimed(self) -> dict:
        """What ``bundle.json`` records of this verification (certify's verdict)."""
        return {"verdict": self.verdict, "findings": [finding.line() for finding in self.findings]}


def _parsed(members: dict[str, bytes], name: str, check: Verification):
    if name not in members:
        check.invalid(name, "absent; every bundle certify writes holds it")
        return None
    try:
        return json.loads(members[name].decode("utf-8"))
    except (UnicodeDecodeError, ValueError) as exc:
        check.invalid(name, f"not JSON ({exc})")
        return None


def check_content(members: dict[str, bytes], released: dict[str, Path] | None = None) -> Verification:
    """Checks 3–11 over a bundle's members (the verdict certify records, and verify reaches again)."""
    from conformance.caselists import load_caselist, released_caselists  # the lists are read only when a bundle is checked

    released = released_caselists() if released is None else released
    check = Verification()
    header, document = _parsed(members, BUNDLE, check), _parsed(members, RESULTS, check)
    digests, waivers = _parsed(members, DIGESTS, check), _parsed(members, WAIVERS, check)
    if header is not None and not isinstance(header, dict):
        check.invalid(BUNDLE, "not a JSON object")
    if document is not None and not (isinstance(document, dict) and isinstance(document.get("results"), list)):
        check.invalid(RESULTS, "not a results document (no 'results' list)")
    if not isinstance(header, dict) or not isinstance(document, dict) or not isinstance(document.get("results"), list):
        return check  # what follows reads both
    if header.get("format") != FORMAT:
        check.invalid(BUNDLE, f"format {header.get('format')!r}; this suite reads format {FORMAT}")
    if header.get("suite_version") != conformance.__version__:
        check.invalid(BUNDLE, f"run by suite {header.get('suite_version')}, verified here with {conformance.__version__}: the released "
                              "lists and verdict rules are a release's; verify with the release that ran it")
    records = [record for record in document["results"] if isinstance(record, dict)]
    if len(records) != len(document["results"]):
        check.invalid(RESULTS, f"{len(document['results']) - len(records)} of its records are not JSON objects")
    claimed = header.get("caselist") if isinstance(header.get("caselist"), dict) else {}
    if {k: claimed.get(k) for k in ("name", "digest")} != {k: (document.get("caselist") or {}).get(k) for k in ("name", "digest")}:
        check.invalid(RESULTS, f"the results record case list {document.get('caselist')!r}, the bundle names {claimed!r}")
    if document.get("target") != header.get("target"):
        check.invalid(RESULTS, f"the results are of target {document.get('target')!r}, the bundle names {header.get('target')!r}")
    caselist, why = released_list(claimed, released, load_caselist)
    if why:
        check.invalid("caselist", why)
    else:
        for problem in population_problems(records, caselist):
            check.invalid(RESULTS, problem)
        by_id = caselist.by_id
        for record in records:
            entry = by_id.get(record.get("id"))
            for problem in record_problems(record, entry) if entry is not None else ():
                check.invalid(f"{RESULTS} record {record.get('id')}", problem)
    manifests = _manifests(members, header, check)
    inputs = _check_digests(records, digests, len(manifests), check)
    for record in records:
        for problem in outcome_problems(record):
            check.invalid(f"{RESULTS} record {record.get('id')}", problem)
    _check_waivers(records, inputs, manifests, header, check)
    if isinstance(waivers, dict) and waivers.get("used") != json.loads(json.dumps(used_waivers(records))):
        check.invalid(WAIVERS, "its 'used' list is not the waivers the records name (each entry once, with the cases it decided)")
    _check_failures(records, check)
    _check_statement(members, header, check)
    counts = {outcome: sum(1 for r in records if r.get("outcome") == outcome) for outcome in sorted({str(r.get("outcome")) for r in records})}
    check.summary = (f"target {header.get('target')}, case list {claimed.get('name')} ({claimed.get('digest')}), {len(records)} records: "
                     + ", ".join(f"{n} {outcome}" for outcome, n in counts.items()))
    return check


def _manifests(members: dict[str, bytes], header: dict, check: Verification) -> list[dict]:
    """Each input's manifest, in order (an empty one where it cannot be read, named)."""
    manifests = []
    inputs = header.get("inputs") if isinstance(header.get("inputs"), list) else []
    if not inputs:
        check.invalid(BUNDLE, "lists no inputs (the runs or shards the results come from)")
    for number in range(1, len(inputs) + 1):
        name = f"{MANIFESTS}input-{number}.json"
        manifest = _parsed(members, name, check)
        manifests.append(manifest if isinstance(manifest, dict) else {})
        if isinstance(manifest, dict) and (manifest.get("caselist") or {}).get("digest") != (header.get("caselist") or {}).get("digest"):
            check.invalid(name, f"this input ran case list {manifest.get('caselist')!r}, not the bundle's")
    return manifests


def _check_digests(records: list[dict], digests, inputs: int, check: Verification) -> dict[str, int]:
    """Check 7; the input each record came from, by id, as ``digests.json`` names it."""
    listed = digests.get("records") if isinstance(digests, dict) else None
    if not isinstance(listed, list):
        if digests is not None:
            check.invalid(DIGESTS, "no 'records' list of record digests")
        return {}
    by_id: dict[str, list[dict]] = {}
    for item in listed:
        by_id.setdefault(str(item.get("id")) if isinstance(item, dict) else "", []).append(item if isinstance(item, dict) else {})
    ids = {str(record.get("id")) for record in records}
    for record in records:
        where = f"{RESULTS} record {record.get('id')}"
        entries = by_id.get(str(record.get("id")), [])
        if len(entries) != 1:
            check.invalid(where, f"{DIGESTS} lists {len(entries)} digests for it, not one")
            continue
        recomputed = record_digest(record)
        if entries[0].get("digest") != recomputed:
            check.invalid(where, f"its digest recomputes to {recomputed}, but {DIGESTS} lists {entries[0].get('digest')}: the record "
                                 "(case, inputs, oracle, outcome, kinds, measurement or expectation) was changed after it was digested")
        if entries[0].get("input") not in range(1, inputs + 1):
            check.invalid(where, f"{DIGESTS} names input {entries[0].get('input')!r}, and the bundle has inputs 1 to {inputs}")
    extra = sorted(set(by_id) - ids)
    if extra:
        check.invalid(DIGESTS, f"digests of {len(extra)} record(s) the results do not hold: {listed_ids(extra)}")
    return {case_id: entries[0].get("input") for case_id, entries in by_id.items() if len(entries) == 1}


def _check_waivers(records: list[dict], inputs: dict[str, int], manifests: list[dict], header: dict, check: Verification) -> None:
    try:
        fallback = _dt.date.fromisoformat(str(header.get("created")))
    except ValueError:
        check.invalid(BUNDLE, f"created {header.get('created')!r} is not a date")
        fallback = _dt.date.today()
    for record in records:
        if record.get("outcome") != Outcome.KNOWN_FAILURE.value:
            continue
        number = inputs.get(str(record.get("id")))
        manifest = manifests[number - 1] if isinstance(number, int) and 0 < number <= len(manifests) else {}
        finding = waiver_finding(record, run_fingerprint(manifest, record), run_date(record, fallback))
        if finding is None:
            continue
        kind, why = finding
        where = f"{RESULTS} record {record.get('id')}"
        if kind == LOCAL_WAIVER:
            check.not_conformant(where, f"a known failure under a local waiver: {why}")
        else:
            check.invalid(where, f"its waiver is presented as central but is not one that covers it: {why}")


def _check_failures(records: list[dict], check: Verification) -> None:
    for outcome in UNWAIVED:
        ids = [str(record.get("id")) for record in records if record.get("outcome") == outcome]
        if ids:
            check.not_conformant(RESULTS, f"{len(ids)} case(s) ended {outcome!r}, which no central waiver covers: {listed_ids(ids)}")


def _check_statement(members: dict[str, bytes], header: dict, check: Verification) -> None:
    if STATEMENT not in members:
        check.invalid(STATEMENT, "absent; certify writes a template for the vendor to fill in")
        return
    listed = header.get("caselist") or {}
    problems, unfilled = statement_findings(members[STATEMENT], header.get("target"), listed.get("name"), listed.get("digest"))
    for problem in problems:
        check.invalid(STATEMENT, problem)
    check.notes.append(f"statement: {'filled' if not unfilled else 'not filled (empty: ' + ', '.join(unfilled) + ')'}")


def finish(members: dict[str, bytes], released: dict[str, Path] | None = None) -> tuple[dict[str, bytes], Verification]:
    """The bundle's members complete: ``bundle.json`` with the verdict the content checks reach, the
    certificate rendered from it, and the index over everything."""
    check = check_content(members, released)
    header = json.loads(members[BUNDLE])
    header["verdict"] = check.claimed()
    members = {**members, BUNDLE: (json.dumps(header, indent=1, sort_keys=True, ensure_ascii=False) + "\n").encode()}
    members[CERTIFICATE] = _certificate(members).encode()
    return archive.with_index(members), check


def _certificate(members: dict[str, bytes]) -> str:
    return render_certificate(*(json.loads(members[name]) for name in (BUNDLE, RESULTS, WAIVERS)))


def verify_bundle(path, released: dict[str, Path] | None = None, rejudge: int = 0, seed: int | None = None) -> Verification:
    """Every check of the module docstring over the bundle at ``path``."""
    check = Verification()
    try:
        members, unsafe = archive.read_archive(path)
    except archive.BundleUnreadable as exc:
        check.invalid("archive", str(exc))
        return check
    # the archive's and the index's problems first: they say whether anything after them can be trusted
    for problem in unsafe:
        check.invalid("archive", problem)
    for problem in archive.index_problems(members):
        check.invalid(archive.INDEX, problem)
    content = check_content(members, released)
    check.findings += content.findings
    check.notes += content.notes
    check.summary = content.summary
    _check_claims(members, content, check)
    if rejudge:
        _rejudge(members, rejudge, seed, check)
    return check


def _check_claims(members: dict[str, bytes], content: Verification, check: Verification) -> None:
    """Check 12: the verdict ``bundle.json`` records, and the certificate, are those of the bundle's data."""
    try:
        recorded = json.loads(members[BUNDLE]).get("verdict")
        certificate = _certificate(members)
    except (KeyError, ValueError, TypeError, AttributeError):
        return  # an unreadable bundle.json, results.json or waivers.json is named by the content checks already
    if recorded != content.claimed() and content.verdict != INVALID:  # an invalid content is named already, claims aside
        said = recorded.get("verdict") if isinstance(recorded, dict) else recorded
        check.invalid(BUNDLE, f"it records the verdict {said!r} and its findings, but its data gives {content.verdict!r} "
                              f"with {len(content.findings)} finding(s) here")
    if CERTIFICATE not in members:
        check.invalid(CERTIFICATE, "absent")
    elif members[CERTIFICATE].decode("utf-8", "replace") != certificate:
        check.invalid(CERTIFICATE, "it is not the certificate the bundle's data renders: it says more or other than the bundle")


def _rejudge(members: dict[str, bytes], count: int, seed: int | None, check: Verification) -> None:
    """Check 13: ``count`` cases of the list, sampled with ``seed``, judged again here (their inputs and oracle)."""
    from conformance.caselists import CaselistError, fingerprints_agree, load_caselist, rejudge_entry, released_caselists

    try:
        header, document = json.loads(members[BUNDLE]), json.loads(members[RESULTS])
        name = header["caselist"]["name"]
        caselist = load_caselist(released_caselists()[name])
    except (KeyError, ValueError, TypeError, CaselistError) as exc:
        check.invalid("rejudge", f"cannot rejudge: the bundle's case list cannot be read here ({exc})")
        return
    seed = secrets.randbelow(2**32) if seed is None else seed
    sample = random.Random(seed).sample(list(caselist.entries), min(count, len(caselist.entries)))
    check.notes.append(f"rejudge: {len(sample)} case(s) of {name}, seed {seed} (--rejudge {count} --seed {seed} repeats it): "
                       + ", ".join(entry.case_id for entry in sample))
    records = {record.get("id"): record for record in document.get("results") or []}
    for entry in sample:
        record = records.get(entry.case_id)
        if record is None:
            continue  # named by the population check
        where = f"rejudge {entry.case_id}"
        try:
            again = rejudge_entry(entry)
        except (CaselistError, ValueError, RuntimeError) as exc:
            check.invalid(where, f"could not be computed again here ({type(exc).__name__}: {exc})")
            continue
        if again["inputs_digest"] != entry.inputs_digest:
            check.invalid(where, f"this environment draws inputs {again['inputs_digest']} for it, the list holds {entry.inputs_digest}: "
                                 "it cannot be rejudged here (another torch build?); rejudge where the list's inputs are drawn")
            continue
        if record.get("outcome") == Outcome.NOT_SUPPORTED.value:
            continue  # the target ran nothing: no oracle was recorded
        recorded, recomputed = record.get("oracle_fingerprint"), again["oracle_fingerprint"]
        if recomputed is None and recorded is None:
            continue
        if recomputed is None or recorded is None or not fingerprints_agree(recorded, recomputed):
            check.invalid(where, f"its recorded oracle fingerprint {recorded} is not the {recomputed} computed here from the list's case: "
                                 "its outcome was not judged against this case's oracle")
