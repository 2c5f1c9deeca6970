"""The pytest front end: ``pytest conformance --target=NAME``.

It turns the profile's cases into tests (ids like ``add_lora_linear-bf16-slices3-r16-neg1``, and the
end-to-end cases of ``conformance.e2e`` like ``greedy_generation-mixed-bf16``, marker ``e2e``), runs each
through ``conformance.runner``, applies the target's expectations, writes a replay for every failing
case, records every result, and at the end applies the gate: the exit code is the verdict.

Outcome → pytest: pass → passed; fail and unexpected pass → failed; broken → error raised by the
target (failed, "broken" in Allure); not supported → skipped with the reason; known failure → xfail.
The failure kinds lead the message (``fail [numerics]: …``), in JUnit and Allure alike.

Cases run in a worker process of their own (``conformance.isolation``; ``--isolation=none`` runs them
here): a target that crashes or hangs costs one case, recorded *broken* (kind ``crashed`` or ``timed
out``, ``--case-timeout``), and the run goes on. Once the cases are collected the run writes its
manifest (``run.json``: every case it is to judge), and every result is appended to
``<report-dir>/results/<worker>.jsonl`` as it arrives (``conformance.journal``); at the end the
results document is built from both, so an expected case without a result fails the gate by name.
A killed run's report is rebuilt by ``python -m conformance.report html DIR``, and ``--resume DIR``
runs only the cases without a result and completes the same report.

Under xdist every worker draws the same cases from the same seed and runs its share; the controller
builds ``results.json`` and renders ``report.html`` (``conformance.report``), and records a case as
crashed should a pytest worker itself die on it. Across machines, ``--shard I/N`` (0-based) keeps the
cases whose index in the profile's list is I modulo N; ``python -m conformance.report merge`` joins
the shards' ``results.json`` files, checks they add up to the profile's case list, and gates them again.

Artifacts of every run, in the report dir: ``results.json`` (with the environment fingerprint and
which device each worker used), ``report.html``, ``junit.xml`` (unless ``--junitxml`` names another;
the fingerprint as test-suite properties), ``allure-results/`` (unless ``--alluredir`` names another;
labels and categories from ``conformance.report.allure_results``) and ``replays/``. ``--devices``
gives each xdist worker its own device (``conformance.devices``); the controller prints progress
lines (``conformance.report.progress``).
"""

from __future__ import annotations

import datetime as dt
import json
import os
import shutil
import sys
from pathlib import Path

import pytest
import torch

import conformance
from conformance import journal
from conformance.cases.replay import read_replay, write_replay
from conformance.devices import assign_device
from conformance.e2e.cases import e2e_cases
from conformance.expectations import apply_expectations, load_expectations, shipped_expectations, split_applicable
from conformance.generator import DEFAULT_PROFILE, PROFILES, profile_cases
from conformance.isolation import ISOLATION_MODES, Breakdown, IsolatedExecutor, LocalExecutor, broken_result
from conformance.ops import OP_SPECS
from conformance.report import write_html_report
from conformance.report.allure_results import label_current_test, write_results_extras
from conformance.report.fingerprint import device_description, environment_fingerprint
from conformance.report.progress import Progress
from conformance.runner import CaseResult, check_values, make_values
from conformance.targets import TargetError, TargetUnavailable, known_targets, resolve
from conformance.verdict import FailureKind, Outcome

SUITE_VERSION = conformance.__version__


class CaseEntry(tuple):
    """``(case_id, case, values or None)``, whose repr is the case id.

    allure-pytest shows a test's parameters by repr and hashes them into the history id; the case's
    repr holds its seed, and seeds must not split a case's history (the seed is an excluded
    parameter of its own, see ``conformance.report.allure_results``).
    """

    def __repr__(self) -> str:
        return self[0]


class TargetBroken(Exception):
    """The target raised while running a case (the *broken* outcome, distinct from a numeric failure)."""


