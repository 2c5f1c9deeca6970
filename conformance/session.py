"""One conformance run, without pytest: its settings, its cases, where they run, what is recorded.

``conformance.plugin`` turns pytest's options into :class:`RunSettings` and calls the methods here
from its hooks; a vendor can drive the same run from a script::

    from conformance.session import ConformanceRun, RunSettings

    run = ConformanceRun(RunSettings(target="mychip", profile="smoke", report_dir="reports/mychip"))
    document = run.run_all()          # every case, then results.json and report.html
    print(document["gate"]["passed"])

A run that cannot start raises :class:`RunError`, whose message names the option and the fix (the
plugin shows it as a usage error). The results document is built by ``conformance.journal`` from the
manifest and the journals, as ``python -m conformance.report html DIR`` and ``merge`` build theirs.
"""

from __future__ import annotations

import datetime as dt
import json
import os
import sys
import time
from dataclasses import dataclass
from pathlib import Path

import torch

import conformance
from conformance import journal
from conformance.caselists import Caselist, CaselistError, load_caselist
from conformance.cases.replay import read_replay
from conformance.devices import parse_devices
from conformance.errors import RunError
from conformance.expectations import (
    apply_expectations,
    load_expectations,
    shipped_expectations,
    split_applicable,
    target_version,
    version_lookup,
)
from conformance.generator import DEFAULT_PROFILE, PROFILES
from conformance.generator.cache import hypothesis_version
from conformance.isolation import IsolatedExecutor, LocalExecutor
from conformance.levels import KINDS, CaseKind, kind_of
from conformance.levels.context import LevelContext
from conformance.query import QueryError, parse_id, parse_query
from conformance.record import CaseResult
from conformance.report import write_html_report
from conformance.report.document import results_document
from conformance.report.fingerprint import device_description, environment_fingerprint
from conformance.runner import check_values
from conformance.target_call import DEFAULT_RUNS
from conformance.targets import TargetError, TargetUnavailable, known_targets
from conformance.targets.facts import TargetFacts, probe
from conformance.tp.run import TPExecutor
from conformance.verdict import FailureKind, Outcome

SUITE_VERSION = conformance.__version__
INPUT_CHECKS = 3  # a --caselist run draws this many of its op cases' inputs before it starts, to check them


@dataclass
class RunSettings:
    """The options of a run (``pytest conformance --help`` explains each); None: the default."""

    target: str | None = None
    profile: str | None = None
    seed: int | None = None
    shard: str | None = None
    cases: list[str] | None = None  # --cases: queries (conformance.query) the run's cases must match, any one of them
    caselist: str | None = None  # --caselist: a frozen list's name or path (conformance.caselists), run instead of drawing
    replay: str | None = None
    resume: str | None = None
    report_dir: str | None = None
    expectations: str | None = None
    shrink: bool = False
    isolation: str = "process"
    case_timeout: float | None = None
    devices: str | None = None  # --devices: also the device of each tensor-parallel rank (conformance.tp.run)
    device_env: str | None = None
    repeat: int | None = None  # calls per attempt at a case (default DEFAULT_RUNS), compared bit for bit
    require_deterministic: bool = False  # a nondeterministic pass fails


class CaseEntry(tuple):
    """``(case_id, case, values or None)``, whose repr is the case id.

    allure-pytest shows a test's parameters by repr and hashes them into the history id; the case's
    repr holds its seed, and seeds must not split a case's history (the seed is an excluded
    parameter of its own, see ``conformance.report.allure_results``).
    """

    def __repr__(self) -> str:
        return self[0]


