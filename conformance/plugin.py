"""The pytest front end: ``pytest conformance --target=NAME``.

It turns the profile's cases into tests (ids like ``add_lora_linear-bf16-slices3-r16-neg1``, and the
end-to-end cases of ``conformance.e2e`` like ``greedy_generation-mixed-bf16``, marker ``e2e``), runs each
through ``conformance.runner``, applies the target's expectations, writes a replay for every failing
case, records every result, and at the end applies the gate: the exit code is the verdict.

Outcome → pytest: pass → passed; fail and unexpected pass → failed; broken → error raised by the
target (failed, "broken" in Allure); not supported → skipped with the reason; known failure → xfail.
The failure kinds lead the message (``fail [numerics]: …``), in JUnit and Allure alike; once the run's
failures are clustered (``conformance.report.clusters``), each names its cluster after them
(``fail [numerics] cluster 1/2 "…": …``) in junit.xml and allure-results, and Allure's categories are
the clusters.

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
cases whose index in the profile's list is I modulo N; ``--shard=auto`` reads I and N from the CI system
or cluster that split the job (``conformance.sharding``), prints which it found, and records it in the
manifest (``shard_source``); ``python -m conformance.report merge`` joins the shards' ``results.json``
files, checks they add up to the profile's case list, and gates them again.

Artifacts of every run, in the report dir: ``results.json`` (with the environment fingerprint and
which device each worker used), ``report.html``, ``junit.xml`` (unless ``--junitxml`` names another;
the fingerprint as test-suite properties), ``allure-results/`` (unless ``--alluredir`` names another;
labels and categories from ``conformance.report.allure_results``) and ``replays/``. ``--devices``
gives each xdist worker its own device (``conformance.devices``); the controller prints progress
lines (``conformance.report.progress``).
"""

from __future__ import annotations

import dataclasses
from pathlib import Path

import pytest
import torch

import conformance
from conformance import journal, sharding
from conformance.devices import assign_device
from conformance.generator import DEFAULT_PROFILE, PROFILES
from conformance.isolation import ISOLATION_MODES
from conformance.levels import KINDS, kind_of
from conformance.optional import skipped_lines
from conformance.record import CaseResult
from conformance.report.allure_results import write_allure_results
from conformance.report.junit import write_junit
from conformance.report.progress import Progress
from conformance.report.target_output import terminal_line as target_output_line
from conformance.session import ConformanceRun, RunError, RunSettings
from conformance.target_call import DEFAULT_RUNS
from conformance.targets import TargetError, TargetUnavailable
from conformance.targets.facts import TargetFacts, probe
from conformance.verdict import FailureKind, Outcome

# The hooks and fixtures pytest finds by name: conformance/conftest.py imports exactly these where the
# entry point does not load the plugin (a test checks that every hook is listed).
__all__ = [
    "conformance_run", "pytest_addoption", "pytest_collection_finish", "pytest_collection_modifyitems", "pytest_configure",
    "pytest_generate_tests", "pytest_report_header", "pytest_sessionfinish", "pytest_terminal_summary",
]  # fmt: skip


class TargetBroken(Exception):
    """The target raised while running a case (the *broken* outcome, distinct from a numeric failure)."""