def pytest_addoption(parser: pytest.Parser) -> None:
    group = parser.getgroup("lora-conformance", "LoRA conformance suite")
    group.addoption("--target", help="target to judge: a registered name or package.module:Class")
    group.addoption("--profile", choices=sorted(PROFILES), help=f"case set (default: {DEFAULT_PROFILE})")
    group.addoption("--seed", type=int, help="run seed: another seed draws other cases (default: 0)")
    group.addoption("--replay", metavar="PATH", help="rerun the single case frozen in this replay file")
    group.addoption("--report-dir", metavar="DIR", help="where results and replays go (default: reports/<target>)")
    group.addoption(
        "--shrink",
        action="store_true",
        help="for every failing case, also search for the smallest case that fails the same way and "
        "write its replay (<id>.shrunk.json)",
    )
    group.addoption(
        "--torch-threads",
        type=int,
        default=1,
        help="CPU threads torch may use per process (default 1: cases are small, and spinning threads of "
        "several workers on few cores slow everything down)",
    )
    group.addoption(
        "--expectations",
        metavar="FILE|none",
        help="known-failures file; 'none' for none (default: the file shipped for the target, if any)",
    )
    group.addoption(
        "--shard",
        metavar="I/N",
        help="run only shard I of N (0-based, 0 <= I < N): the cases whose index in the profile's list "
        "is I modulo N; the same on every machine, merge with `python -m conformance.report merge`",
    )
    group.addoption(
        "--devices",
        metavar="auto|0,1,...",
        help="one device per xdist worker: worker gwN uses the N-th listed device (auto: device N), set "
        "through HABANA_VISIBLE_MODULES (hpu targets) or CUDA_VISIBLE_DEVICES (cuda) before the target loads",
    )
    group.addoption("--device-env", metavar="VAR", help="the visible-devices variable --devices sets, for other device types")
    group.addoption(
        "--case-timeout",
        type=float,
        metavar="SECONDS",
        help="stop a case that runs longer and record it broken (timed out); the run goes on "
        f"(default per profile: {', '.join(f'{p.name} {p.case_timeout:g}' for p in PROFILES.values())}; 0: no limit)",
    )
    group.addoption(
        "--isolation",
        choices=ISOLATION_MODES,
        default="process",
        help="process (default): cases run in a worker process, so a crash or hang costs one case, not the "
        "run; none: in the pytest process (for a debugger or profiler; no crash protection, no timeout)",
    )
    group.addoption(
        "--resume",
        metavar="DIR",
        help="complete the interrupted run whose report dir is DIR: run only its cases without a result, "
        "with its target, profile, seed and shard, and write the whole report again",
    )
    group.addoption(
        "--progress-every",
        type=float,
        default=30.0,
        metavar="SECONDS",
        help="print a [progress] line this often, and at the end (0: after every case, negative: never; "
        "default %(default)s)",
    )


