"""The pytest front end: ``pytest conformance --target=NAME``.

It turns the profile's cases into tests (ids like ``add_lora_linear-bf16-slices3-r16-neg1``, and the
end-to-end cases of ``conformance.e2e`` like ``greedy_generation-mixed-bf16``, marker ``e2e``), runs each
through ``conformance.runner``, applies the target's expectations, writes a replay for every failing
case, records every result, and at the end applies the gate: the exit code is the verdict.

Outcome → pytest: pass → passed; fail and unexpected pass → failed; broken → error raised by the
target (failed, "broken" in Allure); not supported → skipped with the reason; known failure → xfail.

Under xdist every worker draws the same cases from the same seed, runs its share and appends its
results to ``<report-dir>/results/<worker>.jsonl``; the controller merges them into ``results.json``
and renders ``report.html`` (``conformance.report``). Across machines, ``--shard I/N`` (0-based) keeps
the cases whose index in the profile's list is I modulo N; ``python -m conformance.report merge`` joins
the shards' ``results.json`` files and gates them again.

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
from conformance.cases.replay import read_replay, write_replay
from conformance.devices import assign_device
from conformance.e2e.cases import e2e_cases
from conformance.e2e.run import E2EResult, E2ERunner
from conformance.expectations import apply_expectations, load_expectations, shipped_expectations
from conformance.gate import gate_verdict, summarize
from conformance.generator import DEFAULT_PROFILE, PROFILES, profile_cases
from conformance.ops import OP_SPECS
from conformance.report import write_html_report
from conformance.report.allure_results import label_current_test, write_results_extras
from conformance.report.fingerprint import device_description, environment_fingerprint
from conformance.report.progress import Progress
from conformance.runner import CaseResult, check_values, make_values, run_case
from conformance.targets import TargetError, TargetUnavailable, known_targets, load
from conformance.verdict import Outcome

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
    group.addoption("--profile", choices=sorted(PROFILES), default=DEFAULT_PROFILE, help="case set (default: %(default)s)")
    group.addoption("--seed", type=int, default=0, help="run seed: another seed draws other cases (default: 0)")
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
        self.worker = config.workerinput["workerid"] if hasattr(config, "workerinput") else "main"
        self.device_assignment = assign_device(config, self.target_name)  # before the runtime loads
        try:
            self.target = load(self.target_name)
        except (TargetError, TargetUnavailable) as exc:
            raise pytest.UsageError(str(exc).splitlines()[0]) from None
        self.profile = option.profile
        self.shrink = option.shrink
        self.seed = option.seed
        self.shard = self._shard(option.shard)
        self.report_dir = Path(option.report_dir or Path("reports") / self.target_name.replace(":", "_").replace("/", "_"))
        self.expectations_path = self._expectations_path(option.expectations)
        try:
            self.expectations = load_expectations(self.expectations_path) if self.expectations_path else ()
        except ValueError as exc:
            raise pytest.UsageError(str(exc)) from None
        self.today = dt.date.today()
        self._e2e_runner = None  # conformance.e2e.run.E2ERunner, built by the first end-to-end case
        self.results_path = self.report_dir / "results" / f"{self.worker}.jsonl"

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

    def entries(self):
        """``(case_id, case, values or None)`` for every case of this run (of its shard, if any)."""
        if self.replay_entry is not None:
            return [CaseEntry(self.replay_entry)]
        cases = profile_cases(self.profile, self.seed)
        if self.shard:
            index, count = self.shard
            cases = [entry for position, entry in enumerate(cases) if position % count == index]
        return [CaseEntry((case_id, case, None)) for case_id, case in cases]

    def e2e_cases(self) -> list:
        """The profile's end-to-end cases (of this shard); none when replaying an op case."""
        if self.replay_entry is not None:
            return []
        cases = e2e_cases(self.profile)
        if self.shard:
            index, count = self.shard
            cases = [case for position, case in enumerate(cases) if position % count == index]
        return cases

    def run_e2e(self, case) -> E2EResult:
        if self._e2e_runner is None:  # loaded on first use: op-only runs never read the fixtures
            try:
                self._e2e_runner = E2ERunner(self.target)
            except (FileNotFoundError, ValueError, ImportError) as exc:
                raise pytest.UsageError(str(exc)) from None
        result = apply_expectations(self._e2e_runner.run(case), self.expectations, self.today)
        if result.outcome in (Outcome.FAIL, Outcome.BROKEN, Outcome.KNOWN_FAILURE):
            result.repro = f"pytest 'conformance/test_e2e.py::test_e2e[{case.case_id}]' --target={self.target_name}"
        self.record(result)
        return result

    def repro_command(self, replay_path: Path) -> str:
        return f"pytest conformance --target={self.target_name} --replay {replay_path}"

    def run(self, entry) -> CaseResult:
        case_id, case, values = entry
        values = make_values(case) if values is None else values  # once: the run and a replay share them
        result = run_case(self.target, case, case_id, values)
        result = apply_expectations(result, self.expectations, self.today)
        if result.outcome in (Outcome.FAIL, Outcome.BROKEN, Outcome.KNOWN_FAILURE):
            path = write_replay(
                self.report_dir / "replays",
                case_id,
                case,
                values,
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
        # Hypothesis loads only here: a run never needs it otherwise once its profile's cases are in
        # the disk cache, and its import costs seconds per process (conformance.generator.cache).
        # Drawing sets every setting it depends on; shrinking runs under the suite's profile.
        from conformance import hypothesis_profile
        from conformance.shrinking import shrink_failure

        hypothesis_profile.load()
        smallest = shrink_failure(self.target, result, PROFILES[self.profile].limits)
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

    def record(self, result: CaseResult) -> None:
        """Append the result (any object with ``to_json()`` in the results schema) and label the test for Allure."""
        record = {**result.to_json(), "worker": self.worker}
        label_current_test(record, self.seed)
        self.results_path.parent.mkdir(parents=True, exist_ok=True)
        with self.results_path.open("a") as stream:
            stream.write(json.dumps(record) + "\n")

    def worker_info(self) -> dict:
        """Which device this process ran its cases on (its name is read after the cases ran)."""
        info = {"worker": self.worker, "pid": os.getpid()}
        if self.device_assignment:
            info[self.device_assignment["variable"]] = self.device_assignment["device"]
        return {**info, **device_description(self.target.device.type)}

    def about(self) -> dict:
        return {
            "suite_version": SUITE_VERSION,
            "target": self.target_name,
            "profile": self.profile if not self.replay else "replay",
            "seed": self.seed,
            "shard": f"{self.shard[0]}/{self.shard[1]}" if self.shard else None,
            "replay": self.replay,
            "expectations": str(self.expectations_path) if self.expectations_path else None,
            "python": sys.version.split()[0],
        }


_RUN_KEY = pytest.StashKey[ConformanceRun]()
_GATE_KEY = pytest.StashKey[dict]()  # the gate, computed at session finish, printed in the summary
_WORKERS_KEY = pytest.StashKey[list]()  # the controller's record of each worker's device


@pytest.hookimpl(tryfirst=True)  # before junitxml and allure-pytest read the paths set here
def pytest_configure(config: pytest.Config) -> None:
    torch.set_num_threads(config.option.torch_threads)
    config.addinivalue_line("markers", "kernel: a kernel-level op case (design level 1)")
    config.addinivalue_line("markers", "wrapper: a PunicaWrapper-level op case (design level 2)")
    config.addinivalue_line("markers", "e2e: an end-to-end generation case (design level 4, the model)")
    controller = not hasattr(config, "workerinput")
    run = ConformanceRun(config)
    config.stash[_RUN_KEY] = run
    _default_artifact_paths(config, run, controller)
    if controller:  # the controller (or a serial run) starts from a clean slate
        results_dir = run.results_path.parent
        if results_dir.is_dir():
            for stale in results_dir.glob("*.jsonl"):
                stale.unlink()
        config.stash[_WORKERS_KEY] = []
        config.pluginmanager.register(WorkerCollector(config), "lora-conformance-workers")
        if config.option.progress_every >= 0:
            config.pluginmanager.register(Progress(config, config.option.progress_every), "lora-conformance-progress")


def _default_artifact_paths(config: pytest.Config, run: ConformanceRun, controller: bool) -> None:
    """JUnit XML and Allure results go to the report dir unless the user named other places."""
    option = config.option
    if getattr(option, "xmlpath", "absent") is None:
        option.xmlpath = str(run.report_dir / "junit.xml")
    if getattr(option, "allure_report_dir", "absent") is None:
        option.allure_report_dir = str(run.report_dir / "allure-results")
        if controller:  # results of an earlier run would mix into this one (workers never clean)
            shutil.rmtree(option.allure_report_dir, ignore_errors=True)


class WorkerCollector:
    """In the controller: each xdist worker's device record, sent back in its ``workeroutput``."""

    def __init__(self, config: pytest.Config) -> None:
        self.config = config

    @pytest.hookimpl(optionalhook=True)
    def pytest_testnodedown(self, node, error) -> None:
        info = getattr(node, "workeroutput", {}).get("lora_conformance_worker")
        if info:
            self.config.stash[_WORKERS_KEY].append(info)


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
    """Turn a result into the pytest outcome (see the module docstring)."""
    repro = f"\nrepro: {result.repro}" if result.repro else ""
    if result.outcome is Outcome.PASS:
        return
    if result.outcome is Outcome.NOT_SUPPORTED:
        pytest.skip(f"not supported: {result.message}")
    if result.outcome is Outcome.KNOWN_FAILURE:
        entry = result.expectation or {}
        pytest.xfail(f"known failure {entry.get('id')}: {entry.get('reason')} ({', '.join(entry.get('upstream', []))}){repro}")
    if result.outcome is Outcome.BROKEN:
        raise TargetBroken(f"{result.message}{repro}")
    pytest.fail(f"{result.outcome.value}: {result.message}{repro}", pytrace=False)


@pytest.hookimpl(tryfirst=True)  # before junitxml writes its file: the fingerprint goes into it
def pytest_sessionfinish(session: pytest.Session, exitstatus: int) -> None:
    config = session.config
    run = config.stash[_RUN_KEY]
    if hasattr(config, "workerinput"):
        config.workeroutput["lora_conformance_worker"] = run.worker_info()
        return
    workers = sorted(config.stash[_WORKERS_KEY], key=lambda w: w["worker"]) or [run.worker_info()]
    results = []
    for path in sorted((run.report_dir / "results").glob("*.jsonl")):
        results.extend(json.loads(line) for line in path.read_text().splitlines() if line.strip())
    results.sort(key=lambda r: r["id"])
    gate = gate_verdict(results, exitstatus)
    environment = environment_fingerprint(environ=os.environ)
    devices = list(dict.fromkeys((w.get("device"), w.get("driver")) for w in workers))
    environment["device"] = "; ".join(str(name) for name, _ in devices)
    environment["driver"] = "; ".join(dict.fromkeys(str(driver) for _, driver in devices))
    document = {**run.about(), "environment": environment, "workers": workers}
    document.update(gate=gate, summary=summarize(results), results=results)
    _record_fingerprint(config, environment)
    run.report_dir.mkdir(parents=True, exist_ok=True)
    (run.report_dir / "results.json").write_text(json.dumps(document, indent=1) + "\n")
    write_html_report(document, run.report_dir / "report.html")
    config.stash[_GATE_KEY] = gate
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