def pytest_addoption(parser: pytest.Parser) -> None:
    group = parser.getgroup("lora-conformance", "LoRA conformance suite")
    group.addoption(
        "--target",
        help="target to judge: a built-in name, a name a vendor's package registers (entry point group "
        "lora_conformance.targets), or package.module:Class; `lora-conformance targets` lists those that can run here",
    )
    group.addoption("--profile", choices=sorted(PROFILES), help=f"how many cases, the case set (default: {DEFAULT_PROFILE})")
    group.addoption("--seed", type=int, help="run seed: another seed draws other cases (default: 0)")
    group.addoption(
        "--cases",
        action="append",
        metavar="QUERY",
        help="run only the cases whose id a query matches (repeatable: any of them): a level (op, layer, model), "
        "level:name, or level:name:key=value;…;* with * globs, e.g. 'op:lora_*:dtype=bf16;*' (docs/cases.md)",
    )
    group.addoption(
        "--caselist",
        metavar="NAME|PATH",
        help="run exactly the cases of a frozen case list (a shipped one: smoke, standard, release; or a .jsonl path) "
        "instead of drawing the profile: the same cases and inputs under any Hypothesis version (docs/certification.md)",
    )
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
        metavar="I/N|auto",
        help="run only shard I of N (0-based, 0 <= I < N): the cases whose index in the profile's list "
        "is I modulo N; the same on every machine, merge with `python -m conformance.report merge`. auto: I "
        "and N from the job's CI variables (GitLab CI parallel, Buildkite and CircleCI parallelism, Kubernetes "
        f"Indexed Jobs with {sharding.K8S_COMPLETIONS} set to the Job's completions; docs/scale-out.md)",
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
        "--repeat",
        type=int,
        metavar="N",
        help=f"call the target N times per case, each on fresh copies of its inputs (a wrapper after one "
        f"update_metadata, as vLLM calls it once per layer), and compare the calls bit for bit; a failing case is "
        f"attempted once more to tell a consistent failure from a flaky one (default {DEFAULT_RUNS}; docs/referee.md)",
    )
    group.addoption(
        "--require-deterministic",
        action="store_true",
        help="a case whose repeated calls differ bit for bit fails (kind nondeterministic) instead of passing "
        "with the label nondeterministic",
    )
    group.addoption(
        "--resume",
        metavar="DIR",
        help="complete the interrupted run whose report dir is DIR: run only its cases without a result, "
        "with its target, profile, seed, shard and selection (another -k, -m or node ids are refused), and write "
        "the whole report again",
    )
    group.addoption(
        "--progress-every",
        type=float,
        default=30.0,
        metavar="SECONDS",
        help="print a [progress] line this often, and at the end (0: after every case, negative: never; "
        "default %(default)s)",
    )


_RUN_KEY = pytest.StashKey[ConformanceRun]()
_GATE_KEY = pytest.StashKey[dict]()  # the gate, computed at session finish, printed in the summary
_WORKERS_KEY = pytest.StashKey[list]()  # the controller's record of each worker's device
_MANIFEST_KEY = pytest.StashKey[dict]()  # the run's manifest, once the cases are collected
_DOCUMENT_KEY = pytest.StashKey[dict]()  # the results document, for the summary's lines once it is written
_SHARD_SOURCE_KEY = pytest.StashKey[tuple]()  # (where the shard came from, for the manifest; the line to print)
_JUNIT_KEY = pytest.StashKey[Path]()  # where junit.xml is written from the results document
_ALLURE_KEY = pytest.StashKey[Path]()  # where the Allure results are written from the results document
_FACTS_INPUT = "lora_conformance_target_facts"  # the controller's TargetFacts, handed to each xdist worker


def conformance_requested(config: pytest.Config) -> bool:
    """Whether this pytest run is a conformance run: a conformance option given, or the suite's own tests
    collected (``pytest conformance``, ``pytest --pyargs conformance``, a node id inside the package).

    The plugin is installed for every pytest run of the environment (entry point ``pytest11``); in any
    other run (a project's own tests) it does nothing but add its options.
    """
    option = config.option
    if option.target or option.replay or option.resume:
        return True
    package = Path(conformance.__file__).resolve().parent
    for arg in config.args:
        name = str(arg).split("::")[0]
        if getattr(option, "pyargs", False) and (name == "conformance" or name.startswith("conformance.")):
            return True
        path = (config.invocation_params.dir / name).resolve()
        if path == package or package in path.parents:
            return True
    return False


def _target_before_the_run(settings: RunSettings) -> str | None:
    """The target name ``--devices`` needs before the run loads anything (a resumed run's own)."""
    if settings.target or not settings.resume:
        return settings.target
    try:
        return journal.read_manifest(Path(settings.resume))["target"]
    except ValueError:
        return None  # ConformanceRun says what is wrong with the directory


def _run_of(config: pytest.Config) -> ConformanceRun | None:
    return config.stash.get(_RUN_KEY, None)


