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
from dataclasses import dataclass
from pathlib import Path

import torch

import conformance
from conformance import journal
from conformance.cases.replay import read_replay, write_replay
from conformance.devices import parse_devices
from conformance.e2e.cases import e2e_cases
from conformance.expectations import apply_expectations, load_expectations, shipped_expectations, split_applicable
from conformance.generator import DEFAULT_PROFILE, PROFILES, profile_cases
from conformance.isolation import Breakdown, IsolatedExecutor, LocalExecutor
from conformance.report import write_html_report
from conformance.report.clusters import add_clusters
from conformance.report.coverage import add_coverage
from conformance.report.fingerprint import device_description, environment_fingerprint
from conformance.runner import CaseResult, check_values, make_values
from conformance.targets import TargetError, TargetUnavailable, known_targets, resolve
from conformance.tp.cases import tp_cases
from conformance.tp.run import TPExecutor
from conformance.verdict import FailureKind, Outcome

SUITE_VERSION = conformance.__version__


class RunError(ValueError):
    """The run cannot start as asked; the message names the option and what to do."""


@dataclass
class RunSettings:
    """The options of a run (``pytest conformance --help`` explains each); None: the default."""

    target: str | None = None
    profile: str | None = None
    seed: int | None = None
    shard: str | None = None
    replay: str | None = None
    resume: str | None = None
    report_dir: str | None = None
    expectations: str | None = None
    shrink: bool = False
    isolation: str = "process"
    case_timeout: float | None = None
    devices: str | None = None  # --devices: also the device of each tensor-parallel rank (conformance.tp.run)
    device_env: str | None = None


class CaseEntry(tuple):
    """``(case_id, case, values or None)``, whose repr is the case id.

    allure-pytest shows a test's parameters by repr and hashes them into the history id; the case's
    repr holds its seed, and seeds must not split a case's history (the seed is an excluded
    parameter of its own, see ``conformance.report.allure_results``).
    """

    def __repr__(self) -> str:
        return self[0]