class ConformanceRun:
    suite_version = SUITE_VERSION
    """Everything one process needs to run cases on one target, and to write what they gave.

    ``settings`` are the command-line options (``conformance.plugin`` fills them from pytest's);
    ``worker`` names this process's journal (``main`` serially, ``gw0``… for xdist workers);
    ``runs_cases`` is False for an xdist controller, which loads no target; ``device_assignment`` is
    what ``--devices`` set for this process (``conformance.devices``), for the record; ``facts`` the
    target's facts when the caller already has them (an xdist worker gets its controller's);
    ``selection`` how pytest narrowed the cases (:func:`run_selection`), for the manifest and ``--resume``.

    The target is never imported here unless ``--isolation=none``: its facts come from the worker process
    its cases run in (its first message; given ``facts``, or for an xdist controller, from a process of
    their own: ``conformance.targets.facts``), and this process draws the values, runs the oracle and
    judges (``conformance.referee``).
    """

    def __init__(
        self, settings: RunSettings, *, worker: str = "main", runs_cases: bool = True, device_assignment: dict | None = None,
        facts: TargetFacts | None = None, selection: dict | None = None, kinds: tuple[CaseKind, ...] = KINDS,
    ) -> None:
        self.kinds = kinds
        self.controller = worker == "main"
        self.selection = run_selection(**(selection or {}))
        self.resume_manifest = self._resume(settings, self.selection)
        self.replay = settings.replay
        self.replay_document: dict | None = None
        self.replay_entry = None
        if self.replay:
            try:
                case_id, case, values, document = read_replay(self.replay)
                check_values(case, values)
            except ValueError as exc:
                raise RunError(str(exc)) from None
            self.replay_entry = (case_id, case, values)
            self.replay_document = document
        self.target_name = settings.target or (self.replay_document or {}).get("target")
        if not self.target_name:
            raise RunError(
                f"--target is required; known targets: {', '.join(sorted(known_targets()))} (or package.module:Class)"
            )
        self.worker = worker
        self.device_assignment = device_assignment
        self.isolation = settings.isolation
        self._executor = None
        self._tp_executor = None
        self._cases_by_id: dict | None = None
        if self.isolation == "none" and runs_cases:
            self._executor = self._local_executor()  # load errors are usage errors, as they always were
            facts = self._executor.facts()
        elif facts is None and runs_cases:
            # the facts from the worker that runs the cases: the target (a framework's start-up) imported once, not twice
            self._executor = IsolatedExecutor(self.target_name, case_timeout=None, torch_threads=torch.get_num_threads())
        try:
            try:
                self.facts = facts or (self._executor.facts() if self._executor is not None else probe(self.target_name))
            except (TargetError, TargetUnavailable) as exc:
                raise RunError(str(exc).splitlines()[0]) from None
            self._settle(settings)
        except BaseException:  # refused, or interrupted: the worker started for the facts ends with the run, at once
            if isinstance(self._executor, IsolatedExecutor):
                self._executor.close(kill=True)
            raise

    def _settle(self, settings: RunSettings) -> None:
        """The rest of the settings, once the facts are known (``RunError`` for what is refused)."""
        self.repeat = DEFAULT_RUNS if settings.repeat is None else settings.repeat
        if self.repeat < 1:
            raise RunError(f"--repeat expects the number of calls per case, at least 1, got {self.repeat}")
        self.require_deterministic = settings.require_deterministic
        if self.require_deterministic and self.repeat < 2:
            raise RunError("--require-deterministic needs at least two calls per case to compare: leave out --repeat=1")
        self.caselist = self._caselist(settings)
        self.caselist_given = settings.caselist
        self.profile = settings.profile or DEFAULT_PROFILE
        self.shrink = settings.shrink
        self.seed = settings.seed or 0
        self.shard = self._shard(settings.shard)
        try:
            self.case_queries = tuple(parse_query(text) for text in settings.cases or ())
        except QueryError as exc:
            raise RunError(f"--cases: {exc}") from None
        self.report_dir = Path(settings.report_dir or default_report_dir(self.target_name))
        self.expectations_path = self._expectations_path(settings.expectations)
        try:
            entries = load_expectations(self.expectations_path) if self.expectations_path else ()
        except ValueError as exc:
            raise RunError(str(exc)) from None
        # against the versions the target runs (its own statement, e.g. swapped vLLM ops), else the installed ones
        self.expectations, self.expectations_not_applicable = split_applicable(entries, version_lookup(self.facts.package_versions))
        self.target_version = target_version(self.facts.reference)  # what an entry's devices.target_version is evaluated against
        self.today = dt.date.today()
        timeout = settings.case_timeout if settings.case_timeout is not None else PROFILES[self.profile].case_timeout
        if timeout < 0:
            raise RunError(f"--case-timeout expects seconds >= 0 (0: no limit), got {timeout:g}")
        self.case_timeout = timeout if self.isolation == "process" and timeout > 0 else None
        if isinstance(self._executor, IsolatedExecutor):  # made above for the facts, before the profile was known
            self._executor.case_timeout = self.case_timeout
        self.journal = journal.Journal(self.report_dir, self.worker)
        self._e2e_referee = None
        try:
            self.devices = parse_devices(settings.devices)
        except ValueError as exc:
            raise RunError(str(exc)) from None
        self.device_env = settings.device_env
        self.context = LevelContext(
            self.target_name, self.profile, self.seed, self.repeat, self.require_deterministic, self.shrink, self.case_timeout,
            self.report_dir, self.suite_version, provide_executor=lambda: self.executor,
            provide_tp_executor=lambda: self.tp_executor, provide_e2e_referee=lambda: self.e2e_referee,
        )  # what each level's run sees of this session (conformance.levels.context)

    @staticmethod
    def _resume(settings, selection: dict | None = None) -> dict | None:
        """With ``--resume DIR``: the interrupted run's manifest, its target, profile, seed, shard, report
        dir and expectations copied into ``settings``; a ``selection`` (``-k``, ``-m``, node ids) other
        than the run's own is refused."""
        if not settings.resume:
            return None
        if settings.replay:
            raise RunError("--resume and --replay exclude each other")
        try:
            manifest = journal.read_manifest(Path(settings.resume))
        except ValueError as exc:
            raise RunError(f"--resume: {exc}") from None
        if manifest.get("replay"):
            raise RunError(f"--resume {settings.resume}: that run replayed one case; run it again with --replay {manifest['replay']}")
        for name in ("target", "profile", "seed", "shard", "report_dir"):
            given = getattr(settings, name)
            recorded = settings.resume if name == "report_dir" else manifest[name]
            if given is not None and str(given) != str(recorded):
                raise RunError(
                    f"--resume {settings.resume}: the interrupted run has --{name.replace('_', '-')}={recorded}, "
                    f"not {given}; leave the option out to take the run's own"
                )
            setattr(settings, name, recorded)
        listed = (manifest.get("caselist") or {}).get("given")
        if settings.caselist is not None and settings.caselist != listed:
            raise RunError(f"--resume {settings.resume}: the interrupted run ran " + (f"--caselist {listed}" if listed else "a drawn profile")
                           + f", not --caselist {settings.caselist}; leave --caselist out to take the run's own")
        settings.caselist = listed
        _check_resumed_selection(settings.resume, manifest.get("selection"), run_selection(**(selection or {})))
        if settings.expectations is None:
            settings.expectations = manifest.get("expectations") or "none"
        return manifest

    def _caselist(self, settings: RunSettings) -> Caselist | None:
        """With ``--caselist``: the list, its profile and seed copied into ``settings`` (others given are refused), and
        its first op cases' inputs drawn here and checked against the list (``conformance.caselists``)."""
        if not settings.caselist:
            return None
        if self.replay:
            raise RunError("--caselist and --replay exclude each other: a replay runs its one case")
        try:
            caselist = load_caselist(settings.caselist)
        except CaselistError as exc:
            raise RunError(f"--caselist: {exc}") from None
        for name, listed in (("profile", caselist.profile), ("seed", caselist.seed)):
            given = getattr(settings, name)
            if given is not None and str(given) != str(listed):
                raise RunError(f"--caselist {settings.caselist} was frozen from --{name}={listed}, not {given}; leave --{name} out")
            setattr(settings, name, listed)
        recorded = (self.resume_manifest or {}).get("caselist") or {}
        if recorded and recorded.get("digest") != caselist.digest:
            raise RunError(f"--resume: the interrupted run's list {recorded.get('given')} had the digest {recorded.get('digest')}, "
                           f"the list read now {caselist.digest}: it changed since; start a new run")
        kinds = {kind.name: kind for kind in self.kinds}
        unknown = sorted({entry.level for entry in caselist.entries} - set(kinds))
        if unknown:
            raise RunError(f"--caselist {settings.caselist} holds cases of the level(s) {unknown}, which this installation does not "
                           f"have (levels: {', '.join(kinds)}); run it with the suite release that wrote it ({caselist.header['suite_version']})")
        for entry in [entry for entry in caselist.entries if entry.level == "op"][:INPUT_CHECKS]:
            drawn = kinds["op"].inputs_digest(kinds["op"].case_from_json(entry.case_json))
            if drawn != entry.inputs_digest:
                generated = caselist.header.get("generated_with", {})
                raise RunError(
                    f"--caselist {settings.caselist}: this environment draws other input values for {entry.case_id} than the list "
                    f"holds ({drawn} vs {entry.inputs_digest}): torch {torch.__version__} here, torch {generated.get('torch')} where "
                    "the list was written; its cases cannot be run here under the list's name (docs/certification.md)"
                )
        return caselist

    def _local_executor(self) -> LocalExecutor:
        try:
            return LocalExecutor(self.target_name)
        except (TargetError, TargetUnavailable) as exc:
            raise RunError(str(exc).splitlines()[0]) from None

    @property
    def executor(self):
        """Where this process's cases run (``conformance.isolation``), made on first use."""
        if self._executor is None:
            self._executor = (
                self._local_executor()
                if self.isolation == "none"
                else IsolatedExecutor(self.target_name, case_timeout=self.case_timeout, torch_threads=torch.get_num_threads())
            )
        return self._executor

    @property
    def tp_executor(self) -> TPExecutor:
        """Where tensor-parallel cases run: a pool of rank processes (``conformance.tp``), made on first use."""
        if self._tp_executor is None:
            self._tp_executor = TPExecutor(
                self.target_name, self.facts, case_timeout=self.case_timeout, torch_threads=torch.get_num_threads(),
                devices=self.devices, device_env=self.device_env, runs=self.repeat,
                require_deterministic=self.require_deterministic,
            )
        return self._tp_executor

    def start_worker(self, case_ids=None) -> None:
        """Start the isolated worker now, so that it loads the target while the session sets up: when one of
        ``case_ids`` (default: every case of the run) runs in it, as far as the target's facts tell."""
        if self.isolation != "process":
            return
        cases = self.cases_by_id()
        wanted = [cases[case_id] for case_id in (cases if case_ids is None else case_ids) if case_id in cases]
        if any(kind_of(case, self.kinds).uses_worker and self.unsupported_reason(case) is None for case in wanted):
            self.executor.start()

    def close(self) -> None:
        if self._executor is not None:
            self._executor.close()
        if self._tp_executor is not None:
            self._tp_executor.close()

    def _expectations_path(self, value: str | None) -> Path | None:
        if value == "none":
            return None
        if value:
            return Path(value)
        return shipped_expectations(self.target_name)

    @staticmethod
    def _shard(value: str | None) -> tuple[int, int] | None:
        if value is None:
            return None
        index, _, count = value.partition("/")
        if not (index.isdigit() and count.isdigit() and 0 <= int(index) < int(count)):
            raise RunError(f"--shard expects I/N with 0 <= I < N (0-based), got {value!r}")
        return int(index), int(count)

    def _in_shard(self, cases: list) -> list:
        if not self.shard:
            return cases
        index, count = self.shard
        return [entry for position, entry in enumerate(cases) if position % count == index]

    def entries(self) -> list[CaseEntry]:
        """``(case_id, case, values or None)`` for every case of this run, every level's: those ``--cases``
        selects, of its shard (``--shard`` splits the selection); the replayed case alone with ``--replay``."""
        if self.replay_entry is not None:
            return [CaseEntry(self.replay_entry)]
        levels = self.level_cases()
        if self.case_queries:
            levels = self._selected(levels)
        return [CaseEntry((case_id, case, None)) for _, cases in levels for case_id, case in self._in_shard(cases)]

    def level_cases(self) -> list[tuple[CaseKind, list]]:
        """Every level with its ``(case_id, case)`` pairs, in run order: drawn from the profile, or read from ``--caselist``."""
        if self.caselist is None:
            return [(kind, kind.cases(self.profile, self.seed)) for kind in self.kinds]
        levels: dict[str, list] = {kind.name: [] for kind in self.kinds}
        readers = {kind.name: kind for kind in self.kinds}
        for entry in self.caselist.entries:
            try:
                levels[entry.level].append((entry.case_id, readers[entry.level].case_from_json(entry.case_json)))
            except ValueError as exc:
                raise RunError(f"--caselist {self.caselist.path}: the case {entry.case_id} does not read as a {entry.level} case: {exc}") from None
        return [(kind, levels[kind.name]) for kind in self.kinds if levels[kind.name]]

    def _selected(self, levels: list) -> list:
        """Each level's cases that a ``--cases`` query matches; a query that matches none is an error."""
        names = {}
        for kind, cases in levels:
            for case_id, _ in cases:
                try:
                    names[case_id] = parse_id(case_id)
                except QueryError as exc:
                    raise RunError(f"the {kind.name} level's case ids must follow the suite's grammar (conformance.query): {exc}") from None
        unmatched = [str(query) for query in self.case_queries if not any(query.matches(name) for name in names.values())]
        if unmatched:
            raise RunError(
                f"--cases {', '.join(map(repr, unmatched))} selects no case of the {self.profile} profile (levels: "
                f"{', '.join(kind.name for kind, _ in levels)}); `pytest conformance --collect-only -q --target=…` lists the ids"
            )
        return [(kind, [entry for entry in cases if any(query.matches(names[entry[0]]) for query in self.case_queries)]) for kind, cases in levels]

    def cases_by_id(self) -> dict:
        """Every case of this run's shard by id, at every level (drawn once: a profile's op cases take a second
        to read from the disk cache, and the plugin, the worker's start and the progress line each ask)."""
        if self._cases_by_id is None:
            self._cases_by_id = {entry[0]: entry[1] for entry in self.entries()}
        return self._cases_by_id

    def test_node_id(self, case_id: str) -> str:
        return self.context.test_node_id(case_id)

    def manifest(self, expected: list[str]) -> dict:
        """The run's manifest (``conformance.journal``), for the cases collected after ``-k``/``-m``."""
        if self.replay_entry is not None:
            whole_list = [self.replay_entry[0]]
        else:
            whole_list = [case_id for _, cases in self.level_cases() for case_id, _ in cases]
        return {
            **self.about(),
            "environment": environment_fingerprint(environ=os.environ),
            "expected": expected,
            "selection": self.selection,
            # Hypothesis draws the op cases: another version may draw others under the same ids (merge checks)
            "hypothesis_version": hypothesis_version(),
            "shard_cases": list(self.cases_by_id()),
            "case_list": journal.case_list_summary(whole_list),
        }

    def done_case_ids(self) -> set[str]:
        """With ``--resume``: the cases the interrupted run has a result for."""
        return {record["id"] for record in journal.read_journals(self.report_dir)}

    @property
    def e2e_referee(self):
        """The end-to-end referee (fixtures, float64 reference decoder, comparisons), made on first use."""
        if self._e2e_referee is None:
            from conformance.e2e.run import E2EReferee

            try:
                self._e2e_referee = E2EReferee()
            except (FileNotFoundError, ValueError, ImportError) as exc:  # the fixtures, not the target
                raise RunError(str(exc)) from None
        return self._e2e_referee

    def repro_command(self, replay_path: Path) -> str:
        return self.context.repro_command(replay_path)

    def unsupported_reason(self, case) -> str | None:
        """Why the target does not run ``case``, from its facts alone (its level's ``unsupported_reason``), or None."""
        return kind_of(case, self.kinds).unsupported_reason(self.facts, case)

    def support_plan(self) -> dict[str, tuple[str, bool]]:
        """Every case of this run by id: its level's name, and whether the target's facts refuse it already
        (such a case costs no time: the progress line's estimate counts it so)."""
        plan = {}
        for case_id, case in self.cases_by_id().items():
            kind = kind_of(case, self.kinds)
            plan[case_id] = (kind.name, kind.unsupported_reason(self.facts, case) is not None)
        return plan

    def run(self, entry) -> CaseResult:
        """One case of any level: a case the target's facts refuse is "not supported" without starting anything;
        any other, its kind runs and judges it (``conformance.levels``). Then the expectations, the repro (and
        for op cases the replay and, with ``--shrink``, the shrunk case), and the journal."""
        case_id, case, values = entry
        kind = kind_of(case, self.kinds)
        reason = kind.unsupported_reason(self.facts, case)
        if reason is not None:
            result = kind.result_type(case_id, case, Outcome.NOT_SUPPORTED, reason, features=kind.features(case))
        else:
            result = kind.run(self.context, case_id, case, values)
            if result.inputs_digest is None and result.outcome.ran:  # a level that does not record it itself
                result.inputs_digest = kind.inputs_digest(case)
        result = apply_expectations(result, self.expectations, self.today, self.scope_fingerprint())
        shrunk = None
        if result.outcome in (Outcome.FAIL, Outcome.BROKEN, Outcome.KNOWN_FAILURE):
            shrunk = kind.after_failure(self.context, result, values)
        said = self._executor.take_output() if self._executor is not None else None  # its warnings and prints, for the report
        self.record(result, shrunk=shrunk, target_output=said.to_json() if said else None)
        return result

    def broken(self, case_id: str, case, kind: FailureKind, message: str) -> CaseResult:
        """The broken result of a case that did not return, at its own level."""
        return kind_of(case, self.kinds).broken(case_id, case, kind, message)

    def record(self, result: CaseResult, *, shrunk: dict | None = None, target_output: dict | None = None) -> None:
        """Journal the result (the results schema, ``CaseResult.to_json``, with ``shrunk`` where ``--shrink``
        found a smaller case, ``target_output`` what the target warned and printed while it ran
        (``conformance.isolation.output``), and when it finished: the Allure results are written from the journals)."""
        record = {**result.to_json(), "worker": self.worker, "finished": round(time.time(), 3)}
        if shrunk:
            record["shrunk"] = shrunk
        if target_output:
            record["target_output"] = target_output
        self.journal.append(record)

    def scope_fingerprint(self) -> dict:
        """What an expectations entry's ``devices`` scope is evaluated against (``conformance.expectations``): the
        device as the process that ran the cases reported it (the worker, else the tensor-parallel ranks; the
        CPU may be read here), and the target's version.

        This process never queries a device runtime (``conformance.report.fingerprint``), so the device is not
        known when the expectations are loaded: the scope is evaluated per result, against the description the
        worker sent when it loaded the target, which ``worker_info`` records in the results document for a
        verifier to check again (``waiver_check``). Where no process reported one (a case no worker ran, a
        worker that died before it started), the generation is "unknown": a scoped entry is then not applied,
        and a failure it would have covered says so, rather than being applied blind or skipped silently."""
        device = self._executor.device_description() if self._executor is not None else None
        if device is None and self._tp_executor is not None:
            device = self._tp_executor.device_description()
        if device is None and self.facts.device_type == "cpu":
            device = device_description("cpu")  # nothing to initialise: read here, as worker_info does
        return {**(device or {"device": f"{self.facts.device_type}: not read (no process ran a case)"}), "target_version": self.target_version}

    def worker_info(self) -> dict:
        """Which device this process's cases ran on (as the process that ran them read it)."""
        info = {"worker": self.worker, "pid": os.getpid(), "isolation": self.isolation}
        if self.device_assignment:
            info[self.device_assignment["variable"]] = self.device_assignment["device"]
        device = self._executor.device_description() if self._executor is not None else None
        if device is None:
            device_type = self.facts.device_type
            # a device runtime is only asked in a process that ran cases on it
            device = device_description(device_type) if device_type == "cpu" else {
                "device": f"{device_type}: not read (no case ran in this process)", "driver": "unknown"}
        if isinstance(self._executor, IsolatedExecutor):
            info["worker_restarts"] = self._executor.restarts
            if self._executor.load_output:  # what the target printed while it was imported and made
                info["target_output_at_load"] = self._executor.load_output.to_json()
        if self._tp_executor is not None:
            info["tp_pool_starts"] = self._tp_executor.pool_starts
        # processes the target started and left running when its worker or ranks ended (found, and killed, at
        # close: call close() first), as "pid N (command)"
        leftovers = [*getattr(self._executor, "leftover_processes", ()),
                     *(self._tp_executor.leftover_processes if self._tp_executor is not None else ())]
        if leftovers:
            info["leftover_processes"] = leftovers
        return {**info, **device}

    def about(self) -> dict:
        return {
            "suite_version": SUITE_VERSION,
            "target": self.target_name,
            "target_name": self.facts.name,
            "target_class": self.facts.reference,
            "profile": self.profile if not self.replay else "replay",
            "seed": self.seed,
            # the frozen list run (name, digest, count, and as given: a name or a path), None for a drawn profile
            "caselist": {**self.caselist.summary(), "given": self.caselist_given} if self.caselist else None,
            "shard": f"{self.shard[0]}/{self.shard[1]}" if self.shard else None,
            "report_dir": str(self.report_dir),
            "replay": self.replay,
            "expectations": str(self.expectations_path) if self.expectations_path else None,
            "expectations_not_applicable": self.expectations_not_applicable,
            # what the expectations' devices.target_version and versions ranges are evaluated against (waiver_check)
            "target_version": self.target_version,
            "target_package_versions": dict(self.facts.package_versions),
            "isolation": self.isolation,
            "case_timeout": self.case_timeout,
            "repeat": self.repeat,
            "require_deterministic": self.require_deterministic,
            # where the oracle and the judgement ran: apart from the target (its worker process), or in
            # its process (--isolation=none: for a debugger, not for a release verdict)
            "referee": "apart from the target" if self.isolation == "process" else "in the target's process (--isolation=none)",
            "python": sys.version.split()[0],
        }

    # -- a whole run, for scripts (pytest does the same through conformance.plugin's hooks) --------

    def build_document(self, manifest: dict, *, workers: list[dict] | None = None, pytest_exitstatus: int = 0) -> dict:
        """The results document from the manifest and every journal, with the environment and devices."""
        return results_document(manifest, journal.read_journals(self.report_dir), workers=workers or [self.worker_info()],
                                pytest_exitstatus=pytest_exitstatus, environment=environment_fingerprint(environ=os.environ))

    def write_document(self, document: dict) -> None:
        """results.json and report.html in the report dir."""
        self.report_dir.mkdir(parents=True, exist_ok=True)
        (self.report_dir / "results.json").write_text(json.dumps(document, indent=1) + "\n")
        write_html_report(document, self.report_dir / "report.html")

    def run_all(self) -> dict:
        """Every case of this run (all of its shard, op and end to end), then the results document."""
        if self.resume_manifest is None:
            journal.clear_journals(self.report_dir)
            manifest = self.manifest(list(self.cases_by_id()))
            journal.write_manifest(self.report_dir, manifest)
        else:
            manifest = self.resume_manifest
        done = self.done_case_ids()
        expected = set(manifest["expected"])
        try:
            for entry in self.entries():
                if entry[0] in expected and entry[0] not in done:
                    self.run(entry)
        finally:
            self.close()
        workers = [self.worker_info()]
        document = self.build_document(manifest, workers=workers)
        self.write_document(document)
        return document