@pytest.hookimpl(tryfirst=True)  # before junitxml and allure-pytest read the paths set here
def pytest_configure(config: pytest.Config) -> None:
    if not conformance_requested(config):
        return
    torch.set_num_threads(config.option.torch_threads)
    if not _logs_asked_for(config):
        # pytest's log capture attaches a handler to every non-propagating logger (torch and vLLM make
        # dozens) in each phase of each case: ~1.3 ms a case, a tenth of the referee's share. No verdict
        # reads a log record; what the target logs goes to its process's output, captured with it.
        config.pluginmanager.set_blocked("logging-plugin")
    for kind in KINDS:
        for marker, meaning in kind.markers.items():
            config.addinivalue_line("markers", f"{marker}: {meaning}")
    option = config.option
    try:
        config.stash[_SHARD_SOURCE_KEY] = _settle_shard(option)
    except sharding.ShardDetectionError as exc:
        raise pytest.UsageError(str(exc)) from None
    settings = RunSettings(**{field.name: getattr(option, field.name) for field in dataclasses.fields(RunSettings)})
    # from xdist's own record, not PYTEST_XDIST_WORKER: a run started from inside an xdist worker
    # (the suite's own tests) inherits that variable in its controller
    worker = config.workerinput["workerid"] if hasattr(config, "workerinput") else "main"
    try:
        facts = _target_facts(config, _target_before_the_run(settings))
        assignment = assign_device(config, facts) if facts else None  # before any runtime loads
        run = ConformanceRun(
            settings, worker=worker, runs_cases=_runs_cases(config), device_assignment=assignment, facts=facts, selection=_selection(config)
        )
        if settings.cases:
            run.cases_by_id()  # a --cases query that selects nothing is a usage error before collection
    except (RunError, ValueError) as exc:
        raise pytest.UsageError(str(exc)) from None
    for name in ("target", "profile", "seed", "shard", "report_dir", "expectations"):  # as the run settled them
        setattr(option, name, getattr(settings, name))
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
            progress = Progress(config, config.option.progress_every, plan=run.support_plan, workers=_case_processes(config))
            config.pluginmanager.register(progress, "lora-conformance-progress")


def _logs_asked_for(config: pytest.Config) -> bool:
    """Whether the command line or the ini file asks pytest to show, store or level its logs."""
    option = config.option
    asked = (getattr(option, name, None) for name in ("log_level", "log_file", "log_cli_level", "log_format"))
    return any(asked) or bool(config.getini("log_cli")) or bool(config.getini("log_file"))


def _target_facts(config: pytest.Config, target_name: str | None) -> TargetFacts | None:
    """The target's facts: an xdist worker's from its controller, else read by a process that imports the
    target (``conformance.targets.facts``: the pytest process never does); None without a target name yet,
    and None for a serial run that needs none before its session starts (no ``--devices`` to set first):
    the session reads them from its worker (``conformance.isolation.process.IsolatedExecutor.facts``)."""
    handed = getattr(config, "workerinput", {}).get(_FACTS_INPUT)
    if handed:
        return TargetFacts.from_json(handed)
    if not target_name:
        return None
    if _runs_cases(config) and config.option.isolation == "process" and config.option.devices is None:
        return None  # a serial run's session reads them from the worker that runs its cases: one import of the target, not two
    try:
        return probe(target_name)
    except (TargetError, TargetUnavailable) as exc:
        raise RunError(str(exc).splitlines()[0]) from None


def _selection(config: pytest.Config) -> dict:
    """``-k``, ``-m`` and the node-id arguments as given: the manifest records them (``expected`` lists
    what they selected), and ``--resume`` refuses others, which would leave expected cases without a result."""
    node_ids = [str(arg) for arg in config.args if "::" in str(arg)]
    return {"keyword": config.option.keyword, "markexpr": config.option.markexpr, "node_ids": node_ids, "cases": config.option.cases or []}


def _settle_shard(option) -> tuple[dict | None, str | None]:
    """Turn ``--shard=auto`` into the I/N the CI variables name (before the run reads the option).

    Returns the manifest's ``shard_source`` and, for ``auto``, the line saying what was found. A
    resumed run keeps its own manifest, so its ``shard_source`` stays the interrupted run's.
    """
    if option.shard != sharding.AUTO:
        return ({"given": f"--shard={option.shard}"} if option.shard else None), None
    source = sharding.shard_from_environment()
    option.shard = source.shard
    return source.record(), source.announcement()