class ConformanceRun:
    """Everything one process needs to run cases on one target, and to write what they gave.

    ``settings`` are the command-line options (``conformance.plugin`` fills them from pytest's);
    ``worker`` names this process's journal (``main`` serially, ``gw0``… for xdist workers);
    ``runs_cases`` is False for an xdist controller, which loads no target; ``device_assignment`` is
    what ``--devices`` set for this process (``conformance.devices``), for the record.
    """

    def __init__(
        self, settings: RunSettings, *, worker: str = "main", runs_cases: bool = True, device_assignment: dict | None = None
    ) -> None:
        self.controller = worker == "main"
        self.resume_manifest = self._resume(settings)
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
        try:
            # the class only: the target itself (and its device) is loaded where cases run
            self.target_class = resolve(self.target_name)
            self.target_class.check_available()
        except (TargetError, TargetUnavailable) as exc:
            raise RunError(str(exc).splitlines()[0]) from None
        self.profile = settings.profile or DEFAULT_PROFILE
        self.shrink = settings.shrink
        self.seed = settings.seed or 0
        self.shard = self._shard(settings.shard)
        self.report_dir = Path(settings.report_dir or Path("reports") / self.target_name.replace(":", "_").replace("/", "_"))
        self.expectations_path = self._expectations_path(settings.expectations)
        try:
            entries = load_expectations(self.expectations_path) if self.expectations_path else ()
        except ValueError as exc:
            raise RunError(str(exc)) from None
        self.expectations, self.expectations_not_applicable = split_applicable(entries)
        self.today = dt.date.today()
        self.isolation = settings.isolation
        timeout = settings.case_timeout if settings.case_timeout is not None else PROFILES[self.profile].case_timeout
        if timeout < 0:
            raise RunError(f"--case-timeout expects seconds >= 0 (0: no limit), got {timeout:g}")
        self.case_timeout = timeout if self.isolation == "process" and timeout > 0 else None
        self.journal = journal.Journal(self.report_dir, self.worker)
        self._executor = None
        self._tp_executor = None
        try:
            self.devices = parse_devices(settings.devices)
        except ValueError as exc:
            raise RunError(str(exc)) from None
        self.device_env = settings.device_env
        self.on_record = None  # called with each result's record before it is journalled (Allure labels)
        if self.isolation == "none" and runs_cases:
            self._executor = self._local_executor()  # load errors are usage errors, as they always were

    @staticmethod
    def _resume(settings) -> dict | None:
        """With ``--resume DIR``: the interrupted run's manifest, its target, profile, seed, shard, report
        dir and expectations copied into ``settings``."""
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
        if settings.expectations is None:
            settings.expectations = manifest.get("expectations") or "none"
        return manifest

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
                self.target_name, case_timeout=self.case_timeout, torch_threads=torch.get_num_threads(),
                devices=self.devices, device_env=self.device_env,
            )
        return self._tp_executor

    def start_worker(self) -> None:
        """Start the isolated worker now, so that it loads the target while the session sets up."""
        if self.isolation == "process":
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

    def entries(self):
        """``(case_id, case, values or None)`` for every case of this run (of its shard, if any)."""
        if self.replay_entry is not None:
            return [CaseEntry(self.replay_entry)]
        return [CaseEntry((case_id, case, None)) for case_id, case in self._in_shard(profile_cases(self.profile, self.seed))]

    def e2e_cases(self) -> list:
        """The profile's end-to-end cases (of this shard); none when replaying an op case."""
        if self.replay_entry is not None:
            return []
        return self._in_shard(e2e_cases(self.profile))

    def tp_cases(self) -> list:
        """The profile's tensor-parallel cases (of this shard); none when replaying an op case."""
        if self.replay_entry is not None:
            return []
        return self._in_shard(tp_cases(self.profile, self.seed))

    def cases_by_id(self) -> dict:
        """Every case of this run's shard by id: op, end to end and tensor-parallel."""
        cases = {entry[0]: entry[1] for entry in self.entries()}
        cases.update((case.case_id, case) for case in self.e2e_cases())
        cases.update((case.case_id, case) for case in self.tp_cases())
        return cases

    def manifest(self, expected: list[str]) -> dict:
        """The run's manifest (``conformance.journal``), for the cases collected after ``-k``/``-m``."""
        if self.replay_entry is not None:
            whole_list = [self.replay_entry[0]]
        else:
            whole_list = [case_id for case_id, _ in profile_cases(self.profile, self.seed)]
            whole_list += [case.case_id for case in e2e_cases(self.profile)]
            whole_list += [case.case_id for case in tp_cases(self.profile, self.seed)]
        return {
            **self.about(),
            "environment": environment_fingerprint(environ=os.environ),
            "expected": expected,
            "shard_cases": list(self.cases_by_id()),
            "case_list": journal.case_list_summary(whole_list),
        }

    def done_case_ids(self) -> set[str]:
        """With ``--resume``: the cases the interrupted run has a result for."""
        return {record["id"] for record in journal.read_journals(self.report_dir)}

    def run_e2e(self, case) -> CaseResult:
        try:
            result = self.executor.run_e2e(case)
        except (FileNotFoundError, ValueError, ImportError) as exc:  # the fixtures, not the target
            raise RunError(str(exc)) from None
        result = apply_expectations(result, self.expectations, self.today)
        if result.outcome in (Outcome.FAIL, Outcome.BROKEN, Outcome.KNOWN_FAILURE):
            result.repro = f"pytest 'conformance/test_e2e.py::test_e2e[{case.case_id}]' --target={self.target_name}"
        self.record(result)
        return result

    def run_tp(self, case) -> CaseResult:
        try:
            result = self.tp_executor.run(case)
        except ValueError as exc:  # --devices cannot give every rank a device: the run's options, not the target
            raise RunError(str(exc)) from None
        result = apply_expectations(result, self.expectations, self.today)
        if result.outcome in (Outcome.FAIL, Outcome.BROKEN, Outcome.KNOWN_FAILURE):
            seed = f" --seed={self.seed}" if self.seed else ""
            result.repro = f"pytest 'conformance/test_tp.py::test_tp[{case.case_id}]' --target={self.target_name}{seed}"
        self.record(result)
        return result

    def repro_command(self, replay_path: Path) -> str:
        return f"pytest conformance --target={self.target_name} --replay {replay_path}"

    def run(self, entry) -> CaseResult:
        case_id, case, values = entry
        result = self.executor.run_op(case_id, case, values)  # values None: drawn where the case runs
        result = apply_expectations(result, self.expectations, self.today)
        shrunk = None
        if result.outcome in (Outcome.FAIL, Outcome.BROKEN, Outcome.KNOWN_FAILURE):
            path = write_replay(
                self.report_dir / "replays",
                case_id,
                case,
                make_values(case) if values is None else values,  # the same values: drawn from the case's seed
                target=self.target_name,
                outcome=result.outcome.value,
                message=result.message,
                suite_version=SUITE_VERSION,
            )
            result.replay = str(path)
            result.repro = self.repro_command(path)
            if self.shrink and result.outcome is not Outcome.KNOWN_FAILURE:
                shrunk = self.add_shrunk_case(result)
        self.record(result, shrunk=shrunk)
        return result

    def add_shrunk_case(self, result: CaseResult) -> dict | None:
        """Shrink a failure; the shrunk case's replay, repro and structure (the record's ``shrunk``), or None."""
        if result.kind in (FailureKind.CRASHED, FailureKind.TIMED_OUT):
            result.message += " (not shrunk: every candidate of a crash or hang would need a process of its own)"
            return None
        try:
            smallest = self.executor.shrink(result, PROFILES[self.profile].limits)
        except Breakdown as exc:
            result.message += f" (shrinking stopped: {exc.message})"
            return None
        if smallest is None:
            result.message += " (shrinking found no smaller case failing the same way)"
            return None
        path = write_replay(
            self.report_dir / "replays",
            f"{result.case_id}.shrunk",
            smallest,
            make_values(smallest),
            target=self.target_name,
            shrunk_from=result.case_id,
            suite_version=SUITE_VERSION,
        )
        shape = f"{len(smallest.seq_lens)} sequences, {smallest.num_tokens} tokens, {smallest.num_slots} slots, rank {smallest.max_rank}"
        result.repro = f"{result.repro}\nshrunk ({shape}): {self.repro_command(path)}"
        # structured, so that a cluster's smallest case can be the shrunk one without reading the repro text
        return {"replay": str(path), "repro": self.repro_command(path), "case": smallest.to_json()}

    def record(self, result: CaseResult, *, label: bool = True, shrunk: dict | None = None) -> None:
        """Journal the result (the results schema, ``CaseResult.to_json``, with ``shrunk`` where ``--shrink``
        found a smaller case), after ``on_record`` saw it."""
        record = {**result.to_json(), "worker": self.worker}
        if shrunk:
            record["shrunk"] = shrunk
        if label and self.on_record is not None:
            self.on_record(record)
        self.journal.append(record)

    def worker_info(self) -> dict:
        """Which device this process's cases ran on (as the process that ran them read it)."""
        info = {"worker": self.worker, "pid": os.getpid(), "isolation": self.isolation}
        if self.device_assignment:
            info[self.device_assignment["variable"]] = self.device_assignment["device"]
        device = self._executor.device_description() if self._executor is not None else None
        if device is None:
            device_type = self.target_class.default_device().type
            # a device runtime is only asked in a process that ran cases on it
            device = device_description(device_type) if device_type == "cpu" else {
                "device": f"{device_type}: not read (no case ran in this process)", "driver": "unknown"}
        if isinstance(self._executor, IsolatedExecutor):
            info["worker_restarts"] = self._executor.restarts
        if self._tp_executor is not None:
            info["tp_pool_starts"] = self._tp_executor.pool_starts
        return {**info, **device}

    def about(self) -> dict:
        return {
            "suite_version": SUITE_VERSION,
            "target": self.target_name,
            "target_name": self.target_class.name,
            "target_class": f"{self.target_class.__module__}:{self.target_class.__qualname__}",
            "profile": self.profile if not self.replay else "replay",
            "seed": self.seed,
            "shard": f"{self.shard[0]}/{self.shard[1]}" if self.shard else None,
            "report_dir": str(self.report_dir),
            "replay": self.replay,
            "expectations": str(self.expectations_path) if self.expectations_path else None,
            "expectations_not_applicable": self.expectations_not_applicable,
            "isolation": self.isolation,
            "case_timeout": self.case_timeout,
            "python": sys.version.split()[0],
        }

    # -- a whole run, for scripts (pytest does the same through conformance.plugin's hooks) --------

    def build_document(self, manifest: dict, *, workers: list[dict] | None = None, pytest_exitstatus: int = 0) -> dict:
        """The results document from the manifest and every journal, with the environment and devices."""
        workers = workers or [self.worker_info()]
        document = journal.build_document(manifest, journal.read_journals(self.report_dir), workers=workers, pytest_exitstatus=pytest_exitstatus)
        environment = document["environment"] = environment_fingerprint(environ=os.environ)
        devices = list(dict.fromkeys((w.get("device"), w.get("driver")) for w in workers))
        environment["device"] = "; ".join(str(name) for name, _ in devices)
        environment["driver"] = "; ".join(dict.fromkeys(str(driver) for _, driver in devices))
        # one cluster per distinct problem, and what the cases exercised (conformance.report.clusters, .coverage)
        return add_coverage(add_clusters(document))

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
            for case in self.e2e_cases():
                if case.case_id in expected and case.case_id not in done:
                    self.run_e2e(case)
            for case in self.tp_cases():
                if case.case_id in expected and case.case_id not in done:
                    self.run_tp(case)
            workers = [self.worker_info()]
        finally:
            self.close()
        document = self.build_document(manifest, workers=workers)
        self.write_document(document)
        return document