def default_report_dir(target: str) -> Path:
    """``reports/<target>`` with the target's ``:`` and ``/`` made ``_``: no path a run writes holds a colon."""
    return Path("reports") / target.replace(":", "_").replace("/", "_")


def run_selection(keyword: str = "", markexpr: str = "", node_ids=(), cases=()) -> dict:
    """The manifest's ``selection``: pytest's ``-k`` and ``-m`` expressions, the explicit node-id
    arguments and the ``--cases`` queries, as given; all empty for a script run, and for a manifest written before it was recorded.

    ``expected`` lists the cases they selected; the selection itself is kept so that ``--resume`` can
    refuse another one, which would leave some expected cases without a result.
    """
    return {"keyword": keyword or "", "markexpr": markexpr or "", "node_ids": [str(node_id) for node_id in node_ids or ()],
            "cases": [str(query) for query in cases or ()]}


def _check_resumed_selection(report_dir, recorded: dict | None, given: dict) -> None:
    """Refuse a ``--resume`` given a ``-k``, ``-m`` or node ids other than the interrupted run's own."""
    recorded = recorded if isinstance(recorded, dict) else {}  # none recorded (an older manifest): no selection
    recorded = run_selection(recorded.get("keyword"), recorded.get("markexpr"), recorded.get("node_ids"), recorded.get("cases"))
    for option, name in (("-k", "keyword"), ("-m", "markexpr"), ("node ids", "node_ids"), ("--cases", "cases")):
        if given[name] and given[name] != recorded[name]:
            was = f"{option} {recorded[name]!r}" if recorded[name] else f"no {option}"
            raise RunError(
                f"--resume {report_dir}: the interrupted run was selected with {was}, not {option} {given[name]!r}; "
                f"leave {option} out: --resume runs the cases of the run's own selection that have no result yet"
            )