def _default_artifact_paths(config: pytest.Config, run: ConformanceRun) -> None:
    """JUnit XML and Allure results go to the report dir unless the user named other places.

    junit.xml is written from the results document at the end (``conformance.report.junit``), to
    ``--junitxml`` if given: pytest's own writer is turned off (this hook runs before junitxml's)."""
    option = config.option
    config.stash[_JUNIT_KEY] = Path(getattr(option, "xmlpath", None) or run.report_dir / "junit.xml")
    option.xmlpath = None
    # Allure's results are written from the document at the end (conformance.report.allure_results); allure-pytest's
    # own per-test listener, which --alluredir would start, stays off
    config.stash[_ALLURE_KEY] = Path(getattr(option, "allure_report_dir", None) or run.report_dir / "allure-results")
    if hasattr(option, "allure_report_dir"):
        option.allure_report_dir = None


def _case_processes(config: pytest.Config) -> int:
    """How many processes run cases at once: xdist's workers (``-n``, a number by now), else this one."""
    workers = getattr(config.option, "numprocesses", None)
    return workers if isinstance(workers, int) and workers > 0 else 1


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
    manifest["shard_source"] = config.stash[_SHARD_SOURCE_KEY][0]  # copied into results.json with the rest
    journal.write_manifest(run.report_dir, manifest)


class ControllerRecords:
    """In the controller (or a serial run): the manifest, each xdist worker's device, crashed workers' cases."""

    def __init__(self, config: pytest.Config) -> None:
        self.config = config

    @pytest.hookimpl(optionalhook=True)
    def pytest_configure_node(self, node) -> None:
        """Each xdist worker gets the target's facts read once here, instead of starting a process to read them."""
        node.workerinput[_FACTS_INPUT] = self.config.stash[_RUN_KEY].facts.to_json()

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
        run.record(run.broken(case_id, case, FailureKind.CRASHED, message))


def pytest_collection_finish(session: pytest.Session) -> None:
    config = session.config
    run = _run_of(config)
    if run is None:
        return
    if run.controller and not getattr(config.option, "numprocesses", None):
        _write_manifest(config, [item.nodeid for item in session.items])
    if session.items and _runs_cases(config) and not config.option.collectonly:
        run.start_worker([journal.case_id_of(item.nodeid) for item in session.items])  # only if one of them needs it


def pytest_collection_modifyitems(session: pytest.Session, config: pytest.Config, items: list) -> None:
    """Drop what is no case of this run: the placeholder item pytest makes of an empty parametrization
    (``test_case[NOTSET]``), which would be an expected case without a result.
    With ``--resume``: keep only the interrupted run's expected cases that have no result yet."""
    run = _run_of(config)
    if run is None:
        return
    known = set(run.cases_by_id())
    placeholders = [item for item in items if (case_id := journal.case_id_of(item.nodeid)) is not None and case_id not in known]
    if placeholders:
        items[:] = [item for item in items if item not in placeholders]  # not "deselected": nothing was selected
    if run.resume_manifest is None:
        return
    wanted = set(run.resume_manifest["expected"]) - run.done_case_ids()
    keep = [item for item in items if journal.case_id_of(item.nodeid) in wanted]
    if len(keep) != len(items):
        config.hook.pytest_deselected(items=[item for item in items if item not in keep])
        items[:] = keep


def pytest_generate_tests(metafunc: pytest.Metafunc) -> None:
    """One test per case of every level (``conformance.levels``), marked by its kind."""
    if "conformance_case" in metafunc.fixturenames:
        run = metafunc.config.stash[_RUN_KEY]
        params = [
            pytest.param(entry, id=entry[0], marks=[getattr(pytest.mark, name) for name in kind_of(entry[1], run.kinds).marks(entry[1])])
            for entry in run.entries()
        ]
        metafunc.parametrize("conformance_case", params)


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
    if result.stability in ("flaky", "nondeterministic"):
        kind += f" ({result.stability})"
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


