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
    approver = "lora-conformance maintainers"   # who granted it, a person or team: required in a shipped file
    link = "https://github.com/…/pull/48421"    # optional: where to read about it (default: upstream[0])
    devices = { generation = ["gaudi2"], driver = ">=1.18,<1.22", target_version = ">=0.1" }
                                                # optional: only on these devices (each key optional)

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

``devices`` scopes an entry to the device the case ran on, as the environment fingerprint describes it
(``conformance.report.fingerprint.device_description``): ``generation`` lists device generations
(``gaudi2``, ``gaudi3``, ``sm_90``, ``cpu``: the fingerprint's ``device_generation``), ``driver`` and
``target_version`` are PEP 440 ranges for the driver (compared by its leading version: ``1.18.0-ee698fb``
is 1.18.0) and for the version of the distribution that installs the target class (:func:`target_version`:
lora-conformance's for the built-in targets, a vendor package's for its own). The referee's process never
queries a device runtime, so the scope is evaluated per result against the device that the process that
ran the case reported (its worker, or its tensor-parallel ranks: ``ConformanceRun.scope_fingerprint``),
the same description the results document records under ``workers``. An entry outside its scope, or whose
scope cannot be evaluated because the generation, driver or version was not read, is not applied, and a
failure it would have covered says why in its message: never applied blind, never skipped silently.

**Central and local entries** (docs/waivers.md). An entry loaded from a file shipped in the package, beside
this module, is *central*: the release's waivers, each with an ``approver``. Any other file (``--expectations
FILE``, a vendor's CI) is *local*: it works the same way in a run, but a bundle whose known failures use a
local entry is not conformant. A matched result's ``expectation`` records where its entry came from
(``source``, ``file``) and the entry's ``digest``, the SHA-256 of its canonical content
(:meth:`KnownFailure.canonical`): :func:`waiver_check` re-checks a record against the central entries
(:func:`central_entries`) and the device the run recorded, without rerunning anything.
"""

from __future__ import annotations

import datetime as _dt
import enum
import fnmatch
import functools
import importlib.metadata
import re
from collections.abc import Callable, Mapping
from dataclasses import dataclass, fields, replace
from pathlib import Path

try:
    import tomllib
except ModuleNotFoundError:  # Python 3.10 (vendor stacks still ship it): the same parser, packaged as tomli
    import tomli as tomllib

from packaging.specifiers import InvalidSpecifier, SpecifierSet
from packaging.version import InvalidVersion, Version

from conformance.cases.features import FEATURE_DOCS
from conformance.digest import json_digest
from conformance.query import Query, QueryError, matching, parse_query
from conformance.verdict import FailureKind, Outcome

SHIPPED_DIR = Path(__file__).parent
SHIPPED_PREFIX = "conformance/expectations"  # SHIPPED_DIR inside the package: how a central entry's ``file`` starts
CENTRAL, LOCAL = "central", "local"
UNKNOWN = "unknown"
SYMPTOMS = {"no-adapter": "every failing row uses no adapter (slot −1)"}
_FIELDS = {
    "id", "reason", "upstream", "expires", "ops", "cases", "dtypes",
    "features_all", "features_any", "features_none", "failing_rows", "kinds", "versions",
    "approver", "link", "devices",
}
# the keys of ``devices``, and the device fingerprint field each is evaluated against
DEVICE_FIELDS = {"generation": "device_generation", "driver": "driver", "target_version": "target_version"}
DEVICES_EXAMPLE = 'devices = { generation = ["gaudi2"], driver = ">=1.18,<1.22", target_version = ">=0.1" }'
_LEADING_VERSION = re.compile(r"\s*v?(\d+(?:\.\d+)*)")
FAIL_KINDS = frozenset(kind for kind in FailureKind if not kind.broken and kind is not FailureKind.NO_RESULT)


def leading_version(text: str | None) -> Version | None:
    """The version a driver or package string starts with (``1.18.0-ee698fb`` → 1.18.0), None without one."""
    match = _LEADING_VERSION.match(str(text or ""))
    return Version(match.group(1)) if match else None


@dataclass(frozen=True)
class DeviceScope:
    """Where an entry applies (its ``devices`` table), by the fingerprint of the device the case ran on."""

    generation: tuple[str, ...] = ()
    driver: SpecifierSet | None = None
    target_version: SpecifierSet | None = None

    def to_json(self) -> dict:
        record: dict = {"generation": list(self.generation)} if self.generation else {}
        for key in ("driver", "target_version"):
            if getattr(self, key) is not None:
                record[key] = str(getattr(self, key))
        return record

    def excludes(self, fingerprint: Mapping[str, str] | None) -> str | None:
        """None when the device ``fingerprint`` describes is inside the scope; else why it is not, or why that
        cannot be told (a generation, driver or version that was not read)."""
        fingerprint = fingerprint or {}
        if self.generation:
            generation = str(fingerprint.get("device_generation") or UNKNOWN)
            wanted = "device generation " + " or ".join(self.generation)
            if generation == UNKNOWN:
                device = fingerprint.get("device") or "no device description recorded"
                return f"scoped to {wanted}, and the generation of the device that ran the case was not read ({device})"
            if generation not in self.generation:
                return f"scoped to {wanted}; the case ran on {generation}"
        for key, what in (("driver", "driver"), ("target_version", "target version")):
            specifier = getattr(self, key)
            if specifier is None:
                continue
            recorded = str(fingerprint.get(DEVICE_FIELDS[key]) or UNKNOWN)
            version = leading_version(recorded)
            if version is None:
                return f"scoped to {what} {specifier}, and the {what} of this run was not read as a version ({recorded!r})"
            if not specifier.contains(version, prereleases=True):
                return f"scoped to {what} {specifier}; the case ran with {what} {recorded}"
        return None


def _plain(value):
    """A loaded field as plain JSON: sets sorted, dates ISO, versions, queries and kinds as their text."""
    if isinstance(value, DeviceScope):
        return value.to_json()
    if isinstance(value, (frozenset, set)):
        return sorted(_plain(item) for item in value)
    if isinstance(value, (tuple, list)):
        return [_plain(item) for item in value]
    if isinstance(value, _dt.date):
        return value.isoformat()
    if isinstance(value, enum.Enum):
        return value.value
    if isinstance(value, (SpecifierSet, Query)):
        return str(value)
    return value


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
    approver: str | None = None  # who granted it: required for a central entry
    link: str | None = None  # where to read about it; None: upstream[0]
    devices: DeviceScope | None = None
    # where it was loaded from (not part of its content, nor of its digest): central or local, and the file
    source: str = LOCAL
    file: str | None = None

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

    def scope_reason(self, device: Mapping[str, str] | None) -> str | None:
        """None when the entry's ``devices`` scope includes ``device`` (a device fingerprint) or it has none; else why not."""
        return None if self.devices is None else self.devices.excludes(device)

    def canonical(self) -> dict:
        """Every field of the entry as loaded, as plain JSON: its content, without where it was loaded from."""
        return {field.name: _plain(getattr(self, field.name)) for field in fields(self) if field.name not in ("source", "file")}

    @property
    def digest(self) -> str:
        """``sha256:<hex>`` of :meth:`canonical` as JSON with sorted keys: the same entry always gives the same
        digest, wherever it is loaded from; any change to any field gives another."""
        return json_digest(self.canonical())

    def to_json(self) -> dict:
        record = {"id": self.id, "reason": self.reason, "upstream": list(self.upstream), "expires": self.expires.isoformat(),
                  "link": self.link or self.upstream[0]}
        if self.approver:
            record["approver"] = self.approver
        if self.versions:
            record["versions"] = {package: str(specifier) for package, specifier in self.versions}
        if self.devices is not None:
            record["devices"] = self.devices.to_json()
        record.update(source=self.source, file=self.file, digest=self.digest)
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


def _specifier(text, field: str, example: str, fail: Callable[[str], ValueError]) -> SpecifierSet:
    """A PEP 440 range of an entry's field (``versions``' packages, ``devices``' driver and target version)."""
    try:
        if str(text).strip():
            return SpecifierSet(str(text))
    except InvalidSpecifier:
        pass
    raise fail(f"field {field} = {text!r} is not a PEP 440 specifier such as \"{example}\"")


def _text(raw: dict, name: str, fail: Callable[[str], ValueError]) -> str | None:
    """An optional text field (``approver``, ``link``): absent, or a non-empty string."""
    value = raw.get(name)
    if value is not None and not (isinstance(value, str) and value.strip()):
        raise fail(f"field {name!r} must be a non-empty string, got {value!r}")
    return value.strip() if value is not None else None


def _device_scope(raw: dict, fail: Callable[[str], ValueError]) -> DeviceScope | None:
    if "devices" not in raw:
        return None
    devices = raw["devices"]
    if not isinstance(devices, dict) or not devices:
        raise fail(f"field 'devices' must be a table like {DEVICES_EXAMPLE}, got {devices!r}")
    unknown = sorted(set(devices) - set(DEVICE_FIELDS))
    if unknown:
        raise fail(f"field 'devices' has unknown key(s) {unknown}; allowed: {sorted(DEVICE_FIELDS)}, as in {DEVICES_EXAMPLE}")
    generation = devices.get("generation", [])
    generation = [generation] if isinstance(generation, str) else generation
    if "generation" in devices and not (
        isinstance(generation, list) and generation and all(isinstance(g, str) and g.strip() for g in generation)
    ):
        raise fail(f"field 'devices': generation must list device generations like [\"gaudi2\"], got {devices['generation']!r}")
    ranges = {key: _specifier(devices[key], f"'devices': {key}", ">=1.18,<1.22", fail) for key in ("driver", "target_version") if key in devices}
    return DeviceScope(generation=tuple(g.strip().lower() for g in generation), **ranges)


def _entry(raw: dict, where: str, central: bool = False) -> KnownFailure:
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
    parsed_versions = [(package, _specifier(specifier, f"'versions': {package}", "<0.33", fail)) for package, specifier in versions.items()]
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
    approver = _text(raw, "approver", fail)
    if central and approver is None:
        raise fail(
            f"entry {str(raw['id'])!r} is shipped with the package, a central waiver, and names no approver: add "
            "approver = \"<the person or team that granted it>\" (docs/waivers.md), or keep the entry in a local file"
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
        approver=approver,
        link=_text(raw, "link", fail) or upstream[0],
        devices=_device_scope(raw, fail),
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


def central_file(path: str | Path) -> str | None:
    """The package-relative path (``conformance/expectations/cpu.toml``) of a file shipped beside this module,
    None for any other file: its entries are central or local."""
    path = Path(path)
    try:
        inside = path.suffix == ".toml" and path.resolve().parent == SHIPPED_DIR.resolve()
    except OSError:
        return None
    return f"{SHIPPED_PREFIX}/{path.name}" if inside else None


def load_expectations(path: str | Path) -> tuple[KnownFailure, ...]:
    """Parse an expectations file; a malformed one raises ``ValueError`` naming the entry and field.

    A file shipped in the package gives central entries (each must name its approver), any other local ones."""
    path = Path(path)
    shipped = central_file(path)
    try:
        data = tomllib.loads(path.read_text())
    except FileNotFoundError:
        raise ValueError(f"expectations file {path} does not exist") from None
    except tomllib.TOMLDecodeError as exc:
        raise ValueError(f"expectations file {path} is not valid TOML: {exc}") from None
    unknown = sorted(set(data) - {"known_failure"})
    if unknown:
        raise ValueError(f"{path}: unknown top-level key(s) {unknown}; entries go in [[known_failure]] tables")
    source, file = (CENTRAL, shipped) if shipped else (LOCAL, str(path))
    entries = tuple(
        replace(_entry(raw, f"{path} entry {i + 1}", central=source == CENTRAL), source=source, file=file)
        for i, raw in enumerate(data.get("known_failure", ()))
    )
    ids = [e.id for e in entries]
    duplicates = sorted({i for i in ids if ids.count(i) > 1})
    if duplicates:
        raise ValueError(f"{path}: duplicate entry id(s) {duplicates}")
    return entries


def shipped_expectations(target_name: str) -> Path | None:
    """The expectations file the suite ships for a built-in target, if any."""
    path = SHIPPED_DIR / f"{target_name}.toml"
    return path if path.is_file() else None


def central_entries() -> dict[str, KnownFailure]:
    """Every entry of every file shipped in the package, by digest, read from the files now (never cached)."""
    return {entry.digest: entry for path in sorted(SHIPPED_DIR.glob("*.toml")) for entry in load_expectations(path)}


def target_version(reference: str, installed: Callable[[str], str | None] = installed_version) -> str:
    """The version of the distribution that installs a target class (``module:Class``): what a ``devices``
    ``target_version`` range is evaluated against. lora-conformance's for the built-in targets, a vendor
    package's for its own; "unknown" for a module no installed distribution provides (a path on sys.path)."""
    return installed(reference.partition(":")[0].split(".")[0]) or UNKNOWN


def waiver_check(record: Mapping, fingerprint: Mapping, today: _dt.date, central: Mapping[str, KnownFailure] | None = None) -> str | None:
    """Why a result record's known failure is not a valid central waiver for it; None when it is.

    ``record`` is a results record (``CaseResult.to_json``: ``id``, ``op``, ``dtype``, ``features``,
    ``failing_slots``, ``kinds`` and the matched entry under ``expectation``); ``fingerprint`` the run's
    device and stack as the results document records them (a worker's ``device_generation``, ``driver``;
    the run's ``target_version``; installed versions by package name, as the environment fingerprint has
    ``vllm`` and ``torch``; and under ``target_package_versions`` the versions the target said it runs);
    ``today`` the run's date. Pure: it reads the shipped files and its arguments, nothing else.

    The entry is found by its digest among :func:`central_entries`, never by what the record says of it,
    and must cover the record as a run would have applied it: case, symptom, date, versions and device.
    ``central``: :func:`central_entries` read once by a caller that checks many records (reading every shipped
    file per record was 3 of the 4.6 s of verifying the ``cpu`` target's smoke bundle)."""
    expectation = record.get("expectation")
    if not isinstance(expectation, Mapping):
        return "the record names no expectations entry"
    name, digest = expectation.get("id"), expectation.get("digest")
    central = central_entries() if central is None else central
    entry = central.get(digest)
    if entry is None:
        if expectation.get("source") != CENTRAL:
            return f"known failure {name!r} is a local waiver (from {expectation.get('file')}), not one of this release's central waivers"
        same_id = [e for e in central.values() if e.id == name]
        if same_id:
            return f"known failure {name!r} is not the central entry of that id as shipped (digest {digest}, shipped {same_id[0].digest}): it was edited"
        return f"known failure {name!r} (digest {digest}) is not one of this release's central waivers"
    where = f"central known failure {entry.id!r} ({entry.file})"
    if not entry.matches(str(record.get("op")), str(record.get("dtype")), frozenset(record.get("features") or ()), record.get("id")):
        return f"{where} does not cover case {record.get('id')}: its ops, dtypes, features or case queries do not match it"
    try:
        kinds = tuple(FailureKind(kind) for kind in record.get("kinds") or ())
    except ValueError:
        return f"the record's failure kinds {record.get('kinds')!r} are not the suite's"
    if not entry.covers_symptom(tuple(record.get("failing_slots") or ()), kinds):
        return f"{where} covers {entry.symptom()}, not what case {record.get('id')} failed with (kinds {list(record.get('kinds') or ())})"
    if entry.expires < today:
        return f"{where} expired on {entry.expires}, before the run on {today}"
    ran = fingerprint.get("target_package_versions")
    recorded = version_lookup(ran if isinstance(ran, Mapping) else {}, lambda package: _recorded_version(fingerprint, package))
    why = entry.not_applicable_reason(recorded) or entry.scope_reason(fingerprint)
    return f"{where} does not apply to this run: {why}" if why else None


def _recorded_version(fingerprint: Mapping, package: str) -> str | None:
    version = fingerprint.get(package)
    return None if version in (None, "not installed") else str(version)


def apply_expectations(result, entries: tuple[KnownFailure, ...], today: _dt.date, device: Mapping[str, str] | None = None):
    """The result with its outcome adjusted by the first matching, unexpired entry whose device scope holds.

    ``entries`` are those that apply here (:func:`split_applicable`); ``device`` the fingerprint of the device
    the case ran on, as the process that ran it reported it (``ConformanceRun.scope_fingerprint``), against
    which an entry's ``devices`` scope is evaluated. An entry outside its scope, or whose scope cannot be
    evaluated on ``device``, is passed over, and a failure it would have covered says why in its message."""
    matched = [e for e in entries if e.matches(result.case.op, result.case.dtype, result.features, result.case_id)]
    failed = result.outcome in (Outcome.FAIL, Outcome.BROKEN)
    passed_over = [(e, e.scope_reason(device)) for e in matched]
    matched = [e for e, why in passed_over if why is None]
    scope_notes = "".join(f" (known failure {e.id} not applied: {why})" for e, why in passed_over if why and failed)
    live = [e for e in matched if e.expires >= today]
    expired = [e for e in matched if e.expires < today]
    if not live:
        if expired and result.outcome is Outcome.FAIL:
            note = f" (known failure {expired[0].id} expired on {expired[0].expires}: re-check and renew or remove it)"
            return replace(result, message=result.message + scope_notes + note)
        return replace(result, message=result.message + scope_notes) if scope_notes else result
    entry = live[0]
    expectation = entry.to_json()
    if entry.devices is not None:  # what the scope was evaluated against
        expectation["scope_device"] = {key: (device or {}).get(key, UNKNOWN) for key in DEVICE_FIELDS.values()}
    if failed and entry.covers_symptom(result.failing_slots, result.kinds):
        return replace(result, outcome=Outcome.KNOWN_FAILURE, expectation=expectation)
    if failed:
        note = f" (not covered by known failure {entry.id}: {entry.symptom()} is not what failed)"
        return replace(result, message=result.message + scope_notes + note)
    if result.outcome is Outcome.PASS:
        message = f"expected to fail ({entry.id}: {entry.reason}) but passed: narrow or remove the entry"
        return replace(result, outcome=Outcome.UNEXPECTED_PASS, message=message, expectation=expectation)
    return result