class ConformanceRun:
    """Everything one pytest process needs to run cases on one target."""

    def __init__(self, config: pytest.Config) -> None:
        option = config.option
        self.controller = not hasattr(config, "workerinput")
        self.resume_manifest = self._resume(option)
        self.replay = option.replay
        self.replay_document: dict | None = None
        self.replay_entry = None
        if self.replay:
            try:
                case_id, case, values, document = read_replay(self.replay)
                check_values(case, values)
            except ValueError as exc:
                raise pytest.UsageError(str(exc)) from None
            self.replay_entry = (case_id, case, values)
            self.replay_document = document
        self.target_name = option.target or (self.replay_document or {}).get("target")
        if not self.target_name:
            raise pytest.UsageError(
                f"--target is required; known targets: {', '.join(sorted(known_targets()))} (or package.module:Class)"
            )
        # from xdist's own record, not PYTEST_XDIST_WORKER: a run started from inside an xdist worker
        # (the suite's own tests) inherits that variable in its controller
        self.worker = config.workerinput["workerid"] if not self.controller else "main"
        self.device_assignment = assign_device(config, self.target_name)  # before the runtime loads
        try:
            # the class only: the target itself (and its device) is loaded where cases run
            self.target_class = resolve(self.target_name)
            self.target_class.check_available()
        except (TargetError, TargetUnavailable) as exc:
            raise pytest.UsageError(str(exc).splitlines()[0]) from None
        self.profile = option.profile or DEFAULT_PROFILE
        self.shrink = option.shrink
        self.seed = option.seed or 0
        self.shard = self._shard(option.shard)
        self.report_dir = Path(option.report_dir or Path("reports") / self.target_name.replace(":", "_").replace("/", "_"))
        self.expectations_path = self._expectations_path(option.expectations)
        try:
            entries = load_expectations(self.expectations_path) if self.expectations_path else ()
        except ValueError as exc:
            raise pytest.UsageError(str(exc)) from None
        self.expectations, self.expectations_not_applicable = split_applicable(entries)
        self.today = dt.date.today()
        self.isolation = option.isolation
        timeout = option.case_timeout if option.case_timeout is not None else PROFILES[self.profile].case_timeout
        if timeout < 0:
            raise pytest.UsageError(f"--case-timeout expects seconds >= 0 (0: no limit), got {timeout:g}")
        self.case_timeout = timeout if self.isolation == "process" and timeout > 0 else None
        self.journal = journal.Journal(self.report_dir, self.worker)
        self._executor = None
        if self.isolation == "none" and not (self.controller and getattr(option, "numprocesses", None)):
            self._executor = self._local_executor()  # load errors are usage errors, as they always were

    @staticmethod
    def _resume(option) -> dict | None:
        """With ``--resume DIR``: the interrupted run's manifest, its settings copied into ``option``."""
        if not option.resume:
            return None
        if option.replay:
            raise pytest.UsageError("--resume and --replay exclude each other")
        try:
            manifest = journal.read_manifest(Path(option.resume))
        except ValueError as exc:
            raise pytest.UsageError(f"--resume: {exc}") from None
        if manifest.get("replay"):
            raise pytest.UsageError(f"--resume {option.resume}: that run replayed one case; run it again with --replay {manifest['replay']}")
        for name in ("target", "profile", "seed", "shard", "report_dir"):
            given = getattr(option, name)
            recorded = option.resume if name == "report_dir" else manifest[name]
            if given is not None and str(given) != str(recorded):
                raise pytest.UsageError(
                    f"--resume {option.resume}: the interrupted run has --{name.replace('_', '-')}={recorded}, "
                    f"not {given}; leave the option out to take the run's own"
                )
            setattr(option, name, recorded)
        if option.expectations is None:
            option.expectations = manifest.get("expectations") or "none"
        return manifest

    def _local_executor(self) -> LocalExecutor:
        try:
            return LocalExecutor(self.target_name)
        except (TargetError, TargetUnavailable) as exc:
            raise pytest.UsageError(str(exc).splitlines()[0]) from None

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

    def start_worker(self) -> None:
        """Start the isolated worker now, so that it loads the target while the session sets up."""
        if self.isolation == "process":
            self.executor.start()

    def close(self) -> None:
        if self._executor is not None:
            self._executor.close()

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
            raise pytest.UsageError(f"--shard expects I/N with 0 <= I < N (0-based), got {value!r}")
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

    def cases_by_id(self) -> dict:
        """Every case of this run's shard by id, op and end to end."""
        cases = {entry[0]: entry[1] for entry in self.entries()}
        cases.update((case.case_id, case) for case in self.e2e_cases())
        return cases

    def manifest(self, expected: list[str]) -> dict:
        """The run's manifest (``conformance.journal``), for the cases collected after ``-k``/``-m``."""
        if self.replay_entry is not None:
            whole_list = [self.replay_entry[0]]
        else:
            whole_list = [case_id for case_id, _ in profile_cases(self.profile, self.seed)]
            whole_list += [case.case_id for case in e2e_cases(self.profile)]
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
            raise pytest.UsageError(str(exc)) from None
        result = apply_expectations(result, self.expectations, self.today)
        if result.outcome in (Outcome.FAIL, Outcome.BROKEN, Outcome.KNOWN_FAILURE):
            result.repro = f"pytest 'conformance/test_e2e.py::test_e2e[{case.case_id}]' --target={self.target_name}"
        self.record(result)
        return result

    def repro_command(self, replay_path: Path) -> str:
        return f"pytest conformance --target={self.target_name} --replay {replay_path}"

    def run(self, entry) -> CaseResult:
        case_id, case, values = entry
        result = self.executor.run_op(case_id, case, values)  # values None: drawn where the case runs
        result = apply_expectations(result, self.expectations, self.today)
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
                self.add_shrunk_case(result)
        self.record(result)
        return result

    def add_shrunk_case(self, result: CaseResult) -> None:
        if result.kind in (FailureKind.CRASHED, FailureKind.TIMED_OUT):
            result.message += " (not shrunk: every candidate of a crash or hang would need a process of its own)"
            return
        try:
            smallest = self.executor.shrink(result, PROFILES[self.profile].limits)
        except Breakdown as exc:
            result.message += f" (shrinking stopped: {exc.message})"
            return
        if smallest is None:
            result.message += " (shrinking found no smaller case failing the same way)"
            return
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

    def record(self, result: CaseResult, *, label: bool = True) -> None:
        """Journal the result (the results schema, ``CaseResult.to_json``); label the running test for Allure."""
        record = {**result.to_json(), "worker": self.worker}
        if label:
            label_current_test(record, self.seed)
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
        return {**info, **device}

    def about(self) -> dict:
        return {
            "suite_version": SUITE_VERSION,
            "target": self.target_name,
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


_RUN_KEY = pytest.StashKey[ConformanceRun]()
_GATE_KEY = pytest.StashKey[dict]()  # the gate, computed at session finish, printed in the summary
_WORKERS_KEY = pytest.StashKey[list]()  # the controller's record of each worker's device
_MANIFEST_KEY = pytest.StashKey[dict]()  # the run's manifest, once the cases are collected


@pytest.hookimpl(tryfirst=True)  # before junitxml and allure-pytest read the paths set here
def pytest_configure(config: pytest.Config) -> None:
    torch.set_num_threads(config.option.torch_threads)
    config.addinivalue_line("markers", "kernel: a kernel-level op case (design level 1)")
    config.addinivalue_line("markers", "wrapper: a PunicaWrapper-level op case (design level 2)")
    config.addinivalue_line("markers", "e2e: an end-to-end generation case (design level 4, the model)")
    run = ConformanceRun(config)
    config.stash[_RUN_KEY] = run
    _default_artifact_paths(config, run)
    if run.controller:
        if run.resume_manifest is None:  # a new run starts from a clean slate; a resumed one keeps its journals
            journal.clear_journals(run.report_dir)
        else:
            config.stash[_MANIFEST_KEY] = run.resume_manifest
        config.stash[_WORKERS_KEY] = []
        config.pluginmanager.register(ControllerRecords(config), "lora-conformance-controller")
        if config.option.progress_every >= 0:
            config.pluginmanager.register(Progress(config, config.option.progress_every), "lora-conformance-progress")


def _default_artifact_paths(config: pytest.Config, run: ConformanceRun) -> None:
    """JUnit XML and Allure results go to the report dir unless the user named other places."""
    option = config.option
    if getattr(option, "xmlpath", "absent") is None:
        option.xmlpath = str(run.report_dir / "junit.xml")
    if getattr(option, "allure_report_dir", "absent") is None:
        option.allure_report_dir = str(run.report_dir / "allure-results")
        # results of an earlier run would mix into this one (workers never clean); a resumed run adds to its own
        if run.controller and run.resume_manifest is None:
            shutil.rmtree(option.allure_report_dir, ignore_errors=True)


def _runs_cases(config: pytest.Config) -> bool:
    """Whether this process runs cases: a serial run or an xdist worker, not an xdist controller."""
    return hasattr(config, "workerinput") or not getattr(config.option, "numprocesses", None)


def _write_manifest(config: pytest.Config, nodeids: list[str]) -> None:
    """The manifest of a new run, from the collected test ids (after ``-k``/``-m`` and ``--resume``)."""
    if _MANIFEST_KEY in config.stash:
        return
    run = config.stash[_RUN_KEY]
    expected = [case_id for case_id in map(journal.case_id_of, nodeids) if case_id is not None]
    config.stash[_MANIFEST_KEY] = manifest = run.manifest(expected)
    journal.write_manifest(run.report_dir, manifest)


class ControllerRecords:
    """In the controller (or a serial run): the manifest, each xdist worker's device, crashed workers' cases."""

    def __init__(self, config: pytest.Config) -> None:
        self.config = config

    @pytest.hookimpl(optionalhook=True)
    def pytest_xdist_node_collection_finished(self, node, ids) -> None:
        _write_manifest(self.config, ids)  # every worker collects the same ids: the first one's will do

    @pytest.hookimpl(optionalhook=True)
    def pytest_testnodedown(self, node, error) -> None:
        info = getattr(node, "workeroutput", {}).get("lora_conformance_worker")
        if info:
            self.config.stash[_WORKERS_KEY].append(info)

    @pytest.hookimpl(optionalhook=True)
    def pytest_handlecrashitem(self, crashitem, report, sched) -> None:
        """A pytest worker died while running a case (``--isolation=none``, or the harness itself): record it."""
        run = self.config.stash[_RUN_KEY]
        case_id = journal.case_id_of(crashitem)
        case = run.cases_by_id().get(case_id) if case_id else None
        if case is None:
            return
        worker = getattr(getattr(report, "node", None), "gateway", None)
        message = (
            f"the pytest worker {getattr(worker, 'id', '?')} died while running this case (xdist started another; "
            "it reports no signal: rerun with the default --isolation=process to see it)"
        )
        run.record(broken_result(case_id, case, FailureKind.CRASHED, message), label=False)


def pytest_collection_finish(session: pytest.Session) -> None:
    config = session.config
    run = config.stash[_RUN_KEY]
    if run.controller and not getattr(config.option, "numprocesses", None):
        _write_manifest(config, [item.nodeid for item in session.items])
    if session.items and _runs_cases(config) and not config.option.collectonly:
        run.start_worker()


def pytest_collection_modifyitems(session: pytest.Session, config: pytest.Config, items: list) -> None:
    """With ``--resume``: keep only the interrupted run's expected cases that have no result yet."""
    run = config.stash[_RUN_KEY]
    if run.resume_manifest is None:
        return
    wanted = set(run.resume_manifest["expected"]) - run.done_case_ids()
    keep = [item for item in items if journal.case_id_of(item.nodeid) in wanted]
    if len(keep) != len(items):
        config.hook.pytest_deselected(items=[item for item in items if item not in keep])
        items[:] = keep


def pytest_generate_tests(metafunc: pytest.Metafunc) -> None:
    if "conformance_case" in metafunc.fixturenames:
        run = metafunc.config.stash[_RUN_KEY]
        params = [
            pytest.param(entry, id=entry[0], marks=[getattr(pytest.mark, OP_SPECS[entry[1].op].level)])
            for entry in run.entries()
        ]
        metafunc.parametrize("conformance_case", params)
    if "e2e_case" in metafunc.fixturenames:
        run = metafunc.config.stash[_RUN_KEY]
        metafunc.parametrize("e2e_case", [pytest.param(c, id=c.case_id, marks=[pytest.mark.e2e]) for c in run.e2e_cases()])


@pytest.fixture(scope="session")
def conformance_run(request: pytest.FixtureRequest) -> ConformanceRun:
    return request.config.stash[_RUN_KEY]


def report_outcome(result: CaseResult) -> None:
    """Turn a result into the pytest outcome (see the module docstring).

    The failure kinds lead the message in brackets, so JUnit's failure message and Allure's categories
    (``conformance.report.allure_results``) carry them: ``fail [wrote outside its region, numerics]: …``.
    """
    repro = f"\nrepro: {result.repro}" if result.repro else ""
    kind = f" [{', '.join(k.value for k in result.kinds)}]" if result.kinds else ""
    if result.outcome is Outcome.PASS:
        return
    if result.outcome is Outcome.NOT_SUPPORTED:
        pytest.skip(f"not supported: {result.message}")
    if result.outcome is Outcome.KNOWN_FAILURE:
        entry = result.expectation or {}
        pytest.xfail(f"known failure {entry.get('id')}{kind}: {entry.get('reason')} ({', '.join(entry.get('upstream', []))}){repro}")
    if result.outcome is Outcome.BROKEN:
        raise TargetBroken(f"broken{kind}: {result.message}{repro}")
    pytest.fail(f"{result.outcome.value}{kind}: {result.message}{repro}", pytrace=False)


@pytest.hookimpl(tryfirst=True)  # before junitxml writes its file: the fingerprint goes into it
def pytest_sessionfinish(session: pytest.Session, exitstatus: int) -> None:
    config = session.config
    run = config.stash[_RUN_KEY]
    if hasattr(config, "workerinput"):
        config.workeroutput["lora_conformance_worker"] = run.worker_info()
        run.close()
        return
    workers = sorted(config.stash[_WORKERS_KEY], key=lambda w: w["worker"]) or [run.worker_info()]
    run.close()
    if _MANIFEST_KEY not in config.stash:  # collection never finished: nothing was expected, nothing ran
        _write_manifest(config, [])
    if run.resume_manifest is not None and exitstatus == pytest.ExitCode.NO_TESTS_COLLECTED:
        exitstatus = pytest.ExitCode.OK  # every case of the interrupted run already had its result
        session.exitstatus = exitstatus
    results = journal.read_journals(run.report_dir)
    document = journal.build_document(config.stash[_MANIFEST_KEY], results, workers=workers, pytest_exitstatus=exitstatus)
    environment = document["environment"] = environment_fingerprint(environ=os.environ)
    devices = list(dict.fromkeys((w.get("device"), w.get("driver")) for w in workers))
    environment["device"] = "; ".join(str(name) for name, _ in devices)
    environment["driver"] = "; ".join(dict.fromkeys(str(driver) for _, driver in devices))
    _record_fingerprint(config, environment)
    (run.report_dir / "results.json").write_text(json.dumps(document, indent=1) + "\n")
    write_html_report(document, run.report_dir / "report.html")
    gate = config.stash[_GATE_KEY] = document["gate"]
    if not gate["passed"] and session.exitstatus == 0:
        session.exitstatus = pytest.ExitCode.TESTS_FAILED


def pytest_terminal_summary(terminalreporter, exitstatus: int, config: pytest.Config) -> None:
    if hasattr(config, "workerinput") or _GATE_KEY not in config.stash:
        return
    run, gate = config.stash[_RUN_KEY], config.stash[_GATE_KEY]
    write = terminalreporter.write_line
    terminalreporter.section("LoRA conformance verdict")
    write(f"target {run.target_name}, profile {run.about()['profile']}, seed {run.seed}")
    write(f"verdict: {'PASS' if gate['passed'] else 'FAIL'} ({gate['rule']})")
    for reason in gate["reasons"]:
        write(f"  - {reason}")
    write("outcomes: " + ", ".join(f"{count} {name}" for name, count in gate["counts"].items()))
    for entry in gate["known_failures"]:
        write(f"known failure {entry['id']} ({entry['cases']} cases, expires {entry['expires']}): {', '.join(entry['upstream'])}")
    for entry in run.expectations_not_applicable:
        write(f"known failure {entry['id']} not applicable here: {entry['not_applicable']}")
    if gate["counts"].get("no result"):
        write(f"to run the cases without a result: pytest conformance --resume {run.report_dir}")
    write(f"results: {run.report_dir / 'results.json'}")
    write(f"report: {run.report_dir / 'report.html'}")
    if config.option.xmlpath:
        write(f"junit: {config.option.xmlpath}")
    if getattr(config.option, "allure_report_dir", None):
        write(f"allure results: {config.option.allure_report_dir} (HTML: python -m conformance.report allure {run.report_dir})")


def _record_fingerprint(config: pytest.Config, environment: dict) -> None:
    """The fingerprint as JUnit test-suite properties and Allure's environment.properties.

    ``record_testsuite_property`` is a fixture that does nothing in xdist workers, so the controller
    adds the properties to the JUnit writer itself (junitxml's stash key: pytest has no public one).
    """
    from _pytest.junitxml import xml_key

    xml = config.stash.get(xml_key, None)
    if xml is not None:
        for name, value in environment.items():
            xml.add_global_property(name, value)
    if getattr(config.option, "allure_report_dir", None):
        write_results_extras(config.option.allure_report_dir, environment)