@pytest.hookimpl(tryfirst=True)  # before the other plugins' session finish (allure-pytest's, the terminal's)
def pytest_sessionfinish(session: pytest.Session, exitstatus: int) -> None:
    config = session.config
    run = _run_of(config)
    if run is None:
        return
    if hasattr(config, "workerinput"):
        run.close()  # first: a worker's leftover processes are found when it ends
        config.workeroutput["lora_conformance_worker"] = run.worker_info()
        return
    workers = sorted(config.stash[_WORKERS_KEY], key=lambda w: w["worker"])  # none serially: the run reports itself
    run.close()
    if _MANIFEST_KEY not in config.stash:  # collection never finished: nothing was expected, nothing ran
        _write_manifest(config, [])
    if run.resume_manifest is not None and exitstatus == pytest.ExitCode.NO_TESTS_COLLECTED:
        exitstatus = pytest.ExitCode.OK  # every case of the interrupted run already had its result
        session.exitstatus = exitstatus
    document = run.build_document(config.stash[_MANIFEST_KEY], workers=workers, pytest_exitstatus=exitstatus)
    run.write_document(document)
    write_junit(document, config.stash[_JUNIT_KEY])
    write_allure_results(document, config.stash[_ALLURE_KEY])
    config.stash[_DOCUMENT_KEY] = document
    gate = config.stash[_GATE_KEY] = document["gate"]
    if not gate["passed"] and session.exitstatus == 0:
        session.exitstatus = pytest.ExitCode.TESTS_FAILED


def pytest_report_header(config: pytest.Config) -> list[str]:
    """At the top of the run: what ``--shard=auto`` found (the verdict section repeats it, for ``-q``)."""
    announcement = config.stash.get(_SHARD_SOURCE_KEY, (None, None))[1] if _run_of(config) else None
    return [announcement] if announcement else []


def pytest_terminal_summary(terminalreporter, exitstatus: int, config: pytest.Config) -> None:
    if hasattr(config, "workerinput") or _GATE_KEY not in config.stash or _run_of(config) is None:
        return
    run, gate = config.stash[_RUN_KEY], config.stash[_GATE_KEY]
    write = terminalreporter.write_line
    terminalreporter.section("LoRA conformance verdict")
    write(f"target {run.facts.name}, profile {run.about()['profile']}, seed {run.seed}")  # its short name: the repros reload it
    announcement = config.stash[_SHARD_SOURCE_KEY][1]
    if announcement:
        write(announcement)
    write(f"verdict: {'PASS' if gate['passed'] else 'FAIL'} ({gate['rule']})")
    for reason in gate["reasons"]:
        write(f"  - {reason}")
    write("outcomes: " + ", ".join(f"{count} {name}" for name, count in gate["counts"].items()))
    stability = gate.get("stability") or {}
    write(f"determinism: {run.repeat} call(s) per case compared bit for bit; {stability.get('nondeterministic', 0)} "
          f"nondeterministic, {stability.get('flaky', 0)} flaky" + (" (required deterministic)" if run.require_deterministic else ""))
    write(f"referee: {run.about()['referee']}")
    document = config.stash.get(_DOCUMENT_KEY, {})
    for line in skipped_lines(document.get("environment") or {}):  # one per optional part missing here
        write(line)
    said = target_output_line(document, run.report_dir) if document else None  # one line; the lines themselves are in the report
    if said:
        write(said)
    for worker in document.get("workers") or []:
        if worker.get("leftover_processes"):
            left = worker["leftover_processes"]
            write(f"worker {worker.get('worker')}: the target left {len(left)} process(es) running, killed with its worker: {', '.join(left[:5])}")
    for entry in gate["known_failures"]:
        write(f"known failure {entry['id']} ({entry['cases']} cases, expires {entry['expires']}): {', '.join(entry['upstream'])}")
    for entry in run.expectations_not_applicable:
        write(f"known failure {entry['id']} not applicable here: {entry['not_applicable']}")
    if gate["counts"].get("no result"):
        write(f"to run the cases without a result: pytest conformance --resume {run.report_dir}")
    write(f"results: {run.report_dir / 'results.json'}")
    write(f"report: {run.report_dir / 'report.html'}")
    write(f"junit: {config.stash[_JUNIT_KEY]}")
    write(f"allure results: {config.stash[_ALLURE_KEY]} (HTML: python -m conformance.report allure {run.report_dir})")
